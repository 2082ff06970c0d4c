//! Horizontal cascade: the positions of one draft split between drafters.

use super::{Draft, Drafter, NodeStats};
use crate::error::Result;
use crate::sampling::Sampling;
use rand::rngs::StdRng;

/// Fills a draft from a schedule of (drafter, tokens): the first tokens from the first
/// drafter, the next from the second continuing from them, and so on (CS Drafting 3.2:
/// later positions are rarely accepted, so cheaper drafters take them). A drafter that
/// returns fewer tokens than its share leaves the rest to the next one.
pub struct HorizontalCascade {
    name: String,
    parts: Vec<(Box<dyn Drafter>, usize)>,
}

impl HorizontalCascade {
    pub fn new(name: impl Into<String>, parts: Vec<(Box<dyn Drafter>, usize)>) -> Self {
        Self {
            name: name.into(),
            parts,
        }
    }
}

impl Drafter for HorizontalCascade {
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
        for (drafter, share) in &mut self.parts {
            if out.len() >= k {
                break;
            }
            let part = drafter.draft(&seq, (*share).min(k - out.len()), sampling, rng)?;
            seq.extend_from_slice(&part.tokens);
            out.extend(part);
        }
        Ok(out)
    }

    fn commit(&mut self, context: &[u32]) {
        self.parts.iter_mut().for_each(|(d, _)| d.commit(context));
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.parts.iter_mut().try_for_each(|(d, _)| d.start(prompt))
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            name: self.name.clone(),
            kind: "horizontal".into(),
            children: self.parts.iter().map(|(d, _)| d.stats()).collect(),
            ..Default::default()
        }
    }
}
