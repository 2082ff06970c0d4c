//! From logits to an explicit probability distribution, the same way for target and drafters.
//!
//! Speculative sampling is exact only if the target's distribution `p` and each drafter's `q`
//! are the distributions tokens are actually sampled from (Leviathan et al. 2023, section 2.2:
//! "standardized sampling"). Temperature, top-k and top-p are therefore one transformation,
//! [`Sampling::distribution`], applied identically everywhere; temperature 0 gives a point mass.

use crate::error::{Error, Result};
use crate::vecmath;
use serde::{Deserialize, Serialize};

/// The random number generator of every sampling decision: ChaCha12, seeded from a `u64`
/// ([`rand::SeedableRng::seed_from_u64`]). Its output is fixed by its algorithm, unlike
/// `rand`'s `StdRng`, so a seed gives the same tokens across dependency upgrades.
pub type Rng = rand_chacha::ChaCha12Rng;

/// Sampling settings. `temperature = 0` is greedy; `top_k = 0` and `top_p = 1` disable those filters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    /// Temperature; 0 is greedy.
    #[serde(default)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    #[serde(default)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this probability mass (1: off).
    #[serde(default = "one")]
    pub top_p: f32,
}

fn one() -> f32 {
    1.0
}

impl Default for Sampling {
    fn default() -> Self {
        Self::greedy()
    }
}

/// A distribution over token ids, summing to 1: a point mass (greedy, or a deterministic
/// drafter), dense probabilities over the whole vocabulary, or a few (token, probability) pairs.
#[derive(Clone, Debug, PartialEq)]
pub enum Dist {
    /// All mass on one token.
    Point(u32),
    /// A probability for each of the first tokens of the vocabulary, the others 0: every
    /// token, or those of a drafter whose vocabulary is the beginning of its reviewer's
    /// ([`Request::check`](crate::draft::Request::check) fills in the rest).
    Dense(Vec<f32>),
    /// Probabilities of a few tokens, the others 0.
    Sparse(Vec<(u32, f32)>),
}

