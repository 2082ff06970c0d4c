//! AVX2 kernels (with FMA and F16C): `vpmaddubsw` products summed in 16 bits as far as the
//! values allow, then widened by `vpmaddwd`.
//!
//! AVX2 has no 8-bit dot product into 32 bits. `vpmaddubsw` multiplies unsigned weight bytes
//! by signed activation bytes and adds adjacent pairs into 16 bits, saturating; `vpmaddwd`
//! then widens pairs to 32 bits. The widening costs as much as the products, so the kernels
//! add the 16-bit products of several vectors first, as far as no sum can overflow: with
//! activations in -127..=127, a 16-bit product of weights below `w` is at most `2 * 127 * w`,
//! so four vectors of 5-bit weights fit (4 * 7,874 < 32,768), two of 6-bit Q6_K weights, and
//! Q8_0 weights (signed) take the usual sign transfer (`|w|` times the activation with the
//! sign of `w`) one vector at a time.
//!
//! A 64-byte vector of the layout is two 32-byte halves: groups 0-7 and groups 8-15. Formats
//! with one scale per 32 values add the two groups of each 32 with one `vphaddd` and apply
//! the scales as floats; Q6_K (one scale per 16) multiplies its integer scales into the
//! widening `vpmaddwd` itself.
//!
//! Weight vectors are unpacked once per block for up to [`GROUP`] activation rows, and each
//! (weight row, activation row) pair goes through the same operations whatever the number of
//! rows, so a k-row product equals k one-row products bit for bit.

use super::layout::{
    f16_to_f32, PackedQ4K, PackedQ4_0, PackedQ4_1, PackedQ5_0Planes, PackedQ6K, PackedQ8_0, QK,
};
use super::{for_each_output, prefetch, Tile};
use std::arch::x86_64::*;
use std::ops::Range;

/// True if this CPU has the instructions these kernels use.
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// `dst[m x n] = lhs[m x k] x Wᵀ` for `n` weight rows of `k.div_ceil(256)` blocks each.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`supported`]). Slice lengths are checked.
pub(super) unsafe fn matmul<B: Block + Sync>(
    w: &[B],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let kb = k.div_ceil(QK);
    assert!(w.len() >= n * kb && lhs.len() == m * k);
    let acts = ActBlock::quantize(lhs, m, k, B::PER32);
    for_each_output(m, n, dst, |js, r0, rows, out| {
        // SAFETY: the caller guarantees the CPU features; `js` is within the `n` rows of `w`
        // (checked above) and rows `r0..r0 + rows` within the `m` quantized rows.
        unsafe { tile(w, js, &acts[r0 * kb..], kb, rows, out) }
    });
}

/// 256 activations quantized to 8 bits, in the kernel layout, with the integer sum of each
/// 16-value group and the sum of each 32 values times its scale (for mins and offsets).
///
/// Formats with one weight scale per 256 values (Q4_K, Q6_K) take one activation scale per
/// block, as the AVX-512 kernels and candle's Q8_K do. Formats with one scale per 32 (Q4_0,
/// Q4_1, Q5_0, Q8_0) take one per 32 values, as llama.cpp's Q8_0 and Q8_1 do: an outlier
/// activation then coarsens only its own 32 values, not all 256.
#[repr(C, align(32))]
pub(super) struct ActBlock {
    qs: [i8; QK],
    bsums: [i16; 16],
    sums32: [f32; 8],
    /// The scale of each 32 values in [`PAIRED`] order (all `d` with one scale per block).
    dp: [f32; 8],
    d: f32,
}

