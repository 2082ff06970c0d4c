//! Causal grouped-query attention over the KV cache, batched so that every key and value row
//! is read once for all the queries that share it.
//!
//! With grouped-query attention several query heads share one key-value head, and a verify
//! forward brings k query tokens. Computing each (token, head) pair on its own reads the
//! whole cache once per pair: at 1,500 tokens of context that was a third of a decode step and
//! half of an 8-token verify. Here a task takes one key-value head and a run of tokens and
//! walks the cache once, scoring every query of the group against each key, then adding each
//! value row into every query's output.
//!
//! Each query still goes through exactly the operations it would alone, in the same order
//! (its dot products, its softmax in a fixed order, its weighted sum over positions in
//! order), so a token's attention does not depend on how many tokens or heads share the
//! task, and a forward over k tokens equals k one-token forwards bit for bit.

use crate::model::kernels::Kernels;
use crate::vecmath::{exp, sum, Lanes};
use std::ops::Range;

/// The attention shape of a model, and the code its attention runs on.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    /// Query heads.
    pub heads: usize,
    /// Key-value heads (each shared by `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// What query-key dot products are multiplied by (`1 / sqrt(head_dim)`, mostly).
    pub scale: f32,
    /// The code: [`Variant::for_kernels`] of the model's matmul kernels.
    pub variant: Variant,
}

/// Most tokens a task takes: bounds its score buffer (queries x positions).
const MAX_TOKENS: usize = 16;

/// Causal attention of the `m` query rows `q` (positions `pos0..pos0 + m`, each
/// `heads * head_dim` values) over the cached `keys` and `values` (`pos0 + m` positions of
/// `kv_heads * head_dim` values, these rows' included), into `out` (laid out like `q`). With a
/// `window`, each query attends only to the last `window` positions up to its own.
pub fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    pos0: usize,
    s: Heads,
    window: Option<usize>,
    out: &mut [f32],
) {
    let (hd, group) = (s.head_dim, s.heads / s.kv_heads);
    let m = q.len() / (s.heads * hd);
    assert!(out.len() == q.len() && keys.len() >= (pos0 + m) * s.kv_heads * hd);
    // Enough tasks for every thread: runs of tokens per key-value head, and the heads of a
    // group split further when there are more threads than (head, token) pairs.
    // (candle's thread count reads the machine's CPU description: asked once.)
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let threads = *THREADS.get_or_init(|| candle_core::utils::get_num_threads().max(1));
    let per_task = (m * s.kv_heads / (2 * threads)).clamp(1, MAX_TOKENS);
    let runs = m.div_ceil(per_task);
    let head_split = threads.div_ceil(s.kv_heads * runs).min(group);
    let heads_per_task = group.div_ceil(head_split);
    let mut tasks: Vec<(Range<usize>, Range<usize>)> = Vec::new();
    for g in 0..s.kv_heads {
        for t in (0..m).step_by(per_task) {
            for h in (0..group).step_by(heads_per_task) {
                let heads = g * group + h..g * group + (h + heads_per_task).min(group);
                tasks.push((t..(t + per_task).min(m), heads));
            }
        }
    }
    let layer = Layer {
        q,
        keys,
        values,
        pos0,
        s,
        window,
    };
    struct Out(*mut f32);
    // SAFETY: each (token, head) slice of `out` is written by exactly one task.
    unsafe impl Sync for Out {}
    let ptr = Out(out.as_mut_ptr());
    let ptr = &ptr;
    let run = |range: Range<usize>| {
        let mut scores = Vec::new();
        for (tokens, heads) in &tasks[range] {
            let queries: Vec<usize> = tokens
                .clone()
                .flat_map(|t| heads.clone().map(move |h| t * s.heads + h))
                .collect();
            let mut outs: Vec<&mut [f32]> = queries
                .iter()
                // SAFETY: query i's slice lies within `out` (i < m * heads) and belongs to
                // this task alone.
                .map(|&i| unsafe { std::slice::from_raw_parts_mut(ptr.0.add(i * hd), hd) })
                .collect();
            attend(&layer, &queries, &mut outs, &mut scores);
        }
    };
    candle_core::utils::barrier_pool().execute_chunked(tasks.len(), run);
}

/// What the queries of one layer attend over: the query rows (positions `pos0..`), the cached
/// keys and values, and the attention shape.
struct Layer<'a> {
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    pos0: usize,
    s: Heads,
    window: Option<usize>,
}

