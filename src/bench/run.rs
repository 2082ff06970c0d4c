//! Running a suite: every prompt through every config and through autoregressive decoding of
//! the same target, interleaved, in one process.

use super::measure::{measure_store_costs, ModelCost, VerifyCost};
use super::suite::SuitePrompt;
use super::summary::{summarize, Summary};
use crate::config::Plan;
use crate::draft::NodeKind;
use crate::engine::{Engine, GenerateOptions, Generation, SourceBuckets, Stats};
use crate::error::{Error, Result};
use crate::model::ModelStore;
use crate::review::ReviewCounts;
use crate::sampling::Sampling;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

/// A config under test: its label (file stem) and validated plan.
pub struct BenchConfig {
    /// The config's label (file stem).
    pub label: String,
    /// The validated config.
    pub plan: Plan,
}

/// The settings of a bench run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchOptions {
    /// Tokens generated per prompt.
    pub max_new_tokens: usize,
    /// Timed passes over the suite.
    pub repeats: usize,
    /// Untimed passes over the first prompts before timing (warms caches and page faults).
    pub warmup_prompts: usize,
    /// Sampling settings for every config and the baseline instead of each config's own.
    #[serde(default)]
    pub sampling: Option<Sampling>,
}

/// One generation (JSON `runs[]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRecord {
    /// Config label; `autoregressive` for the baseline.
    pub config: String,
    /// The prompt's category.
    pub category: String,
    /// The prompt's index in the suite.
    pub prompt: usize,
    /// Which timed pass over the suite.
    pub repeat: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Prompt processing time.
    pub prefill_seconds: f64,
    /// Generation time after the prompt.
    pub decode_seconds: f64,
    /// Generated tokens per second of decoding.
    pub decode_tokens_per_second: f64,
    /// Autoregressive decode time / this run's, same prompt and repeat.
    pub speedup: f64,
    /// The same end to end: the seconds autoregressive decoding takes to read the prompt and
    /// generate as many tokens as this run (at its measured decode rate), over this run's
    /// prefill and decode seconds. Lower than `speedup` where reading the prompt is a larger
    /// share of the time, or costs a drafter what its drafts save.
    #[serde(default)]
    pub end_to_end: f64,
    /// Target forward passes after the prompt.
    pub target_calls: usize,
    /// Tokens drafted for the target's review.
    pub drafted: usize,
    /// Drafted tokens the target accepted.
    pub accepted: usize,
    /// The target's reviews by draft position: `reviews`, `drafted_at`, `reached_at`,
    /// `accepted_at`.
    #[serde(flatten)]
    pub target: ReviewCounts,
    /// Adaptive drafting: the speedup the run-time cost model predicted.
    #[serde(default)]
    pub predicted_speedup: Option<f64>,
    /// Adaptive drafting: the target's reviews of each drafter by confidence bucket.
    #[serde(default)]
    pub acceptance_by_confidence: Vec<SourceBuckets>,
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
    /// The target's reviews by draft position.
    #[serde(flatten)]
    pub reviews: ReviewCounts,
    /// Adaptive inner drafts: this level's reviews by confidence bucket.
    #[serde(default)]
    pub acceptance_by_confidence: Vec<SourceBuckets>,
}

/// Decode speed of `run` relative to `base` (tokens per second, so that runs of different
/// lengths compare); 0 when either generated nothing.
pub fn speedup(base: &Stats, run: &Stats) -> f64 {
    ratio(
        base.decode_tokens_per_second(),
        run.decode_tokens_per_second(),
    )
}

/// [`speedup`] end to end: `base`'s prefill and decode time for as many tokens as `run`
/// generated (sampled runs differ in length, and the prefill weighs more in a shorter one)
/// over `run`'s.
pub fn end_to_end(base: &Stats, run: &Stats) -> f64 {
    if base.generated_tokens == 0 || run.generated_tokens == 0 {
        return 0.0;
    }
    let per_token = base.decode_seconds / base.generated_tokens as f64;
    let base_seconds = base.prefill_seconds + per_token * run.generated_tokens as f64;
    ratio(run.prefill_seconds + run.decode_seconds, base_seconds)
}

/// `run / base`, or 0 unless both are positive.
fn ratio(base: f64, run: f64) -> f64 {
    if base > 0.0 && run > 0.0 {
        run / base
    } else {
        0.0
    }
}

impl RunRecord {
    /// Sets the speedups of this run (`run`'s stats) over `base`, same prompt and repeat.
    fn compare_with(&mut self, base: &Stats, run: &Stats) {
        self.speedup = speedup(base, run);
        self.end_to_end = end_to_end(base, run);
    }
}

/// Options under which a run must reproduce the target's greedy tokens.
pub fn exact_greedy(o: &GenerateOptions) -> bool {
    o.sampling.is_greedy() && o.lenience == 1.0
}

