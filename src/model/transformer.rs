//! The decoder-only transformer behind the `qwen2`, `llama` and `gemma3` GGUF architectures.
//!
//! They differ only in configuration: qwen2 has biases on the q/k/v projections and rotates
//! halves of each head (NeoX RoPE); llama GGUFs store q/k permuted for rotating adjacent
//! pairs. Gemma 3 scales the embeddings by the square root of their width, normalizes each
//! query and key head, normalizes the attention and feed-forward outputs again before adding
//! them, gates with GELU (tanh approximation) instead of SiLU, and lets five of every six
//! layers attend only to a window of recent positions, with their own RoPE base. Activations
//! are plain `f32` rows: every operation works row by row in a fixed order, so a token's
//! logits do not depend on how many tokens share its forward pass.

use crate::error::{Error, Result};
use crate::model::attention::{attention, Heads, Variant};
use crate::model::gguf::GgufFile;
use crate::model::kernels::Kernels;
use crate::model::kv_cache::KvCache;
use crate::model::qweight::{QWeight, Stacked};
use crate::model::{Logits, Model};
use crate::profile::{time, Section};
use std::sync::Arc;

/// How RoPE pairs up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimension i with i + head_dim/2 (qwen2).
    Halves,
    /// Dimension 2i with 2i+1 (llama as stored in GGUF).
    Interleaved,
}

/// The hyperparameters of a model, checked for range and consistency.
#[derive(Clone, Debug)]
pub struct Config {
    /// The GGUF architecture (`qwen2`, `llama` or `gemma3`).
    pub arch: String,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Width of the hidden state.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key-value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Width of the feed-forward layer.
    pub feed_forward: usize,
    /// Rows of the embedding (and output) matrix.
    pub vocab: usize,
    /// The trained context length.
    pub context_length: usize,
    /// Epsilon of the RMS norms.
    pub rms_eps: f32,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// How RoPE pairs dimensions.
    pub rope_style: RopeStyle,
    /// What the embeddings are multiplied by.
    pub embedding_scale: f32,
    /// The feed-forward gate's activation.
    pub activation: Activation,
    /// Sliding-window attention: the window, and the RoPE base of the layers that use it
    /// (all but every `SLIDING_PATTERN`th).
    pub sliding: Option<(usize, f32)>,
    /// Linear RoPE scaling of the layers that attend to the whole context: positions are
    /// multiplied by this (1 / `rope.scaling.factor`).
    pub rope_scale: f32,
    /// What query-key dot products are multiplied by: `1 / sqrt(head_dim)`, except in Gemma 3
    /// 27B (62 layers), trained with `1 / sqrt(hidden / heads)` (its `query_pre_attn_scalar`,
    /// which the GGUF does not carry; llama.cpp tells it by its size too).
    pub attention_scale: f32,
}

/// The activation of the feed-forward gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)` (qwen2, llama).
    Silu,
    /// GELU, tanh approximation (Gemma).
    GeluTanh,
}

/// Gemma 3: every sixth layer attends to the whole context, the others to a window.
const SLIDING_PATTERN: usize = 6;
/// Gemma 3's RoPE base for its sliding-window layers (llama.cpp and transformers fix it too).
const SLIDING_ROPE_BASE: f32 = 10_000.0;

