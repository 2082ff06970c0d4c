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
/// neither pays: the round is then a plain decode step. A part whose token the gate declined
/// is not asked again at the same place (a draft model would pay for the same forward to be
/// declined again).
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
        // Where the gate last declined each part's token (a length of `seq`).
        let mut declined_at = vec![None; self.parts.len()];
        'positions: while request.remaining() > 0 {
            for ((drafter, source), declined_at) in self.parts.iter_mut().zip(&mut declined_at) {
                if *declined_at == Some(seq.len()) {
                    continue;
                }
                let cap = request.remaining();
                let (draft, declined) = ask_part(drafter.as_mut(), source, &seq, request, cap)?;
                seq.extend_from_slice(draft.tokens());
                if declined {
                    *declined_at = Some(seq.len());
                }
                if !draft.is_empty() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::ForwardCost;
    use crate::gate::{Adaptive, Gate};
    use crate::sampling::{Dist, Rng, Sampling};
    use rand::SeedableRng;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Drafts token 1 at each position with the next of `confidences`, counting its calls.
    struct Scripted {
        confidences: Vec<f32>,
        at: usize,
        calls: Arc<AtomicUsize>,
    }

    impl Drafter for Scripted {
        fn name(&self) -> &str {
            "scripted"
        }

        fn draft(&mut self, _: &[u32], request: &mut Request) -> Result<Draft> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let mut draft = Draft::new();
            while let Some(&c) = self.confidences.get(self.at) {
                if !request.admit(Some(c)) {
                    break;
                }
                self.at += 1;
                draft.push(1, Dist::Point(1));
            }
            Ok(draft)
        }
    }

    /// A part whose token the gate declined is not asked again at the same place: one call
    /// drafts the sure tokens and stops at the unsure one, which ends the draft.
    #[test]
    fn a_part_declined_by_the_gate_is_not_asked_again_there() {
        let verify = ForwardCost {
            decode_seconds: 0.01,
            ratios: (1..=16).map(|k| (k, 1.0 + 0.1 * (k - 1) as f64)).collect(),
            per_context: Vec::new(),
        };
        let calls = Arc::new(AtomicUsize::new(0));
        let part = Scripted {
            confidences: vec![0.99, 0.99, 0.01, 0.99],
            at: 0,
            calls: calls.clone(),
        };
        let mut cascade = AdaptiveCascade::new("a", vec![Box::new(part)]);
        let mut gate = Gate::adaptive(Adaptive::new(verify));
        let (sampling, mut rng) = (Sampling::default(), Rng::seed_from_u64(1));
        let mut request = Request::new(&sampling, &mut rng, &mut gate, "a".into(), 8, 4);
        let draft = cascade.draft(&[0, 1], &mut request).unwrap();
        assert_eq!((draft.len(), calls.load(Ordering::Relaxed)), (2, 1));
    }
}
