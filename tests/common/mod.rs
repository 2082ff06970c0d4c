//! Shared test helpers: a synthetic model with exactly known distributions, a matching
//! synthetic tokenizer, and the real test models (fetched by scripts/fetch-models.sh).
#![allow(dead_code)]

use cascade::model::{LoadedModel, Logits, Model};
use cascade::tokenizer::Tokenizer;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// A deterministic synthetic language model over a small vocabulary: the logits of the token
/// after `before, prev` at position `pos` are a fixed pseudo-random function of (seed, before,
/// prev, pos), so a stale token left behind by a rollback changes what follows. Two toy
/// models with different seeds disagree, as a draft and a target do.
pub struct ToyModel {
    pub seed: u64,
    pub vocab: usize,
    /// Scales the logits: larger is peakier.
    pub sharpness: f32,
    pub tokens: Vec<u32>,
    pub max_len: usize,
    pub calls: usize,
    /// A trimmed vocabulary: the tokens scored (the others get `-inf`).
    pub scored: Option<Vec<u32>>,
}

impl ToyModel {
    pub fn new(seed: u64, vocab: usize, sharpness: f32) -> Self {
        Self {
            seed,
            vocab,
            sharpness,
            tokens: Vec::new(),
            max_len: 4096,
            calls: 0,
            scored: None,
        }
    }

