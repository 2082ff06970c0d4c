//! AVX2 kernels (with FMA and F16C), on the [`NARROW`] layout: a 32-bit lane of a 32-byte
//! vector holds values of one 32-value group, so the 16-bit products of a lane's eight vectors
//! add up before a single widening per block.
//!
//! AVX2 has no 8-bit dot product into 32 bits. `vpmaddubsw` multiplies unsigned weight bytes
//! by signed activation bytes and adds adjacent pairs into 16 bits, saturating; `vpmaddwd`
//! then widens pairs to 32 bits. The widening costs as much as the products (both run on one
//! port of many CPUs), so the kernels add the 16-bit products of several vectors first, as
//! far as the result fits: with activations in -127..=127, a 16-bit product of weights of
//! magnitude at most `w` is at most `2 * 127 * w`, so all eight vectors of 4-bit weights fit
//! (8 * 3,810 < 32,768). Weights stored plus an offset (Q6_K 32, Q5_0 16, Q4_0 8) have the
//! offset's share taken off in 16 bits ([`ActBlock::offsets`]), which leaves the products of
//! their true values, half as large: eight vectors of Q5_0 and Q4_0 fit, and four of Q6_K
//! (whose two 16-value halves of a lane have their own scales), of Q5_K and of Q5_1 (values
//! up to 31, with mins instead of an offset), which widen each half. Q8_0 weights (signed) take
//! the usual sign transfer (`|w|` times the activation with the sign of `w`) one vector at a
//! time. Q4_K, Q5_K and Q6_K multiply their integer sub-block scales into the widening itself.
//!
//! A weight block is unpacked into registers once, in two halves of four vectors
//! ([`Block::vectors`]), multiplied by every activation row's ([`Block::half`]) and the sum of
//! both halves scaled ([`finish`]). An AVX2-only build, with 16 vector registers, takes
//! the first half over all of a group's rows, then the second, so that four value vectors are
//! live instead of eight and the group's sums stay in registers; a build with AVX-512's 32
//! keeps all eight and takes the rows one by one ([`REGISTERS_32`]). Each (weight row,
//! activation row) pair goes through the same operations whatever the number of rows and in
//! either order, so a k-row product equals k one-row products bit for bit.
//!
//! CPUs with AVX-VNNI (Intel's 12th generation and later) run the same layout with
//! `vpdpbusd`, which multiplies, adds and widens in one instruction: the [`AvxVnni`] family.
//! Each half's products then go straight into 32-bit lanes, starting from the storage offset's
//! share taken off ([`ActBlock::offsets`]); the K-quants' integer sub-block scales are
//! applied as float products, exact for sums below 2^24, instead of 32-bit integer multiplies
//! (two instructions and ten cycles each). The sums are the same exact integers, and the float
//! steps are shared, so both families give the same bits (tested). The AVX-512 family runs
//! the formats it has no kernels of its own for (Q4_0, Q4_1, Q5_1) the same way, with the EVEX
//! encoding of `vpdpbusd` that every AVX-512 VNNI CPU has (Cascade Lake, Ice Lake and Zen 4
//! have no AVX-VNNI). Which instruction makes the products is a [`Products`] type.
//!
//! [`AvxVnni`]: super::Kernels::AvxVnni

use super::layout::{
    HalfQ4_0, HalfQ4_1, HalfQ5_0Planes, HalfQ5_1Planes, HalfQ8_0, PackedQ4K, PackedQ4_0,
    PackedQ4_1, PackedQ5KPlanes, PackedQ5_0Planes, PackedQ5_1Planes, PackedQ6K, PackedQ8_0, NARROW,
    QK,
};
use super::{for_each_output, Part, Tile, Weights, CHUNK, MAX_ROWS};
use std::arch::x86_64::*;
use std::ops::Range;

/// True if this CPU has the instructions these kernels use.
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// True if this CPU also has AVX-VNNI (`vpdpbusd` on 32-byte vectors, VEX-encoded).
pub(super) fn supported_vnni() -> bool {
    supported() && is_x86_feature_detected!("avxvnni")
}

/// `dst[m x n] = lhs[m x k] x Wᵀ` for `n` weight rows of `k.div_ceil(256)` blocks each: all
/// in `w`, or (if `tails` is not empty) all but the last in `w` and the last, in half size,
/// in `tails` (`Rows` in the layout module); with the products of `P`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`supported`]), and what `P` names ([`Products`]).
/// Slice lengths are checked.
pub(super) unsafe fn matmul<B, H, P: Products>(
    w: &[B],
    tails: &[H],
    mkn: (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) where
    B: Block + Sync,
    H: Block<Scales = B::Scales> + Sync,
{
    matmul_in_order::<B, H, { !REGISTERS_32 }, P>(w, tails, mkn, lhs, dst)
}

/// [`matmul`], taking each block half by half over a group's rows if `HALF_BY_HALF`, else
/// whole row by row ([`REGISTERS_32`]): the same operations per (weight row, activation row)
/// pair in another order, so the same bits (tested).
///
/// # Safety
/// As [`matmul`].
pub(super) unsafe fn matmul_in_order<B, H, const HALF_BY_HALF: bool, P: Products>(
    w: &[B],
    tails: &[H],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) where
    B: Block + Sync,
    H: Block<Scales = B::Scales> + Sync,
{
    const {
        assert!(
            B::PER32 == H::PER32
                && B::OFFSET == H::OFFSET
                && B::VNNI_OFFSET == H::VNNI_OFFSET
                && B::WIDE == H::WIDE
        )
    };
    let kb = k.div_ceil(QK);
    let w = Weights::new(w, tails, kb);
    assert!(w.holds(n, kb) && Some(lhs.len()) == m.checked_mul(k));
    let acts = ActBlock::quantize::<B>(lhs, m, k, P::VNNI);
    let slab = slab(m, kb);
    let row_bytes = kb * std::mem::size_of::<ActBlock>();
    for_each_output((m, n), row_bytes, dst, |js, r0, rows, out| {
        let acts = &acts[r0 * kb..];
        // SAFETY: the caller guarantees the CPU features; `js` is within the `n` rows of `w`
        // (checked above) and rows `r0..r0 + rows` within the `m` quantized rows.
        unsafe { P::tile::<B, H, HALF_BY_HALF>(&w, js, acts, kb, slab, rows, out) }
    });
}

/// A block's scales, whole or half-size.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[inline(always)]
unsafe fn scales<B: Block, H: Block<Scales = B::Scales>>(part: &Part<B, H>) -> B::Scales {
    match part {
        Part::Whole(x) => x.scales(),
        Part::Half(x) => x.scales(),
    }
}

/// 256 activations quantized to 8 bits, in the [`NARROW`] layout, with the sum of each 32
/// values times its scale (for mins) and, for weights stored plus an offset, the offset's
/// share of the products ([`ActBlock::offsets`]).
///
/// Formats with one weight scale per 256 values (Q4_K, Q6_K) take one activation scale per
/// block, as the AVX-512 kernels and candle's Q8_K do. Formats with one scale per 32 (Q4_0,
/// Q4_1, Q5_0, Q5_1, Q8_0) take one per 32 values, as llama.cpp's Q8_0 and Q8_1 do: an outlier
/// activation then coarsens only its own 32 values, not all 256.
#[repr(C, align(32))]
pub(super) struct ActBlock {
    qs: [i8; QK],
    /// For vectors 0-3 and 4-7 (the halves), the weights' storage offset's share of their
    /// products, as the kernels take it off:
    /// - AVX2: [`Block::OFFSET`] times the activation pair under each 16-bit product of
    ///   `vpmaddubsw`, summed over the four vectors. Subtracted from the summed products, it
    ///   leaves the products of the weights' true (signed) values, which are small enough for
    ///   four (Q6_K) or eight vectors (Q5_0, Q4_0) to add up in 16 bits before one widening,
    ///   with no separate term for the offset.
    /// - AVX-VNNI: minus [`Block::VNNI_OFFSET`] times the sum of each 32-bit lane's activations,
    ///   where a half's chain of `vpdpbusd` starts, so that it ends on the true values' sums.
    offsets: [HalfOffsets; 2],
    sums32: [f32; 8],
    /// The scale of each 32 values (eight copies of the block's scale where the weights have
    /// one per block): the kernels multiply it by a weight block's scale in one `vmulps`.
    d32: [f32; 8],
}

// The kernels read every field with aligned 256-bit loads.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(offset_of!(ActBlock, offsets).is_multiple_of(32));
    assert!(offset_of!(ActBlock, sums32).is_multiple_of(32));
    assert!(offset_of!(ActBlock, d32).is_multiple_of(32));
    assert!(size_of::<ActBlock>().is_multiple_of(32) && size_of::<HalfOffsets>() == 32);
};

