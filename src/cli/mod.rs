//! The commands of the `cascade` binary, one module each; shared helpers here.

pub mod bench;
pub mod generate;
pub mod ngram;
pub mod serve;

use anyhow::Result;
use cascade::config::{Plan, RawConfig};
use cascade::model::ModelStore;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// Validates the config at `path` (relative paths from its folder).
pub fn load_plan(path: &Path, raw: &RawConfig) -> Result<Plan> {
    let base = path.parent().map(PathBuf::from).unwrap_or_default();
    Ok(raw.validate(&base)?)
}

/// A config's label: its file name without `.toml`.
pub fn label(path: &Path) -> String {
    path.file_stem()
        .map_or("config".into(), |s| s.to_string_lossy().into_owned())
}

/// A progress bar in `style`, hidden when standard error is not a terminal.
pub fn bar(style: &str) -> ProgressBar {
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.with_style(
        ProgressStyle::with_template(style)
            .expect("a valid template")
            .progress_chars("=> "),
    )
}

/// Shows `done` of `total` steps of `what` on `bar`, which may have shown another task (or
/// none yet): a new task's label, count and total are set out of sight and drawn together, so
/// that no frame shows one task's label or count against another's total (or against none).
pub fn show_step(bar: &ProgressBar, what: &str, done: usize, total: usize) {
    let new_task = bar.message() != what && !bar.is_hidden();
    if new_task {
        bar.set_draw_target(ProgressDrawTarget::hidden());
        bar.set_message(what.to_string());
    }
    bar.update(|state| {
        state.set_len(total as u64);
        state.set_pos(done as u64);
    });
    if new_task {
        bar.set_draw_target(ProgressDrawTarget::stderr());
        bar.tick();
    }
}

/// Builds `plan`'s engine, models loaded through `store`, with a progress bar.
pub fn build(plan: &Plan, store: &mut ModelStore) -> Result<cascade::engine::Engine> {
    let bar = bar("{msg:>50} [{bar:30}] {pos}/{len}");
    let engine = plan.build_with(store, &mut |what, done, total| {
        show_step(&bar, what, done, total)
    })?;
    bar.finish_and_clear();
    Ok(engine)
}
