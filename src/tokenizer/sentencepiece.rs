//! SentencePiece vocabularies as GGUF stores them (`tokenizer.ggml.model = "llama"`), for
//! the Gemma family: a BPE tokenizer whose merges are recovered from the vocabulary.
//!
//! The file lists tokens, scores and token types but no merges. A SentencePiece BPE merges,
//! at every step, the adjacent pair whose concatenation is the best-ranked token; that is a
//! BPE whose merge list holds every split of every token into two tokens, in the tokens'
//! rank order. Gemma ranks its tokens by their order in the file (its scores do not follow
//! the merge order). Spaces are written `▁` before merging and no space is prepended; a
//! character outside the vocabulary falls back to its UTF-8 bytes (`<0x..>` tokens). Control
//! tokens (`<start_of_turn>`) are matched whole as special tokens, user-defined ones (`\n`,
//! `<table>`) whole as plain text; Gemma's tokens of two or more spaces are stored with real
//! spaces but looked up as `▁` runs, so they are respelled and left to the merges. This
//! follows how Hugging Face transformers builds the tokenizer of a Gemma GGUF, and gives its
//! token ids (a test compares them).

use crate::error::{Error, Result};
use crate::model::gguf::GgufFile;
use candle_core::quantized::gguf_file::Value;
use std::cmp::Reverse;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

/// How SentencePiece writes a space.
const SPACE: &str = "\u{2581}";

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: i64 = 3;
pub(super) const USER_DEFINED: i64 = 4;

/// The tokenizer of `gguf`, whose `tokenizer.ggml.model` is `llama` (SentencePiece).
pub fn from_gguf(gguf: &GgufFile<'_>) -> Result<tokenizers::Tokenizer> {
    let arch = gguf.string("general.architecture")?;
    if !arch.starts_with("gemma") {
        return Err(fail(
            gguf,
            format!(
                "a SentencePiece vocabulary (tokenizer model `llama`) is read for Gemma models only, \
                 not `{arch}`; give the model's tokenizer.json instead (`tokenizer = ...` in the config)"
            ),
        ));
    }
    let tokens: Vec<String> = array(gguf, "tokenizer.ggml.tokens")?
        .iter()
        .map(|v| v.to_string().cloned())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            fail(
                gguf,
                "`tokenizer.ggml.tokens` holds a value that is not a string".into(),
            )
        })?;
    let types: Vec<i64> = array(gguf, "tokenizer.ggml.token_type")?
        .iter()
        .map(integer)
        .collect::<Option<_>>()
        .filter(|t: &Vec<i64>| t.len() == tokens.len())
        .ok_or_else(|| {
            fail(
                gguf,
                "`tokenizer.ggml.token_type` does not hold one integer per token".into(),
            )
        })?;
    // Runs of spaces as the normalizer writes them.
    let tokens: Vec<String> = tokens
        .into_iter()
        .map(|t| match t.len() > 1 && t.bytes().all(|b| b == b' ') {
            true => SPACE.repeat(t.len()),
            false => t,
        })
        .collect();
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .rev() // a token listed twice keeps its first id
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let unk = token_name(gguf, &tokens, "tokenizer.ggml.unknown_token_id")?;
    // Text the merges cannot spell falls back to byte tokens, or to the unknown token; with
    // neither, it would be dropped from the prompt without a word.
    let bytes = (0..=255u8).all(|b| vocab.contains_key(&format!("<0x{b:02X}>")));
    if !bytes && unk.is_none() {
        return Err(fail(
            gguf,
            "the vocabulary has neither the 256 byte tokens <0x00>..<0xFF> nor an unknown token"
                .into(),
        ));
    }
    // Each split of a token hashes its two pieces: a vocabulary of many long tokens would take
    // hours to load.
    let hashed: usize = tokens
        .iter()
        .map(|t| t.len().min(MAX_MERGED + 1).pow(2))
        .sum();
    if hashed > MERGE_BUDGET {
        return Err(fail(
            gguf,
            format!(
                "its {} tokens are too long to rebuild the merges from",
                tokens.len()
            ),
        ));
    }
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab.clone(), merges(&tokens, &vocab))
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let model = builder.build().map_err(|e| fail(gguf, e.to_string()))?;
    let mut t = tokenizers::Tokenizer::new(model);
    let replace = |from: &str, to: &str| Replace::new(from, to).expect("a plain string pattern");
    t.with_normalizer(Some(replace(" ", SPACE)))
        .map_err(|e| fail(gguf, e.to_string()))?;
    t.with_decoder(Some(Sequence::new(vec![
        replace(SPACE, " ").into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ])));
    // Matched whole in the text as written (a respelled space run is not: it is left to the
    // merges).
    let whole = |ty: i64, special: bool| -> Vec<AddedToken> {
        types
            .iter()
            .zip(&tokens)
            .filter(|(&t, name)| t == ty && !name.contains(SPACE))
            .map(|(_, name)| AddedToken::from(name.clone(), special).normalized(false))
            .collect()
    };
    let (control, user) = (whole(CONTROL, true), whole(USER_DEFINED, false));
    let added = t
        .add_special_tokens(control)
        .and_then(|_| t.add_tokens(user));
    added.map_err(|e| {
        fail(
            gguf,
            format!("cannot add the control and user-defined tokens: {e}"),
        )
    })?;
    let add_bos = match gguf.get("tokenizer.ggml.add_bos_token") {
        Some(v) => v.to_bool().unwrap_or(true),
        None => true,
    };
    let bos = token_name(gguf, &tokens, "tokenizer.ggml.bos_token_id")?;
    if let (true, Some(bos)) = (add_bos, bos) {
        let id = gguf.usize("tokenizer.ggml.bos_token_id")? as u32;
        let cannot = |e: String| fail(gguf, format!("cannot add `{bos}` to encodings: {e}"));
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .map_err(cannot)?
            .special_tokens(vec![(bos.clone(), id)])
            .build()
            .map_err(|e| cannot(e.to_string()))?;
        t.with_post_processor(Some(template));
    }
    Ok(t)
}