/// A half's offsets ([`ActBlock::offsets`]): per 16-bit product (AVX2) or per 32-bit lane
/// (AVX-VNNI). The kernels load them as a vector; only the quantization reads the fields.
#[derive(Clone, Copy)]
#[repr(C)]
union HalfOffsets {
    pairs: [i16; 16],
    lanes: [i32; 8],
}

/// The storage offset a quantization takes off, and in which form ([`ActBlock::offsets`]).
#[derive(Clone, Copy)]
enum Offset {
    Pairs(i16),
    Lanes(i32),
}

impl ActBlock {
    /// The block of activations that hold a NaN or an infinity: NaN scales, so that every
    /// product with it is NaN, as it is in the other families and in plain arithmetic (a
    /// model gone wrong must not give finite logits; `max` and the integer conversion would
    /// turn a NaN into a plain number).
    fn non_finite() -> ActBlock {
        ActBlock {
            qs: [0; QK],
            offsets: [HalfOffsets { lanes: [0; 8] }; 2],
            sums32: [f32::NAN; 8],
            d32: [f32::NAN; 8],
        }
    }

    /// Quantizes `m` rows of `k` values, block by block (a row's last block padded with zeros,
    /// as the weights are), for weights of format `B`: one scale per 32 values if
    /// [`Block::PER32`], else one per block; with the offsets as the AVX-VNNI kernels take
    /// them if `vnni`.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    unsafe fn quantize<B: Block>(lhs: &[f32], m: usize, k: usize, vnni: bool) -> Vec<ActBlock> {
        let offset = match vnni {
            true => Offset::Lanes(B::VNNI_OFFSET),
            false => Offset::Pairs(B::OFFSET),
        };
        let mut out = Vec::with_capacity(m * k.div_ceil(QK));
        for row in lhs.chunks_exact(k) {
            for x in row.chunks(QK) {
                let mut padded = [0f32; QK];
                padded[..x.len()].copy_from_slice(x);
                // SAFETY: the caller guarantees the CPU features.
                out.push(unsafe { Self::quantize_block(&padded, B::PER32, offset) });
            }
        }
        out
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quantize_block(x: &[f32; QK], per32: bool, offset: Offset) -> ActBlock {
        let p = x.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        let mut nan = _mm256_setzero_ps();
        // The largest magnitude of each 32 values (max is exact, so the block's is theirs).
        let amax32: [f32; 8] = std::array::from_fn(|l| {
            let mut m = _mm256_setzero_ps();
            for i in 0..4 {
                let v = _mm256_loadu_ps(p.add(32 * l + 8 * i));
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            }
            let lanes: [f32; 8] = std::mem::transmute(m);
            lanes.into_iter().fold(0f32, f32::max)
        });
        let amax = amax32.into_iter().fold(0f32, f32::max);
        if _mm256_movemask_ps(nan) != 0 || amax.is_infinite() {
            return ActBlock::non_finite();
        }
        let amax32 = if per32 { amax32 } else { [amax; 8] };
        let d32 = amax32.map(|a| a / 127.0);
        let mut block = ActBlock {
            qs: [0; QK],
            offsets: [HalfOffsets { lanes: [0; 8] }; 2],
            sums32: [0.0; 8],
            d32,
        };
        // Lane l of vector z holds values 32l + 4z .. 32l + 4z + 4.
        let lanes = block.qs.as_mut_ptr() as *mut [i8; 4];
        for (l, &amax) in amax32.iter().enumerate() {
            if amax == 0.0 {
                continue; // all zeros
            }
            // Rounds to nearest, ties to even (the default MXCSR mode), as the AVX-512
            // kernels do.
            let iscale = _mm256_set1_ps(127.0 / amax);
            let q: [[i32; 8]; 4] = std::array::from_fn(|i| {
                let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(32 * l + 8 * i)), iscale);
                std::mem::transmute(_mm256_cvtps_epi32(v))
            });
            let q: [i32; 32] = std::mem::transmute(q);
            for (z, four) in q.chunks_exact(4).enumerate() {
                *lanes.add(8 * z + l) = std::array::from_fn(|i| four[i] as i8);
                // Vector z is in half z / 4. Its four values are lane l's, and the pairs
                // (0, 1) and (2, 3) of them its 16-bit products 2l and 2l + 1.
                let half = &mut block.offsets[z / 4];
                match offset {
                    Offset::Pairs(o) => {
                        half.pairs[2 * l] += o * (four[0] + four[1]) as i16;
                        half.pairs[2 * l + 1] += o * (four[2] + four[3]) as i16;
                    }
                    Offset::Lanes(o) => half.lanes[l] -= o * four.iter().sum::<i32>(),
                }
            }
            block.sums32[l] = q.iter().sum::<i32>() as f32 * d32[l];
        }
        block
    }
}

