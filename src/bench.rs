//! The bench harness: a prompt suite across configs, interleaved, against autoregressive
//! decoding of the same prompts in the same process, with the papers' metrics beside the
//! measured ones. The JSON report's fields are documented on the types below.

use crate::config::{file_label, Plan};
use crate::draft::NodeKind;
use crate::engine::{Engine, GenerateOptions, Generation, Stats};
use crate::error::{Error, Result};
use crate::model::{LoadedModel, Model, ModelStore};
use crate::review::ReviewCounts;
use crate::theory;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// One line of a prompt suite (JSONL).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SuitePrompt {
    pub category: String,
    pub prompt: String,
    /// Wrap the prompt in the model's chat template.
    #[serde(default)]
    pub chat: bool,
}

/// Reads a JSONL prompt suite; errors name the line.
pub fn load_suite(path: &Path) -> Result<Vec<SuitePrompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::config(
            path.display().to_string(),
            format!("cannot read prompt suite: {e}"),
        )
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .map_err(|e| Error::config(format!("{}:{}", path.display(), i + 1), e.to_string()))
        })
        .collect()
}

/// A config under test: its label (file stem) and validated plan.
pub struct BenchConfig {
    pub label: String,
    pub plan: Plan,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchOptions {
    pub max_new_tokens: usize,
    /// Timed passes over the suite.
    pub repeats: usize,
    /// Untimed passes over the first prompts before timing (warms caches and page faults).
    pub warmup_prompts: usize,
}

/// One generation (JSON `runs[]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRecord {
    /// Config label; `autoregressive` for the baseline.
    pub config: String,
    pub category: String,
    pub prompt: usize,
    pub repeat: usize,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub decode_tokens_per_second: f64,
    /// Autoregressive decode time / this run's, same prompt and repeat.
    pub speedup: f64,
    pub target_calls: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// The target's reviews by draft position: `reviews`, `drafted_at`, `reached_at`,
    /// `accepted_at`.
    #[serde(flatten)]
    pub target: ReviewCounts,
    /// Every review inside the drafter tree (vertical cascades), by node.
    pub levels: Vec<LevelRecord>,
    /// Forward passes per drafter model (by file name).
    pub model_calls: BTreeMap<String, usize>,
    /// Greedy runs: whether the tokens equal the autoregressive ones. `None` when sampling.
    pub matches_autoregressive: Option<bool>,
}

/// A cascade level of one run (JSON `runs[].levels[]`): a vertical cascade's reviews of its
/// inner drafter.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LevelRecord {
    /// The vertical cascade's node name (`<name>.d<i>` for K-matrix reviewers).
    pub node: String,
    /// Its reviewer model (file name).
    pub model: String,
    #[serde(flatten)]
    pub reviews: ReviewCounts,
}

/// A model's measured cost (JSON `models[]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelCost {
    pub model: String,
    pub params: usize,
    /// Median one-token decode time after a 64-token context.
    pub decode_ms: f64,
    /// (k, r(k)): this model's forward over k tokens relative to one token (a reviewer's
    /// verify cost).
    pub forward_cost: Vec<(usize, f64)>,
    /// `decode_ms` relative to the target's: the measured cost coefficient c.
    pub c_measured: f64,
    /// Parameter count relative to the target's (the paper's "model size" cost model).
    pub c_params: f64,
}

/// Aggregates per config and category (JSON `summary[]`; category `all` for the whole suite).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Summary {
    pub config: String,
    pub category: String,
    pub runs: usize,
    pub decode_tokens_per_second: f64,
    pub speedup_mean: f64,
    pub speedup_sd: f64,
    /// Mean tokens per target call, bonus included (1 for autoregressive).
    pub tokens_per_call: f64,
    pub mean_draft_len: f64,
    /// Acceptance at each draft position given it was reviewed (CS Drafting's a_i).
    pub acceptance_by_position: Vec<f64>,
    /// The same for each cascade level inside the drafter tree, by node name.
    pub acceptance_by_level: BTreeMap<String, Vec<f64>>,
    /// Standardized walltime improvement, costs by parameter count and by measured time.
    pub swi_params: f64,
    pub swi_measured: f64,
    /// Theorem 4.1 with the measured a_i and drafter costs, verify counted as one call.
    pub predicted_paper: f64,
    /// The same with the verify forward's measured cost r(k + 1).
    pub predicted_cpu: f64,
    pub greedy_mismatches: usize,
}

