//! A drafter that samples autoregressively from a (smaller) model.

use super::{common_prefix, Draft, Drafter};
use crate::error::Result;
use crate::model::Model;
use crate::sampling::Sampling;
use rand::rngs::StdRng;

/// Samples `k` tokens one at a time from its model, reporting each token's distribution.
pub struct NeuralDrafter {
    name: String,
    model: Box<dyn Model>,
    /// The tokens in the model's cache, in order.
    fed: Vec<u32>,
    /// How many leading tokens of `fed` are known to be committed.
    committed: usize,
}

impl NeuralDrafter {
    pub fn new(name: impl Into<String>, model: Box<dyn Model>) -> Self {
        Self {
            name: name.into(),
            model,
            fed: Vec::new(),
            committed: 0,
        }
    }

    /// Feeds `tokens` after `self.fed`; returns the logits row of the last one.
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let logits = self.model.forward(tokens)?;
        self.fed.extend_from_slice(tokens);
        Ok(logits.row(logits.rows() - 1).to_vec())
    }
}

impl Drafter for NeuralDrafter {
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
        let mut draft = Draft::default();
        // Room left in this model's context, keeping the reviewer's own limit to the caller.
        let room = self.model.max_len().saturating_sub(context.len());
        let k = k.min(room);
        if k == 0 || context.is_empty() {
            return Ok(draft);
        }
        // Reuse the cache for the common prefix, but refeed at least the last token: its
        // logits are the ones the first draft token is sampled from.
        let keep = common_prefix(&self.fed, context, self.committed).min(context.len() - 1);
        self.model.truncate(keep);
        self.fed.truncate(keep);
        let mut row = self.feed(&context[keep..])?;
        self.committed = context.len();
        for i in 0..k {
            let q = sampling.distribution(&row);
            let token = q.sample(rng);
            draft.push(token, q);
            if i + 1 < k {
                row = self.feed(&[token])?;
            }
        }
        Ok(draft)
    }

    fn commit(&mut self, context: &[u32]) {
        let keep = common_prefix(&self.fed, context, self.committed);
        self.model.truncate(keep);
        self.fed.truncate(keep);
        self.committed = keep;
    }

    fn start(&mut self, _prompt: &[u32]) {
        self.model.truncate(0);
        self.fed.clear();
        self.committed = 0;
    }
}
