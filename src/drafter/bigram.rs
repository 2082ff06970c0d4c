//! A drafter that follows a bigram table.

use super::max_gram::bigram_chain;
use super::{Draft, Drafter, NodeStats};
use crate::error::Result;
use crate::ngram::BigramTable;
use crate::sampling::{Dist, Sampling};
use rand::rngs::StdRng;
use std::sync::Arc;

/// Drafts by following the table: its most likely successor each step (a point mass), or,
/// with `sample`, a successor drawn from the table's row renormalized over the successors it
/// keeps, reported with exactly that distribution so the review stays exact.
pub struct BigramDrafter {
    name: String,
    table: Arc<BigramTable>,
    sample: bool,
}

impl BigramDrafter {
    pub fn new(name: impl Into<String>, table: Arc<BigramTable>, sample: bool) -> Self {
        Self {
            name: name.into(),
            table,
            sample,
        }
    }
}

impl Drafter for BigramDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(
        &mut self,
        context: &[u32],
        k: usize,
        _: &Sampling,
        rng: &mut StdRng,
    ) -> Result<Draft> {
        let Some(&last) = context.last() else {
            return Ok(Draft::default());
        };
        if !self.sample {
            let tokens = bigram_chain(&self.table, last, k);
            let dists = tokens.iter().map(|&t| Dist::Point(t)).collect();
            return Ok(Draft { tokens, dists });
        }
        let mut draft = Draft::default();
        let mut prev = last;
        while draft.len() < k {
            let (next, probs) = self.table.successors(prev);
            let total: f32 = probs.iter().sum();
            if next.is_empty() || total <= 0.0 {
                break;
            }
            let q = Dist::Sparse(
                next.iter()
                    .zip(probs)
                    .map(|(&t, &p)| (t, p / total))
                    .collect(),
            );
            prev = q.sample(rng);
            draft.push(prev, q);
        }
        Ok(draft)
    }

    fn commit(&mut self, _: &[u32]) {}

    fn start(&mut self, _: &[u32]) -> Result<()> {
        Ok(())
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            name: self.name.clone(),
            kind: "bigram".into(),
            ..Default::default()
        }
    }
}
