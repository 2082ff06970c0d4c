//! The generation loop: draft, verify in one target forward, keep the accepted prefix, roll back.
//!
//! Autoregressive decoding is the same loop with no drafter: every round feeds the last
//! committed token alone and samples the next from the target.

use crate::costs::ForwardCost;
use crate::draft::{Drafter, NodeStats};
use crate::error::{Error, Result};
use crate::gate::{BucketCount, Priors};
use crate::model::Model;
use crate::review::ReviewCounts;
use crate::reviewer::{ReviewRule, Reviewer};
use crate::sampling::{Rng, Sampling};
use crate::stream::TextStream;
use crate::tokenizer::Tokenizer;
use rand::SeedableRng;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Whether `CASCADE_TRACE=1`: every round's draft, prediction and time on standard error.
pub(crate) fn trace() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CASCADE_TRACE").is_ok_and(|v| v == "1"))
}

/// Per-call generation settings.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens generated.
    pub max_new_tokens: usize,
    /// How tokens are sampled.
    pub sampling: Sampling,
    /// Seed of the sampling generator.
    pub seed: u64,
    /// Draft length requested from the drafter per target call.
    pub k: usize,
    /// Lenience of the target's review; 1 keeps the output exact.
    pub lenience: f32,
    /// Stop strings: the output ends before the first that appears.
    pub stop: Vec<String>,
    /// When set (by another thread), generation ends at the next round with
    /// [`FinishReason::Cancelled`]: a server's client went away.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Keep generating past end-of-sequence tokens (they are then part of the output):
    /// for benchmarks of long runs.
    pub ignore_eos: bool,
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
            cancel: None,
            ignore_eos: false,
        }
    }
}

/// Why a generation ended.
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
    /// [`GenerateOptions::cancel`] was set.
    Cancelled,
}

impl FinishReason {
    /// Its name, as reports and `--json` spell it.
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Context => "context",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Counters of one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Target forward passes after the prompt (one per round).
    pub target_calls: usize,
    /// Tokens drafted for the target's review.
    pub drafted: usize,
    /// Drafted tokens the target accepted (a round cut by a stop string counts those its review
    /// kept after the cut too: the counters measure the drafts).
    pub accepted: usize,
    /// The target's reviews by draft position (one per round).
    #[serde(flatten)]
    pub reviews: ReviewCounts,
    /// Prompt tokens the target did not feed again: the start the prompt shares with the
    /// previous generation, still in its cache ([`Engine::forget`] empties it).
    pub cached_tokens: usize,
    /// Prompt processing time.
    pub prefill_seconds: f64,
    /// Generation time after the prompt.
    pub decode_seconds: f64,
    /// With adaptive drafting: the rounds' expected tokens and seconds as the cost model
    /// predicted them when each draft was made, and what plain decoding of those tokens would
    /// take (sums over rounds).
    pub predicted_tokens: f64,
    /// Predicted seconds of the rounds (adaptive drafting).
    pub predicted_seconds: f64,
    /// Predicted seconds of plain decoding of the same tokens (adaptive drafting).
    pub predicted_decode_seconds: f64,
    /// With adaptive drafting: the target's reviews of each drafter by confidence bucket.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub acceptance_by_confidence: Vec<SourceBuckets>,
}

