//! The `cascade` command line.

use anyhow::{bail, Context, Result};
use cascade::config::{RawConfig, RawDrafter};
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
    /// Choose the draft length K, or a horizontal cascade's schedule, from a bench report's
    /// measured acceptance and costs.
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
    /// A report.json written by `cascade bench`.
    #[arg(short, long)]
    report: PathBuf,
    /// The config to plan for (its label in the report is the file stem).
    #[arg(short, long)]
    config: PathBuf,
    /// Largest K considered.
    #[arg(long, default_value_t = 16)]
    max_k: usize,
    /// Write the config with the best K here (comments are not kept).
    #[arg(long)]
    write: Option<PathBuf>,
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
        bar.set_message(format!("loading {what}"));
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
            eprintln!(
                "[seed {}: {} tokens ({:?}), {:.2} tokens/s, {:.2} tokens per target call, {}/{} drafted accepted, prefill {:.2}s]",
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
        let opts = BenchOptions {
            max_new_tokens: args.max_new_tokens,
            repeats: args.repeats,
            warmup_prompts: args.warmup,
        };
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
        date: String::from_utf8_lossy(
            &std::process::Command::new("date")
                .arg("-u")
                .arg("+%Y-%m-%d %H:%M UTC")
                .output()?
                .stdout,
        )
        .trim()
        .to_string(),
        threads: candle_core::utils::get_num_threads(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        options: BenchOptions {
            max_new_tokens: args.max_new_tokens,
            repeats: args.repeats,
            warmup_prompts: args.warmup,
        },
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

/// What a bench report measured for one config: the figures `cascade plan` works from.
struct Measured {
    label: String,
    /// Acceptance at position i as "drafted and accepted, given every earlier one was", so
    /// that drafts shorter than K (Max-Gram without a match) count as rejections.
    accept: Vec<f64>,
    verify: Vec<(usize, f64)>,
    models: Vec<serde_json::Value>,
    runs: Vec<serde_json::Value>,
    /// Target calls over the config's runs.
    rounds: f64,
}

impl Measured {
    fn from_report(report: &serde_json::Value, label: &str) -> Result<Self> {
        let summary = report["summary"]
            .as_array()
            .and_then(|s| {
                s.iter()
                    .find(|s| s["config"] == label && s["category"] == "all")
            })
            .with_context(|| format!("the report has no results for config `{label}`"))?;
        let positions = summary["acceptance_by_position"]
            .as_array()
            .map_or(0, |a| a.len());
        if positions == 0 {
            bail!("config `{label}` drafted nothing in the report: nothing to plan from");
        }
        let verify: Vec<(usize, f64)> = serde_json::from_value(report["verify_cost"].clone())
            .context("report lacks verify_cost")?;
        if verify.len() < 2 || verify[0] != (1, 1.0) || verify.windows(2).any(|w| w[0].0 >= w[1].0)
        {
            bail!("the report's verify_cost must be (1, 1.0) then points of increasing k");
        }
        let models = report["models"].as_array().context("report lacks models")?;
        let runs: Vec<serde_json::Value> = report["runs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["config"] == label)
            .cloned()
            .collect();
        let total = |f: &dyn Fn(&serde_json::Value) -> Option<f64>| -> f64 {
            runs.iter().filter_map(f).sum()
        };
        let rounds = total(&|r| r["target_calls"].as_f64());
        let accepted_at = |i: usize| total(&|r| r["accepted_at"][i].as_f64());
        let accept = (0..positions)
            .map(|i| {
                let before = if i == 0 { rounds } else { accepted_at(i - 1) };
                accepted_at(i) / before.max(1.0)
            })
            .collect();
        Ok(Self {
            label: label.to_string(),
            accept,
            verify,
            models: models.clone(),
            runs,
            rounds,
        })
    }

    /// A model's measured cost relative to the target (0 for unknown names).
    fn c(&self, model: &str) -> f64 {
        let m = self.models.iter().find(|x| x["model"] == model);
        m.and_then(|x| x["c_measured"].as_f64()).unwrap_or(0.0)
    }

    /// Forward passes of `model` over the config's runs.
    fn calls(&self, model: &str) -> f64 {
        let n = self.runs.iter().map(|r| r["model_calls"][model].as_f64());
        n.map(|n| n.unwrap_or(0.0)).fold(0.0, |a, b| a + b) // (an empty f64 sum is -0.0)
    }

    /// The target's cost of verifying `n` tokens, in one-token forwards.
    fn verify_cost(&self, n: usize) -> f64 {
        cascade::bench::interpolate(&self.verify, n as f64)
    }
}

fn rounded(v: &[f64]) -> Vec<f64> {
    v.iter().map(|a| (a * 100.0).round() / 100.0).collect()
}

fn slower(p: f64) -> &'static str {
    if p < 1.0 {
        ", slower than autoregressive decoding"
    } else {
        ""
    }
}

fn plan(args: PlanArgs) -> Result<()> {
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&args.report)
            .with_context(|| format!("cannot read {}", args.report.display()))?,
    )
    .with_context(|| format!("{} is not a bench report", args.report.display()))?;
    let label = args
        .config
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if args.max_k == 0 {
        bail!("--max-k must be >= 1");
    }
    let measured = Measured::from_report(&report, &label)?;
    let raw = RawConfig::load(&args.config)?;
    let mut doc: toml::Value = toml::from_str(&std::fs::read_to_string(&args.config)?)?;
    let horizontal = raw
        .target
        .drafter
        .as_ref()
        .and_then(|name| match raw.drafters.get(name) {
            Some(RawDrafter::Horizontal { schedule }) => Some((name, schedule)),
            _ => None,
        });
    let k = match horizontal {
        Some((name, schedule)) => {
            if let Some((d, _)) = schedule.iter().find(|(_, n)| *n == 0) {
                bail!(
                    "{}: `{d}` has 0 positions in the schedule of `{name}`",
                    args.config.display()
                );
            }
            let best = plan_schedule(&measured, &raw, schedule, args.max_k);
            let kept: Vec<toml::Value> = schedule
                .iter()
                .zip(&best)
                .filter(|(_, n)| **n > 0)
                .map(|((d, _), n)| toml::Value::Array(vec![d.as_str().into(), (*n as i64).into()]))
                .collect();
            let drafter = doc
                .get_mut("drafters")
                .and_then(|d| d.get_mut(name.as_str()));
            let drafter = drafter.and_then(|d| d.as_table_mut());
            drafter
                .context("the config's schedule is not a [drafters.<name>] table")?
                .insert("schedule".into(), toml::Value::Array(kept));
            best.iter().sum::<usize>()
        }
        None => plan_draft_length(&measured, args.max_k),
    };
    doc.get_mut("target")
        .and_then(|t| t.as_table_mut())
        .context("the config has no [target] table")?
        .insert("k".into(), toml::Value::Integer(k as i64));
    if let Some(out) = args.write {
        std::fs::write(&out, toml::to_string(&doc)?)?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// Leviathan section 3.5 with measured costs: prints the predicted speedup of each K and
/// returns the best.
fn plan_draft_length(m: &Measured, max_k: usize) -> usize {
    use cascade::theory;
    // Drafter cost per drafted token: model forward passes weighted by their measured c.
    let drafted: f64 = m.runs.iter().filter_map(|r| r["drafted"].as_f64()).sum();
    let model_cost = m
        .runs
        .iter()
        .flat_map(|r| r["model_calls"].as_object().into_iter().flatten())
        .map(|(model, n)| n.as_f64().unwrap_or(0.0) * m.c(model))
        .fold(0.0, |a, b| a + b); // (an empty f64 sum is -0.0)
    let cost = model_cost / drafted.max(1.0);
    let cpu = theory::plan_k(&m.accept, cost, &|n| m.verify_cost(n), max_k);
    let paper = theory::plan_k(&m.accept, cost, &|_| 1.0, max_k);
    println!(
        "config {}: acceptance by position {:?}, drafter cost {cost:.3} target calls per drafted token",
        m.label,
        rounded(&m.accept)
    );
    println!("| K | predicted speedup (verify = 1 call, the papers) | predicted speedup (measured r(K+1)) |\n|---|---|---|");
    for ((k, p), (_, c)) in paper.iter().zip(&cpu) {
        println!("| {k} | {p:.2} | {c:.2} |");
    }
    let (k, p) = cpu
        .iter()
        .copied()
        .fold((0, 0.0), |b, x| if x.1 > b.1 { x } else { b });
    println!(
        "best K on this machine: {k} (predicted {p:.2}x{})",
        slower(p)
    );
    k
}

/// CS Drafting Theorem 4.1 over the splits of a horizontal schedule: prints the best ones and
/// returns the best counts (one per scheduled drafter, possibly 0).
fn plan_schedule(
    m: &Measured,
    raw: &RawConfig,
    schedule: &[(String, usize)],
    max_k: usize,
) -> Vec<usize> {
    use cascade::theory;
    // Each segment: its measured acceptance by position, and the cost of the models it runs
    // per target call spread over its positions (a model shared by segments is charged by
    // their share of positions).
    let users = |model: &String| -> usize {
        let uses = |(d, _): &&(String, usize)| raw.model_files(d).contains(model);
        schedule.iter().filter(uses).map(|(_, n)| *n).sum()
    };
    let mut offset = 0;
    let segments: Vec<theory::Segment> = schedule
        .iter()
        .map(|(d, n)| {
            let per_round = raw
                .model_files(d)
                .iter()
                .map(|model| m.calls(model) * m.c(model) * *n as f64 / users(model) as f64)
                .fold(0.0, |a, b| a + b)
                / m.rounds.max(1.0);
            let end = (offset + n).min(m.accept.len());
            let segment = theory::Segment {
                accept: m.accept[offset.min(end)..end].to_vec(),
                cost: per_round / *n as f64,
            };
            offset += n;
            segment
        })
        .collect();
    let verify = |n: usize| m.verify_cost(n);
    let ranked = theory::plan_schedule(&segments, &verify, max_k);
    let paper = |counts: &[usize]| theory::schedule_improvement(&segments, counts, &|_| 1.0);
    let names: Vec<&str> = schedule.iter().map(|(d, _)| d.as_str()).collect();
    let current: Vec<usize> = schedule.iter().map(|(_, n)| *n).collect();
    println!("config {}: horizontal schedule over {names:?}", m.label);
    for (d, s) in names.iter().zip(&segments) {
        println!(
            "  {d}: acceptance by position {:?}, {:.3} target calls per drafted token",
            rounded(&s.accept),
            s.cost
        );
    }
    println!("| counts {names:?} | predicted speedup (verify = 1 call, the papers) | predicted speedup (measured r(K+1)) |\n|---|---|---|");
    for (counts, p) in ranked.iter().take(8) {
        println!("| {counts:?} | {:.2} | {p:.2} |", paper(counts));
    }
    let (best, p) = ranked[0].clone();
    println!(
        "current {current:?}: predicted {:.2}x; best on this machine: {best:?} (predicted {p:.2}x{})",
        theory::schedule_improvement(&segments, &current, &verify),
        slower(p)
    );
    best
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