impl Config {
    /// Reads the hyperparameters and checks them for range and consistency with each other
    /// and with the embedding tensor; fails on architectures this transformer does not
    /// implement.
    pub fn from_gguf(f: &GgufFile<'_>) -> Result<Self> {
        let arch = f.string("general.architecture")?;
        let rope_style = match arch.as_str() {
            "qwen2" | "gemma3" => RopeStyle::Halves,
            "llama" => RopeStyle::Interleaved,
            _ => {
                return Err(Error::UnsupportedArchitecture {
                    path: f.path.clone(),
                    arch,
                })
            }
        };
        let bad = |reason: String| Error::BadModelFile {
            path: f.path.clone(),
            reason,
        };
        let key = |k: &str| format!("{arch}.{k}");
        let ranged = |k: &str, max: usize| -> Result<usize> {
            let v = f.usize(&key(k))?;
            if (1..=max).contains(&v) {
                Ok(v)
            } else {
                Err(bad(format!(
                    "metadata `{}` is {v}, expected 1 to {max}",
                    key(k)
                )))
            }
        };
        let hidden = ranged("embedding_length", 1 << 16)?;
        let heads = ranged("attention.head_count", 1 << 10)?;
        let kv_heads = match f.get(&key("attention.head_count_kv")) {
            None => heads,
            Some(_) => ranged("attention.head_count_kv", heads)?,
        };
        if heads % kv_heads != 0 {
            return Err(bad(format!(
                "{heads} attention heads cannot be shared evenly by {kv_heads} key-value heads"
            )));
        }
        // The head width: given (Gemma), or the embedding shared by the heads.
        let head_dim = match f.get(&key("attention.key_length")) {
            Some(_) => ranged("attention.key_length", 1 << 12)?,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(bad(format!(
                    "embedding length {hidden} is not shared evenly by {heads} heads"
                )))
            }
        };
        if head_dim % 2 != 0 {
            return Err(bad(format!("head dimension {head_dim} is odd")));
        }
        if f.get(&key("attention.value_length")).is_some()
            && ranged("attention.value_length", 1 << 12)? != head_dim
        {
            return Err(bad(format!(
                "value heads differ in width from the key heads ({head_dim}), which is not supported"
            )));
        }
        let positive = |k: &str, default: f32| -> Result<f32> {
            let v = f.f32_or(&key(k), default)?;
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(bad(format!(
                    "metadata `{}` is {v}, expected a positive number",
                    key(k)
                )))
            }
        };
        let vocab = match f.dims("token_embd.weight") {
            Some(&[vocab, cols]) if cols == hidden => vocab,
            Some(dims) => {
                return Err(bad(format!(
                    "tensor `token_embd.weight` has shape {dims:?}, expected [vocabulary, {hidden}]"
                )))
            }
            None => return Err(bad("tensor `token_embd.weight` is missing".into())),
        };
        if f.get(&key("rope.dimension_count")).is_some()
            && ranged("rope.dimension_count", 1 << 12)? != head_dim
        {
            return Err(bad(format!(
                "RoPE rotates part of each head only (metadata `{}`), which is not supported",
                key("rope.dimension_count")
            )));
        }
        let gemma = arch == "gemma3";
        let sliding = match gemma {
            true => Some((
                ranged("attention.sliding_window", 1 << 24)?,
                SLIDING_ROPE_BASE,
            )),
            false => None,
        };
        let layers = ranged("block_count", 1 << 10)?;
        Ok(Self {
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            feed_forward: ranged("feed_forward_length", 1 << 20)?,
            vocab,
            context_length: ranged("context_length", 1 << 24)?,
            rms_eps: positive("attention.layer_norm_rms_epsilon", 1e-6)?,
            rope_base: positive("rope.freq_base", 10_000.0)?,
            rope_style,
            embedding_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            sliding,
            attention_scale: match (gemma, layers) {
                (true, 62) => 1.0 / ((hidden / heads) as f32).sqrt(),
                _ => 1.0 / (head_dim as f32).sqrt(),
            },
            // As llama.cpp reads it: linear unless a type says otherwise, by
            // `rope.scaling.factor`, else by the older `rope.scale_linear`, else none.
            rope_scale: match f
                .get(&key("rope.scaling.type"))
                .map(|_| f.string(&key("rope.scaling.type")))
                .transpose()?
                .as_deref()
            {
                Some("none") => 1.0,
                None | Some("linear") => match f.get(&key("rope.scaling.factor")) {
                    Some(_) => 1.0 / positive("rope.scaling.factor", 1.0)?,
                    None => 1.0 / positive("rope.scale_linear", 1.0)?,
                },
                Some(other) => {
                    return Err(bad(format!(
                        "RoPE scaling `{other}` is not supported (only `linear`)"
                    )))
                }
            },
            arch,
        })
    }

    /// The window of recent positions layer `i` attends to, if it attends to a window only.
    fn window(&self, i: usize) -> Option<usize> {
        self.sliding
            .filter(|_| !(i + 1).is_multiple_of(SLIDING_PATTERN))
            .map(|(w, _)| w)
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Queries, keys and values.
    qkv: Stacked,
    bias_q: Option<Vec<f32>>,
    bias_k: Option<Vec<f32>>,
    bias_v: Option<Vec<f32>>,
    /// Per-head norms of queries and keys (Gemma).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    wo: QWeight,
    /// Norm of the attention output before it is added (Gemma).
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// The feed-forward gate and up projections.
    gate_up: Stacked,
    down: QWeight,
    /// Norm of the feed-forward output before it is added (Gemma).
    post_ffn_norm: Option<Vec<f32>>,
    /// Attends only to this many recent positions.
    window: Option<usize>,
}