impl ActBlock {
    /// Quantizes `m` rows of `k` values, block by block (a row's last block padded with zeros,
    /// as the weights are), with one scale per 32 values if `per32`, else one per block.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn quantize(lhs: &[f32], m: usize, k: usize, per32: bool) -> Vec<ActBlock> {
        let mut out = Vec::with_capacity(m * k.div_ceil(QK));
        for row in lhs.chunks_exact(k) {
            for x in row.chunks(QK) {
                let mut padded = [0f32; QK];
                padded[..x.len()].copy_from_slice(x);
                // SAFETY: the caller guarantees the CPU features.
                out.push(unsafe { Self::quantize_block(&padded, per32) });
            }
        }
        out
    }

    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quantize_block(x: &[f32; QK], per32: bool) -> ActBlock {
        let p = x.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        // The largest magnitude of each 32 values (max is exact, so the block's is theirs).
        let amax32: [f32; 8] = std::array::from_fn(|s| {
            let mut m = _mm256_setzero_ps();
            for i in 0..4 {
                let v = _mm256_loadu_ps(p.add(32 * s + 8 * i));
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
            }
            let lanes: [f32; 8] = std::mem::transmute(m);
            lanes.into_iter().fold(0f32, f32::max)
        });
        let amax = amax32.into_iter().fold(0f32, f32::max);
        let amax32 = if per32 { amax32 } else { [amax; 8] };
        let d32 = amax32.map(|a| a / 127.0);
        let mut block = ActBlock {
            qs: [0; QK],
            bsums: [0; 16],
            sums32: [0.0; 8],
            dp: PAIRED.map(|i| d32[i as usize]),
            d: amax / 127.0,
        };
        for g in 0..16 {
            let amax = amax32[g / 2];
            if amax == 0.0 {
                continue; // all zeros
            }
            // Rounds to nearest, ties to even (the default MXCSR mode), as the AVX-512
            // kernels do.
            let iscale = _mm256_set1_ps(127.0 / amax);
            let q = |o: usize| _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(o)), iscale));
            let q: [i32; 16] = std::mem::transmute([q(16 * g), q(16 * g + 8)]);
            // Group g is lane g of the four vectors: values 16g + 4z.. in vector z.
            for (i, &v) in q.iter().enumerate() {
                block.qs[64 * (i / 4) + 4 * g + i % 4] = v as i8;
            }
            block.bsums[g] = q.iter().sum::<i32>() as i16;
        }
        for (s, sum) in block.sums32.iter_mut().enumerate() {
            let ints = block.bsums[2 * s] as i32 + block.bsums[2 * s + 1] as i32;
            *sum = ints as f32 * d32[s];
        }
        block
    }
}

/// What the kernels need of a packed block format.
pub(super) trait Block {
    /// Weights are signed bytes (Q8_0): products take `|w|` and the activation times the sign
    /// of `w`.
    const SIGNED: bool = false;
    /// Consecutive vectors whose 16-bit products can be added before widening (1, 2 or 4).
    const SPAN: usize;
    /// One weight scale per 32 values: activations take one per 32 too ([`ActBlock`]).
    const PER32: bool = false;
    /// Per-block scales, unpacked once for all activation rows.
    type Scales;

    /// # Safety
    /// The CPU must have AVX2 and F16C.
    unsafe fn scales(&self) -> Self::Scales;

    /// The four vectors (z = 0..4) of half `h` (0 or 1) of the block, as bytes.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn half(&self, h: usize) -> [__m256i; 4];

    /// Widens 16-bit sums of half `h` into 32-bit sums per 16-value group (lane).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[inline(always)]
    unsafe fn widen(_: &Self::Scales, _: usize, p: __m256i) -> __m256i {
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// Adds the block's contribution to `acc`, from the 32-bit sums of the two halves.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    unsafe fn finish(s: &Self::Scales, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256;
}

/// Scales of a format with one scale per 32 values: per 32 values in the order `vphaddd`
/// leaves them ([`PAIRED`]), and the offset per unit of activation sum in natural order.
#[derive(Clone, Copy)]
pub(super) struct Scales32 {
    scale: __m256,
    offset: __m256,
}

/// `vphaddd` of the two halves' group sums gives the 32-value sums in this order.
const PAIRED: [i32; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

/// Eight values, one per 32 values, in [`PAIRED`] order.
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
unsafe fn paired(v: __m256) -> __m256 {
    _mm256_permutevar8x32_ps(v, std::mem::transmute::<[i32; 8], __m256i>(PAIRED))
}

/// Eight f16 scales as floats.
///
/// # Safety
/// The CPU must have F16C.
#[inline(always)]
unsafe fn f16x8(d: &[u16; 8]) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr() as *const _))
}

/// `acc + Σ scale · a.dp · sums - Σ offset · a.sums32` for formats with one scale per 32.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn finish32(s: &Scales32, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256 {
    let ints = _mm256_cvtepi32_ps(_mm256_hadd_epi32(sums[0], sums[1]));
    let acc = _mm256_fmadd_ps(
        ints,
        _mm256_mul_ps(s.scale, _mm256_load_ps(a.dp.as_ptr())),
        acc,
    );
    _mm256_fnmadd_ps(_mm256_load_ps(a.sums32.as_ptr()), s.offset, acc)
}

