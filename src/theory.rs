//! The papers' closed forms for what speculation should gain.
//!
//! - Leviathan et al. 2023: expected tokens per target call with acceptance rate `a` and `g`
//!   drafted tokens, `(1 - a^(g+1)) / (1 - a)` (equation 1), and the walltime improvement
//!   factor of Theorem 3.8, `(1 - a^(g+1)) / ((1 - a)(g c + 1))`, for a drafter costing `c`
//!   target calls per token.
//! - CS Drafting, Theorem 4.1: with position-dependent drafters (acceptance `a_i`, cost `c_i`
//!   at draft position `i`), `EWIF = sum_{i=0..k} prod_{j<=i} a_j / (1 + sum_i c_i)`.
//! - CS Drafting, section 5: the standardized walltime improvement
//!   `SWI = n / (target calls + sum_i calls_i c_i)`.
//!
//! The papers assume a verify forward over g + 1 tokens costs one target call. On a CPU it
//! costs `r(g + 1)` calls (measured by `cargo bench --bench forward`); the `_with_verify_cost`
//! variants divide by that instead.

/// Expected tokens per target call: `(1 - a^(g+1)) / (1 - a)` (`g + 1` when `a = 1`).
pub fn expected_tokens(a: f64, g: usize) -> f64 {
    position_dependent_tokens(&vec![a; g])
}

/// Theorem 3.8: expected walltime improvement over autoregressive decoding.
pub fn improvement(a: f64, g: usize, c: f64) -> f64 {
    expected_tokens(a, g) / (g as f64 * c + 1.0)
}

/// The `g` in `1..=max_g` that maximizes [`improvement`], with its value; `(0, 1.0)` when no
/// `g` improves on autoregressive decoding.
pub fn optimal_gamma(a: f64, c: f64, max_g: usize) -> (usize, f64) {
    (1..=max_g)
        .map(|g| (g, improvement(a, g, c)))
        .fold((0, 1.0), |best, x| if x.1 > best.1 { x } else { best })
}

/// Expected tokens per call when position `i` (1-based) is accepted with probability
/// `accept[i - 1]` given the earlier ones were: `sum_{i=0..k} prod_{j<=i} a_j`.
pub fn position_dependent_tokens(accept: &[f64]) -> f64 {
    let mut total = 1.0;
    let mut reach = 1.0;
    for &a in accept {
        reach *= a;
        total += reach;
    }
    total
}

/// CS Drafting Theorem 4.1: expected walltime improvement factor with position-dependent
/// acceptance rates and costs.
pub fn ewif(accept: &[f64], cost: &[f64]) -> f64 {
    position_dependent_tokens(accept) / (1.0 + cost.iter().sum::<f64>())
}

/// [`ewif`] when verifying `k` draft tokens costs `verify_cost` target calls instead of one.
pub fn ewif_with_verify_cost(accept: &[f64], cost: &[f64], verify_cost: f64) -> f64 {
    position_dependent_tokens(accept) / (verify_cost + cost.iter().sum::<f64>())
}

/// CS Drafting's standardized walltime improvement: `n` tokens generated with `target_calls`
/// target runs and, per drafter model, (runs, cost coefficient).
pub fn swi(n: usize, target_calls: usize, drafters: &[(usize, f64)]) -> f64 {
    n as f64
        / (target_calls as f64
            + drafters
                .iter()
                .map(|&(calls, c)| calls as f64 * c)
                .sum::<f64>())
}

/// Predicted improvement for each draft length `k` in `1..=max_k` of a single drafter whose
/// acceptance at position `i` is `accept[i]` (the last value extends to later positions),
/// drafting at `cost` target calls per token, when verifying `k` tokens costs `verify(k + 1)`
/// target calls: `E[tokens per call] / (verify(k + 1) + k cost)`.
pub fn plan_k(
    accept: &[f64],
    cost: f64,
    verify: &dyn Fn(usize) -> f64,
    max_k: usize,
) -> Vec<(usize, f64)> {
    let at = |i: usize| accept.get(i).or(accept.last()).copied().unwrap_or(0.0);
    (1..=max_k)
        .map(|k| {
            let a: Vec<f64> = (0..k).map(at).collect();
            (
                k,
                position_dependent_tokens(&a) / (verify(k + 1) + k as f64 * cost),
            )
        })
        .collect()
}

