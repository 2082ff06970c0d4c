//! A drafter that samples autoregressively from a (smaller) model.

use super::{Draft, Drafter, NodeStats};
use crate::error::Result;
use crate::model::Model;
use crate::sampling::Sampling;
use crate::verifier::Verifier;
use rand::rngs::StdRng;

/// Samples `k` tokens one at a time from its model, reporting each token's distribution.
pub struct NeuralDrafter {
    name: String,
    model: Verifier,
}

impl NeuralDrafter {
    pub fn new(name: impl Into<String>, model: Box<dyn Model>) -> Self {
        Self {
            name: name.into(),
            model: Verifier::new(model),
        }
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
        // Room left in this model's context.
        let k = k.min(self.model.model().max_len().saturating_sub(context.len()));
        let mut seq = context.to_vec();
        while draft.len() < k && !seq.is_empty() {
            // An empty draft scored: one forward over the last token (after catching up).
            let logits = self.model.score(&seq, &[])?;
            let q = sampling.distribution(logits.row(0));
            let token = q.sample(rng);
            draft.push(token, q);
            seq.push(token);
        }
        Ok(draft)
    }

    fn commit(&mut self, _: &[u32]) {}

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.model.reset();
        self.model.prepare(prompt)
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            name: self.name.clone(),
            kind: "model".into(),
            model: Some(self.model.model().name().to_string()),
            forward_calls: self.model.calls,
            ..Default::default()
        }
    }
}
