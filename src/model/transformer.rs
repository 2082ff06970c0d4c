//! The decoder-only transformer behind the `qwen2` and `llama` GGUF architectures.
//!
//! The two differ only in configuration: qwen2 has biases on the q/k/v projections and
//! rotates halves of each head (NeoX RoPE); llama GGUFs store q/k permuted for rotating
//! adjacent pairs. Activations are plain `f32` rows: every operation works row by row in a
//! fixed order, so a token's logits do not depend on how many tokens share its forward pass.

use crate::error::{Error, Result};
use crate::model::attention::{attention, Heads};
use crate::model::gguf::GgufFile;
use crate::model::kernels::Kernels;
use crate::model::kv_cache::KvCache;
use crate::model::qweight::QWeight;
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
    /// The GGUF architecture (`qwen2` or `llama`).
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
}

impl Config {
    /// Reads the hyperparameters and checks them for range and consistency with each other
    /// and with the embedding tensor; fails on architectures this transformer does not
    /// implement.
    pub fn from_gguf(f: &GgufFile<'_>) -> Result<Self> {
        let arch = f.string("general.architecture")?;
        let rope_style = match arch.as_str() {
            "qwen2" => RopeStyle::Halves,
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
        if hidden % heads != 0 || (hidden / heads) % 2 != 0 {
            return Err(bad(format!(
                "embedding length {hidden} over {heads} heads does not give an even head dimension"
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
        Ok(Self {
            layers: ranged("block_count", 1 << 10)?,
            hidden,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            feed_forward: ranged("feed_forward_length", 1 << 20)?,
            vocab,
            context_length: ranged("context_length", 1 << 24)?,
            rms_eps: positive("attention.layer_norm_rms_epsilon", 1e-6)?,
            rope_base: positive("rope.freq_base", 10_000.0)?,
            rope_style,
            arch,
        })
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: QWeight,
    wk: QWeight,
    wv: QWeight,
    bias_q: Option<Vec<f32>>,
    bias_k: Option<Vec<f32>>,
    bias_v: Option<Vec<f32>>,
    wo: QWeight,
    ffn_norm: Vec<f32>,
    gate: QWeight,
    up: QWeight,
    down: QWeight,
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
            let bias = |f: &mut GgufFile, t: &str, len: usize| -> Result<Option<Vec<f32>>> {
                match f.has_tensor(&name(t)) {
                    true => vector(f, t, len).map(Some),
                    false => Ok(None),
                }
            };
            layers.push(Layer {
                attn_norm: vector(f, "attn_norm.weight", d)?,
                wq,
                wk,
                wv,
                bias_q: bias(f, "attn_q.bias", qd)?,
                bias_k: bias(f, "attn_k.bias", kvd)?,
                bias_v: bias(f, "attn_v.bias", kvd)?,
                wo,
                ffn_norm: vector(f, "ffn_norm.weight", d)?,
                gate,
                up,
                down,
            });
        }
        progress(c.layers, c.layers);
        let out_norm = f.tensor("output_norm.weight", &[d], kernels)?.to_vec();
        let output = if f.has_tensor("output.weight") {
            Some(f.tensor("output.weight", &[c.vocab, d], kernels)?)
        } else {
            None
        };
        let half = config.head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                1.0 / config
                    .rope_base
                    .powf(2.0 * i as f32 / config.head_dim as f32)
            })
            .collect();
        Ok(Self {
            config,
            kernels,
            embeddings,
            layers,
            out_norm,
            output,
            inv_freq,
        })
    }

    fn output(&self) -> &QWeight {
        self.output.as_ref().unwrap_or(&self.embeddings)
    }

    /// Width of a logits row.
    pub fn vocab_size(&self) -> usize {
        self.output().rows()
    }

    /// Number of weights (embeddings counted once when tied).
    pub fn param_count(&self) -> usize {
        let size = |w: &QWeight| w.rows() * w.cols();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]
                    .into_iter()
                    .map(size)
                    .sum::<usize>()
            })
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
        let max_len = max_len.map_or(c.context_length, |m| m.min(c.context_length));
        Self {
            name: name.into(),
            cache: KvCache::new(c.layers, c.kv_heads, c.head_dim),
            weights,
            max_len,
            trimmed: None,
        }
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
        let (qd, kvd, ffd) = (c.heads * hd, c.kv_heads * hd, c.feed_forward);
        let heads = Heads {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: hd,
        };
        let mut h = vec![0f32; m * d];
        let (mut q, mut k, mut v) = (vec![0f32; m * qd], vec![0f32; m * kvd], vec![0f32; m * kvd]);
        let mut att = vec![0f32; m * qd];
        let mut proj = vec![0f32; m * d];
        let (mut g, mut u) = (vec![0f32; m * ffd], vec![0f32; m * ffd]);
        for (li, l) in w.layers.iter().enumerate() {
            time(Section::Norm, || {
                rms_norm(&x, &l.attn_norm, c.rms_eps, &mut h)
            });
            time(Section::Qkv, || -> Result<()> {
                l.wq.matmul(&h, &mut q)?;
                l.wk.matmul(&h, &mut k)?;
                l.wv.matmul(&h, &mut v)?;
                add_bias(&mut q, l.bias_q.as_deref());
                add_bias(&mut k, l.bias_k.as_deref());
                add_bias(&mut v, l.bias_v.as_deref());
                Ok(())
            })?;
            time(Section::Rope, || {
                rope(&mut q, c.heads, hd, pos0, &w.inv_freq, c.rope_style);
                rope(&mut k, c.kv_heads, hd, pos0, &w.inv_freq, c.rope_style);
            });
            self.cache.append(li, &k, &v);
            let (keys, values) = self.cache.layer(li);
            time(Section::Attention, || {
                attention(&q, keys, values, pos0, heads, &mut att)
            });
            time(Section::AttnOut, || l.wo.matmul(&att, &mut proj))?;
            add(&mut x, &proj);
            time(Section::Norm, || {
                rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h)
            });
            time(Section::GateUp, || -> Result<()> {
                l.gate.matmul(&h, &mut g)?;
                l.up.matmul(&h, &mut u)?;
                silu_mul(&mut g, &u);
                Ok(())
            })?;
            time(Section::Down, || l.down.matmul(&g, &mut proj))?;
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
        let hidden = self
            .hidden(tokens)
            .inspect_err(|_| self.cache.discard_uncommitted())?;
        let w = &*self.weights;
        let vocab = w.vocab_size();
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

    fn restrict_vocabulary(&mut self, tokens: Option<&[u32]>) -> Result<()> {
        let vocab = self.weights.vocab_size();
        self.trimmed = match tokens {
            None => None,
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
        // Chunks bound the activation memory; rows are independent, so chunking changes nothing.
        for chunk in tokens.chunks(256) {
            self.hidden(chunk)
                .inspect_err(|_| self.cache.discard_uncommitted())?;
        }
        Ok(())
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
    /// `g = silu(g) * u`, element by element.
    fn silu_mul(g: &mut [f32], u: &[f32]) {
        for (g, u) in g.iter_mut().zip(u) {
            *g = *g / (1.0 + crate::vecmath::exp(-*g)) * u;
        }
    }
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(weight) {
            *o = xv * scale * wv;
        }
    }
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
