//! Drafters: anything that proposes tokens for a reviewer to check.
//!
//! One trait covers neural drafters, statistical tables and cascades (a cascade is a drafter
//! that contains a reviewer model and other drafters), so any tree of them composes over a
//! target. Plug-ins implement [`Drafter`] and are used as `Box<dyn Drafter>`.

mod bigram;
mod max_gram;
mod neural;

pub use bigram::BigramDrafter;
pub use max_gram::{MaxGram, MaxGramDrafter, MaxGramPolicy};
pub use neural::NeuralDrafter;

use crate::error::Result;
use crate::sampling::{Dist, Sampling};
use rand::rngs::StdRng;

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
}

/// A source of draft tokens.
///
/// The caller owns the committed sequence (prompt plus accepted text) and passes it whole;
/// a drafter keeps whatever state it likes (a KV cache, an index) and uses [`Drafter::commit`]
/// to drop the part of it that the review discarded.
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

    /// The committed sequence is now `context`: the context of the last [`Drafter::draft`]
    /// call, then a prefix of that draft, then the reviewer's token. State past the common
    /// prefix must be forgotten.
    fn commit(&mut self, context: &[u32]);

    /// A new sequence begins with `prompt`: forget the previous one. (Max-Gram uses it to
    /// tell the prompt from the generated text.)
    fn start(&mut self, prompt: &[u32]);
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
