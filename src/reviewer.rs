//! A model that reviews drafts, and the one review round every level runs.
//!
//! The target verifying its drafter and a vertical cascade's reviewer reviewing its inner
//! drafter are the same operation, [`Reviewer::round`]: draft, check the drafter's contract,
//! score the draft in one forward pass, review it, count, and roll the cache back past the
//! rejected tokens.

use crate::costs::ForwardCost;
use crate::draft::{Draft, Drafter, Request};
use crate::error::{Error, Result};
use crate::gate::{Adaptive, Gate, Prediction, Priors, Source};
use crate::model::{Logits, Model, SyncedModel};
use crate::review::{keep_chance, review, ReviewCounts, Verdict};
use crate::sampling::{Dist, Rng, Sampling};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A review rule: given the draft, its distributions `q`, the reviewer's logits for every
/// draft position and the one after, the sampling settings and a lenience, decides how many
/// draft tokens are kept and the token that follows; when asked, also pushes the
/// distribution each emitted token was effectively drawn from. [`review`] is the exact one.
pub type ReviewRule = fn(
    draft: &[u32],
    q: &[Dist],
    logits: &Logits,
    sampling: &Sampling,
    lenience: f32,
    rng: &mut Rng,
    emitted: Option<&mut Vec<Dist>>,
) -> Verdict;

/// What one round produced.
#[derive(Clone, Debug)]
pub struct Round {
    /// The emitted tokens: the accepted draft tokens, then the reviewer's own (the
    /// recovered token after a rejection, or the bonus token).
    pub tokens: Vec<u32>,
    /// When asked for: the distribution each emitted token was effectively drawn from.
    pub dists: Vec<Dist>,
    /// Draft tokens proposed and accepted.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// With adaptive drafting: the round as the measured costs and the learned acceptance
    /// predicted it when the draft was made.
    pub predicted: Option<Prediction>,
    /// The reviewer's logits: row `i` scored emitted token `i`.
    pub logits: Logits,
}

/// A model that reviews the drafts of the drafter below it.
pub struct Reviewer {
    model: SyncedModel,
    rule: ReviewRule,
    lenience: f32,
    /// Reviews of the drafter's proposals, by position.
    pub counts: ReviewCounts,
    /// When drafts are sized adaptively: this model's forward cost and what it learned, kept
    /// apart for greedy and for sampled reviews (a sampled token is accepted less often, and a
    /// server mixes both).
    adaptive: Option<[Adaptive; 2]>,
    /// Whether the last round sampled: which of the two [`Reviewer::adaptive`] reports.
    sampled: bool,
    /// Set when the generation is cancelled: passed to the drafts this reviewer asks for.
    cancel: Option<Arc<AtomicBool>>,
    /// The tokens the generation stops at: a draft is cut after the first of them.
    ends: Arc<[u32]>,
}

impl Reviewer {
    /// A reviewer with the exact rule and the given lenience (1 keeps the output exact;
    /// more is allowed inside a cascade only).
    pub fn new(model: Box<dyn Model>, lenience: f32) -> Self {
        Self {
            model: SyncedModel::new(model),
            rule: review,
            lenience,
            counts: ReviewCounts::default(),
            adaptive: None,
            sampled: false,
            cancel: None,
            ends: Arc::new([]),
        }
    }

    /// The same reviewer inside a cascade, reading the target's text with
    /// [`SyncedModel::standing_in`]: its vocabulary may be the beginning of the target's.
    pub fn in_cascade(mut self) -> Self {
        self.model = self.model.standing_in();
        self
    }

    /// The generation's cancel flag ([`crate::engine::GenerateOptions::cancel`]): reading a
    /// prompt stops between chunks once it is set, and so do the drafters asked below.
    pub fn set_cancel(&mut self, cancel: Option<Arc<AtomicBool>>) {
        self.cancel = cancel;
    }

    /// The tokens the generation stops at (its end-of-sequence tokens; none when it goes on
    /// past them): drafts are cut after the first of them, since nothing after it could be
    /// kept, and drafters are told to stop there ([`Request::ends`]).
    pub fn set_ends(&mut self, ends: Arc<[u32]>) {
        self.ends = ends;
    }

    /// Sizes drafts adaptively (see [`crate::gate`]), with this model's measured forward
    /// cost; the draft length asked for becomes an upper bound.
    pub fn set_adaptive(&mut self, verify: ForwardCost, priors: &[(String, Priors)]) {
        let adaptive = Adaptive::new(verify).with_priors(priors);
        self.adaptive = Some([adaptive.clone(), adaptive]);
    }

    /// With adaptive drafting, what this level learned of the drafters below it, for the
    /// kind of sampling (greedy or not) of its last round.
    pub fn adaptive(&self) -> Option<&Adaptive> {
        self.adaptive.as_ref().map(|a| &a[self.sampled as usize])
    }

    /// Replaces the review rule: for experiments, and for tests that show a broken rule is
    /// caught by the distribution test.
    pub fn set_rule(&mut self, rule: ReviewRule) {
        self.rule = rule;
    }

    /// Sets the lenience of this reviewer's reviews.
    pub fn set_lenience(&mut self, lenience: f32) {
        self.lenience = lenience;
    }

    /// The reviewing model.
    pub fn model(&self) -> &dyn Model {
        self.model.model()
    }

    /// Forward passes over drafts.
    pub fn calls(&self) -> usize {
        self.model.calls
    }

    /// A new sequence begins with `prompt`: the counters start over and the cache is brought
    /// to the prompt (a prefill of what it does not already hold, reported to
    /// `progress(done, total)` as it goes, and stopped where that returns `false`). Returns
    /// the prompt tokens found in the cache.
    pub fn start(
        &mut self,
        prompt: &[u32],
        progress: &mut dyn FnMut(usize, usize) -> bool,
    ) -> Result<usize> {
        self.reset();
        let cached = self.model.cached(prompt);
        self.model.prepare_with(prompt, progress)?;
        Ok(cached)
    }

