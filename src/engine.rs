//! The generation loop: draft, verify in one target forward, keep the accepted prefix, roll back.
//!
//! Autoregressive decoding is the same loop with no drafter: every round feeds the last
//! committed token alone and samples the next from the target.

use crate::drafter::{Draft, Drafter, NodeStats};
use crate::error::{Error, Result};
use crate::model::Logits;
use crate::model::Model;
use crate::review::{review, ReviewCounts, Verdict};
use crate::sampling::{Dist, Sampling};
use crate::stream::TextStream;
use crate::tokenizer::Tokenizer;
use crate::verifier::Verifier;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;
use std::time::Instant;

/// Per-call generation settings.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// Draft length requested from the drafter per target call.
    pub k: usize,
    /// Lenience of the target's review; 1 keeps the output exact.
    pub lenience: f32,
    pub stop: Vec<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            sampling: Sampling::greedy(),
            seed: 0,
            k: 4,
            lenience: 1.0,
            stop: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token was sampled (it is not part of the output).
    Eos,
    /// `max_new_tokens` were generated.
    Length,
    /// A stop string appeared (the text ends before it).
    Stop,
    /// The model's context is full.
    Context,
}

/// Counters of one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Target forward passes after the prompt (one per round).
    pub target_calls: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// The target's reviews by draft position (one per round).
    #[serde(flatten)]
    pub reviews: ReviewCounts,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl Stats {
    /// Mean tokens committed per target call, the bonus token included (1 for autoregressive).
    pub fn tokens_per_call(&self) -> f64 {
        self.generated_tokens as f64 / self.target_calls.max(1) as f64
    }

    /// Generated tokens per second of decoding (prompt processing excluded).
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.generated_tokens as f64 / self.decode_seconds.max(1e-9)
    }

    /// Acceptance rate at each draft position, given it was reviewed (every earlier
    /// position accepted): the `a_i` of CS Drafting's Theorem 4.1.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.reviews.acceptance_by_position()
    }

    /// Mean draft length per target call.
    pub fn mean_draft_len(&self) -> f64 {
        self.drafted as f64 / self.target_calls.max(1) as f64
    }

    fn record(&mut self, drafted: usize, accepted: usize) {
        self.reviews.record(drafted, accepted);
        self.drafted += drafted;
        self.accepted += accepted;
    }
}

/// Holds plug-in drafters to their contract: at most `k` tokens, one distribution per token,
/// ids inside the vocabulary.
fn check_draft(draft: &mut Draft, k: usize, vocab: usize) -> Result<()> {
    if draft.tokens.len() != draft.dists.len() {
        return Err(Error::Drafter(format!(
            "{} tokens but {} distributions",
            draft.tokens.len(),
            draft.dists.len()
        )));
    }
    if let Some(&t) = draft.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Drafter(format!(
            "token id {t} is outside the vocabulary ({vocab} tokens)"
        )));
    }
    draft.tokens.truncate(k);
    draft.dists.truncate(k);
    Ok(())
}

/// The result of one generation.
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    /// Generated token ids (an end-of-sequence token is not included).
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: Stats,
    /// Counters of every node of the drafter tree.
    pub drafter: Option<NodeStats>,
}

/// The signature of a review rule; [`review`] is the exact one.
pub type ReviewFn = fn(&[u32], &[Dist], &Logits, &Sampling, f32, &mut StdRng) -> Verdict;

/// A target model with an optional drafter.
pub struct Engine {
    target: Verifier,
    pub drafter: Option<Box<dyn Drafter>>,
    pub tokenizer: Tokenizer,
    reviewer: ReviewFn,
}

impl Engine {
    pub fn new(
        target: Box<dyn Model>,
        drafter: Option<Box<dyn Drafter>>,
        tokenizer: Tokenizer,
    ) -> Self {
        Self {
            target: Verifier::new(target),
            drafter,
            tokenizer,
            reviewer: review,
        }
    }

    pub fn target(&self) -> &dyn Model {
        self.target.model()
    }

    /// Replaces the target's review rule: for experiments, and for tests that show a broken
    /// rule is caught by the distribution test.
    pub fn with_reviewer(mut self, reviewer: ReviewFn) -> Self {
        self.reviewer = reviewer;
        self
    }

    /// Generates a continuation of `prompt`, calling `on_text` with each piece of final text.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        opts.sampling.validate()?;
        if !(opts.lenience >= 1.0 && opts.lenience.is_finite()) {
            return Err(Error::config(
                "lenience",
                format!("must be a finite number >= 1, got {}", opts.lenience),
            ));
        }
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let max_len = self.target.model().max_len();
        if prompt.len() >= max_len {
            return Err(Error::PromptTooLong {
                model: self.target.model().name().to_string(),
                prompt: prompt.len(),
                context: max_len,
            });
        }
        let mut rng = StdRng::seed_from_u64(opts.seed);
        let mut stats = Stats {
            prompt_tokens: prompt.len(),
            ..Stats::default()
        };
        let mut stream = TextStream::new(&self.tokenizer, &opts.stop);
        let mut context = prompt.to_vec();
        let mut generated = Vec::new();

        let start = Instant::now();
        self.target.reset();
        if let Some(d) = self.drafter.as_mut() {
            d.start(prompt)?;
        }
        // The target's cache holds the committed sequence minus its last token, which is
        // fed at the head of each round.
        self.target.prepare(prompt)?;
        stats.prefill_seconds = start.elapsed().as_secs_f64();

        let start = Instant::now();
        let finish = 'rounds: loop {
            if generated.len() >= opts.max_new_tokens {
                break FinishReason::Length;
            }
            if context.len() >= max_len {
                break FinishReason::Context;
            }
            // Never draft past max_new_tokens (the bonus token counts) or the target's context.
            let k = opts
                .k
                .min(opts.max_new_tokens - generated.len() - 1)
                .min(max_len - context.len());
            let mut draft = match self.drafter.as_mut() {
                Some(d) if k > 0 => d.draft(&context, k, &opts.sampling, &mut rng)?,
                _ => Draft::default(),
            };
            check_draft(&mut draft, k, self.target.model().vocab_size())?;
            let logits = self.target.score(&context, &draft.tokens)?;
            stats.target_calls += 1;
            let verdict = (self.reviewer)(
                &draft.tokens,
                &draft.dists,
                &logits,
                &opts.sampling,
                opts.lenience,
                &mut rng,
            );
            stats.record(draft.len(), verdict.accepted);
            // Roll back the target past the rejected draft tokens.
            self.target.settle(context.len() + verdict.accepted);

            let new_tokens = draft.tokens[..verdict.accepted]
                .iter()
                .copied()
                .chain([verdict.next]);
            for token in new_tokens {
                context.push(token);
                if self.tokenizer.is_eos(token) {
                    break 'rounds FinishReason::Eos;
                }
                generated.push(token);
                let stopped = stream.push(token)?;
                on_text(stream.take_final(false));
                if stopped {
                    break 'rounds FinishReason::Stop;
                }
                if generated.len() >= opts.max_new_tokens {
                    break 'rounds FinishReason::Length;
                }
            }
            if let Some(d) = self.drafter.as_mut() {
                d.commit(&context);
            }
        };
        on_text(stream.take_final(true));
        stats.decode_seconds = start.elapsed().as_secs_f64();
        stats.generated_tokens = generated.len();
        Ok(Generation {
            text: stream.text().to_string(),
            tokens: generated,
            finish_reason: finish,
            stats,
            drafter: self.drafter.as_ref().map(|d| d.stats()),
        })
    }
}