/// One drafter of a horizontal schedule, for [`plan_schedule`]: its acceptance at each
/// position of its segment (the last value extends to later positions) and its cost per
/// drafted token in target calls.
pub struct Segment {
    pub accept: Vec<f64>,
    pub cost: f64,
}

/// CS Drafting Theorem 4.1 over horizontal schedules: every split of at most `max_k` draft
/// positions between `segments` (in their order; a count may be 0), with the predicted
/// improvement `E[tokens per call] / (verify(K + 1) + sum of drafting costs)`, best first.
pub fn plan_schedule(
    segments: &[Segment],
    verify: &dyn Fn(usize) -> f64,
    max_k: usize,
) -> Vec<(Vec<usize>, f64)> {
    fn splits(n: usize, max: usize) -> Vec<Vec<usize>> {
        if n == 0 {
            return vec![vec![]];
        }
        (0..=max)
            .flat_map(|c| {
                splits(n - 1, max - c).into_iter().map(move |mut rest| {
                    rest.insert(0, c);
                    rest
                })
            })
            .collect()
    }
    let mut out: Vec<(Vec<usize>, f64)> = splits(segments.len(), max_k)
        .into_iter()
        .filter(|counts| counts.iter().sum::<usize>() > 0)
        .map(|counts| {
            let predicted = schedule_improvement(segments, &counts, verify);
            (counts, predicted)
        })
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

/// The improvement [`plan_schedule`] predicts for one split: `counts[i]` positions from
/// `segments[i]`.
pub fn schedule_improvement(
    segments: &[Segment],
    counts: &[usize],
    verify: &dyn Fn(usize) -> f64,
) -> f64 {
    let (mut accept, mut cost) = (Vec::new(), 0.0);
    for (s, &n) in segments.iter().zip(counts) {
        let at = |j: usize| s.accept.get(j).or(s.accept.last()).copied().unwrap_or(0.0);
        accept.extend((0..n).map(at));
        cost += n as f64 * s.cost;
    }
    position_dependent_tokens(&accept) / (verify(accept.len() + 1) + cost)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn schedule_planning_with_one_drafter_is_k_planning() {
        let accept = vec![0.8, 0.7, 0.6];
        let verify = |k: usize| 1.0 + 0.1 * k as f64;
        let seg = [Segment {
            accept: accept.clone(),
            cost: 0.2,
        }];
        let mut by_k = plan_schedule(&seg, &verify, 8);
        by_k.sort_by_key(|(c, _)| c[0]);
        for ((counts, s), (k, p)) in by_k.iter().zip(plan_k(&accept, 0.2, &verify, 8)) {
            assert_eq!(counts[0], k);
            assert!(close(*s, p));
        }
    }

    #[test]
    fn schedule_planning_puts_the_better_drafter_first_and_the_free_one_last() {
        // A costly accurate drafter and a free weak one: the best split uses both, and its
        // prediction is the closed form of Theorem 4.1 for that split.
        let segs = [
            Segment {
                accept: vec![0.9],
                cost: 0.3,
            },
            Segment {
                accept: vec![0.3],
                cost: 0.0,
            },
        ];
        let verify = |_: usize| 1.0;
        let best = &plan_schedule(&segs, &verify, 10)[0];
        assert!(best.0[0] > 0 && best.0[1] > 0, "{best:?}");
        let (n1, n2) = (best.0[0], best.0[1]);
        let accept: Vec<f64> = (0..n1).map(|_| 0.9).chain((0..n2).map(|_| 0.3)).collect();
        let cost = vec![0.3; n1];
        assert!(close(best.1, ewif(&accept, &cost)));
    }

    #[test]
    fn expected_tokens_matches_the_closed_form() {
        for (a, g) in [(0.5, 1), (0.6, 4), (0.8, 7), (0.9, 3), (0.99, 10)] {
            let closed = (1.0 - f64::powi(a, g as i32 + 1)) / (1.0 - a);
            assert!(close(expected_tokens(a, g), closed), "a={a} g={g}");
        }
        assert_eq!(expected_tokens(1.0, 4), 5.0);
        assert_eq!(expected_tokens(0.0, 4), 1.0);
    }

    #[test]
    fn improvement_matches_theorem_3_8() {
        for (a, g, c) in [(0.6, 3, 0.05), (0.8, 5, 0.1), (0.9, 8, 0.02), (0.7, 1, 0.5)] {
            let closed = (1.0 - f64::powi(a, g as i32 + 1)) / ((1.0 - a) * (g as f64 * c + 1.0));
            assert!(close(improvement(a, g, c), closed));
        }
        // Corollary: with g = 1 the factor is (1 + a) / (1 + c).
        assert!(close(improvement(0.7, 1, 0.2), 1.7 / 1.2));
    }

    #[test]
    fn optimal_gamma_as_in_leviathan_figure_3() {
        // Figure 3 plots the argmax over integer g of the closed form; recompute it literally.
        let argmax = |a: f64, c: f64| {
            let f = |g: i32| (1.0 - a.powi(g + 1)) / ((1.0 - a) * (g as f64 * c + 1.0));
            (1..=30).max_by(|&x, &y| f(x).total_cmp(&f(y))).unwrap() as usize
        };
        for (a, c) in [
            (0.9, 0.01),
            (0.8, 0.05),
            (0.6, 0.1),
            (0.7, 0.02),
            (0.95, 0.05),
        ] {
            assert_eq!(optimal_gamma(a, c, 30).0, argmax(a, c), "a={a} c={c}");
        }
        // The figure's shape: better drafters want longer drafts, costlier ones shorter.
        assert!(optimal_gamma(0.9, 0.05, 30).0 > optimal_gamma(0.7, 0.05, 30).0);
        assert!(optimal_gamma(0.8, 0.01, 30).0 > optimal_gamma(0.8, 0.2, 30).0);
        // A drafter no better than its cost never helps (Corollary 3.9: it needs a > c).
        assert_eq!(optimal_gamma(0.3, 0.4, 30), (0, 1.0));
    }

    #[test]
    fn ewif_generalizes_theorem_3_8() {
        let (a, c, g) = (0.75, 0.1, 5);
        assert!(close(ewif(&vec![a; g], &vec![c; g]), improvement(a, g, c)));
        // A cheaper drafter for later positions (the horizontal cascade's point).
        let mixed = ewif(&[0.8, 0.8, 0.5, 0.5], &[0.3, 0.3, 0.0, 0.0]);
        assert!(close(mixed, (1.0 + 0.8 + 0.64 + 0.32 + 0.16) / 1.6));
        assert!(close(ewif_with_verify_cost(&[0.5], &[0.0], 2.0), 0.75));
    }

    #[test]
    fn plan_k_with_unit_verify_cost_is_theorem_3_8() {
        let plan = plan_k(&[0.8], 0.05, &|_| 1.0, 30);
        for &(k, f) in &plan {
            assert!(close(f, improvement(0.8, k, 0.05)));
        }
        let best = plan
            .iter()
            .fold((0, 0.0), |b, &x| if x.1 > b.1 { x } else { b });
        assert_eq!(best.0, optimal_gamma(0.8, 0.05, 30).0);
        // A verify cost growing with k shortens the best draft.
        let cpu = plan_k(&[0.8], 0.05, &|n| 1.0 + 0.3 * (n - 1) as f64, 30);
        let best_cpu = cpu
            .iter()
            .fold((0, 0.0), |b, &x| if x.1 > b.1 { x } else { b });
        assert!(best_cpu.0 < best.0, "{best_cpu:?} vs {best:?}");
    }

    #[test]
    fn swi_counts_model_runs_weighted_by_cost() {
        assert!(close(swi(100, 40, &[(160, 0.1)]), 100.0 / 56.0));
        assert!(close(swi(100, 100, &[]), 1.0));
    }
}
