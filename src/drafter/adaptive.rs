//! Dynamic horizontal cascade: each position of a draft goes to the cheapest drafter that is
//! worth it there.

use super::horizontal::{ask_part, Share};
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
/// declined again). A draft model (a part whose [`NodeStats`] kind is [`NodeKind::Model`]) is
/// asked for one token at a time (each of its forwards gives one anyway), so that a cheaper
/// drafter can take over wherever a match appears in the middle of the model's run; every
/// other part (a cascade, whose asks are review rounds; a plug-in) is asked for its whole run.
pub struct AdaptiveCascade {
    name: String,
    parts: Vec<(Box<dyn Drafter>, Source, Share)>,
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
                    let share = match d.stats().kind {
                        NodeKind::Model => Share::Step,
                        _ => Share::UpTo(usize::MAX),
                    };
                    (d, source, share)
                })
                .collect(),
        }
    }

    /// The parts, in order (to take back a drafter lent to a cascade for one request).
    pub fn into_parts(self) -> Vec<Box<dyn Drafter>> {
        self.parts.into_iter().map(|(d, ..)| d).collect()
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
            for ((drafter, source, share), declined_at) in
                self.parts.iter_mut().zip(&mut declined_at)
            {
                if *declined_at == Some(seq.len()) {
                    continue;
                }
                let (draft, declined) = ask_part(drafter.as_mut(), source, &seq, request, *share)?;
                seq.extend_from_slice(draft.tokens());
                if declined {
                    *declined_at = Some(seq.len());
                }
                if !draft.is_empty() {
                    let ended = request.ended(&draft);
                    out.append(draft);
                    if ended {
                        break 'positions;
                    }
                    continue 'positions; // the cheaper parts may have something now
                }
            }
            break; // no part drafts here
        }
        // A part declined where the draft ends would be declined there again, and so would
        // this cascade: a cascade above it (a server's prediction ahead of it) should not ask.
        if declined_at.contains(&Some(seq.len())) {
            request.set_declined();
        }
        Ok(out)
    }

    fn commit(&mut self, context: &[u32]) {
        self.parts.iter_mut().for_each(|(d, ..)| d.commit(context));
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.parts
            .iter_mut()
            .try_for_each(|(d, ..)| d.start(prompt))
    }

    fn finish(&mut self, output: &[u32]) -> Result<()> {
        // Every part records the output, even after one fails; the first failure is reported.
        self.parts
            .iter_mut()
            .map(|(d, ..)| d.finish(output))
            .fold(Ok(()), Result::and)
    }

    fn forget(&mut self) {
        self.parts.iter_mut().for_each(|(d, ..)| d.forget());
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            children: self.parts.iter().map(|(d, ..)| d.stats()).collect(),
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

    /// 10 ms per decode step, each extra token verified 1 ms.
    fn verify() -> ForwardCost {
        ForwardCost {
            decode_seconds: 0.01,
            ratios: (1..=16).map(|k| (k, 1.0 + 0.1 * (k - 1) as f64)).collect(),
            per_context: Vec::new(),
        }
    }

    /// Two sure tokens, an unsure one, a sure one: a part the gate declines at the third.
    fn sure_sure_unsure(calls: &Arc<AtomicUsize>) -> Box<dyn Drafter> {
        Box::new(Scripted {
            confidences: vec![0.99, 0.99, 0.01, 0.99],
            at: 0,
            calls: calls.clone(),
        })
    }

    /// `drafter`'s draft of up to 8 tokens after `[0, 1]`, under an adaptive gate.
    fn adaptive_draft(drafter: &mut dyn Drafter) -> Draft {
        let mut gate = Gate::adaptive(Adaptive::new(verify()));
        let (sampling, mut rng) = (Sampling::default(), Rng::seed_from_u64(1));
        let mut request = Request::new(&sampling, &mut rng, &mut gate, "a".into(), 8, 4);
        drafter.draft(&[0, 1], &mut request).unwrap()
    }

    /// A part whose token the gate declined is not asked again at the same place: one call
    /// drafts the sure tokens and stops at the unsure one, which ends the draft.
    #[test]
    fn a_part_declined_by_the_gate_is_not_asked_again_there() {
        let calls = Arc::new(AtomicUsize::new(0));
        let mut cascade = AdaptiveCascade::new("a", vec![sure_sure_unsure(&calls)]);
        let draft = adaptive_draft(&mut cascade);
        assert_eq!((draft.len(), calls.load(Ordering::Relaxed)), (2, 1));
    }

    /// A refusal ends the draft: asked again, even with a sure token, the request refuses (the
    /// gate's plan of the round ends at the declined position, and what it learns from the
    /// review pairs its positions with the draft's).
    #[test]
    fn a_request_refuses_every_position_after_a_declined_one() {
        let mut gate = Gate::adaptive(Adaptive::new(verify()));
        let (sampling, mut rng) = (Sampling::default(), Rng::seed_from_u64(1));
        let mut request = Request::new(&sampling, &mut rng, &mut gate, "a".into(), 8, 4);
        let asked: Vec<bool> = [0.99, 0.01, 0.99, 0.99]
            .into_iter()
            .map(|c| request.admit(Some(c)))
            .collect();
        assert_eq!(asked, [true, false, false, false]);
        assert_eq!((request.admitted(), request.declined()), (1, true));
    }

    /// The same through a cascade nested in another (a server's prediction ahead of the
    /// config's adaptive cascade): the inner cascade's decline reaches the outer one, which
    /// does not ask it again where it stopped.
    #[test]
    fn a_nested_cascade_declined_by_the_gate_is_not_asked_again_there() {
        let calls = Arc::new(AtomicUsize::new(0));
        let inner = AdaptiveCascade::new("inner", vec![sure_sure_unsure(&calls)]);
        let mut outer =
            AdaptiveCascade::new("outer", vec![Box::new(CopyAt { at: 99 }), Box::new(inner)]);
        let draft = adaptive_draft(&mut outer);
        assert_eq!((draft.len(), calls.load(Ordering::Relaxed)), (2, 1));
    }

    /// A draft model in miniature: before each forward it asks the gate, paying `cost.0`
    /// seconds for a forward that catches up on text it has not seen and `cost.1` for one
    /// that only feeds its own last token; it drafts token 1 with confidence 0.99.
    struct MiniModel {
        cost: (f64, f64),
        seen: usize,
    }

    impl Drafter for MiniModel {
        fn name(&self) -> &str {
            "model"
        }

        fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
            let mut seq = context.to_vec();
            let mut draft = Draft::new();
            loop {
                let cost = match seq.len() > self.seen + 1 {
                    true => self.cost.0,
                    false => self.cost.1,
                };
                if !request.worth_drafting(cost, self.cost.1) || !request.admit(Some(0.99)) {
                    return Ok(draft);
                }
                self.seen = seq.len();
                seq.push(1);
                draft.push(1, Dist::Point(1));
            }
        }

        fn stats(&self) -> NodeStats {
            NodeStats::new("model", NodeKind::Model)
        }
    }

    /// Copies token 7 wherever the text is `at` tokens long, and drafts nothing elsewhere.
    struct CopyAt {
        at: usize,
    }

    impl Drafter for CopyAt {
        fn name(&self) -> &str {
            "copy"
        }

        fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
            let mut draft = Draft::new();
            if context.len() == self.at && request.admit(Some(0.99)) {
                draft.push(7, Dist::Point(7));
            }
            Ok(draft)
        }
    }

    fn cascade_draft(parts: Vec<Box<dyn Drafter>>, gate: Gate, k: usize) -> Vec<u32> {
        draft_ending(&mut AdaptiveCascade::new("a", parts), gate, k, &[])
    }

    /// `drafter`'s draft of up to `k` tokens after `[0, 0]`, for a generation ending at `ends`.
    fn draft_ending(drafter: &mut dyn Drafter, mut gate: Gate, k: usize, ends: &[u32]) -> Vec<u32> {
        let (sampling, mut rng) = (Sampling::default(), Rng::seed_from_u64(1));
        let mut request =
            Request::new(&sampling, &mut rng, &mut gate, "a".into(), k, 8).with_ends(ends.into());
        drafter
            .draft(&[0, 0], &mut request)
            .unwrap()
            .tokens()
            .to_vec()
    }

    /// After a part's token that ends the generation, a cascade asks no part for more: the
    /// draft model's forwards there would buy nothing (the reviewer would cut them off).
    #[test]
    fn a_cascade_stops_after_a_token_that_ends_the_generation() {
        let parts = || -> Vec<Box<dyn Drafter>> {
            vec![
                Box::new(CopyAt { at: 2 }),
                Box::new(MiniModel {
                    cost: (0.0, 0.0),
                    seen: 0,
                }),
            ]
        };
        let adaptive = |ends: &[u32]| {
            draft_ending(
                &mut AdaptiveCascade::new("a", parts()),
                Gate::fixed(),
                4,
                ends,
            )
        };
        assert_eq!(adaptive(&[]), [7, 1, 1, 1]);
        assert_eq!(adaptive(&[7]), [7]);
        let horizontal = |ends: &[u32]| {
            let parts = parts().into_iter().zip([1, 3]).collect();
            let mut h = crate::drafter::HorizontalCascade::new("h", parts);
            draft_ending(&mut h, Gate::fixed(), 4, ends)
        };
        assert_eq!(horizontal(&[]), [7, 1, 1, 1]);
        assert_eq!(horizontal(&[7]), [7]);
    }

    /// A draft model drafts one position per ask, so a cheaper part is asked again at every
    /// position and takes over where it has something, in the middle of the model's run.
    #[test]
    fn a_cheaper_part_takes_over_in_the_middle_of_a_draft_models_run() {
        let parts: Vec<Box<dyn Drafter>> = vec![
            Box::new(CopyAt { at: 4 }),
            Box::new(MiniModel {
                cost: (0.0, 0.0),
                seen: 0,
            }),
        ];
        assert_eq!(cascade_draft(parts, Gate::fixed(), 5), [1, 1, 7, 1, 1]);
    }

    /// Asked one position at a time, a draft model is still weighed over the run it may start:
    /// a first forward too dear for one position is paid for a run that repays it.
    #[test]
    fn a_draft_models_first_forward_is_weighed_over_the_whole_draft() {
        let gate = || Gate::adaptive(Adaptive::new(verify()));
        // At 100 tokens/s, a 12 ms forward for one position expected to give 0.8 tokens does
        // not pay; with a few 1 ms positions after it, the run does.
        let model = || -> Vec<Box<dyn Drafter>> {
            vec![Box::new(MiniModel {
                cost: (0.012, 0.001),
                seen: 0,
            })]
        };
        assert_eq!(cascade_draft(model(), gate(), 8).len(), 8);
        assert!(cascade_draft(model(), gate(), 1).is_empty());
    }
}