/// What the kernels need of a packed block format: its value vectors in registers half by half,
/// each half's products with an activation block, and the scaling of their sum.
pub(super) trait Block {
    /// One weight scale per 32 values: activations take one per 32 too ([`ActBlock`]).
    const PER32: bool = false;
    /// What the values are stored plus, if the AVX2 kernel takes it off in 16 bits with
    /// [`ActBlock::offsets`] (0 otherwise).
    const OFFSET: i16 = 0;
    /// What the values are stored plus, as [`Block::stored`] gives them to `vpdpbusd`.
    const VNNI_OFFSET: i32 = Self::OFFSET as i32;
    /// Whether [`Block::half`] sums into 32-bit lanes (widened per half) rather than 16-bit.
    const WIDE: bool = false;
    /// The block's scales in registers.
    type Scales: Copy;

    /// Value vectors `4h..4h + 4`, as [`Block::half`] multiplies them.
    ///
    /// # Safety
    /// The CPU must have AVX2; `h < 2`.
    unsafe fn vectors(&self, h: usize) -> [__m256i; 4];

    /// Value vectors `4h..4h + 4` as unsigned bytes, for `vpdpbusd` ([`Block::vectors`]
    /// unless those are signed).
    ///
    /// # Safety
    /// The CPU must have AVX2; `h < 2`.
    #[inline(always)]
    unsafe fn stored(&self, h: usize) -> [__m256i; 4] {
        self.vectors(h)
    }

    /// # Safety
    /// The CPU must have AVX2 and F16C.
    unsafe fn scales(&self) -> Self::Scales;

    /// The products of half `h`'s vectors `w` with `a`'s, summed per lane: in 16 bits, or in
    /// 32 if [`Block::WIDE`].
    ///
    /// # Safety
    /// The CPU must have AVX2; `h < 2`.
    unsafe fn half(w: &[__m256i; 4], s: &Self::Scales, a: &ActBlock, h: usize) -> __m256i;

    /// Both halves' sums of [`dots`] as one, for [`Block::scaled_vnni`].
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline(always)]
    unsafe fn both_vnni(_: &Self::Scales, lo: __m256i, hi: __m256i) -> __m256i {
        _mm256_add_epi32(lo, hi)
    }

    /// Both halves' sums (as [`both`] adds them) widened to 32 bits with any integer scale.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn widen(s: &Self::Scales, ints: __m256i) -> __m256i;

    /// `acc` plus the block's products with `a` from its widened integer sums, per lane (the
    /// caller sums the lanes).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    unsafe fn scaled(s: &Self::Scales, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256;

    /// [`Block::scaled`] from the 32-bit sums of [`dots`], with the same result:
    /// what [`Block::widen`] would multiply in is applied exactly on the way.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline(always)]
    unsafe fn scaled_vnni(s: &Self::Scales, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
        Self::scaled(s, ints, a, acc)
    }
}

/// Half `h` of a block's value vectors, whole or half-size (which reads as its whole block's
/// registers: `per32_blocks!`): as [`Block::half`] multiplies them, or with `vpdpbusd`, as
/// [`dots`] does.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `h < 2`.
#[inline(always)]
unsafe fn vectors<B: Block, H: Block, P: Products>(part: &Part<B, H>, h: usize) -> [__m256i; 4] {
    match (part, P::VNNI) {
        (Part::Whole(x), false) => x.vectors(h),
        (Part::Half(x), false) => x.vectors(h),
        (Part::Whole(x), true) => x.stored(h),
        (Part::Half(x), true) => x.stored(h),
    }
}

/// [`Block::half`], or with `vpdpbusd` [`dots`].
///
/// # Safety
/// As those.
#[inline(always)]
unsafe fn half<B: Block, P: Products>(
    w: &[__m256i; 4],
    s: &B::Scales,
    a: &ActBlock,
    h: usize,
) -> __m256i {
    match P::VNNI {
        true => dots::<B, P>(w, a, h),
        false => B::half(w, s, a, h),
    }
}

/// Both halves' sums of a format `B` as one (exact: the formats' bounds keep the total in
/// range, and wrapping on the way does not change it); with `vpdpbusd`, [`Block::both_vnni`].
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn both<B: Block, P: Products>(s: &B::Scales, lo: __m256i, hi: __m256i) -> __m256i {
    if P::VNNI {
        B::both_vnni(s, lo, hi)
    } else if B::WIDE {
        _mm256_add_epi32(lo, hi)
    } else {
        _mm256_add_epi16(lo, hi)
    }
}

/// `acc` plus the block's products with `a` from the sum of both halves ([`both`]), per lane.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn finish<B: Block, P: Products>(
    s: &B::Scales,
    ints: __m256i,
    a: &ActBlock,
    acc: __m256,
) -> __m256 {
    match P::VNNI {
        true => B::scaled_vnni(s, ints, a, acc),
        false => B::scaled(s, B::widen(s, ints), a, acc),
    }
}

/// The 32-bit products of half `h`'s stored vectors `w` ([`Block::stored`]) with `a`'s by
/// `vpdpbusd`, from the storage offset's share taken off ([`ActBlock::offsets`]): the true
/// values' products, exact, summed per lane (integer scales come later:
/// [`Block::both_vnni`], [`Block::scaled_vnni`]).
///
/// # Safety
/// The CPU must have AVX2 and `P`'s `vpdpbusd`; `h < 2`; `a` quantized for `vpdpbusd`.
#[inline(always)]
unsafe fn dots<B: Block, P: Products>(w: &[__m256i; 4], a: &ActBlock, h: usize) -> __m256i {
    let mut sum = match B::VNNI_OFFSET {
        0 => _mm256_setzero_si256(),
        _ => offsets(a, h),
    };
    for (i, w) in w.iter().enumerate() {
        sum = P::dpbusd(sum, *w, act(a, 4 * h + i));
    }
    sum
}

/// Vector `z` of an activation block.
///
/// # Safety
/// The CPU must have AVX2 (the block is 32-byte aligned by its type); `z < 8`.
#[inline(always)]
unsafe fn act(a: &ActBlock, z: usize) -> __m256i {
    _mm256_load_si256(a.qs.as_ptr().add(32 * z) as *const _)
}

