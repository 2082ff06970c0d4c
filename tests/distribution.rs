//! Speculative sampling reproduces the target's distribution exactly.
//!
//! On synthetic models with exactly computable distributions, generations are sampled many
//! times with speculative decoding, and each pair of successive tokens through the first round
//! (its K drafted positions and the bonus or recovered token) and into the next is compared
//! with the target's exact joint distribution by a chi-square test. Each comparison (one
//! configuration, all its pairs) has a false-alarm rate of 1e-4 (Bonferroni over the pairs;
//! critical values from the Wilson-Hilferty approximation), so a test of m comparisons has at
//! most m x 1e-4; seeds are fixed, so results are stable. Broken review rules (no residual,
//! the bonus or the residual from the wrong row, p and q swapped) must fail the same test.

mod common;

use cascade::costs::ForwardCost;
use cascade::draft::{Draft, Request};
use cascade::drafter::{
    AdaptiveCascade, BigramDrafter, Drafter, HorizontalCascade, MaxGramDrafter, MaxGramPolicy,
    NeuralDrafter, VerticalCascade,
};
use cascade::engine::{Engine, GenerateOptions};
use cascade::model::Logits;
use cascade::ngram::BigramTable;
use cascade::review::Verdict;
use cascade::sampling::Rng;
use cascade::sampling::{Dist, Sampling};
use common::{toy_tokenizer, ToyModel};
use rand::Rng as _;
use std::sync::Arc;

const VOCAB: usize = 6;
const SAMPLES: u64 = 20_000;
const PROMPT: [u32; 3] = [1, 4, 2];
/// Each comparison's false-alarm rate, over all the pairs it compares.
const FALSE_ALARM: f64 = 1e-4;

fn target() -> ToyModel {
    ToyModel::new(11, VOCAB, 3.0)
}

fn drafter() -> ToyModel {
    ToyModel::new(22, VOCAB, 4.0)
}

/// Exact probability of each pair of successive generated tokens (j, j + 1) under the
/// target, for j in 0..=k: row `a * VOCAB + b` of entry j is P(token j = a, token j + 1 = b).
fn exact(s: &Sampling, k: usize) -> Vec<Vec<f64>> {
    let t = target();
    // The toy target's token j depends on the two tokens before it and on its position only:
    // the joint of each pair of successive tokens follows from the pair before.
    let n = PROMPT.len();
    let next = |before: usize, prev: usize, j: usize| -> Vec<f32> {
        let mut ctx = PROMPT.to_vec();
        ctx.resize(n + j, 0);
        let len = ctx.len();
        (ctx[len - 2], ctx[len - 1]) = (before as u32, prev as u32);
        s.distribution(&t.logits_after(&ctx)).to_dense(VOCAB)
    };
    // P(token j - 1 = a, token j = b), token -1 being the prompt's last.
    let mut joint = vec![0f64; VOCAB * VOCAB];
    let (before, last) = (PROMPT[n - 2] as usize, PROMPT[n - 1] as usize);
    for (b, &p) in next(before, last, 0).iter().enumerate() {
        joint[last * VOCAB + b] = p as f64;
    }
    let mut pairs = Vec::new();
    for j in 0..=k {
        let mut cells = vec![0f64; VOCAB * VOCAB];
        for a in 0..VOCAB {
            for b in 0..VOCAB {
                let p_ab = joint[a * VOCAB + b];
                if p_ab == 0.0 {
                    continue;
                }
                for (c, &p) in next(a, b, j + 1).iter().enumerate() {
                    cells[b * VOCAB + c] += p_ab * p as f64;
                }
            }
        }
        joint = cells.clone();
        pairs.push(cells);
    }
    pairs
}

/// Counts of each pair of successive tokens (j, j + 1), j in 0..=k, as [`exact`] lays them out.
type Counts = Vec<Vec<u64>>;

/// Adds `tokens`' pairs to `counts`.
fn count_pairs(counts: &mut Counts, tokens: &[u32]) {
    for (j, c) in counts.iter_mut().enumerate() {
        c[tokens[j] as usize * VOCAB + tokens[j + 1] as usize] += 1;
    }
}

/// Options generating k + 2 tokens, so that the first round drafts all k positions and the
/// pairs reach into the second round.
fn options(s: &Sampling, k: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: k + 2,
        sampling: *s,
        k,
        ..Default::default()
    }
}

fn engine(reviewer: Option<cascade::reviewer::ReviewRule>) -> Engine {
    engine_with(
        Box::new(NeuralDrafter::new("toy-draft", Box::new(drafter()))),
        reviewer,
    )
}

fn engine_with(d: Box<dyn Drafter>, reviewer: Option<cascade::reviewer::ReviewRule>) -> Engine {
    let e = Engine::new(Box::new(target()), Some(d), toy_tokenizer(VOCAB));
    match reviewer {
        Some(r) => e.with_review_rule(r),
        None => e,
    }
}

