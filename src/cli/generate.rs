//! `cascade generate`: streamed text, a summary line, `--json`, `--compare`.

use super::{build, label, load_plan, Steps};
use anyhow::{bail, Context, Result};
use cascade::bench;
use cascade::config::{Plan, RawConfig};
use cascade::engine::Generation;
use cascade::model::ModelStore;
use cascade::sampling::Sampling;
use clap::Args;
use serde::Serialize;
use std::cell::RefCell;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

#[derive(Args)]
pub struct GenerateArgs {
    /// TOML config naming the target, the drafter and the settings.
    #[arg(short, long, default_value = "configs/adaptive.toml")]
    config: PathBuf,
    /// The prompt text (else --prompt-file, else standard input).
    #[arg(
        short,
        long,
        conflicts_with = "prompt_file",
        allow_hyphen_values = true
    )]
    prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long)]
    max_new_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Random seed; sample i of --num-samples uses seed + i.
    #[arg(short, long)]
    seed: Option<u64>,
    /// Tokens drafted per target call (an upper bound with adaptive drafting).
    #[arg(short, long, conflicts_with = "no_draft")]
    k: Option<usize>,
    /// Decode autoregressively, ignoring the config's drafter.
    #[arg(long)]
    no_draft: bool,
    /// Wrap the prompt in the model's chat template.
    #[arg(long, overrides_with = "no_chat")]
    chat: bool,
    /// Use the prompt as raw text even if the config enables the chat template.
    #[arg(long)]
    no_chat: bool,
    /// System message for the chat template.
    #[arg(long, allow_hyphen_values = true)]
    system: Option<String>,
    /// Stop when this text appears (repeatable; replaces the config's stop strings); the
    /// output ends before it. It may begin with a hyphen (`--stop ---`).
    #[arg(long, allow_hyphen_values = true)]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (for long-run measurements).
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON document (ids, text, counters) instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Number of independent samples (seeds seed..seed+N-1).
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Then decode each sample again with the target alone (same options, same process) and
    /// report the wall-clock speedup over autoregressive decoding.
    #[arg(long)]
    compare: bool,
}

#[derive(Args)]
pub struct SamplingArgs {
    /// Sampling temperature (0 = greedy).
    #[arg(short, long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the most likely tokens up to this probability mass (1 = off).
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
}

impl SamplingArgs {
    /// `base` with the settings given on the command line.
    pub fn over(&self, base: Sampling) -> Sampling {
        Sampling {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
        }
    }

    /// Whether any setting was given.
    pub fn given(&self) -> bool {
        self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some()
    }
}