/// Immutable weights, shared (through `Arc`) by every model instance that uses them.
pub struct Weights {
    /// The hyperparameters.
    pub config: Config,
    /// The matmul kernels the weights are packed for.
    pub kernels: Kernels,
    embeddings: QWeight,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    /// `None` when the output projection is tied to the embeddings.
    output: Option<QWeight>,
    inv_freq: Vec<f32>,
    /// RoPE frequencies of the sliding-window layers.
    inv_freq_sliding: Vec<f32>,
}

impl Weights {
    /// Reads every tensor of `f`, packed for `kernels`; `progress(done, total)` per layer.
    pub fn load(
        f: &mut GgufFile<'_>,
        kernels: Kernels,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let config = Config::from_gguf(f)?;
        let c = &config;
        let (d, qd, kvd, ff) = (
            c.hidden,
            c.heads * c.head_dim,
            c.kv_heads * c.head_dim,
            c.feed_forward,
        );
        let embeddings = f.tensor("token_embd.weight", &[c.vocab, d], kernels)?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            progress(i, c.layers);
            let name = |t: &str| format!("blk.{i}.{t}");
            let mut w = |t: &str, dims: &[usize]| f.tensor(&name(t), dims, kernels);
            let vector = |f: &mut GgufFile, t: &str, len: usize| -> Result<Vec<f32>> {
                Ok(f.tensor(&name(t), &[len], kernels)?.to_vec())
            };
            let wq = w("attn_q.weight", &[qd, d])?;
            let wk = w("attn_k.weight", &[kvd, d])?;
            let wv = w("attn_v.weight", &[kvd, d])?;
            let wo = w("attn_output.weight", &[d, qd])?;
            let gate = w("ffn_gate.weight", &[ff, d])?;
            let up = w("ffn_up.weight", &[ff, d])?;
            let down = w("ffn_down.weight", &[d, ff])?;
            let optional = |f: &mut GgufFile, t: &str, len: usize| -> Result<Option<Vec<f32>>> {
                match f.has_tensor(&name(t)) {
                    true => vector(f, t, len).map(Some),
                    false => Ok(None),
                }
            };
            // Gemma's norms are required of it (a file missing one is damaged).
            let gemma = |f: &mut GgufFile, t: &str, len: usize| -> Result<Option<Vec<f32>>> {
                match c.sliding.is_some() {
                    true => vector(f, t, len).map(Some),
                    false => Ok(None),
                }
            };
            layers.push(Layer {
                attn_norm: vector(f, "attn_norm.weight", d)?,
                qkv: Stacked::new(vec![wq, wk, wv]),
                bias_q: optional(f, "attn_q.bias", qd)?,
                bias_k: optional(f, "attn_k.bias", kvd)?,
                bias_v: optional(f, "attn_v.bias", kvd)?,
                q_norm: gemma(f, "attn_q_norm.weight", c.head_dim)?,
                k_norm: gemma(f, "attn_k_norm.weight", c.head_dim)?,
                wo,
                post_attn_norm: gemma(f, "post_attention_norm.weight", d)?,
                ffn_norm: vector(f, "ffn_norm.weight", d)?,
                gate_up: Stacked::new(vec![gate, up]),
                down,
                post_ffn_norm: gemma(f, "post_ffw_norm.weight", d)?,
                window: c.window(i),
            });
        }
        progress(c.layers, c.layers);
        let out_norm = f.tensor("output_norm.weight", &[d], kernels)?.to_vec();
        let output = if f.has_tensor("output.weight") {
            Some(f.tensor("output.weight", &[c.vocab, d], kernels)?)
        } else {
            None
        };
        let frequencies = |base: f32, scale: f32| -> Vec<f32> {
            let hd = config.head_dim;
            (0..hd / 2)
                .map(|i| scale / base.powf(2.0 * i as f32 / hd as f32))
                .collect()
        };
        let mut inv_freq = frequencies(config.rope_base, config.rope_scale);
        // Llama 3's long-context RoPE: a divisor per frequency, slowing the low ones.
        if f.has_tensor("rope_freqs.weight") {
            let divisors = f.tensor("rope_freqs.weight", &[inv_freq.len()], kernels)?;
            for (v, d) in inv_freq.iter_mut().zip(divisors.to_vec()) {
                if !(d.is_finite() && d > 0.0) {
                    return Err(f.bad(format!(
                        "tensor `rope_freqs.weight` holds {d}, expected positive RoPE frequency divisors"
                    )));
                }
                *v /= d;
            }
        }
        // A tensor left over belongs to a variant this code does not compute (biases of other
        // projections, experts, a second norm): loading without it would give other logits.
        if let Some(name) = f.unread_tensor() {
            return Err(f.bad(format!(
                "tensor `{name}` is not one the {} transformer uses: the file is of a variant \
                 it does not implement",
                config.arch
            )));
        }
        let inv_freq_sliding = match config.sliding {
            Some((_, base)) => frequencies(base, 1.0),
            None => inv_freq.clone(),
        };
        Ok(Self {
            config,
            kernels,
            embeddings,
            layers,
            out_norm,
            output,
            inv_freq,
            inv_freq_sliding,
        })
    }

    fn output(&self) -> &QWeight {
        self.output.as_ref().unwrap_or(&self.embeddings)
    }

    /// Width of a logits row.
    pub fn vocab_size(&self) -> usize {
        self.output().rows()
    }

    /// The most positions an instance holds: `limit` if given, at most the trained context.
    pub fn max_len(&self, limit: Option<usize>) -> usize {
        let trained = self.config.context_length;
        limit.map_or(trained, |m| m.min(trained))
    }

    /// Number of weights (embeddings counted once when tied).
    pub fn param_count(&self) -> usize {
        let size = |w: &QWeight| w.rows() * w.cols();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.params() + size(&l.wo) + l.gate_up.params() + size(&l.down))
            .sum();
        layers + size(&self.embeddings) + self.output.as_ref().map_or(0, size)
    }
}