/// Longest token (in bytes) built by merges: a split costs a hash of the token, so a file with
/// huge tokens would take hours to load; real vocabularies stay far below (Gemma 3: 93 bytes,
/// a run of 31 spaces respelled).
const MAX_MERGED: usize = 1024;

/// Most bytes hashed while rebuilding the merges (about a second; Gemma 3 needs 1/40 of it).
const MERGE_BUDGET: usize = 1 << 30;

/// Every split of every token into two tokens, in the order SentencePiece merges them: by
/// the token's position in the vocabulary, then the longer left piece first.
fn merges(tokens: &[String], vocab: &Vocab) -> Vec<(String, String)> {
    let mut merges: Vec<(usize, Reverse<usize>, &str, &str)> = Vec::new();
    for (rank, token) in tokens.iter().enumerate() {
        if vocab.get(token) != Some(&(rank as u32)) || token.len() > MAX_MERGED {
            continue; // a duplicate, or too long to build
        }
        let chars: Vec<usize> = token.char_indices().map(|(i, _)| i).skip(1).collect();
        for (split, &at) in chars.iter().enumerate() {
            let (left, right) = token.split_at(at);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                merges.push((rank, Reverse(split), left, right));
            }
        }
    }
    merges.sort_unstable();
    merges
        .into_iter()
        .map(|(_, _, l, r)| (l.to_string(), r.to_string()))
        .collect()
}

/// The array at `key`.
fn array<'a>(gguf: &'a GgufFile<'_>, key: &str) -> Result<&'a [Value]> {
    match gguf.get(key) {
        Some(Value::Array(values)) => Ok(values),
        _ => Err(fail(
            gguf,
            format!("metadata `{key}` is missing or not an array"),
        )),
    }
}

pub(super) fn integer(v: &Value) -> Option<i64> {
    match *v {
        Value::I32(x) => Some(x as i64),
        Value::U32(x) => Some(x as i64),
        Value::I8(x) => Some(x as i64),
        Value::U8(x) => Some(x as i64),
        Value::I16(x) => Some(x as i64),
        Value::U16(x) => Some(x as i64),
        Value::I64(x) => Some(x),
        Value::U64(x) => i64::try_from(x).ok(),
        _ => None,
    }
}

/// The token whose id is at `key`, if the key is there; an id outside the vocabulary fails.
fn token_name(gguf: &GgufFile<'_>, tokens: &[String], key: &str) -> Result<Option<String>> {
    if gguf.get(key).is_none() {
        return Ok(None);
    }
    let id = gguf.usize(key)?;
    match tokens.get(id) {
        Some(t) => Ok(Some(t.clone())),
        None => Err(fail(
            gguf,
            format!(
                "metadata `{key}` is {id}, outside the {} tokens",
                tokens.len()
            ),
        )),
    }
}

fn fail(gguf: &GgufFile<'_>, reason: String) -> Error {
    Error::Tokenizer(format!("cannot load {}: {reason}", gguf.path.display()))
}
