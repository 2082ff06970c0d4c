//! Bigram tables: for each token, its most likely successors with their probabilities.
//!
//! Built from a corpus with a given tokenizer and stored in a small versioned binary format
//! that carries the tokenizer's fingerprint, so a table is never used with another vocabulary.
//!
//! File layout (little-endian):
//! `b"CSBIGRAM"`, version `u32`, tokenizer fingerprint `u64`, vocabulary size `u32`,
//! entries `u32`, ranked `u32`, then `offsets: [u32; vocab + 1]`, `next: [u32; entries]`,
//! `probs: [f32; entries]`, `ranking: [u32; ranked]`, and the CRC-32 (`u32`) of everything
//! before it. The successors of token `t` are `next[offsets[t]..offsets[t + 1]]`, most likely
//! first; `ranking` lists the tokens the corpus holds, most frequent first (a draft model's
//! trimmed vocabulary is read from it). Version 2 files (no `ranked`, no `ranking`) are read
//! too, with an empty ranking.
//! Reading checks every length against the file size before allocating, and every offset,
//! token id and probability before use.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use fxhash::FxHashMap;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"CSBIGRAM";
const VERSION: u32 = 3;

/// A bigram table in compressed sparse rows.
#[derive(Clone, Debug, PartialEq)]
pub struct BigramTable {
    fingerprint: u64,
    offsets: Vec<u32>,
    next: Vec<u32>,
    probs: Vec<f32>,
    ranking: Vec<u32>,
}

impl BigramTable {
    /// Builds a table from bigram `counts` over `vocab` tokens, keeping the `top` most
    /// frequent successors of each token (ties to the lower id). Probabilities are relative
    /// to all of a token's successors in the corpus, so a row sums to at most 1. The ranking
    /// orders the tokens with a nonzero count in `frequency` (indexed by token id), most
    /// frequent first, ties to the lower id.
    pub fn from_counts(
        counts: &FxHashMap<(u32, u32), u32>,
        frequency: &[u64],
        vocab: usize,
        top: usize,
        fingerprint: u64,
    ) -> Self {
        let mut rows: Vec<Vec<(u32, u32)>> = vec![Vec::new(); vocab];
        // Pairs with an id past the vocabulary (a tokenizer whose ids leave gaps) are left
        // out: the table could not be loaded with them.
        for (&(a, b), &c) in counts {
            if (a as usize) < vocab && (b as usize) < vocab {
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
        let mut ranking: Vec<u32> = (0..frequency.len().min(vocab) as u32)
            .filter(|&t| frequency[t as usize] > 0)
            .collect();
        ranking.sort_by_key(|&t| std::cmp::Reverse(frequency[t as usize]));
        Self {
            fingerprint,
            offsets,
            next,
            probs,
            ranking,
        }
    }

    /// The tokens the corpus holds, most frequent first (empty for a version 2 table).
    pub fn ranking(&self) -> &[u32] {
        &self.ranking
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

    /// Number of tokens the table covers.
    pub fn vocab_size(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Number of (token, successor) entries.
    pub fn entries(&self) -> usize {
        self.next.len()
    }

    /// The fingerprint of the tokenizer the table was built with.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Refuses a table built with another tokenizer.
    pub fn check_tokenizer(&self, tokenizer: &Tokenizer, path: &Path) -> Result<()> {
        // Or its first ids: a larger model of the family pads its vocabulary further.
        let n = self.vocab_size();
        let model = tokenizer.fingerprint_of_first(n.min(tokenizer.vocab_size()));
        if n > tokenizer.vocab_size() || self.fingerprint != model {
            return Err(bad_table(
                path,
                format!(
                    "built for another tokenizer (fingerprint {:016x} of its {n} ids; the \
                     model's first {} of {} ids give {model:016x}); rebuild it with `cascade \
                     ngram build`",
                    self.fingerprint,
                    n.min(tokenizer.vocab_size()),
                    tokenizer.vocab_size()
                ),
            ));
        }
        Ok(())
    }

    /// The table in its binary format (checksummed).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            36 + 4 * (self.offsets.len() + 2 * self.next.len() + self.ranking.len()),
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.to_le_bytes());
        out.extend_from_slice(&(self.vocab_size() as u32).to_le_bytes());
        out.extend_from_slice(&(self.next.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.ranking.len() as u32).to_le_bytes());
        self.offsets
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.next
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.probs
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.ranking
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        let sum = crc32fast::hash(&out);
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
        if version != VERSION && version != 2 {
            return Err(bad_table(
                path,
                format!("format version {version}, this build reads 2 and {VERSION}"),
            ));
        }
        let fingerprint = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
        let (vocab, entries) = (u32_at(20) as usize, u32_at(24) as usize);
        // Version 2 has no ranking, and a header one word shorter.
        let (ranked, header) = if version == 2 {
            (0, 28)
        } else {
            (u32_at(28) as usize, 32)
        };
        // u32 counts: the sum cannot overflow a 64-bit usize, and is compared with the real
        // size before anything is allocated.
        let expected = header + 4 * (vocab + 1) + 8 * entries + 4 * ranked + 4;
        if bytes.len() != expected {
            return Err(bad_table(
                path,
                format!(
                    "truncated or corrupt: {} bytes, the header implies {expected}",
                    bytes.len()
                ),
            ));
        }
        let body = &bytes[..expected - 4];
        if crc32fast::hash(body) != u32_at(expected - 4) {
            return Err(bad("corrupt: checksum mismatch"));
        }
        let words = |from: usize, n: usize| (0..n).map(move |i| u32_at(from + 4 * i));
        let offsets: Vec<u32> = words(header, vocab + 1).collect();
        let next: Vec<u32> = words(header + 4 * (vocab + 1), entries).collect();
        let probs: Vec<f32> = words(header + 4 * (vocab + 1 + entries), entries)
            .map(f32::from_bits)
            .collect();
        let ranking: Vec<u32> = words(header + 4 * (vocab + 1 + 2 * entries), ranked).collect();
        if offsets.windows(2).any(|w| w[0] > w[1]) || offsets[vocab] as usize != entries {
            return Err(bad("corrupt: row offsets out of order"));
        }
        if next.iter().any(|&t| t as usize >= vocab) {
            return Err(bad("corrupt: a successor outside the vocabulary"));
        }
        if probs.iter().any(|p: &f32| !(0.0..=1.0).contains(p)) {
            return Err(bad("corrupt: a probability outside [0, 1]"));
        }
        let mut seen = vec![false; vocab];
        for &t in &ranking {
            match seen.get_mut(t as usize) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(bad(
                        "corrupt: a ranked token outside the vocabulary or twice",
                    ))
                }
            }
        }
        Ok(Self {
            fingerprint,
            offsets,
            next,
            probs,
            ranking,
        })
    }

