//! AVX-512 VNNI matmul kernels for Q4_K, Q6_K and Q8_0 weights.
//!
//! A verify forward multiplies each weight matrix by k+1 activation rows. These kernels unpack
//! every weight block once and then run it against all rows, so extra rows cost only their own
//! multiply-adds (`vpmaddubsw` + `vpdpwssd`, or `vpdpbusd`), not another pass over the weights.
//!
//! Row independence is by construction: for each (weight row, activation row) pair the
//! arithmetic is the same sequence of operations whatever the number of rows (integer sums are
//! exact; the float accumulation runs block by block in a fixed order). So a forward over k
//! tokens gives bit for bit the logits of k one-token forwards.
//!
//! [`available`] tells whether the CPU has the instructions; otherwise callers use candle's
//! `vec_dot` (also row-independent, slower for many rows).

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ6K, BlockQ8K, BlockQ8_0, GgmlType};
use half::f16;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Activation rows handled by one kernel call (accumulators live on the stack).
const MAX_ROWS: usize = 16;

// Mirrors of candle's block layouts (its fields are private); sizes are checked below.
#[repr(C)]
struct Q4K {
    d: u16,
    dmin: u16,
    scales: [u8; 12],
    qs: [u8; 128],
}
#[repr(C)]
struct Q6K {
    ql: [u8; 128],
    qh: [u8; 64],
    scales: [i8; 16],
    d: u16,
}
#[repr(C)]
struct Q8K {
    d: f32,
    qs: [i8; 256],
    bsums: [i16; 16],
}
#[repr(C)]
struct Q8_0 {
    d: u16,
    qs: [i8; 32],
}
const _: () = assert!(std::mem::size_of::<Q4K>() == std::mem::size_of::<BlockQ4K>());
const _: () = assert!(std::mem::size_of::<Q6K>() == std::mem::size_of::<BlockQ6K>());
const _: () = assert!(std::mem::size_of::<Q8K>() == std::mem::size_of::<BlockQ8K>());
const _: () = assert!(std::mem::size_of::<Q8_0>() == std::mem::size_of::<BlockQ8_0>());

/// Reinterprets candle blocks as their mirror.
fn view<A, B>(a: &[A]) -> &[B] {
    debug_assert_eq!(std::mem::size_of::<A>(), std::mem::size_of::<B>());
    debug_assert!(std::mem::align_of::<A>() >= std::mem::align_of::<B>());
    // SAFETY: same size, compatible alignment, both plain bytes.
    unsafe { std::slice::from_raw_parts(a.as_ptr() as *const B, a.len()) }
}

fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Weights the kernels can multiply. Q4_K comes with its scales and mins unpacked
/// ([`q4k_unpacked_scales`]), done once at load time rather than once per block per matmul.
pub enum Weights<'a> {
    Q4K(&'a [BlockQ4K], &'a [[u8; 16]]),
    Q6K(&'a [BlockQ6K]),
    Q8_0(&'a [BlockQ8_0]),
}

/// True if this CPU runs the kernels (AVX-512 F/BW/VNNI); checked once.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::env::var("CASCADE_PORTABLE").is_err()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// True if `w` with rows of `k` values fits the kernels' block structure.
pub fn supports(w: &Weights, k: usize) -> bool {
    match w {
        Weights::Q4K(..) | Weights::Q6K(_) => k.is_multiple_of(256),
        Weights::Q8_0(_) => k.is_multiple_of(64),
    }
}

/// `dst[m x n] = lhs[m x k] x Wᵀ` for `n` weight rows of `k` values.
/// Callers check [`available`] and [`supports`] first.
pub fn matmul(w: Weights, (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
    assert!(available() && supports(&w, k));
    assert_eq!(lhs.len(), m * k);
    assert!(dst.len() >= m * n);
    #[cfg(target_arch = "x86_64")]
    match w {
        Weights::Q4K(b, scales) => {
            let acts = quantize_q8k(lhs, m, k);
            let (w, a, kb) = (view::<_, Q4K>(b), view::<_, Q8K>(&acts), k / 256);
            for_each_output(m, n, dst, |j, r0, rows, out| unsafe {
                let blocks = j * kb..(j + 1) * kb;
                q4k_rows(
                    &w[blocks.clone()],
                    &scales[blocks],
                    &a[r0 * kb..],
                    kb,
                    rows,
                    out,
                )
            });
        }
        Weights::Q6K(b) => {
            let acts = quantize_q8k(lhs, m, k);
            let (w, a, kb) = (view::<_, Q6K>(b), view::<_, Q8K>(&acts), k / 256);
            for_each_output(m, n, dst, |j, r0, rows, out| unsafe {
                q6k_rows(&w[j * kb..(j + 1) * kb], &a[r0 * kb..], kb, rows, out)
            });
        }
        Weights::Q8_0(b) => {
            let acts = Q8_0Acts::new(lhs, m, k);
            let (w, kb) = (view::<_, Q8_0>(b), k / 32);
            for_each_output(m, n, dst, |j, r0, rows, out| unsafe {
                q8_0_rows(&w[j * kb..(j + 1) * kb], &acts, r0, rows, out)
            });
        }
    }
}

fn quantize_q8k(lhs: &[f32], m: usize, k: usize) -> Vec<BlockQ8K> {
    let kb = k / 256;
    let mut acts = vec![BlockQ8K::zeros(); m * kb];
    for (row, out) in lhs.chunks(k).zip(acts.chunks_mut(kb)) {
        BlockQ8K::from_float(row, out);
    }
    acts
}

/// Q8_0 activations as kernel input: quantized as candle does, then stored as contiguous
/// unsigned bytes (value + 128, for `vpdpbusd`) and per-block scales.
struct Q8_0Acts {
    k: usize,
    bytes: Vec<u8>,
    scales: Vec<f32>,
}

impl Q8_0Acts {
    fn new(lhs: &[f32], m: usize, k: usize) -> Self {
        let kb = k / 32;
        let mut blocks = vec![BlockQ8_0::zeros(); m * kb];
        for (row, out) in lhs.chunks(k).zip(blocks.chunks_mut(kb)) {
            BlockQ8_0::from_float(row, out);
        }
        let blocks = view::<_, Q8_0>(&blocks);
        Self {
            k,
            bytes: blocks
                .iter()
                .flat_map(|b| b.qs.map(|q| (q as u8) ^ 0x80))
                .collect(),
            scales: blocks.iter().map(|b| f16_to_f32(b.d)).collect(),
        }
    }
}

/// Runs `f(weight_row, first_act_row, rows, out)` over every weight row and group of at most
/// `MAX_ROWS` activation rows, in parallel over weight rows (on candle's spinning thread
/// pool: a decode step makes ~200 small matmuls, so wake-up latency matters), scattering
/// `out` into `dst`.
fn for_each_output(
    m: usize,
    n: usize,
    dst: &mut [f32],
    f: impl Fn(usize, usize, usize, &mut [f32; MAX_ROWS]) + Sync,
) {
    const CHUNK: usize = 16;
    struct Dst(*mut f32);
    // SAFETY: every (row, column) of dst is written by exactly one task.
    unsafe impl Sync for Dst {}
    let dst = Dst(dst.as_mut_ptr());
    let dst = &dst;
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |chunks| {
        let mut out = [0f32; MAX_ROWS];
        for j in chunks.start * CHUNK..n.min(chunks.end * CHUNK) {
            for r0 in (0..m).step_by(MAX_ROWS) {
                let rows = (m - r0).min(MAX_ROWS);
                f(j, r0, rows, &mut out);
                for (r, &v) in out[..rows].iter().enumerate() {
                    unsafe { *dst.0.add((r0 + r) * n + j) = v };
                }
            }
        }
    });
}

/// The 6-bit scales (bytes 0..8) and mins (bytes 8..16) of each Q4_K block's sub-blocks.
pub fn q4k_unpacked_scales(blocks: &[BlockQ4K]) -> Vec<[u8; 16]> {
    view::<_, Q4K>(blocks)
        .iter()
        .map(|b| {
            let (s, mut out) = (&b.scales, [0u8; 16]);
            for j in 0..8 {
                (out[j], out[8 + j]) = if j < 4 {
                    (s[j] & 63, s[j + 4] & 63)
                } else {
                    (
                        (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
                        (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                    )
                };
            }
            out
        })
        .collect()
}

/// `[a; n], [a + 1; n], ...` as 32 i16 lane indices for `vpermw`.
const fn lane_index(first: i16, repeat: usize) -> [i16; 32] {
    let mut idx = [0i16; 32];
    let mut t = 0;
    while t < 32 {
        idx[t] = first + (t / repeat) as i16;
        t += 1;
    }
    idx
}

// Q4_K: zmm j holds sub-blocks 2j, 2j+1 (32 values each): i16 lane t has scale 2j + t/16.
const Q4K_SCALE_IDX: [[i16; 32]; 4] = [
    lane_index(0, 16),
    lane_index(2, 16),
    lane_index(4, 16),
    lane_index(6, 16),
];
// Q6_K: zmm i holds 64 values in 16-value groups 4i..4i+4: i16 lane t has scale 4i + t/8.
const Q6K_SCALE_IDX: [[i16; 32]; 4] = [
    lane_index(0, 8),
    lane_index(4, 8),
    lane_index(8, 8),
    lane_index(12, 8),
];

/// One Q4_K weight row against `rows` Q8_K activation rows (`acts[r * kb + b]`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn q4k_rows(
    w: &[Q4K],
    scales: &[[u8; 16]],
    acts: &[Q8K],
    kb: usize,
    rows: usize,
    out: &mut [f32; MAX_ROWS],
) {
    // Per row: 16 lanes of scaled sums, and 8 lanes of min corrections; reduced at the end.
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    let mut acc_min = [_mm256_setzero_ps(); MAX_ROWS];
    let m4 = _mm512_set1_epi8(0x0f);
    let idx = Q4K_SCALE_IDX.map(|i| _mm512_loadu_si512(i.as_ptr() as *const __m512i));
    for (b, (x, sm)) in w.iter().zip(scales).enumerate() {
        let (dw, dminw) = (f16_to_f32(x.d), f16_to_f32(x.dmin));
        let sm = _mm_loadu_si128(sm.as_ptr() as *const __m128i);
        let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sm));
        let mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        // Each min twice: bsums come per 16 values, mins per 32.
        let mins = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_unpacklo_epi16(mn16, mn16)),
            _mm_unpackhi_epi16(mn16, mn16),
            1,
        );
        // 64 bytes of nibbles cover two 64-value chunks: [low j, low j+1] and [high j, high j+1];
        // a chunk is its 32 low nibbles then its 32 high nibbles.
        let mut wv = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let q = _mm512_loadu_si512(x.qs.as_ptr().add(64 * h) as *const __m512i);
            let lo = _mm512_and_si512(q, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            wv[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0b01_00_01_00);
            wv[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0b11_10_11_10);
        }
        let sv = idx.map(|i| _mm512_permutexvar_epi16(i, sc16));
        for r in 0..rows {
            let a = &acts[r * kb + b];
            let mut s = _mm512_setzero_si512();
            for j in 0..4 {
                let av = _mm512_loadu_si512(a.qs.as_ptr().add(64 * j) as *const __m512i);
                s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[j], av), sv[j]);
            }
            // Lane sums are below 2^24, so the conversions are exact.
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a.d * dw), acc[r]);
            let bsums = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
            let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins));
            acc_min[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.d * dminw), acc_min[r]);
        }
    }
    for r in 0..rows {
        out[r] =
            _mm512_reduce_add_ps(acc[r]) - _mm512_reduce_add_ps(_mm512_castps256_ps512(acc_min[r]));
    }
}

