//! Aggregating a bench's runs per config and category, with the papers' metrics (SWI,
//! Theorem 3.8 / 4.1 predictions) beside the measured speedup.

use super::measure::ModelCost;
use super::run::RunRecord;
use crate::costs::interpolate;
use crate::engine::SourceBuckets;
use crate::review::ReviewCounts;
use crate::theory;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Aggregates per config and category (JSON `summary[]`; category `all` for the whole suite).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Summary {
    /// The config's label.
    pub config: String,
    /// The category, or `all`.
    pub category: String,
    /// Runs aggregated.
    pub runs: usize,
    /// Decode speed over the runs together: their tokens over their seconds.
    pub decode_tokens_per_second: f64,
    /// Mean speedup over autoregressive decoding of the same prompts (of the runs where both
    /// generated tokens).
    pub speedup_mean: f64,
    /// Standard deviation of the per-prompt speedups.
    pub speedup_sd: f64,
    /// Mean end-to-end speedup (prefill and decode) over autoregressive decoding.
    #[serde(default)]
    pub end_to_end_mean: f64,
    /// Tokens per target call over the runs together, bonus included (1 for autoregressive).
    pub tokens_per_call: f64,
    /// Mean draft length per target call.
    pub mean_draft_len: f64,
    /// Acceptance at each draft position given it was reviewed (CS Drafting's a_i).
    pub acceptance_by_position: Vec<f64>,
    /// The same for each cascade level inside the drafter tree, by node name.
    pub acceptance_by_level: BTreeMap<String, Vec<f64>>,
    /// Standardized walltime improvement, costs by parameter count and by measured time.
    pub swi_params: f64,
    /// SWI with costs by measured time.
    pub swi_measured: f64,
    /// Theorem 4.1 with the measured a_i and drafter costs, verify counted as one call.
    pub predicted_paper: f64,
    /// The same with the verify forward's measured cost r(k + 1).
    pub predicted_cpu: f64,
    /// Adaptive drafting: the speedup the run-time cost model predicted (mean over runs).
    #[serde(default)]
    pub predicted_runtime: Option<f64>,
    /// Adaptive drafting: the target's reviews of each drafter by confidence bucket.
    #[serde(default)]
    pub acceptance_by_confidence: Vec<SourceBuckets>,
    /// Greedy runs whose tokens differ from autoregressive decoding (must be 0).
    pub greedy_mismatches: usize,
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
            // A run where either side generated nothing has no speedup (0): left out.
            let (speedup_mean, speedup_sd) =
                mean(rs.iter().map(|r| r.speedup).filter(|&s| s > 0.0));
            let (end_to_end_mean, _) = mean(rs.iter().map(|r| r.end_to_end).filter(|&s| s > 0.0));
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
                end_to_end_mean,
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
                predicted_runtime: {
                    let p: Vec<f64> = rs.iter().filter_map(|r| r.predicted_speedup).collect();
                    (!p.is_empty()).then(|| p.iter().sum::<f64>() / p.len() as f64)
                },
                acceptance_by_confidence: merge_buckets(
                    rs.iter().map(|r| &r.acceptance_by_confidence),
                ),
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

/// Adds up per-drafter bucket counts.
fn merge_buckets<'a>(runs: impl Iterator<Item = &'a Vec<SourceBuckets>>) -> Vec<SourceBuckets> {
    let mut out: Vec<SourceBuckets> = Vec::new();
    for r in runs.flatten() {
        let entry = match out.iter_mut().find(|s| s.drafter == r.drafter) {
            Some(e) => e,
            None => {
                out.push(SourceBuckets {
                    drafter: r.drafter.clone(),
                    buckets: Vec::new(),
                });
                out.last_mut().expect("just pushed")
            }
        };
        for b in &r.buckets {
            match entry.buckets.iter_mut().find(|x| x.up_to == b.up_to) {
                Some(x) => {
                    x.reviewed += b.reviewed;
                    x.accepted += b.accepted;
                }
                None => entry.buckets.push(b.clone()),
            }
        }
        entry.buckets.sort_by(|a, b| {
            a.up_to
                .unwrap_or(f32::INFINITY)
                .total_cmp(&b.up_to.unwrap_or(f32::INFINITY))
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of config `spec` in `category` whose target reviews were `rounds` (drafted,
    /// accepted) and whose draft model `d` ran `draft_calls` forwards.
    fn run(
        category: &str,
        (generated, decode_seconds, speedup): (usize, f64, f64),
        rounds: &[(usize, usize)],
        draft_calls: usize,
        (predicted, matches): (Option<f64>, Option<bool>),
    ) -> RunRecord {
        let mut target = ReviewCounts::default();
        rounds.iter().for_each(|&(d, a)| target.record(d, a));
        RunRecord {
            config: "spec".into(),
            category: category.into(),
            prompt: 0,
            repeat: 0,
            prompt_tokens: 10,
            generated_tokens: generated,
            prefill_seconds: 0.1,
            decode_seconds,
            decode_tokens_per_second: generated as f64 / decode_seconds,
            speedup,
            end_to_end: speedup,
            target_calls: rounds.len().max(1),
            drafted: rounds.iter().map(|r| r.0).sum(),
            accepted: rounds.iter().map(|r| r.1).sum(),
            target,
            predicted_speedup: predicted,
            acceptance_by_confidence: Vec::new(),
            levels: Vec::new(),
            model_calls: [("d".to_string(), draft_calls)].into(),
            matches_autoregressive: matches,
        }
    }

    /// Every figure of a summary, worked out by hand for three runs: pooled speed and tokens
    /// per call, the mean and sample deviation of the speedups with a run that generated
    /// nothing left out, acceptance per position, SWI and the Theorem 4.1 predictions.
    #[test]
    fn a_summary_adds_up_as_worked_out_by_hand() {
        let records = [
            run(
                "a",
                (4, 1.0, 2.0),
                &[(2, 2), (2, 0)],
                4,
                (Some(1.2), Some(true)),
            ),
            run("a", (2, 1.0, 1.0), &[(2, 1)], 2, (Some(1.4), Some(false))),
            run("b", (0, 0.5, 0.0), &[], 0, (None, Some(true))),
        ];
        let draft = ModelCost {
            model: "d".into(),
            params: 1,
            decode_ms: 1.0,
            forward_cost: Vec::new(),
            c_measured: 0.25,
            c_params: 0.5,
            cpu_share: None,
        };
        let verify = [(1, 1.0), (3, 1.5)];
        let summaries = summarize(&records, &[draft], &verify, &|_| 2);
        let get = |c: &str| summaries.iter().find(|s| s.category == c).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let all = get("all");
        assert_eq!((all.runs, all.greedy_mismatches), (3, 1));
        // 6 tokens in 2.5 s, over 4 target calls (the empty run's one included).
        assert!(close(all.decode_tokens_per_second, 2.4));
        assert!(close(all.tokens_per_call, 1.5));
        // Speedups 2 and 1 (the run of no tokens has none): mean 1.5, sd sqrt(0.5).
        assert!(close(all.speedup_mean, 1.5) && close(all.speedup_sd, 0.5f64.sqrt()));
        // Position 1 kept in 2 of 3 reviews, position 2 in 1 of the 2 that reached it.
        assert_eq!(all.acceptance_by_position, [2.0 / 3.0, 0.5]);
        assert!(close(all.mean_draft_len, 2.0));
        // SWI: 6 tokens over 4 target calls and 6 draft calls at c = 0.25 (0.5 by size).
        assert!(close(all.swi_measured, 6.0 / 5.5) && close(all.swi_params, 6.0 / 7.0));
        // E = 1 + 2/3 + 2/3 x 1/2 = 2 tokens a call, at 1 + 6 x 0.25 / 4 calls' cost, or with
        // a verify of 3 tokens at r(3) = 1.5.
        assert!(close(all.predicted_paper, 2.0 / 1.375));
        assert!(close(all.predicted_cpu, 2.0 / 1.875));
        assert!(close(all.predicted_runtime.unwrap(), 1.3));
        let a = get("a");
        assert_eq!(a.runs, 2);
        assert!(close(a.decode_tokens_per_second, 3.0) && close(a.tokens_per_call, 2.0));
        let b = get("b");
        assert_eq!(
            (b.runs, b.speedup_mean, b.predicted_runtime),
            (1, 0.0, None)
        );
    }
}