/// The four nibble vectors of half `h` of a layout's 128 nibble bytes.
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
unsafe fn nibbles(qs: &[u8; 128], h: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0f);
    let [lo, hi] = [0, 64].map(|o| _mm256_loadu_si256(qs.as_ptr().add(o + 32 * h) as *const _));
    [
        _mm256_and_si256(lo, m4),
        _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
        _mm256_and_si256(hi, m4),
        _mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
    ]
}

/// Q4_K scales: the integer scale of each 32 values twice per 32-bit lane, per half (for
/// the widening), `d`, and the min times `dmin` per 32 values (natural order).
pub(super) struct ScalesQ4K {
    lanes: [__m256i; 2],
    d: f32,
    offset: __m256,
}

impl Block for PackedQ4K {
    const SPAN: usize = 4;
    type Scales = ScalesQ4K;

    #[inline(always)]
    unsafe fn scales(&self) -> ScalesQ4K {
        // Half h holds groups 8h..8h + 8, i.e. sub-blocks 4h..4h + 4, each over two lanes.
        let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(self.scales.as_ptr() as *const _));
        let lanes = [[0, 0, 1, 1, 2, 2, 3, 3], [4, 4, 5, 5, 6, 6, 7, 7]].map(|idx: [i32; 8]| {
            let idx = std::mem::transmute::<[i32; 8], __m256i>(idx);
            let per_lane = _mm256_permutevar8x32_epi32(sc, idx);
            // Each 32-bit lane holds the scale in both 16-bit halves.
            _mm256_or_si256(per_lane, _mm256_slli_epi32(per_lane, 16))
        });
        let mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(self.mins.as_ptr() as *const _));
        ScalesQ4K {
            lanes,
            d: f16_to_f32(self.d),
            offset: _mm256_mul_ps(
                _mm256_set1_ps(f16_to_f32(self.dmin)),
                _mm256_cvtepi32_ps(mins),
            ),
        }
    }

    #[inline(always)]
    unsafe fn half(&self, h: usize) -> [__m256i; 4] {
        nibbles(&self.qs, h)
    }

    #[inline(always)]
    unsafe fn widen(s: &ScalesQ4K, h: usize, p: __m256i) -> __m256i {
        _mm256_madd_epi16(p, s.lanes[h])
    }

    #[inline(always)]
    unsafe fn finish(s: &ScalesQ4K, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256 {
        // Lane sums stay below 2^24 (two groups of 16 products of at most 15 * 127, times a
        // 6-bit scale), so the conversion is exact.
        let ints = _mm256_cvtepi32_ps(_mm256_add_epi32(sums[0], sums[1]));
        let acc = _mm256_fmadd_ps(ints, _mm256_set1_ps(s.d * a.d), acc);
        _mm256_fnmadd_ps(_mm256_load_ps(a.sums32.as_ptr()), s.offset, acc)
    }
}

/// Q6_K scales: the integer scale of each group twice per 32-bit lane, per half (for the
/// widening), 32 times each scale (for the offset of values stored plus 32), and `d`.
pub(super) struct ScalesQ6K {
    lanes: [__m256i; 2],
    offset: __m256i,
    d: f32,
}

impl Block for PackedQ6K {
    const SPAN: usize = 2;
    type Scales = ScalesQ6K;

    #[inline(always)]
    unsafe fn scales(&self) -> ScalesQ6K {
        let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(self.scales.as_ptr() as *const _));
        // Per 128-bit lane, unpacking duplicates each 16-bit scale; then reassemble halves.
        let (lo, hi) = (_mm256_unpacklo_epi16(sc, sc), _mm256_unpackhi_epi16(sc, sc));
        ScalesQ6K {
            lanes: [
                _mm256_permute2x128_si256(lo, hi, 0x20),
                _mm256_permute2x128_si256(lo, hi, 0x31),
            ],
            offset: _mm256_slli_epi16(sc, 5),
            d: f16_to_f32(self.d),
        }
    }

    #[inline(always)]
    unsafe fn half(&self, h: usize) -> [__m256i; 4] {
        let low = nibbles(&self.ql, h);
        // Bits 4-5 of vector z are bits 2z..2z + 2 of `qh`: move them to bits 4-5.
        let q = _mm256_loadu_si256(self.qh.as_ptr().add(32 * h) as *const _);
        let high = [
            _mm256_slli_epi16(q, 4),
            _mm256_slli_epi16(q, 2),
            q,
            _mm256_srli_epi16(q, 2),
        ];
        let m30 = _mm256_set1_epi8(0x30);
        std::array::from_fn(|z| _mm256_or_si256(low[z], _mm256_and_si256(high[z], m30)))
    }

    #[inline(always)]
    unsafe fn widen(s: &ScalesQ6K, h: usize, p: __m256i) -> __m256i {
        _mm256_madd_epi16(p, s.lanes[h])
    }

    #[inline(always)]
    unsafe fn finish(s: &ScalesQ6K, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256 {
        // Values are stored plus 32: subtract 32 * scale * (group sum) in integers.
        let bsums = _mm256_load_si256(a.bsums.as_ptr() as *const _);
        let offset = _mm256_madd_epi16(bsums, s.offset);
        let ints = _mm256_sub_epi32(_mm256_add_epi32(sums[0], sums[1]), offset);
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(s.d * a.d), acc)
    }
}

