//! Vertical cascade: a drafter that is itself a speculative decoder.

use super::{Draft, Drafter, NodeStats};
use crate::error::Result;
use crate::model::Model;
use crate::review::{review_emitting, ReviewCounts};
use crate::sampling::Sampling;
use crate::verifier::Verifier;
use rand::rngs::StdRng;

/// A reviewer model over an inner drafter (CS Drafting 3.1): the inner drafter proposes up to
/// `inner_k` tokens, the reviewer scores them in one forward pass and keeps what passes its
/// review (the same [`review`](crate::review::review) the target uses, here with lenience
/// `l >= 1` allowed), and the reviewed tokens become this drafter's draft. Rounds repeat until
/// the level above has its `k` tokens.
///
/// Each emitted token is reported with the distribution it was effectively drawn from
/// ([`emitted_distribution`](crate::review::emitted_distribution)): the reviewer's own when
/// `l = 1`, a mixture of reviewer and inner drafter when `l > 1`. That is what keeps the
/// target's review exact through lenient cascades at any temperature.
pub struct VerticalCascade {
    name: String,
    reviewer: Verifier,
    inner: Box<dyn Drafter>,
    inner_k: usize,
    lenience: f32,
    report_reviewer: bool,
    reviews: ReviewCounts,
}

impl VerticalCascade {
    pub fn new(
        name: impl Into<String>,
        reviewer: Box<dyn Model>,
        inner: Box<dyn Drafter>,
        inner_k: usize,
        lenience: f32,
    ) -> Self {
        Self {
            name: name.into(),
            reviewer: Verifier::new(reviewer),
            inner,
            inner_k: inner_k.max(1),
            lenience,
            report_reviewer: false,
            reviews: ReviewCounts::default(),
        }
    }

    /// Deliberately wrong: reports the reviewer's distribution instead of the effective one.
    /// Exists so tests can show that the distribution test catches it when `l > 1`.
    pub fn reporting_reviewer_distribution(mut self) -> Self {
        self.report_reviewer = true;
        self
    }
}

impl Drafter for VerticalCascade {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &Sampling,
        rng: &mut StdRng,
    ) -> Result<Draft> {
        let mut seq = context.to_vec();
        let mut out = Draft::default();
        let max_len = self.reviewer.model().max_len();
        while out.len() < k && seq.len() < max_len {
            let want = (k - out.len()).min(self.inner_k).min(max_len - seq.len());
            let proposal = self.inner.draft(&seq, want, sampling, rng)?;
            let logits = self.reviewer.score(&seq, &proposal.tokens)?;
            let (verdict, emitted) = review_emitting(
                &proposal.tokens,
                &proposal.dists,
                &logits,
                sampling,
                self.lenience,
                rng,
            );
            self.reviews.record(proposal.len(), verdict.accepted);
            self.reviewer.settle(seq.len() + verdict.accepted);
            let tokens = proposal.tokens[..verdict.accepted]
                .iter()
                .copied()
                .chain([verdict.next]);
            for (i, (token, dist)) in tokens.zip(emitted).enumerate() {
                if out.len() == k {
                    break;
                }
                let dist = if self.report_reviewer {
                    sampling.distribution(logits.row(i))
                } else {
                    dist
                };
                out.push(token, dist);
                seq.push(token);
            }
        }
        Ok(out)
    }

    fn commit(&mut self, context: &[u32]) {
        self.inner.commit(context);
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.reviewer.reset();
        self.reviews = ReviewCounts::default();
        self.reviewer.prepare(prompt)?;
        self.inner.start(prompt)
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            name: self.name.clone(),
            kind: "vertical".into(),
            model: Some(self.reviewer.model().name().to_string()),
            forward_calls: self.reviewer.calls,
            reviews: self.reviews.clone(),
            children: vec![self.inner.stats()],
        }
    }
}