/// The whole report (`report.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub date: String,
    pub threads: usize,
    pub command: String,
    pub options: BenchOptions,
    /// (k, r(k)): target forward over k tokens relative to one.
    pub verify_cost: Vec<(usize, f64)>,
    pub models: Vec<ModelCost>,
    pub runs: Vec<RunRecord>,
    pub summary: Vec<Summary>,
    /// True if Ctrl-C stopped the run early (the report holds what was gathered).
    pub interrupted: bool,
}

/// Measured (k, r(k)) points: a target forward over k tokens relative to one token.
pub type VerifyCost = Vec<(usize, f64)>;

/// Median seconds of a forward over `k` new tokens of `models[i]` after a 64-token context,
/// for every `(i, k)` of `runs`, interleaved repetition by repetition so that machine drift
/// hits them alike.
fn forward_seconds(
    models: &mut [Box<dyn Model>],
    runs: &[(usize, usize)],
    reps: usize,
) -> Result<Vec<f64>> {
    let ctx: Vec<u32> = (0..64).map(|i| 100 + i * 7).collect();
    for model in models.iter_mut() {
        model.truncate(0);
        model.prefill(&ctx)?;
    }
    let mut times = vec![Vec::with_capacity(reps); runs.len()];
    for rep in 0..=reps {
        for (t, &(i, k)) in times.iter_mut().zip(runs) {
            let feed: Vec<u32> = (0..k as u32).map(|i| 300 + i).collect();
            let start = Instant::now();
            models[i].forward(&feed)?;
            if rep > 0 {
                t.push(start.elapsed().as_secs_f64()); // the first round is a warm-up
            }
            models[i].truncate(ctx.len());
        }
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

/// Measures r(k) for the target and the cost coefficient of every other model.
pub fn measure_costs(
    target: &LoadedModel,
    others: &[&LoadedModel],
) -> Result<(VerifyCost, Vec<ModelCost>)> {
    const KS: [usize; 5] = [1, 2, 4, 8, 16];
    let mut models: Vec<Box<dyn Model>> = vec![Box::new(target.instance("target", None))];
    models.extend(
        others
            .iter()
            .map(|m| Box::new(m.instance("m", None)) as Box<dyn Model>),
    );
    // Every model at every k (reviewers verify too).
    let runs: Vec<(usize, usize)> = (0..models.len())
        .flat_map(|i| KS.iter().map(move |&k| (i, k)))
        .collect();
    let s = forward_seconds(&mut models, &runs, 8)?;
    let tp = target.weights.param_count() as f64;
    let costs: Vec<ModelCost> = std::iter::once(target)
        .chain(others.iter().copied())
        .zip(s.chunks(KS.len()))
        .map(|(m, t)| ModelCost {
            model: file_label(&m.path),
            params: m.weights.param_count(),
            decode_ms: t[0] * 1e3,
            forward_cost: KS.iter().zip(t).map(|(&k, x)| (k, x / t[0])).collect(),
            c_measured: t[0] / s[0],
            c_params: m.weights.param_count() as f64 / tp,
        })
        .collect();
    Ok((costs[0].forward_cost.clone(), costs))
}

/// [`measure_costs`] for the models of `store`, the one at `target` being the target.
pub fn measure_store_costs(
    store: &ModelStore,
    target: &Path,
) -> Result<(VerifyCost, Vec<ModelCost>)> {
    let loaded: Vec<_> = store.loaded().collect();
    let (t, others): (Vec<_>, Vec<_>) = loaded.into_iter().partition(|m| m.path == target);
    let t = t.first().ok_or_else(|| {
        Error::config(
            target.display().to_string(),
            "the target model was not loaded",
        )
    })?;
    let others: Vec<&LoadedModel> = others.into_iter().map(|m| m.as_ref()).collect();
    measure_costs(t, &others)
}

/// The current time as `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    let (h, m) = (secs % 86_400 / 3_600, secs % 3_600 / 60);
    format!("{year:04}-{month:02}-{day:02} {h:02}:{m:02} UTC")
}

/// r(k) by linear interpolation of the measured points.
pub fn interpolate(points: &[(usize, f64)], k: f64) -> f64 {
    let mut prev = points[0];
    for &p in points {
        if k <= p.0 as f64 {
            let span = (p.0 - prev.0) as f64;
            return if span == 0.0 {
                p.1
            } else {
                prev.1 + (p.1 - prev.1) * (k - prev.0 as f64) / span
            };
        }
        prev = p;
    }
    let (a, b) = (points[points.len() - 2], points[points.len() - 1]);
    b.1 + (b.1 - a.1) / (b.0 - a.0) as f64 * (k - b.0 as f64)
}

/// Decode speed of `run` relative to `base` (tokens per second, so that runs of different
/// lengths compare); 0 when either generated nothing.
pub fn speedup(base: &Stats, run: &Stats) -> f64 {
    let (b, r) = (
        base.decode_tokens_per_second(),
        run.decode_tokens_per_second(),
    );
    if b > 0.0 && r > 0.0 {
        r / b
    } else {
        0.0
    }
}

/// Options under which a run must reproduce the target's greedy tokens.
pub fn exact_greedy(o: &GenerateOptions) -> bool {
    o.sampling.is_greedy() && o.lenience == 1.0
}

/// The record of one generation (speedup 1 and no greedy check until compared).
pub fn record(
    config: &str,
    p: &SuitePrompt,
    index: usize,
    repeat: usize,
    g: &Generation,
) -> RunRecord {
    let s = &g.stats;
    let mut model_calls = BTreeMap::new();
    let mut levels = Vec::new();
    if let Some(tree) = &g.drafter {
        tree.model_calls(&mut model_calls);
        tree.visit(&mut |n| {
            if let (Some(model), NodeKind::Vertical) = (&n.model, &n.kind) {
                levels.push(LevelRecord {
                    node: n.name.clone(),
                    model: model.clone(),
                    reviews: n.reviews.clone(),
                });
            }
        });
    }
    RunRecord {
        config: config.to_string(),
        category: p.category.clone(),
        prompt: index,
        repeat,
        prompt_tokens: s.prompt_tokens,
        generated_tokens: s.generated_tokens,
        prefill_seconds: s.prefill_seconds,
        decode_seconds: s.decode_seconds,
        decode_tokens_per_second: s.decode_tokens_per_second(),
        speedup: 1.0,
        target_calls: s.target_calls,
        drafted: s.drafted,
        accepted: s.accepted,
        target: s.reviews.clone(),
        levels,
        model_calls,
        matches_autoregressive: None,
    }
}

/// Runs the suite: every prompt through autoregressive decoding (the first config's target
/// without drafter) and every config, in an order rotated per prompt so that machine drift
/// hits all configs alike. `progress(done, total)` after each run; `stop` ends early.
pub fn run(
    configs: &[BenchConfig],
    suite: &[SuitePrompt],
    opts: &BenchOptions,
    store: &mut ModelStore,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<(Vec<RunRecord>, bool)> {
    let first = configs
        .first()
        .ok_or_else(|| Error::config("--configs", "no config to bench"))?;
    // One autoregressive baseline serves every config: they must share its target.
    if let Some(c) = configs.iter().find(|c| {
        (&c.plan.target.path, &c.plan.target.tokenizer)
            != (&first.plan.target.path, &first.plan.target.tokenizer)
    }) {
        return Err(Error::config(
            &c.label,
            format!(
                "its target differs from `{}`'s; bench compares configs over one target",
                first.label
            ),
        ));
    }
    let mut baseline_plan = first.plan.clone();
    baseline_plan.drafter = None;
    let mut engines: Vec<(String, Engine, GenerateOptions)> = Vec::new();
    let mut add = |label: &str, plan: &Plan, store: &mut ModelStore| -> Result<()> {
        let engine = plan.build_with(store, &mut |_, _, _| {})?;
        let mut o = plan.options.clone();
        o.max_new_tokens = opts.max_new_tokens;
        engines.push((label.to_string(), engine, o));
        Ok(())
    };
    add("autoregressive", &baseline_plan, store)?;
    for c in configs {
        add(&c.label, &c.plan, store)?;
    }
    let prompts: Vec<Vec<u32>> = suite
        .iter()
        .map(|p| {
            let t = &engines[0].1.tokenizer;
            let text = if p.chat {
                crate::chat::apply(t, None, &p.prompt)?
            } else {
                p.prompt.clone()
            };
            t.encode(&text)
        })
        .collect::<Result<_>>()?;
    let n = engines.len();
    let total = (opts.warmup_prompts.min(suite.len()) + suite.len() * opts.repeats) * n;
    let mut done = 0;
    for (i, tokens) in prompts.iter().enumerate().take(opts.warmup_prompts) {
        for (label, e, o) in &mut engines {
            if stop.load(Ordering::Relaxed) {
                return Ok((Vec::new(), true));
            }
            e.generate(tokens, o, &mut |_| {})?;
            done += 1;
            progress(done, total, &format!("warm-up {label}, prompt {i}"));
        }
    }
    let mut records = Vec::new();
    for repeat in 0..opts.repeats {
        for (i, (p, tokens)) in suite.iter().zip(&prompts).enumerate() {
            let mut outputs: Vec<Option<Generation>> = vec![None; n];
            for j in 0..n {
                let slot = (i + repeat + j) % n;
                if stop.load(Ordering::Relaxed) {
                    return Ok((records, true));
                }
                let (label, e, o) = &mut engines[slot];
                outputs[slot] = Some(e.generate(tokens, o, &mut |_| {})?);
                done += 1;
                progress(done, total, &format!("{label}, {} prompt {i}", p.category));
            }
            let base = outputs[0].take().unwrap();
            let mut base_record = record("autoregressive", p, i, repeat, &base);
            base_record.matches_autoregressive = Some(true);
            records.push(base_record);
            for (j, out) in outputs.into_iter().enumerate().skip(1) {
                let out = out.unwrap();
                let mut r = record(&engines[j].0, p, i, repeat, &out);
                r.speedup = speedup(&base.stats, &out.stats);
                if exact_greedy(&engines[0].2) && exact_greedy(&engines[j].2) {
                    r.matches_autoregressive = Some(out.tokens == base.tokens);
                }
                records.push(r);
            }
        }
    }
    Ok((records, false))
}

fn mean(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = v.collect();
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}

/// Aggregates runs per (config, category) and per config over the whole suite.
pub fn summarize(
    records: &[RunRecord],
    models: &[ModelCost],
    verify: &[(usize, f64)],
    k_of: &dyn Fn(&str) -> usize,
) -> Vec<Summary> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in records {
        for cat in [r.category.clone(), "all".to_string()] {
            let key = (r.config.clone(), cat);
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    let cost = |m: &str| models.iter().find(|c| c.model == m);
    keys.into_iter()
        .map(|(config, category)| {
            let rs: Vec<&RunRecord> = records
                .iter()
                .filter(|r| r.config == config && (category == "all" || r.category == category))
                .collect();
            let tokens: usize = rs.iter().map(|r| r.generated_tokens).sum();
            let calls: usize = rs.iter().map(|r| r.target_calls).sum();
            let seconds: f64 = rs.iter().map(|r| r.decode_seconds).sum();
            let (speedup_mean, speedup_sd) = mean(rs.iter().map(|r| r.speedup));
            let mut target = ReviewCounts::default();
            let mut levels: BTreeMap<String, ReviewCounts> = BTreeMap::new();
            for r in &rs {
                target.add(&r.target);
                for l in &r.levels {
                    levels.entry(l.node.clone()).or_default().add(&l.reviews);
                }
            }
            let mut model_calls: BTreeMap<&str, usize> = BTreeMap::new();
            for r in &rs {
                for (m, c) in &r.model_calls {
                    *model_calls.entry(m).or_default() += c;
                }
            }
            let weighted = |f: &dyn Fn(&ModelCost) -> f64| -> Vec<(usize, f64)> {
                model_calls
                    .iter()
                    .map(|(m, &c)| (c, cost(m).map_or(0.0, f)))
                    .collect()
            };
            let swi_params = theory::swi(tokens, calls, &weighted(&|c| c.c_params));
            let swi_measured = theory::swi(tokens, calls, &weighted(&|c| c.c_measured));
            // Drafter cost per target call in target-call units, and the expected tokens per
            // call from the measured acceptance over the configured draft length.
            let drafter_cost: f64 = weighted(&|c| c.c_measured)
                .iter()
                .map(|(n, c)| *n as f64 * c)
                .sum::<f64>()
                / calls.max(1) as f64;
            let k = if config == "autoregressive" {
                0
            } else {
                k_of(&config)
            };
            let mut accept = target.chain_acceptance();
            accept.resize(k, 0.0);
            let expected = theory::position_dependent_tokens(&accept);
            let mean_draft_len = target.mean_draft_len();
            Summary {
                runs: rs.len(),
                decode_tokens_per_second: tokens as f64 / seconds.max(1e-9),
                speedup_mean,
                speedup_sd,
                tokens_per_call: tokens as f64 / calls.max(1) as f64,
                mean_draft_len,
                acceptance_by_position: target.acceptance_by_position(),
                acceptance_by_level: levels
                    .iter()
                    .map(|(n, c)| (n.clone(), c.acceptance_by_position()))
                    .collect(),
                swi_params,
                swi_measured,
                predicted_paper: expected / (1.0 + drafter_cost),
                predicted_cpu: expected
                    / (interpolate(verify, mean_draft_len + 1.0) + drafter_cost),
                greedy_mismatches: rs
                    .iter()
                    .filter(|r| r.matches_autoregressive == Some(false))
                    .count(),
                config,
                category,
            }
        })
        .collect()
}

/// The terminal / README table: one row per config over the whole suite, then speedup per
/// category.
pub fn markdown(summary: &[Summary]) -> String {
    let mut out = String::from(
        "| config | tokens/s | speedup (± sd) | tokens/call | SWI (params) | SWI (measured c) | predicted (paper) | predicted (CPU) | greedy mismatches |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in summary.iter().filter(|s| s.category == "all") {
        out += &format!(
            "| {} | {:.1} | {:.2} ± {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} |\n",
            s.config,
            s.decode_tokens_per_second,
            s.speedup_mean,
            s.speedup_sd,
            s.tokens_per_call,
            s.swi_params,
            s.swi_measured,
            s.predicted_paper,
            s.predicted_cpu,
            s.greedy_mismatches
        );
    }
    let mut cats: Vec<&str> = summary
        .iter()
        .map(|s| s.category.as_str())
        .filter(|c| *c != "all")
        .collect();
    cats.sort();
    cats.dedup();
    out += &format!(
        "\n| speedup by category | {} |\n|---|{}\n",
        cats.join(" | "),
        "---|".repeat(cats.len())
    );
    let mut configs: Vec<&str> = Vec::new();
    for s in summary {
        if !configs.contains(&s.config.as_str()) {
            configs.push(&s.config);
        }
    }
    for c in configs {
        let cells: Vec<String> = cats
            .iter()
            .map(|cat| {
                summary
                    .iter()
                    .find(|s| s.config == c && s.category == *cat)
                    .map_or("-".into(), |s| format!("{:.2}", s.speedup_mean))
            })
            .collect();
        out += &format!("| {c} | {} |\n", cells.join(" | "));
    }
    out + &acceptance_table(summary)
}

/// Acceptance by draft position at every review level (CS Drafting Figure 1), over the
/// suite, for the first positions.
fn acceptance_table(summary: &[Summary]) -> String {
    const SHOWN: usize = 10;
    let mut rows: Vec<(String, &[f64])> = Vec::new();
    for s in summary.iter().filter(|s| s.category == "all") {
        if !s.acceptance_by_position.is_empty() {
            rows.push((format!("{} (target)", s.config), &s.acceptance_by_position));
        }
        for (node, a) in &s.acceptance_by_level {
            rows.push((format!("{}: `{node}`", s.config), a));
        }
    }
    let width = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).min(SHOWN);
    if width == 0 {
        return String::new();
    }
    let mut out = format!(
        "\n| acceptance by draft position | {} |\n|---|{}\n",
        (1..=width)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(width)
    );
    for (name, a) in rows {
        let cells: Vec<String> = (0..width)
            .map(|i| a.get(i).map_or("-".into(), |x| format!("{x:.2}")))
            .collect();
        out += &format!("| {name} | {} |\n", cells.join(" | "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_now_is_a_plausible_date() {
        let d = utc_now();
        assert_eq!(d.len(), "2026-11-22 07:28 UTC".len(), "{d}");
        let year: i32 = d[..4].parse().unwrap();
        let month: u32 = d[5..7].parse().unwrap();
        let day: u32 = d[8..10].parse().unwrap();
        assert!(
            year >= 2024 && (1..=12).contains(&month) && (1..=31).contains(&day),
            "{d}"
        );
    }

    #[test]
    fn interpolation_between_and_beyond_measured_points() {
        let pts = [(1, 1.0), (2, 1.4), (4, 2.0), (8, 3.0)];
        assert_eq!(interpolate(&pts, 1.0), 1.0);
        assert!((interpolate(&pts, 3.0) - 1.7).abs() < 1e-12);
        assert!((interpolate(&pts, 10.0) - 3.5).abs() < 1e-12);
    }
}
