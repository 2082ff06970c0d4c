//! A model that reviews drafts: the target at the top of the tree, or the reviewer of a
//! vertical cascade. Both score a draft the same way and roll back the same way.

use crate::drafter::common_prefix;
use crate::error::Result;
use crate::model::{Logits, Model};

/// Keeps a model's KV cache in step with a caller's sequence.
///
/// Contract: [`Verifier::score`] feeds `[last token of context, draft...]` in one forward
/// pass (catching up first on any context the cache lacks) and returns one logits row per
/// fed token; [`Verifier::settle`] then keeps the context plus the accepted draft tokens.
///
/// The cache is matched against the caller's sequence token by token on every call: a
/// comparison of a few thousand integers, negligible beside a forward pass, and robust to
/// callers whose sequences hold speculative tokens (a reviewer inside a cascade).
pub struct Verifier {
    model: Box<dyn Model>,
    /// The tokens in the model's cache, in order.
    fed: Vec<u32>,
    /// Forward passes over drafts (catch-up prefills not counted).
    pub calls: usize,
}

impl Verifier {
    pub fn new(model: Box<dyn Model>) -> Self {
        Self {
            model,
            fed: Vec::new(),
            calls: 0,
        }
    }

    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// Forgets the cache and the counters: a new sequence starts.
    pub fn reset(&mut self) {
        self.model.truncate(0);
        self.fed.clear();
        self.calls = 0;
    }

    /// Brings the cache to `context` minus its last token, feeding what is missing
    /// without computing logits (the prompt, or text another drafter produced).
    pub fn prepare(&mut self, context: &[u32]) -> Result<()> {
        let want = context.len().saturating_sub(1);
        let keep = common_prefix(&self.fed, context, 0).min(want);
        self.model.truncate(keep);
        self.fed.truncate(keep);
        if keep < want {
            self.model.prefill(&context[keep..want])?;
            self.fed.extend_from_slice(&context[keep..want]);
        }
        Ok(())
    }

    /// Scores `draft` as the continuation of `context`: row `i` of the result is the
    /// distribution after `context + draft[..i]`.
    pub fn score(&mut self, context: &[u32], draft: &[u32]) -> Result<Logits> {
        self.prepare(context)?;
        let mut feed = Vec::with_capacity(draft.len() + 1);
        feed.push(*context.last().expect("a context of at least one token"));
        feed.extend_from_slice(draft);
        let logits = self.model.forward(&feed)?;
        self.fed.extend_from_slice(&feed);
        self.calls += 1;
        Ok(logits)
    }

    /// Keeps the first `len` tokens of the cache (context plus accepted draft tokens).
    pub fn settle(&mut self, len: usize) {
        self.model.truncate(len);
        self.fed.truncate(len);
    }
}
