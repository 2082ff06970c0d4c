//! The review step: one operation for the target's verification and a cascade's inner review.
//!
//! Given a draft `x_1..x_k` with the distributions `q_i` it was sampled from, and the
//! reviewer's logits for the `k + 1` positions, [`review`] walks the draft (Leviathan et al.
//! 2023, Algorithm 1; Chen et al. 2023, Algorithm 2):
//!
//! - **accepted** tokens: `x_i` is kept with probability `min(1, l * p_i(x_i) / q_i(x_i))`;
//! - the **recovered** token: at the first rejection, a token is drawn from the residual
//!   `norm(max(0, p_i - q_i))` and the rest of the draft is dropped;
//! - the **bonus** token: if all `k` are kept, one more is drawn from `p_{k+1}`.
//!
//! So a review always yields at least one new token. With lenience `l = 1` the output follows
//! `p` exactly, whatever `q` is. At temperature 0 the distributions are point masses and the
//! rule becomes "keep `x_i` while it is the reviewer's argmax"; lenience then applies before
//! standardization: keep `x_i` if `p_raw(x_i) >= max(p_raw) / l` (Leviathan et al., A.5).
//! `l > 1` changes the output distribution: it is for reviews inside a cascade, never the target.

use crate::model::Logits;
use crate::sampling::{argmax, sample_weights, Dist, Rng, Sampling};
use crate::vecmath;
use rand::Rng as _;
use serde::{Deserialize, Serialize};

/// Checks a lenience given at `at` (a TOML path, or the review it is for): a finite number of
/// at least 1. NaN would reject every token while the distribution a cascade reports still
/// reads as its drafter's, and an infinite one misstates it wherever top-k or top-p zero a
/// probability: either would bias the level above without an error.
pub fn check_lenience(at: impl std::fmt::Display, lenience: f32) -> crate::error::Result<()> {
    if lenience >= 1.0 && lenience.is_finite() {
        Ok(())
    } else {
        Err(crate::error::Error::config(
            at.to_string(),
            format!("must be a finite number >= 1, got {lenience}"),
        ))
    }
}

/// What a review decided: the first `accepted` draft tokens are kept, then `next` follows
/// (the recovered token after a rejection, or the bonus token when all were kept).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Draft tokens kept.
    pub accepted: usize,
    /// The token after them.
    pub next: u32,
}

/// Reviews `draft` (with its distributions `q`) against `logits`, whose row `i` scores
/// position `i` of the draft and row `draft.len()` the position after it. With `emitted`, also
/// pushes the distribution each emitted token (the accepted ones, then `next`) was effectively
/// drawn from: what a cascade reports to the level above it (see [`emitted_distribution`]).
///
/// # Panics
/// If `q` has not one distribution per draft token, or `logits` fewer than `draft.len() + 1`
/// rows (the reviewer checks both before it calls a rule).
pub fn review(
    draft: &[u32],
    q: &[Dist],
    logits: &Logits,
    sampling: &Sampling,
    lenience: f32,
    rng: &mut Rng,
    mut emitted: Option<&mut Vec<Dist>>,
) -> Verdict {
    assert_eq!(draft.len(), q.len(), "one distribution per draft token");
    assert!(
        logits.rows() > draft.len(),
        "a row of logits per draft token and one after them"
    );
    for (i, (&x, qi)) in draft.iter().zip(q).enumerate() {
        let row = logits.row(i);
        if sampling.is_greedy() {
            // Deterministic: each emitted token is a point mass given its prefix.
            let (kept, best) = greedy_keeps(x, row, lenience);
            let token = if kept { x } else { best };
            if let Some(e) = emitted.as_deref_mut() {
                e.push(Dist::Point(token));
            }
            if !kept {
                return Verdict {
                    accepted: i,
                    next: best,
                };
            }
            continue;
        }
        let p = logits.distribution(i, sampling);
        if let Some(e) = emitted.as_deref_mut() {
            e.push(emitted_distribution(&p, qi, lenience));
        }
        let (px, qx) = (p.prob(x), qi.prob(x));
        // u < l p / q, written without the division (q(x) > 0 for a token drawn from q), and
        // so that a NaN rejects. In f64: an f32 u is a multiple of 2^-24, which would keep a
        // token whose p(x) / q(x) is below that up to 2^-24 of the time.
        let kept = rng.random::<f64>() * f64::from(qx) < f64::from(lenience) * f64::from(px);
        if !kept {
            return Verdict {
                accepted: i,
                next: residual_sample(&p, qi, rng),
            };
        }
    }
    let bonus = logits.distribution(draft.len(), sampling);
    let next = bonus.sample(rng);
    if let Some(e) = emitted {
        e.push(bonus.into_owned());
    }
    Verdict {
        accepted: draft.len(),
        next,
    }
}

