//! A model whose KV cache follows a caller's token sequence.

use super::{Logits, Model, PREFILL_CHUNK};
use crate::costs::ForwardCost;
use crate::error::{Error, Result};

/// Keeps a model's KV cache in step with a caller's sequence, which may hold speculative
/// tokens that are later replaced (inside a cascade, tokens another drafter proposed).
///
/// [`SyncedModel::score`] feeds `[last token of context, draft...]` in one forward pass
/// (catching up first on any context the cache lacks) and returns one logits row per fed
/// token; [`SyncedModel::settle`] then keeps the context plus the accepted draft tokens.
/// The cache is compared with the caller's sequence only past a watermark of tokens known to
/// be committed ([`SyncedModel::commit`]), so a round costs time independent of the context.
pub struct SyncedModel {
    model: Box<dyn Model>,
    /// The tokens in the model's cache, in order.
    fed: Vec<u32>,
    /// `fed[..stable]` equals the committed sequence's start, which never changes again.
    stable: usize,
    /// Forward passes over drafts (catch-up prefills not counted).
    pub calls: usize,
    /// Whether ids beyond the model's vocabulary are fed as its last id ([`standing_in`]).
    ///
    /// [`standing_in`]: SyncedModel::standing_in
    stand_in: bool,
}

impl SyncedModel {
    /// Wraps `model`, with nothing known to be committed yet.
    pub fn new(model: Box<dyn Model>) -> Self {
        Self {
            model,
            fed: Vec::new(),
            stable: 0,
            calls: 0,
            stand_in: false,
        }
    }

    /// The same model, reading an id beyond its vocabulary as its last id instead of failing:
    /// for a drafter or a cascade's reviewer whose vocabulary is the beginning of the target's
    /// (a padding id the target sampled, or a prompt spelt it), where the last id is an unused
    /// one too. What a drafter reads only shapes its guesses; the cache keeps the ids as given.
    pub fn standing_in(mut self) -> Self {
        self.stand_in = true;
        self
    }