/// A model instance: shared weights plus its own KV cache.
pub struct Transformer {
    name: String,
    weights: Arc<Weights>,
    cache: KvCache,
    max_len: usize,
    /// The output projection's rows for a trimmed vocabulary, and their token ids.
    trimmed: Option<(QWeight, Vec<u32>)>,
}

impl Transformer {
    /// A fresh instance over `weights`, whose context holds at most `max_len` tokens
    /// (capped at the model's trained context length).
    pub fn new(name: impl Into<String>, weights: Arc<Weights>, max_len: Option<usize>) -> Self {
        let c = &weights.config;
        let max_len = weights.max_len(max_len);
        Self {
            name: name.into(),
            cache: KvCache::new(c.layers, c.kv_heads, c.head_dim),
            weights,
            max_len,
            trimmed: None,
        }
    }

    /// [`Model::forward`]'s work: the layers, then the output projection over the whole
    /// vocabulary or the trimmed one.
    fn logits(&mut self, tokens: &[u32]) -> Result<Logits> {
        let hidden = self.hidden(tokens)?;
        let w = &*self.weights;
        let vocab = w.vocab_size();
        if tokens.is_empty() {
            return Ok(Logits::new(Vec::new(), vocab));
        }
        let Some((out, ids)) = &self.trimmed else {
            let mut data = vec![0f32; tokens.len() * vocab];
            time(Section::Output, || w.output().matmul(&hidden, &mut data))?;
            return Ok(Logits::new(data, vocab));
        };
        let mut some = vec![0f32; tokens.len() * ids.len()];
        time(Section::Output, || out.matmul(&hidden, &mut some))?;
        let mut data = vec![f32::NEG_INFINITY; tokens.len() * vocab];
        for (row, logits) in data.chunks_mut(vocab).zip(some.chunks(ids.len())) {
            for (&t, &l) in ids.iter().zip(logits) {
                row[t as usize] = l;
            }
        }
        Ok(Logits::new(data, vocab))
    }

