//! Earlier outputs, kept on disk and searched by suffix: Max-Gram's memory across runs.
//!
//! Agents, editors and batch jobs ask for the same kind of text again and again, and much of
//! an answer repeats an earlier one (SuffixDecoding, arXiv 2411.04975, drafts from a tree
//! over earlier outputs for this reason). A [`History`] keeps the most recent outputs, up to a
//! bound in tokens, and finds the longest earlier occurrence of the text's suffix in them,
//! with how often each continuation followed it. Max-Gram consults it beside the text itself
//! ([`super::MaxGramDrafter::with_history`]).
//!
//! In memory: the outputs, each followed by a separator, and a suffix array over them (every
//! position, sorted by the tokens from there, compared over `max_ngram + 1` tokens), so a
//! lookup is a few binary searches whatever the size.
//!
//! File layout (little-endian): `b"CSHISTRY"`, version `u32`, tokenizer fingerprint `u64`,
//! vocabulary size `u32`, token count `u32`, the tokens (`u32` each, outputs separated by
//! `u32::MAX`), and the CRC-32 (`u32`) of everything before it. Reading checks the length
//! against the file size before allocating, the checksum, then the tokenizer (a file for
//! another one is refused) and every token id. Writing goes to a temporary file renamed over
//! the old one.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

const MAGIC: &[u8; 8] = b"CSHISTRY";
const VERSION: u32 = 1;
/// Ends every output in the token store (never a token id).
const SEP: u32 = u32::MAX;
/// Occurrences scanned for the most frequent continuation: of more, an evenly spaced sample.
const SCANNED: usize = 4096;

/// The most recent outputs, searchable by suffix.
pub struct History {
    path: PathBuf,
    fingerprint: u64,
    vocab: usize,
    capacity: usize,
    max_ngram: usize,
    /// The outputs, oldest first, each followed by [`SEP`].
    tokens: Vec<u32>,
    /// Positions of `tokens` that start with a token, sorted by the tokens from there.
    suffixes: Vec<u32>,
}

/// A [`History`] as the Max-Gram nodes of one tree hold it: every node that names the file
/// reads the same one, and only the first records, so each output goes in once.
#[derive(Clone)]
pub struct SharedHistory {
    history: Arc<Mutex<History>>,
    records: bool,
}

impl SharedHistory {
    /// Another node's view of the same history: it reads, but does not record.
    pub fn reader(&self) -> Self {
        Self {
            history: self.history.clone(),
            records: false,
        }
    }

    /// The history (a panic elsewhere leaves it whole: every change is made before saving).
    pub fn lock(&self) -> MutexGuard<'_, History> {
        self.history.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `output` if this view is the recording one ([`History::record`]).
    pub fn record(&self, output: &[u32]) -> Result<()> {
        match self.records {
            true => self.lock().record(output),
            false => Ok(()),
        }
    }
}

impl From<History> for SharedHistory {
    fn from(history: History) -> Self {
        Self {
            history: Arc::new(Mutex::new(history)),
            records: true,
        }
    }
}

/// Where an earlier output continues the text's suffix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HistoryMatch {
    /// Length of the matched suffix.
    pub len: usize,
    /// Where the continuation starts in the token store.
    pub at: usize,
    /// The continuation's share of the occurrences of the matched suffix.
    pub share: f32,
}

impl History {
    /// The history in `path` for a tokenizer with `fingerprint` and `vocab` tokens, keeping at
    /// most `capacity` tokens and matching suffixes of up to `max_ngram` tokens. A missing
    /// or empty file is an empty history (written on the first [`History::record`]); a
    /// damaged one, or one for another tokenizer, is an error naming it.
    pub fn open(
        path: &Path,
        fingerprint: u64,
        vocab: usize,
        capacity: usize,
        max_ngram: usize,
    ) -> Result<Self> {
        let tokens = read(path, fingerprint, vocab)?.unwrap_or_default();
        let mut history = Self {
            path: path.to_path_buf(),
            fingerprint,
            vocab,
            capacity: capacity.max(1),
            max_ngram: max_ngram.max(1),
            tokens,
            suffixes: Vec::new(),
        };
        history.evict();
        history.index();
        Ok(history)
    }