/// A drafter's reviews at one level, by confidence bucket.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct SourceBuckets {
    /// The drafter's name.
    pub drafter: String,
    /// Its reviews by confidence bucket.
    pub buckets: Vec<BucketCount>,
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

    /// The decode speed the cost model predicted, in tokens per second (0 without adaptive
    /// drafting).
    pub fn predicted_tokens_per_second(&self) -> f64 {
        if self.predicted_seconds > 0.0 {
            self.predicted_tokens / self.predicted_seconds
        } else {
            0.0
        }
    }

    /// The speedup over plain decoding the cost model predicted (`None` without adaptive
    /// drafting).
    pub fn predicted_speedup(&self) -> Option<f64> {
        (self.predicted_seconds > 0.0)
            .then(|| self.predicted_decode_seconds / self.predicted_seconds)
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

/// The result of one generation.
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    /// Generated token ids (not the end-of-sequence token that ended the generation, if one did;
    /// those of a stop string, which `text` leaves out, included).
    pub tokens: Vec<u32>,
    /// The generated text, cut before a stop string (and before a character the generation
    /// cut off in the middle: half a character is no text).
    pub text: String,
    /// Why generation ended.
    pub finish_reason: FinishReason,
    /// Counters and timings.
    pub stats: Stats,
    /// Counters of every node of the drafter tree.
    pub drafter: Option<NodeStats>,
    /// What went wrong after the text was complete, without losing it: a drafter that could
    /// not record the output (Max-Gram's history file).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A target model with an optional drafter.
pub struct Engine {
    target: Reviewer,
    /// The drafter tree; `None` decodes autoregressively.
    pub drafter: Option<Box<dyn Drafter>>,
    /// The target's tokenizer.
    pub tokenizer: Tokenizer,
}

impl Engine {
    /// An engine over `target`, drafting with `drafter`.
    pub fn new(
        target: Box<dyn Model>,
        drafter: Option<Box<dyn Drafter>>,
        tokenizer: Tokenizer,
    ) -> Self {
        Self {
            target: Reviewer::new(target, 1.0),
            drafter,
            tokenizer,
        }
    }

    /// The target model.
    pub fn target(&self) -> &dyn Model {
        self.target.model()
    }

    /// Replaces the target's review rule: for experiments, and for tests that show a broken
    /// rule is caught by the distribution test. Any rule but the exact one
    /// ([`crate::review::review`]) gives up the output's exactness.
    pub fn with_review_rule(mut self, rule: ReviewRule) -> Self {
        self.target.set_rule(rule);
        self
    }

    /// Sizes the target's drafts adaptively (see [`crate::gate`]) with its measured forward
    /// cost, starting each drafter's acceptance estimates from `priors` where given (bucket
    /// midpoints otherwise): `GenerateOptions::k` becomes an upper bound.
    pub fn with_adaptive(mut self, verify: ForwardCost, priors: &[(String, Priors)]) -> Self {
        self.target.set_adaptive(verify, priors);
        self
    }

    /// With drafts sized adaptively: the target's forward cost and what it learned, for the
    /// kind of sampling (greedy or not) of the last round.
    pub fn adaptive(&self) -> Option<&crate::gate::Adaptive> {
        self.target.adaptive()
    }

    /// Empties the target's and the drafters' caches: the next generation reads its prompt
    /// from the first token instead of reusing what it shares with the previous one.
    pub fn forget(&mut self) {
        self.target.forget();
        if let Some(d) = self.drafter.as_mut() {
            d.forget();
        }
    }

    /// Generates a continuation of `prompt`, calling `on_text` with each piece of final text.
    /// The caches keep the previous generation's text: the start of `prompt` that repeats it
    /// is not processed again (the output is the same either way).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        self.generate_with_progress(prompt, opts, &mut |_, _| {}, on_text)
    }

    /// [`Engine::generate`], calling `reading(done, total)` as the target reads the prompt
    /// tokens it does not already hold (a progress bar: a long prompt takes minutes on a slow
    /// CPU). `opts.cancel` is checked between the chunks read, so a cancelled request stops
    /// reading too.
    pub fn generate_with_progress(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        reading: &mut dyn FnMut(usize, usize),
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        opts.sampling.validate()?;
        crate::review::check_lenience("lenience", opts.lenience)?;
        crate::draft::check_draft_length(opts.k)?;
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
        let mut rng = Rng::seed_from_u64(opts.seed);
        let mut stats = Stats {
            prompt_tokens: prompt.len(),
            ..Stats::default()
        };
        let mut stream = TextStream::new(&self.tokenizer, &opts.stop)?;
        let mut context = prompt.to_vec();
        let mut generated = Vec::new();

        let start = Instant::now();
        self.target.set_lenience(opts.lenience);
        self.target.set_cancel(opts.cancel.clone());
        self.target.set_ends(match opts.ignore_eos {
            true => Arc::new([]),
            false => self.tokenizer.eos_ids().into(),
        });
        if let Some(d) = self.drafter.as_mut() {
            d.start(prompt)?;
        }
        // The target's cache holds the committed sequence minus its last token, which is
        // fed at the head of each round.
        // A cancelled request stops reading between chunks (the rounds then end at once).
        let cancelled = || {
            opts.cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::Relaxed))
        };
        stats.cached_tokens = self.target.start(prompt, &mut |done, total| {
            reading(done, total);
            !cancelled()
        })?;
        stats.prefill_seconds = start.elapsed().as_secs_f64();

        let start = Instant::now();
        let finish = 'rounds: loop {
            if generated.len() >= opts.max_new_tokens {
                break FinishReason::Length;
            }
            if context.len() >= max_len {
                break FinishReason::Context;
            }
            if cancelled() {
                break FinishReason::Cancelled;
            }
            // Never draft past max_new_tokens or the target's context: the bonus token counts
            // against both.
            let k = opts
                .k
                .min(opts.max_new_tokens - generated.len() - 1)
                .min(max_len - context.len() - 1);
            let drafter = self.drafter.as_deref_mut();
            // What may still come out: bounded by max_new_tokens and by the context's room.
            let room = (opts.max_new_tokens - generated.len()).min(max_len - context.len());
            self.target.set_horizon(generated.len(), room);
            let round_start = Instant::now();
            let round = self
                .target
                .round(&context, drafter, k, &opts.sampling, &mut rng, false)?;
            if trace() {
                let (e, t) = round
                    .predicted
                    .map_or((0.0, 0.0), |p| (p.tokens, p.seconds));
                eprintln!(
                    "round {:>3}: drafted {} accepted {} | predicted {:.2} tokens in {:.1} ms | took {:.1} ms",
                    stats.target_calls,
                    round.drafted,
                    round.accepted,
                    e,
                    t * 1e3,
                    round_start.elapsed().as_secs_f64() * 1e3
                );
            }
            stats.target_calls += 1;
            stats.record(round.drafted, round.accepted);
            if let Some(p) = round.predicted {
                stats.predicted_tokens += p.tokens;
                stats.predicted_seconds += p.seconds;
                stats.predicted_decode_seconds += p.tokens * p.decode_seconds;
            }
            for token in round.tokens {
                context.push(token);
                if self.tokenizer.is_eos(token) && !opts.ignore_eos {
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
            self.target.commit(&context);
            if let Some(d) = self.drafter.as_mut() {
                d.commit(&context);
            }
        };
        on_text(stream.take_final(true));
        // The last tokens, held back as half a character, may have ended in a stop string.
        let finish = match finish {
            FinishReason::Cancelled => finish,
            _ if stream.stopped() => FinishReason::Stop,
            _ => finish,
        };
        stats.decode_seconds = start.elapsed().as_secs_f64();
        // The text is out: a drafter that cannot record it costs a warning, not the text. A
        // cancelled generation is not an answer to learn from (its client left or the server
        // is stopping): it is not recorded.
        let finished = self
            .drafter
            .as_mut()
            .filter(|_| finish != FinishReason::Cancelled);
        let warnings = match finished.map(|d| d.finish(&generated)) {
            Some(Err(e)) => vec![e.to_string()],
            _ => Vec::new(),
        };
        stats.generated_tokens = generated.len();
        if let Some(a) = self.target.adaptive() {
            stats.acceptance_by_confidence = a.report();
        }
        Ok(Generation {
            text: stream.text().to_string(),
            tokens: generated,
            finish_reason: finish,
            stats,
            drafter: self.drafter.as_ref().map(|d| d.stats()),
            warnings,
        })
    }
}