    /// Writes the table atomically: to a temporary file beside `path`, then renamed over it,
    /// so an interrupted build never leaves a half-written table.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::files::write_atomically(path, &self.to_bytes())
            .map_err(|e| bad_table(path, format!("cannot write: {e}")))
    }

    /// Whether a table may be written at `path` without losing anything: no file is there, an
    /// empty one, or a table (of any version, damaged or not: it is rebuilt).
    pub fn replaceable(path: &Path) -> std::io::Result<bool> {
        use std::io::Read;
        let mut head = Vec::new();
        match std::fs::File::open(path) {
            Ok(f) => Ok(f.take(8).read_to_end(&mut head)? == 0 || head == MAGIC),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Reads and checks the table at `path`.
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

/// Counts the bigrams of a corpus, file by file.
pub struct BigramCounter<'a> {
    tokenizer: &'a Tokenizer,
    /// Occurrences of each bigram.
    pub counts: FxHashMap<(u32, u32), u32>,
    /// Occurrences of each token, by id.
    pub frequency: Vec<u64>,
    /// Tokens counted.
    pub tokens: u64,
}

impl<'a> BigramCounter<'a> {
    /// An empty counter for `tokenizer`'s tokens.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            counts: FxHashMap::default(),
            frequency: vec![0; tokenizer.vocab_size()],
            tokens: 0,
        }
    }

    /// Tokenizes `text` (without special tokens) and counts its bigrams.
    pub fn add_text(&mut self, text: &str) -> Result<()> {
        let ids = self.tokenizer.encode_plain(text)?;
        self.tokens += ids.len() as u64;
        for &t in &ids {
            if let Some(f) = self.frequency.get_mut(t as usize) {
                *f += 1;
            }
        }
        for w in ids.windows(2) {
            *self.counts.entry((w[0], w[1])).or_insert(0) += 1;
        }
        Ok(())
    }

    /// The table keeping each token's `top` most frequent successors.
    pub fn into_table(self, top: usize) -> BigramTable {
        BigramTable::from_counts(
            &self.counts,
            &self.frequency,
            self.tokenizer.vocab_size(),
            top,
            self.tokenizer.fingerprint(),
        )
    }
}