/// The 16-bit products of weight vectors `w` with the activation vectors `z0..`, summed.
///
/// # Safety
/// The CPU must have AVX2; `z0 + w.len() <= 8`.
#[inline(always)]
unsafe fn products(w: &[__m256i], a: &ActBlock, z0: usize) -> __m256i {
    let mut sum = _mm256_maddubs_epi16(w[0], act(a, z0));
    for (i, w) in w.iter().enumerate().skip(1) {
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(*w, act(a, z0 + i)));
    }
    sum
}

/// How a block's vectors are stored: [`Whole`], or [`Low`] for the half blocks that end some
/// rows (`Halves` in the layout module).
trait Lanes {
    /// Vector `i` of the vectors stored from `p`.
    ///
    /// # Safety
    /// The CPU must have AVX2; `p` points to at least `i + 1` stored vectors.
    unsafe fn vector(p: *const u8, i: usize) -> __m256i;

    /// The f16 scales (one per lane) stored at `d`, as floats.
    ///
    /// # Safety
    /// The CPU must have F16C; `d` points to the block's stored scales.
    unsafe fn scales(d: *const u16) -> __m256;
}

/// All eight lanes: 32 bytes a vector, eight scales.
struct Whole;

/// Lanes 0-3: 16 bytes a vector, four scales; lanes 4-7 read as zeros, scales included. The
/// padding they replace held zero scales too (and zero values, or for Q8_0, stored plus 128,
/// the byte 0x80 where a zero read gives -128): against the zero activations of those lanes
/// every product, sum and scaled term is the same.
struct Low;

impl Lanes for Whole {
    #[inline(always)]
    unsafe fn vector(p: *const u8, i: usize) -> __m256i {
        _mm256_loadu_si256(p.add(32 * i) as *const _)
    }

    #[inline(always)]
    unsafe fn scales(d: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(d as *const _))
    }
}

impl Lanes for Low {
    #[inline(always)]
    unsafe fn vector(p: *const u8, i: usize) -> __m256i {
        _mm256_zextsi128_si256(_mm_loadu_si128(p.add(16 * i) as *const _))
    }

    #[inline(always)]
    unsafe fn scales(d: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadl_epi64(d as *const _))
    }
}

/// Eight bytes, each zero-extended into its own 32-bit lane; with `twice`, also into the
/// lane's upper 16 bits (a `vpmaddwd` multiplier per lane).
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
unsafe fn byte_lanes(bytes: &[u8; 8], twice: bool) -> __m256i {
    // Every 128 bits hold the eight bytes; lanes 0-3 take bytes 0-3, lanes 4-7 bytes 4-7.
    let v = _mm256_set1_epi64x(i64::from_le_bytes(*bytes));
    let upper = |l: i8| if twice { l } else { -128 };
    let idx: [i8; 32] = std::array::from_fn(|i| match i % 4 {
        0 => (i / 4) as i8,
        2 => upper((i / 4) as i8),
        _ => -128, // zero
    });
    _mm256_shuffle_epi8(v, std::mem::transmute::<[i8; 32], __m256i>(idx))
}

/// Vectors `4h..4h + 4` of a layout's nibble bytes stored from `qs` (128 bytes, or 64 for
/// [`Low`]): the low and high nibbles of stored vectors `2h` and `2h + 1`.
///
/// # Safety
/// The CPU must have AVX2; `qs` points to the stored nibbles; `h < 2`.
#[inline(always)]
unsafe fn nibbles<L: Lanes>(qs: *const u8, h: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0f);
    let [v0, v1] = [0, 1].map(|p| L::vector(qs, 2 * h + p));
    [
        _mm256_and_si256(v0, m4),
        _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4),
        _mm256_and_si256(v1, m4),
        _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4),
    ]
}

/// The scales of a format with one per 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the scale per lane
/// and (Q4_1, Q5_1) the min per unit of activation sum.
#[derive(Clone, Copy)]
pub(super) struct Scales32 {
    scale: __m256,
    min: __m256,
}

/// `acc` plus the products of a per-32 format whose lane sums are `ints`, without the min.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn scaled32(s: &Scales32, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
    let scale = _mm256_mul_ps(s.scale, _mm256_load_ps(a.d32.as_ptr()));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, acc)
}

/// The 16-bit products of half `h` of a block's vectors with `a`, less the storage offset's
/// part ([`ActBlock::offsets`]): the products of the true values, for formats whose true
/// values times 16 activations fit in 16 bits over the block (Q5_0, Q4_0: at most
/// 16 * 16 * 127 = 32,512; the sums may wrap on the way, the total is in range and exact).
///
/// # Safety
/// The CPU must have AVX2; `h < 2`.
#[inline(always)]
unsafe fn centered(w: &[__m256i; 4], a: &ActBlock, h: usize) -> __m256i {
    _mm256_sub_epi16(products(w, a, 4 * h), offsets(a, h))
}

/// [`ActBlock::offsets`] of vectors 0-3 (`half` 0) or 4-7 (1).
///
/// # Safety
/// The CPU must have AVX2; `half < 2`.
#[inline(always)]
unsafe fn offsets(a: &ActBlock, half: usize) -> __m256i {
    _mm256_load_si256(a.offsets.as_ptr().add(half) as *const _)
}

/// The scales of a Q4_K block: the integer scale per lane (twice, for `vpmaddwd`, and as a
/// float), `d`, and the min times `dmin` per lane.
#[derive(Clone, Copy)]
pub(super) struct ScalesQ4K {
    scales: __m256i,
    lanes: __m256,
    d: __m256,
    offset: __m256,
}

impl Block for PackedQ4K {
    type Scales = ScalesQ4K;

    #[inline(always)]
    unsafe fn vectors(&self, h: usize) -> [__m256i; 4] {
        nibbles::<Whole>(self.qs.as_ptr(), h)
    }

    #[inline(always)]
    unsafe fn scales(&self) -> ScalesQ4K {
        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(
            (self.d as u32 | (self.dmin as u32) << 16) as i32,
        ));
        let mins = _mm256_cvtepi32_ps(byte_lanes(&self.mins, false));
        ScalesQ4K {
            scales: byte_lanes(&self.scales, true),
            lanes: _mm256_cvtepi32_ps(byte_lanes(&self.scales, false)),
            d: _mm256_broadcastss_ps(dd),
            offset: _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), mins),
        }
    }

    #[inline(always)]
    unsafe fn half(w: &[__m256i; 4], _: &ScalesQ4K, a: &ActBlock, h: usize) -> __m256i {
        products(w, a, 4 * h)
    }

    #[inline(always)]
    unsafe fn widen(s: &ScalesQ4K, ints: __m256i) -> __m256i {
        _mm256_madd_epi16(ints, s.scales)
    }

    #[inline(always)]
    unsafe fn scaled(s: &ScalesQ4K, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
        // Lane sums stay below 2^24, so the conversion is exact.
        q4k_scaled(s, _mm256_cvtepi32_ps(ints), a, acc)
    }

    #[inline(always)]
    unsafe fn scaled_vnni(s: &ScalesQ4K, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
        // The integer scale in floats: a product of integers below 2^24 (at most
        // 32 * 15 * 127 * 63), so exactly the value `widen` gives, in one instruction where a
        // 32-bit integer multiply takes two and ten cycles.
        q4k_scaled(s, _mm256_mul_ps(_mm256_cvtepi32_ps(ints), s.lanes), a, acc)
    }
}