/// The record of one generation (speedup 1 and no greedy check until compared).
/// One record of `g` for the report.
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
                    acceptance_by_confidence: n.acceptance_by_confidence.clone(),
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
        end_to_end: 1.0,
        target_calls: s.target_calls,
        drafted: s.drafted,
        accepted: s.accepted,
        target: s.reviews.clone(),
        predicted_speedup: s.predicted_speedup(),
        acceptance_by_confidence: s.acceptance_by_confidence.clone(),
        levels,
        model_calls,
        matches_autoregressive: None,
    }
}

/// Runs the suite: every prompt through autoregressive decoding (the first config's target
/// without drafter) and every config, in an order rotated per prompt so that machine drift
/// hits all configs alike. `progress(done, total)` after each run; `stop` ends early, and so
/// does a failed generation: the runs finished before are returned with why it ended.
pub fn run(
    configs: &[BenchConfig],
    suite: &[SuitePrompt],
    opts: &BenchOptions,
    store: &mut ModelStore,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<(Vec<RunRecord>, Option<EarlyEnd>)> {
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
    baseline_plan.options.lenience = 1.0; // the target's own output, whatever config 1 allows
    let options = |plan: &Plan| {
        let mut o = plan.options.clone();
        o.max_new_tokens = opts.max_new_tokens;
        if let Some(s) = opts.sampling {
            o.sampling = s;
        }
        o
    };
    // ... and their outputs must be comparable with it: the same sampling (the seed too, if
    // sampled) and stop strings.
    let base = options(&baseline_plan);
    for c in configs {
        let o = options(&c.plan);
        let sampled = !base.sampling.is_greedy() || !o.sampling.is_greedy();
        let (what, how) = if sampled && o.sampling != base.sampling {
            (
                "its sampling differs",
                " (--temperature, --top-k and --top-p set the sampling of all)",
            )
        } else if sampled && o.seed != base.seed {
            ("its seed differs", " (generation.seed)")
        } else if o.stop != base.stop {
            ("its stop strings differ", " (generation.stop)")
        } else {
            continue;
        };
        return Err(Error::config(
            &c.label,
            format!(
                "{what} from `{}`'s, and bench compares every config with one autoregressive run{how}",
                first.label
            ),
        ));
    }
    let mut engines: Vec<(String, Engine, GenerateOptions)> = Vec::new();
    let mut add = |label: &str, plan: &Plan, store: &mut ModelStore| -> Result<()> {
        // Named by its config's label, one of several.
        let engine = plan
            .build_with(store, &mut |_, _, _| {})
            .map_err(|e| Error::config(label, e.to_string()))?;
        engines.push((label.to_string(), engine, options(plan)));
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
    // Checked before the first run, so that a bad prompt does not end the bench halfway.
    let context = engines.iter().map(|(_, e, _)| e.target().max_len()).min();
    for (i, (p, tokens)) in suite.iter().zip(&prompts).enumerate() {
        let problem = match context {
            // A chat prompt's template adds tokens around it: its own text must be there.
            _ if tokens.is_empty() || p.prompt.is_empty() => "is empty".to_string(),
            Some(c) if tokens.len() >= c => {
                format!("has {} tokens but the context holds {c}", tokens.len())
            }
            _ => continue,
        };
        let which = match p.line {
            0 => format!("prompt {} of the suite", i + 1),
            line => format!("the prompt on line {line} of the suite"),
        };
        return Err(Error::config(
            "--prompts",
            format!("{which} ({}) {problem}", p.category),
        ));
    }
    let n = engines.len();
    let total = (opts.warmup_prompts.min(suite.len()) + suite.len() * opts.repeats) * n;
    let mut done = 0;
    for (i, tokens) in prompts.iter().enumerate().take(opts.warmup_prompts) {
        for (label, e, o) in &mut engines {
            if stop.load(Ordering::Relaxed) {
                return Ok((Vec::new(), Some(EarlyEnd::Interrupted)));
            }
            e.forget();
            if let Err(e) = e.generate(tokens, o, &mut |_| {}) {
                return Ok((Vec::new(), Some(EarlyEnd::Failed(e))));
            }
            done += 1;
            progress(done, total, &format!("warm-up {label}, prompt {i}"));
        }
    }
    let mut records = Vec::new();
    for repeat in 0..opts.repeats {
        for (i, (p, tokens)) in suite.iter().zip(&prompts).enumerate() {
            let mut outputs: Vec<Option<Generation>> = vec![None; n];
            let mut early_end = None;
            for j in 0..n {
                let slot = (i + repeat + j) % n;
                if stop.load(Ordering::Relaxed) {
                    early_end = Some(EarlyEnd::Interrupted);
                    break;
                }
                let (label, e, o) = &mut engines[slot];
                // Every run reads its prompt whole, as the first request would.
                e.forget();
                match e.generate(tokens, o, &mut |_| {}) {
                    Ok(out) => outputs[slot] = Some(out),
                    Err(e) => {
                        early_end = Some(EarlyEnd::Failed(e));
                        break;
                    }
                }
                done += 1;
                progress(done, total, &format!("{label}, {} prompt {i}", p.category));
            }
            // The runs of a prompt the bench ended in count too, those with a baseline run.
            let Some(base) = outputs[0].take() else {
                return Ok((records, early_end));
            };
            let mut base_record = record("autoregressive", p, i, repeat, &base);
            base_record.matches_autoregressive = Some(true);
            records.push(base_record);
            for (j, out) in outputs.into_iter().enumerate().skip(1) {
                let Some(out) = out else { continue };
                let mut r = record(&engines[j].0, p, i, repeat, &out);
                r.compare_with(&base.stats, &out.stats);
                if exact_greedy(&engines[0].2) && exact_greedy(&engines[j].2) {
                    r.matches_autoregressive = Some(out.tokens == base.tokens);
                }
                records.push(r);
            }
            if early_end.is_some() {
                return Ok((records, early_end));
            }
        }
    }
    Ok((records, None))
}

/// Why a bench ended before its last run: the records finished until then are kept.
#[derive(Debug)]
pub enum EarlyEnd {
    /// `stop` was set (Ctrl-C).
    Interrupted,
    /// A generation failed.
    Failed(Error),
}

/// `generate --compare`: each sample decoded again by the target alone (same options, same
/// process), and the bench's figures for this one prompt.
pub struct Comparison {
    /// Per sample: the autoregressive run, and whether its tokens equal the sample's.
    pub samples: Vec<(Generation, bool)>,
    /// The target's measured r(k).
    pub verify_cost: VerifyCost,
    /// Every model's measured cost.
    pub models: Vec<ModelCost>,
    /// The bench summary of `label` over the samples.
    pub summary: Option<Summary>,
}

/// Decodes `prompt` with the target alone for each of `samples` (generated by `engine` with
/// `plan`, seed by seed), pairs the runs as the bench does, measures the models of `store`, and
/// summarizes.
pub fn compare(
    engine: &mut Engine,
    store: &ModelStore,
    plan: &Plan,
    label: &str,
    (text, prompt): (&str, &[u32]),
    samples: &[(u64, Generation)],
) -> Result<Comparison> {
    let suite_prompt = SuitePrompt {
        category: "prompt".into(),
        prompt: text.to_string(),
        chat: plan.chat,
        line: 0,
    };
    let mut records = Vec::new();
    let mut pairs = Vec::new();
    let drafter = engine.drafter.take();
    let outcome = samples
        .iter()
        .enumerate()
        .try_for_each(|(i, (seed, spec))| {
            let opts = GenerateOptions {
                seed: *seed,
                ..plan.options.clone()
            };
            engine.forget();
            let ar = engine.generate(prompt, &opts, &mut |_| {})?;
            let same = ar.tokens == spec.tokens;
            let mut r = record(label, &suite_prompt, 0, i, spec);
            r.compare_with(&ar.stats, &spec.stats);
            r.matches_autoregressive = exact_greedy(&plan.options).then_some(same);
            records.push(r);
            records.push(record("autoregressive", &suite_prompt, 0, i, &ar));
            pairs.push((ar, same));
            Ok::<(), Error>(())
        });
    engine.drafter = drafter;
    outcome?;
    let (verify_cost, models) = measure_store_costs(store, &[plan])?;
    let k_of = |l: &str| if l == label { plan.options.k } else { 0 };
    let summary = summarize(&records, &models, &verify_cost, &k_of)
        .into_iter()
        .find(|s| s.config == label && s.category == "all");
    Ok(Comparison {
        samples: pairs,
        verify_cost,
        models,
        summary,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(tokens: usize, prefill: f64, decode: f64) -> Stats {
        Stats {
            generated_tokens: tokens,
            prefill_seconds: prefill,
            decode_seconds: decode,
            ..Stats::default()
        }
    }

    #[test]
    fn end_to_end_counts_the_prefill_for_as_many_tokens_as_the_run() {
        // Plain decoding: 6 s of prefill, 100 tokens in 5 s.
        let base = stats(100, 6.0, 5.0);
        // Twice the decode speed: 2x, but 11 s against 8.5 s end to end.
        let run = stats(100, 6.0, 2.5);
        assert_eq!(speedup(&base, &run), 2.0);
        let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        close(end_to_end(&base, &run), 11.0 / 8.5);
        // A sampled run half as long: plain decoding would take 6 + 2.5 s for it.
        let short = stats(50, 6.0, 1.25);
        close(end_to_end(&base, &short), 8.5 / 7.25);
        // A drafter that reads the prompt for 3 s loses end to end what it wins decoding.
        let reads = stats(100, 9.0, 2.5);
        assert!(end_to_end(&base, &reads) < 1.0);
        assert_eq!(end_to_end(&base, &stats(0, 1.0, 0.0)), 0.0);
    }
}
