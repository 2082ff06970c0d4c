//! Models that can verify: a forward pass returns logits for every fed position, and the
//! KV cache can be rolled back after a rejected draft.

mod attention;
pub mod gguf;
mod kernels;
mod kv_cache;
mod qweight;
pub mod source;
mod synced;
pub mod transformer;

use crate::error::{Error, Result};
use crate::sampling::{Dist, Sampling};
use crate::tokenizer::Tokenizer;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

pub use kernels::{Kernels, KERNELS_ENV};
pub use source::{HubEnv, ModelSource};
pub(crate) use synced::common_prefix;
pub use synced::SyncedModel;
pub use transformer::{Transformer, Weights};

/// Tokens fed per forward pass when reading a prompt: bounds the activation memory, and
/// is the step of the reading's progress.
pub const PREFILL_CHUNK: usize = 256;

/// A causal language model with a KV cache.
///
/// The cache holds `len()` positions. `forward(tokens)` feeds `tokens` at positions
/// `len()..len() + tokens.len()` and returns one row of logits per token: row `i` scores the
/// token that follows `tokens[i]`. `truncate(n)` forgets every position from `n` on, so that
/// after a rejected draft the model continues as if the rejected tokens were never fed.
///
/// Two properties the engine relies on: a forward or prefill that fails leaves `len()` as it
/// was, and a forward over k tokens gives the same logits, bit for bit, as k one-token
/// forwards (rows computed independently). Greedy output equal to the target's plain decoding
/// and the prompt cache both depend on the second.
pub trait Model: Send {
    /// A short name for messages and reports.
    fn name(&self) -> &str;

    /// Feeds `tokens`; returns their logits, one row per token.
    fn forward(&mut self, tokens: &[u32]) -> Result<Logits>;

    /// Feeds `tokens` without computing logits (prompt processing).
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.forward(tokens).map(drop)
    }

    /// Number of cached positions.
    fn len(&self) -> usize;

    /// Whether the cache is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the first `len` cached positions (no-op if `len >= self.len()`).
    fn truncate(&mut self, len: usize);

    /// Width of a logits row.
    fn vocab_size(&self) -> usize;

    /// The most positions the cache may hold.
    fn max_len(&self) -> usize;

    /// Computes logits for `tokens` only, the others coming out as `-inf` (probability 0), or
    /// for the whole vocabulary again with `None`: a draft model's trimmed vocabulary, which
    /// saves most of its output projection. Exactness does not depend on it, since a drafter
    /// reports the distribution it sampled from. Models that cannot trim refuse.
    fn restrict_vocabulary(&mut self, tokens: Option<&[u32]>) -> Result<()> {
        match tokens {
            None => Ok(()),
            Some(_) => Err(Error::config(
                self.name(),
                "this model cannot trim its vocabulary",
            )),
        }
    }
}

/// Logits for consecutive positions, `rows() x vocab` row-major.
#[derive(Clone, Debug)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
    /// Each row's distribution, under the sampling it was first asked for.
    dists: Vec<OnceLock<(Sampling, Dist)>>,
}

impl Logits {
    /// `data` as rows of `vocab` logits (a reviewer checks the shape of what a model returns).
    pub fn new(data: Vec<f32>, vocab: usize) -> Self {
        let rows = data.len().checked_div(vocab).unwrap_or(0);
        Self {
            data,
            vocab,
            dists: (0..rows).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Number of (whole) rows.
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }

    /// Row `i`.
    ///
    /// # Panics
    /// If `i` is not below [`Logits::rows`].
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// Row `i`'s distribution under `sampling` ([`Sampling::distribution`]), computed once and
    /// kept: a review and what adaptive drafting learns from it both need it, and at T > 0 it
    /// costs 0.1-1.4 ms over a 151,936-token vocabulary. Under another sampling than the first
    /// asked for, it is computed afresh.
    ///
    /// # Panics
    /// If `i` is not below [`Logits::rows`].
    pub fn distribution(&self, i: usize, sampling: &Sampling) -> Cow<'_, Dist> {
        let compute = || sampling.distribution(self.row(i));
        let (first, dist) = self.dists[i].get_or_init(|| (*sampling, compute()));
        if first == sampling {
            Cow::Borrowed(dist)
        } else {
            Cow::Owned(compute())
        }
    }

    /// Every row, row-major.
    pub fn values(&self) -> &[f32] {
        &self.data
    }

