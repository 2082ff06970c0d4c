//! The commands of the `cascade` binary: generate, serve, ngram, and bench (with plan and
//! calibrate); shared helpers here.

pub mod bench;
pub mod generate;
pub mod ngram;
pub mod serve;

use anyhow::Result;
use cascade::config::{Plan, RawConfig};
use cascade::model::ModelStore;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Validates the config at `path` (relative paths from its folder); an error names the file,
/// since bench and calibrate take several.
pub fn load_plan(path: &Path, raw: &RawConfig) -> Result<Plan> {
    let base = path.parent().map(PathBuf::from).unwrap_or_default();
    // Validating resolves hub models, which may download them.
    let _downloading = PipeSignalIgnored::new();
    raw.validate(&base)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Warns when the draft length (`k`: `-k`, or `target.k`) is more than the plan's drafter
/// drafts in a round whatever it is asked (a horizontal schedule).
pub fn warn_unused_k(path: &Path, plan: &Plan, k: &str) {
    let drafter = plan.drafter.as_ref();
    let most = drafter.and_then(|d| Some((d, d.most_per_round()?)));
    if let Some((drafter, most)) = most.filter(|&(_, most)| plan.options.k > most) {
        eprintln!(
            "cascade: warning: {}: {k} = {} is more than `{}` drafts in a round ({most}, its \
             schedule): a K above {most} changes nothing",
            path.display(),
            plan.options.k,
            drafter.name
        );
    }
}

/// While alive, SIGPIPE is ignored, as Rust starts a program: a download's TLS socket
/// (written with `writev`, which has no `MSG_NOSIGNAL`) then sees a reset connection as an
/// error, where the default action that `main` restores for the commands' output would end the
/// process without a word.
struct PipeSignalIgnored(#[cfg(unix)] libc::sighandler_t);

impl PipeSignalIgnored {
    fn new() -> Self {
        // SAFETY: swaps the signal's action; no handler of ours runs.
        #[cfg(unix)]
        return Self(unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) });
        #[cfg(not(unix))]
        Self()
    }
}

impl Drop for PipeSignalIgnored {
    fn drop(&mut self) {
        // SAFETY: puts back the action `new` found.
        #[cfg(unix)]
        unsafe {
            libc::signal(libc::SIGPIPE, self.0);
        }
    }
}

/// Ctrl-C asks the command to stop and finish what it can: the first press sets the returned
/// flag, after `first` on standard error (what happens now); a second press exits at once,
/// with status 130, after `second`.
pub fn on_interrupt(first: &'static str, second: &'static str) -> Result<Arc<AtomicBool>> {
    let pressed = Arc::new(AtomicBool::new(false));
    let flag = pressed.clone();
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::Relaxed) {
            eprintln!("\ncascade: interrupted twice: {second}");
            std::process::exit(130);
        }
        eprintln!("\ncascade: interrupted: {first}");
    })?;
    Ok(pressed)
}

/// A config's label: its file name without `.toml`.
pub fn label(path: &Path) -> String {
    path.file_stem()
        .map_or("config".into(), |s| s.to_string_lossy().into_owned())
}

/// A progress bar in `template`, hidden when standard error is not a terminal.
pub fn bar(template: &str) -> ProgressBar {
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.with_style(style(template))
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .expect("a valid template")
        .progress_chars("=> ")
}

/// A progress bar over the steps of successive tasks (loading one model, then the next).
pub struct Steps {
    bar: ProgressBar,
    task: String,
}

impl Steps {
    /// A hidden bar when standard error is not a terminal.
    pub fn new() -> Self {
        let bar = bar("");
        // Redrawn while a step takes long (a chunk of a prompt on a slow CPU takes seconds).
        bar.enable_steady_tick(std::time::Duration::from_millis(500));
        Self {
            bar,
            task: String::new(),
        }
    }

    /// Shows `done` of `total` steps of `what`. A new task's label goes into the bar's style,
    /// which changes without drawing, and is drawn with its count and total in one frame: no
    /// frame shows one task's label or count against another's total (or against none).
    pub fn show(&mut self, what: &str, done: usize, total: usize) {
        if self.task != what {
            let label = format!("{what:>50}").replace('{', "{{").replace('}', "}}");
            self.bar.set_style(style(&format!(
                "{label} [{{bar:30}}] {{pos}}/{{len}} {{elapsed}}"
            )));
            self.task = what.to_string();
            self.bar.reset_elapsed();
        }
        self.bar.update(|state| {
            state.set_len(total as u64);
            state.set_pos(done as u64);
        });
    }

    /// Clears the bar.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}

/// Builds `plan`'s engine, models loaded through `store`, with a progress bar; an error names
/// the config `path`.
pub fn build(path: &Path, plan: &Plan, store: &mut ModelStore) -> Result<cascade::engine::Engine> {
    let mut steps = Steps::new();
    let engine = plan
        .build_with(store, &mut |what, done, total| {
            steps.show(what, done, total)
        })
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    steps.finish();
    Ok(engine)
}