/// Q5_K: Q4_K's scales and mins, values of five bits (0..32, bit 4 in planes as Q5_0's).
/// Four vectors' 16-bit products fit (4 * 2 * 31 * 127 = 31,496), eight would not, so each
/// half is widened with the scales on its own.
impl Block for PackedQ5KPlanes {
    const WIDE: bool = true;
    type Scales = ScalesQ4K;

    #[inline(always)]
    unsafe fn vectors(&self, h: usize) -> [__m256i; 4] {
        five_bit_vectors::<Whole>(self.low.qs.as_ptr(), self.qh.as_ptr(), h)
    }

    #[inline(always)]
    unsafe fn scales(&self) -> ScalesQ4K {
        self.low.scales()
    }

    #[inline(always)]
    unsafe fn half(w: &[__m256i; 4], s: &ScalesQ4K, a: &ActBlock, h: usize) -> __m256i {
        _mm256_madd_epi16(products(w, a, 4 * h), s.scales)
    }

    #[inline(always)]
    unsafe fn widen(_: &ScalesQ4K, ints: __m256i) -> __m256i {
        ints
    }

    /// As Q4_K's (lane sums stay below 2^24: 32 * 31 * 127 * 63, so conversions are exact).
    #[inline(always)]
    unsafe fn scaled(s: &ScalesQ4K, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
        PackedQ4K::scaled(s, ints, a, acc)
    }

    #[inline(always)]
    unsafe fn scaled_vnni(s: &ScalesQ4K, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
        PackedQ4K::scaled_vnni(s, ints, a, acc)
    }
}

/// `acc` plus a Q4_K block's products with `a` from its scaled integer sums as floats.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn q4k_scaled(s: &ScalesQ4K, sums: __m256, a: &ActBlock, acc: __m256) -> __m256 {
    let scale = _mm256_mul_ps(s.d, _mm256_load_ps(a.d32.as_ptr()));
    let acc = _mm256_fmadd_ps(sums, scale, acc);
    _mm256_fnmadd_ps(_mm256_load_ps(a.sums32.as_ptr()), s.offset, acc)
}

/// The scales of a Q6_K block: the integer scales of each lane's first and second 16 values
/// (twice per lane, for `vpmaddwd`, and as floats) and `d`.
#[derive(Clone, Copy)]
pub(super) struct ScalesQ6K {
    halves: [__m256i; 2],
    lanes: [__m256; 2],
    d: __m256,
}

impl Block for PackedQ6K<NARROW> {
    const OFFSET: i16 = 32;
    const WIDE: bool = true;
    type Scales = ScalesQ6K;

    #[inline(always)]
    unsafe fn vectors(&self, h: usize) -> [__m256i; 4] {
        let low = nibbles::<Whole>(self.ql.as_ptr(), h);
        let q = _mm256_loadu_si256(self.qh.as_ptr().add(32 * h) as *const _);
        // Bits 4-5 of vector 4h + i are bits 2i.. of qh[32h..]: move them to 4-5.
        let high = [
            _mm256_slli_epi16(q, 4),
            _mm256_slli_epi16(q, 2),
            q,
            _mm256_srli_epi16(q, 2),
        ];
        let m30 = _mm256_set1_epi8(0x30);
        std::array::from_fn(|i| _mm256_or_si256(low[i], _mm256_and_si256(high[i], m30)))
    }

    #[inline(always)]
    unsafe fn scales(&self) -> ScalesQ6K {
        // Scales s0..s15 as 16-bit values; group 2l and 2l + 1 belong to lane l.
        let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(self.scales.as_ptr() as *const _));
        #[rustfmt::skip]
        let even = _mm256_setr_epi8(
            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
        );
        let odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
        // Lanes 0-3 need s0..s7 and lanes 4-7 s8..s15: the low and high 128 bits of `sc`.
        let halves = [_mm256_shuffle_epi8(sc, even), _mm256_shuffle_epi8(sc, odd)];
        ScalesQ6K {
            halves,
            // The upper copy of each, sign-extended.
            lanes: halves.map(|h| _mm256_cvtepi32_ps(_mm256_srai_epi32(h, 16))),
            d: _mm256_set1_ps(super::layout::f16_to_f32(self.d)),
        }
    }

    #[inline(always)]
    unsafe fn half(w: &[__m256i; 4], s: &ScalesQ6K, a: &ActBlock, h: usize) -> __m256i {
        // A half's products less the offset's are those of the true values (-32..=31), whose
        // four vectors sum to at most 4 * 2 * 32 * 127 = 32,512 in magnitude: exact in 16
        // bits (wrapping on the way), then widened with the half's scales.
        let sum = _mm256_sub_epi16(products(w, a, 4 * h), offsets(a, h));
        _mm256_madd_epi16(sum, s.halves[h])
    }

    /// The halves' scales applied in floats, exactly (each scaled half is an integer of
    /// magnitude at most 16 * 32 * 127 * 128 < 2^23, and so is their sum below 2^24): the
    /// value of `half` and `widen`, without 32-bit integer multiplies (two instructions and
    /// ten cycles each); a zero may come out as -0.0, which adds to an accumulator as +0.0
    /// does. The sum is returned as the bits of a float vector.
    #[inline(always)]
    unsafe fn both_vnni(s: &ScalesQ6K, lo: __m256i, hi: __m256i) -> __m256i {
        let lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), s.lanes[0]);
        _mm256_castps_si256(_mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s.lanes[1], lo))
    }

    #[inline(always)]
    unsafe fn scaled_vnni(s: &ScalesQ6K, sums: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
        let scale = _mm256_mul_ps(s.d, _mm256_load_ps(a.d32.as_ptr()));
        _mm256_fmadd_ps(_mm256_castsi256_ps(sums), scale, acc)
    }

    #[inline(always)]
    unsafe fn widen(_: &ScalesQ6K, ints: __m256i) -> __m256i {
        ints
    }

    #[inline(always)]
    unsafe fn scaled(s: &ScalesQ6K, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
        let scale = _mm256_mul_ps(s.d, _mm256_load_ps(a.d32.as_ptr()));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, acc)
    }
}

