//! Tokenizers: built from the GGUF's embedded vocabulary, or read from a `tokenizer.json`.

mod sentencepiece;

use crate::error::{Error, Result};
use crate::model::gguf::GgufFile;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use std::hash::Hasher;
use std::path::Path;

/// Token names that end a turn or a document in the model families we load.
const END_TOKENS: [&str; 6] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
];

/// GGUF keys of tokens that end generation: the end of the sequence, of a turn, of a message.
const END_KEYS: [&str; 3] = [
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
];

/// A tokenizer with the model-level facts generation needs: end-of-sequence ids,
/// the chat template, and a fingerprint of the vocabulary for compatibility checks.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos: Vec<u32>,
    chat_template: Option<String>,
    bos_token: Option<String>,
    bos_id: Option<u32>,
    eos_token: Option<String>,
    /// Ids decoding leaves out (sorted): control tokens, not user-defined ones.
    hidden: Vec<u32>,
    fingerprint: u64,
}

impl Tokenizer {
    /// The tokenizer of a GGUF model: from `tokenizer_json` if given, else from the GGUF itself.
    pub fn load(gguf: &GgufFile<'_>, tokenizer_json: Option<&Path>) -> Result<Self> {
        let inner = match tokenizer_json {
            Some(p) => tokenizers::Tokenizer::from_file(p)
                .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", p.display())))?,
            None if gguf.string("tokenizer.ggml.model").ok().as_deref() == Some("llama") => {
                sentencepiece::from_gguf(gguf)?
            }
            None => byte_level_bpe(gguf)?,
        };
        let vocab = inner.get_vocab_size(true);
        // A token id of the metadata, if the key is there; one outside the vocabulary fails.
        let token_id = |key: &str| -> Result<Option<u32>> {
            if gguf.get(key).is_none() {
                return Ok(None);
            }
            match gguf.usize(key)? {
                id if id < vocab => Ok(Some(id as u32)),
                id => Err(Error::Tokenizer(format!(
                    "cannot load {}: metadata `{key}` is {id}, outside the vocabulary ({vocab} tokens)",
                    gguf.path.display()
                ))),
            }
        };
        let eos_token = token_id(END_KEYS[0])?.and_then(|id| inner.id_to_token(id));
        let mut eos = Vec::new();
        for key in END_KEYS {
            eos.extend(token_id(key)?);
        }
        eos.extend(END_TOKENS.iter().filter_map(|t| inner.token_to_id(t)));
        eos.sort_unstable();
        eos.dedup();
        let bos_id = token_id("tokenizer.ggml.bos_token_id")?;
        let bos_token = bos_id.and_then(|id| inner.id_to_token(id));
        let chat_template = gguf.string("tokenizer.chat_template").ok();
        // candle registers every non-normal GGUF token as special; user-defined ones (Qwen's
        // `<tool_call>`) are text the model writes, which Hugging Face's decoding keeps.
        let shown = match tokenizer_json {
            Some(_) => Vec::new(),
            None => user_defined(gguf),
        };
        let mut t = Self::from_parts(inner, eos);
        t.hidden.retain(|id| shown.binary_search(id).is_err());
        t.chat_template = chat_template;
        t.bos_token = bos_token;
        t.bos_id = bos_id;
        t.eos_token = eos_token;
        Ok(t)
    }