    /// The file the history lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens held (separators included).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether no output is held.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The longest suffix of `text` (up to `max_ngram` tokens) that an earlier output holds
    /// with a token after it; among its occurrences, the continuation that followed most often
    /// (ties: the most recent), copied from its most recent occurrence (counted, for a suffix
    /// that occurs more than 4,096 times, over an evenly spaced sample of them).
    pub fn best_continuation(&self, text: &[u32]) -> Option<HistoryMatch> {
        let mut best = None;
        for n in 1..=self.max_ngram.min(text.len()) {
            let pattern = &text[text.len() - n..];
            let range = self.occurrences(pattern);
            if range.is_empty() {
                break; // longer suffixes occur only where this one does
            }
            best = Some((n, range));
        }
        let (n, range) = best?;
        // Continuations are sorted within the range: count each run, in a sample spread over
        // the whole range where it is long (its start alone would hold the lowest token ids).
        // (Drafting asks every round: a short range is read in place, not copied.)
        let all = &self.suffixes[range];
        let scanned: std::borrow::Cow<[u32]> = match all.len().div_ceil(SCANNED) {
            1 => all.into(),
            step => all.iter().step_by(step).copied().collect(),
        };
        let (mut top, mut i) = (None::<(usize, usize)>, 0);
        while i < scanned.len() {
            let next = |s: &u32| self.tokens[*s as usize + n];
            let token = next(&scanned[i]);
            let run = scanned[i..].iter().take_while(|s| next(s) == token).count();
            let recent = scanned[i..i + run]
                .iter()
                .map(|&s| s as usize)
                .max()
                .unwrap();
            if top.is_none_or(|(count, at)| (run, recent) > (count, at)) {
                top = Some((run, recent));
            }
            i += run;
        }
        let (count, start) = top?;
        Some(HistoryMatch {
            len: n,
            at: start + n,
            share: count as f32 / scanned.len() as f32,
        })
    }

    /// Up to `k` tokens of the store from `at`, stopping at the end of that output.
    pub fn copy(&self, at: usize, k: usize) -> Vec<u32> {
        self.tokens[at.min(self.tokens.len())..]
            .iter()
            .take(k)
            .take_while(|&&t| t != SEP)
            .copied()
            .collect()
    }