pub fn generate(args: GenerateArgs) -> Result<()> {
    // A flag's mistake is named by the flag (the config's checks would name its TOML key).
    use cascade::config::{MAX_CONTEXT, MAX_DRAFT};
    for (flag, value, most) in [
        ("--max-new-tokens", args.max_new_tokens, MAX_CONTEXT),
        ("-k", args.k, MAX_DRAFT),
    ] {
        if let Some(v) = value.filter(|v| !(1..=most).contains(v)) {
            bail!("{flag} must be between 1 and {most}, got {v}");
        }
    }
    let mut raw = RawConfig::load(&args.config)?;
    raw.sampling = args.sampling.over(raw.sampling);
    if args.sampling.given() {
        raw.sampling.validate()?; // before the warning below, which it would make moot
    }
    let filters = args.sampling.top_k.is_some() || args.sampling.top_p.is_some();
    if filters && raw.sampling.temperature == 0.0 {
        eprintln!(
            "cascade: warning: --top-k and --top-p take effect with a temperature above 0; this \
             run decodes greedily (-t sets the temperature)"
        );
    }
    let g = &mut raw.generation;
    g.max_new_tokens = args.max_new_tokens.unwrap_or(g.max_new_tokens);
    g.seed = args.seed.unwrap_or(g.seed);
    if !args.stop.is_empty() {
        g.stop = args.stop.clone();
    }
    g.chat = (g.chat || args.chat) && !args.no_chat;
    g.system = args.system.clone().or(g.system.take());
    raw.target.k = args.k.unwrap_or(raw.target.k);
    if args.k.is_some() && raw.target.drafter.is_none() {
        eprintln!("cascade: warning: -k has no effect: the config names no drafter");
    }
    if args.no_draft {
        // Plain decoding: no drafter, and no gate whose costs would be measured for nothing.
        raw.target.drafter = None;
        raw.target.adaptive = false;
        raw.target.acceptance.clear();
    }
    if args.num_samples == 0 {
        bail!("--num-samples must be >= 1");
    }
    if args.stop.iter().any(String::is_empty) {
        bail!("--stop: a stop string is empty");
    }
    let mut plan = load_plan(&args.config, &raw)?;
    super::warn_unused_k(
        &args.config,
        &plan,
        if args.k.is_some() { "-k" } else { "target.k" },
    );
    // In the plan's options, so that --compare's plain decoding ignores it too.
    plan.options.ignore_eos = args.ignore_eos;
    if plan.options.lenience != 1.0 {
        eprintln!(
            "cascade: warning: lenience {} at the target: the output is no longer exactly the target's",
            plan.options.lenience
        );
    }
    if !plan.chat && plan.system.is_some() {
        eprintln!("cascade: warning: a system prompt is used only with the chat template (--chat)");
    }
    let prompt_text = read_prompt(&args)?;
    // A prompt's final line break (`echo`'s, a file's) is not part of a chat message.
    let message = prompt_text
        .strip_suffix('\n')
        .map_or(prompt_text.as_str(), |m| m.strip_suffix('\r').unwrap_or(m));
    // The template would wrap an empty message into a prompt of its own, and the model answer
    // it: an input that came out empty (a pipe that produced nothing) is an error.
    if plan.chat && message.trim().is_empty() {
        bail!("empty prompt: the message for the chat template is empty");
    }
    let mut store = ModelStore::default();
    let mut engine = build(&args.config, &plan, &mut store)?;
    cascade::profile_reset(); // building may have measured forward costs
    let text = plan.prompt_text(
        &engine.tokenizer,
        if plan.chat { message } else { &prompt_text },
    )?;
    let prompt = engine.tokenizer.encode(&text)?;
    let mut samples: Vec<(u64, Generation)> = Vec::new();
    // Ctrl-C ends the generation, after which what came out is reported as usual; so does a
    // failed write to standard output (a full disk), which then fails the command. Either
    // sets the engine's cancel flag.
    let cancel = super::on_interrupt(
        "stopping; what came out is reported (Ctrl-C again exits at once)",
        "exiting now",
    )?;
    for i in 0..args.num_samples as u64 {
        if cancel.load(Ordering::Relaxed) {
            break;
        }
        let mut opts = plan.options.clone();
        opts.seed = opts.seed.wrapping_add(i);
        opts.cancel = Some(cancel.clone());
        if args.compare {
            // Compared with decoding that reads the prompt whole: so does every sample.
            engine.forget();
        }
        let mut stdout = std::io::stdout().lock();
        let mut write_error = None;
        // Shown while the prompt is read, until the first text (a drafter may read it too).
        let reading = RefCell::new(Some(Steps::new()));
        let done_reading = || reading.borrow_mut().take().map(Steps::finish);
        let out = engine.generate_with_progress(
            &prompt,
            &opts,
            &mut |done, total| {
                if let Some(bar) = reading.borrow_mut().as_mut() {
                    bar.show("reading the prompt", done, total);
                }
            },
            &mut |piece| {
                done_reading();
                if !args.json && write_error.is_none() {
                    if let Err(e) = stdout
                        .write_all(piece.as_bytes())
                        .and_then(|()| stdout.flush())
                    {
                        write_error = Some(e);
                        cancel.store(true, Ordering::Relaxed);
                    }
                }
            },
        );
        done_reading();
        let out = out?;
        if let Some(e) = write_error {
            return Err(stdout_error(e));
        }
        if !args.json {
            writeln!(stdout).map_err(stdout_error)?;
            eprintln!("[seed {}: {}]", opts.seed, summary_line(&out));
        }
        for w in &out.warnings {
            eprintln!("cascade: warning: {w}");
        }
        samples.push((opts.seed, out));
    }
    // A Ctrl-C while comparing (which cannot be cancelled) is reported after it.
    let comparison = if args.compare && !cancel.load(Ordering::Relaxed) {
        let c = bench::compare(
            &mut engine,
            &store,
            &plan,
            &label(&args.config),
            (&text, &prompt),
            &samples,
        )?;
        if !args.json {
            print_comparison(&samples, &c);
        }
        Some(c)
    } else {
        None
    };
    if let Some(table) = cascade::profile_report() {
        eprintln!("forward time by section (CASCADE_PROFILE=1), every model of the run:\n{table}");
    }
    if args.json {
        // The family the target's weights were packed for: the kernels that ran.
        let kernels = store
            .loaded()
            .find(|m| m.path == plan.target.path)
            .map(|m| m.weights.kernels.to_string());
        let doc = GenerateDoc::new(
            &args.config,
            &plan,
            kernels,
            &prompt,
            &samples,
            comparison.as_ref(),
        );
        writeln!(std::io::stdout(), "{}", serde_json::to_string_pretty(&doc)?)
            .map_err(stdout_error)?;
    }
    if cancel.load(Ordering::Relaxed) {
        bail!("interrupted by Ctrl-C: the output above is what came out before it");
    }
    Ok(())
}

/// A failed write to standard output (a closed pipe ends the process before: SIGPIPE).
fn stdout_error(e: std::io::Error) -> anyhow::Error {
    anyhow::Error::new(e).context("cannot write to standard output")
}

/// One line on a generation: tokens, speed (and the cost model's prediction), drafting.
fn summary_line(out: &Generation) -> String {
    let st = &out.stats;
    let predicted = match st.predicted_speedup() {
        Some(_) => format!(" (cost model: {:.2})", st.predicted_tokens_per_second()),
        None => String::new(),
    };
    let cached = match st.cached_tokens {
        0 => String::new(),
        n => format!(" ({n} of {} prompt tokens cached)", st.prompt_tokens),
    };
    format!(
        "{} tokens ({}), {:.2} tokens/s{predicted}, {:.2} tokens per target call, {} of {} drafted tokens accepted, prefill {:.2}s{cached}",
        st.generated_tokens,
        out.finish_reason.name(),
        st.decode_tokens_per_second(),
        st.tokens_per_call(),
        st.accepted,
        st.drafted,
        st.prefill_seconds
    )
}