/// The greedy review's test of draft token `x` at a position whose logits are `row`: kept if
/// it is the argmax, or with lenience `l > 1` within `ln l` of it; and the argmax.
fn greedy_keeps(x: u32, row: &[f32], lenience: f32) -> (bool, u32) {
    let best = argmax(row);
    let kept =
        x == best || (lenience > 1.0 && row[x as usize] >= row[best as usize] - lenience.ln());
    (kept, best)
}

/// The chance that [`review`] keeps draft token `x`, drawn from `q`, at the position whose
/// logits are `logits`' row `i`, given that the draft before it is kept: `min(1, l p(x) / q(x))`,
/// or at temperature 0 whether `x` passes the greedy test (a NaN keeps nothing, as in the
/// review). What adaptive drafting learns from, at every drafted position: the reviewer
/// scores the positions after a rejection in the same forward.
pub fn keep_chance(
    x: u32,
    q: &Dist,
    (logits, i): (&Logits, usize),
    sampling: &Sampling,
    lenience: f32,
) -> f64 {
    if sampling.is_greedy() {
        return greedy_keeps(x, logits.row(i), lenience).0 as u8 as f64;
    }
    let (px, qx) = (logits.distribution(i, sampling).prob(x), q.prob(x));
    // As the review's `u q(x) < l p(x)`: with q(x) = 0 (which the drafter contract refuses),
    // kept whenever p(x) > 0.
    let chance = if qx > 0.0 {
        lenience * px / qx
    } else {
        (px > 0.0) as u8 as f32
    };
    if chance.is_nan() {
        0.0
    } else {
        chance.min(1.0) as f64
    }
}

/// The distribution of the token a review emits at a reviewed position, where the proposal
/// `x ~ q` is kept with probability `min(1, l p(x) / q(x))` and otherwise replaced by a draw
/// from `r = norm(max(0, p - q))`:
///
/// `e(y) = min(q(y), l p(y)) + (1 - sum_x min(q(x), l p(x))) r(y)`.
///
/// With `l = 1` this is exactly `p` (the point of speculative sampling). With `l > 1` it is
/// neither `p` nor `q`, and a cascade must report `e`, not `p`, for the review above it to
/// stay exact.
pub fn emitted_distribution(p: &Dist, q: &Dist, lenience: f32) -> Dist {
    let Dist::Dense(pd) = p else {
        return p.clone(); // a point-mass p emits its token whatever q proposes
    };
    if lenience == 1.0 {
        return p.clone();
    }
    let qd = q.to_dense(pd.len());
    let mut e: Vec<f32> = qd
        .iter()
        .zip(pd)
        .map(|(&q, &p)| q.min(lenience * p))
        .collect();
    // The chance of a rejection, 1 - sum(e) so far, summed from its non-negative terms: no
    // cancellation, so it is 0 only where no rejection can happen, and a token only the
    // residual can emit keeps a positive probability.
    let rejected: f64 = qd
        .iter()
        .zip(pd)
        .map(|(&q, &p)| f64::from((q - lenience * p).max(0.0)))
        .sum();
    let residual: Vec<f32> = pd.iter().zip(&qd).map(|(p, q)| (p - q).max(0.0)).collect();
    let total = vecmath::sum_f64(&residual);
    let (r, r_total) = if total > 0.0 {
        (&residual, total)
    } else {
        (pd, 1.0)
    };
    let scale = rejected / r_total;
    e.iter_mut()
        .zip(r)
        .for_each(|(e, &r)| *e += (scale * f64::from(r)) as f32);
    Dist::Dense(e)
}

/// Draws from `norm(max(0, p - q))`; if that is empty (p <= q everywhere, so p = q up to
/// rounding), from `p`.
pub fn residual_sample(p: &Dist, q: &Dist, rng: &mut impl rand::Rng) -> u32 {
    let Dist::Dense(pd) = p else {
        return p.argmax(); // a point-mass p: the only token it allows
    };
    let residual: Vec<f32> = match q {
        Dist::Point(t) => {
            let mut r = pd.clone();
            r[*t as usize] = 0.0;
            r
        }
        // (A drafter's narrower vocabulary gives the ids beyond it no probability.)
        Dist::Dense(qd) => (pd.iter().enumerate())
            .map(|(i, p)| (p - qd.get(i).copied().unwrap_or(0.0)).max(0.0))
            .collect(),
        Dist::Sparse(qs) => {
            let mut r = pd.clone();
            qs.iter()
                .for_each(|&(t, q)| r[t as usize] = (r[t as usize] - q).max(0.0));
            r
        }
    };
    if residual.iter().any(|&r| r > 0.0) {
        sample_weights(&residual, rng)
    } else {
        p.sample(rng)
    }
}