    /// The tokenizer in `path`: a `tokenizer.json`, or a GGUF model's embedded one.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "json") {
            let inner = tokenizers::Tokenizer::from_file(path)
                .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", path.display())))?;
            Ok(Self::from_parts(inner, Vec::new()))
        } else {
            Self::load(&GgufFile::open(path)?, None)
        }
    }

    /// Wraps a `tokenizers::Tokenizer` directly (synthetic vocabularies in tests, plug-ins):
    /// `eos` lists the end-of-sequence ids.
    pub fn from_parts(inner: tokenizers::Tokenizer, eos: Vec<u32>) -> Self {
        let fingerprint = fingerprint(&inner, inner.get_vocab_size(true));
        let mut hidden: Vec<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        hidden.sort_unstable();
        Self {
            inner,
            eos,
            chat_template: None,
            bos_token: None,
            bos_id: None,
            eos_token: None,
            hidden,
            fingerprint,
        }
    }

    /// Encodes `text`, with the special tokens the tokenizer adds (BOS), but one BOS only: a
    /// text that starts with it already (a chat template's `bos_token`, as Llama 3's) is not
    /// given a second, which the model never saw in training.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        let ids = enc.get_ids();
        match (self.bos_id, ids) {
            (Some(b), [x, y, ..]) if *x == b && *y == b => Ok(ids[1..].to_vec()),
            _ => Ok(ids.to_vec()),
        }
    }

    /// Encodes `text` as plain text: no BOS or other special tokens added.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids`, special tokens omitted (control tokens; user-defined ones are text).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let shown: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| self.hidden.binary_search(id).is_err())
            .collect();
        self.inner
            .decode(&shown, false)
            .map_err(|e| Error::Tokenizer(format!("decoding failed: {e}")))
    }

    /// Whether `id` ends a sequence.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// The end-of-sequence ids.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// The chat template from the GGUF, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The same tokenizer with another chat template (Jinja, as in Hugging Face's
    /// `tokenizer_config.json`).
    pub fn with_chat_template(mut self, template: impl Into<String>) -> Self {
        self.chat_template = Some(template.into());
        self
    }

    /// The beginning-of-sequence token's text, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The end-of-sequence token's text (the GGUF's `eos_token_id`), if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Number of tokens, special ones included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A hash of every (id, token) pair: equal fingerprints mean the same ids mean the same text.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The [`Tokenizer::fingerprint`] of the first `n` ids alone (all of them if `n` is the
    /// vocabulary's size): whether a smaller vocabulary is this one's beginning.
    pub fn fingerprint_of_first(&self, n: usize) -> u64 {
        match n == self.vocab_size() {
            true => self.fingerprint,
            false => fingerprint(&self.inner, n.min(self.vocab_size())),
        }
    }
}

/// How a byte-level BPE vocabulary splits text before merging, by llama.cpp's name for it
/// (`tokenizer.ggml.pre`). candle builds Qwen 2's and Llama 3's splits under its own names;
/// for any other name it falls back to GPT-2's split with a space added before every text,
/// which none of these models was trained with, so the others are built here and an unknown
/// name is refused rather than guessed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Split {
    /// One of candle's pipelines, by candle's name.
    Candle(&'static str),
    /// GPT-2's regular expression, no space added.
    Gpt2,
    /// Every digit apart, then GPT-2's split (SmolLM, StarCoder).
    DigitsThenGpt2,
}

/// The llama.cpp names [`split`] knows, for the error that lists them.
const KNOWN_SPLITS: &str =
    "qwen2, deepseek-r1-qwen, llama-bpe, llama3, smaug-bpe, gpt-2, gpt2, smollm, starcoder, refact";

fn split(pre: &str) -> Option<Split> {
    Some(match pre {
        "qwen2" | "deepseek-r1-qwen" => Split::Candle("qwen2"),
        "llama-bpe" | "llama3" | "smaug-bpe" => Split::Candle("llama3"),
        "gpt-2" | "gpt2" => Split::Gpt2,
        "smollm" | "starcoder" | "refact" => Split::DigitsThenGpt2,
        _ => return None,
    })
}

/// The byte-level BPE tokenizer of a GGUF (`tokenizer.ggml.model = gpt2`), split as its
/// `tokenizer.ggml.pre` says.
/// The GGUF key of the tokens' types (`llama_token_type`).
const TYPES: &str = "tokenizer.ggml.token_type";
/// The type of a token no text should produce.
const UNUSED: i64 = 5;

