//! Vertical cascade: a drafter that is itself a speculative decoder.

use super::neural::top_probability;
use crate::costs::ForwardCost;
use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use crate::error::Result;
use crate::model::Model;
use crate::reviewer::ReviewRule;
use crate::reviewer::Reviewer;
use crate::sampling::{softmax_max, Dist};

/// A reviewer model over an inner drafter (CS Drafting 3.1): rounds of the inner drafter
/// proposing up to `inner_k` tokens and the reviewer reviewing them, with the same
/// [`Reviewer::round`] the target runs (here with lenience `l >= 1` allowed), until the level
/// above has the tokens it admits.
///
/// Each emitted token is reported with the distribution it was effectively drawn from
/// ([`emitted_distribution`](crate::review::emitted_distribution)): the reviewer's own when
/// `l = 1`, a mixture of reviewer and inner drafter when `l > 1`. That is what keeps the
/// target's review exact through lenient cascades at any temperature. The cascade's
/// confidence in an emitted token is the largest probability of that distribution.
pub struct VerticalCascade {
    name: String,
    reviewer: Reviewer,
    inner: Box<dyn Drafter>,
    inner_k: usize,
    report_reviewer: bool,
    /// The reviewer's measured forward cost, if known.
    cost: Option<ForwardCost>,
    /// Seconds per emitted token (an average over past rounds of their predicted cost), for
    /// the gate above; computed from measured costs, not a live clock, so that a seed
    /// reproduces its output.
    seconds_per_token: f64,
    /// Whether the reviewer has read the sequence's prompt (before the first draft, if the
    /// gate above finds it worth the time, as a neural drafter does).
    read_prompt: bool,
}

impl VerticalCascade {
    /// `reviewer` reviewing `inner`'s drafts of `k` tokens with `lenience`.
    pub fn new(
        name: impl Into<String>,
        reviewer: Box<dyn Model>,
        inner: Box<dyn Drafter>,
        inner_k: usize,
        lenience: f32,
    ) -> Self {
        Self {
            name: name.into(),
            reviewer: Reviewer::new(reviewer, lenience).in_cascade(),
            inner,
            inner_k: inner_k.max(1),
            report_reviewer: false,
            cost: None,
            seconds_per_token: 0.0,
            read_prompt: false,
        }
    }

    /// Sets the reviewer's measured forward cost, from which the cascade tells the level above
    /// what its tokens cost.
    pub fn with_cost(mut self, cost: ForwardCost) -> Self {
        self.cost = Some(cost);
        self
    }

    /// Sizes this level's inner drafts adaptively (see [`crate::gate`]) with the reviewer's
    /// measured forward cost; the inner draft length becomes an upper bound.
    pub fn with_adaptive(mut self, cost: ForwardCost) -> Self {
        self.reviewer.set_adaptive(cost.clone(), &[]);
        self.with_cost(cost)
    }

    /// Replaces this level's review rule (see [`Reviewer::set_rule`]).
    pub fn with_review_rule(mut self, rule: ReviewRule) -> Self {
        self.reviewer.set_rule(rule);
        self
    }

    /// Deliberately wrong: reports the reviewer's distribution instead of the effective one.
    /// Exists so tests can show that the distribution test catches it when `l > 1` (hidden
    /// from the docs: never for use).
    #[doc(hidden)]
    pub fn reporting_reviewer_distribution(mut self) -> Self {
        self.report_reviewer = true;
        self
    }
}

impl Drafter for VerticalCascade {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        let mut out = Draft::new();
        let max_len = self.reviewer.model().max_len();
        // A reviewer with a shorter context than the level above stops where the text
        // outgrows it.
        if context.len() >= max_len {
            return Ok(out);
        }
        self.reviewer.set_cancel(request.cancel_flag());
        self.reviewer.set_ends(request.end_tokens());
        if !self.read_prompt {
            if !request.worth_reading(self.reviewer.behind(context), self.cost.as_ref()) {
                return Ok(out);
            }
            self.reviewer.read(context)?;
            if request.cancelled() {
                return Ok(out); // read in part: the next sequence catches up
            }
            self.read_prompt = true;
        }
        let mut seq = context.to_vec();
        'rounds: while request.remaining() > 0 && seq.len() < max_len {
            if !request.worth_drafting(self.seconds_per_token, self.seconds_per_token) {
                break;
            }
            let want = request
                .remaining()
                .min(self.inner_k)
                .min(max_len - seq.len());
            let sampling = *request.sampling();
            let round = self.reviewer.round(
                &seq,
                Some(self.inner.as_mut()),
                want,
                &sampling,
                request.rng(),
                true,
            )?;
            // What the round cost: as predicted when adaptive (drafting included, but not an
            // inner drafter's one-time reading of the prompt), else the reviewer's forward.
            let seconds = match (round.predicted, &self.cost) {
                (Some(p), _) => p.seconds - p.invested,
                (None, Some(c)) => c.seconds(round.drafted + 1),
                (None, None) => 0.0,
            } / round.tokens.len() as f64;
            self.seconds_per_token = if self.seconds_per_token == 0.0 {
                seconds
            } else {
                0.9 * self.seconds_per_token + 0.1 * seconds
            };
            for (i, (token, dist)) in round.tokens.into_iter().zip(round.dists).enumerate() {
                let row = round.logits.row(i);
                // Greedy emits point masses, which say nothing: the reviewer's own top
                // probability does.
                let confidence = match &dist {
                    Dist::Point(_) => softmax_max(row),
                    d => top_probability(d),
                };
                if !request.admit(Some(confidence)) {
                    break 'rounds;
                }
                let dist = if self.report_reviewer {
                    round.logits.distribution(i, &sampling).into_owned()
                } else {
                    dist
                };
                out.push(token, dist);
                seq.push(token);
                if request.ends(token) {
                    break 'rounds;
                }
            }
        }
        Ok(out)
    }

    fn commit(&mut self, context: &[u32]) {
        self.reviewer.commit(context);
        self.inner.commit(context);
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        // The prompt is read before the first draft, if at all.
        self.reviewer.reset();
        self.read_prompt = false;
        self.inner.start(prompt)
    }

    fn finish(&mut self, output: &[u32]) -> Result<()> {
        self.inner.finish(output)
    }

    fn forget(&mut self) {
        self.reviewer.forget();
        self.inner.forget();
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            model: Some(self.reviewer.model().name().to_string()),
            forward_calls: self.reviewer.calls(),
            reviews: self.reviewer.counts.clone(),
            acceptance_by_confidence: self
                .reviewer
                .adaptive()
                .map_or_else(Vec::new, |a| a.report()),
            children: vec![self.inner.stats()],
            ..NodeStats::new(&self.name, NodeKind::Vertical)
        }
    }
}
