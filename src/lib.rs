//! # cascade: lossless speculative decoding with cascades of drafters
//!
//! A target model is slow because every token costs a forward pass. Drafters guess several
//! tokens; the target scores all guesses in one forward pass and keeps the longest correct
//! prefix, by modified rejection sampling, so the output distribution is exactly the target's
//! (Leviathan et al. 2023; Chen et al. 2023). At temperature 0 the output is the target's
//! greedy output, token for token.
//!
//! The pieces, one module each:
//! - [`model`]: GGUF models (qwen2, llama, gemma3) whose forward returns logits for every position
//!   and whose KV cache rolls back;
//! - [`sampling`]: logits to the explicit distribution tokens are drawn from;
//! - [`draft`]: the [`draft::Drafter`] trait every drafter implements, and a round's
//!   [`draft::Request`];
//! - [`review`]: the verification step (accept, recover, bonus);
//! - [`reviewer`]: one review round, the same for the target and every vertical cascade;
//! - [`gate`] and [`costs`]: adaptive drafting from learned acceptance and measured costs;
//! - [`drafter`]: the built-in drafters (neural, bigram, Max-Gram, prediction, cascades);
//! - [`ngram`]: bigram tables built from corpora;
//! - [`engine`] and [`stream`]: the generation loop, stop conditions, counters, streamed text;
//! - [`config`]: TOML configs, validated into a plan and built into an engine, with a registry
//!   of plug-in drafter kinds;
//! - `server`: the OpenAI-compatible HTTP server (the `server` feature);
//! - [`theory`], [`bench`](mod@bench), [`planner`]: the papers' formulas, the bench harness, and the
//!   planner that picks draft lengths, schedules and K matrices from a bench report.
//!
//! Cargo features: `cli` (the default) builds the `cascade` command and turns on `server`. A
//! program that only embeds the engine can leave both out (`default-features = false`), and with
//! them clap, indicatif, axum and tokio.
//!
//! ```no_run
//! use cascade::config::RawConfig;
//! use std::path::Path;
//!
//! let plan = RawConfig::load(Path::new("configs/speculative.toml"))?.validate(Path::new("configs"))?;
//! let mut engine = plan.build(&mut |_, _, _| {})?;
//! // In the config's chat template (it sets `chat = true`), as `cascade generate` reads it.
//! let text = plan.prompt_text(&engine.tokenizer, "Write a Python function for Fibonacci numbers.")?;
//! let prompt = engine.tokenizer.encode(&text)?;
//! let out = engine.generate(&prompt, &plan.options, &mut |piece| print!("{piece}"))?;
//! eprintln!("\n{:.2} tokens per target call", out.stats.tokens_per_call());
//! # Ok::<(), cascade::Error>(())
//! ```

#![warn(missing_docs)]

pub mod bench;
pub mod chat;
pub mod config;
pub mod costs;
pub mod draft;
pub mod drafter;
pub mod engine;
pub mod error;
pub mod files;
pub mod gate;
pub mod model;
pub mod ngram;
pub mod planner;
mod profile;
pub mod review;
pub mod reviewer;
pub mod sampling;
#[cfg(feature = "server")]
pub mod server;
pub mod stream;
pub mod theory;
pub mod tokenizer;
mod vecmath;

/// The `candle-core` this crate computes with, at this version: for a plug-in
/// [`model::Model`] written with candle, and [`Error::candle_message`].
pub use candle_core;
pub use error::{Error, Result};
/// The `rand` this crate draws with: a plug-in drafter that samples from a round's
/// [`sampling::Rng`] needs its traits (`use cascade::rand::Rng as _;`), at this version.
pub use rand;
/// The `tokenizers` of [`tokenizer::Tokenizer::from_parts`].
pub use tokenizers;
/// The `toml` of [`config::PluginContext::table`]: a plug-in reads its table's values with it.
pub use toml;

/// Forward time by section, when `CASCADE_PROFILE=1` (otherwise `None`).
pub fn profile_report() -> Option<String> {
    profile::report()
}

/// Forgets the forward times so far, when `CASCADE_PROFILE=1`: a run that measured its
/// forward costs first (adaptive drafting, on a machine or build not measured yet) reports
/// only its generation.
pub fn profile_reset() {
    profile::reset()
}