/// Pair counts over `SAMPLES` seeds, drafting `k` tokens per call.
fn sampled(s: &Sampling, k: usize, reviewer: Option<cascade::reviewer::ReviewRule>) -> Counts {
    sampled_with(&mut engine(reviewer), s, k, (0.2, 0.9))
}

/// The same with any engine; `acceptance` bounds the acceptance rate for the test to mean much.
fn sampled_with(e: &mut Engine, s: &Sampling, k: usize, acceptance: (f64, f64)) -> Counts {
    let mut counts = vec![vec![0u64; VOCAB * VOCAB]; k + 1];
    let (mut drafted, mut accepted) = (0, 0);
    let mut opts = options(s, k);
    for seed in 0..SAMPLES {
        opts.seed = seed;
        let out = e.generate(&PROMPT, &opts, &mut |_| {}).unwrap();
        count_pairs(&mut counts, &out.tokens);
        drafted += out.stats.drafted;
        accepted += out.stats.accepted;
    }
    // The test means something only if drafts are both accepted and rejected often.
    let rate = accepted as f64 / drafted as f64;
    assert!(
        (acceptance.0..acceptance.1).contains(&rate),
        "acceptance rate {rate:.2} makes the test weak"
    );
    counts
}

/// Chi-square goodness of fit of every pair, at [`FALSE_ALARM`] over all of them: the largest
/// statistic, or the first rejected pair's details.
fn fit(expected: &[Vec<f64>], counts: &Counts) -> Result<f64, String> {
    assert_eq!(expected.len(), counts.len());
    let z = upper_quantile(FALSE_ALARM / expected.len() as f64);
    let mut largest = 0f64;
    for (j, (p, c)) in expected.iter().zip(counts).enumerate() {
        let stat = chi_square(p, c, z).map_err(|e| format!("tokens {j} and {}: {e}", j + 1))?;
        largest = largest.max(stat);
    }
    Ok(largest)
}