/// Positions per block: a block's keys (or values) stay in the first-level cache while every
/// query of the task uses them.
const BLOCK: usize = 32;

/// Attention of `queries` (indices `token * heads + head`, all heads of one key-value head)
/// into `outs`, walking the keys once and the values once.
///
/// Per query, the arithmetic is fixed: score `j` is [`dots`] of the query and key `j` times
/// the scale; weights are `exp(score - max) / sum`, with the sum as [`sum`] takes it (eight
/// running sums over the whole 8-position chunks in order, added in a fixed tree, then the
/// positions past them in order); each output value is
/// `fma(weight_j, value_j, acc)` over positions in order. It runs on the shape's [`Variant`];
/// every variant gives the same results.
fn attend(layer: &Layer, queries: &[usize], outs: &mut [&mut [f32]], scores: &mut Vec<f32>) {
    let variant = layer.s.variant;
    assert!(
        Variant::supported().contains(&variant),
        "this CPU does not run {variant:?}"
    );
    match variant {
        // SAFETY: arrays need no CPU feature.
        Variant::Portable => unsafe { attend_with::<[f32; 8], 4, 8>(layer, queries, outs, scores) },
        #[cfg(target_arch = "x86_64")]
        Variant::Avx2 => {
            /// # Safety
            /// The CPU must have AVX2 and FMA.
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(l: &Layer, q: &[usize], outs: &mut [&mut [f32]], s: &mut Vec<f32>) {
                attend_with::<std::arch::x86_64::__m256, 4, 8>(l, q, outs, s)
            }
            // SAFETY: the CPU has AVX2 and FMA (asserted above).
            unsafe { avx2(layer, queries, outs, scores) }
        }
        #[cfg(target_arch = "x86_64")]
        Variant::Avx512 => {
            /// # Safety
            /// The CPU must have AVX2, FMA, AVX-512 F and VL.
            #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
            unsafe fn avx512(l: &Layer, q: &[usize], outs: &mut [&mut [f32]], s: &mut Vec<f32>) {
                attend_with::<std::arch::x86_64::__m256, 8, 16>(l, q, outs, s)
            }
            // SAFETY: the CPU has AVX2, FMA, AVX-512 F and VL (asserted above).
            unsafe { avx512(layer, queries, outs, scores) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the portable variant is supported here"),
    }
}

/// The code [`attend`] runs: every variant takes the same operations on 8-lane vectors, so
/// they give the same results.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Variant {
    /// Arrays, on any CPU.
    Portable,
    /// AVX2 and FMA.
    Avx2,
    /// AVX2 and FMA with the 32 registers of AVX-512 (F and VL), which hold more keys and
    /// output values at once.
    Avx512,
}

impl Variant {
    /// The variant for a model whose matmuls run on `kernels`: AVX-512's groupings with the
    /// AVX-512 kernels only, so that a forced AVX2 family (`CASCADE_KERNELS=avx2`) takes an
    /// AVX2 CPU's groupings in attention too (a `target-cpu=native` build still compiles every
    /// variant with the CPU's registers; an AVX2-only build has 16); AVX2 with the others (the
    /// fallback's included) where the CPU has AVX2 and FMA.
    pub fn for_kernels(kernels: Kernels) -> Self {
        let runs = |v| Self::supported().contains(&v);
        match kernels {
            Kernels::Avx512 if runs(Variant::Avx512) => Variant::Avx512,
            _ if runs(Variant::Avx2) => Variant::Avx2,
            _ => Variant::Portable,
        }
    }

    /// Every variant this CPU runs, slowest first (asked once).
    pub fn supported() -> &'static [Self] {
        static SUPPORTED: std::sync::OnceLock<Vec<Variant>> = std::sync::OnceLock::new();
        SUPPORTED.get_or_init(|| {
            let mut all = vec![Variant::Portable];
            #[cfg(target_arch = "x86_64")]
            if crate::vecmath::has_fma() {
                all.push(Variant::Avx2);
                if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
                    all.push(Variant::Avx512);
                }
            }
            all
        })
    }
}

