//! The TOML as written: [`RawConfig`] mirrors the file and only checks what was typed
//! (unknown keys are errors).

use crate::drafter::MaxGramPolicy;
use crate::error::{Error, Result};
use crate::model::ModelSource;
use crate::sampling::Sampling;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The TOML file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// The target model and its draft settings (`[target]`).
    pub target: RawTarget,
    /// The named drafters (`[drafters.NAME]`).
    #[serde(default, deserialize_with = "drafter_tables")]
    pub drafters: BTreeMap<String, RawDrafter>,
    /// Sampling settings (`[sampling]`).
    #[serde(default)]
    pub sampling: Sampling,
    /// Generation settings (`[generation]`).
    #[serde(default)]
    pub generation: RawGeneration,
}

/// `[target]`: the model whose output the engine reproduces.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTarget {
    /// The model file.
    pub model: ModelSource,
    /// A `tokenizer.json` to use instead of the one embedded in the GGUF.
    pub tokenizer: Option<PathBuf>,
    /// Name of the drafter in `[drafters]`; none means autoregressive decoding.
    pub drafter: Option<String>,
    /// Tokens drafted per target call.
    #[serde(default = "default_k")]
    pub k: usize,
    /// Lenience of the target's review; anything but 1 changes the output distribution.
    #[serde(default = "one")]
    pub lenience: f32,
    /// Must be true for `lenience != 1`: an explicit opt-in to inexact output.
    #[serde(default)]
    pub allow_inexact: bool,
    /// Size each draft by the drafters' learned acceptance and this machine's measured costs
    /// (`k` becomes an upper bound).
    #[serde(default)]
    pub adaptive: bool,
    /// With `adaptive`: measured acceptance by confidence bucket of each drafter, where the
    /// gate's estimates start (`cascade plan` writes it from a bench report).
    #[serde(default)]
    pub acceptance: BTreeMap<String, Vec<f64>>,
    /// Cap on the context length (tokens), below the model's own.
    pub context: Option<usize>,
}

/// A named drafter.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum RawDrafter {
    /// Samples from a smaller model that shares the target's tokenizer.
    Model {
        /// The model file.
        model: ModelSource,
        /// A `tokenizer.json` instead of the GGUF's own tokenizer.
        tokenizer: Option<PathBuf>,
        /// Score only this many of the most frequent tokens of `vocabulary_table`'s corpus
        /// (plus each prompt's own tokens and the end-of-sequence tokens).
        vocabulary: Option<usize>,
        /// The bigram table whose token ranking `vocabulary` reads.
        vocabulary_table: Option<PathBuf>,
    },
    /// Follows a bigram table (built with `cascade ngram build`).
    Bigram {
        /// The table file.
        table: PathBuf,
        /// Sample successors from the table instead of taking the most likely.
        #[serde(default)]
        sample: bool,
    },
    /// Copies the continuation of the longest earlier match of the text's suffix, falling
    /// back to a bigram table when there is none.
    MaxGram {
        /// The bigram table to fall back on.
        table: Option<PathBuf>,
        /// Longest suffix searched for.
        #[serde(default = "default_max_ngram")]
        max_ngram: usize,
        /// Shortest match worth drafting from.
        #[serde(default = "default_min_match")]
        min_match: usize,
        /// Tokens drafted from the bigram table when there is no match.
        #[serde(default = "default_bigram_tokens")]
        bigram_tokens: usize,
        /// A match of length n copies at most `n * length_per_match` tokens; 0 leaves it to
        /// the gate.
        #[serde(default = "default_length_per_match")]
        length_per_match: f32,
        /// A file of earlier outputs to copy from too (created if missing), so that repeated
        /// tasks speed up across runs.
        history: Option<PathBuf>,
        /// The most tokens the history keeps (the oldest outputs go first).
        #[serde(default = "default_history_tokens")]
        history_tokens: usize,
    },
    /// A reviewer model over another drafter (CS Drafting's vertical cascade).
    Vertical {
        /// The reviewing model.
        reviewer: ModelSource,
        /// A `tokenizer.json` instead of the reviewer's own.
        tokenizer: Option<PathBuf>,
        /// The inner drafter's name.
        draft: String,
        /// Tokens asked of the inner drafter per review.
        #[serde(default = "default_k")]
        k: usize,
        /// Lenience of this review (>= 1; 1 is exact).
        #[serde(default = "one")]
        lenience: f32,
        /// Size the inner drafts adaptively (`k` becomes an upper bound).
        #[serde(default)]
        adaptive: bool,
    },
    /// Each position of a draft from the cheapest drafter worth it there (a dynamic
    /// horizontal cascade): `drafters = ["mag", "small"]`, cheapest first.
    Adaptive {
        /// The drafters' names, cheapest first.
        drafters: Vec<String>,
    },
    /// Positions of one draft split between drafters (CS Drafting's horizontal cascade):
    /// `schedule = [["a", 2], ["b", 6]]` takes 2 tokens from `a`, then up to 6 from `b`.
    Horizontal {
        /// `[drafter, tokens]` pairs in draft order.
        schedule: Vec<(String, usize)>,
    },
    /// The paper's notation (CS Drafting, Algorithm 1 and Table 2). With reviewer models
    /// `d_1..d_n` (most capable first) and a final drafter `d_{n+1}` (`last`, usually
    /// Max-Gram), row `r` of `k_matrix` (1-based) builds the draft reviewed at level `r - 1`
    /// (row 1: the target's): `k_matrix[r][j]` tokens from `d_{r+j}`, where each `d_i` with
    /// `i <= n` is a vertical cascade reviewing the draft of row `i + 1`, and `d_{n+1}`
    /// drafts `last_k` tokens per review. Row `r` has `n + 2 - r` entries (the last one for
    /// `last`). Table 2's `k11, k12, k21` for base, small, Max-Gram is
    /// `k_matrix = [[k11, k12, 0], [k21, 0]]`.
    KMatrix {
        /// The reviewer models `d_1..d_n`, most capable first.
        reviewers: Vec<ModelSource>,
        /// The final drafter's name.
        last: String,
        /// Row r: tokens from each drafter in the draft reviewed at level r - 1.
        k_matrix: Vec<Vec<usize>>,
        /// Tokens the final drafter drafts per review.
        #[serde(default = "default_last_k")]
        last_k: usize,
        /// Lenience of the reviews inside the cascade.
        #[serde(default = "one")]
        lenience: f32,
    },
    /// A kind a library user registered ([`Registry`](super::Registry)): its table as written,
    /// `kind` removed.
    #[serde(skip)]
    Plugin {
        /// The registered kind.
        kind: String,
        /// The table, `kind` removed.
        table: toml::Table,
    },
}