fn byte_level_bpe(gguf: &GgufFile<'_>) -> Result<tokenizers::Tokenizer> {
    use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence};
    const KEY: &str = "tokenizer.ggml.pre";
    let fail =
        |why: String| Error::Tokenizer(format!("cannot load {}: {why}", gguf.path.display()));
    let kind = gguf.string("tokenizer.ggml.model").unwrap_or_default();
    if kind != "gpt2" {
        return Err(fail(format!(
            "unsupported tokenizer model `{kind}` (cascade builds `gpt2`, and `llama` for \
             Gemma); give the model's tokenizer.json (`tokenizer = ...` in the config)"
        )));
    }
    let pre = gguf.string(KEY).map_err(|_| {
        fail(format!(
            "it names no pre-tokenizer (`{KEY}`), so how it splits text is unknown; give the \
             model's tokenizer.json (`tokenizer = ...` in the config)"
        ))
    })?;
    let split = split(&pre).ok_or_else(|| {
        fail(format!(
            "its pre-tokenizer `{pre}` (`{KEY}`) is not one cascade builds ({KNOWN_SPLITS}); \
             give the model's tokenizer.json (`tokenizer = ...` in the config)"
        ))
    })?;
    // What candle reads differently, in a copy of the metadata: the pre-tokenizer by its own
    // name, and unused tokens (type 5, Qwen's 271 `[PAD151665]`...) as normal ones. candle
    // registers every non-normal token as special, which text then matches: `[PAD151700]` in
    // a message would become that untrained token, where transformers and llama.cpp read it
    // as text.
    let c = &gguf.content;
    let mut metadata = std::borrow::Cow::Borrowed(&c.metadata);
    match split {
        Split::Candle(name) if name != pre => {
            let name = Value::String(name.into());
            metadata.to_mut().insert(KEY.into(), name);
        }
        _ => {}
    }
    if let Some(Value::Array(types)) = c.metadata.get(TYPES) {
        if types
            .iter()
            .any(|t| sentencepiece::integer(t) == Some(UNUSED))
        {
            let normal = types
                .iter()
                .map(|t| match sentencepiece::integer(t) == Some(UNUSED) {
                    true => Value::I32(1),
                    false => t.clone(),
                })
                .collect();
            metadata.to_mut().insert(TYPES.into(), Value::Array(normal));
        }
    }
    let copy = match metadata {
        std::borrow::Cow::Borrowed(_) => None,
        std::borrow::Cow::Owned(metadata) => Some(Content {
            magic: c.magic,
            metadata,
            tensor_infos: Default::default(),
            tensor_data_offset: c.tensor_data_offset,
        }),
    };
    let mut t = tokenizers::Tokenizer::from_gguf(copy.as_ref().unwrap_or(c))
        .map_err(|e| fail(Error::candle_message(e)))?;
    // GPT-2's regular expression, without the space candle's fallback adds.
    let gpt2 = ByteLevel::new(false, true, true);
    match split {
        Split::Candle(_) => {}
        Split::Gpt2 => {
            t.with_pre_tokenizer(Some(gpt2));
        }
        Split::DigitsThenGpt2 => {
            t.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                gpt2.into(),
            ])));
        }
    }
    Ok(t)
}

/// The ids a GGUF marks user-defined (sorted).
fn user_defined(gguf: &GgufFile<'_>) -> Vec<u32> {
    match gguf.get(TYPES) {
        Some(candle_core::quantized::gguf_file::Value::Array(types)) => (0u32..)
            .zip(types)
            .filter(|(_, t)| sentencepiece::integer(t) == Some(sentencepiece::USER_DEFINED))
            .map(|(id, _)| id)
            .collect(),
        _ => Vec::new(),
    }
}

/// The hash of the first `n` (id, token) pairs of `t`.
fn fingerprint(t: &tokenizers::Tokenizer, n: usize) -> u64 {
    let mut h = fxhash::FxHasher64::default();
    for id in 0..n as u32 {
        h.write_u32(id);
        if let Some(tok) = t.id_to_token(id) {
            h.write(tok.as_bytes());
        }
        h.write_u8(0xff);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::AddedToken;

    #[test]
    fn a_text_that_starts_with_bos_gets_no_second_one() {
        let words = [("<s>", 0), ("hi", 1), ("there", 2)];
        let model = WordLevel::builder()
            .vocab(words.iter().map(|&(w, i)| (w.to_string(), i)).collect())
            .unk_token("hi".into())
            .build()
            .unwrap();
        let mut inner = tokenizers::Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
        inner
            .add_special_tokens([AddedToken::from("<s>", true)])
            .unwrap();
        let bos = TemplateProcessing::builder()
            .try_single("<s> $A")
            .unwrap()
            .special_tokens(vec![("<s>", 0)])
            .build()
            .unwrap();
        inner.with_post_processor(Some(bos));
        let mut t = Tokenizer::from_parts(inner, Vec::new());
        assert_eq!(t.encode("<s> hi there").unwrap(), [0, 0, 1, 2]);
        t.bos_id = Some(0);
        assert_eq!(t.encode("hi there").unwrap(), [0, 1, 2]);
        assert_eq!(t.encode("<s> hi there").unwrap(), [0, 1, 2]);
        assert_eq!(t.encode_plain("<s> hi").unwrap(), [0, 1]);
    }
}