    /// Runs the layers over `tokens` at the next positions; returns the final hidden rows.
    fn hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let w = &*self.weights;
        let c = &w.config;
        let (m, d, hd) = (tokens.len(), c.hidden, c.head_dim);
        let pos0 = self.cache.len();
        if pos0 + m > self.max_len {
            return Err(Error::PromptTooLong {
                model: self.name.clone(),
                prompt: pos0 + m,
                context: self.max_len,
            });
        }
        if m == 0 {
            // Nothing to attend from (and no work to split between threads).
            return Ok(Vec::new());
        }
        let vocab = w.embeddings.rows();
        let mut x = vec![0f32; m * d];
        for (row, &t) in x.chunks_mut(d).zip(tokens) {
            if t as usize >= vocab {
                return Err(Error::Tokenizer(format!(
                    "token id {t} is outside the vocabulary of `{}` ({vocab} tokens)",
                    self.name
                )));
            }
            time(Section::Embed, || w.embeddings.row(t as usize, row));
        }
        if c.embedding_scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= c.embedding_scale);
        }
        let (qd, kvd, ffd) = (c.heads * hd, c.kv_heads * hd, c.feed_forward);
        let heads = Heads {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: hd,
            scale: c.attention_scale,
            variant: Variant::for_kernels(w.kernels),
        };
        let mut h = vec![0f32; m * d];
        let (mut q, mut k, mut v) = (vec![0f32; m * qd], vec![0f32; m * kvd], vec![0f32; m * kvd]);
        let mut att = vec![0f32; m * qd];
        let mut proj = vec![0f32; m * d];
        let mut g = vec![0f32; m * ffd];
        // The stacked products' outputs, by run.
        let (mut qkv, mut gate_up) = (Vec::new(), Vec::new());
        for (li, l) in w.layers.iter().enumerate() {
            time(Section::Norm, || {
                rms_norm(&x, &l.attn_norm, c.rms_eps, &mut h)
            });
            time(Section::Qkv, || -> Result<()> {
                l.qkv.matmul(&h, &mut qkv)?;
                for (i, x) in [&mut q, &mut k, &mut v].into_iter().enumerate() {
                    let width = x.len() / m;
                    for (r, row) in x.chunks_mut(width).enumerate() {
                        row.copy_from_slice(l.qkv.part(&qkv, i, r));
                    }
                }
                add_bias(&mut q, l.bias_q.as_deref());
                add_bias(&mut k, l.bias_k.as_deref());
                add_bias(&mut v, l.bias_v.as_deref());
                Ok(())
            })?;
            time(Section::Norm, || {
                norm_in_place(&mut q, l.q_norm.as_deref(), c.rms_eps);
                norm_in_place(&mut k, l.k_norm.as_deref(), c.rms_eps);
            });
            let inv_freq = match l.window {
                Some(_) => &w.inv_freq_sliding,
                None => &w.inv_freq,
            };
            time(Section::Rope, || {
                rope(&mut q, c.heads, hd, pos0, inv_freq, c.rope_style);
                rope(&mut k, c.kv_heads, hd, pos0, inv_freq, c.rope_style);
            });
            self.cache.append(li, &k, &v);
            let (keys, values) = self.cache.layer(li);
            time(Section::Attention, || {
                attention(&q, keys, values, pos0, heads, l.window, &mut att)
            });
            time(Section::AttnOut, || l.wo.matmul(&att, &mut proj))?;
            time(Section::Norm, || {
                norm_in_place(&mut proj, l.post_attn_norm.as_deref(), c.rms_eps)
            });
            add(&mut x, &proj);
            time(Section::Norm, || {
                rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h)
            });
            time(Section::GateUp, || -> Result<()> {
                l.gate_up.matmul(&h, &mut gate_up)?;
                for (r, row) in g.chunks_mut(ffd).enumerate() {
                    let part = |i| l.gate_up.part(&gate_up, i, r);
                    let (gate, up) = (part(0), part(1));
                    match c.activation {
                        Activation::Silu => silu_mul(gate, up, row),
                        Activation::GeluTanh => gelu_tanh_mul(gate, up, row),
                    }
                }
                Ok(())
            })?;
            time(Section::Down, || l.down.matmul(&g, &mut proj))?;
            time(Section::Norm, || {
                norm_in_place(&mut proj, l.post_ffn_norm.as_deref(), c.rms_eps)
            });
            add(&mut x, &proj);
        }
        self.cache.commit(m);
        rms_norm(&x.clone(), &w.out_norm, c.rms_eps, &mut x);
        Ok(x)
    }
}

