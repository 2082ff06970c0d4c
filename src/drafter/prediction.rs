//! Predicted outputs: a client sends the text it expects back (typically the file being
//! edited), and the drafter copies from it wherever the text so far matches it.
//!
//! This is Max-Gram over one more source: the index holds the prediction, a separator, then
//! the context, and a suffix of the context found in the prediction proposes what followed it
//! there. The review keeps the output exact: a wrong prediction costs rejected drafts, never
//! wrong text.

use super::max_gram::MaxGram;
use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use crate::error::Result;
use crate::model::common_prefix;
use crate::sampling::Dist;

/// Copies continuations from a prediction (and from the context itself).
pub struct PredictionDrafter {
    name: String,
    /// The prediction, then [`SEPARATOR`].
    prediction: Vec<u32>,
    /// `prediction`, then the context.
    index: MaxGram,
    /// Leading context tokens of the index known to be committed.
    committed: usize,
    /// The shortest suffix match that drafts: shorter ones are often chance.
    min_match: usize,
}

/// Between the prediction and the context in the index: no token id, so no suffix of the
/// context matches across the seam (nothing there was ever written in that order).
const SEPARATOR: u32 = u32::MAX;

impl PredictionDrafter {
    /// A drafter over the tokens of `prediction`, matching suffixes of up to `max_ngram`.
    pub fn new(name: impl Into<String>, mut prediction: Vec<u32>, max_ngram: usize) -> Self {
        prediction.push(SEPARATOR);
        let mut index = MaxGram::new(max_ngram);
        index.start(&prediction);
        Self {
            name: name.into(),
            prediction,
            index,
            committed: 0,
            min_match: 2,
        }
    }

    fn sync(&mut self, context: &[u32]) {
        let p = self.prediction.len();
        let keep = common_prefix(&self.index.tokens()[p..], context, self.committed);
        self.index.truncate(p + keep);
        context[keep..].iter().for_each(|&t| self.index.push(t));
    }
}

impl Drafter for PredictionDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        self.sync(context);
        let mut draft = Draft::new();
        let Some((m, share)) = self.index.best_continuation() else {
            return Ok(draft);
        };
        // A match lies in the prediction or in the context (the separator is in neither); a
        // copy from the prediction stops at its end.
        let end = self.prediction.len() - 1;
        let room = match m.end <= end {
            true => end - m.end,
            false => usize::MAX,
        };
        if m.len < self.min_match || room == 0 {
            return Ok(draft);
        }
        for (i, t) in self
            .index
            .copy(m, request.remaining().min(room))
            .into_iter()
            .enumerate()
        {
            let matched = (m.len + i) as f32;
            if !request.fits(t) || !request.admit(Some(share * matched / (matched + 1.0))) {
                break;
            }
            draft.push(t, Dist::Point(t));
            if request.ends(t) {
                break;
            }
        }
        Ok(draft)
    }

    fn commit(&mut self, context: &[u32]) {
        self.sync(context);
        self.committed = context.len();
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.index.start(&self.prediction);
        prompt.iter().for_each(|&t| self.index.push(t));
        self.committed = prompt.len();
        Ok(())
    }

    fn stats(&self) -> NodeStats {
        NodeStats::new(&self.name, NodeKind::Prediction)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::propose;

    #[test]
    fn copies_what_followed_the_match_in_the_prediction() {
        // The prediction says 1 2 3 4 5 6; the text so far ends with 2 3.
        let mut d = PredictionDrafter::new("p", vec![1, 2, 3, 4, 5, 6], 8);
        d.start(&[9, 2, 3]).unwrap();
        assert_eq!(propose(&mut d, &[9, 2, 3], 3).tokens(), &[4, 5, 6]);
        // After committing a token the prediction did not have, nothing matches.
        d.commit(&[9, 2, 3, 7]);
        assert!(propose(&mut d, &[9, 2, 3, 7], 3).is_empty());
        // A rollback of the context brings the match back.
        assert_eq!(propose(&mut d, &[9, 2, 3], 2).tokens(), &[4, 5]);
    }

    #[test]
    fn copies_stop_at_the_seam_between_prediction_and_context() {
        let mut d = PredictionDrafter::new("p", vec![1, 2, 3, 4], 8);
        d.start(&[7, 8]).unwrap();
        // The text reproduced the prediction to its end: what follows in the index is the
        // prompt, which the prediction never said comes next.
        assert!(propose(&mut d, &[7, 8, 5, 1, 2, 3, 4], 3).is_empty());
        // A copy from within the prediction stops at its end.
        assert_eq!(propose(&mut d, &[7, 8, 5, 1, 2], 4).tokens(), &[3, 4]);
        // A suffix found only across the seam (4 then 7) drafts nothing.
        assert!(propose(&mut d, &[7, 8, 4, 7], 3).is_empty());
        // Where the longest suffix (9 4 7) would match only across the seam, a shorter one
        // (4 7) found in the context still drafts.
        let mut d = PredictionDrafter::new("p", vec![9, 4], 8);
        let context = [7, 1, 4, 7, 2, 9, 4, 7];
        d.start(&context[..5]).unwrap();
        assert_eq!(propose(&mut d, &context, 2).tokens(), &[2, 9]);
    }
}
