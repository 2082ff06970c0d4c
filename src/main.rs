//! The `cascade` command line.

use anyhow::{bail, Context, Result};
use cascade::config::RawConfig;
use cascade::engine::{GenerateOptions, Generation};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

/// Lossless speculative decoding with cascades of drafters.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt with the target model and (optionally) a drafter.
    Generate(GenerateArgs),
    /// Compare configs on a prompt suite against autoregressive decoding, in one process.
    Bench(BenchArgs),
    /// Plan every review of a config's tree (draft lengths, schedules, K-matrix rows) from a
    /// bench report's measured acceptance and costs, or from a short calibration run.
    Plan(PlanArgs),
    /// Bigram tables for the statistical drafters (bigram, Max-Gram).
    Ngram {
        #[command(subcommand)]
        command: NgramCommand,
    },
}

#[derive(Args)]
struct BenchArgs {
    /// Configs to compare (the first one's target also runs alone as the autoregressive baseline).
    #[arg(short, long, num_args = 1.., required = true)]
    configs: Vec<PathBuf>,
    /// Prompt suite (JSONL: category, prompt, chat).
    #[arg(short, long, default_value = "prompts/suite.jsonl")]
    prompts: PathBuf,
    /// Tokens generated per prompt.
    #[arg(short = 'n', long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Timed passes over the suite.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Prompts run untimed first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Use only the first N prompts of each category.
    #[arg(long)]
    per_category: Option<usize>,
    /// Report folder (report.json, report.md, acceptance.svg, speedup.svg).
    #[arg(short, long, default_value = "reports/latest")]
    out: PathBuf,
}

#[derive(Args)]
struct PlanArgs {
    /// A report.json written by `cascade bench`. Without it, `plan` first runs a short
    /// calibration bench of the config (--prompts, --per-category, -n, --out).
    #[arg(short, long)]
    report: Option<PathBuf>,
    /// The config to plan for (its label in the report is the file stem).
    #[arg(short, long)]
    config: PathBuf,
    /// Largest K considered.
    #[arg(long, default_value_t = 16)]
    max_k: usize,
    /// Write the config with the best K here (comments are not kept).
    #[arg(long)]
    write: Option<PathBuf>,
    /// Calibration: the prompt suite.
    #[arg(long, default_value = "prompts/suite.jsonl", conflicts_with = "report")]
    prompts: PathBuf,
    /// Calibration: prompts per category.
    #[arg(long, default_value_t = 2, conflicts_with = "report")]
    per_category: usize,
    /// Calibration: tokens generated per prompt.
    #[arg(short = 'n', long, default_value_t = 48, conflicts_with = "report")]
    max_new_tokens: usize,
    /// Calibration: where its bench report goes (plan again from it with -r).
    #[arg(long, default_value = "reports/calibration", conflicts_with = "report")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum NgramCommand {
    /// Build a bigram table from a corpus of text or code files.
    Build(BuildArgs),
}

#[derive(Args)]
struct BuildArgs {
    /// Tokenizer: a GGUF model (its embedded tokenizer) or a tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Where to write the table.
    #[arg(short, long)]
    out: PathBuf,
    /// Successors kept per token.
    #[arg(long, default_value_t = 8)]
    top: usize,
    /// Only files with these extensions (comma-separated; default: all files).
    #[arg(long, value_delimiter = ',')]
    ext: Vec<String>,
    /// Skip files under folders with these names (repeatable), e.g. site-packages.
    #[arg(long)]
    exclude: Vec<String>,
    /// Corpus files or folders (searched recursively).
    #[arg(required = true)]
    corpus: Vec<PathBuf>,
}

