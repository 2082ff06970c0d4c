//! Bigram tables: for each token, its most likely successors with their probabilities.
//!
//! Built from a corpus with a given tokenizer and stored in a small versioned binary format
//! that carries the tokenizer's fingerprint, so a table is never used with another vocabulary.
//!
//! File layout (little-endian):
//! `b"CSBIGRAM"`, version `u32`, tokenizer fingerprint `u64`, vocabulary size `u32`,
//! entries `u32`, then `offsets: [u32; vocab + 1]`, `next: [u32; entries]`,
//! `probs: [f32; entries]`, and an FxHash-64 checksum `u64` of everything before it.
//! The successors of token `t` are `next[offsets[t]..offsets[t + 1]]`, most likely first.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use fxhash::FxHashMap;
use std::hash::Hasher;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"CSBIGRAM";
const VERSION: u32 = 1;

/// A bigram table in compressed sparse rows.
#[derive(Clone, Debug, PartialEq)]
pub struct BigramTable {
    fingerprint: u64,
    offsets: Vec<u32>,
    next: Vec<u32>,
    probs: Vec<f32>,
}

impl BigramTable {
    /// Builds a table from bigram `counts` over `vocab` tokens, keeping the `top` most
    /// frequent successors of each token (ties to the lower id). Probabilities are relative
    /// to all of a token's successors in the corpus, so a row sums to at most 1.
    pub fn from_counts(
        counts: &FxHashMap<(u32, u32), u32>,
        vocab: usize,
        top: usize,
        fingerprint: u64,
    ) -> Self {
        let mut rows: Vec<Vec<(u32, u32)>> = vec![Vec::new(); vocab];
        for (&(a, b), &c) in counts {
            if (a as usize) < vocab {
                rows[a as usize].push((b, c));
            }
        }
        let (mut offsets, mut next, mut probs) = (vec![0u32], Vec::new(), Vec::new());
        for row in &mut rows {
            let total: u64 = row.iter().map(|&(_, c)| c as u64).sum();
            row.sort_unstable_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
            for &(b, c) in row.iter().take(top) {
                next.push(b);
                probs.push((c as f64 / total as f64) as f32);
            }
            offsets.push(next.len() as u32);
        }
        Self {
            fingerprint,
            offsets,
            next,
            probs,
        }
    }

    /// The most likely successors of `token` and their probabilities, most likely first.
    pub fn successors(&self, token: u32) -> (&[u32], &[f32]) {
        let t = token as usize;
        if t + 1 >= self.offsets.len() {
            return (&[], &[]);
        }
        let (a, b) = (self.offsets[t] as usize, self.offsets[t + 1] as usize);
        (&self.next[a..b], &self.probs[a..b])
    }