    /// Width of a row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The last `rows` rows.
    pub fn tail(mut self, rows: usize) -> Self {
        let skip = self.rows().saturating_sub(rows);
        self.data.drain(..skip * self.vocab);
        self.dists.drain(..skip);
        self
    }
}

/// A model file loaded once: its weights and tokenizer, shared by every instance using it.
pub struct LoadedModel {
    /// The GGUF file.
    pub path: PathBuf,
    /// The weights, shared by every instance.
    pub weights: Arc<Weights>,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
}

impl LoadedModel {
    /// Loads a GGUF file for the kernels [`Kernels::detect`] picks; `progress(done, total)` is
    /// called as layers are read.
    pub fn load(
        path: &Path,
        tokenizer_json: Option<&Path>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::load_with(path, tokenizer_json, Kernels::detect()?, progress)
    }

    /// Loads a GGUF file with its weights packed for `kernels`.
    pub fn load_with(
        path: &Path,
        tokenizer_json: Option<&Path>,
        kernels: Kernels,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::from_gguf(
            gguf::GgufFile::open(path)?,
            tokenizer_json,
            kernels,
            progress,
        )
    }

    /// Loads a model from an open GGUF file (a file, or bytes in memory through
    /// [`gguf::GgufFile::from_reader`]).
    pub fn from_gguf(
        mut file: gguf::GgufFile<'_>,
        tokenizer_json: Option<&Path>,
        kernels: Kernels,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        // Weights are packed only for kernels that can multiply them here.
        kernels.runnable()?;
        // The hyperparameters first: an unsupported or inconsistent file fails before the
        // tokenizer or any weights are read.
        let config = transformer::Config::from_gguf(&file)?;
        let tokenizer = Tokenizer::load(&file, tokenizer_json)?;
        if tokenizer.vocab_size() > config.vocab {
            return Err(Error::BadModelFile {
                path: file.path.clone(),
                reason: format!(
                    "the tokenizer has {} tokens but the embeddings only {}",
                    tokenizer.vocab_size(),
                    config.vocab
                ),
            });
        }
        let weights = Arc::new(Weights::load(&mut file, kernels, progress)?);
        Ok(Self {
            path: file.path.clone(),
            weights,
            tokenizer,
        })
    }

    /// A fresh instance with its own (empty) cache of at most `max_len` positions.
    pub fn instance(&self, name: &str, max_len: Option<usize>) -> Transformer {
        Transformer::new(name, self.weights.clone(), max_len)
    }
}

/// Loads each model file at most once, however many cascade nodes use it.
#[derive(Default)]
pub struct ModelStore {
    loaded: HashMap<(PathBuf, Option<PathBuf>), Arc<LoadedModel>>,
}

impl ModelStore {
    /// The models loaded so far.
    pub fn loaded(&self) -> impl Iterator<Item = &Arc<LoadedModel>> {
        self.loaded.values()
    }

    /// The model at `path`, loaded on first use.
    pub fn load(
        &mut self,
        path: &Path,
        tokenizer_json: Option<&Path>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Arc<LoadedModel>> {
        let key = (
            path.canonicalize().unwrap_or_else(|_| path.to_path_buf()),
            tokenizer_json.map(Path::to_path_buf),
        );
        if let Some(m) = self.loaded.get(&key) {
            return Ok(m.clone());
        }
        let m = Arc::new(LoadedModel::load(path, tokenizer_json, progress)?);
        self.loaded.insert(key, m.clone());
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's kept distribution is the sampling's, for the sampling it was first asked for
    /// and for another one, and follows its row through `tail`.
    #[test]
    fn a_rows_distribution_is_the_samplings_whichever_is_asked_first() {
        let rows = [[0.0f32, 1.0, 2.0, -1.0], [3.0, 0.5, 0.5, 0.0]];
        let logits = Logits::new(rows.concat(), 4);
        let warm = Sampling {
            temperature: 0.7,
            top_k: 0,
            top_p: 0.9,
        };
        let hot = Sampling {
            temperature: 1.5,
            top_k: 2,
            top_p: 1.0,
        };
        for s in [warm, hot, warm, Sampling::greedy()] {
            for (i, row) in rows.iter().enumerate() {
                assert_eq!(*logits.distribution(i, &s), s.distribution(row));
            }
        }
        let last = logits.tail(1);
        assert_eq!(*last.distribution(0, &warm), warm.distribution(&rows[1]));
    }
}