/// One Q6_K weight row against `rows` Q8_K activation rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn q6k_rows(w: &[Q6K], acts: &[Q8K], kb: usize, rows: usize, out: &mut [f32; MAX_ROWS]) {
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    let mut acc_off = [_mm256_setzero_ps(); MAX_ROWS];
    let idx = Q6K_SCALE_IDX.map(|i| _mm512_loadu_si512(i.as_ptr() as *const __m512i));
    let (m4, m3) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(3));
    for (b, x) in w.iter().enumerate() {
        let d = f16_to_f32(x.d);
        let sc16y = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.scales.as_ptr() as *const __m128i));
        let sc16 = _mm512_castsi256_si512(sc16y);
        // Per 128 values: 64 bytes of low nibbles, 32 bytes of 2-bit highs. Values 0..64 are
        // [low nibbles | highs bits 0-1 and 2-3], values 64..128 [high nibbles | bits 4-5, 6-7].
        let mut wv = [_mm512_setzero_si512(); 4];
        for n in 0..2 {
            let ql = _mm512_loadu_si512(x.ql.as_ptr().add(64 * n) as *const __m512i);
            let h = _mm256_loadu_si256(x.qh.as_ptr().add(32 * n) as *const __m256i);
            let hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            let high_lo = _mm512_slli_epi16(_mm512_and_si512(hh, m3), 4);
            let high_hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hh, 4), m3), 4);
            wv[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, m4), high_lo);
            wv[2 * n + 1] =
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), high_hi);
        }
        let sv = idx.map(|i| _mm512_permutexvar_epi16(i, sc16));
        for r in 0..rows {
            let a = &acts[r * kb + b];
            let mut s = _mm512_setzero_si512();
            for i in 0..4 {
                let av = _mm512_loadu_si512(a.qs.as_ptr().add(64 * i) as *const __m512i);
                s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[i], av), sv[i]);
            }
            let scale = a.d * d;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(scale), acc[r]);
            // Weights are stored as q + 32: subtract 32 * sum(scale_g * sum of group g).
            let bsums = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
            let off = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, sc16y));
            acc_off[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(32.0 * scale), acc_off[r]);
        }
    }
    for r in 0..rows {
        out[r] =
            _mm512_reduce_add_ps(acc[r]) - _mm512_reduce_add_ps(_mm512_castps256_ps512(acc_off[r]));
    }
}