impl Block for PackedQ5_0Planes {
    const PER32: bool = true;
    // Values 0..32: four vectors of products fit in 16 bits.
    const SPAN: usize = 4;
    type Scales = Scales32;

    #[inline(always)]
    unsafe fn scales(&self) -> Scales32 {
        let d = f16x8(&self.d);
        // Values are stored plus 16.
        Scales32 {
            scale: paired(d),
            offset: _mm256_mul_ps(d, _mm256_set1_ps(16.0)),
        }
    }

    #[inline(always)]
    unsafe fn half(&self, h: usize) -> [__m256i; 4] {
        let low = nibbles(&self.qs, h);
        let planes = _mm256_loadu_si256(self.qh.as_ptr() as *const _);
        // Bit 4h + z of each byte to bit 4 (16-bit shifts: the mask drops what crosses bytes).
        let high = match h {
            0 => [
                _mm256_slli_epi16(planes, 4),
                _mm256_slli_epi16(planes, 3),
                _mm256_slli_epi16(planes, 2),
                _mm256_slli_epi16(planes, 1),
            ],
            _ => [
                planes,
                _mm256_srli_epi16(planes, 1),
                _mm256_srli_epi16(planes, 2),
                _mm256_srli_epi16(planes, 3),
            ],
        };
        let bit4 = _mm256_set1_epi8(0x10);
        std::array::from_fn(|z| _mm256_or_si256(low[z], _mm256_and_si256(high[z], bit4)))
    }

    #[inline(always)]
    unsafe fn finish(s: &Scales32, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256 {
        finish32(s, sums, a, acc)
    }
}

impl Block for PackedQ8_0 {
    const PER32: bool = true;
    const SIGNED: bool = true;
    const SPAN: usize = 1;
    type Scales = __m256;

    #[inline(always)]
    unsafe fn scales(&self) -> __m256 {
        paired(f16x8(&self.d))
    }

    #[inline(always)]
    unsafe fn half(&self, h: usize) -> [__m256i; 4] {
        // Stored plus 128: flipping the top bit gives the signed value.
        let q = self.qs.as_ptr();
        std::array::from_fn(|z| {
            let v = _mm256_loadu_si256(q.add(64 * z + 32 * h) as *const _);
            _mm256_xor_si256(v, _mm256_set1_epi8(-128))
        })
    }

    #[inline(always)]
    unsafe fn finish(scale: &__m256, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256 {
        let ints = _mm256_cvtepi32_ps(_mm256_hadd_epi32(sums[0], sums[1]));
        _mm256_fmadd_ps(
            ints,
            _mm256_mul_ps(*scale, _mm256_load_ps(a.dp.as_ptr())),
            acc,
        )
    }
}

impl Block for PackedQ4_0 {
    const PER32: bool = true;
    const SPAN: usize = 4;
    type Scales = Scales32;

    #[inline(always)]
    unsafe fn scales(&self) -> Scales32 {
        let d = f16x8(&self.d);
        // Values are stored plus 8.
        Scales32 {
            scale: paired(d),
            offset: _mm256_mul_ps(d, _mm256_set1_ps(8.0)),
        }
    }

    #[inline(always)]
    unsafe fn half(&self, h: usize) -> [__m256i; 4] {
        nibbles(&self.qs, h)
    }

    #[inline(always)]
    unsafe fn finish(s: &Scales32, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256 {
        finish32(s, sums, a, acc)
    }
}

impl Block for PackedQ4_1 {
    const PER32: bool = true;
    const SPAN: usize = 4;
    type Scales = Scales32;