/// Half `h` of a Q5_0 or Q5_1 block stored from `qs` and `qh` with lanes `L`.
///
/// # Safety
/// The CPU must have AVX2; the pointers are the block's fields; `h < 2`.
#[inline(always)]
unsafe fn five_bit_vectors<L: Lanes>(qs: *const u8, qh: *const u8, h: usize) -> [__m256i; 4] {
    let low = nibbles::<L>(qs, h);
    let planes = L::vector(qh, 0);
    // Bit z of each byte to bit 4 (16-bit shifts: the mask drops what crosses bytes).
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
    std::array::from_fn(|i| _mm256_or_si256(low[i], _mm256_and_si256(high[i], bit4)))
}

/// Half `h` of a Q8_0 block stored from `qs` with lanes `L`, as signed bytes.
///
/// # Safety
/// The CPU must have AVX2; `qs` is the block's field; `h < 2`.
#[inline(always)]
unsafe fn q8_0_vectors<L: Lanes>(qs: *const u8, h: usize) -> [__m256i; 4] {
    // Stored plus 128: flipping the top bit gives the signed value.
    std::array::from_fn(|i| _mm256_xor_si256(L::vector(qs, 4 * h + i), _mm256_set1_epi8(-128)))
}

/// Q8_0: |w| times the activation with w's sign, one vector at a time (|w| reaches 128),
/// widened per vector.
///
/// # Safety
/// The CPU must have AVX2; `h < 2`.
#[inline(always)]
unsafe fn q8_0_half(w: &[__m256i; 4], a: &ActBlock, h: usize) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let mut ints = _mm256_setzero_si256();
    for (i, w) in w.iter().enumerate() {
        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(*w), _mm256_sign_epi8(act(a, 4 * h + i), *w));
        ints = _mm256_add_epi32(ints, _mm256_madd_epi16(p, ones));
    }
    ints
}

/// A per-32 format's sums widened (16-bit unless `WIDE`).
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
unsafe fn widen32<const WIDE: bool>(ints: __m256i) -> __m256i {
    match WIDE {
        true => ints,
        false => _mm256_madd_epi16(ints, _mm256_set1_epi16(1)),
    }
}

/// A per-32 format's widened sums scaled, and with `MIN` (Q4_1, Q5_1) the min added.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn finish32<const MIN: bool>(
    s: &Scales32,
    ints: __m256i,
    a: &ActBlock,
    acc: __m256,
) -> __m256 {
    let acc = scaled32(s, ints, a, acc);
    match MIN {
        true => _mm256_fmadd_ps(_mm256_load_ps(a.sums32.as_ptr()), s.min, acc),
        false => acc,
    }
}

/// [`Block`] for the per-32 formats, each whole ([`Whole`]) and half-size ([`Low`]): the
/// storage offset, the min's field (`m`, or `none`), whether a half's sum is 32-bit, the
/// vectors of half `h` stored with lanes `L`, the sum of a half's products, and for a format
/// whose vectors are not its stored bytes (Q8_0), the stored vectors and their offset.
macro_rules! per32_blocks {
    ($($whole:ty, $low:ty: offset $offset:literal, min $m:tt, wide $wide:literal,
        |$b:ident, $L:ident, $h:ident| $vectors:expr,
        |$w:ident, $a:ident, $hh:ident| $half:expr
        $(, stored |$sb:ident, $sL:ident, $sh:ident| $stored:expr, offset $soffset:literal)?;)*) => {$(
        per32_blocks!(@impl $whole, Whole, $offset, $m, $wide,
            |$b, $L, $h| $vectors, |$w, $a, $hh| $half
            $(, |$sb, $sL, $sh| $stored, $soffset)?);
        per32_blocks!(@impl $low, Low, $offset, $m, $wide,
            |$b, $L, $h| $vectors, |$w, $a, $hh| $half
            $(, |$sb, $sL, $sh| $stored, $soffset)?);
    )*};
    (@impl $block:ty, $lanes:ty, $offset:literal, $m:tt, $wide:literal,
        |$b:ident, $L:ident, $h:ident| $vectors:expr,
        |$w:ident, $a:ident, $hh:ident| $half:expr
        $(, |$sb:ident, $sL:ident, $sh:ident| $stored:expr, $soffset:literal)?) => {
        impl Block for $block {
            const PER32: bool = true;
            const OFFSET: i16 = $offset;
            $(const VNNI_OFFSET: i32 = $soffset;)?
            const WIDE: bool = $wide;
            type Scales = Scales32;

            #[inline(always)]
            unsafe fn vectors(&self, $h: usize) -> [__m256i; 4] {
                type $L = $lanes;
                let $b = self;
                $vectors
            }

            $(
            #[inline(always)]
            unsafe fn stored(&self, $sh: usize) -> [__m256i; 4] {
                type $sL = $lanes;
                let $sb = self;
                $stored
            }
            )?

            #[inline(always)]
            unsafe fn scales(&self) -> Scales32 {
                Scales32 {
                    scale: <$lanes>::scales(self.d.as_ptr()),
                    min: per32_blocks!(@min self, $lanes, $m),
                }
            }

            #[inline(always)]
            unsafe fn half($w: &[__m256i; 4], _: &Scales32, $a: &ActBlock, $hh: usize) -> __m256i {
                $half
            }

            #[inline(always)]
            unsafe fn widen(_: &Scales32, ints: __m256i) -> __m256i {
                widen32::<$wide>(ints)
            }

            #[inline(always)]
            unsafe fn scaled(s: &Scales32, ints: __m256i, a: &ActBlock, acc: __m256) -> __m256 {
                finish32::<{ per32_blocks!(@has_min $m) }>(s, ints, a, acc)
            }
        }
    };
    // Q4_1's and Q5_1's min per unit of activation sum (value = d q + m); the others have none.
    (@min $self:ident, $lanes:ty, none) => { _mm256_setzero_ps() };
    (@min $self:ident, $lanes:ty, $m:ident) => { <$lanes>::scales($self.$m.as_ptr()) };
    (@has_min none) => { false };
    (@has_min $m:ident) => { true };
}