/// [`attend`] on lanes `L`, scoring `KEYS` keys at a time and adding `VECS` vectors of output
/// values at a time (which changes no result: each score and each output value goes through
/// its own operations either way).
///
/// # Safety
/// The CPU must run `L`'s methods ([`Lanes`]): AVX2 and FMA for `__m256`, none for arrays.
#[inline(always)]
unsafe fn attend_with<L: Lanes, const KEYS: usize, const VECS: usize>(
    layer: &Layer,
    queries: &[usize],
    outs: &mut [&mut [f32]],
    scores: &mut Vec<f32>,
) {
    let &Layer {
        q,
        keys,
        values,
        pos0,
        s,
        window,
    } = layer;
    let hd = s.head_dim;
    let kv_row = s.kv_heads * hd;
    let kv = (queries[0] % s.heads) / (s.heads / s.kv_heads) * hd;
    let scale = s.scale;
    // Query i attends to positions start(i)..len(i), its own included.
    let len = |i: usize| pos0 + i / s.heads + 1;
    let start = |i: usize| window.map_or(0, |w| len(i).saturating_sub(w));
    let n = queries.iter().map(|&i| len(i)).max().unwrap_or(0);
    let key = |j: usize| &keys[j * kv_row + kv..j * kv_row + kv + hd];
    scores.clear();
    scores.resize(queries.len() * n, 0.0);
    for jb in (0..n).step_by(BLOCK) {
        for (x, &i) in queries.iter().enumerate() {
            let (query, end) = (&q[i * hd..(i + 1) * hd], len(i).min(jb + BLOCK));
            let row = &mut scores[x * n..(x + 1) * n];
            let mut j = jb.max(start(i));
            while j + KEYS <= end {
                let d = dots::<L, KEYS>(std::array::from_fn(|t| key(j + t)), query);
                for (t, d) in d.into_iter().enumerate() {
                    row[j + t] = d * scale;
                }
                j += KEYS;
            }
            for (j, r) in row.iter_mut().enumerate().take(end).skip(j) {
                *r = dots::<L, 1>([key(j)], query)[0] * scale;
            }
        }
    }
    for (x, &i) in queries.iter().enumerate() {
        let row = &mut scores[x * n + start(i)..x * n + len(i)];
        let max = max(row);
        row.iter_mut().for_each(|s| *s = exp(*s - max));
        let sum = sum(row);
        row.iter_mut().for_each(|s| *s /= sum);
    }
    outs.iter_mut().for_each(|o| o.fill(0.0));
    for jb in (0..n).step_by(BLOCK) {
        for (x, (&i, o)) in queries.iter().zip(outs.iter_mut()).enumerate() {
            let j0 = jb.max(start(i));
            let (first, end) = (x * n + j0, x * n + len(i).min(jb + BLOCK));
            if first >= end {
                continue;
            }
            let value = |j: usize| &values[(j0 + j) * kv_row + kv..(j0 + j + 1) * kv_row];
            accumulate::<L, VECS>(o, &scores[first..end], value);
        }
    }
}

