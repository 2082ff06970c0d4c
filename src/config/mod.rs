//! Configuration in two layers: [`RawConfig`] mirrors the TOML and only checks what was typed
//! (unknown keys are errors); [`RawConfig::validate`] turns it into a [`Plan`] once, with errors
//! that name the TOML path. [`Plan::build`] loads the models into an [`Engine`](crate::engine::Engine).
//!
//! Drafters are named in `[drafters.NAME]` tables and reference each other by name, forming
//! any tree over the target:
//!
//! ```toml
//! [target]
//! model = "../models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
//! drafter = "cascade"
//! k = 6
//!
//! [drafters.mag]
//! kind = "max_gram"
//!
//! [drafters.small]            # vertical: the 0.5B reviews Max-Gram's drafts
//! kind = "vertical"
//! reviewer = "../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
//! draft = "mag"
//! k = 8                       # tokens asked of the inner drafter per review
//! lenience = 2.0
//!
//! [drafters.cascade]          # horizontal: 3 tokens from the cascade, the rest from Max-Gram
//! kind = "horizontal"
//! schedule = [["small", 3], ["mag", 8]]
//! ```
//!
//! The paper's K-matrix notation is accepted too (`kind = "k_matrix"`, see [`RawDrafter`]).
//!
//! Library users add drafter kinds of their own with a [`Registry`] and
//! [`RawConfig::validate_with`]; a config then names them like a built-in kind.

mod build;
mod registry;
mod schema;
mod validate;

pub use build::{
    check_vocab, distinct_trimmed_vocabularies, file_label, trimmed_tokens, TrimmedModel,
};
pub use registry::{PluginContext, Registry};
pub use schema::{RawConfig, RawDrafter, RawGeneration, RawTarget, BUILT_IN_KINDS};
pub use validate::{
    DrafterNode, DrafterPlan, KMatrixRole, ModelPlan, Plan, TrimmedVocabulary, MAX_CONTEXT,
    MAX_DRAFT, MAX_HISTORY, MAX_NGRAM,
};