    /// Adds `output` as the most recent, forgets the oldest outputs beyond the capacity, and
    /// writes the file. Other processes may share the file: under its lock, what they wrote
    /// since is read first and kept, so no writer drops another's outputs.
    pub fn record(&mut self, output: &[u32]) -> Result<()> {
        if output.is_empty() {
            return Ok(());
        }
        if let Some(&t) = output.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(bad(
                &self.path,
                format!(
                    "token {t} is outside the vocabulary ({} tokens)",
                    self.vocab
                ),
            ));
        }
        let _lock = self.lock()?;
        // Unless another process wrote since, the sorted positions are kept and only the new
        // output's are sorted and merged in: sorting them all anew took 113 ms at 262,144
        // tokens (AMD EPYC Zen 4), on the engine's thread after every generation.
        let merge = match read(&self.path, self.fingerprint, self.vocab)? {
            Some(tokens) if tokens != self.tokens => {
                self.tokens = tokens;
                false
            }
            _ => true,
        };
        let old = self.tokens.len();
        // An output longer than the whole capacity keeps its end.
        let keep = output.len().min(self.capacity - 1);
        self.tokens
            .extend_from_slice(&output[output.len() - keep..]);
        self.tokens.push(SEP);
        let dropped = self.evict();
        match merge {
            true => self.index_from(old - dropped, dropped),
            false => self.index(),
        }
        self.save()
    }

    /// Drops the oldest outputs until the tokens fit the capacity; returns how many tokens.
    fn evict(&mut self) -> usize {
        let mut start = 0;
        while self.tokens.len() - start > self.capacity {
            match self.tokens[start..].iter().position(|&t| t == SEP) {
                Some(p) => start += p + 1,
                None => start = self.tokens.len(),
            }
        }
        self.tokens.drain(..start);
        start
    }

    /// Sorts the positions by the `max_ngram + 1` tokens from each (a separator ends the
    /// comparison: it sorts after every token), then by position.
    fn index(&mut self) {
        self.suffixes.clear();
        self.index_from(0, 0);
    }

    /// [`History::index`] for the tokens from `new` on, merged into the positions indexed
    /// before `dropped` tokens were evicted from the front. Every output ends in a separator,
    /// which ends every comparison, so tokens added after or dropped before an output change
    /// nothing in the order of its positions.
    fn index_from(&mut self, new: usize, dropped: usize) {
        let width = self.max_ngram + 1;
        let tokens = &self.tokens;
        let key = |s: u32| {
            let s = s as usize;
            let end = (s + width).min(tokens.len());
            let stop = tokens[s..end]
                .iter()
                .position(|&t| t == SEP)
                .map_or(end, |p| s + p + 1);
            &tokens[s..stop]
        };
        let order = |a: &u32, b: &u32| key(*a).cmp(key(*b)).then(a.cmp(b));
        let mut added: Vec<u32> = (new as u32..tokens.len() as u32)
            .filter(|&s| tokens[s as usize] != SEP)
            .collect();
        added.sort_unstable_by(order);
        let kept = self
            .suffixes
            .iter()
            .filter_map(|&s| (s as usize).checked_sub(dropped).map(|s| s as u32));
        let mut merged = Vec::with_capacity(self.suffixes.len() + added.len());
        let mut added = added.into_iter().peekable();
        for s in kept {
            while let Some(a) = added.next_if(|a| order(a, &s).is_lt()) {
                merged.push(a);
            }
            merged.push(s);
        }
        merged.extend(added);
        self.suffixes = merged;
    }

    /// The positions (a range of `suffixes`) where `pattern` occurs followed by a token.
    fn occurrences(&self, pattern: &[u32]) -> std::ops::Range<usize> {
        let n = pattern.len();
        let head = |s: u32| {
            let s = s as usize;
            &self.tokens[s..(s + n).min(self.tokens.len())]
        };
        let lo = self.suffixes.partition_point(|&s| head(s) < pattern);
        let hi = lo + self.suffixes[lo..].partition_point(|&s| head(s) == pattern);
        // Occurrences ending their output (followed by the separator) sort last.
        let followed = self.suffixes[lo..hi]
            .partition_point(|&s| self.tokens.get(s as usize + n).is_some_and(|&t| t != SEP));
        lo..lo + followed
    }

    /// The history in its file format.
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + 4 * self.tokens.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.to_le_bytes());
        out.extend_from_slice(&(self.vocab as u32).to_le_bytes());
        out.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        self.tokens
            .iter()
            .for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
        let sum = crc32fast::hash(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// The file's lock (`<path>.lock`, held until dropped), waiting for another process to
    /// release it.
    fn lock(&self) -> Result<std::fs::File> {
        crate::files::lock_beside(&self.path).map_err(|e| {
            let lock = format!("{}.lock", self.path.display());
            bad(&self.path, format!("cannot lock {lock}: {e}"))
        })
    }

    /// Writes the file (atomically).
    fn save(&self) -> Result<()> {
        crate::files::write_atomically(&self.path, &self.to_bytes())
            .map_err(|e| bad(&self.path, format!("cannot write: {e}")))
    }
}

/// The tokens of the history file at `path`, checked; `None` if there is no file, or an
/// empty one (created beforehand, as with `touch`).
fn read(path: &Path, fingerprint: u64, vocab: usize) -> Result<Option<Vec<u32>>> {
    match std::fs::read(path) {
        Ok(bytes) if bytes.is_empty() => Ok(None),
        Ok(bytes) => parse(&bytes, path, fingerprint, vocab).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(bad(path, format!("cannot read: {e}"))),
    }
}