/// Counters of the reviews at one level (the target's, or a vertical cascade's reviewer), by
/// draft position (0-based).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReviewCounts {
    /// Reviews, an empty draft's included.
    pub reviews: usize,
    /// `drafted_at[i]`: reviews whose draft had a token at position i.
    pub drafted_at: Vec<usize>,
    /// `reached_at[i]`: reviews that examined position i (every earlier one accepted).
    pub reached_at: Vec<usize>,
    /// `accepted_at[i]`: reviews that accepted position i.
    pub accepted_at: Vec<usize>,
}

impl ReviewCounts {
    /// Counts one review of a `drafted`-token draft that accepted `accepted` tokens.
    ///
    /// # Panics
    /// If `accepted` exceeds `drafted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        let reviewed = drafted.min(accepted + 1);
        self.reviews += 1;
        if self.drafted_at.len() < drafted {
            self.drafted_at.resize(drafted, 0);
            self.reached_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        self.drafted_at[..drafted].iter_mut().for_each(|c| *c += 1);
        self.reached_at[..reviewed].iter_mut().for_each(|c| *c += 1);
        self.accepted_at[..accepted]
            .iter_mut()
            .for_each(|c| *c += 1);
    }

    /// Adds another level's (or run's) counters to these.
    pub fn add(&mut self, other: &ReviewCounts) {
        fn add(a: &mut Vec<usize>, b: &[usize]) {
            if a.len() < b.len() {
                a.resize(b.len(), 0);
            }
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        self.reviews += other.reviews;
        add(&mut self.drafted_at, &other.drafted_at);
        add(&mut self.reached_at, &other.reached_at);
        add(&mut self.accepted_at, &other.accepted_at);
    }

    /// Acceptance at each position given it was examined (CS Drafting Figure 1), up to the
    /// last position ever examined: one drafted but never reached has no acceptance to show
    /// (reaching a position takes reaching every one before it).
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        let at = |v: &[usize], i: usize| v.get(i).copied().unwrap_or(0) as f64;
        let examined = self
            .reached_at
            .iter()
            .rposition(|&r| r > 0)
            .map_or(0, |i| i + 1);
        (0..examined)
            .map(|i| at(&self.accepted_at, i) / at(&self.reached_at, i))
            .collect()
    }

    /// Theorem 4.1's `a_i` for planning: position i drafted and accepted, given every earlier
    /// one was, so that a drafter that sometimes drafts less (Max-Gram without a match)
    /// counts as rejected there.
    pub fn chain_acceptance(&self) -> Vec<f64> {
        (0..self.accepted_at.len())
            .map(|i| {
                let before = if i == 0 {
                    self.reviews
                } else {
                    self.accepted_at[i - 1]
                };
                self.accepted_at[i] as f64 / before.max(1) as f64
            })
            .collect()
    }

    /// The share of reviews whose draft had a token at each position.
    pub fn fill(&self) -> Vec<f64> {
        let n = self.reviews.max(1) as f64;
        self.drafted_at.iter().map(|&d| d as f64 / n).collect()
    }

