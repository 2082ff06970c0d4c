//! Drafters: anything that proposes tokens for a reviewer to check.
//!
//! One trait covers neural drafters, statistical tables and cascades (a cascade is a drafter
//! that contains a reviewer model and other drafters), so any tree of them composes over a
//! target. Plug-ins implement [`Drafter`] and are used as `Box<dyn Drafter>`.

mod bigram;
mod horizontal;
mod max_gram;
mod neural;
mod vertical;

pub use bigram::BigramDrafter;
pub use horizontal::HorizontalCascade;
pub use max_gram::{MaxGram, MaxGramDrafter, MaxGramPolicy};
pub use neural::NeuralDrafter;
pub use vertical::VerticalCascade;

use crate::error::Result;
use crate::review::ReviewCounts;
use crate::sampling::{Dist, Sampling};
use rand::rngs::StdRng;
use serde::Serialize;

/// Proposed tokens and, for each, the distribution it was drawn from (`q` in the papers).
/// A deterministic drafter reports point masses.
#[derive(Clone, Debug, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub dists: Vec<Dist>,
}

impl Draft {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn push(&mut self, token: u32, dist: Dist) {
        self.tokens.push(token);
        self.dists.push(dist);
    }

    pub fn extend(&mut self, other: Draft) {
        self.tokens.extend(other.tokens);
        self.dists.extend(other.dists);
    }
}

/// Counters of one node of a drafter tree, since the sequence started.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NodeStats {
    pub name: String,
    pub kind: String,
    /// This node's own model (its instance name), if it has one.
    pub model: Option<String>,
    /// Forward passes of this node's own model (drafting or reviewing).
    pub forward_calls: usize,
    /// For a reviewing node: its reviews of the inner drafter's proposals, by position.
    #[serde(flatten)]
    pub reviews: ReviewCounts,
    pub children: Vec<NodeStats>,
}

impl NodeStats {
    /// Forward passes per model over the whole tree.
    pub fn model_calls(&self, into: &mut std::collections::BTreeMap<String, usize>) {
        if let Some(m) = &self.model {
            *into.entry(m.clone()).or_default() += self.forward_calls;
        }
        self.children.iter().for_each(|c| c.model_calls(into));
    }

    /// Calls `f` on this node and every node below it, parents first.
    pub fn visit(&self, f: &mut dyn FnMut(&NodeStats)) {
        f(self);
        self.children.iter().for_each(|c| c.visit(f));
    }
}

/// A source of draft tokens.
///
/// The caller owns the sequence and passes it whole. Between two [`Drafter::commit`] calls the
/// contexts passed to [`Drafter::draft`] all extend the last committed sequence, possibly with
/// speculative tokens (inside a cascade, tokens another drafter or a reviewer produced). A
/// drafter keeps whatever state it likes (a KV cache, an index) and drops what no longer
/// matches.
pub trait Drafter: Send {
    /// A short name for reports.
    fn name(&self) -> &str;

    /// Proposes at most `k` tokens continuing `context`; may return fewer (even none).
    /// Each token must be drawn from the distribution reported with it, computed with
    /// `sampling` (at temperature 0, its argmax): the review is exact only then.
    fn draft(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &Sampling,
        rng: &mut StdRng,
    ) -> Result<Draft>;

    /// The committed sequence is now `context`: it extends the previous committed sequence
    /// (with a prefix of the last draft and the reviewer's token). It will not change again.
    fn commit(&mut self, context: &[u32]);

    /// A new sequence begins with `prompt`: forget the previous one and its counters. Neural
    /// drafters process the prompt here (so it counts as prefill); Max-Gram learns where the
    /// prompt ends.
    fn start(&mut self, prompt: &[u32]) -> Result<()>;

    /// Counters of this node and the nodes below it.
    fn stats(&self) -> NodeStats;
}

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