    /// `tokens` as the model reads them.
    fn readable<'t>(&self, tokens: &'t [u32]) -> std::borrow::Cow<'t, [u32]> {
        let last = self.model.vocab_size().saturating_sub(1) as u32;
        match self.stand_in && tokens.iter().any(|&t| t > last) {
            true => tokens.iter().map(|&t| t.min(last)).collect(),
            false => tokens.into(),
        }
    }

    /// The wrapped model.
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// The wrapped model, to change its settings (its cache must be left to this wrapper).
    pub fn model_mut(&mut self) -> &mut dyn Model {
        self.model.as_mut()
    }

    /// A new sequence starts: the counters start over, and the cache is kept as far as the
    /// new sequence agrees with it (the next [`prepare`] or [`score`] finds where). A prompt
    /// that repeats the start of the previous sequence (a chat's earlier turns, a shared
    /// system prompt, another sample of the same prompt) is not fed again: rows are computed
    /// independently, so the cached positions are bit for bit what feeding them again gives.
    ///
    /// [`prepare`]: SyncedModel::prepare
    /// [`score`]: SyncedModel::score
    pub fn reset(&mut self) {
        self.stable = 0;
        self.calls = 0;
    }

    /// Empties the cache: the next sequence is read from its first token (benches measure
    /// each generation on its own).
    pub fn forget(&mut self) {
        self.model.truncate(0);
        self.fed.clear();
        self.reset();
    }

    /// Tokens of `context` besides its last that the cache already holds.
    pub fn cached(&self, context: &[u32]) -> usize {
        common_prefix(&self.fed, context, self.stable).min(context.len().saturating_sub(1))
    }

    /// Brings the cache to `context` minus its last token, feeding what is missing
    /// without computing logits (the prompt, or text another drafter produced).
    pub fn prepare(&mut self, context: &[u32]) -> Result<()> {
        self.prepare_with(context, &mut |_, _| true)
    }

    /// [`SyncedModel::prepare`], feeding [`PREFILL_CHUNK`] tokens at a time and calling
    /// `progress(done, total)` with the tokens fed so far of those missing (a long prompt
    /// takes minutes on a slow CPU); feeding stops where it returns `false` (a cancelled
    /// request), the cache holding what was fed. Rows are computed independently, so the
    /// chunks change nothing in the cache.
    pub fn prepare_with(
        &mut self,
        context: &[u32],
        progress: &mut dyn FnMut(usize, usize) -> bool,
    ) -> Result<()> {
        let want = context.len().saturating_sub(1);
        let keep = self.cached(context);
        self.model.truncate(keep);
        self.fed.truncate(keep);
        let missing = &context[keep.min(want)..want];
        let mut done = 0;
        for chunk in missing.chunks(PREFILL_CHUNK) {
            if !progress(done, missing.len()) {
                return Ok(());
            }
            self.model.prefill(&self.readable(chunk))?;
            self.fed.extend_from_slice(chunk);
            done += chunk.len();
        }
        if done > 0 {
            progress(done, missing.len());
        }
        Ok(())
    }

    /// Scores `draft` as the continuation of `context`: row `i` of the result is the
    /// distribution after `context + draft[..i]`.
    ///
    /// A few tokens the cache lacks (a drafter catching up on the tokens its reviewer accepted)
    /// ride in the same forward pass rather than a separate one: rows are computed
    /// independently, so the logits are the same either way, and one pass costs less.
    pub fn score(&mut self, context: &[u32], draft: &[u32]) -> Result<Logits> {
        if context.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        // A plug-in model's mistake, caught before any work.
        if self.model.vocab_size() == 0 {
            return Err(Error::Compute(format!(
                "`{}` reports a vocabulary of 0 tokens",
                self.model.name()
            )));
        }
        let keep = common_prefix(&self.fed, context, self.stable).min(context.len() - 1);
        let from = if context.len() - keep <= CATCH_UP_IN_PASS {
            self.model.truncate(keep);
            self.fed.truncate(keep);
            keep
        } else {
            self.prepare(context)?;
            context.len() - 1
        };
        let mut feed = Vec::with_capacity(context.len() - from + draft.len());
        feed.extend_from_slice(&context[from..]);
        feed.extend_from_slice(draft);
        let logits = self.model.forward(&self.readable(&feed))?;
        let vocab = self.model.vocab_size();
        if logits.vocab() != vocab || logits.values().len() != feed.len() * vocab {
            // A plug-in model's mistake: an error here, not an index out of bounds later.
            self.model.truncate(from);
            return Err(Error::Compute(format!(
                "`{}` returned {} logits in rows of {} for {} tokens fed (expected {} rows of {vocab})",
                self.model.name(),
                logits.values().len(),
                logits.vocab(),
                feed.len(),
                feed.len()
            )));
        }
        // A NaN (or +inf, whose softmax is NaN, or a row of -inf only, which has none) would
        // make every review test false, and the review would accept whatever was drafted: a
        // broken model is an error, not text. (-inf is a probability of 0: a trimmed
        // vocabulary's.)
        if let Some(row) = logits.values().chunks(vocab).position(|row| {
            let (bad, top) = row
                .iter()
                .fold((false, f32::NEG_INFINITY), |(bad, top), &v| {
                    (bad | v.is_nan() | (v == f32::INFINITY), top.max(v))
                });
            bad || top == f32::NEG_INFINITY
        }) {
            self.model.truncate(from);
            return Err(Error::Compute(format!(
                "`{}` returned a NaN or infinite logit, or no finite one, for token {row} of {} fed (a damaged model file, or an overflow in its computation)",
                self.model.name(),
                feed.len()
            )));
        }
        self.fed.extend_from_slice(&feed);
        self.calls += 1;
        Ok(logits.tail(draft.len() + 1))
    }

    /// Tokens of `context` besides its last that the next scoring pass must catch up on.
    pub fn behind(&self, context: &[u32]) -> usize {
        context.len().saturating_sub(1) - self.cached(context)
    }

    /// The seconds [`SyncedModel::score`] will take to score a draft of `draft` tokens after
    /// `context`, with this model's measured `cost`: the tokens it must catch up on count too.
    pub fn score_seconds(&self, context: &[u32], draft: usize, cost: &ForwardCost) -> f64 {
        let behind = context.len() - self.cached(context);
        let at = context.len();
        if behind <= CATCH_UP_IN_PASS {
            cost.seconds_at(behind + draft, at)
        } else {
            cost.seconds_at(behind - 1, at) + cost.seconds_at(1 + draft, at)
        }
    }

    /// Keeps the first `len` tokens of the cache (context plus accepted draft tokens).
    pub fn settle(&mut self, len: usize) {
        self.model.truncate(len);
        self.fed.truncate(len);
        self.stable = self.stable.min(len);
    }

    /// The committed sequence is now `context` (it extends the previous one): the cache's
    /// agreement with it is checked once, past the old watermark.
    pub fn commit(&mut self, context: &[u32]) {
        self.stable = common_prefix(&self.fed, context, self.stable);
    }
}

/// Most tokens of context (the last one included) fed in the scoring pass itself.
const CATCH_UP_IN_PASS: usize = 4;