/// Files under `roots` (files, or folders searched recursively, symbolic links followed)
/// whose extension is in `extensions` (with or without its dot; all files if empty) and whose
/// path has no component named in `exclude`, in a stable order. A symbolic link that loops back is skipped.
pub fn corpus_files(
    roots: &[PathBuf],
    extensions: &[String],
    exclude: &[String],
) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for root in roots {
        let walk = walkdir::WalkDir::new(root)
            .follow_links(true)
            .into_iter()
            .filter_entry(|e| !exclude.iter().any(|x| e.file_name() == x.as_str()));
        for entry in walk {
            let entry = match entry {
                Ok(e) => e,
                Err(e) if e.loop_ancestor().is_some() => continue,
                Err(e) => {
                    // walkdir's own message names the path again: the I/O error's alone.
                    let at = e.path().unwrap_or(root).display().to_string();
                    let why = e.io_error().map_or(e.to_string(), |io| io.to_string());
                    return Err(Error::Io(std::io::Error::other(format!("{at}: {why}"))));
                }
            };
            let p = entry.path();
            // `py` and `.py` alike.
            let wanted = extensions.is_empty()
                || p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                    extensions
                        .iter()
                        .any(|x| x.trim().trim_start_matches('.') == e)
                });
            if entry.file_type().is_file() && wanted {
                files.push(p.to_path_buf());
            }
        }
    }
    files.sort();
    // A file named twice (or found under two roots) is read once, under its first name.
    let mut seen = std::collections::HashSet::new();
    files.retain(|f| seen.insert(f.canonicalize().unwrap_or_else(|_| f.clone())));
    Ok(files)
}

/// What [`build_table`] read.
pub struct BuildSummary {
    /// Files read.
    pub files: usize,
    /// Files skipped because they are not UTF-8 text.
    pub skipped: usize,
    /// Files that could not be read (permissions, removed meanwhile).
    pub unreadable: usize,
    /// The first of them, with its error.
    pub first_unreadable: Option<String>,
    /// Tokens counted.
    pub tokens: u64,
}