fn print_comparison(samples: &[(u64, Generation)], c: &bench::Comparison) {
    for ((seed, spec), (ar, same)) in samples.iter().zip(&c.samples) {
        let predicted = spec.stats.predicted_speedup().map_or(String::new(), |p| {
            format!(", predicted {p:.2}x by the run-time cost model")
        });
        eprintln!(
            "[seed {seed}: autoregressive {:.2} tokens/s, speedup {:.2}x{predicted}, same tokens: {same}]",
            ar.stats.decode_tokens_per_second(),
            bench::speedup(&ar.stats, &spec.stats),
        );
    }
    if let Some(s) = &c.summary {
        let costs: Vec<String> = c
            .models
            .iter()
            .map(|m| format!("{} {:.2}", m.model, m.c_measured))
            .collect();
        eprintln!(
            "[SWI {:.2} (params) / {:.2} (measured c); predicted {:.2}x (verify = 1 call) / {:.2}x (measured r(k)); c: {}]",
            s.swi_params,
            s.swi_measured,
            s.predicted_paper,
            s.predicted_cpu,
            costs.join(", ")
        );
    }
}

/// `generate --json`.
#[derive(Serialize)]
struct GenerateDoc<'a> {
    config: &'a Path,
    drafter: Option<&'a str>,
    /// The kernel family the target ran with (`avx512`, `avxvnni`, `avx2`, `portable`).
    kernels: Option<String>,
    /// Tokens drafted per target call at most; none without a drafter.
    k: Option<usize>,
    sampling: Sampling,
    prompt_tokens: &'a [u32],
    /// With `--compare`: the models' costs and the bench's summary for this prompt.
    compare: Option<CompareDoc<'a>>,
    samples: Vec<SampleDoc<'a>>,
}

#[derive(Serialize)]
struct CompareDoc<'a> {
    models: &'a [bench::ModelCost],
    verify_cost: &'a [(usize, f64)],
    summary: Option<&'a bench::Summary>,
}

#[derive(Serialize)]
struct SampleDoc<'a> {
    seed: u64,
    #[serde(flatten)]
    generation: &'a Generation,
    rates: Rates,
    compare: Option<SampleCompare>,
}

/// Figures derived from a generation's counters.
#[derive(Serialize)]
struct Rates {
    tokens_per_call: f64,
    decode_tokens_per_second: f64,
    acceptance_by_position: Vec<f64>,
    predicted_speedup: Option<f64>,
}

#[derive(Serialize)]
struct SampleCompare {
    autoregressive_tokens_per_second: f64,
    speedup: f64,
    same_tokens: bool,
}

impl<'a> GenerateDoc<'a> {
    fn new(
        config: &'a Path,
        plan: &'a Plan,
        kernels: Option<String>,
        prompt: &'a [u32],
        samples: &'a [(u64, Generation)],
        comparison: Option<&'a bench::Comparison>,
    ) -> Self {
        let samples = samples
            .iter()
            .enumerate()
            .map(|(i, (seed, g))| SampleDoc {
                seed: *seed,
                generation: g,
                rates: Rates {
                    tokens_per_call: g.stats.tokens_per_call(),
                    decode_tokens_per_second: g.stats.decode_tokens_per_second(),
                    acceptance_by_position: g.stats.acceptance_by_position(),
                    predicted_speedup: g.stats.predicted_speedup(),
                },
                compare: comparison.and_then(|c| c.samples.get(i)).map(|(ar, same)| {
                    SampleCompare {
                        autoregressive_tokens_per_second: ar.stats.decode_tokens_per_second(),
                        speedup: bench::speedup(&ar.stats, &g.stats),
                        same_tokens: *same,
                    }
                }),
            })
            .collect();
        Self {
            config,
            drafter: plan.drafter.as_ref().map(|d| d.name.as_str()),
            kernels,
            k: plan.drafter.is_some().then_some(plan.options.k),
            sampling: plan.options.sampling,
            prompt_tokens: prompt,
            compare: comparison.map(|c| CompareDoc {
                models: &c.models,
                verify_cost: &c.verify_cost,
                summary: c.summary.as_ref(),
            }),
            samples,
        }
    }
}

fn read_prompt(args: &GenerateArgs) -> Result<String> {
    if let Some(p) = &args.prompt {
        return Ok(p.clone());
    }
    if let Some(f) = &args.prompt_file {
        return std::fs::read_to_string(f)
            .with_context(|| format!("cannot read prompt file {}", f.display()));
    }
    if std::io::stdin().is_terminal() {
        bail!("no prompt: give --prompt, --prompt-file, or pipe text to standard input");
    }
    let mut s = String::new();
    std::io::stdin()
        .read_to_string(&mut s)
        .context("cannot read the prompt from standard input")?;
    Ok(s)
}