#[derive(Args)]
struct GenerateArgs {
    /// TOML config naming the target, the drafter and the settings.
    #[arg(short, long, default_value = "configs/speculative.toml")]
    config: PathBuf,
    /// The prompt text (else --prompt-file, else standard input).
    #[arg(short, long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long)]
    max_new_tokens: Option<usize>,
    /// Sampling temperature (0 = greedy).
    #[arg(short, long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the most likely tokens up to this probability mass (1 = off).
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Random seed; sample i of --num-samples uses seed + i.
    #[arg(short, long)]
    seed: Option<u64>,
    /// Tokens drafted per target call.
    #[arg(short, long)]
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
    #[arg(long)]
    system: Option<String>,
    /// Stop when this text appears (repeatable); the output ends before it.
    #[arg(long)]
    stop: Vec<String>,
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

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(args),
        Command::Bench(args) => bench(args),
        Command::Plan(args) => plan(args),
        Command::Ngram {
            command: NgramCommand::Build(args),
        } => ngram_build(args),
    };
    if let Err(e) = result {
        eprintln!("cascade: {e:#}");
        std::process::exit(1);
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    let mut raw = RawConfig::load(&args.config)?;
    let s = &mut raw.sampling;
    s.temperature = args.temperature.unwrap_or(s.temperature);
    s.top_k = args.top_k.unwrap_or(s.top_k);
    s.top_p = args.top_p.unwrap_or(s.top_p);
    let g = &mut raw.generation;
    g.max_new_tokens = args.max_new_tokens.unwrap_or(g.max_new_tokens);
    g.seed = args.seed.unwrap_or(g.seed);
    g.stop.extend(args.stop.iter().cloned());
    g.chat = (g.chat || args.chat) && !args.no_chat;
    g.system = args.system.clone().or(g.system.take());
    raw.target.k = args.k.unwrap_or(raw.target.k);
    if args.no_draft {
        raw.target.drafter = None;
    }
    if args.num_samples == 0 {
        bail!("--num-samples must be >= 1");
    }
    let base = args.config.parent().map(PathBuf::from).unwrap_or_default();
    let plan = raw.validate(&base)?;
    if plan.options.lenience != 1.0 {
        eprintln!(
            "cascade: warning: lenience {} at the target: the output is no longer exactly the target's",
            plan.options.lenience
        );
    }
    let prompt_text = read_prompt(&args)?;

    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg:>40} [{bar:30}] {pos}/{len} layers")
            .unwrap()
            .progress_chars("=> "),
    );
    let mut store = cascade::model::ModelStore::default();
    let mut engine = plan.build_with(&mut store, &mut |what, done, total| {
        bar.set_message(what.to_string());
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();

    let text = if plan.chat {
        cascade::chat::apply(&engine.tokenizer, plan.system.as_deref(), &prompt_text)?
    } else {
        prompt_text
    };
    let prompt = engine.tokenizer.encode(&text)?;
    let mut samples: Vec<(u64, Generation)> = Vec::new();
    for i in 0..args.num_samples as u64 {
        let mut opts = plan.options.clone();
        opts.seed += i;
        let mut stdout = std::io::stdout().lock();
        let mut on_text = |piece: &str| {
            if !args.json {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
        };
        let out = engine.generate(&prompt, &opts, &mut on_text)?;
        if !args.json {
            println!();
            let st = &out.stats;
            let predicted = match st.predicted_tokens_per_second() {
                p if p > 0.0 => format!(" (cost model: {p:.2})"),
                _ => String::new(),
            };
            eprintln!(
                "[seed {}: {} tokens ({:?}), {:.2} tokens/s{predicted}, {:.2} tokens per target call, {}/{} drafted accepted, prefill {:.2}s]",
                opts.seed,
                st.generated_tokens,
                out.finish_reason,
                st.decode_tokens_per_second(),
                st.tokens_per_call(),
                st.accepted,
                st.drafted,
                st.prefill_seconds
            );
        }
        samples.push((opts.seed, out));
    }
    let (comparisons, costs) = if args.compare {
        let label = cascade::config::file_label(&args.config);
        let label = label.trim_end_matches(".toml");
        let input = (text.as_str(), prompt.as_slice());
        compare(
            &mut engine,
            &store,
            &plan,
            label,
            input,
            &samples,
            !args.json,
        )?
    } else {
        (Vec::new(), serde_json::Value::Null)
    };
    if let Some(table) = cascade::profile::report() {
        eprintln!("forward time by section (CASCADE_PROFILE=1):\n{table}");
    }
    if args.json {
        let doc = serde_json::json!({
            "config": args.config,
            "drafter": plan.drafter.as_ref().map(|d| &d.name),
            "k": plan.options.k,
            "sampling": plan.options.sampling,
            "prompt_tokens": prompt,
            "compare": costs,
            "samples": samples.iter().enumerate().map(|(i, (seed, g))| {
                let mut v = serde_json::to_value(g).unwrap();
                if let Some(c) = comparisons.get(i) {
                    v["compare"] = c.clone();
                }
                v["seed"] = (*seed).into();
                v["stats"]["tokens_per_call"] = g.stats.tokens_per_call().into();
                v["stats"]["decode_tokens_per_second"] = g.stats.decode_tokens_per_second().into();
                v["stats"]["acceptance_by_position"] = serde_json::to_value(g.stats.acceptance_by_position()).unwrap();
                v
            }).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}

/// `generate --compare`: decodes each sample again with the target alone (same options), then
/// measures the models' costs and summarizes the runs as the bench does. Returns one
/// comparison per sample and the costs and summary.
fn compare(
    engine: &mut cascade::engine::Engine,
    store: &cascade::model::ModelStore,
    plan: &cascade::config::Plan,
    label: &str,
    (text, prompt): (&str, &[u32]),
    samples: &[(u64, Generation)],
    print: bool,
) -> Result<(Vec<serde_json::Value>, serde_json::Value)> {
    use cascade::bench;
    let suite_prompt = bench::SuitePrompt {
        category: "prompt".into(),
        prompt: text.to_string(),
        chat: plan.chat,
    };
    let (mut records, mut comparisons) = (Vec::new(), Vec::new());
    let drafter = engine.drafter.take();
    for (i, (seed, spec)) in samples.iter().enumerate() {
        let opts = GenerateOptions {
            seed: *seed,
            ..plan.options.clone()
        };
        let ar = engine.generate(prompt, &opts, &mut |_| {});
        let ar = match ar {
            Ok(ar) => ar,
            Err(e) => {
                engine.drafter = drafter;
                return Err(e.into());
            }
        };
        let ar_rate = ar.stats.decode_tokens_per_second();
        let speedup = bench::speedup(&ar.stats, &spec.stats);
        let same = ar.tokens == spec.tokens;
        if print {
            eprintln!(
                "[seed {seed}: autoregressive {ar_rate:.2} tokens/s, speedup {speedup:.2}x, same tokens: {same}]"
            );
        }
        comparisons.push(serde_json::json!({
            "autoregressive_tokens_per_second": ar_rate,
            "speedup": speedup,
            "same_tokens": same,
        }));
        let mut r = bench::record(label, &suite_prompt, 0, i, spec);
        r.speedup = speedup;
        r.matches_autoregressive = bench::exact_greedy(&plan.options).then_some(same);
        records.push(r);
        records.push(bench::record("autoregressive", &suite_prompt, 0, i, &ar));
    }
    engine.drafter = drafter;
    // Model costs (c, r(k)) measured now, and the bench's per-config figures from them.
    let (verify, models) = bench::measure_store_costs(store, &plan.target.path)?;
    let k_of = |l: &str| if l == label { plan.options.k } else { 0 };
    let summary = bench::summarize(&records, &models, &verify, &k_of);
    let mine = summary
        .iter()
        .find(|s| s.config == label && s.category == "all");
    if let (Some(s), true) = (mine, print) {
        let c: Vec<String> = models
            .iter()
            .map(|m| format!("{} {:.2}", m.model, m.c_measured))
            .collect();
        eprintln!(
            "[SWI {:.2} (params) / {:.2} (measured c); predicted {:.2}x (verify = 1 call) / {:.2}x (measured r(k)); c: {}]",
            s.swi_params,
            s.swi_measured,
            s.predicted_paper,
            s.predicted_cpu,
            c.join(", ")
        );
    }
    let costs = serde_json::json!({ "models": models, "verify_cost": verify, "summary": mine });
    Ok((comparisons, costs))
}

fn bench(args: BenchArgs) -> Result<()> {
    use cascade::bench::{self, BenchConfig, BenchOptions};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut suite = bench::load_suite(&args.prompts)?;
    if let Some(n) = args.per_category {
        let mut seen = std::collections::HashMap::new();
        suite.retain(|p| {
            let c = seen.entry(p.category.clone()).or_insert(0);
            *c += 1;
            *c <= n
        });
    }
    let configs = args
        .configs
        .iter()
        .map(|path| {
            let base = path.parent().map(PathBuf::from).unwrap_or_default();
            let plan = RawConfig::load(path)?.validate(&base)?;
            let label = path
                .file_stem()
                .map_or("config".into(), |s| s.to_string_lossy().into_owned());
            Ok(BenchConfig { label, plan })
        })
        .collect::<Result<Vec<_>>>()?;
    if args.max_new_tokens == 0 || args.repeats == 0 {
        bail!("-n/--max-new-tokens and --repeats must be >= 1");
    }
    if suite.is_empty() {
        bail!("{}: the prompt suite is empty", args.prompts.display());
    }
    for (i, c) in configs.iter().enumerate() {
        if c.label == "autoregressive" || configs[..i].iter().any(|d| d.label == c.label) {
            bail!(
                "config label `{}` is taken (labels are file names without .toml; `autoregressive` is the baseline's): rename the file",
                c.label
            );
        }
    }
    let opts = BenchOptions {
        max_new_tokens: args.max_new_tokens,
        repeats: args.repeats,
        warmup_prompts: args.warmup,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || {
        eprintln!("\ncascade: interrupted, finishing the current run and writing the report");
        flag.store(true, Ordering::Relaxed);
    })?;
    let mut store = cascade::model::ModelStore::default();
    eprintln!(
        "loading {} configs and measuring model costs",
        configs.len()
    );
    let (records, interrupted) = {
        let bar = ProgressBar::new(0).with_style(
            ProgressStyle::with_template("[{elapsed_precise}] [{bar:30}] {pos}/{len} {msg}")
                .unwrap()
                .progress_chars("=> "),
        );
        let out = bench::run(
            &configs,
            &suite,
            &opts,
            &mut store,
            &stop,
            &mut |done, total, what| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                bar.set_message(what.to_string());
            },
        )?;
        bar.finish_and_clear();
        out
    };
    let (verify_cost, models) = bench::measure_store_costs(&store, &configs[0].plan.target.path)?;
    let k_of = |label: &str| {
        configs
            .iter()
            .find(|c| c.label == label)
            .map_or(0, |c| c.plan.options.k)
    };
    let summary = bench::summarize(&records, &models, &verify_cost, &k_of);
    let report = bench::Report {
        date: bench::utc_now(),
        threads: candle_core::utils::get_num_threads(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        options: opts,
        verify_cost,
        models,
        runs: records,
        summary,
        interrupted,
    };
    std::fs::create_dir_all(&args.out)?;
    let table = bench::markdown(&report.summary);
    std::fs::write(
        args.out.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(args.out.join("report.md"), &table)?;
    let labels: Vec<String> = report
        .summary
        .iter()
        .filter(|s| s.category == "all")
        .map(|s| s.config.clone())
        .collect();
    let acceptance: Vec<(String, Vec<f64>)> = report
        .summary
        .iter()
        .filter(|s| s.category == "all" && s.config != "autoregressive")
        .map(|s| (s.config.clone(), s.acceptance_by_position.clone()))
        .collect();
    let mut categories: Vec<String> = report
        .summary
        .iter()
        .map(|s| s.category.clone())
        .filter(|c| c != "all")
        .collect();
    categories.sort();
    categories.dedup();
    let speedups: Vec<(String, Vec<f64>)> = labels
        .iter()
        .filter(|l| *l != "autoregressive")
        .map(|l| {
            let v = categories
                .iter()
                .map(|c| {
                    report
                        .summary
                        .iter()
                        .find(|s| &s.config == l && &s.category == c)
                        .map_or(0.0, |s| s.speedup_mean)
                })
                .collect();
            (l.clone(), v)
        })
        .collect();
    std::fs::write(
        args.out.join("acceptance.svg"),
        cascade::plot::acceptance(&acceptance),
    )?;
    std::fs::write(
        args.out.join("speedup.svg"),
        cascade::plot::speedup(&categories, &speedups),
    )?;
    println!("{table}");
    let costs: Vec<String> = report
        .models
        .iter()
        .map(|m| {
            format!(
                "{} {:.1} ms (c = {:.2})",
                m.model, m.decode_ms, m.c_measured
            )
        })
        .collect();
    let r: Vec<String> = report
        .verify_cost
        .iter()
        .map(|(k, r)| format!("r({k}) = {r:.2}"))
        .collect();
    println!("decode: {}; verify: {}", costs.join(", "), r.join(", "));
    println!("report: {}", args.out.display());
    let mismatches: usize = report
        .summary
        .iter()
        .filter(|s| s.category == "all")
        .map(|s| s.greedy_mismatches)
        .sum();
    if mismatches > 0 {
        bail!("{mismatches} greedy run(s) differ from autoregressive decoding: this is a bug");
    }
    if interrupted {
        eprintln!("cascade: interrupted: the report holds the runs finished before Ctrl-C");
    }
    Ok(())
}

fn plan(args: PlanArgs) -> Result<()> {
    use cascade::planner;
    if args.max_k == 0 {
        bail!("--max-k must be >= 1");
    }
    let report_path = match &args.report {
        Some(path) => path.clone(),
        None => {
            eprintln!("no report given: calibrating with a short bench run");
            bench(BenchArgs {
                configs: vec![args.config.clone()],
                prompts: args.prompts.clone(),
                max_new_tokens: args.max_new_tokens,
                repeats: 1,
                warmup: 1,
                per_category: Some(args.per_category),
                out: args.out.clone(),
            })?;
            args.out.join("report.json")
        }
    };
    let text = std::fs::read_to_string(&report_path)
        .with_context(|| format!("cannot read {}", report_path.display()))?;
    let report: cascade::bench::Report = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a report of this version of `cascade bench`",
            report_path.display()
        )
    })?;
    let label = args
        .config
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let raw = RawConfig::load(&args.config)?;
    let base = args.config.parent().map(PathBuf::from).unwrap_or_default();
    let config = raw.validate(&base)?;
    let measured = planner::Measured::new(&report, &label)?;
    let levels = planner::plan_levels(&measured, &config, args.max_k)?;
    println!("config {label}, planned from {}:", report_path.display());
    for l in &levels {
        print_level(l);
    }
    if let Some(out) = args.write {
        let mut doc: toml::Value = toml::from_str(&std::fs::read_to_string(&args.config)?)?;
        planner::write_best(&raw, &mut doc, &levels)?;
        planner::absolute_paths(&mut doc, &base);
        std::fs::write(&out, toml::to_string(&doc)?)?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// One review level of `cascade plan`: its drafters' measured figures, the best splits and
/// the verdict.
fn print_level(l: &cascade::planner::LevelPlan) {
    use cascade::planner::Rating;
    let rounded =
        |v: &[f64]| -> Vec<f64> { v.iter().map(|a| (a * 100.0).round() / 100.0).collect() };
    let what = match l.rating {
        Rating::Speedup => "predicted speedup".to_string(),
        Rating::CostPerToken { share } => {
            format!("target calls per token, emitting {share}")
        }
    };
    println!(
        "\n{} reviews `{}` (drafting from {:?}):",
        l.reviewer, l.draft, l.parts
    );
    for (d, s) in l.parts.iter().zip(&l.segments) {
        let per_token = s.cost.get(1).copied().unwrap_or(0.0);
        // Past the measured positions (one per fill value), the pooled rate.
        let (measured, beyond) = s.accept.split_at(s.fill.len().min(s.accept.len()));
        let beyond = beyond
            .first()
            .map_or(String::new(), |a| format!(" then {a:.2}"));
        println!(
            "  {d}: kept by position {:?}{beyond} (not drafted counts as rejected), drafted in {:?} of reviews, {per_token:.3} target calls for one token",
            rounded(measured),
            rounded(&s.fill),
        );
    }
    println!("| counts | {what} (verify = 1 call, the papers) | {what} (measured verify cost) |\n|---|---|---|");
    for (counts, paper, measured) in l.ranked.iter().take(8) {
        println!("| {counts:?} | {paper:.3} | {measured:.3} |");
    }
    let (best, value) = (l.best(), l.ranked[0].2);
    let verdict = match l.rating {
        Rating::Speedup if value < 1.0 => ", slower than autoregressive decoding",
        _ => "",
    };
    println!(
        "current {:?}: {:.3}; best on this machine: {best:?} ({value:.3}{verdict})",
        l.current, l.current_value
    );
    // A part moved to earlier positions keeps the rates measured where it was: a guess.
    let starts = |counts: &[usize]| -> Vec<usize> {
        counts
            .iter()
            .scan(0, |at, n| Some(std::mem::replace(at, *at + n)))
            .collect()
    };
    for ((d, now), (then, n)) in l
        .parts
        .iter()
        .zip(starts(&l.current))
        .zip(starts(best).into_iter().zip(best))
    {
        if *n > 0 && then < now {
            println!(
                "  note: `{d}` was measured from position {} on; the best split puts it at {} with the same rates, so bench the written config to confirm",
                now + 1,
                then + 1
            );
        }
    }
}

fn ngram_build(args: BuildArgs) -> Result<()> {
    use cascade::ngram::{corpus_files, BigramCounter};
    if args.top == 0 {
        bail!("--top must be >= 1");
    }
    let start = std::time::Instant::now();
    let tokenizer = cascade::tokenizer::Tokenizer::from_file(&args.tokenizer)?;
    let files: Vec<PathBuf> = corpus_files(&args.corpus, &args.ext)?
        .into_iter()
        .filter(|f| {
            !f.components()
                .any(|c| args.exclude.iter().any(|x| c.as_os_str() == x.as_str()))
        })
        .collect();
    if files.is_empty() {
        bail!("no corpus files found under {:?}", args.corpus);
    }
    let bytes: u64 = files
        .iter()
        .filter_map(|f| f.metadata().ok())
        .map(|m| m.len())
        .sum();
    let bar = ProgressBar::new(bytes).with_style(
        ProgressStyle::with_template("tokenizing [{bar:30}] {bytes}/{total_bytes} ({eta} left)")
            .unwrap()
            .progress_chars("=> "),
    );
    let mut counter = BigramCounter::new(&tokenizer);
    let mut skipped = 0;
    for f in &files {
        match std::fs::read_to_string(f) {
            Ok(text) => counter.add_text(&text)?,
            Err(_) => skipped += 1, // not UTF-8 text
        }
        bar.inc(f.metadata().map(|m| m.len()).unwrap_or(0));
    }
    bar.finish_and_clear();
    let tokens = counter.tokens;
    let table = counter.into_table(args.top);
    table.save(&args.out)?;
    eprintln!(
        "{}: {} files ({skipped} skipped as non-UTF-8), {tokens} tokens, {} table entries, {} bytes, {:.1}s",
        args.out.display(),
        files.len() - skipped,
        table.entries(),
        std::fs::metadata(&args.out)?.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
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
