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

/// One drafter's part of a draft, for planning: its acceptance `a_j` and fill (the share of
/// reviews that had a token there) at each position of its part (the last value extends to
/// later positions), and `cost[n]`, the target calls it spends to draft `n` tokens.
#[derive(Clone, Debug)]
pub struct Segment {
    /// Acceptance at each position of the part.
    pub accept: Vec<f64>,
    /// Share of reviews with a token at each position.
    pub fill: Vec<f64>,
    /// `cost[n]`: target calls spent drafting n tokens.
    pub cost: Vec<f64>,
}

impl Segment {
    /// A drafter that drafts every position at `c` target calls per token.
    pub fn linear(accept: Vec<f64>, c: f64, max_n: usize) -> Self {
        Self {
            accept,
            fill: vec![1.0],
            cost: (0..=max_n).map(|n| n as f64 * c).collect(),
        }
    }
}

fn extended(v: &[f64], j: usize) -> f64 {
    v.get(j).or(v.last()).copied().unwrap_or(0.0)
}

/// The first `limit` positions of a split (`counts[i]` positions from `segments[i]`, in
/// order): acceptance and fill by position, and the drafting cost.
fn layout(segments: &[Segment], counts: &[usize], limit: usize) -> (Vec<f64>, Vec<f64>, f64) {
    let (mut accept, mut fill, mut cost) = (Vec::new(), Vec::new(), 0.0);
    for (s, &n) in segments.iter().zip(counts) {
        let n = n.min(limit - accept.len());
        accept.extend((0..n).map(|j| extended(&s.accept, j)));
        fill.extend((0..n).map(|j| extended(&s.fill, j)));
        cost += s.cost[n.min(s.cost.len() - 1)];
    }
    (accept, fill, cost)
}

/// CS Drafting Theorem 4.1 for one split, with a review's cost as it is on this machine:
/// `E[tokens per review] / (verify(1 + E[draft length]) + drafting cost)`, where
/// `verify(x)` is the reviewer's cost of a forward over `x` tokens in target calls (1 in the
/// papers). At the target this is the predicted speedup.
pub fn split_improvement(
    segments: &[Segment],
    counts: &[usize],
    verify: &dyn Fn(f64) -> f64,
) -> f64 {
    let (accept, fill, cost) = layout(segments, counts, usize::MAX);
    position_dependent_tokens(&accept) / (verify(1.0 + fill.iter().sum::<f64>()) + cost)
}

/// How many [`splits`] there are: C(max_k + parts, parts) - 1 (saturating).
pub fn split_count(parts: usize, max_k: usize) -> u128 {
    (1..=parts as u128)
        .try_fold(1u128, |c, i| {
            c.checked_mul(max_k as u128 + i).map(|c| c / i)
        })
        .map_or(u128::MAX, |c| c - 1)
}

/// Every way to give at most `max_k` positions, at least one, to `parts` drafters in order.
pub fn splits(parts: usize, max_k: usize) -> Vec<Vec<usize>> {
    fn all(n: usize, max: usize) -> Vec<Vec<usize>> {
        if n == 0 {
            return vec![vec![]];
        }
        (0..=max)
            .flat_map(|c| {
                all(n - 1, max - c).into_iter().map(move |mut rest| {
                    rest.insert(0, c);
                    rest
                })
            })
            .collect()
    }
    let mut out = all(parts, max_k);
    out.retain(|c| c.iter().sum::<usize>() > 0);
    out
}