impl Model for Transformer {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Logits> {
        // A failure anywhere, the output projection included, leaves the cache as it was.
        let start = self.cache.len();
        self.logits(tokens)
            .inspect_err(|_| self.cache.truncate(start))
    }

    fn restrict_vocabulary(&mut self, tokens: Option<&[u32]>) -> Result<()> {
        let vocab = self.weights.vocab_size();
        self.trimmed = match tokens {
            None => None,
            Some([]) => {
                return Err(Error::config(
                    &self.name,
                    "cannot score an empty vocabulary: give at least one token",
                ))
            }
            Some(ids) => {
                if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(Error::config(
                        &self.name,
                        format!("cannot score token id {t}: the vocabulary has {vocab} tokens"),
                    ));
                }
                let out = self.weights.output();
                Some((out.select_rows(ids), ids.to_vec()))
            }
        };
        Ok(())
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        // Rows are independent, so chunking changes nothing; a failed chunk undoes the others.
        let start = self.cache.len();
        crate::profile::reading(|| {
            tokens
                .chunks(super::PREFILL_CHUNK)
                .try_for_each(|chunk| self.hidden(chunk).map(drop))
        })
        .inspect_err(|_| self.cache.truncate(start))
    }

    fn len(&self) -> usize {
        self.cache.len()
    }

    fn truncate(&mut self, len: usize) {
        self.cache.truncate(len)
    }

    fn vocab_size(&self) -> usize {
        self.weights.vocab_size()
    }

    fn max_len(&self) -> usize {
        self.max_len
    }
}

crate::vecmath::fast_path! {
    /// `out = silu(g) * u`, element by element.
    fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        for ((o, &g), u) in out.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + crate::vecmath::exp(-g)) * u;
        }
    }
}