/// The tokens of a history file, checked.
fn parse(bytes: &[u8], path: &Path, fingerprint: u64, vocab: usize) -> Result<Vec<u32>> {
    if bytes.len() < 32 || &bytes[..8] != MAGIC {
        return Err(bad(path, "not a Max-Gram history file (bad magic)".into()));
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let version = u32_at(8);
    if version != VERSION {
        return Err(bad(
            path,
            format!("format version {version}, this build reads {VERSION}"),
        ));
    }
    let count = u32_at(24) as usize;
    let expected = 28 + 4 * count + 4;
    if bytes.len() != expected {
        return Err(bad(
            path,
            format!(
                "truncated or corrupt: {} bytes, the header implies {expected}",
                bytes.len()
            ),
        ));
    }
    if crc32fast::hash(&bytes[..expected - 4]) != u32_at(expected - 4) {
        return Err(bad(path, "corrupt: checksum mismatch".into()));
    }
    // After the checksum: a flipped bit in the header is damage, not another tokenizer.
    let theirs = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
    if theirs != fingerprint || u32_at(20) as usize != vocab {
        return Err(bad(
            path,
            format!(
                "written for another tokenizer (fingerprint {theirs:016x}, the model's is \
                 {fingerprint:016x}); delete it or point `history` elsewhere"
            ),
        ));
    }
    let tokens: Vec<u32> = (0..count).map(|i| u32_at(28 + 4 * i)).collect();
    if tokens.iter().any(|&t| t != SEP && t as usize >= vocab)
        || tokens.last() != Some(&SEP) && count > 0
    {
        return Err(bad(
            path,
            "corrupt: a token outside the vocabulary or an unterminated output".into(),
        ));
    }
    Ok(tokens)
}

fn bad(path: &Path, reason: String) -> Error {
    Error::History {
        path: path.to_path_buf(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(dir: &Path, outputs: &[&[u32]], capacity: usize, max_ngram: usize) -> History {
        let mut h = History::open(&dir.join("h.hist"), 7, 100, capacity, max_ngram).unwrap();
        for o in outputs {
            h.record(o).unwrap();
        }
        h
    }

    #[test]
    fn finds_the_longest_suffix_and_its_most_frequent_continuation() {
        let dir = tempfile::tempdir().unwrap();
        // [1, 2] is followed by 3 twice and by 4 once; [9, 1, 2] once, by 4.
        let h = history(
            dir.path(),
            &[&[1, 2, 3, 5], &[1, 2, 3, 6], &[9, 1, 2, 4]],
            100,
            4,
        );
        let m = h.best_continuation(&[7, 1, 2]).unwrap();
        assert_eq!((m.len, m.share), (2, 2.0 / 3.0));
        // The most recent of the occurrences followed by 3: the second output.
        assert_eq!(h.copy(m.at, 8), vec![3, 6]);
        let m = h.best_continuation(&[9, 1, 2]).unwrap();
        assert_eq!((m.len, m.share), (3, 1.0));
        assert_eq!(h.copy(m.at, 8), vec![4]);
        // Nothing follows the end of an output, and unknown text does not match.
        assert_eq!(h.best_continuation(&[2, 4]), None);
        assert_eq!(h.best_continuation(&[50]), None);
    }

    #[test]
    fn the_most_frequent_continuation_of_a_common_suffix_is_counted_over_all_of_it() {
        // 1 is followed by 2 3,000 times and by 9 5,000 times: more occurrences than are
        // scanned, sorted with the 2s first.
        let dir = tempfile::tempdir().unwrap();
        let output: Vec<u32> = [[1, 2]; 3000]
            .into_iter()
            .chain([[1, 9]; 5000])
            .flatten()
            .collect();
        let h = history(dir.path(), &[&output], 20_000, 4);
        let m = h.best_continuation(&[1]).unwrap();
        assert_eq!(h.copy(m.at, 1), [9]);
        assert!((m.share - 0.625).abs() < 0.01, "{}", m.share);
    }

    /// The longest suffix with a continuation, found by brute force.
    fn naive(outputs: &[Vec<u32>], text: &[u32], max_ngram: usize) -> usize {
        (1..=max_ngram.min(text.len()))
            .rev()
            .find(|&n| {
                let p = &text[text.len() - n..];
                outputs
                    .iter()
                    .any(|o| o.windows(n + 1).any(|w| &w[..n] == p))
            })
            .unwrap_or(0)
    }

    #[test]
    fn agrees_with_a_brute_force_search_and_keeps_to_its_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let mut state = 99u64;
        let mut rand = |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        let mut h = History::open(&dir.path().join("h.hist"), 7, 100, 60, 5).unwrap();
        let mut outputs: Vec<Vec<u32>> = Vec::new();
        for _ in 0..40 {
            let o: Vec<u32> = (0..1 + rand(15)).map(|_| rand(4) as u32).collect();
            h.record(&o).unwrap();
            outputs.push(o);
            // What the capacity keeps: the most recent outputs whose tokens (and separators)
            // fit in 60.
            let mut kept = 0;
            let mut size = 0;
            for o in outputs.iter().rev() {
                if size + o.len() + 1 > 60 {
                    break;
                }
                size += o.len() + 1;
                kept += 1;
            }
            assert_eq!(h.len(), size);
            // The positions merged in order as those sorted anew (the file read fresh).
            let fresh = History::open(&dir.path().join("h.hist"), 7, 100, 60, 5).unwrap();
            assert_eq!(h.suffixes, fresh.suffixes);
            let recent = &outputs[outputs.len() - kept..];
            for _ in 0..10 {
                let text: Vec<u32> = (0..1 + rand(8)).map(|_| rand(4) as u32).collect();
                let got = h.best_continuation(&text).map_or(0, |m| m.len);
                assert_eq!(got, naive(recent, &text, 5), "{text:?} in {recent:?}");
            }
        }
    }

    #[test]
    fn writers_sharing_a_file_keep_each_others_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.hist");
        // Two processes open the (missing) file, then each records an output.
        let mut a = History::open(&path, 7, 100, 1000, 4).unwrap();
        let mut b = History::open(&path, 7, 100, 1000, 4).unwrap();
        a.record(&[1, 2, 3]).unwrap();
        b.record(&[4, 5, 6]).unwrap();
        a.record(&[7, 8]).unwrap();
        let all = [1, 2, 3, SEP, 4, 5, 6, SEP, 7, 8, SEP];
        assert_eq!(History::open(&path, 7, 100, 1000, 4).unwrap().tokens, all);
        // Each also drafts from what the other wrote before its last record.
        assert_eq!(a.copy(a.best_continuation(&[4, 5]).unwrap().at, 5), [6]);
        assert_eq!(b.copy(b.best_continuation(&[1, 2]).unwrap().at, 5), [3]);
    }

    /// The same under contention: writers on four threads, each with the file open as its own
    /// (the lock is the file's, so threads contend for it as processes do), record at once;
    /// the file ends with every output, once.
    #[test]
    fn writers_recording_at_once_lose_no_output() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.hist");
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let path = &path;
                s.spawn(move || {
                    let mut h = History::open(path, 7, 100, 1000, 4).unwrap();
                    for i in 0..20 {
                        h.record(&[t + 1, i + 10, 7]).unwrap();
                    }
                });
            }
        });
        let tokens = History::open(&path, 7, 100, 1000, 4).unwrap().tokens;
        let mut outputs: Vec<&[u32]> = tokens.split(|&t| t == SEP).collect();
        assert_eq!(outputs.pop(), Some(&[][..])); // after the last separator
        outputs.sort();
        let mut want: Vec<[u32; 3]> = (0..4)
            .flat_map(|t| (0..20).map(move |i| [t + 1, i + 10, 7]))
            .collect();
        want.sort();
        assert_eq!(outputs, want.iter().map(|o| &o[..]).collect::<Vec<_>>());
    }

    #[test]
    fn survives_a_round_trip_and_refuses_damaged_or_foreign_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("h.hist");
        let mut h = History::open(&path, 7, 100, 1000, 4).unwrap();
        assert!(h.is_empty());
        h.record(&[1, 2, 3]).unwrap();
        h.record(&[4, 5]).unwrap();
        let again = History::open(&path, 7, 100, 1000, 4).unwrap();
        assert_eq!(again.tokens, h.tokens);
        assert_eq!(
            again.copy(again.best_continuation(&[1]).unwrap().at, 5),
            [2, 3]
        );
        // A smaller capacity keeps the most recent outputs.
        assert_eq!(
            History::open(&path, 7, 100, 3, 4).unwrap().tokens,
            [4, 5, SEP]
        );

        let error = |bytes: &[u8], fingerprint: u64| {
            std::fs::write(&path, bytes).unwrap();
            match History::open(&path, fingerprint, 100, 1000, 4) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("accepted"),
            }
        };
        let good = h.to_bytes();
        let name = path.display();
        assert_eq!(
            error(&good, 8),
            format!(
                "Max-Gram history {name}: written for another tokenizer (fingerprint \
                 0000000000000007, the model's is 0000000000000008); delete it or point \
                 `history` elsewhere"
            )
        );
        assert_eq!(
            error(&good[..good.len() - 3], 7),
            format!(
                "Max-Gram history {name}: truncated or corrupt: {} bytes, the header implies {}",
                good.len() - 3,
                good.len()
            )
        );
        for at in [13, 30] {
            // A bit flipped in the tokenizer's fingerprint, or in a token.
            let mut flipped = good.clone();
            flipped[at] ^= 1;
            assert!(
                error(&flipped, 7).contains("checksum mismatch"),
                "byte {at}"
            );
        }
        assert!(error(b"not a history file at all..........", 7).contains("bad magic"));
        let mut future = good.clone();
        future[8] = 9;
        assert!(error(&future, 7).contains("format version 9, this build reads 1"));
        // An empty file (created beforehand) is an empty history, as a missing one is.
        std::fs::write(&path, b"").unwrap();
        assert!(History::open(&path, 7, 100, 1000, 4).unwrap().is_empty());
        assert!(h
            .record(&[100])
            .unwrap_err()
            .to_string()
            .contains("outside the vocabulary"));
    }
}
