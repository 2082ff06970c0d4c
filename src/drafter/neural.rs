//! A drafter that samples autoregressively from a (smaller) model.

use crate::costs::ForwardCost;
use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use crate::error::Result;
use crate::model::{Model, SyncedModel};
use crate::sampling::{softmax_max, Dist};
use std::sync::Arc;

/// Samples tokens one at a time from its model, reporting each token's distribution. Its
/// confidence in a token is the largest probability of the distribution it is drawn from.
pub struct NeuralDrafter {
    name: String,
    model: SyncedModel,
    /// Its model's measured forward cost, which an adaptive gate weighs before each forward
    /// pass (free if unknown). Measured once, not a live clock, so that a seed reproduces its
    /// output.
    cost: Option<ForwardCost>,
    /// A trimmed vocabulary: the tokens always scored (a corpus's most frequent ones and the
    /// end-of-sequence tokens); each prompt's own tokens join them.
    vocabulary: Option<Arc<[u32]>>,
    /// Whether its model has read the sequence's prompt. It does so before its first draft,
    /// not when the sequence starts, and only if the gate finds it worth the time.
    read_prompt: bool,
}

impl NeuralDrafter {
    /// A drafter sampling from `model`.
    pub fn new(name: impl Into<String>, model: Box<dyn Model>) -> Self {
        Self {
            name: name.into(),
            model: SyncedModel::new(model).standing_in(),
            cost: None,
            vocabulary: None,
            read_prompt: false,
        }
    }

    /// Scores only `tokens` plus each prompt's own tokens (FR-Spec's frequency-ranked draft
    /// vocabulary): most of the output projection is skipped, and a token outside the set is
    /// never drafted. The review stays exact: the drafter reports the distribution over the
    /// set that it sampled from.
    pub fn with_vocabulary(mut self, tokens: Arc<[u32]>) -> Self {
        self.vocabulary = Some(tokens);
        self
    }

    /// Sets its model's measured forward cost on this machine.
    pub fn with_cost(mut self, cost: &ForwardCost) -> Self {
        self.cost = Some(cost.clone());
        self
    }
}

/// The largest probability of `dist`: a drafter's confidence in what it samples from it.
pub(crate) fn top_probability(dist: &Dist) -> f32 {
    match dist {
        Dist::Point(_) => 1.0,
        Dist::Dense(p) => p.iter().copied().fold(0.0, f32::max),
        Dist::Sparse(s) => s.iter().map(|&(_, p)| p).fold(0.0, f32::max),
    }
}

impl Drafter for NeuralDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        let mut draft = Draft::new();
        // Room left in this model's context: a draft model with a shorter context than the
        // target's stops drafting where the text outgrows it.
        let room = self.model.model().max_len().saturating_sub(context.len());
        if room == 0 {
            return Ok(draft);
        }
        if !self.read_prompt {
            // Reading the prompt is a one-time investment, weighed against the whole rest of
            // the generation (a long prompt with a short answer may not repay it).
            if !request.worth_reading(self.model.behind(context), self.cost.as_ref()) {
                return Ok(draft);
            }
            self.model
                .prepare_with(context, &mut |_, _| !request.cancelled())?;
            if request.cancelled() {
                return Ok(draft); // read in part: the next sequence catches up
            }
            self.read_prompt = true;
        }
        let mut seq = context.to_vec();
        while draft.len() < room && !seq.is_empty() {
            // The next forward: catching up on the text since its last draft, then one token;
            // the forwards after it, one token each.
            let (seconds, then) = self.cost.as_ref().map_or((0.0, 0.0), |c| {
                (
                    self.model.score_seconds(&seq, 0, c),
                    c.seconds_at(1, seq.len()),
                )
            });
            if !request.worth_drafting(seconds, then) {
                break;
            }
            // An empty draft scored: one forward over the last token (after catching up).
            let logits = self.model.score(&seq, &[])?;
            let q = request.sampling().distribution(logits.row(0));
            // Greedy draws from a point mass, which says nothing: the model's own top
            // probability does.
            let confidence = match q {
                Dist::Point(_) => softmax_max(logits.row(0)),
                _ => top_probability(&q),
            };
            if !request.admit(Some(confidence)) {
                break;
            }
            let token = q.sample(request.rng());
            draft.push(token, q);
            seq.push(token);
            if request.ends(token) {
                break;
            }
        }
        Ok(draft)
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.model.reset();
        if let Some(base) = &self.vocabulary {
            // (A prompt may spell ids a narrower vocabulary than the target's lacks.)
            let vocab = self.model.model().vocab_size();
            let mut tokens: Vec<u32> = (base.iter().chain(prompt).copied())
                .filter(|&t| (t as usize) < vocab)
                .collect();
            tokens.sort_unstable();
            tokens.dedup();
            self.model.model_mut().restrict_vocabulary(Some(&tokens))?;
        }
        // The prompt is read before the first draft, if at all.
        self.read_prompt = false;
        Ok(())
    }

    fn commit(&mut self, context: &[u32]) {
        self.model.commit(context);
    }

    fn forget(&mut self) {
        self.model.forget();
    }

    fn stats(&self) -> NodeStats {
        NodeStats {
            model: Some(crate::costs::subject_label(
                self.model.model().name(),
                self.vocabulary.as_ref().map(|v| v.len()),
            )),
            forward_calls: self.model.calls,
            ..NodeStats::new(&self.name, NodeKind::Model)
        }
    }
}