crate::vecmath::fast_path! {
    /// `g = gelu(g) * u`, element by element, GELU in its tanh approximation, computed as
    /// `x * sigmoid(2 inner)` (the same function: `(1 + tanh(z)) / 2 = sigmoid(2z)`) with
    /// [`crate::vecmath::exp`], so that the loop vectorizes (`tanh` is a library call per
    /// value).
    fn gelu_tanh_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        for ((o, &x), u) in out.iter_mut().zip(g).zip(u) {
            let inner = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
            *o = x / (1.0 + crate::vecmath::exp(-2.0 * inner)) * u;
        }
    }
}

/// RMS-normalizes every `weight.len()` values of `x` in place (each head of a row, or each
/// row), if there is a weight.
fn norm_in_place(x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    if let Some(weight) = weight {
        for row in x.chunks_mut(weight.len()) {
            let scale = rms_scale(row, eps);
            row.iter_mut()
                .zip(weight)
                .for_each(|(v, &w)| *v = *v * scale * w);
        }
    }
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let scale = rms_scale(xr, eps);
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(weight) {
            *o = xv * scale * wv;
        }
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ss + eps).sqrt()
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        x.chunks_mut(b.len()).for_each(|row| add(row, b));
    }
}

/// Rotates every head of every row; a row holds `heads * head_dim` values of the token at
/// position `pos0 + row`.
fn rope(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    pos0: usize,
    inv_freq: &[f32],
    style: RopeStyle,
) {
    let half = head_dim / 2;
    let mut sincos = vec![(0f32, 0f32); half];
    for (t, row) in x.chunks_mut(heads * head_dim).enumerate() {
        let pos = (pos0 + t) as f32;
        for (sc, &f) in sincos.iter_mut().zip(inv_freq) {
            *sc = (pos * f).sin_cos();
        }
        for head in row.chunks_mut(head_dim) {
            for (i, &(sin, cos)) in sincos.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Halves => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use std::path::Path;

    /// GELU as `x * sigmoid(2 inner)` is the tanh form, to float precision, over the range
    /// activations take, and `u` multiplies it.
    #[test]
    fn gelu_is_its_tanh_approximation() {
        let xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.006).collect();
        let u: Vec<f32> = xs.iter().map(|x| 1.5 - x.abs() * 0.01).collect();
        let mut g = vec![0f32; xs.len()];
        gelu_tanh_mul(&xs, &u, &mut g);
        for ((&x, &u), &got) in xs.iter().zip(&u).zip(&g) {
            let x64 = x as f64;
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044_715 * x64.powi(3));
            let want = 0.5 * x64 * (1.0 + inner.tanh()) * u as f64;
            let err = (got as f64 - want).abs();
            assert!(
                err <= 4e-6 * want.abs() + 1e-7,
                "gelu({x}) * {u} = {got}, want {want}"
            );
        }
    }

    /// A metadata value of a test GGUF file.
    enum Meta {
        U32(u32),
        Str(&'static str),
        F32(f32),
    }

    /// A GGUF file (version 3, F32 tensors) of a tiny llama model with random weights: hidden
    /// 32, 4 heads of 8, one layer, 16 tokens; plus `meta` and `extra` tensors.
    fn tiny_llama(meta: &[(&str, Meta)], extra: &[(&str, Vec<f32>)]) -> Vec<u8> {
        let (d, vocab) = (32usize, 16usize);
        let mut rng = 1u64;
        let mut random = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    rng = rng
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                })
                .collect()
        };
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
            (
                "token_embd.weight".into(),
                vec![vocab, d],
                random(vocab * d),
            ),
            ("output_norm.weight".into(), vec![d], vec![1.0; d]),
        ];
        for t in ["attn_norm", "ffn_norm"] {
            tensors.push((format!("blk.0.{t}.weight"), vec![d], vec![1.0; d]));
        }
        for t in [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            tensors.push((format!("blk.0.{t}.weight"), vec![d, d], random(d * d)));
        }
        for (name, data) in extra {
            tensors.push((name.to_string(), vec![data.len()], data.clone()));
        }
        let base = [
            ("general.architecture", Meta::Str("llama")),
            ("llama.embedding_length", Meta::U32(d as u32)),
            ("llama.attention.head_count", Meta::U32(4)),
            ("llama.block_count", Meta::U32(1)),
            ("llama.feed_forward_length", Meta::U32(d as u32)),
            ("llama.context_length", Meta::U32(64)),
        ];
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend(((base.len() + meta.len()) as u64).to_le_bytes());
        for (key, value) in base.iter().chain(meta) {
            string(&mut out, key);
            match value {
                Meta::U32(v) => out.extend(4u32.to_le_bytes().into_iter().chain(v.to_le_bytes())),
                Meta::F32(v) => out.extend(6u32.to_le_bytes().into_iter().chain(v.to_le_bytes())),
                Meta::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
            }
        }
        let mut offset = 0u64;
        for (name, shape, data) in &tensors {
            string(&mut out, name);
            out.extend((shape.len() as u32).to_le_bytes());
            shape
                .iter()
                .rev()
                .for_each(|&n| out.extend((n as u64).to_le_bytes()));
            out.extend(0u32.to_le_bytes()); // F32
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64 * 4).div_ceil(32) * 32;
        }
        for (_, _, data) in &tensors {
            out.resize(out.len().div_ceil(32) * 32, 0);
            data.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        out
    }

    fn load(file: Vec<u8>) -> Result<Transformer> {
        let mut f = GgufFile::from_reader(Path::new("tiny.gguf"), Cursor::new(file))?;
        let weights = Weights::load(&mut f, Kernels::detect()?, |_, _| {})?;
        Ok(Transformer::new("tiny", Arc::new(weights), None))
    }

    fn logits(file: Vec<u8>) -> Vec<f32> {
        let tokens = [1, 5, 9, 2, 14, 7];
        let logits = load(file).unwrap().forward(&tokens).unwrap();
        (0..tokens.len())
            .flat_map(|i| logits.row(i).to_vec())
            .collect()
    }

    /// Llama 3's per-frequency RoPE divisors (`rope_freqs.weight`) are applied: divisors of 2
    /// everywhere rotate exactly as linear scaling by 2 does.
    #[test]
    fn rope_frequency_divisors_are_applied() {
        let plain = logits(tiny_llama(&[], &[]));
        let linear = logits(tiny_llama(
            &[
                ("llama.rope.scaling.type", Meta::Str("linear")),
                ("llama.rope.scaling.factor", Meta::F32(2.0)),
            ],
            &[],
        ));
        let divided = logits(tiny_llama(&[], &[("rope_freqs.weight", vec![2.0; 4])]));
        assert!(
            plain != linear,
            "scaling must change the logits to test anything"
        );
        assert!(divided == linear);
    }

    #[test]
    fn unsupported_rope_variants_are_refused() {
        let error = |meta| load(tiny_llama(&[meta], &[])).err().unwrap().to_string();
        assert_eq!(
            error(("llama.rope.scaling.type", Meta::Str("yarn"))),
            "cannot read GGUF file tiny.gguf: RoPE scaling `yarn` is not supported (only `linear`)"
        );
        assert_eq!(
            error(("llama.rope.dimension_count", Meta::U32(4))),
            "cannot read GGUF file tiny.gguf: RoPE rotates part of each head only (metadata `llama.rope.dimension_count`), which is not supported"
        );
        let divisors = load(tiny_llama(
            &[],
            &[("rope_freqs.weight", vec![1.0, 0.0, 2.0, 1.0])],
        ));
        assert_eq!(
            divisors.err().unwrap().to_string(),
            "cannot read GGUF file tiny.gguf: tensor `rope_freqs.weight` holds 0, expected positive RoPE frequency divisors"
        );
    }
}