    /// The logits after `context` (so a test can compute exact target distributions).
    pub fn logits_after(&self, context: &[u32]) -> Vec<f32> {
        let prev = *context.last().unwrap() as u64;
        let before = context
            .len()
            .checked_sub(2)
            .map_or(u64::MAX, |i| context[i] as u64);
        let pos = context.len() as u64;
        let mix = |mut h: u64| {
            h ^= h >> 31;
            h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            h ^= h >> 29;
            h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
            h ^= h >> 32;
            (h % 1000) as f32 / 1000.0
        };
        (0..self.vocab as u64)
            .map(|t| {
                let own = mix(self.seed
                    ^ (prev.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                    ^ (pos << 32)
                    ^ (t << 48));
                // The token before `prev` shifts every toy model alike (draft and target
                // keep agreeing as much), by up to 0.6.
                let shared =
                    mix(before.wrapping_mul(0xc2b2_ae3d_27d4_eb4f) ^ (pos << 32) ^ (t << 48));
                own * self.sharpness + 0.6 * shared
            })
            .collect()
    }
}

impl Model for ToyModel {
    fn name(&self) -> &str {
        "toy"
    }
    fn forward(&mut self, tokens: &[u32]) -> cascade::Result<Logits> {
        // As a real model: nothing past the context.
        if self.tokens.len() + tokens.len() > self.max_len {
            return Err(cascade::Error::PromptTooLong {
                model: "toy".into(),
                prompt: self.tokens.len() + tokens.len(),
                context: self.max_len,
            });
        }
        // As a real model: no id beyond the vocabulary.
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(cascade::Error::Tokenizer(format!(
                "token id {t} is outside the vocabulary of `toy` ({} tokens)",
                self.vocab
            )));
        }
        self.calls += 1;
        let mut data = Vec::new();
        for &t in tokens {
            self.tokens.push(t);
            let mut row = self.logits_after(&self.tokens);
            if let Some(scored) = &self.scored {
                for (i, l) in row.iter_mut().enumerate() {
                    if !scored.contains(&(i as u32)) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            data.extend(row);
        }
        Ok(Logits::new(data, self.vocab))
    }
    fn restrict_vocabulary(&mut self, tokens: Option<&[u32]>) -> cascade::Result<()> {
        self.scored = tokens.map(<[u32]>::to_vec);
        Ok(())
    }
    fn len(&self) -> usize {
        self.tokens.len()
    }
    fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_len(&self) -> usize {
        self.max_len
    }
}

/// A word-level tokenizer whose tokens are `t0 .. t{vocab-1}`, with no end-of-sequence id.
pub fn toy_tokenizer(vocab: usize) -> Tokenizer {
    toy_tokenizer_ending(vocab, Vec::new())
}

/// [`toy_tokenizer`] with end-of-sequence ids `eos`.
pub fn toy_tokenizer_ending(vocab: usize, eos: Vec<u32>) -> Tokenizer {
    use tokenizers::models::wordlevel::WordLevel;
    let words = (0..vocab as u32).map(|i| (format!("t{i}"), i)).collect();
    let model = WordLevel::builder()
        .vocab(words)
        .unk_token("t0".into())
        .build()
        .unwrap();
    let mut t = tokenizers::Tokenizer::new(model);
    t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
    Tokenizer::from_parts(t, eos)
}

pub fn models_dir() -> PathBuf {
    std::env::var_os("CASCADE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"))
}

pub const TARGET: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
pub const DRAFT: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
pub const SMOLLM2: &str = "smollm2-135m-instruct-q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

/// The 1.5B target with every Q4_K tensor requantized to Q5_K: most of a Q5_K_M file's
/// weights are Q5_K, and none of the shipped test models has any ([`requantized`]).
pub fn q5k_target() -> PathBuf {
    use candle_core::quantized::GgmlDType;
    requantized(
        TARGET,
        "qwen2.5-coder-1.5b-q5_k",
        GgmlDType::Q4K,
        GgmlDType::Q5K,
    )
}

/// The 0.5B draft with every Q5_0 tensor requantized to Q5_1: a Q5_K_M file of a model whose
/// widths are not multiples of 256 (the 0.5B's 896) stores most matrices as Q5_1, as its
/// Q4_K_M stores them as Q5_0, and none of the shipped test models has any ([`requantized`]).
pub fn q5_1_draft() -> PathBuf {
    use candle_core::quantized::GgmlDType;
    requantized(
        DRAFT,
        "qwen2.5-coder-0.5b-q5_1",
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
    )
}

/// Model `file` with every tensor of type `from` requantized to `to` by candle (dequantized,
/// then quantized as llama.cpp's `quantize` would). Made once (up to about 40 s) in Cargo's
/// directory for test files as `{name}-from-{source size}.gguf`, and reused while its source
/// is unchanged.
fn requantized(
    file: &str,
    name: &str,
    from: candle_core::quantized::GgmlDType,
    to: candle_core::quantized::GgmlDType,
) -> PathBuf {
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::Device;
    static MADE: Mutex<()> = Mutex::new(());
    let _made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    let source = models_dir().join(file);
    let size = std::fs::metadata(&source)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models.sh)", source.display()))
        .len();
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-from-{size}.gguf"));
    if path.exists() {
        return path;
    }
    let mut file = std::fs::File::open(&source).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .iter()
        .map(|(name, info)| {
            let q = content.tensor(&mut file, name, &Device::Cpu).unwrap();
            let q = match info.ggml_dtype {
                d if d == from => {
                    QTensor::quantize(&q.dequantize(&Device::Cpu).unwrap(), to).unwrap()
                }
                _ => q,
            };
            (name.clone(), q)
        })
        .collect();
    let metadata: Vec<_> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<_> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    // Written aside and renamed, so that an interrupted run leaves no partial file behind (and
    // test binaries run at once each write their own).
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&partial).unwrap());
    gguf_file::write(&mut out, &metadata, &tensors).unwrap();
    std::io::Write::flush(&mut out).unwrap();
    drop(out);
    std::fs::rename(&partial, &path).unwrap();
    path
}

/// A real model, loaded once per test binary. Missing files fail loudly: the README's test
/// command fetches them first.
pub fn real(file: &str) -> Arc<LoadedModel> {
    type Loaded = Vec<(String, Arc<LoadedModel>)>;
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    let cache = LOADED.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap();
    if let Some((_, m)) = cache.iter().find(|(f, _)| f == file) {
        return m.clone();
    }
    let path = models_dir().join(file);
    let m = Arc::new(
        LoadedModel::load(&path, None, &mut |_, _| {}).unwrap_or_else(|e| {
            panic!("{e}\n(run scripts/fetch-models.sh to fetch the test models)")
        }),
    );
    cache.push((file.to_string(), m.clone()));
    m
}

/// Real-model tests take both cores each: run them one at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