/// One Q8_0 weight row against activation rows `r0..r0 + rows`, two 32-value blocks at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn q8_0_rows(
    w: &[Q8_0],
    acts: &Q8_0Acts,
    r0: usize,
    rows: usize,
    out: &mut [f32; MAX_ROWS],
) {
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    let bias = _mm512_set1_epi8(-128); // 0x80 bytes: 128 as the unsigned operand
    let kb = acts.k / 32;
    for p in 0..w.len() / 2 {
        let (x0, x1) = (&w[2 * p], &w[2 * p + 1]);
        let lo = _mm256_loadu_si256(x0.qs.as_ptr() as *const __m256i);
        let hi = _mm256_loadu_si256(x1.qs.as_ptr() as *const __m256i);
        let wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        // Activations are stored as a + 128: subtract 128 * (sum of each lane's 4 weights).
        let offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wv);
        let ws = _mm512_mask_blend_ps(
            0xff00,
            _mm512_set1_ps(f16_to_f32(x0.d)),
            _mm512_set1_ps(f16_to_f32(x1.d)),
        );
        for (r, acc) in acc[..rows].iter_mut().enumerate() {
            let row = r0 + r;
            let av = _mm512_loadu_si512(
                acts.bytes.as_ptr().add(row * acts.k + 64 * p) as *const __m512i
            );
            let s = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), av, wv), offset);
            let sa = &acts.scales[row * kb + 2 * p..];
            let as_ = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(sa[0]), _mm512_set1_ps(sa[1]));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, as_), *acc);
        }
    }
    for (o, acc) in out[..rows].iter_mut().zip(&acc[..rows]) {
        *o = _mm512_reduce_add_ps(*acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Dequantize the weights, quantize nothing else: a plain f32 reference.
    fn reference<T: GgmlType>(w: &[T], m: usize, k: usize, n: usize, lhs: &[f32]) -> Vec<f32> {
        let mut wf = vec![0f32; n * k];
        T::to_float(w, &mut wf);
        let mut out = vec![0f32; m * n];
        for r in 0..m {
            for j in 0..n {
                out[r * n + j] = (0..k).map(|i| lhs[r * k + i] * wf[j * k + i]).sum();
            }
        }
        out
    }

    fn check<T: GgmlType>(make: impl for<'a> Fn(&'a [T]) -> Weights<'a>, k: usize) {
        if !available() {
            eprintln!("AVX-512 VNNI not available: kernel not tested on this CPU");
            return;
        }
        let (n, m) = (24, 19);
        let mut w = vec![T::zeros(); n * k / T::BLCK_SIZE];
        T::from_float(&random(n * k, 1), &mut w);
        let lhs = random(m * k, 2);
        let mut got = vec![0f32; m * n];
        matmul(make(&w), (m, k, n), &lhs, &mut got);
        // Close to the f32 reference (activation quantization costs some precision) ...
        let want = reference(&w, m, k, n, &lhs);
        let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (g, r) in got.iter().zip(&want) {
            assert!((g - r).abs() <= 0.02 * scale, "{g} vs {r}");
        }
        // ... close to candle's vec_dot path ...
        let mut candle = vec![0f32; m * n];
        k_quants::matmul((m, k, n), &lhs, &w, &mut candle).unwrap();
        for (g, c) in got.iter().zip(&candle) {
            assert!((g - c).abs() <= 1e-4 * scale.max(1.0), "{g} vs candle {c}");
        }
        // ... and every row is computed alike whatever the number of rows.
        for rows in [1, 2, 5, 16, 17] {
            let mut part = vec![0f32; rows * n];
            matmul(make(&w), (rows, k, n), &lhs[..rows * k], &mut part);
            assert!(part == got[..rows * n], "{rows} rows differ from {m}");
        }
    }

    #[test]
    fn q4k_kernel_matches_references() {
        check::<k_quants::BlockQ4K>(
            |w| Weights::Q4K(w, Box::leak(q4k_unpacked_scales(w).into_boxed_slice())),
            512,
        );
    }

    #[test]
    fn q6k_kernel_matches_references() {
        check::<k_quants::BlockQ6K>(|w| Weights::Q6K(w), 512);
    }

    #[test]
    fn q8_0_kernel_matches_references() {
        check::<k_quants::BlockQ8_0>(|w| Weights::Q8_0(w), 192);
    }
}