/// The kinds built into the engine; any other `kind` names a plug-in.
pub const BUILT_IN_KINDS: [&str; 7] = [
    "model",
    "bigram",
    "max_gram",
    "vertical",
    "horizontal",
    "adaptive",
    "k_matrix",
];

/// Reads `[drafters.*]`: built-in kinds into their typed form, any other kind as a plug-in
/// table (checked against the registry when the config is validated).
fn drafter_tables<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, RawDrafter>, D::Error> {
    let tables = BTreeMap::<String, DrafterTable>::deserialize(d)?;
    Ok(tables.into_iter().map(|(name, t)| (name, t.0)).collect())
}

/// One `[drafters.NAME]` table, read where the TOML deserializer stands on it, so that an
/// error in it points at this table, not at the first drafter's.
struct DrafterTable(RawDrafter);

impl<'de> Deserialize<'de> for DrafterTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let mut table = toml::Table::deserialize(d)?;
        let kind = match table.get("kind") {
            Some(toml::Value::String(k)) => k.clone(),
            Some(_) => return Err(D::Error::custom("`kind` must be a string")),
            None => return Err(D::Error::custom("missing `kind`")),
        };
        Ok(DrafterTable(if BUILT_IN_KINDS.contains(&kind.as_str()) {
            RawDrafter::deserialize(toml::Value::Table(table)).map_err(D::Error::custom)?
        } else {
            table.remove("kind");
            RawDrafter::Plugin { kind, table }
        }))
    }
}

/// `[generation]`: how much to generate and when to stop.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGeneration {
    /// Most tokens generated per prompt.
    #[serde(default = "default_max_new")]
    pub max_new_tokens: usize,
    /// Seed of the sampling generator.
    #[serde(default)]
    pub seed: u64,
    /// Stop strings: the output ends before the first that appears.
    #[serde(default)]
    pub stop: Vec<String>,
    /// Wrap the prompt in the model's chat template.
    #[serde(default)]
    pub chat: bool,
    /// System message for the chat template.
    pub system: Option<String>,
}

impl Default for RawGeneration {
    fn default() -> Self {
        Self {
            max_new_tokens: default_max_new(),
            seed: 0,
            stop: Vec::new(),
            chat: false,
            system: None,
        }
    }
}

fn default_k() -> usize {
    4
}
fn one() -> f32 {
    1.0
}
fn default_max_new() -> usize {
    256
}
fn default_last_k() -> usize {
    10
}
fn default_max_ngram() -> usize {
    MaxGramPolicy::default().max_ngram
}
fn default_min_match() -> usize {
    MaxGramPolicy::default().min_match
}
fn default_bigram_tokens() -> usize {
    MaxGramPolicy::default().bigram_tokens
}
fn default_history_tokens() -> usize {
    1 << 18
}
fn default_length_per_match() -> f32 {
    MaxGramPolicy::default().length_per_match
}

impl RawConfig {
    /// Parses TOML text; `origin` names the file in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| Error::config(origin, e.to_string().trim_end()))
    }

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            // The shipped configs are named from the repository's root.
            let cwd = std::env::current_dir()
                .ok()
                .filter(|_| e.kind() == std::io::ErrorKind::NotFound && path.is_relative());
            let hint = cwd.map_or(String::new(), |d| {
                format!(" (relative to the current folder, {})", d.display())
            });
            Error::config(
                path.display().to_string(),
                format!("cannot read config: {e}{hint}"),
            )
        })?;
        Self::parse(&text, &path.display().to_string())
    }
}