impl Sampling {
    /// Greedy decoding: temperature 0.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    /// Checks the ranges: temperature finite and >= 0 (and, if not 0, with a finite
    /// reciprocal), top-p in (0, 1].
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::Sampling(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        // Logits are divided by the temperature: below f32's smallest normal number that
        // overflows, and the distribution would be undefined.
        if self.temperature > 0.0 && self.temperature < f32::MIN_POSITIVE {
            return Err(Error::Sampling(format!(
                "temperature {:e} is too small to divide by; use 0 for greedy decoding",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Sampling(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    /// Whether sampling is greedy (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The distribution tokens are sampled from, given raw `logits`.
    pub fn distribution(&self, logits: &[f32]) -> Dist {
        if self.is_greedy() {
            return Dist::Point(argmax(logits));
        }
        let inv_t = 1.0 / self.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs = vec![0f32; logits.len()];
        vecmath::exp_shifted(logits, max, inv_t, &mut probs);
        let n = probs.len();
        if self.top_k > 0 && self.top_k < n {
            let keep = top_indices(&probs, self.top_k);
            let mut kept = vec![0f32; n];
            for i in keep {
                kept[i] = probs[i];
            }
            probs = kept;
        }
        if self.top_p < 1.0 {
            apply_top_p(&mut probs, self.top_p);
        }
        // Normalized in f64, as a draw normalizes its weights: the review reads p(x) as given,
        // and an f32 total drops a peaked row's long tail (its sum came out 1 + 1e-4).
        let scale = 1.0 / vecmath::sum_f64(&probs);
        probs
            .iter_mut()
            .for_each(|p| *p = (f64::from(*p) * scale) as f32);
        Dist::Dense(probs)
    }
}

/// The largest probability of `softmax(logits)`, without building the distribution.
pub fn softmax_max(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut e = vec![0f32; logits.len()];
    vecmath::exp_shifted(logits, max, 1.0, &mut e);
    1.0 / vecmath::sum(&e)
}

/// The index of the largest value (the lowest index among equals), as a scan that keeps the
/// first value no later one exceeds: NaNs are never kept, unless first.
pub fn argmax(values: &[f32]) -> u32 {
    // Passes that vectorize (the maximum; the first 64-value run holding it; its place there)
    // instead of one chain of dependent compares: 105 to 13-22 µs over a 151,936-token
    // vocabulary, once per verified position.
    let Some(&first) = values.first().filter(|v| !v.is_nan()) else {
        return 0;
    };
    let max = values.iter().copied().fold(first, f32::max);
    let run = values
        .chunks(64)
        .position(|run| run.iter().fold(false, |found, &v| found | (v == max)))
        .unwrap_or(0);
    let at = values[64 * run..].iter().position(|&v| v == max);
    (64 * run + at.unwrap_or(0)) as u32
}

/// The ranking of tokens: higher values first, ties broken by lower index.
fn ranked(values: &[f32]) -> impl Fn(&usize, &usize) -> std::cmp::Ordering + '_ {
    |a, b| values[*b].total_cmp(&values[*a]).then(a.cmp(b))
}

/// Indices of the `k` largest values, ties broken by lower index; in descending order.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx = at_or_above(values, |count, _| count >= k);
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, ranked(values));
        idx.truncate(k);
    }
    idx.sort_unstable_by(ranked(values));
    idx
}

/// Cells of [`at_or_above`]'s grid: a value's bits above the 19th, which for non-negative
/// floats rank as the values do (the exponent and four bits of the mantissa: each cell spans
/// at most 1/16 of its values).
const GRID_SHIFT: u32 = 19;
const GRID_CELLS: usize = (f32::INFINITY.to_bits() >> GRID_SHIFT) as usize + 1;

/// The indices (in no order) of the values at or above the highest cell of a fine grid of
/// thresholds where `enough(count, mass)` holds for the values at or above it; all of them
/// if it holds nowhere, or if a value is negative or NaN. A superset of the most likely
/// tokens `enough` needs that is a prefix of their ranking ([`ranked`]: equal values share a
/// cell), found by counting the values per cell and then picking them (two passes), where
/// ranking all 151,936 tokens of a vocabulary took up to 7.5 ms.
fn at_or_above(values: &[f32], enough: impl Fn(usize, f64) -> bool) -> Vec<usize> {
    let all = || (0..values.len()).collect();
    let mut count = vec![0usize; GRID_CELLS];
    let mut mass = vec![0f64; GRID_CELLS];
    for &v in values {
        let bits = v.to_bits();
        if bits > f32::INFINITY.to_bits() {
            return all(); // negative (the sign bit) or NaN
        }
        // Zeros (most of a vocabulary after top-k) are counted at the end: adding each to
        // one cell would make every addition wait for the one before.
        if bits != 0 {
            let cell = (bits >> GRID_SHIFT) as usize;
            count[cell] += 1;
            mass[cell] += f64::from(v);
        }
    }
    count[0] += values.len() - count.iter().sum::<usize>();
    let (mut n, mut m) = (0, 0.0);
    let Some(lowest) = (0..GRID_CELLS).rev().find(|&c| {
        n += count[c];
        m += mass[c];
        enough(n, m)
    }) else {
        return all();
    };
    let lowest = (lowest as u32) << GRID_SHIFT;
    (values.iter().enumerate())
        .filter(|(_, v)| v.to_bits() >= lowest)
        .map(|(i, _)| i)
        .collect()
}

/// Keeps the smallest set of most likely tokens whose mass reaches `top_p` of the total
/// (ties broken by lower index). The tokens whose mass reaches it by [`at_or_above`]'s count
/// (with a margin for the order of the additions) are ranked first; all the tokens only if
/// their running sum falls short.
fn apply_top_p(probs: &mut [f32], top_p: f32) {
    // In f64, so that a tail below f32's rounding of the running sum still adds up.
    let target = f64::from(top_p) * vecmath::sum_f64(probs);
    let nonzero = probs.iter().filter(|&&p| p > 0.0).count();
    if nonzero == 0 {
        return;
    }
    let cut = |idx: &[usize]| {
        let mut cum = 0f64;
        idx.iter().position(|&i| {
            cum += f64::from(probs[i]);
            cum >= target
        })
    };
    let mut idx = at_or_above(probs, |_, mass| mass >= 1.001 * target);
    idx.sort_unstable_by(ranked(probs));
    let kept = match cut(&idx) {
        Some(n) => n + 1,
        None => {
            // Ranked again only if some tokens were left out (the zeros rank last).
            if idx.len() < probs.len() {
                idx = top_indices(probs, nonzero);
            }
            cut(&idx).map_or(nonzero, |n| n + 1)
        }
    };
    let mut keep = vec![false; probs.len()];
    idx[..kept].iter().for_each(|&i| keep[i] = true);
    probs.iter_mut().zip(keep).for_each(|(p, k)| {
        if !k {
            *p = 0.0
        }
    });
}

impl Dist {
    /// Probability of `id`.
    pub fn prob(&self, id: u32) -> f32 {
        match self {
            Dist::Point(t) => (*t == id) as u8 as f32,
            Dist::Dense(p) => p.get(id as usize).copied().unwrap_or(0.0),
            Dist::Sparse(s) => s.iter().find(|(t, _)| *t == id).map_or(0.0, |(_, p)| *p),
        }
    }

    /// Multiplies every probability by `factor` (a point mass has none to scale).
    pub fn rescale(&mut self, factor: f64) {
        let scale = |p: &mut f32| *p = (f64::from(*p) * factor) as f32;
        match self {
            Dist::Point(_) => {}
            Dist::Dense(p) => p.iter_mut().for_each(scale),
            Dist::Sparse(s) => s.iter_mut().for_each(|(_, p)| scale(p)),
        }
    }

    /// Draws one token.
    ///
    /// # Panics
    /// On an empty sparse distribution (no token to draw; [`Request::check`] refuses one from a
    /// drafter).
    ///
    /// [`Request::check`]: crate::draft::Request::check
    pub fn sample(&self, rng: &mut impl rand::Rng) -> u32 {
        match self {
            Dist::Point(t) => *t,
            Dist::Dense(p) => sample_weights(p, rng),
            Dist::Sparse(s) => {
                let weights: Vec<f32> = s.iter().map(|(_, p)| *p).collect();
                s[sample_weights(&weights, rng) as usize].0
            }
        }
    }

    /// The most likely token (lowest id among equals).
    pub fn argmax(&self) -> u32 {
        match self {
            Dist::Point(t) => *t,
            Dist::Dense(p) => argmax(p),
            Dist::Sparse(s) => {
                let best = s.iter().fold(None::<(u32, f32)>, |b, &(t, p)| match b {
                    Some((bt, bp)) if bp > p || (bp == p && bt < t) => b,
                    _ => Some((t, p)),
                });
                best.map_or(0, |(t, _)| t)
            }
        }
    }

    /// Dense probabilities over `vocab` tokens.
    ///
    /// # Panics
    /// If a point mass or a sparse entry names an id of `vocab` or more.
    pub fn to_dense(&self, vocab: usize) -> Vec<f32> {
        match self {
            Dist::Point(t) => {
                let mut v = vec![0f32; vocab];
                v[*t as usize] = 1.0;
                v
            }
            Dist::Dense(p) => {
                // A drafter's narrower vocabulary: the ids beyond it have probability 0.
                let mut v = p.clone();
                v.resize(vocab.max(p.len()), 0.0);
                v
            }
            Dist::Sparse(s) => {
                let mut v = vec![0f32; vocab];
                s.iter().for_each(|&(t, p)| v[t as usize] += p);
                v
            }
        }
    }
}

/// Draws an index with probability proportional to `weights` (non-negative, positive sum).
///
/// In f64: over a vocabulary of 150,000 weights, f32 sums drift by about 1e-5 of the total
/// (moving the edges between tokens), and an f32 draw cannot tell probabilities below 2^-24.
pub fn sample_weights(weights: &[f32], rng: &mut impl rand::Rng) -> u32 {
    let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let mut u = rng.random::<f64>() * total;
    let mut last = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            let w = f64::from(w);
            if u < w {
                return i as u32;
            }
            u -= w;
            last = i;
        }
    }
    last as u32 // rounding left u just above the last weight
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peaked distribution over a large vocabulary sums to 1 to within f32's rounding of
    /// each probability: the review reads p(x) as given while a draw normalizes, and an f32
    /// total of the row lost the tail of the lane holding the peak (e^-17 each, below half an
    /// ulp of 1), so p summed to 1 + 8e-4.
    #[test]
    fn a_peaked_distribution_over_a_large_vocabulary_sums_to_one() {
        for temperature in [0.7, 1.0] {
            let mut logits = vec![0f32; 151_936];
            logits[7] = 17.0 * temperature;
            let s = Sampling {
                temperature,
                top_k: 0,
                top_p: 1.0,
            };
            let total: f64 = s
                .distribution(&logits)
                .to_dense(0)
                .iter()
                .map(|&p| f64::from(p))
                .sum();
            assert!((total - 1.0).abs() < 1e-6, "T = {temperature}: {total}");
        }
    }