    /// The single most likely successor of `token`, if the corpus had one.
    pub fn most_likely(&self, token: u32) -> Option<u32> {
        self.successors(token).0.first().copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn entries(&self) -> usize {
        self.next.len()
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Refuses a table built with another tokenizer.
    pub fn check_tokenizer(&self, tokenizer: &Tokenizer, path: &Path) -> Result<()> {
        if self.fingerprint != tokenizer.fingerprint() {
            return Err(bad_table(
                path,
                format!(
                    "built for another tokenizer (fingerprint {:016x}, the model's is {:016x}); \
                     rebuild it with `cascade ngram build`",
                    self.fingerprint,
                    tokenizer.fingerprint()
                ),
            ));
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(36 + 4 * (self.offsets.len() + 2 * self.next.len()));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.to_le_bytes());
        out.extend_from_slice(&(self.vocab_size() as u32).to_le_bytes());
        out.extend_from_slice(&(self.next.len() as u32).to_le_bytes());
        self.offsets
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.next
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.probs
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        let sum = checksum(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Parses a table; `path` names it in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |reason: &str| bad_table(path, reason.to_string());
        if bytes.len() < 36 || &bytes[..8] != MAGIC {
            return Err(bad("not a bigram table (bad magic)"));
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad_table(
                path,
                format!("format version {version}, this build reads {VERSION}"),
            ));
        }
        let fingerprint = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
        let (vocab, entries) = (u32_at(20) as usize, u32_at(24) as usize);
        let expected = 28 + 4 * (vocab + 1) + 8 * entries + 8;
        if bytes.len() != expected {
            return Err(bad_table(
                path,
                format!(
                    "truncated or corrupt: {} bytes, the header implies {expected}",
                    bytes.len()
                ),
            ));
        }
        let body = &bytes[..expected - 8];
        if checksum(body) != u64::from_le_bytes(bytes[expected - 8..].try_into().unwrap()) {
            return Err(bad("corrupt: checksum mismatch"));
        }
        let words = |from: usize, n: usize| (0..n).map(move |i| u32_at(from + 4 * i));
        let offsets: Vec<u32> = words(28, vocab + 1).collect();
        let next: Vec<u32> = words(28 + 4 * (vocab + 1), entries).collect();
        let probs = words(28 + 4 * (vocab + 1 + entries), entries)
            .map(f32::from_bits)
            .collect();
        if offsets.windows(2).any(|w| w[0] > w[1]) || offsets[vocab] as usize != entries {
            return Err(bad("corrupt: row offsets out of order"));
        }
        Ok(Self {
            fingerprint,
            offsets,
            next,
            probs,
        })
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes())
            .map_err(|e| bad_table(path, format!("cannot write: {e}")))
    }

    pub fn load(path: &Path) -> Result<Self> {
        let bytes =
            std::fs::read(path).map_err(|e| bad_table(path, format!("cannot read: {e}")))?;
        Self::from_bytes(&bytes, path)
    }
}

fn bad_table(path: &Path, reason: String) -> Error {
    Error::NgramTable {
        path: path.to_path_buf(),
        reason,
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut h = fxhash::FxHasher64::default();
    h.write(bytes);
    h.finish()
}

/// Counts the bigrams of a corpus, file by file.
pub struct BigramCounter<'a> {
    tokenizer: &'a Tokenizer,
    pub counts: FxHashMap<(u32, u32), u32>,
    pub tokens: u64,
}

impl<'a> BigramCounter<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            counts: FxHashMap::default(),
            tokens: 0,
        }
    }

    /// Tokenizes `text` (without special tokens) and counts its bigrams.
    pub fn add_text(&mut self, text: &str) -> Result<()> {
        let ids = self.tokenizer.encode_plain(text)?;
        self.tokens += ids.len() as u64;
        for w in ids.windows(2) {
            *self.counts.entry((w[0], w[1])).or_insert(0) += 1;
        }
        Ok(())
    }

    pub fn into_table(self, top: usize) -> BigramTable {
        BigramTable::from_counts(
            &self.counts,
            self.tokenizer.vocab_size(),
            top,
            self.tokenizer.fingerprint(),
        )
    }
}

/// Files under `roots` (files, or folders searched recursively) whose extension is in
/// `extensions` (all files if empty), in a stable order.
pub fn corpus_files(roots: &[PathBuf], extensions: &[String]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut stack: Vec<PathBuf> = roots.to_vec();
    while let Some(p) = stack.pop() {
        let meta = std::fs::metadata(&p).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", p.display()),
            ))
        })?;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&p)? {
                stack.push(entry?.path());
            }
        } else if extensions.is_empty()
            || p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| extensions.iter().any(|x| x == e))
        {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> BigramTable {
        let mut counts = FxHashMap::default();
        for (a, b, c) in [(1, 2, 5), (1, 3, 3), (1, 4, 3), (1, 5, 1), (2, 1, 7)] {
            counts.insert((a, b), c);
        }
        BigramTable::from_counts(&counts, 8, 3, 0xabc)
    }

    #[test]
    fn rows_keep_the_top_successors_with_ties_to_lower_ids() {
        let t = table();
        let (next, probs) = t.successors(1);
        assert_eq!(next, &[2, 3, 4]);
        assert_eq!(probs, &[5.0 / 12.0, 3.0 / 12.0, 3.0 / 12.0]);
        assert_eq!(t.most_likely(2), Some(1));
        assert_eq!(t.most_likely(7), None);
        assert_eq!(t.successors(1000), (&[][..], &[][..]));
    }

    #[test]
    fn round_trip_and_damage_detection() {
        let t = table();
        let p = Path::new("t.bigram");
        let bytes = t.to_bytes();
        assert_eq!(BigramTable::from_bytes(&bytes, p).unwrap(), t);
        let e = BigramTable::from_bytes(&bytes[..bytes.len() - 3], p)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("bigram table t.bigram: truncated or corrupt: "),
            "{e}"
        );
        let mut flipped = bytes.clone();
        flipped[40] ^= 1;
        let e = BigramTable::from_bytes(&flipped, p)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "bigram table t.bigram: corrupt: checksum mismatch");
        let e = BigramTable::from_bytes(b"GGUF....", p)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "bigram table t.bigram: not a bigram table (bad magic)");
    }
}
