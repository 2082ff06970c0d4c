//! Horizontal cascade: the positions of one draft split between drafters.

use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use crate::error::Result;
use crate::gate::Source;

/// Fills a draft from a schedule of (drafter, tokens): the first tokens from the first
/// drafter, the next from the second continuing from them, and so on (CS Drafting 3.2:
/// later positions are rarely accepted, so cheaper drafters take them). A drafter that
/// returns fewer tokens than its share leaves the rest to the next one.
pub struct HorizontalCascade {
    name: String,
    parts: Vec<Part>,
}

/// A drafter of a horizontal cascade and its share of the draft.
struct Part {
    drafter: Box<dyn Drafter>,
    source: Source,
    share: usize,
}

impl HorizontalCascade {
    /// Parts drafting the given token counts, in draft order.
    pub fn new(name: impl Into<String>, parts: Vec<(Box<dyn Drafter>, usize)>) -> Self {
        Self {
            name: name.into(),
            parts: parts
                .into_iter()
                .map(|(drafter, share)| Part {
                    source: drafter.name().into(),
                    drafter,
                    share,
                })
                .collect(),
        }
    }
}

/// How much of a draft a part is asked for.
#[derive(Clone, Copy)]
pub(crate) enum Share {
    /// Up to this many tokens ([`Request::part`]).
    UpTo(usize),
    /// One token, its forwards weighed over the rest of the draft ([`Request::step`]).
    Step,
}

/// Asks `drafter` (as `source`) for its `share` of tokens continuing `seq`, through a part of
/// `request`, and holds it to the contract. Also says whether the gate declined its next
/// token ([`Request::declined`]).
pub(crate) fn ask_part(
    drafter: &mut dyn Drafter,
    source: &Source,
    seq: &[u32],
    request: &mut Request,
    share: Share,
) -> Result<(Draft, bool)> {
    let mut part = match share {
        Share::UpTo(cap) => request.part(source, cap),
        Share::Step => request.step(source),
    };
    let mut draft = drafter.draft(seq, &mut part)?;
    part.check(&mut draft, drafter.name())?;
    let (admitted, declined) = (part.admitted(), part.declined());
    request.count_part(admitted);
    Ok((draft, declined))
}

impl Drafter for HorizontalCascade {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        let mut seq = context.to_vec();
        let mut out = Draft::new();
        for p in &mut self.parts {
            if request.remaining() == 0 {
                break;
            }
            let (draft, _) = ask_part(
                p.drafter.as_mut(),
                &p.source,
                &seq,
                request,
                Share::UpTo(p.share),
            )?;
            let ended = request.ended(&draft);
            seq.extend_from_slice(draft.tokens());
            out.append(draft);
            if ended {
                break;
            }
        }
        Ok(out)
    }

    fn commit(&mut self, context: &[u32]) {
        self.parts
            .iter_mut()
            .for_each(|p| p.drafter.commit(context));
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.parts
            .iter_mut()
            .try_for_each(|p| p.drafter.start(prompt))
    }

    fn finish(&mut self, output: &[u32]) -> Result<()> {
        // Every part records the output, even after one fails; the first failure is reported.
        self.parts
            .iter_mut()
            .map(|p| p.drafter.finish(output))
            .fold(Ok(()), Result::and)
    }

    fn forget(&mut self) {
        self.parts.iter_mut().for_each(|p| p.drafter.forget());
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            children: self.parts.iter().map(|p| p.drafter.stats()).collect(),
            ..NodeStats::new(&self.name, NodeKind::Horizontal)
        }
    }
}