per32_blocks! {
    PackedQ5_0Planes, HalfQ5_0Planes: offset 16, min none, wide false,
        |b, L, h| five_bit_vectors::<L>(b.qs.as_ptr(), b.qh.as_ptr(), h),
        |w, a, h| centered(w, a, h);
    PackedQ8_0, HalfQ8_0: offset 0, min none, wide true,
        |b, L, h| q8_0_vectors::<L>(b.qs.as_ptr(), h),
        |w, a, h| q8_0_half(w, a, h),
        stored |b, L, h| std::array::from_fn(|i| L::vector(b.qs.as_ptr(), 4 * h + i)), offset 128;
    PackedQ4_0, HalfQ4_0: offset 8, min none, wide false,
        |b, L, h| nibbles::<L>(b.qs.as_ptr(), h),
        |w, a, h| centered(w, a, h);
    PackedQ4_1, HalfQ4_1: offset 0, min m, wide false,
        |b, L, h| nibbles::<L>(b.qs.as_ptr(), h),
        |w, a, h| products(w, a, 4 * h);
    // Values up to 31 with no offset to take off: four vectors' products fit in 16 bits
    // (4 * 2 * 127 * 31 = 31,496), eight would not, so each half widens.
    PackedQ5_1Planes, HalfQ5_1Planes: offset 0, min m, wide true,
        |b, L, h| five_bit_vectors::<L>(b.qs.as_ptr(), b.qh.as_ptr(), h),
        |w, a, h| widen32::<false>(products(w, a, 4 * h));
}

/// Whether the build has AVX-512's 32 vector registers (an AVX-512 CPU with
/// `target-cpu=native`): then a block's eight value vectors, the group's accumulators and
/// sums all stay in registers, and each row takes both halves in turn; with AVX2's 16, the
/// group's rows take the first half, then the second ([`Block`]), keeping four value
/// vectors live instead of eight. Measured on an Intel Xeon (`kernel_timing`, the 1.5B's
/// `gate` shape): an AVX2-only build (`target-cpu=x86-64-v3`) with all eight live spilled and
/// was 3-9% slower per product at 8 and 16 rows; an AVX-512 build half by half was 4-7% slower
/// at 4 rows.
pub(super) const REGISTERS_32: bool = cfg!(target_feature = "avx512f");

/// Activation rows per group: each weight block is unpacked once for all of them, with the
/// group's accumulators in registers.
const GROUP: usize = 8;

/// Blocks per slab of the reduction when a matmul has more activation rows than one tile (a
/// prompt): each task's weight rows are then reused from the cache by every row group, and
/// reducing in slabs keeps a group's activations (8 rows x 5 blocks, 15 KB) in the L1 cache
/// while the task's weight rows pass over them. With fewer rows (a verify) the weights stream
/// from memory once and in order, which slabs would break up. Either way each (weight row,
/// activation row) pair accumulates its blocks in order: the results are the same bits.
const SLAB: usize = 5;

/// The slab length for `m` activation rows of `kb` blocks: equal slabs of at most [`SLAB`]
/// blocks, or one slab of all.
fn slab(m: usize, kb: usize) -> usize {
    if m > MAX_ROWS && kb > SLAB {
        kb.div_ceil(kb.div_ceil(SLAB))
    } else {
        kb.max(1)
    }
}

/// How the kernels multiply bytes, and the tile function compiled for those instructions.
pub(super) trait Products {
    /// Whether the products come from `vpdpbusd` (the activations then carry the offsets as
    /// [`dots`] takes them) rather than from `vpmaddubsw`.
    const VNNI: bool;

    /// `acc` plus, per 32-bit lane, the four products of `w`'s unsigned bytes with `a`'s
    /// signed ones.
    ///
    /// # Safety
    /// The CPU must have the instruction (the implementor's documentation).
    unsafe fn dpbusd(acc: __m256i, w: __m256i, a: __m256i) -> __m256i;

    /// Weight rows `js` (each `kb` blocks of `w`) against `rows` activation rows
    /// (`acts[r * kb + b]`), in groups of up to [`GROUP`] activation rows, reducing in slabs
    /// of `slab` blocks ([`slab`]), compiled for the CPU features these products need.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and the features the implementor names; `acts`
    /// quantized for these products. Slice lengths are checked.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<B: Block, H: Block<Scales = B::Scales>, const HALF_BY_HALF: bool>(
        w: &Weights<B, H>,
        js: Range<usize>,
        acts: &[ActBlock],
        kb: usize,
        slab: usize,
        rows: usize,
        out: &mut Tile,
    );
}