/// Length of the common prefix of `a` and `b`, checking from `from` on (the caller knows the
/// first `from` tokens agree), so the cost does not grow with the context.
pub(crate) fn common_prefix(a: &[u32], b: &[u32], from: usize) -> usize {
    let n = a.len().min(b.len());
    let from = from.min(n);
    from + a[from..n]
        .iter()
        .zip(&b[from..n])
        .take_while(|(x, y)| x == y)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A model that records what it was fed, and counts its forward passes; with `.2`, its
    /// logits are one row short.
    /// Fed to [`Echo`], this token's row holds a NaN.
    const NAN_TOKEN: u32 = 666;
    /// Fed to [`Echo`], this token's row is -inf only: no token has any probability.
    const MASKED_TOKEN: u32 = 667;

    /// A model whose logits are all 0: its fed tokens, its passes, and how many values it
    /// leaves out of its logits (a broken plug-in's).
    struct Echo(Vec<u32>, Arc<AtomicUsize>, usize);

    impl Model for Echo {
        fn name(&self) -> &str {
            "echo"
        }
        fn forward(&mut self, tokens: &[u32]) -> Result<Logits> {
            self.0.extend_from_slice(tokens);
            self.1.fetch_add(1, Ordering::Relaxed);
            let mut values = vec![0.0; tokens.len() * 2 - self.2];
            for (i, &t) in tokens.iter().enumerate() {
                match t {
                    NAN_TOKEN => values[2 * i] = f32::NAN,
                    MASKED_TOKEN => values[2 * i..2 * i + 2].fill(f32::NEG_INFINITY),
                    _ => {}
                }
            }
            Ok(Logits::new(values, 2))
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn truncate(&mut self, len: usize) {
            self.0.truncate(len)
        }
        fn vocab_size(&self) -> usize {
            2
        }
        fn max_len(&self) -> usize {
            1 << 20
        }
    }

    /// Standing in, an id beyond the vocabulary is read as the last id (here [`NAN_TOKEN`], whose
    /// row would hold a NaN, as 1); without, as given. The cache keeps the given ids.
    #[test]
    fn standing_in_reads_ids_beyond_the_vocabulary_as_the_last() {
        let (plain, _) = echo();
        let mut m = plain.standing_in();
        let logits = m.score(&[0, NAN_TOKEN, 1], &[NAN_TOKEN]).unwrap();
        assert!(logits.values().iter().all(|v| v.is_finite()));
        assert_eq!(m.cached(&[0, NAN_TOKEN, 1, 0]), 3);
        let (mut plain, _) = echo();
        assert!(plain.score(&[0, 1], &[NAN_TOKEN]).is_err());
    }

    fn echo() -> (SyncedModel, Arc<AtomicUsize>) {
        let passes = Arc::new(AtomicUsize::new(0));
        let m = SyncedModel::new(Box::new(Echo(Vec::new(), passes.clone(), 0)));
        (m, passes)
    }

    #[test]
    fn the_cache_follows_speculative_sequences_and_commits() {
        let (mut m, _) = echo();
        m.score(&[1, 2, 3], &[4, 5]).unwrap();
        m.settle(4); // 4 accepted, 5 rejected
        m.commit(&[1, 2, 3, 4, 6]);
        assert_eq!(m.stable, 4);
        // Speculative text from elsewhere replaces the tail; the committed part is kept.
        m.score(&[1, 2, 3, 4, 6, 7, 8], &[]).unwrap();
        assert_eq!(m.fed, [1, 2, 3, 4, 6, 7, 8]);
        m.score(&[1, 2, 3, 4, 6, 9], &[]).unwrap();
        assert_eq!(m.fed, [1, 2, 3, 4, 6, 9]);
        assert!(m.score(&[], &[1]).is_err());
    }

    #[test]
    fn a_new_sequence_reuses_what_it_shares_with_the_cache() {
        let (mut m, passes) = echo();
        m.prepare(&[1, 2, 3, 4, 5, 6]).unwrap();
        m.score(&[1, 2, 3, 4, 5, 6], &[7]).unwrap();
        m.settle(7);
        m.commit(&[1, 2, 3, 4, 5, 6, 7]);
        // A new sequence sharing its first three tokens: only the rest is fed.
        m.reset();
        assert_eq!(
            (m.cached(&[1, 2, 3, 9, 9]), m.behind(&[1, 2, 3, 9, 9])),
            (3, 1)
        );
        let before = passes.load(Ordering::Relaxed);
        m.prepare(&[1, 2, 3, 9, 9]).unwrap();
        assert_eq!(m.fed, [1, 2, 3, 9]);
        assert_eq!(m.model().len(), 4);
        assert_eq!(passes.load(Ordering::Relaxed), before + 1);
        // The same prompt again: nothing to feed.
        m.reset();
        m.prepare(&[1, 2, 3, 9, 9]).unwrap();
        assert_eq!(passes.load(Ordering::Relaxed), before + 1);
        // Forgotten: everything is fed again.
        m.forget();
        assert_eq!((m.cached(&[1, 2, 3, 9, 9]), m.model().len()), (0, 0));
        m.prepare(&[1, 2, 3, 9, 9]).unwrap();
        assert_eq!(m.fed, [1, 2, 3, 9]);
    }

    #[test]
    fn a_long_prompt_is_read_in_chunks_with_its_progress_reported() {
        let (mut m, passes) = echo();
        m.prepare(&[1, 2, 3]).unwrap();
        m.commit(&[1, 2, 3]);
        m.reset();
        // [1, 2] cached (a context's last token is fed by the next round), 2.5 chunks missing.
        let prompt: Vec<u32> = (1..=(2 + 5 * PREFILL_CHUNK / 2 + 1) as u32).collect();
        let missing = prompt.len() - 1 - 2;
        let before = passes.load(Ordering::Relaxed);
        let mut seen = Vec::new();
        let mut report = |done, total| {
            seen.push((done, total));
            true
        };
        m.prepare_with(&prompt, &mut report).unwrap();
        let steps = [0, PREFILL_CHUNK, 2 * PREFILL_CHUNK, missing];
        assert_eq!(seen, steps.map(|d| (d, missing)));
        assert_eq!(passes.load(Ordering::Relaxed), before + 3);
        assert_eq!(m.fed, prompt[..prompt.len() - 1]);
        // Nothing missing: nothing fed, nothing reported.
        seen.clear();
        let mut report = |done, total| {
            seen.push((done, total));
            true
        };
        m.prepare_with(&prompt, &mut report).unwrap();
        assert!(seen.is_empty());
    }

    /// A plug-in model of no vocabulary is an error at its first scoring, not a division by
    /// zero in the checks after it.
    #[test]
    fn a_model_of_no_vocabulary_is_an_error() {
        struct Empty(usize);
        impl Model for Empty {
            fn name(&self) -> &str {
                "empty"
            }
            fn forward(&mut self, tokens: &[u32]) -> Result<Logits> {
                self.0 += tokens.len();
                Ok(Logits::new(Vec::new(), 0))
            }
            fn len(&self) -> usize {
                self.0
            }
            fn truncate(&mut self, len: usize) {
                self.0 = self.0.min(len)
            }
            fn vocab_size(&self) -> usize {
                0
            }
            fn max_len(&self) -> usize {
                64
            }
        }
        let mut m = SyncedModel::new(Box::new(Empty(0)));
        let e = m.score(&[1, 2, 3], &[4]).unwrap_err().to_string();
        assert_eq!(
            e,
            "model computation failed: `empty` reports a vocabulary of 0 tokens"
        );
        assert_eq!((m.model().len(), m.fed.len()), (0, 0));
    }

    #[test]
    fn logits_of_the_wrong_shape_or_not_finite_are_an_error_and_feed_nothing() {
        for (missing, values) in [(2, 6), (1, 7)] {
            let short = Echo(Vec::new(), Arc::new(AtomicUsize::new(0)), missing);
            let mut m = SyncedModel::new(Box::new(short));
            let e = m.score(&[1, 2, 3], &[4]).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "model computation failed: `echo` returned {values} logits in rows of 2 \
                     for 4 tokens fed (expected 4 rows of 2)"
                )
            );
            assert_eq!((m.model().len(), m.fed.len()), (0, 0));
        }
        let (mut m, _) = echo();
        m.score(&[1, 2], &[]).unwrap();
        let e = m
            .score(&[1, 2, 3], &[NAN_TOKEN, 5])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "model computation failed: `echo` returned a NaN or infinite logit, or no finite one, \
             for token 1 of 3 fed (a damaged model file, or an overflow in its computation)"
        );
        // [1, 2] stay: only this pass's tokens are dropped.
        assert_eq!((m.model().len(), m.fed.len()), (2, 2));
        let e = m
            .score(&[1, 2, 3], &[4, MASKED_TOKEN])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no finite one, for token 2 of 3 fed"), "{e}");
        assert_eq!((m.model().len(), m.fed.len()), (2, 2));
    }

    #[test]
    fn a_short_catch_up_rides_in_the_scoring_pass() {
        let (mut m, passes) = echo();
        m.score(&[1, 2, 3], &[]).unwrap();
        let before = passes.load(Ordering::Relaxed);
        // Three tokens behind: one pass over [4, 5, 6] and the draft, rows for [6, 7] only.
        let logits = m.score(&[1, 2, 3, 4, 5, 6], &[7]).unwrap();
        assert_eq!(passes.load(Ordering::Relaxed), before + 1);
        assert_eq!(logits.rows(), 2);
        assert_eq!(m.fed, [1, 2, 3, 4, 5, 6, 7]);
        // Far behind: a prefill, then the scoring pass.
        let long: Vec<u32> = (1..=20).collect();
        m.score(&long, &[]).unwrap();
        assert_eq!(passes.load(Ordering::Relaxed), before + 3);
        assert_eq!(m.fed, long);
    }
}
