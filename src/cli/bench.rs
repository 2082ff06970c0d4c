//! `cascade bench`, `cascade plan` and `cascade calibrate`.

use super::generate::SamplingArgs;
use super::{bar, label, load_plan, Steps};
use anyhow::{bail, Context, Result};
use cascade::bench::{self, BenchConfig, BenchOptions, Report};
use cascade::config::RawConfig;
use cascade::files::write_atomically;
use cascade::model::ModelStore;
use cascade::sampling::Sampling;
use clap::Args;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Args)]
pub struct BenchArgs {
    /// Configs to compare (the first one's target also runs alone as the autoregressive baseline).
    #[arg(short, long, num_args = 1.., required = true)]
    configs: Vec<PathBuf>,
    /// Prompt suite (JSONL: category, prompt, chat).
    #[arg(short, long, default_value = "prompts/suite.jsonl")]
    prompts: PathBuf,
    /// Tokens generated per prompt.
    #[arg(short = 'n', long, default_value_t = 128)]
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
    /// Sampling settings for every config and the baseline (default: each config's own).
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Report folder (report.json, report.md, acceptance.svg, speedup.svg).
    #[arg(short, long, default_value = "reports/latest")]
    out: PathBuf,
}

#[derive(Args)]
pub struct PlanArgs {
    /// A report.json written by `cascade bench`. Without it, `plan` first runs a short
    /// calibration bench of the config (--prompts, --per-category, -n, --out).
    #[arg(short, long)]
    report: Option<PathBuf>,
    /// The config to plan for (its label in the report is the file stem).
    #[arg(short, long)]
    config: PathBuf,
    /// Largest K considered (for fixed draft lengths; an adaptive config sizes its drafts
    /// as it goes, and its plan is where its acceptance estimates start).
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

#[derive(Args)]
pub struct CalibrateArgs {
    /// Configs whose models to measure.
    #[arg(short, long, num_args = 1.., default_value = "configs/adaptive.toml")]
    configs: Vec<PathBuf>,
    /// The cost cache (default: $CASCADE_COSTS, else $XDG_CACHE_HOME/cascade/costs.json, else
    /// ~/.cache/cascade/costs.json).
    #[arg(long)]
    cache: Option<PathBuf>,
}

pub fn bench_command(args: BenchArgs) -> Result<Report> {
    let mut suite = bench::load_suite(&args.prompts)?;
    if args.max_new_tokens == 0 || args.repeats == 0 || args.per_category == Some(0) {
        bail!("-n/--max-new-tokens, --repeats and --per-category must be >= 1");
    }
    if let Some(n) = args.per_category {
        bench::per_category(&mut suite, n);
    }
    if suite.is_empty() {
        bail!("{}: the prompt suite is empty", args.prompts.display());
    }
    let configs = args
        .configs
        .iter()
        .map(|path| {
            let mut plan = load_plan(path, &RawConfig::load(path)?)?;
            super::warn_unused_k(path, &plan, "target.k");
            let mut histories = plan.without_histories();
            histories.sort(); // a drafter named in several places is built in each
            histories.dedup();
            if !histories.is_empty() {
                eprintln!(
                    "cascade: note: {}: benched without the Max-Gram history of {} (each run \
                     is measured on its own, and the file is left as it is)",
                    path.display(),
                    histories.join(", ")
                );
            }
            Ok(BenchConfig {
                label: label(path),
                plan,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    for (i, c) in configs.iter().enumerate() {
        if c.label == "autoregressive" || configs[..i].iter().any(|d| d.label == c.label) {
            bail!(
                "config label `{}` is taken (labels are file names without .toml; `autoregressive` is the baseline's): rename the file",
                c.label
            );
        }
    }
    // The flags replace every config's sampling; top-k and top-p alone would be greedy.
    if args.sampling.given() && args.sampling.temperature.is_none() {
        bail!("--top-k and --top-p take effect with --temperature (without it bench decodes greedily)");
    }
    let sampling = args
        .sampling
        .given()
        .then(|| args.sampling.over(Sampling::greedy()));
    if let Some(s) = sampling {
        s.validate()?;
    }
    let opts = BenchOptions {
        max_new_tokens: args.max_new_tokens,
        repeats: args.repeats,
        warmup_prompts: args.warmup.min(suite.len()), // as many as run, for the report
        sampling,
    };
    // The report's folder is checked now, not after the hour the suite may take.
    report_folder(&args.out)?;
    let stop = super::on_interrupt(
        "finishing the current run and writing the report",
        "exiting now, no report written",
    )?;
    let mut store = ModelStore::default();
    let started = bench::utc_now();
    eprintln!("loading {} configs, then running the suite", configs.len());
    let bar = bar("[{elapsed_precise}] [{bar:30}] {pos}/{len} {msg}");
    let (records, early_end) = bench::run(
        &configs,
        &suite,
        &opts,
        &mut store,
        &stop,
        &mut |done, total, what| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(what.to_string());
            if bar.is_hidden() {
                // Standard error is a log, not a terminal: one line per finished run.
                eprintln!("[{done}/{total}] {what}");
            }
        },
    )?;
    bar.finish_and_clear();
    if records.is_empty() {
        // Nothing to report: an earlier report in the folder stays as it was.
        let why = match early_end {
            Some(bench::EarlyEnd::Failed(e)) => e.to_string(),
            _ => "interrupted".to_string(),
        };
        bail!(
            "{why} before any run of the suite finished: no report written (what {} held is unchanged)",
            args.out.display()
        );
    }
    eprintln!("measuring every model's forward costs, side by side");
    let (verify_cost, models) =
        bench::measure_store_costs(&store, &configs.iter().map(|c| &c.plan).collect::<Vec<_>>())?;
    let k_of = |label: &str| {
        configs
            .iter()
            .find(|c| c.label == label)
            .map_or(0, |c| c.plan.options.k)
    };
    let summary = bench::summarize(&records, &models, &verify_cost, &k_of);
    let report = Report {
        date: started,
        threads: candle_core::utils::get_num_threads(),
        cpu: cascade::costs::cpu_name(),
        kernels: cascade::model::Kernels::detect()?.to_string(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        options: opts,
        verify_cost,
        models,
        runs: records,
        summary,
        interrupted: early_end.is_some(),
    };
    let table = report
        .write(&args.out)
        .with_context(|| format!("cannot write the report to {}", args.out.display()))?;
    println!("{table}\nreport: {}", args.out.display());
    if report.greedy_mismatches() > 0 {
        bail!(
            "{} greedy run(s) differ from autoregressive decoding: this is a bug",
            report.greedy_mismatches()
        );
    }
    if let Some(bench::EarlyEnd::Failed(e)) = early_end {
        bail!("{e} (the report holds the runs finished before it)")
    }
    Ok(report)
}

/// `cascade bench`: an interrupted one exits with status 1, so that a script tells it from
/// one that finished.
pub fn bench(args: BenchArgs) -> Result<()> {
    if bench_command(args)?.interrupted {
        bail!("interrupted: the report holds the runs finished before Ctrl-C")
    }
    Ok(())
}

/// Creates `dir`, the folder a report goes to, if missing; an error names it if it cannot be
/// one (a file is in the way, or the folder cannot be created or written to).
fn report_folder(dir: &Path) -> Result<()> {
    let what = || format!("the report folder {}", dir.display());
    if dir.exists() && !dir.is_dir() {
        bail!("{} is a file, not a folder", what());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", what()))?;
    // A folder that cannot take a file fails here, not after the run.
    let probe = dir.join(format!(".cascade-{}.probe", std::process::id()));
    std::fs::write(&probe, b"").with_context(|| format!("cannot write to {}", what()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

pub fn plan(args: PlanArgs) -> Result<()> {
    use cascade::planner;
    // A config holds at most MAX_DRAFT tokens per draft: a plan above it could not be written.
    if !(1..=cascade::config::MAX_DRAFT).contains(&args.max_k) {
        bail!(
            "--max-k must be between 1 and {}, got {}",
            cascade::config::MAX_DRAFT,
            args.max_k
        );
    }
    // Checked before a calibration bench that may take minutes. Writing over the config
    // itself would drop its comments and its user's choices.
    if let Some(out) = &args.write {
        let same = out
            .canonicalize()
            .is_ok_and(|o| args.config.canonicalize().is_ok_and(|c| o == c));
        if same {
            bail!(
                "--write {} is the config itself (writing drops its comments): name another file",
                out.display()
            );
        }
        if out.is_dir() {
            bail!(
                "--write {} is a folder: name the config file to write",
                out.display()
            );
        }
        // Only a config (a plan written before) is written over: `-r` and `--write` swapped
        // must not replace the report, nor a typo a prompt suite or a table.
        if let Ok(meta) = std::fs::metadata(out) {
            // A config is small: a model or table named by mistake is not read whole.
            let config = meta.len() <= 1 << 20
                && std::fs::read_to_string(out)
                    .is_ok_and(|t| t.trim().is_empty() || RawConfig::parse(&t, "").is_ok());
            if !config {
                bail!(
                    "--write {} is a file and no cascade config: the plan would replace it",
                    out.display()
                );
            }
        }
    }
    let (report, from) = match &args.report {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let report: Report = serde_json::from_str(&text).with_context(|| {
                format!(
                    "{} is not a report of this version of `cascade bench`",
                    path.display()
                )
            })?;
            (report, path.clone())
        }
        None => {
            eprintln!("no report given: calibrating with a short bench run");
            let report = bench_command(BenchArgs {
                configs: vec![args.config.clone()],
                prompts: args.prompts.clone(),
                max_new_tokens: args.max_new_tokens,
                repeats: 1,
                warmup: 1,
                per_category: Some(args.per_category),
                sampling: SamplingArgs {
                    temperature: None,
                    top_k: None,
                    top_p: None,
                },
                out: args.out.clone(),
            })?;
            (report, args.out.join("report.json"))
        }
    };
    if report.interrupted {
        eprintln!(
            "cascade: warning: {}: its bench was interrupted: planning from the runs it finished",
            from.display()
        );
    }
    let raw = RawConfig::load(&args.config)?;
    let config = load_plan(&args.config, &raw)?;
    let name = label(&args.config);
    let measured = planner::Measured::new(&report, &name)?;
    println!("config {name}, planned from {}:", from.display());
    if !report.cpu.is_empty() && report.cpu != cascade::costs::cpu_name() {
        eprintln!(
            "cascade: warning: the report was measured on another CPU ({}): its costs may not \
             hold on this one",
            report.cpu
        );
    }
    // An adaptive target sizes its drafts as it goes: what is planned is where its gate's
    // acceptance estimates start.
    let (levels, acceptance) = if config.adaptive {
        let acceptance = measured.acceptance();
        if acceptance.is_empty() {
            bail!("config `{name}` has no acceptance by confidence in the report");
        }
        println!(
            "\nacceptance at the target by confidence bucket (reviews), where the gate's \
             estimates start:\n{}",
            planner::acceptance_header()
        );
        acceptance.iter().for_each(|a| println!("{a}"));
        (Vec::new(), acceptance)
    } else {
        let levels = planner::plan_levels(&measured, &config, args.max_k)?;
        for l in &levels {
            println!("\n{l}");
        }
        (levels, Vec::new())
    };
    if let Some(out) = args.write {
        let slower = levels
            .iter()
            .any(|l| l.rating == planner::Rating::Speedup && l.ranked[0].2 < 1.0);
        if slower {
            eprintln!(
                "warning: even the best plan is slower than autoregressive decoding, by the report's costs"
            );
        }
        let mut doc: toml::Value = toml::from_str(&std::fs::read_to_string(&args.config)?)?;
        for warning in planner::write_best(&raw, &mut doc, &levels)? {
            eprintln!("warning: {warning}");
        }
        if !acceptance.is_empty() {
            planner::write_acceptance(&mut doc, &acceptance)?;
        }
        let base = args.config.parent().map(PathBuf::from).unwrap_or_default();
        planner::absolute_paths(&mut doc, &base);
        write_atomically(&out, toml::to_string(&doc)?.as_bytes())
            .with_context(|| format!("cannot write {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

pub fn calibrate(args: CalibrateArgs) -> Result<()> {
    use cascade::costs::{CostCache, CostEvent, Subject};
    // A cache path that can never be written fails before minutes of measuring.
    if let Some(dir) = args.cache.as_deref().filter(|p| p.is_dir()) {
        bail!(
            "--cache {} is a folder: name the cost cache file (e.g. {})",
            dir.display(),
            dir.join("costs.json").display()
        );
    }
    let mut store = ModelStore::default();
    let mut models = Vec::new();
    let mut plans = Vec::new();
    for path in &args.configs {
        let plan = load_plan(path, &RawConfig::load(path)?)?;
        for m in plan.models() {
            let mut steps = Steps::new();
            let label = cascade::config::file_label(&m.path);
            let what = format!("loading {label}");
            let loaded = store.load(&m.path, m.tokenizer.as_deref(), &mut |d, t| {
                steps.show(&what, d, t)
            })?;
            steps.finish();
            if !models
                .iter()
                .any(|x: &Arc<cascade::model::LoadedModel>| x.path == loaded.path)
            {
                models.push(loaded);
            }
        }
        plans.push(plan);
    }
    let trimmed = cascade::config::distinct_trimmed_vocabularies(&plans, &store)?;
    let path = args.cache.unwrap_or_else(CostCache::default_path);
    // Everything is measured again: a cache whose entries cannot be read is replaced.
    let (mut cache, damaged) = CostCache::open_to_replace(&path)?;
    if let Some(e) = damaged {
        eprintln!("cascade: warning: {e}: replacing it");
    }
    if let Some(newer) = cache.written_by_newer_build() {
        bail!(
            "{newer}: calibrating would replace its measurements; name another file with --cache"
        );
    }
    let subjects: Vec<Subject> = models
        .iter()
        .map(|m| m.as_ref().into())
        .chain(trimmed.iter().map(|(m, t)| Subject {
            model: m,
            vocabulary: Some(t),
        }))
        .collect();
    // Calibrating is for the cache: measurements it cannot keep are an error.
    let mut unsaved = None;
    let costs = cache.costs(&subjects, true, &mut |event| match event {
        CostEvent::Measuring(_) => eprintln!("{event}"),
        CostEvent::Contended { .. } => eprintln!("cascade: warning: {event}"),
        CostEvent::NotSaved(reason) => unsaved = Some(reason.to_string()),
    })?;
    if let Some(reason) = unsaved {
        bail!("{reason}");
    }
    println!("| model | decode ms | r(2) | r(4) | r(8) | r(16) | ms per 100 tokens of context |\n|---|---|---|---|---|---|---|");
    for (&s, c) in subjects.iter().zip(&costs) {
        println!(
            "| {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} |",
            CostCache::label(s),
            c.decode_seconds * 1e3,
            c.ratio(2.0),
            c.ratio(4.0),
            c.ratio(8.0),
            c.ratio(16.0),
            (c.seconds_at(1, cascade::costs::CONTEXT + 100) - c.seconds(1)) * 1e3
        );
    }
    println!(
        "{}: {} ({} threads)",
        path.display(),
        cascade::costs::cpu_name(),
        candle_core::utils::get_num_threads()
    );
    Ok(())
}