/// Implements [`Products`] for `$p`: `$dpbusd` makes the products if `$vnni`, and the tile is
/// compiled with `$features` (the only place they are enabled).
macro_rules! products {
    ($(
        $(#[$doc:meta])*
        $p:ident: $features:literal, $vnni:literal, |$acc:ident, $w:ident, $a:ident| $dpbusd:expr;
    )*) => {$(
        $(#[$doc])*
        pub(super) struct $p;

        impl Products for $p {
            const VNNI: bool = $vnni;

            #[inline(always)]
            unsafe fn dpbusd($acc: __m256i, $w: __m256i, $a: __m256i) -> __m256i {
                $dpbusd
            }

            #[inline(always)]
            unsafe fn tile<B: Block, H: Block<Scales = B::Scales>, const HALF_BY_HALF: bool>(
                w: &Weights<B, H>,
                js: Range<usize>,
                acts: &[ActBlock],
                kb: usize,
                slab: usize,
                rows: usize,
                out: &mut Tile,
            ) {
                /// # Safety
                /// As [`Products::tile`]: the CPU has this implementor's features.
                #[target_feature(enable = $features)]
                unsafe fn compiled<
                    B: Block,
                    H: Block<Scales = B::Scales>,
                    const HALF_BY_HALF: bool,
                >(
                    w: &Weights<B, H>,
                    js: Range<usize>,
                    acts: &[ActBlock],
                    kb: usize,
                    slab: usize,
                    rows: usize,
                    out: &mut Tile,
                ) {
                    tile_with::<B, H, HALF_BY_HALF, $p>(w, js, acts, kb, slab, rows, out)
                }
                compiled::<B, H, HALF_BY_HALF>(w, js, acts, kb, slab, rows, out)
            }
        }
    )*};
}

products! {
    /// `vpmaddubsw` and `vpmaddwd`: AVX2, FMA and F16C ([`supported`]).
    Maddubs: "avx2,fma,f16c", false, |_acc, _w, _a| unreachable!("products by vpmaddubsw");
    /// `vpdpbusd`, VEX-encoded: AVX-VNNI besides ([`supported_vnni`]).
    VexDpbusd: "avx2,fma,f16c,avxvnni", true, |acc, w, a| _mm256_dpbusd_avx_epi32(acc, w, a);
    /// `vpdpbusd` on 32-byte vectors, EVEX-encoded: AVX-512 F, VNNI and VL besides (every
    /// CPU the AVX-512 family runs on).
    EvexDpbusd: "avx2,fma,f16c,avx512f,avx512vnni,avx512vl", true,
        |acc, w, a| _mm256_dpbusd_epi32(acc, w, a);
}

/// [`Products::tile`]'s work, inlined into each of its compiled versions.
///
/// # Safety
/// As [`Products::tile`].
#[inline(always)]
unsafe fn tile_with<
    B: Block,
    H: Block<Scales = B::Scales>,
    const HALF_BY_HALF: bool,
    P: Products,
>(
    w: &Weights<B, H>,
    js: Range<usize>,
    acts: &[ActBlock],
    kb: usize,
    slab: usize,
    rows: usize,
    out: &mut Tile,
) {
    assert!(
        w.holds(js.end, kb)
            && rows.checked_mul(kb).is_some_and(|len| len <= acts.len())
            && js.len() <= out.len()
    );
    let mut r = 0;
    while r < rows {
        let n = (rows - r).min(GROUP);
        let acts = &acts[r * kb..(r + n) * kb];
        let js = js.clone();
        match n {
            1 => group::<B, H, HALF_BY_HALF, P, 1>(w, js, acts, kb, slab, r, out),
            2 => group::<B, H, HALF_BY_HALF, P, 2>(w, js, acts, kb, slab, r, out),
            3 => group::<B, H, HALF_BY_HALF, P, 3>(w, js, acts, kb, slab, r, out),
            4 => group::<B, H, HALF_BY_HALF, P, 4>(w, js, acts, kb, slab, r, out),
            5 => group::<B, H, HALF_BY_HALF, P, 5>(w, js, acts, kb, slab, r, out),
            6 => group::<B, H, HALF_BY_HALF, P, 6>(w, js, acts, kb, slab, r, out),
            7 => group::<B, H, HALF_BY_HALF, P, 7>(w, js, acts, kb, slab, r, out),
            _ => group::<B, H, HALF_BY_HALF, P, 8>(w, js, acts, kb, slab, r, out),
        }
        r += n;
    }
}

/// `R` activation rows (`acts`, `R * kb` blocks) against weight rows `js`, into columns
/// `r0..r0 + R` of `out`: each weight block is unpacked once, then multiplied by each row's,
/// half by half over the rows if `HALF_BY_HALF` ([`REGISTERS_32`]).
/// Slab by slab of `slab` blocks, every weight row's accumulators go on from where the last
/// slab left them.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and what `P` names (and `acts` quantized for
/// it); `acts` holds `R * kb` blocks, `w` the rows `js` of `kb` blocks each, `js` at most
/// [`CHUNK`] rows (checked by the caller, [`tile_with`]); `slab > 0`.
#[inline(always)]
unsafe fn group<
    B: Block,
    H: Block<Scales = B::Scales>,
    const HALF_BY_HALF: bool,
    P: Products,
    const R: usize,
>(
    w: &Weights<B, H>,
    js: Range<usize>,
    acts: &[ActBlock],
    kb: usize,
    slab: usize,
    r0: usize,
    out: &mut Tile,
) {
    let a = acts.as_ptr();
    let mut accs = [[_mm256_setzero_ps(); R]; CHUNK];
    for s in (0..kb).step_by(slab) {
        let e = (s + slab).min(kb);
        for (j, accs) in js.clone().zip(accs.iter_mut()) {
            let mut acc = *accs;
            for b in s..e {
                let part = w.block(j, b);
                let act = |i: usize| &*a.add(i * kb + b);
                let sc = scales(&part);
                let half = |w, i, h| half::<B, P>(w, &sc, act(i), h);
                let lo = vectors::<B, H, P>(&part, 0);
                if HALF_BY_HALF {
                    let mut ints: [__m256i; R] = std::array::from_fn(|i| half(&lo, i, 0));
                    let hi = vectors::<B, H, P>(&part, 1);
                    for (i, ints) in ints.iter_mut().enumerate() {
                        *ints = both::<B, P>(&sc, *ints, half(&hi, i, 1));
                    }
                    for (i, acc) in acc.iter_mut().enumerate() {
                        *acc = finish::<B, P>(&sc, ints[i], act(i), *acc);
                    }
                } else {
                    let hi = vectors::<B, H, P>(&part, 1);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let ints = both::<B, P>(&sc, half(&lo, i, 0), half(&hi, i, 1));
                        *acc = finish::<B, P>(&sc, ints, act(i), *acc);
                    }
                }
            }
            *accs = acc;
        }
    }
    for (out, acc) in out.iter_mut().zip(&accs).take(js.len()) {
        if R >= ADD_ALL_FROM {
            let all = std::array::from_fn(|i| acc.get(i).copied().unwrap_or(_mm256_setzero_ps()));
            let sums: [f32; GROUP] = std::mem::transmute(add_lanes(&all));
            out[r0..r0 + R].copy_from_slice(&sums[..R]);
        } else {
            for (o, acc) in out[r0..r0 + R].iter_mut().zip(acc) {
                *o = add_one(*acc);
            }
        }
    }
}

/// The sum of `v`'s lanes as `((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7))`
/// ([`add_lanes`] takes the same tree).
#[inline(always)]
pub(super) fn add_one(v: __m256) -> f32 {
    // SAFETY: a vector of 8 f32s has the layout of the array.
    let v: [f32; 8] = unsafe { std::mem::transmute(v) };
    ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]))
}

/// From how many rows [`group`] adds its accumulators' lanes all at once ([`add_lanes`])
/// rather than one by one ([`add_one`]): the same bits either way.
const ADD_ALL_FROM: usize = 4;

/// The lanes of each of 8 vectors added up: lane `r` of the result is the sum of `v[r]`'s,
/// in a transposing tree (7 additions of whole vectors and their shuffles, about 3 operations
/// a sum against 15 for one vector's lanes alone), each lane by the tree of [`add_one`],
/// whatever the other vectors hold (tested).
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
pub(super) unsafe fn add_lanes(v: &[__m256; GROUP]) -> __m256 {
    // Taken in the order that leaves the sums in order (the tree puts the sum of its input t
    // in lane [0, 4, 1, 5, 2, 6, 3, 7][t]).
    let v = |t: usize| v[[0, 4, 1, 5, 2, 6, 3, 7][t]];
    // Halves added: [a0+a4 .. a3+a7, b0+b4 .. b3+b7].
    let h: [__m256; 4] = std::array::from_fn(|k| {
        let (a, b) = (v(2 * k), v(2 * k + 1));
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    });
    // Adjacent pairs, twice.
    let q = [_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3])];
    _mm256_hadd_ps(q[0], q[1])
}