    /// Mean draft length per review.
    pub fn mean_draft_len(&self) -> f64 {
        self.drafted_at.iter().sum::<usize>() as f64 / self.reviews.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A position drafted but never examined (the draft was rejected before it) has no
    /// acceptance: it is not shown as always rejected.
    #[test]
    fn acceptance_by_position_ends_at_the_last_position_examined() {
        let mut counts = ReviewCounts::default();
        counts.record(10, 1); // positions 0 and 1 examined, 1 rejected
        counts.record(3, 0);
        assert_eq!(counts.acceptance_by_position(), [0.5, 0.0]);
        assert!(ReviewCounts::default().acceptance_by_position().is_empty());
    }

    #[test]
    fn the_keep_chance_is_the_reviews_own_test() {
        let logits = Logits::new(vec![2.0, 1.0, 0.0, 2.0, 1.0, 0.0], 3);
        let greedy = Sampling::greedy();
        let chance = |x, q: &Dist, s: &Sampling, l| keep_chance(x, q, (&logits, 0), s, l);
        assert_eq!(chance(0, &Dist::Point(0), &greedy, 1.0), 1.0);
        assert_eq!(chance(1, &Dist::Point(1), &greedy, 1.0), 0.0);
        // Lenience 3 keeps a token within ln 3 of the best logit: 1.0 is within 1.0986 of 2.0.
        assert_eq!(chance(1, &Dist::Point(1), &greedy, 3.0), 1.0);
        let t1 = Sampling {
            temperature: 1.0,
            ..Sampling::greedy()
        };
        let p = t1.distribution(logits.row(0));
        // A point-mass draft is kept with the reviewer's probability of it.
        assert!((chance(1, &Dist::Point(1), &t1, 1.0) - p.prob(1) as f64).abs() < 1e-6);
        // A draft from q: min(1, p / q).
        let q = Dist::Dense(vec![0.2, 0.2, 0.6]);
        assert_eq!(chance(0, &q, &t1, 1.0), 1.0);
        let want = (p.prob(2) / 0.6) as f64;
        assert!((chance(2, &q, &t1, 1.0) - want).abs() < 1e-6);
        // A NaN keeps nothing, as the review rejects it.
        let nan = Logits::new(vec![f32::NAN; 3], 3);
        assert_eq!(keep_chance(0, &q, (&nan, 0), &t1, 1.0), 0.0);
    }
    use rand::SeedableRng;

    fn logits(rows: &[&[f32]]) -> Logits {
        Logits::new(rows.concat(), rows[0].len())
    }

    fn greedy(draft: &[u32], rows: &[&[f32]], lenience: f32) -> Verdict {
        let q: Vec<Dist> = draft.iter().map(|&t| Dist::Point(t)).collect();
        let mut rng = Rng::seed_from_u64(0);
        review(
            draft,
            &q,
            &logits(rows),
            &Sampling::greedy(),
            lenience,
            &mut rng,
            None,
        )
    }

    // Greedy tables: argmaxes per row are 1, 2, 0, 3.
    const ROWS: [&[f32]; 4] = [
        &[0., 5., 1., 0.],
        &[0., 0., 5., 1.],
        &[5., 0., 0., 4.],
        &[0., 0., 0., 9.],
    ];

    #[test]
    fn greedy_perfect_match_gets_the_bonus() {
        assert_eq!(
            greedy(&[1, 2, 0], &ROWS, 1.0),
            Verdict {
                accepted: 3,
                next: 3
            }
        );
    }

    #[test]
    fn greedy_early_mismatch_recovers_the_argmax() {
        assert_eq!(
            greedy(&[1, 3, 0], &ROWS, 1.0),
            Verdict {
                accepted: 1,
                next: 2
            }
        );
        assert_eq!(
            greedy(&[0, 2, 0], &ROWS, 1.0),
            Verdict {
                accepted: 0,
                next: 1
            }
        );
    }

    #[test]
    fn greedy_empty_draft_is_one_autoregressive_step() {
        assert_eq!(
            greedy(&[], &ROWS, 1.0),
            Verdict {
                accepted: 0,
                next: 1
            }
        );
    }

    #[test]
    fn emitted_distribution_is_p_without_lenience_and_the_mixture_with_it() {
        let p = Dist::Dense(vec![0.5, 0.3, 0.2]);
        let q = Dist::Dense(vec![0.1, 0.1, 0.8]);
        assert_eq!(emitted_distribution(&p, &q, 1.0), p);
        // l = 2: kept mass min(q, 2p) = [0.1, 0.1, 0.4], rejected 0.4, residual (p - q)+ =
        // [0.4, 0.2, 0] normalized to [2/3, 1/3, 0].
        let Dist::Dense(e) = emitted_distribution(&p, &q, 2.0) else {
            panic!()
        };
        let want = [0.1 + 0.4 * 2.0 / 3.0, 0.1 + 0.4 / 3.0, 0.4];
        for (a, b) in e.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{e:?}");
        }
        // Checked against a simulation of the lenient review.
        let mut rng = Rng::seed_from_u64(7);
        let logits = Logits::new(
            vec![0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.0, 0.0, 0.0],
            3,
        );
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        };
        let mut counts = [0f32; 3];
        let n = 200_000;
        for _ in 0..n {
            let x = q.sample(&mut rng);
            let v = review(
                &[x],
                std::slice::from_ref(&q),
                &logits,
                &s,
                2.0,
                &mut rng,
                None,
            );
            counts[if v.accepted == 1 { x } else { v.next } as usize] += 1.0;
        }
        for (c, w) in counts.iter().zip(want) {
            assert!((c / n as f32 - w).abs() < 0.005, "{counts:?}");
        }
    }

    #[test]
    fn greedy_lenience_accepts_near_maxima_only() {
        // Row 2: token 3 has logit 4 vs max 5, so p_raw(3) / max p_raw = e^-1 ≈ 0.37.
        assert_eq!(
            greedy(&[1, 2, 3], &ROWS, 2.0),
            Verdict {
                accepted: 2,
                next: 0
            }
        );
        assert_eq!(
            greedy(&[1, 2, 3], &ROWS, 3.0),
            Verdict {
                accepted: 3,
                next: 3
            }
        );
    }
}