    /// A new sequence begins: the counters and the adaptive gate's recent rates start over
    /// ([`read`] the prompt later, or let the first round catch up on it); the cache is kept
    /// as far as the new sequence agrees with it ([`SyncedModel::reset`]).
    ///
    /// [`read`]: Reviewer::read
    pub fn reset(&mut self) {
        self.model.reset();
        self.counts = ReviewCounts::default();
        self.adaptive
            .iter_mut()
            .flatten()
            .for_each(Adaptive::start_sequence);
    }

    /// Empties the cache: the next sequence is read from its first token.
    pub fn forget(&mut self) {
        self.model.forget();
    }

    /// Brings the cache to `context` minus its last token (a prefill of what it lacks).
    /// Stops between chunks once the generation is cancelled.
    pub fn read(&mut self, context: &[u32]) -> Result<()> {
        let cancel = self.cancel.clone();
        self.model.prepare_with(context, &mut |_, _| {
            !cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed))
        })
    }

    /// Tokens of `context` besides its last that the next round must catch up on.
    pub fn behind(&self, context: &[u32]) -> usize {
        self.model.behind(context)
    }

    /// The generation has emitted `generated` tokens and may emit at most `remaining` more
    /// (with adaptive drafting, this bounds what drafters may spend catching up on the text:
    /// [`Adaptive::set_horizon`]).
    pub fn set_horizon(&mut self, generated: usize, remaining: usize) {
        for a in self.adaptive.iter_mut().flatten() {
            a.set_horizon(generated, remaining);
        }
    }

    /// The committed sequence is now `context`.
    pub fn commit(&mut self, context: &[u32]) {
        self.model.commit(context);
    }

    /// One round over `context`: `drafter` proposes up to `k` tokens (none without a
    /// drafter or with `k = 0`), the draft is checked against the drafter's contract, scored
    /// in one forward pass and reviewed; the cache keeps the accepted tokens. With `emit`,
    /// the round also reports the distribution each emitted token was drawn from (what a
    /// cascade reports to the level above it).
    pub fn round(
        &mut self,
        context: &[u32],
        drafter: Option<&mut (dyn Drafter + '_)>,
        k: usize,
        sampling: &Sampling,
        rng: &mut Rng,
        emit: bool,
    ) -> Result<Round> {
        // A cascade built in code has not been through a config's validation.
        crate::review::check_lenience(
            format_args!("lenience of the review by `{}`", self.model().name()),
            self.lenience,
        )?;
        self.sampled = !sampling.is_greedy();
        let mut gate = match self.adaptive() {
            Some(a) => Gate::adaptive_at(a.clone(), self.model.behind(context), context.len()),
            None => Gate::fixed(),
        };
        let started = Instant::now();
        let draft = match drafter {
            Some(d) if k > 0 => {
                let source: Source = d.name().into();
                let vocab = self.model().vocab_size();
                let mut request = Request::new(sampling, rng, &mut gate, source, k, vocab)
                    .with_cancel(self.cancel.clone())
                    .with_ends(self.ends.clone());
                let mut draft = d.draft(context, &mut request)?;
                request.check(&mut draft, d.name())?;
                // Nothing after an end of the text can be kept: not worth verifying.
                if let Some(i) = draft.tokens().iter().position(|t| self.ends.contains(t)) {
                    draft.truncate(i + 1);
                    gate.truncate(i + 1);
                }
                draft
            }
            _ => Draft::new(),
        };
        let drafted = Instant::now();
        let logits = self.model.score(context, draft.tokens())?;
        if let Some(p) = gate.prediction().filter(|_| crate::engine::trace()) {
            // Which of the cost model's two terms a round's error comes from.
            let ms = |s: f64| s * 1e3;
            eprintln!(
                "  drafting took {:.1} ms (predicted {:.1}), scoring {:.1} ms (predicted {:.1})",
                ms((drafted - started).as_secs_f64()),
                ms(p.drafting + p.invested),
                ms(drafted.elapsed().as_secs_f64()),
                ms(p.seconds - p.drafting - p.invested)
            );
        }
        let mut dists = Vec::new();
        let verdict = (self.rule)(
            draft.tokens(),
            draft.dists(),
            &logits,
            sampling,
            self.lenience,
            rng,
            emit.then_some(&mut dists),
        );
        // A rule set for an experiment is held to its contract, not trusted.
        if verdict.accepted > draft.len() {
            return Err(Error::Compute(format!(
                "the review rule kept {} of {} drafted tokens",
                verdict.accepted,
                draft.len()
            )));
        }
        if emit && dists.len() != verdict.accepted + 1 {
            return Err(Error::Compute(format!(
                "the review rule gave {} distributions for the {} tokens it emitted",
                dists.len(),
                verdict.accepted + 1
            )));
        }
        self.counts.record(draft.len(), verdict.accepted);
        if let Some(a) = &mut self.adaptive {
            let chances: Vec<f64> = (draft.tokens().iter().zip(draft.dists()).enumerate())
                .map(|(i, (&x, q))| keep_chance(x, q, (&logits, i), sampling, self.lenience))
                .collect();
            a[self.sampled as usize].learn(&gate, verdict.accepted, &chances);
        }
        self.model.settle(context.len() + verdict.accepted);
        let mut tokens = draft.tokens()[..verdict.accepted].to_vec();
        tokens.push(verdict.next);
        Ok(Round {
            tokens,
            dists,
            drafted: draft.len(),
            accepted: verdict.accepted,
            predicted: gate.prediction(),
            logits,
        })
    }
}