/// The standard normal quantile with upper tail `alpha`, by bisection on the tail
/// (Q(z) = erfc(z / sqrt 2) / 2, erfc from Numerical Recipes: relative error below 1.2e-7).
fn upper_quantile(alpha: f64) -> f64 {
    let tail = |z: f64| {
        let x = z / std::f64::consts::SQRT_2;
        let t = 1.0 / (1.0 + 0.5 * x);
        let poly = [
            -1.26551223,
            1.00002368,
            0.37409196,
            0.09678418,
            -0.18628806,
            0.27886807,
            -1.13520398,
            1.48851587,
            -0.82215223,
            0.17087277,
        ]
        .iter()
        .rev()
        .fold(0.0, |acc, c| c + t * acc);
        t * (-x * x + poly).exp() / 2.0
    };
    let (mut lo, mut hi) = (0.0, 12.0);
    for _ in 0..100 {
        let mid = (lo + hi) / 2.0;
        if tail(mid) > alpha {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[test]
fn the_critical_values_are_the_normal_quantiles() {
    // Tables: 3.7190 for 1e-4, 4.1075 for 2e-5, 1.6449 for 0.05.
    for (alpha, z) in [(1e-4, 3.7190), (2e-5, 4.1075), (0.05, 1.6449)] {
        assert!((upper_quantile(alpha) - z).abs() < 1e-3, "{alpha}");
    }
}

/// Chi-square goodness of fit; cells expecting fewer than 5 are pooled. An error with the
/// details if the fit is rejected at the one-sided normal quantile `z` (through Wilson-Hilferty),
/// or if an impossible pair appears.
fn chi_square(expected_p: &[f64], counts: &[u64], z: f64) -> Result<f64, String> {
    let n = counts.iter().sum::<u64>() as f64;
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_e, mut pool_o) = (0.0, 0.0);
    for (&p, &o) in expected_p.iter().zip(counts) {
        if p == 0.0 && o > 0 {
            return Err(format!("a pair of probability 0 was sampled {o} times"));
        }
        let e = p * n;
        if e < 5.0 {
            pool_e += e;
            pool_o += o as f64;
        } else {
            stat += (o as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
        cells += 1;
    }
    let df = (cells - 1).max(1) as f64;
    let h = 2.0 / (9.0 * df);
    let critical = df * (1.0 - h + z * h.sqrt()).powi(3);
    if stat > critical {
        Err(format!(
            "chi-square {stat:.1} > critical {critical:.1} (df {df})"
        ))
    } else {
        Ok(stat)
    }
}

fn settings() -> Vec<(&'static str, Sampling)> {
    let s = |temperature, top_k, top_p| Sampling {
        temperature,
        top_k,
        top_p,
    };
    vec![
        ("temperature 0.7", s(0.7, 0, 1.0)),
        ("temperature 1.0", s(1.0, 0, 1.0)),
        ("top-k 3", s(1.0, 3, 1.0)),
        ("top-p 0.8", s(1.0, 0, 0.8)),
        ("temperature 0.7, top-k 4, top-p 0.9", s(0.7, 4, 0.9)),
    ]
}

#[test]
fn speculative_sampling_matches_the_target_distribution() {
    let mut failures = Vec::new();
    for (label, s) in settings() {
        for k in [1, 4] {
            match fit(&exact(&s, k), &sampled(&s, k, None)) {
                Ok(stat) => eprintln!("{label}, K={k}: chi-square {stat:.1}"),
                Err(e) => failures.push(format!("{label}, K={k}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Samples with drafters from `make`, which never propose the last id, at the first two
/// settings and K = 4, and fits the target's distribution, in which that id matters.
fn never_drafting_the_last_id_keeps_the_distribution(
    what: &str,
    make: impl Fn() -> Box<dyn Drafter>,
) {
    let mut failures = Vec::new();
    for (label, s) in &settings()[..2] {
        let p = exact(s, 4);
        assert!(
            p[0].chunks(VOCAB).map(|row| row[VOCAB - 1]).sum::<f64>() > 0.05,
            "the last id must matter"
        );
        let mut e = engine_with(make(), None);
        match fit(&p, &sampled_with(&mut e, s, 4, (0.2, 0.9))) {
            Ok(stat) => eprintln!("{what}, {label}: chi-square {stat:.1}"),
            Err(err) => failures.push(format!("{what}, {label}: {err}")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A drafter scoring part of the vocabulary (its trimmed vocabulary plus the prompt's tokens)
/// never proposes the others, which the target still samples: the review keeps the target's
/// distribution because the drafter reports the distribution over the part it sampled from.
#[test]
fn a_trimmed_draft_vocabulary_keeps_the_target_distribution() {
    // Scored: 0 and 3, and the prompt's 1, 4 and 2; never 5.
    never_drafting_the_last_id_keeps_the_distribution("trimmed vocabulary", || {
        Box::new(
            NeuralDrafter::new("trimmed", Box::new(drafter())).with_vocabulary(Arc::from([0, 3])),
        )
    });
}

/// A drafter model of a narrower vocabulary, the beginning of the target's (as the Qwen2.5
/// 0.5B's 151,936 ids are of the 7B's 152,064), reports distributions over its own ids: the
/// review reads the ids it lacks as never drafted, and the output keeps the target's
/// distribution. The drafter reads the id it lacks, which the target samples, as its last
/// (a toy model, as a real one, refuses ids beyond its vocabulary).
#[test]
fn a_drafter_of_a_narrower_vocabulary_keeps_the_target_distribution() {
    never_drafting_the_last_id_keeps_the_distribution("narrower vocabulary", || {
        let narrow = ToyModel::new(22, VOCAB - 1, 4.0);
        Box::new(NeuralDrafter::new("narrow", Box::new(narrow)))
    });
}

#[test]
fn greedy_speculative_output_is_the_targets_argmax_chain() {
    let t = target();
    let mut ctx = PROMPT.to_vec();
    for _ in 0..6 {
        let next = cascade::sampling::argmax(&t.logits_after(&ctx));
        ctx.push(next);
    }
    let expected = &ctx[PROMPT.len()..];
    for k in [1, 4] {
        let mut e = engine(None);
        let (mut drafted, mut accepted) = (0, 0);
        for seed in 0..50 {
            let opts = GenerateOptions {
                max_new_tokens: 6,
                k,
                seed,
                ..Default::default()
            };
            let out = e.generate(&PROMPT, &opts, &mut |_| {}).unwrap();
            assert_eq!(out.tokens, expected, "K={k}, seed {seed}");
            (drafted, accepted) = (drafted + out.stats.drafted, accepted + out.stats.accepted);
        }
        // Drafts were both kept and rejected: the equality is speculation's, not decoding's.
        assert!(
            0 < accepted && accepted < drafted,
            "K={k}: {accepted} of {drafted}"
        );
    }
}

/// At the target's context limit a round's drafts and bonus token stop exactly where plain
/// decoding stops: a drafter that is always right (the target itself) cannot push the output
/// past the context by its bonus token.
#[test]
fn greedy_speculative_output_stops_at_the_context_limit_as_plain_decoding_does() {
    for room in [1, 2, 5, 6] {
        let limited = || {
            let mut t = target();
            t.max_len = PROMPT.len() + room;
            Box::new(t)
        };
        let opts = |k| GenerateOptions {
            max_new_tokens: 100,
            k,
            ..Default::default()
        };
        let mut plain = Engine::new(limited(), None, toy_tokenizer(VOCAB));
        let expected = plain.generate(&PROMPT, &opts(1), &mut |_| {}).unwrap();
        assert_eq!(expected.tokens.len(), room);
        for k in [1, 4, 8] {
            let d = Box::new(NeuralDrafter::new("same", Box::new(target())));
            let mut e = Engine::new(limited(), Some(d), toy_tokenizer(VOCAB));
            let out = e.generate(&PROMPT, &opts(k), &mut |_| {}).unwrap();
            assert_eq!(out.tokens, expected.tokens, "room {room}, K={k}");
            assert_eq!(
                out.finish_reason, expected.finish_reason,
                "room {room}, K={k}"
            );
        }
    }
}

/// Classic mistakes of a speculative sampling review.
#[derive(Clone, Copy, PartialEq)]
enum Mistake {
    /// On rejection, samples from p instead of the residual max(0, p - q).
    NoResidual,
    /// Takes the residual from the next position's row.
    ResidualFromNextRow,
    /// After a fully accepted draft, samples the bonus token from the last draft row.
    BonusFromLastDraftRow,
    /// Keeps a token with probability min(1, q / p) instead of min(1, p / q).
    PAndQSwapped,
}

/// The review of [`cascade::review::review`] (lenience 1) with `mistake` made.
fn mistaken_review(
    mistake: Mistake,
    draft: &[u32],
    q: &[Dist],
    logits: &Logits,
    s: &Sampling,
    rng: &mut Rng,
) -> Verdict {
    for (i, (&x, qi)) in draft.iter().zip(q).enumerate() {
        let p = s.distribution(logits.row(i));
        let (px, qx) = (p.prob(x), qi.prob(x));
        let kept = match mistake {
            Mistake::PAndQSwapped => rng.random::<f32>() * px < qx,
            _ => rng.random::<f32>() * qx < px,
        };
        if !kept {
            let next = match mistake {
                Mistake::NoResidual => p.sample(rng),
                Mistake::ResidualFromNextRow => {
                    let next_row = s.distribution(logits.row(i + 1));
                    cascade::review::residual_sample(&next_row, qi, rng)
                }
                _ => cascade::review::residual_sample(&p, qi, rng),
            };
            return Verdict { accepted: i, next };
        }
    }
    let row = match mistake {
        Mistake::BonusFromLastDraftRow => draft.len().saturating_sub(1),
        _ => draft.len(),
    };
    Verdict {
        accepted: draft.len(),
        next: s.distribution(logits.row(row)).sample(rng),
    }
}

/// [`mistaken_review`] as review rules (plain functions, as the engine takes them).
macro_rules! mistaken_rule {
    ($name:ident, $mistake:expr) => {
        fn $name(
            draft: &[u32],
            q: &[Dist],
            logits: &Logits,
            s: &Sampling,
            _lenience: f32,
            rng: &mut Rng,
            _emitted: Option<&mut Vec<Dist>>,
        ) -> Verdict {
            mistaken_review($mistake, draft, q, logits, s, rng)
        }
    };
}
mistaken_rule!(review_without_residual, Mistake::NoResidual);
mistaken_rule!(
    review_with_residual_from_next_row,
    Mistake::ResidualFromNextRow
);
mistaken_rule!(
    review_with_bonus_from_last_draft_row,
    Mistake::BonusFromLastDraftRow
);
mistaken_rule!(review_with_p_and_q_swapped, Mistake::PAndQSwapped);

/// Each mistake is caught: the test has the power to see what it is for. The bonus token after
/// a draft of 4 and the residual at later positions are caught only by the pairs past the
/// first two tokens.
#[test]
fn broken_verifiers_fail_the_test() {
    let rules: [(&str, cascade::reviewer::ReviewRule, usize); 5] = [
        ("no residual, K=1", review_without_residual, 1),
        ("no residual, K=4", review_without_residual, 4),
        (
            "residual from the next row, K=4",
            review_with_residual_from_next_row,
            4,
        ),
        (
            "bonus from the last draft row, K=4",
            review_with_bonus_from_last_draft_row,
            4,
        ),
        ("p and q swapped, K=4", review_with_p_and_q_swapped, 4),
    ];
    for (label, s) in settings().into_iter().take(2) {
        for (name, rule, k) in rules {
            let counts = sampled_with(&mut engine(Some(rule)), &s, k, (0.05, 0.95));
            assert!(
                fit(&exact(&s, k), &counts).is_err(),
                "{label}: {name} went undetected"
            );
        }
    }
}

/// A target whose rollback after a rejected draft is subtly wrong: cutting back to `n`
/// positions leaves a rejected token in the last position kept (the one before the next token
/// fed, which the engine feeds itself, so the mistake shows only in what follows). Cuts into
/// the prompt (the prompt cache's, between generations) stay right, so that only the rounds'
/// rollbacks are wrong.
struct StaleRollback(ToyModel);

impl cascade::model::Model for StaleRollback {
    fn name(&self) -> &str {
        "stale"
    }
    fn forward(&mut self, tokens: &[u32]) -> cascade::Result<Logits> {
        self.0.forward(tokens)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn truncate(&mut self, n: usize) {
        let t = &mut self.0.tokens;
        if n > PROMPT.len() && n < t.len() {
            t[n - 1] = t[n];
        }
        t.truncate(n);
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn max_len(&self) -> usize {
        self.0.max_len
    }
}

/// The toy models read the token before the one fed too, so a rollback leaving a stale token
/// there fails the test (a toy model reading only the token fed passed it).
#[test]
fn a_rollback_that_leaves_a_stale_token_fails_the_test() {
    let s = settings()[1].1;
    let d = NeuralDrafter::new("toy-draft", Box::new(drafter()));
    let mut e = Engine::new(
        Box::new(StaleRollback(target())),
        Some(Box::new(d)),
        toy_tokenizer(VOCAB),
    );
    let counts = sampled_with(&mut e, &s, 4, (0.2, 0.9));
    let fit = fit(&exact(&s, 4), &counts);
    eprintln!("stale rollback: {fit:?}");
    assert!(
        fit.is_err(),
        "a stale token left by a rollback went undetected"
    );
}

/// A bigram table of the toy target's own greedy-ish transitions: some proposals are right.
fn toy_table() -> Arc<BigramTable> {
    let t = target();
    let mut counts = fxhash::FxHashMap::default();
    for prev in 0..VOCAB as u32 {
        let logits = t.logits_after(&[prev, prev, prev, prev]);
        for (next, &l) in logits.iter().enumerate() {
            counts.insert((prev, next as u32), 1 + (l * 10.0) as u32);
        }
    }
    Arc::new(BigramTable::from_counts(&counts, &[], VOCAB, 3, 0))
}

#[test]
fn statistical_drafters_keep_the_target_distribution() {
    let s = Sampling {
        temperature: 0.7,
        top_k: 0,
        top_p: 1.0,
    };
    let p = exact(&s, 4);
    let policy = MaxGramPolicy {
        max_ngram: 4,
        min_match: 1,
        bigram_tokens: 4,
        ..Default::default()
    };
    let drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
        (
            "max-gram",
            Box::new(MaxGramDrafter::new("mag", policy, Some(toy_table()))),
        ),
        (
            "bigram argmax",
            Box::new(BigramDrafter::new("bigram", toy_table(), false)),
        ),
        (
            "bigram sampled",
            Box::new(BigramDrafter::new("bigram", toy_table(), true)),
        ),
    ];
    for (label, d) in drafters {
        let mut e = engine_with(d, None);
        let counts = sampled_with(&mut e, &s, 4, (0.05, 0.95));
        match fit(&p, &counts) {
            Ok(stat) => eprintln!("{label}: chi-square {stat:.1}"),
            Err(err) => panic!("{label}: {err}"),
        }
    }
}

/// Lenient reviews of a deterministic drafter (point masses) and of a sampling one (sparse
/// distributions), top-k together with lenience, and a fixed horizontal schedule mixing a
/// draft model with Max-Gram: each keeps the target's distribution.
#[test]
fn lenient_reviews_of_statistical_drafters_and_fixed_schedules_keep_the_target_distribution() {
    let policy = MaxGramPolicy {
        max_ngram: 4,
        min_match: 1,
        bigram_tokens: 4,
        ..Default::default()
    };
    let mag =
        || -> Box<dyn Drafter> { Box::new(MaxGramDrafter::new("mag", policy, Some(toy_table()))) };
    let lenient = |inner: Box<dyn Drafter>| -> Box<dyn Drafter> {
        let reviewer = Box::new(ToyModel::new(33, VOCAB, 3.0));
        Box::new(VerticalCascade::new("r", reviewer, inner, 3, 2.0))
    };
    let schedule = || -> Box<dyn Drafter> {
        let model: Box<dyn Drafter> = Box::new(NeuralDrafter::new("d", Box::new(drafter())));
        Box::new(HorizontalCascade::new("h", vec![(model, 2), (mag(), 2)]))
    };
    let s = |temperature, top_k, top_p| Sampling {
        temperature,
        top_k,
        top_p,
    };
    let (top_k, nucleus) = (s(0.7, 3, 1.0), s(1.0, 0, 0.8));
    let sampled_bigrams = || Box::new(BigramDrafter::new("bigram", toy_table(), true));
    let cases: Vec<(&str, Sampling, Box<dyn Drafter>)> = vec![
        (
            "a lenient review of Max-Gram, top-k 3",
            top_k,
            lenient(mag()),
        ),
        (
            "a lenient review of Max-Gram, top-p 0.8",
            nucleus,
            lenient(mag()),
        ),
        (
            "a lenient review of sampled bigrams, top-k 3",
            top_k,
            lenient(sampled_bigrams()),
        ),
        ("the draft model then Max-Gram, top-k 3", top_k, schedule()),
        (
            "the draft model then Max-Gram, top-p 0.8",
            nucleus,
            schedule(),
        ),
    ];
    let mut failures = Vec::new();
    for (label, s, d) in cases {
        let mut e = engine_with(d, None);
        let counts = sampled_with(&mut e, &s, 4, (0.05, 0.95));
        match fit(&exact(&s, 4), &counts) {
            Ok(stat) => eprintln!("{label}: chi-square {stat:.1}"),
            Err(err) => failures.push(format!("{label}: {err}")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Two reviewers over an innermost neural drafter, lenience `l` at both inner reviews:
/// target <- R1 (reviews) <- R2 (reviews) <- D.
fn three_level(lenience: f32, broken: bool) -> Box<dyn Drafter> {
    let inner = VerticalCascade::new(
        "r2",
        Box::new(ToyModel::new(44, VOCAB, 2.5)),
        Box::new(NeuralDrafter::new("d", Box::new(drafter()))),
        3,
        lenience,
    );
    let outer = VerticalCascade::new(
        "r1",
        Box::new(ToyModel::new(33, VOCAB, 3.0)),
        Box::new(inner),
        2,
        lenience,
    );
    Box::new(if broken {
        outer.reporting_reviewer_distribution()
    } else {
        outer
    })
}

fn nucleus_settings() -> [(&'static str, Sampling); 2] {
    [
        (
            "temperature 0.7, top-p 0.9",
            Sampling {
                temperature: 0.7,
                top_k: 0,
                top_p: 0.9,
            },
        ),
        (
            "temperature 1.0, top-p 0.9",
            Sampling {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.9,
            },
        ),
    ]
}

#[test]
fn a_lenient_three_level_cascade_keeps_the_target_distribution() {
    for (label, s) in nucleus_settings() {
        let mut e = engine_with(three_level(2.0, false), None);
        let counts = sampled_with(&mut e, &s, 4, (0.1, 0.95));
        match fit(&exact(&s, 4), &counts) {
            Ok(stat) => eprintln!("three-level, {label}: chi-square {stat:.1}"),
            Err(err) => panic!("three-level, {label}: {err}"),
        }
    }
}

#[test]
fn a_cascade_reporting_the_reviewers_distribution_fails_the_test() {
    for (label, s) in nucleus_settings() {
        let mut e = engine_with(three_level(2.0, true), None);
        let counts = sampled_with(&mut e, &s, 4, (0.1, 0.95));
        assert!(
            fit(&exact(&s, 4), &counts).is_err(),
            "{label}: reporting p instead of the effective distribution went undetected"
        );
    }
}

/// Every cascade shape, greedy, with lenience inside: the output is the target's argmax chain.
#[test]
fn every_cascade_shape_decodes_greedily_like_the_target() {
    let t = target();
    let mut ctx = PROMPT.to_vec();
    for _ in 0..12 {
        ctx.push(cascade::sampling::argmax(&t.logits_after(&ctx)));
    }
    let expected = ctx[PROMPT.len()..].to_vec();
    let neural = || -> Box<dyn Drafter> { Box::new(NeuralDrafter::new("d", Box::new(drafter()))) };
    let mag = || -> Box<dyn Drafter> {
        Box::new(MaxGramDrafter::new(
            "mag",
            MaxGramPolicy {
                max_ngram: 4,
                min_match: 1,
                bigram_tokens: 3,
                ..Default::default()
            },
            Some(toy_table()),
        ))
    };
    let vertical = |inner: Box<dyn Drafter>, l: f32| -> Box<dyn Drafter> {
        Box::new(VerticalCascade::new(
            "r",
            Box::new(ToyModel::new(33, VOCAB, 3.0)),
            inner,
            3,
            l,
        ))
    };
    let shapes: Vec<(&str, Box<dyn Drafter>)> = vec![
        ("vertical over neural", vertical(neural(), 1.0)),
        ("vertical over max-gram, lenient", vertical(mag(), 3.0)),
        (
            "horizontal",
            Box::new(HorizontalCascade::new(
                "h",
                vec![(vertical(neural(), 2.0), 2), (mag(), 3)],
            )),
        ),
        ("three levels", vertical(vertical(mag(), 2.0), 2.0)),
        (
            "horizontal of horizontals",
            Box::new(HorizontalCascade::new(
                "h",
                vec![
                    (mag(), 1),
                    (
                        Box::new(HorizontalCascade::new(
                            "h2",
                            vec![(neural(), 1), (mag(), 2)],
                        )),
                        4,
                    ),
                ],
            )),
        ),
    ];
    for (label, d) in shapes {
        let mut e = engine_with(d, None);
        let (mut drafted, mut accepted) = (0, 0);
        for k in [1, 3, 6] {
            let opts = GenerateOptions {
                max_new_tokens: 12,
                k,
                ..Default::default()
            };
            let out = e.generate(&PROMPT, &opts, &mut |_| {}).unwrap();
            assert_eq!(out.tokens, expected, "{label}, K={k}");
            (drafted, accepted) = (drafted + out.stats.drafted, accepted + out.stats.accepted);
        }
        assert!(
            0 < accepted && accepted < drafted,
            "{label}: {accepted} of {drafted}"
        );
    }
}

/// A model whose next-token distribution ignores the context: exact acceptance rates.
struct ConstModel {
    logits: Vec<f32>,
    len: usize,
}

impl cascade::model::Model for ConstModel {
    fn name(&self) -> &str {
        "const"
    }
    fn forward(&mut self, tokens: &[u32]) -> cascade::Result<Logits> {
        self.len += tokens.len();
        Ok(Logits::new(
            self.logits.repeat(tokens.len()),
            self.logits.len(),
        ))
    }
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    fn vocab_size(&self) -> usize {
        self.logits.len()
    }
    fn max_len(&self) -> usize {
        usize::MAX
    }
}

/// With p = (0.5, 0.5) and q = (0.8, 0.2) every draft token is accepted with probability
/// a = sum min(p, q) = 0.7: the measured tokens per target call must match
/// (1 - a^(g+1)) / (1 - a) within 2% (over ~20,000 tokens the standard error is below 0.5%).
#[test]
fn measured_tokens_per_call_match_the_closed_form() {
    let model = |p: [f32; 2]| {
        Box::new(ConstModel {
            logits: p.map(f32::ln).to_vec(),
            len: 0,
        })
    };
    let s = Sampling {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    for g in [1, 3, 6] {
        let d = NeuralDrafter::new("q", model([0.8, 0.2]));
        let mut e = Engine::new(model([0.5, 0.5]), Some(Box::new(d)), toy_tokenizer(2));
        let opts = GenerateOptions {
            max_new_tokens: 20_000,
            k: g,
            sampling: s,
            seed: 3,
            ..Default::default()
        };
        let out = e.generate(&[0], &opts, &mut |_| {}).unwrap();
        let want = cascade::theory::expected_tokens(0.7, g);
        let got = out.stats.tokens_per_call();
        assert!(
            (got - want).abs() / want < 0.02,
            "g={g}: measured {got:.3}, formula {want:.3}"
        );
    }
}

/// A verify cost where each extra scored token adds 15% of a decode step: an adaptive gate
/// then declines positions that are unlikely enough, so drafts of every length occur.
fn verify_cost() -> ForwardCost {
    ForwardCost {
        decode_seconds: 0.01,
        ratios: (1..=16).map(|k| (k, 1.0 + 0.15 * (k - 1) as f64)).collect(),
        per_context: Vec::new(),
    }
}

/// Adaptive drafting (the gate, the dynamic horizontal cascade, an adaptive vertical cascade
/// inside it) keeps the target's distribution at temperatures 0.7 and 1.0: draft lengths
/// follow the drafters' confidence and the learned acceptance, both known before each token
/// is sampled.
#[test]
fn adaptive_drafting_keeps_the_target_distribution() {
    let policy = MaxGramPolicy {
        max_ngram: 4,
        min_match: 1,
        bigram_tokens: 2,
        ..Default::default()
    };
    let draft_cost = ForwardCost {
        decode_seconds: 0.001,
        ratios: vec![(1, 1.0)],
        per_context: Vec::new(),
    };
    let neural_at =
        |cost: &ForwardCost| NeuralDrafter::new("d", Box::new(drafter())).with_cost(cost);
    let neural = || neural_at(&draft_cost);
    let mag = || MaxGramDrafter::new("mag", policy, Some(toy_table()));
    // A reviewer a twentieth of the target's cost (at a fifth, the vertical cascade drafted
    // too little for the test to mean much), drafted for by a model a tenth of its own: the
    // reviewer's gate then drafts with it where it is confident (about 6,400 tokens at
    // temperature 0.7, 44% kept). At 0.4 of the reviewer's cost the toy drafter's acceptance
    // never paid for its tokens: the inner review drafted nothing and was plain decoding,
    // which the assertion below now catches.
    let reviewer_cost = ForwardCost {
        decode_seconds: 0.0005,
        ..verify_cost()
    };
    let inner_cost = ForwardCost {
        decode_seconds: 0.00005,
        ..draft_cost.clone()
    };
    let vertical = || {
        let reviewer = Box::new(ToyModel::new(33, VOCAB, 3.0));
        VerticalCascade::new("r", reviewer, Box::new(neural_at(&inner_cost)), 3, 1.0)
            .with_adaptive(reviewer_cost.clone())
    };
    let mut failures = Vec::new();
    for (label, s) in [&settings()[0], &settings()[1]] {
        let p = exact(s, 4);
        let drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
            ("adaptive gate, neural drafter", Box::new(neural())),
            (
                "dynamic cascade of Max-Gram and the neural drafter",
                Box::new(AdaptiveCascade::new(
                    "auto",
                    vec![Box::new(mag()), Box::new(neural())],
                )),
            ),
            (
                "dynamic cascade of Max-Gram and an adaptive vertical cascade",
                Box::new(AdaptiveCascade::new(
                    "auto",
                    vec![Box::new(mag()), Box::new(vertical())],
                )),
            ),
        ];
        for (name, d) in drafters {
            let mut e = Engine::new(Box::new(target()), Some(d), toy_tokenizer(VOCAB))
                .with_adaptive(verify_cost(), &[]);
            let (counts, mean_draft, inner) = sampled_with_drafts(&mut e, s, 4);
            // The gate must have both drafted and declined for the test to mean much.
            assert!(
                (0.3..3.7).contains(&mean_draft),
                "{name}, {label}: mean longest draft {mean_draft:.2}"
            );
            // So must a vertical cascade's review, and its drafts be both kept and rejected.
            if name.contains("vertical") {
                let (calls, drafted, accepted) = inner;
                assert!(
                    calls > 0 && 0 < accepted && accepted < drafted,
                    "{name}, {label}: inner review kept {accepted} of {drafted} in {calls} calls"
                );
            }
            match fit(&p, &counts) {
                Ok(stat) => {
                    eprintln!("{name}, {label}: chi-square {stat:.1}, mean longest draft {mean_draft:.2}, vertical reviews (calls, drafted, kept) {inner:?}")
                }
                Err(err) => failures.push(format!("{name}, {label}: {err}")),
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Pair counts over `SAMPLES` seeds, the mean number of draft positions a generation
/// reached (its longest draft), and the vertical cascades' reviewer calls, drafted and kept
/// tokens, summed over the generations.
fn sampled_with_drafts(
    e: &mut Engine,
    s: &Sampling,
    k: usize,
) -> (Counts, f64, (usize, usize, usize)) {
    fn add_vertical(node: &cascade::draft::NodeStats, sums: &mut (usize, usize, usize)) {
        if node.kind == cascade::draft::NodeKind::Vertical {
            let sum = |v: &[usize]| v.iter().sum::<usize>();
            sums.0 += node.forward_calls;
            sums.1 += sum(&node.reviews.drafted_at);
            sums.2 += sum(&node.reviews.accepted_at);
        }
        node.children.iter().for_each(|c| add_vertical(c, sums));
    }
    let mut inner = (0, 0, 0);
    let mut counts = vec![vec![0u64; VOCAB * VOCAB]; k + 1];
    let mut first_drafts = 0usize;
    let mut opts = options(s, k);
    let offset: u64 = std::env::var("SEED_OFFSET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    for seed in offset..offset + SAMPLES {
        opts.seed = seed;
        let out = e.generate(&PROMPT, &opts, &mut |_| {}).unwrap();
        count_pairs(&mut counts, &out.tokens);
        if let Some(tree) = &out.drafter {
            add_vertical(tree, &mut inner);
        }
        first_drafts += out.stats.reviews.drafted_at.first().map_or(0, |_| {
            out.stats
                .reviews
                .drafted_at
                .iter()
                .filter(|&&c| c > 0)
                .count()
        });
    }
    (counts, first_drafts as f64 / SAMPLES as f64, inner)
}

/// Deliberately wrong: samples its token first, then asks the gate with a confidence that
/// depends on which token came out (high for its argmax), while reporting the distribution it
/// sampled from. Under an adaptive gate it proposes mostly its argmax, so the tokens it
/// proposes no longer follow the distribution it reports.
struct Peeking;

impl Drafter for Peeking {
    fn name(&self) -> &str {
        "peeking"
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> cascade::Result<Draft> {
        let q = request
            .sampling()
            .distribution(&drafter().logits_after(context));
        let x = q.sample(request.rng());
        let confidence = if x == q.argmax() { 0.99 } else { 0.01 };
        let mut draft = Draft::new();
        if request.admit(Some(confidence)) {
            draft.push(x, q);
        }
        Ok(draft)
    }
}

#[test]
fn a_gate_asked_after_sampling_fails_the_test() {
    let s = settings()[1].1;
    let mut e = Engine::new(
        Box::new(target()),
        Some(Box::new(Peeking)),
        toy_tokenizer(VOCAB),
    )
    .with_adaptive(verify_cost(), &[]);
    let (counts, mean_draft, _) = sampled_with_drafts(&mut e, &s, 1);
    assert!(mean_draft > 0.1, "{mean_draft}");
    assert!(
        fit(&exact(&s, 1), &counts).is_err(),
        "a gate decision that depends on the sampled token went undetected"
    );
}
