//! The library's error type: one enum, each message naming the offending value.

use std::path::PathBuf;

/// Everything that can go wrong in the library. The binary wraps these in `anyhow`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file does not exist.
    #[error("model {}", crate::files::not_a_file(.0))]
    ModelNotFound(PathBuf),

    #[error("cannot read GGUF file {}: {reason}", path.display())]
    /// A GGUF file that cannot be read: malformed, truncated or inconsistent.
    BadModelFile {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key, tensor or byte offset.
        reason: String,
    },

    #[error("unsupported model architecture `{arch}` in {} (supported: qwen2, llama, gemma3)", path.display())]
    /// A GGUF file of an architecture the transformer does not implement.
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// Its `general.architecture`.
        arch: String,
    },

    #[error("cannot resolve model {repo}/{file}: {reason}")]
    /// A model named by Hugging Face repo that cannot be found.
    Hub {
        /// The repository.
        repo: String,
        /// The file in it.
        file: String,
        /// Why it cannot be resolved.
        reason: String,
    },

    #[error("bigram table {}: {reason}", path.display())]
    /// A bigram table that cannot be read or written.
    NgramTable {
        /// The table's file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A Max-Gram history file that cannot be read, checked or written.
    #[error("Max-Gram history {}: {reason}", path.display())]
    History {
        /// The history's file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A tokenizer that cannot be loaded, or text it cannot encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error(
        "vocabulary mismatch: drafter `{drafter}` ({drafter_vocab} tokens, fingerprint {drafter_fp:016x}) \
         cannot draft for `{target}` ({target_vocab} tokens, fingerprint {target_fp:016x}); \
         a drafter must use its reviewer's tokenizer (or its first ids)"
    )]
    /// A drafter (model, reviewer or table) whose vocabulary is not its reviewer's: the
    /// target's, or that of the vertical cascade's reviewer it drafts for (named `target`
    /// here too).
    VocabMismatch {
        /// The reviewer's name.
        target: String,
        /// The drafter's name.
        drafter: String,
        /// The reviewer's vocabulary size.
        target_vocab: usize,
        /// The drafter's vocabulary size.
        drafter_vocab: usize,
        /// The reviewer's vocabulary fingerprint (of as many ids as the drafter has).
        target_fp: u64,
        /// The drafter's vocabulary fingerprint.
        drafter_fp: u64,
    },

    #[error("prompt has {prompt} tokens but the context of `{model}` holds {context}, with room for at least one new token needed")]
    /// A prompt that leaves no room in the context for a new token.
    PromptTooLong {
        /// The model whose context is too short.
        model: String,
        /// The prompt's length in tokens.
        prompt: usize,
        /// The context's length in tokens.
        context: usize,
    },

    /// A drafter that proposed out-of-vocabulary tokens, other than the tokens it was
    /// admitted, or tokens its reported distributions could not draw.
    #[error("drafter broke its contract: {0}")]
    Drafter(String),

    /// A plug-in drafter's own failure (a lookup service down, a file it reads damaged),
    /// named by the drafter.
    #[error("drafter `{drafter}` failed: {message}")]
    DrafterFailed {
        /// The drafter's name.
        drafter: String,
        /// What went wrong.
        message: String,
    },

    /// A prompt of no tokens.
    #[error("empty prompt: at least one token is needed to start generation")]
    EmptyPrompt,

    #[error("{path}: {message}")]
    /// A configuration value out of range or inconsistent.
    Config {
        /// The TOML path (or file) of the value.
        path: String,
        /// What was expected.
        message: String,
    },

    /// A sampling setting out of range.
    #[error("invalid sampling setting: {0}")]
    Sampling(String),

    /// A plan that cannot be made from the given report.
    #[error("{0}")]
    Plan(String),

    /// A chat template that is missing or cannot be rendered.
    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// A failure inside candle, its backtrace stripped (see [`Error::candle_message`]).
    #[error("model computation failed: {0}")]
    Compute(String),

    /// A file or socket operation that failed. Transparent: the I/O error's message is the
    /// message, once (a `{0}` message would repeat it as its own cause).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The library's result type.
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
