//! Dynamic horizontal cascade: each position of a draft goes to the cheapest drafter that is
//! worth it there.

use super::horizontal::ask_part;
use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use crate::error::Result;
use crate::gate::Source;

/// Drafters tried cheapest first at every position: a part drafts while the gate admits its
/// tokens (with an adaptive gate: while their learned acceptance pays for their cost), then the
/// next takes over; after a part has drafted, the cheaper ones are tried again, since the text
/// it added may give them something (a Max-Gram match). So Max-Gram drafts where it has a
/// long or frequent match, a neural cascade where it is confident, and nothing drafts where
/// neither pays: the round is then a plain decode step.
pub struct AdaptiveCascade {
    name: String,
    parts: Vec<(Box<dyn Drafter>, Source)>,
}

impl AdaptiveCascade {
    /// `parts`, cheapest first.
    pub fn new(name: impl Into<String>, parts: Vec<Box<dyn Drafter>>) -> Self {
        Self {
            name: name.into(),
            parts: parts
                .into_iter()
                .map(|d| {
                    let source = d.name().into();
                    (d, source)
                })
                .collect(),
        }
    }

    /// The parts, in order (to take back a drafter lent to a cascade for one request).
    pub fn into_parts(self) -> Vec<Box<dyn Drafter>> {
        self.parts.into_iter().map(|(d, _)| d).collect()
    }
}

impl Drafter for AdaptiveCascade {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        let mut seq = context.to_vec();
        let mut out = Draft::new();
        'positions: while request.remaining() > 0 {
            for (drafter, source) in &mut self.parts {
                let cap = request.remaining();
                let draft = ask_part(drafter.as_mut(), source, &seq, request, cap)?;
                if !draft.is_empty() {
                    seq.extend_from_slice(draft.tokens());
                    out.append(draft);
                    continue 'positions; // the cheaper parts may have something now
                }
            }
            break; // no part drafts here
        }
        Ok(out)
    }

    fn commit(&mut self, context: &[u32]) {
        self.parts.iter_mut().for_each(|(d, _)| d.commit(context));
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.parts.iter_mut().try_for_each(|(d, _)| d.start(prompt))
    }

    fn finish(&mut self, output: &[u32]) -> Result<()> {
        // Every part records the output, even after one fails; the first failure is reported.
        self.parts
            .iter_mut()
            .map(|(d, _)| d.finish(output))
            .fold(Ok(()), Result::and)
    }

    fn forget(&mut self) {
        self.parts.iter_mut().for_each(|(d, _)| d.forget());
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            children: self.parts.iter().map(|(d, _)| d.stats()).collect(),
            ..NodeStats::new(&self.name, NodeKind::Adaptive)
        }
    }
}