    #[inline(always)]
    unsafe fn scales(&self) -> Scales32 {
        // value = d q + m: the min adds m per unit of activation sum.
        Scales32 {
            scale: paired(f16x8(&self.d)),
            offset: _mm256_sub_ps(_mm256_setzero_ps(), f16x8(&self.m)),
        }
    }

    #[inline(always)]
    unsafe fn half(&self, h: usize) -> [__m256i; 4] {
        nibbles(&self.qs, h)
    }

    #[inline(always)]
    unsafe fn finish(s: &Scales32, sums: [__m256i; 2], a: &ActBlock, acc: __m256) -> __m256 {
        finish32(s, sums, a, acc)
    }
}

/// Activation rows per group: each weight vector is unpacked once for all of them.
const GROUP: usize = 4;

/// Weight rows `js` (each `kb` blocks of `w`) against `rows` activation rows
/// (`acts[r * kb + b]`): activation rows in groups of up to [`GROUP`], each group against
/// every weight row, block by block, with the group's accumulators in registers.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. Slice lengths are checked.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<B: Block>(
    w: &[B],
    js: Range<usize>,
    acts: &[ActBlock],
    kb: usize,
    rows: usize,
    out: &mut Tile,
) {
    assert!(js.end * kb <= w.len() && rows * kb <= acts.len() && js.len() <= out.len());
    let mut r = 0;
    while r < rows {
        let n = (rows - r).min(GROUP);
        let acts = &acts[r * kb..(r + n) * kb];
        match n {
            1 => rows_group::<B, 1>(w, js.clone(), acts, kb, r, out),
            2 => rows_group::<B, 2>(w, js.clone(), acts, kb, r, out),
            3 => rows_group::<B, 3>(w, js.clone(), acts, kb, r, out),
            _ => rows_group::<B, 4>(w, js.clone(), acts, kb, r, out),
        }
        r += n;
    }
}

/// `R` activation rows (`acts`, `R * kb` blocks) against weight rows `js`, into columns
/// `r0..r0 + R` of `out`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `acts` holds `R * kb` blocks and `w` at least
/// `js.end * kb` (checked by the caller, [`tile`]).
#[inline(always)]
unsafe fn rows_group<B: Block, const R: usize>(
    w: &[B],
    js: Range<usize>,
    acts: &[ActBlock],
    kb: usize,
    r0: usize,
    out: &mut Tile,
) {
    let a = acts.as_ptr();
    for (j, out) in js.zip(out.iter_mut()) {
        let row = w.as_ptr().add(j * kb);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..kb {
            let x = &*row.add(b);
            prefetch(x);
            let s = x.scales();
            group::<B, R>(
                x,
                &s,
                std::array::from_fn(|i| &*a.add(i * kb + b)),
                &mut acc,
            );
        }
        for (o, acc) in out[r0..r0 + R].iter_mut().zip(&acc) {
            let v: [f32; 8] = std::mem::transmute(*acc);
            *o = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
        }
    }
}

/// One weight block against `R` activation rows' blocks, accumulated into `acc`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `acc` holds `R` entries.
#[inline(always)]
unsafe fn group<B: Block, const R: usize>(
    x: &B,
    s: &B::Scales,
    acts: [&ActBlock; R],
    acc: &mut [__m256],
) {
    let zero = _mm256_setzero_si256();
    let mut sums = [[zero; 2]; R];
    for h in 0..2 {
        let w = x.half(h);
        let magnitude = if B::SIGNED {
            w.map(|v| _mm256_abs_epi8(v))
        } else {
            w
        };
        let mut part = [[zero; 4]; R];
        for z in 0..4 {
            for (r, a) in acts.iter().enumerate() {
                let av = _mm256_load_si256(a.qs.as_ptr().add(64 * z + 32 * h) as *const _);
                let av = if B::SIGNED {
                    _mm256_sign_epi8(av, w[z])
                } else {
                    av
                };
                let p = _mm256_maddubs_epi16(magnitude[z], av);
                part[r][z / B::SPAN] = _mm256_add_epi16(part[r][z / B::SPAN], p);
            }
        }
        for (sums, part) in sums.iter_mut().zip(&part) {
            let mut s32 = B::widen(s, h, part[0]);
            for p in &part[1..4 / B::SPAN] {
                s32 = _mm256_add_epi32(s32, B::widen(s, h, *p));
            }
            sums[h] = s32;
        }
    }
    for (r, a) in acts.iter().enumerate() {
        acc[r] = B::finish(s, sums[r], a, acc[r]);
    }
}