    #[test]
    fn argmax_is_the_first_value_no_later_one_exceeds() {
        fn scan(values: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &v) in values.iter().enumerate() {
                if v > values[best] {
                    best = i;
                }
            }
            best as u32
        }
        use rand::{Rng as _, SeedableRng};
        let mut rng = Rng::seed_from_u64(7);
        let pool = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1.5,
            -2.0,
            3.0,
        ];
        for len in (0..40).chain([63, 64, 65, 130, 200]) {
            for _ in 0..200 {
                let v: Vec<f32> = (0..len)
                    .map(|_| pool[rng.random_range(0..pool.len())])
                    .collect();
                assert_eq!(argmax(&v), scan(&v), "{v:?}");
            }
        }
        let big: Vec<f32> = (0..151_936).map(|i| ((i * 7919) % 1000) as f32).collect();
        assert_eq!(argmax(&big), scan(&big));
    }

    fn dense(d: Dist) -> Vec<f32> {
        match d {
            Dist::Dense(p) => p,
            other => panic!("expected dense, got {other:?}"),
        }
    }

    #[test]
    fn greedy_is_a_point_mass_on_the_first_maximum() {
        let s = Sampling::greedy();
        assert_eq!(s.distribution(&[0.1, 3.0, -1.0, 3.0]), Dist::Point(1));
    }

    #[test]
    fn temperature_one_is_softmax() {
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        };
        let p = dense(s.distribution(&[0.0, (2f32).ln()]));
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn top_k_keeps_k_tokens_with_ties_to_lower_ids() {
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
        };
        let p = dense(s.distribution(&[1.0, 2.0, 2.0, 2.0, 0.0]));
        assert_eq!(p, vec![0.0, 0.5, 0.5, 0.0, 0.0]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // probs 0.5, 0.3, 0.2: top_p 0.7 needs 0.5 + 0.3.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.7,
        };
        let p = dense(s.distribution(&logits));
        assert!((p[0] - 0.625).abs() < 1e-6 && (p[1] - 0.375).abs() < 1e-6 && p[2] == 0.0);
        // A cut beyond a thousand tokens of a large vocabulary.
        let big: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 5000) as f32 / 1000.0)
            .collect();
        let s = Sampling {
            temperature: 2.0,
            top_k: 0,
            top_p: 0.999,
        };
        let p = dense(s.distribution(&big));
        let kept = p.iter().filter(|&&x| x > 0.0).count();
        assert!(kept > 1024 && kept < 5000, "kept {kept}");
    }

    /// The definition, spelled out: softmax at temperature T in f64, tokens ranked by
    /// probability (ties to the lower id), the first `top_k` kept, then the shortest prefix of
    /// those whose mass reaches `top_p` of theirs, renormalized.
    fn by_definition(s: &Sampling, logits: &[f32]) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = logits
            .iter()
            .map(|&l| ((l as f64 - max) / s.temperature as f64).exp())
            .collect();
        let mut order: Vec<usize> = (0..e.len()).collect();
        order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
        if s.top_k > 0 {
            order.truncate(s.top_k);
        }
        let mass: f64 = order.iter().map(|&i| e[i]).sum();
        let (mut cum, mut cut) = (0.0, order.len());
        for (n, &i) in order.iter().enumerate() {
            cum += e[i];
            if cum >= s.top_p as f64 * mass {
                cut = n + 1;
                break;
            }
        }
        let kept: f64 = order[..cut].iter().map(|&i| e[i]).sum();
        let mut p = vec![0.0; e.len()];
        order[..cut].iter().for_each(|&i| p[i] = e[i] / kept);
        p
    }

    /// Temperature, top-k and top-p, alone and combined, on a small and a larger vocabulary,
    /// with tied logits: the distribution is the definition's.
    #[test]
    fn sampling_follows_the_definition() {
        use rand::{Rng as _, SeedableRng};
        let mut rng = Rng::seed_from_u64(7);
        for vocab in [50, 3000] {
            // Logits on a grid of 1/8: many ties.
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (rng.random_range(-48..48) as f32) / 8.0)
                .collect();
            for temperature in [0.7, 1.0, 1.3] {
                for top_k in [0, 1, 5, 40] {
                    for top_p in [1.0, 0.95, 0.5, 0.05] {
                        let s = Sampling {
                            temperature,
                            top_k,
                            top_p,
                        };
                        let got = dense(s.distribution(&logits));
                        let want = by_definition(&s, &logits);
                        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                (g as f64 - w).abs() < 1e-5,
                                "vocabulary {vocab}, {s:?}: token {i} has {g}, not {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Top-k and top-p keep exactly what ranking every token would: the same indices, the
    /// same cut, on probabilities with ties, zeros, subnormals and flat tails, and at top-p
    /// values where the running sum of all tokens falls short of the target.
    #[test]
    fn ranking_a_grid_prefix_keeps_what_ranking_everything_keeps() {
        use rand::{Rng as _, SeedableRng};
        fn by_ranking_all(probs: &[f32], top_p: f32) -> Vec<f32> {
            let target = f64::from(top_p) * vecmath::sum_f64(probs);
            let mut order: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
            order.sort_by(ranked(probs));
            let mut cum = 0f64;
            let cut = order.iter().position(|&i| {
                cum += f64::from(probs[i]);
                cum >= target
            });
            let mut kept = vec![0.0; probs.len()];
            for &i in &order[..cut.map_or(order.len(), |n| n + 1)] {
                kept[i] = probs[i];
            }
            kept
        }
        let mut rng = Rng::seed_from_u64(11);
        for case in 0..40 {
            let vocab = [7, 1000, 20_000][case % 3];
            let probs: Vec<f32> = (0..vocab)
                .map(|_| match case % 4 {
                    0 => (rng.random_range(0..16) as f32) / 16.0, // ties and zeros
                    1 => rng.random::<f32>().powi(40),            // a long tail
                    2 => f32::from_bits(rng.random_range(0..1 << 24)), // subnormals, zero
                    _ => 1.0 + rng.random::<f32>() * 1e-3,        // flat
                })
                .collect();
            for k in [1, 2, 40.min(vocab), vocab - 1, vocab] {
                let mut all: Vec<usize> = (0..vocab).collect();
                all.sort_by(ranked(&probs));
                assert_eq!(top_indices(&probs, k), all[..k], "case {case}, k {k}");
            }
            for top_p in [0.05, 0.5, 0.9, 0.999, 0.999_999_9] {
                let mut got = probs.clone();
                apply_top_p(&mut got, top_p);
                assert_eq!(
                    got,
                    by_ranking_all(&probs, top_p),
                    "case {case}, top-p {top_p}"
                );
            }
        }
    }

    #[test]
    fn the_smallest_accepted_temperature_is_nearly_greedy() {
        let s = Sampling {
            temperature: f32::MIN_POSITIVE,
            top_k: 0,
            top_p: 0.9,
        };
        s.validate().unwrap();
        let d = s.distribution(&[0.5, 2.0, 1.0, 2.0 - 1e-6]);
        assert_eq!(d.argmax(), 1);
        assert!(d.prob(1) > 0.999, "{d:?}");
    }

    #[test]
    fn invalid_settings_are_refused() {
        let bad = |t: f32, p: f32| {
            Sampling {
                temperature: t,
                top_k: 0,
                top_p: p,
            }
            .validate()
            .unwrap_err()
            .to_string()
        };
        assert_eq!(
            bad(-0.5, 1.0),
            "invalid sampling setting: temperature must be a finite number >= 0, got -0.5"
        );
        assert_eq!(
            bad(f32::NAN, 1.0),
            "invalid sampling setting: temperature must be a finite number >= 0, got NaN"
        );
        assert_eq!(
            bad(1e-40, 0.9),
            "invalid sampling setting: temperature 1e-40 is too small to divide by; use 0 for greedy decoding"
        );
        assert_eq!(
            bad(1.0, 0.0),
            "invalid sampling setting: top_p must be in (0, 1], got 0"
        );
        assert_eq!(
            bad(1.0, 1.5),
            "invalid sampling setting: top_p must be in (0, 1], got 1.5"
        );
    }
}