/// Counts the bigrams of `files` with `tokenizer` and keeps the `top` successors of each
/// token; `progress(bytes)` after each file.
pub fn build_table(
    files: &[PathBuf],
    tokenizer: &Tokenizer,
    top: usize,
    progress: &mut dyn FnMut(u64),
) -> Result<(BigramTable, BuildSummary)> {
    let mut counter = BigramCounter::new(tokenizer);
    let (mut skipped, mut unreadable, mut first_unreadable) = (0, 0, None);
    for f in files {
        match std::fs::read_to_string(f) {
            Ok(text) => counter.add_text(&text)?,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => skipped += 1,
            Err(e) => {
                unreadable += 1;
                first_unreadable.get_or_insert_with(|| format!("{}: {e}", f.display()));
            }
        }
        progress(f.metadata().map_or(0, |m| m.len()));
    }
    let summary = BuildSummary {
        files: files.len() - skipped - unreadable,
        skipped,
        unreadable,
        first_unreadable,
        tokens: counter.tokens,
    };
    Ok((counter.into_table(top), summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> BigramTable {
        let mut counts = FxHashMap::default();
        for (a, b, c) in [(1, 2, 5), (1, 3, 3), (1, 4, 3), (1, 5, 1), (2, 1, 7)] {
            counts.insert((a, b), c);
        }
        BigramTable::from_counts(&counts, &[0, 9, 5, 3, 3, 1, 0, 0], 8, 3, 0xabc)
    }

    /// A word-level tokenizer of `words`, ids in order.
    fn words(words: &[&str]) -> Tokenizer {
        use tokenizers::models::wordlevel::WordLevel;
        let vocab = words.iter().zip(0u32..).map(|(w, i)| (w.to_string(), i));
        let model = WordLevel::builder()
            .vocab(vocab.collect())
            .unk_token(words[0].into())
            .build()
            .unwrap();
        Tokenizer::from_parts(tokenizers::Tokenizer::new(model), Vec::new())
    }

    /// A table serves its own tokenizer and one that extends it (a larger model of the family,
    /// whose vocabulary is padded further); another is refused.
    #[test]
    fn a_table_serves_a_tokenizer_that_extends_its_own() {
        let own = words(&["a", "b", "c"]);
        let t = BigramTable::from_counts(&FxHashMap::default(), &[0; 3], 3, 3, own.fingerprint());
        let path = Path::new("t.bigram");
        assert!(t.check_tokenizer(&own, path).is_ok());
        assert!(t
            .check_tokenizer(&words(&["a", "b", "c", "d"]), path)
            .is_ok());
        assert!(t
            .check_tokenizer(&words(&["a", "x", "c", "d"]), path)
            .is_err());
        assert!(t.check_tokenizer(&words(&["a", "b"]), path).is_err());
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
        assert_eq!(t.ranking(), &[1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_version_2_table_reads_with_an_empty_ranking() {
        let mut counts = FxHashMap::default();
        counts.insert((1, 2), 1);
        let t = BigramTable::from_counts(&counts, &[], 4, 1, 7);
        let v3 = t.to_bytes();
        let mut v2 = [
            &v3[..8],
            &2u32.to_le_bytes(),
            &v3[12..28],
            &v3[32..v3.len() - 4],
        ]
        .concat();
        let sum = crc32fast::hash(&v2);
        v2.extend_from_slice(&sum.to_le_bytes());
        let read = BigramTable::from_bytes(&v2, Path::new("old.bigram")).unwrap();
        assert_eq!(read, t);
        assert!(read.ranking().is_empty());
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
        // A successor outside the vocabulary, with a checksum that matches.
        let mut bad = bytes[..bytes.len() - 4].to_vec();
        let next_at = 32 + 4 * (8 + 1);
        bad[next_at..next_at + 4].copy_from_slice(&99u32.to_le_bytes());
        let sum = crc32fast::hash(&bad);
        bad.extend_from_slice(&sum.to_le_bytes());
        let e = BigramTable::from_bytes(&bad, p).unwrap_err().to_string();
        assert_eq!(
            e,
            "bigram table t.bigram: corrupt: a successor outside the vocabulary"
        );
        // A token ranked twice.
        let mut twice = bytes[..bytes.len() - 4].to_vec();
        let ranked_at = twice.len() - 4;
        twice[ranked_at..].copy_from_slice(&1u32.to_le_bytes());
        let sum = crc32fast::hash(&twice);
        twice.extend_from_slice(&sum.to_le_bytes());
        let e = BigramTable::from_bytes(&twice, p).unwrap_err().to_string();
        assert_eq!(
            e,
            "bigram table t.bigram: corrupt: a ranked token outside the vocabulary or twice"
        );
        let e = BigramTable::from_bytes(b"GGUF....", p)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "bigram table t.bigram: not a bigram table (bad magic)");
    }
}

#[cfg(all(test, unix))]
mod walk_tests {
    use super::*;

    #[test]
    fn a_symlink_loop_in_the_corpus_ends() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("a");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("x.py"), "print(1)\n").unwrap();
        std::os::unix::fs::symlink(dir.path(), sub.join("loop")).unwrap();
        let files = corpus_files(&[dir.path().to_path_buf()], &["py".into()], &[]).unwrap();
        assert_eq!(files, [sub.join("x.py")]);
        let none =
            corpus_files(&[dir.path().to_path_buf()], &["py".into()], &["a".into()]).unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn an_extension_may_be_given_with_its_dot() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("x.py"), "print(1)\n").unwrap();
        std::fs::write(dir.path().join("y.rs"), "fn main() {}\n").unwrap();
        let files = corpus_files(&[dir.path().to_path_buf()], &[".py".into()], &[]).unwrap();
        assert_eq!(files, [dir.path().join("x.py")]);
        // Or after a space (`--ext "py, rs"`).
        let files = corpus_files(&[dir.path().to_path_buf()], &[" rs".into()], &[]).unwrap();
        assert_eq!(files, [dir.path().join("y.rs")]);
    }

    #[test]
    fn a_file_named_twice_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let x = dir.path().join("x.py");
        std::fs::write(&x, "print(1)\n").unwrap();
        let again = dir.path().join(".").join("x.py");
        let files = corpus_files(&[again, dir.path().to_path_buf()], &[], &[]).unwrap();
        assert_eq!(files.len(), 1, "{files:?}");
    }

    #[test]
    fn files_not_utf8_or_unreadable_are_left_out_and_counted_apart() {
        use tokenizers::models::wordlevel::WordLevel;
        let words = [("a", 0), ("b", 1)].map(|(w, i)| (w.to_string(), i)).into();
        let model = WordLevel::builder()
            .vocab(words)
            .unk_token("a".into())
            .build()
            .unwrap();
        let mut t = tokenizers::Tokenizer::new(model);
        t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
        let tokenizer = Tokenizer::from_parts(t, Vec::new());
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.txt");
        let binary = dir.path().join("binary.txt");
        std::fs::write(&good, "a b a b").unwrap();
        std::fs::write(&binary, [0xff, 0xfe, 0x00]).unwrap();
        let gone = dir.path().join("gone.txt");
        let files = [good, binary, gone.clone(), dir.path().to_path_buf()];
        let (table, read) = build_table(&files, &tokenizer, 4, &mut |_| {}).unwrap();
        assert_eq!((read.files, read.skipped, read.unreadable), (1, 1, 2));
        let first = read.first_unreadable.unwrap();
        assert!(
            first.starts_with(&format!("{}: ", gone.display())),
            "{first}"
        );
        assert_eq!((read.tokens, table.entries()), (4, 2));
    }
}
