//! The library's error type: one enum, each message naming the offending value.

use std::path::PathBuf;

/// Everything that can go wrong in the library. The binary wraps these in `anyhow`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("model file not found: {}", .0.display())]
    ModelNotFound(PathBuf),

    #[error("cannot read GGUF file {}: {reason}", path.display())]
    BadModelFile { path: PathBuf, reason: String },

    #[error("unsupported model architecture `{arch}` in {} (supported: qwen2, llama)", path.display())]
    UnsupportedArchitecture { path: PathBuf, arch: String },

    #[error("cannot resolve model {repo}/{file}: {reason}")]
    Hub {
        repo: String,
        file: String,
        reason: String,
    },

    #[error("bigram table {}: {reason}", path.display())]
    NgramTable { path: PathBuf, reason: String },

    #[error("cannot load tokenizer: {0}")]
    Tokenizer(String),

    #[error(
        "vocabulary mismatch: drafter `{drafter}` ({drafter_vocab} tokens, fingerprint {drafter_fp:016x}) \
         cannot draft for `{target}` ({target_vocab} tokens, fingerprint {target_fp:016x}); \
         a drafter must use the target's tokenizer"
    )]
    VocabMismatch {
        target: String,
        drafter: String,
        target_vocab: usize,
        drafter_vocab: usize,
        target_fp: u64,
        drafter_fp: u64,
    },

    #[error("prompt has {prompt} tokens but the context of `{model}` holds {context}, with room for at least one new token needed")]
    PromptTooLong {
        model: String,
        prompt: usize,
        context: usize,
    },

    #[error("drafter broke its contract: {0}")]
    Drafter(String),

    #[error("empty prompt: at least one token is needed to start generation")]
    EmptyPrompt,

    #[error("{path}: {message}")]
    Config { path: String, message: String },

    #[error("invalid sampling setting: {0}")]
    Sampling(String),

    #[error("{0}")]
    Plan(String),

    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// A failure inside candle, its backtrace stripped (see [`Error::candle_message`]).
    #[error("model computation failed: {0}")]
    Compute(String),

    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A configuration error at a TOML path such as `drafters.small.k`.
    pub fn config(path: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl Error {
    /// The message of a candle error without the backtrace candle attaches when
    /// `RUST_BACKTRACE` is set: users see what went wrong, not a stack dump.
    pub fn candle_message(e: candle_core::Error) -> String {
        match e {
            candle_core::Error::WithBacktrace { inner, .. } => Self::candle_message(*inner),
            candle_core::Error::Context { inner, context } => {
                format!("{context}: {}", Self::candle_message(*inner))
            }
            e => e.to_string(),
        }
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Compute(Self::candle_message(e))
    }
}