/// A vertical cascade's cost to emit `n` tokens, for `n` in `0..=max_n`: it reviews splits of
/// its inner draft (at most `counts`, fewer when fewer tokens are still wanted) until it has
/// emitted `n`; each review costs `verify(1 + E[draft length])` plus the drafting, and emits
/// `j` tokens with the probability Theorem 4.1's acceptance chain gives (a rejection at
/// position `j`, or the bonus token after all `m`).
pub fn emission_costs(
    segments: &[Segment],
    counts: &[usize],
    verify: &dyn Fn(f64) -> f64,
    max_n: usize,
) -> Vec<f64> {
    let k: usize = counts.iter().sum();
    let mut cost = vec![0.0; max_n + 1];
    for n in 1..=max_n {
        let m = n.min(k);
        let (accept, fill, drafting) = layout(segments, counts, m);
        let mut total = verify(1.0 + fill.iter().sum::<f64>()) + drafting;
        let mut reach = 1.0; // P(the first j - 1 positions were accepted)
        for j in 1..=m + 1 {
            let p_emit_j = if j <= m {
                reach * (1.0 - accept[j - 1])
            } else {
                reach
            };
            total += p_emit_j * cost[n.saturating_sub(j)];
            if j <= m {
                reach *= accept[j - 1];
            }
        }
        cost[n] = total;
    }
    cost
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_count_counts_the_splits() {
        for parts in 1..=4 {
            for max_k in 0..=6 {
                assert_eq!(
                    split_count(parts, max_k),
                    splits(parts, max_k).len() as u128
                );
            }
        }
        assert_eq!(split_count(7, 64), 1_329_890_704);
        assert_eq!(split_count(1000, 1000), u128::MAX);
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn one_linear_drafter_with_unit_verify_cost_is_theorem_3_8() {
        for (a, c) in [(0.8, 0.05), (0.6, 0.3), (0.95, 0.01)] {
            let seg = [Segment::linear(vec![a], c, 30)];
            for k in 1..=30 {
                assert!(close(
                    split_improvement(&seg, &[k], &|_| 1.0),
                    improvement(a, k, c)
                ));
            }
            let best = splits(1, 30)
                .into_iter()
                .max_by(|x, y| {
                    let f = |s: &Vec<usize>| split_improvement(&seg, s, &|_| 1.0);
                    f(x).total_cmp(&f(y))
                })
                .unwrap();
            assert_eq!(best[0], optimal_gamma(a, c, 30).0.max(1));
        }
        // A verify cost growing with the draft shortens the best draft.
        let seg = [Segment::linear(vec![0.8], 0.05, 30)];
        let best = |verify: &dyn Fn(f64) -> f64| {
            (1..=30)
                .max_by(|&x, &y| {
                    split_improvement(&seg, &[x], verify).total_cmp(&split_improvement(
                        &seg,
                        &[y],
                        verify,
                    ))
                })
                .unwrap()
        };
        assert!(best(&|x| 1.0 + 0.3 * (x - 1.0)) < best(&|_| 1.0));
    }

    #[test]
    fn a_split_between_two_drafters_is_theorem_4_1() {
        // A costly accurate drafter and a free weak one: the best split uses both, and its
        // prediction is the closed form of Theorem 4.1 for that split.
        let segs = [
            Segment::linear(vec![0.9], 0.3, 10),
            Segment::linear(vec![0.3], 0.0, 10),
        ];
        let value = |c: &[usize]| split_improvement(&segs, c, &|_| 1.0);
        let best = splits(2, 10)
            .into_iter()
            .max_by(|x, y| value(x).total_cmp(&value(y)))
            .unwrap();
        assert!(best[0] > 0 && best[1] > 0, "{best:?}");
        let (n1, n2) = (best[0], best[1]);
        let accept: Vec<f64> = (0..n1).map(|_| 0.9).chain((0..n2).map(|_| 0.3)).collect();
        assert!(close(value(&best), ewif(&accept, &vec![0.3; n1])));
        // Positions a drafter leaves empty are not verified: a half-filled free segment costs
        // half its positions at the reviewer.
        let sparse = [Segment {
            accept: vec![0.2],
            fill: vec![0.5],
            cost: vec![0.0; 11],
        }];
        let verify = |x: f64| x; // r(x) = x
        assert!(close(
            split_improvement(&sparse, &[4], &verify),
            expected_tokens(0.2, 4) / 3.0
        ));
        assert_eq!(splits(2, 2), [[0, 1], [0, 2], [1, 0], [1, 1], [2, 0]]);
    }

    #[test]
    fn emission_costs_count_reviews() {
        let round = |m: usize| 1.0 + m as f64; // verify(1 + m), free drafter
        let verify = |x: f64| x;
        // Everything rejected: one token per review, each review drafting min(wanted, k).
        let none = [Segment::linear(vec![0.0], 0.0, 20)];
        let c = emission_costs(&none, &[4], &verify, 20);
        assert_eq!(c.len(), 21);
        for (n, &cost) in c.iter().enumerate() {
            let want: f64 = (1..=n).map(|i| round(i.min(4))).sum();
            assert!(close(cost, want), "n={n}");
        }
        // Everything accepted: k + 1 tokens per review, the last review asking only for what
        // is still wanted.
        let all = [Segment::linear(vec![1.0], 0.0, 20)];
        let c = emission_costs(&all, &[4], &verify, 20);
        assert!(close(c[15], 3.0 * round(4)));
        assert!(close(c[7], round(4) + round(2)));
        // With a costly drafter, drafting cost is paid per review on the positions drafted.
        let paid = [Segment::linear(vec![1.0], 0.5, 20)];
        let c = emission_costs(&paid, &[2], &verify, 20);
        assert!(close(c[6], 2.0 * (round(2) + 1.0)));
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
    fn swi_counts_model_runs_weighted_by_cost() {
        assert!(close(swi(100, 40, &[(160, 0.1)]), 100.0 / 56.0));
        assert!(close(swi(100, 100, &[]), 1.0));
    }
}