/// The largest of `xs` (NaNs aside), as eight running maxima: a maximum does not depend on
/// the order it is taken in, and this order vectorizes (one running maximum did not: a chain
/// of dependent instructions, one per score).
#[inline(always)]
fn max(xs: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    m.into_iter()
        .chain(rest.iter().copied())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The dot products of `query` with `T` keys (sharing the query's loads). Each is the same
/// sequence of operations: eight lanes times two accumulators (even and odd 8-value chunks),
/// fused multiply-adds, the accumulators added, the lanes summed in a fixed tree, then the
/// values past the last whole chunk.
///
/// # Safety
/// The CPU must run `L`'s methods.
#[inline(always)]
unsafe fn dots<L: Lanes, const T: usize>(keys: [&[f32]; T], query: &[f32]) -> [f32; T] {
    let chunks = query.len() / 8;
    let (mut even, mut odd) = ([L::zero(); T], [L::zero(); T]);
    for c in (0..chunks).step_by(2) {
        let q0 = L::load(&query[8 * c..]);
        for t in 0..T {
            even[t] = L::fma(q0, L::load(&keys[t][8 * c..]), even[t]);
        }
        if c + 1 < chunks {
            let q1 = L::load(&query[8 * c + 8..]);
            for t in 0..T {
                odd[t] = L::fma(q1, L::load(&keys[t][8 * c + 8..]), odd[t]);
            }
        }
    }
    let acc: [L; T] = std::array::from_fn(|t| L::add(even[t], odd[t]));
    let mut sums = [0.0; T];
    for (quad, sums) in acc.chunks(4).zip(sums.chunks_mut(4)) {
        match quad {
            &[a, b, c, d] => sums.copy_from_slice(&L::sums4([a, b, c, d])),
            // The same tree, a vector at a time.
            _ => (0..quad.len()).for_each(|t| sums[t] = L::sums4([quad[t]; 4])[0]),
        }
    }
    std::array::from_fn(|t| {
        let mut d = sums[t];
        for (a, b) in query.iter().zip(keys[t]).skip(8 * chunks) {
            d = a.mul_add(*b, d);
        }
        d
    })
}

/// `o[d] = fma(weights[j], value(j)[d], o[d])` for every `d` and each `j` in order, `VECS`
/// vectors of values at a time in registers, then 8 (if `VECS` is more: a 64-wide head), then
/// one, then one value (the same operation per value in every case).
///
/// # Safety
/// The CPU must run `L`'s methods.
#[inline(always)]
unsafe fn accumulate<'a, L: Lanes, const VECS: usize>(
    o: &mut [f32],
    weights: &[f32],
    value: impl Fn(usize) -> &'a [f32],
) {
    let mut d = accumulate_runs::<L, VECS>(o, weights, &value, 0);
    if VECS > 8 {
        d = accumulate_runs::<L, 8>(o, weights, &value, d);
    }
    d = accumulate_runs::<L, 1>(o, weights, &value, d);
    for (d, o) in o.iter_mut().enumerate().skip(d) {
        for (j, &w) in weights.iter().enumerate() {
            *o = w.mul_add(value(j)[d], *o);
        }
    }
}

/// [`accumulate`]'s work from value `d` on, `VECS` vectors at a time while they fit; returns
/// where it stopped.
///
/// # Safety
/// The CPU must run `L`'s methods.
#[inline(always)]
unsafe fn accumulate_runs<'a, L: Lanes, const VECS: usize>(
    o: &mut [f32],
    weights: &[f32],
    value: &impl Fn(usize) -> &'a [f32],
    mut d: usize,
) -> usize {
    while d + 8 * VECS <= o.len() {
        let mut acc: [L; VECS] = std::array::from_fn(|v| L::load(&o[d + 8 * v..]));
        for (j, &w) in weights.iter().enumerate() {
            let (w, x) = (L::splat(w), &value(j)[d..d + 8 * VECS]);
            for (v, acc) in acc.iter_mut().enumerate() {
                *acc = L::fma(w, L::load(&x[8 * v..]), *acc);
            }
        }
        for (v, acc) in acc.iter().enumerate() {
            acc.store(&mut o[d + 8 * v..]);
        }
        d += 8 * VECS;
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each (token, head) on its own: the definition the batched version must equal.
    fn one_by_one(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        pos0: usize,
        s: Heads,
        window: Option<usize>,
    ) -> Vec<f32> {
        let hd = s.head_dim;
        let mut out = vec![0f32; q.len()];
        let mut scores = Vec::new();
        for i in 0..q.len() / hd {
            let o = &mut out[i * hd..(i + 1) * hd];
            let layer = Layer {
                q,
                keys,
                values,
                pos0,
                s,
                window,
            };
            attend(&layer, &[i], &mut [o], &mut scores);
        }
        out
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Head widths that take every path of the scores and the weighted sums: the 8-value
    /// chunks in pairs and alone, the values past the last chunk, and the output values 128
    /// and 64 at a time, then 8, then one (the 1.5B's heads are 128 wide, the 0.5B's and
    /// SmolLM2's 64).
    const SHAPES: [(usize, usize, usize); 7] = [
        (12, 2, 16),
        (9, 3, 8),
        (4, 4, 8),
        (7, 1, 12),
        (4, 2, 128),
        (3, 1, 203),
        (5, 1, 72),
    ];

    /// The shape `(heads, kv_heads, head_dim)` on `variant`.
    fn shape((heads, kv_heads, head_dim): (usize, usize, usize), variant: Variant) -> Heads {
        Heads {
            heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            variant,
        }
    }

    /// Every variant this CPU runs gives the portable variant's bits.
    #[test]
    fn every_variant_gives_the_same_bits() {
        for dims in SHAPES {
            for window in [None, Some(6)] {
                let (pos0, m, s) = (45, 3, shape(dims, Variant::Portable));
                let q = random(m * s.heads * s.head_dim, 4);
                let keys = random((pos0 + m) * s.kv_heads * s.head_dim, 5);
                let values = random((pos0 + m) * s.kv_heads * s.head_dim, 6);
                let want = one_by_one(&q, &keys, &values, pos0, s, window);
                for &v in Variant::supported() {
                    let s = shape(dims, v);
                    let got = one_by_one(&q, &keys, &values, pos0, s, window);
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert!(bits(&got) == bits(&want), "{s:?}, window {window:?}");
                }
            }
        }
    }

    /// [`attend_with`] for some lanes and groupings.
    type AttendWith = unsafe fn(&Layer, &[usize], &mut [&mut [f32]], &mut Vec<f32>);

    /// The AVX-512 variant's groupings (8 keys, 128 output values at a time) give the 4 and 64
    /// of the others' bits, checked on arrays so that a CPU without AVX-512 checks them too.
    #[test]
    fn the_groupings_change_no_bits() {
        for dims in SHAPES {
            let (pos0, m, s) = (37, 5, shape(dims, Variant::Portable));
            let q = random(m * s.heads * s.head_dim, 7);
            let keys = random((pos0 + m) * s.kv_heads * s.head_dim, 8);
            let values = random((pos0 + m) * s.kv_heads * s.head_dim, 9);
            let layer = Layer {
                q: &q,
                keys: &keys,
                values: &values,
                pos0,
                s,
                window: None,
            };
            let queries: Vec<usize> = (0..s.heads / s.kv_heads).collect();
            let run = |f: AttendWith| {
                let mut out = vec![f32::NAN; queries.len() * s.head_dim];
                let mut outs: Vec<&mut [f32]> = out.chunks_mut(s.head_dim).collect();
                // SAFETY: arrays need no CPU feature.
                unsafe { f(&layer, &queries, &mut outs, &mut Vec::new()) };
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let narrow = run(attend_with::<[f32; 8], 4, 8>);
            assert!(run(attend_with::<[f32; 8], 8, 16>) == narrow, "{s:?}");
        }
    }

    #[test]
    fn batched_attention_equals_each_query_alone_bit_for_bit() {
        for (dims, &variant) in SHAPES
            .iter()
            .flat_map(|&d| Variant::supported().iter().map(move |v| (d, v)))
        {
            let s = shape(dims, variant);
            let (heads, head_dim) = (s.heads, s.head_dim);
            for (pos0, m) in [(0, 1), (5, 1), (3, 7), (40, 19), (0, 33)] {
                for window in [None, Some(1), Some(6), Some(37)] {
                    let q = random(m * heads * head_dim, 1);
                    let keys = random((pos0 + m) * s.kv_heads * head_dim, 2);
                    let values = random((pos0 + m) * s.kv_heads * head_dim, 3);
                    let want = one_by_one(&q, &keys, &values, pos0, s, window);
                    let mut got = vec![f32::NAN; q.len()];
                    attention(&q, &keys, &values, pos0, s, window, &mut got);
                    assert!(got == want, "{s:?} pos0 {pos0} m {m} window {window:?}");
                    // And a token's output does not depend on the tokens after it.
                    let mut first = vec![f32::NAN; heads * head_dim];
                    let q0 = &q[..heads * head_dim];
                    attention(q0, &keys, &values, pos0, s, window, &mut first);
                    assert!(first[..] == want[..heads * head_dim], "{s:?} pos0 {pos0}");
                }
            }
        }
    }

    #[test]
    fn a_window_attends_to_the_last_positions_only() {
        let s = Heads {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            scale: 0.3,
            variant: *Variant::supported().last().unwrap(),
        };
        let row = s.kv_heads * s.head_dim;
        let (pos0, window) = (30, 7);
        let q = random(s.heads * s.head_dim, 1);
        let keys = random((pos0 + 1) * row, 2);
        let values = random((pos0 + 1) * row, 3);
        let mut windowed = vec![0f32; q.len()];
        attention(&q, &keys, &values, pos0, s, Some(window), &mut windowed);
        // The same query over a cache that holds only those positions.
        let from = pos0 + 1 - window;
        let mut alone = vec![0f32; q.len()];
        let (k, v) = (&keys[from * row..], &values[from * row..]);
        attention(&q, k, v, pos0 - from, s, None, &mut alone);
        assert!(windowed == alone);
        // A window wider than the context changes nothing.
        let mut full = vec![0f32; q.len()];
        attention(&q, &keys, &values, pos0, s, None, &mut full);
        let mut wide = vec![0f32; q.len()];
        attention(&q, &keys, &values, pos0, s, Some(pos0 + 1), &mut wide);
        assert!(wide == full && full != windowed);
    }
}
