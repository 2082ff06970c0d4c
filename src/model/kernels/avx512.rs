//! AVX-512 VNNI kernels: one `vpdpbusd` (64 multiply-adds) per 64-byte vector.
//!
//! A kernel goes through a weight row a step of `Z` value vectors at a time: for Q6_K (one
//! scale per 16 values) one 256-value block in a layout of its own (four vectors, a 16-value
//! group per lane), for Q4_K, Q5_K, Q5_0 and Q8_0 (one scale per 32) two blocks of AVX2's
//! layout side by side (eight vectors, a 32-value group per lane, [`TwoBlocks`]). Per step and
//! activation row: `Z` `vpdpbusd`, one conversion, a multiply and a fused multiply-add, with
//! the scales applied per 32-bit lane after the integer sums, so steps of two blocks take half
//! the float work per block. Formats stored plus a constant start their integer sums from
//! minus its products (exact, and free); the mins of Q4_K and Q5_K take a second fused
//! multiply-add. Weight blocks are unpacked once for all activation rows. Weight rows go in
//! pairs, so that each activation vector is loaded once for both, from 9 activation rows, and
//! for Q6_K also from 2 when the rows outgrow L1 ([`in_pairs`]); activation rows that outgrow
//! L1 are taken a span of steps at a time ([`span`]), so that they come from L2 once per tile
//! of weight rows rather than once per weight row.

use super::layout::{
    f16_to_f32, HalfQ5_0Planes, HalfQ8_0, PackedQ4K, PackedQ5KPlanes, PackedQ5_0Planes, PackedQ6K,
    PackedQ8_0, Rows, QK, WIDE,
};
use super::{for_each_output, Part, Tile, Weights, CHUNK, MAX_ROWS};
use std::arch::x86_64::*;
use std::ops::Range;

/// True if this CPU has the AVX-512 instructions these kernels use: F, BW, VNNI, and VL for
/// the formats run on AVX2's layout with 32-byte `vpdpbusd` (every AVX-512 VNNI CPU has it);
/// not DQ. FMA and F16C, which they use too, are AVX2's (`Kernels::runs_here` asks both).
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx2")
}

/// `dst[m x n] = lhs[m x k] x Wᵀ` for `n` Q6_K weight rows of `k / 256` blocks each.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, AVX2 and F16C
/// ([`Kernels::runs_here`](super::Kernels::runs_here)). Slice lengths are checked.
pub(super) unsafe fn matmul_q6k(
    w: &[PackedQ6K<WIDE>],
    mkn: (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let kb = mkn.1.div_ceil(QK);
    matmul_steps::<_, 4>(&Weights::new(w, &[], kb), kb, mkn, lhs, dst)
}

/// `dst[m x n] = lhs[m x k] x Wᵀ` for the `n` weight rows of `w`, `k.div_ceil(256)` blocks
/// each in AVX2's layout (a row's half-size last block in `w.tails`), taken two at a time
/// ([`TwoBlocks`]).
///
/// # Safety
/// As [`matmul_q6k`].
pub(super) unsafe fn matmul_two_blocks<B: TwoBlock + Sync, H: NarrowPart + Sync>(
    w: &Rows<B, H>,
    mkn: (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let kb = mkn.1.div_ceil(QK);
    let steps = TwoBlocks(Weights::new(&w.blocks, &w.tails, kb));
    matmul_steps::<_, 8>(&steps, kb, mkn, lhs, dst)
}

/// `dst[m x n] = lhs[m x k] x Wᵀ` for the `n` weight rows of `w`, `kb` blocks each, `Z / 4`
/// blocks a step.
///
/// # Safety
/// As [`matmul_q6k`].
unsafe fn matmul_steps<W: Steps<Z> + Sync, const Z: usize>(
    w: &W,
    kb: usize,
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let ks = kb.div_ceil(Z / 4);
    assert!(w.holds_steps(n, ks) && Some(lhs.len()) == m.checked_mul(k));
    let acts = Acts::<Z>::quantize(lhs, m, k, W::OFFSET_LOG2);
    let row_bytes = ks * std::mem::size_of::<Acts<Z>>();
    for_each_output((m, n), row_bytes, dst, |js, r0, rows, out| {
        // SAFETY: the caller guarantees the CPU features; `js` is within the `n` rows of `w`
        // (checked above) and rows `r0..r0 + rows` within the `m` quantized rows.
        unsafe { packed_tile(w, js, &acts[r0 * ks..], ks, rows, out) }
    });
}

/// A matrix's weight rows as a kernel goes through them, `Z` value vectors a step.
trait Steps<const Z: usize> {
    /// Formats whose stored values all carry the same offset, a power of two (Q6_K 32, Q5_0 16,
    /// Q8_0 128): its log2. The integer sums then start from minus its products and end on the
    /// true values' sums, exactly (a row of zero weights gives exactly 0), and the steps'
    /// offsets are unused. `None` for Q4_K and Q5_K, whose mins vary by sub-block and are
    /// subtracted in floats.
    const OFFSET_LOG2: Option<u32>;

    /// Whether rows `..end` of `ks` steps are all there ([`Weights::holds`]).
    fn holds_steps(&self, end: usize, ks: usize) -> bool;

    /// The same rows read `rows` at a time ([`Weights::in_groups_of`]).
    fn in_groups_of(&self, rows: usize) -> Self;

    /// Step `s` of weight row `j`, prefetching ahead, in registers: the value vectors (unsigned
    /// bytes), and per 32-bit lane the scale of its values and (formats without
    /// [`Steps::OFFSET_LOG2`]) the offset to subtract per unit of activation sum.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VNNI, AVX2 and F16C
    /// ([`Kernels::runs_here`](super::Kernels::runs_here)); `j` below an `end` and `s` below a `ks`
    /// for which [`Steps::holds_steps`] is true.
    unsafe fn step(&self, j: usize, s: usize) -> ([__m512i; Z], __m512, __m512);
}

/// Q6_K in AVX-512's own layout ([`WIDE`]: a 16-value group, one scale, per lane), a block a
/// step.
impl Steps<4> for Weights<'_, PackedQ6K<WIDE>, PackedQ6K<WIDE>> {
    /// Values are stored plus 32.
    const OFFSET_LOG2: Option<u32> = Some(5);

    fn holds_steps(&self, end: usize, ks: usize) -> bool {
        self.holds(end, ks)
    }

    fn in_groups_of(&self, rows: usize) -> Self {
        Weights::in_groups_of(self, rows)
    }

    #[inline(always)]
    unsafe fn step(&self, j: usize, b: usize) -> ([__m512i; 4], __m512, __m512) {
        match self.block(j, b) {
            Part::Whole(x) | Part::Half(x) => unpack_q6k(x),
        }
    }
}

/// Blocks of AVX2's layout ([`NARROW`]: a 32-value group per 32-bit lane of a 32-byte
/// vector), two at a time: vector `z` of a step holds vector `z` of the first block in its low
/// half and of the second in its high half, so lane `l` is group `l % 8` of block `l / 8`, one
/// scale a lane for the formats whose scales are per 32 values. A step's eight `vpdpbusd` then
/// take one conversion, one multiply and one fused multiply-add per activation row (mins one
/// more), where two 256-value blocks of 16-value lanes took twice that. Against that layout
/// (`kernel_timing`, AMD EPYC Zen 4, interleaved), the 1,536-wide products of Q4_K took 13-18%
/// less time per product at 8 rows and 6-16% less at one row, Q5_K's 12% and 11%, and the
/// 896-wide ones of Q5_0 11% and 2%; Q8_0's 896-wide ones took 5-13% less from 8 rows but
/// 10-13% more at one row held in L3 (17% less streaming from memory, as a decode does). A row
/// of an odd number of blocks ends on a step of one, its high halves zero; a row's half-size
/// last block ([`Rows`](super::layout::Rows)) fills the low quarter of each vector of its
/// half.
struct TwoBlocks<'a, B, H>(Weights<'a, B, H>);

/// A block of AVX2's layout, or a row's half-size last block, as either half of a step of
/// [`TwoBlocks`]: its storage in 32-byte pieces (a half block's 16-byte ones zero-extended)
/// and its lanes' scales.
pub(super) trait NarrowPart {
    /// Piece `i` of the block's storage (the step's vectors are made from the pieces,
    /// [`TwoBlock::vectors`]).
    ///
    /// # Safety
    /// The CPU must have AVX2; `i` below the format's pieces.
    unsafe fn piece(&self, i: usize) -> __m256i;

    /// Per lane: the scale of its values and the offset to subtract per unit of activation
    /// sum (zero for formats with [`TwoBlock::OFFSET_LOG2`]); zero in a half block's lanes 4-7.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    unsafe fn scales(&self) -> (__m256, __m256);
}

/// A format in AVX2's layout taken two blocks a step.
pub(super) trait TwoBlock: NarrowPart {
    /// As [`Steps::OFFSET_LOG2`].
    const OFFSET_LOG2: Option<u32>;

    /// A step's eight value vectors (unsigned bytes) from its pieces: `piece(i)` holds piece
    /// `i` of the first block in its low half and of the second in its high half.
    ///
    /// # Safety
    /// The CPU must have what [`supported`] asks (the implementations enable AVX-512 F, BW and
    /// VNNI, and AVX2).
    unsafe fn vectors(piece: impl Fn(usize) -> __m512i) -> [__m512i; 8];
}

/// Piece `i` of a block or a half block.
///
/// # Safety
/// As [`NarrowPart::piece`].
#[inline(always)]
unsafe fn piece_of<B: NarrowPart, H: NarrowPart>(part: &Part<'_, B, H>, i: usize) -> __m256i {
    match part {
        Part::Whole(x) => x.piece(i),
        Part::Half(x) => x.piece(i),
    }
}

impl<B: TwoBlock, H: NarrowPart> Steps<8> for TwoBlocks<'_, B, H> {
    const OFFSET_LOG2: Option<u32> = B::OFFSET_LOG2;

    fn holds_steps(&self, end: usize, ks: usize) -> bool {
        let kb = self.blocks();
        self.0.holds(end, kb) && kb.div_ceil(2) == ks
    }

    fn in_groups_of(&self, rows: usize) -> Self {
        Self(self.0.in_groups_of(rows))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    unsafe fn step(&self, j: usize, s: usize) -> ([__m512i; 8], __m512, __m512) {
        let first = self.0.block(j, 2 * s);
        let second = (2 * s + 1 < self.blocks()).then(|| self.0.block(j, 2 * s + 1));
        let w = B::vectors(|i| {
            let low = piece_of(&first, i);
            match &second {
                Some(x) => _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), piece_of(x, i)),
                None => _mm512_zextsi256_si512(low),
            }
        });
        let [(s0, o0), (s1, o1)] = [Some(&first), second.as_ref()].map(|x| match x {
            Some(Part::Whole(x)) => x.scales(),
            Some(Part::Half(x)) => x.scales(),
            None => (_mm256_setzero_ps(), _mm256_setzero_ps()),
        });
        // AVX-512 F's 64-bit insert moves the same bits as DQ's `_mm512_insertf32x8`, which
        // these kernels do not require (a virtual machine may hide DQ).
        let join = |a: __m256, b: __m256| {
            let low = _mm512_castpd256_pd512(_mm256_castps_pd(a));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(low, _mm256_castps_pd(b)))
        };
        (w, join(s0, s1), join(o0, o1))
    }
}

impl<B, H> TwoBlocks<'_, B, H> {
    /// Blocks a row spans, its half-size last one included.
    fn blocks(&self) -> usize {
        self.0.full + usize::from(!self.0.tails.is_empty())
    }
}

/// The low and high nibbles of the pieces `0..4`: the eight value vectors.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn nibble_vectors(piece: impl Fn(usize) -> __m512i) -> [__m512i; 8] {
    let m4 = _mm512_set1_epi8(0x0f);
    let mut w = [_mm512_setzero_si512(); 8];
    for i in 0..4 {
        let v = piece(i);
        w[2 * i] = _mm512_and_si512(v, m4);
        w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    w
}

/// 32 bytes at `p`.
///
/// # Safety
/// The CPU must have AVX; `p` points to 32 readable bytes.
#[inline(always)]
unsafe fn load32(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const _)
}

/// 16 bytes at `p`, zero-extended to 32.
///
/// # Safety
/// The CPU must have AVX; `p` points to 16 readable bytes.
#[inline(always)]
unsafe fn load16(p: *const u8) -> __m256i {
    _mm256_zextsi128_si256(_mm_loadu_si128(p as *const _))
}

/// Eight f16 scales as floats.
///
/// # Safety
/// The CPU must have AVX and F16C.
#[inline(always)]
unsafe fn scales8(d: &[u16; 8]) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr() as *const _))
}

/// Four f16 scales as floats, lanes 4-7 zero.
///
/// # Safety
/// The CPU must have AVX and F16C.
#[inline(always)]
unsafe fn scales4(d: &[u16; 4]) -> __m256 {
    _mm256_zextps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(d.as_ptr() as *const _)))
}

impl NarrowPart for PackedQ4K {
    #[inline(always)]
    unsafe fn piece(&self, i: usize) -> __m256i {
        load32(self.qs.as_ptr().add(32 * i))
    }

    #[inline(always)]
    unsafe fn scales(&self) -> (__m256, __m256) {
        let lanes = |x: &[u8; 8]| {
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                _mm_loadl_epi64(x.as_ptr() as *const _),
            ))
        };
        let scale = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(self.d)), lanes(&self.scales));
        let offset = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(self.dmin)), lanes(&self.mins));
        (scale, offset)
    }
}

impl NarrowPart for PackedQ5KPlanes {
    /// Pieces 0-3: the nibbles; 4: bit 4's planes.
    #[inline(always)]
    unsafe fn piece(&self, i: usize) -> __m256i {
        match i {
            4 => load32(self.qh.as_ptr()),
            i => self.low.piece(i),
        }
    }

    #[inline(always)]
    unsafe fn scales(&self) -> (__m256, __m256) {
        self.low.scales()
    }
}

/// [`NarrowPart`] for eight 32-value blocks (or a row's last four, in half size): nibbles in
/// `qs` (pieces 0-3, `$w` bytes each: 32, or 16 in a half) or whole bytes (Q8_0, pieces 0-7),
/// bit 4's planes in `qh` (piece 4) for the five-bit formats, one scale each in `d` and, for
/// formats whose value is `d q + m`, its `m` (the offset per unit of activation sum is `-m`).
macro_rules! per32_parts {
    ($($t:ty: $w:literal, $load:ident, $scales:ident, [$($qh:ident)?], [$($m:ident)?];)*) => {$(
        impl NarrowPart for $t {
            #[inline(always)]
            unsafe fn piece(&self, i: usize) -> __m256i {
                $(if i == 4 {
                    return $load(self.$qh.as_ptr());
                })?
                $load(self.qs.as_ptr().add($w * i))
            }

            #[inline(always)]
            unsafe fn scales(&self) -> (__m256, __m256) {
                #[allow(unused_mut)]
                let mut offset = _mm256_setzero_ps();
                $(offset = _mm256_sub_ps(offset, $scales(&self.$m));)?
                ($scales(&self.d), offset)
            }
        }
    )*};
}

per32_parts! {
    PackedQ5_0Planes: 32, load32, scales8, [qh], [];
    HalfQ5_0Planes: 16, load16, scales4, [qh], [];
    PackedQ8_0: 32, load32, scales8, [], [];
    HalfQ8_0: 16, load16, scales4, [], [];
}

/// [`TwoBlock`] for `$t`, stored plus `2^$offset` if that is not `None`, its vectors made by
/// `$vectors`.
macro_rules! two_block {
    ($($t:ty: $offset:expr, $vectors:expr;)*) => {$(
        impl TwoBlock for $t {
            const OFFSET_LOG2: Option<u32> = $offset;

            #[inline(always)]
            unsafe fn vectors(piece: impl Fn(usize) -> __m512i) -> [__m512i; 8] {
                $vectors(piece)
            }
        }
    )*};
}

two_block! {
    PackedQ4K: None, nibble_vectors;
    PackedQ5KPlanes: None, planes_vectors;
    PackedQ5_0Planes: Some(4), planes_vectors;
    PackedQ8_0: Some(7), std::array::from_fn;
}

/// The value vectors of five-bit formats in AVX2's layout: nibbles in pieces 0-3 and bit 4 in
/// bit planes in piece 4 (bit `z` of a byte is bit 4 of the value at that byte of vector `z`).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn planes_vectors(piece: impl Fn(usize) -> __m512i) -> [__m512i; 8] {
    {
        let low = nibble_vectors(&piece);
        // Each vector's bit shifted to bit 4 within its byte (the 16-bit shifts carry other
        // bytes' bits only below it).
        let p = piece(4);
        let at4 = [
            _mm512_slli_epi16::<4>(p),
            _mm512_slli_epi16::<3>(p),
            _mm512_slli_epi16::<2>(p),
            _mm512_slli_epi16::<1>(p),
            p,
            _mm512_srli_epi16::<1>(p),
            _mm512_srli_epi16::<2>(p),
            _mm512_srli_epi16::<3>(p),
        ];
        // low | (at4 & 0x10)
        std::array::from_fn(|z| {
            _mm512_ternarylogic_epi32::<0xf8>(low[z], at4[z], _mm512_set1_epi8(0x10))
        })
    }
}

/// A step's activations (`Z / 4` blocks of 256) quantized to 8 bits with one scale a block
/// (as candle's Q8_K, up to the sign convention and rounding ties), in the kernel layout (lane
/// `l` of vector `z` holds values `gl + 4z .. gl + 4z + 4`, `g = 4Z` values a lane), with the
/// sum of each lane's values.
#[repr(C, align(64))]
struct Acts<const Z: usize> {
    qs: [[i8; 64]; Z],
    /// Each lane's sum as the weights' format takes it off: for a format stored plus a
    /// constant ([`Steps::OFFSET_LOG2`]) minus the integer sum times it, where the lane's
    /// `vpdpbusd` chain starts; otherwise (Q4_K's mins) the f32 bits of the sum times `d`.
    sums: [u32; 16],
    /// Each lane's scale (its block's); in the padding a single block would have anyway.
    d: [f32; 16],
}

impl<const Z: usize> Acts<Z> {
    /// Values a step holds.
    const VALUES: usize = 64 * Z;

    /// The kernels read the sums and scales with aligned 512-bit loads (checked where
    /// [`Acts::quantize`] builds them, at compile time).
    const ALIGNED: () = {
        use std::mem::offset_of;
        assert!(
            offset_of!(Self, sums).is_multiple_of(64) && offset_of!(Self, d).is_multiple_of(64)
        );
    };

    /// Quantizes `m` rows of `k` values, step by step (a row's last step padded with zeros,
    /// as the weights are), with the lane sums for weights of offset `2^offset_log2`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
    unsafe fn quantize(lhs: &[f32], m: usize, k: usize, offset_log2: Option<u32>) -> Vec<Self> {
        let () = Self::ALIGNED;
        let mut out = Vec::with_capacity(m * k.div_ceil(Self::VALUES));
        for row in lhs.chunks_exact(k) {
            for x in row.chunks(Self::VALUES) {
                let mut step = Self {
                    qs: [[0; 64]; Z],
                    sums: [0; 16],
                    d: [0.0; 16],
                };
                for (i, x) in x.chunks(QK).enumerate() {
                    let mut padded = [0f32; QK];
                    padded[..x.len()].copy_from_slice(x);
                    // SAFETY: the caller guarantees the CPU features; `i < Z / 4`.
                    unsafe { step.quantize_block(i, &padded, offset_log2) };
                }
                out.push(step);
            }
        }
        out
    }

    /// Quantizes block `i` of the step (its lanes `16i / (Z / 4) ..`) from `x`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VNNI, and AVX2; `i < Z / 4`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn quantize_block(&mut self, i: usize, x: &[f32; QK], offset_log2: Option<u32>) {
        const { assert!(Z == 4 || Z == 8) };
        let lanes = 16 / (Z / 4);
        let own = i * lanes..(i + 1) * lanes;
        let p = x.as_ptr();
        let mut amax = _mm512_setzero_ps();
        let mut nan: __mmask16 = 0;
        for g in 0..16 {
            let v = _mm512_loadu_ps(p.add(16 * g));
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        }
        let amax = _mm512_reduce_max_ps(amax);
        if nan != 0 || amax.is_infinite() {
            // NaN scales, so that every product is NaN, as in plain arithmetic (`max` and the
            // integer conversion would turn a NaN into a plain number).
            self.sums[own.clone()].fill(f32::NAN.to_bits());
            self.d[own].fill(f32::NAN);
            return;
        }
        let d = amax / 127.0;
        self.d[own.clone()].fill(d);
        if amax == 0.0 {
            return;
        }
        let iscale = _mm512_set1_ps(127.0 / amax);
        // Values 16g..16g + 16 go to lane own.start + 16g / 4Z of the vectors from 16g % 4Z / 4 on,
        // 4 bytes in each.
        let mut sums = [0i32; 16];
        for g in 0..16 {
            let v = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * g)), iscale);
            let q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            let bytes: [[i8; 4]; 4] = std::mem::transmute(_mm512_cvtsepi32_epi8(q));
            let (lane, z0) = (own.start + 16 * g / (4 * Z), 16 * g % (4 * Z) / 4);
            for (z, b) in bytes.into_iter().enumerate() {
                self.qs[z0 + z][4 * lane..4 * lane + 4].copy_from_slice(&b);
            }
            sums[lane] += _mm512_reduce_add_epi32(q);
        }
        for l in own {
            self.sums[l] = match offset_log2 {
                // At most 32 x 127 << 7: far inside an i32.
                Some(log2) => (-(sums[l] << log2)) as u32,
                None => (sums[l] as f32 * d).to_bits(),
            };
        }
    }
}

/// The low four bits of 256 values, stored as the layout's nibbles, as the four vectors.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn nibbles(qs: &[u8; 128]) -> [__m512i; 4] {
    let m4 = _mm512_set1_epi8(0x0f);
    let [lo, hi] = [0, 64].map(|o| _mm512_loadu_si512(qs.as_ptr().add(o) as *const _));
    [
        _mm512_and_si512(lo, m4),
        _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4),
        _mm512_and_si512(hi, m4),
        _mm512_and_si512(_mm512_srli_epi16(hi, 4), m4),
    ]
}

/// A Q6_K block in registers.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn unpack_q6k(x: &PackedQ6K<WIDE>) -> ([__m512i; 4], __m512, __m512) {
    let (low, m30) = (nibbles(&x.ql), _mm512_set1_epi8(0x30));
    // Bits 4-5 of vector z are bits 2z..2z + 2 of `qh`: move them to bits 4-5.
    let h = _mm512_loadu_si512(x.qh.as_ptr() as *const _);
    let high = [
        _mm512_slli_epi16(h, 4),
        _mm512_slli_epi16(h, 2),
        h,
        _mm512_srli_epi16(h, 2),
    ];
    let w = std::array::from_fn(|z| _mm512_or_si512(low[z], _mm512_and_si512(high[z], m30)));
    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(x.scales.as_ptr() as *const _));
    let scale = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(x.d)), _mm512_cvtepi32_ps(sc));
    // Values are stored plus 32 (`Steps::OFFSET_LOG2`).
    (w, scale, _mm512_setzero_ps())
}

/// The activation bytes a tile sweeps per weight row while they stay in a core's L1 data cache
/// (32-48 KB on CPUs with AVX-512; the rest holds the weight blocks and, in spans, the kept
/// sums: up to 16 KB). Beyond it each activation vector would come from L2 for every weight
/// row, whose bandwidth, not the multiply-adds, then bounds a block: the tile then goes in
/// spans of blocks that fit ([`span`]), and its weight rows in pairs ([`in_pairs`]), which
/// halves the loads (measured with the `kernel_timing` test: the 1.5B's `down` shape, 35
/// blocks a row, 21-29% less time per product at 4-8 rows on an Intel Xeon, before spans).
const L1_ACTS: usize = 32 << 10;

/// [`L1_ACTS`] for steps of two blocks ([`TwoBlocks`]): the 1.5B's `down` shape at 8 rows
/// took 7-16% less time per product in spans of 3 steps (6 blocks) than of 6 (`kernel_timing`,
/// AMD EPYC Zen 4).
const L1_ACTS_TWO_BLOCKS: usize = 20 << 10;

/// From how many activation rows weight rows go in pairs even while the activations stay in
/// L1. Pairs gain where the loads and multiply-adds bound a block, not the memory: on an AMD
/// EPYC Zen 5 (`kernel_timing`, `KT=1536,151936`: 131-191 MB streaming from memory) Q4_K and
/// Q6_K took 19-22% less time per product at 12 rows than one weight row at a time with the
/// accumulators in memory, but up to 46% more at 2-4 rows. One weight row with its
/// accumulators in registers ([`by_count`], up to 8 rows) was faster than pairs with theirs in
/// memory at 6-8 rows (Q4_K 0.62-0.64 ns at 8 rows against 0.65-0.67, Q6_K 0.65-0.67 against
/// 0.72-0.75); pairs keep theirs in registers too since, which has not been compared at these
/// shapes. On an Intel Xeon, pairs gained nothing while the activations stayed in L1.
const PAIRS_FROM: usize = 9;

/// Whether a tile of `rows` activation rows of `ks` steps goes in weight-row pairs. Steps of
/// two blocks go in pairs only from [`PAIRS_FROM`] rows: with 8 rows, two unpacked steps and
/// 16 accumulators would take more than the 32 vector registers (the `down` shape took 2-10%
/// longer in pairs at 4-8 rows, AMD EPYC Zen 4).
fn in_pairs<const Z: usize>(rows: usize, ks: usize) -> bool {
    rows >= PAIRS_FROM
        || (Z == 4 && rows > 1 && rows * ks * std::mem::size_of::<Acts<Z>>() > L1_ACTS)
}

/// `$f::<.., S, N>(args)` for `S` the value of `$spans` and `N` the row count `$rows` if it is
/// one of the listed counts, else 0 (the count read at run time).
macro_rules! by_count {
    ($rows:expr, [$($n:literal),*], $spans:expr, $f:ident::<$w:ty, $z:ident> $args:tt) => {
        match ($spans, $rows) {
            $((true, $n) => $f::<$w, $z, true, $n> $args,)*
            $((false, $n) => $f::<$w, $z, false, $n> $args,)*
            (true, _) => $f::<$w, $z, true, 0> $args,
            (false, _) => $f::<$w, $z, false, 0> $args,
        }
    };
}

/// The steps each weight row runs before the next weight row takes its turn: all `ks` while
/// `rows` activation rows of them fit in L1 ([`L1_ACTS`]), else spans of as near equal length
/// as fit, so that a span's activations come from L2 once for the whole tile rather than once
/// per weight row (the 1.5B's `down`, 35 blocks a row, outgrows L1 from 3 rows: 9, 9, 9 and 8
/// blocks at 8 rows). Spans shorter than [`MIN_SPAN`] are not taken, nor spans of one row: a
/// one-token decode streams the weights from memory, which wants them in order.
fn span<const Z: usize>(rows: usize, ks: usize) -> usize {
    let (l1, min_span) = match Z {
        4 => (L1_ACTS, MIN_SPAN),
        _ => (L1_ACTS_TWO_BLOCKS, MIN_SPAN_TWO_BLOCKS),
    };
    let fit = (l1 / (rows.max(1) * std::mem::size_of::<Acts<Z>>())).max(1);
    match ks.div_ceil(ks.div_ceil(fit)) {
        span if span >= min_span && rows > 1 => span,
        _ => ks,
    }
}

/// The shortest span of blocks worth taking: in spans of 3 blocks (rows of 6, a little over L1
/// at 16 rows), the 1.5B's 16-token forward took 15% longer in its `gate` and `up` and a third
/// longer in its output projection (AMD EPYC Zen 5), while its `down` took 23% less in spans
/// of 5.
const MIN_SPAN: usize = 4;

/// [`MIN_SPAN`] in steps of two blocks: in spans of 2 (4 blocks), the `gate` shape at 16 rows
/// took as long as the old layout's, against 12% less without spans (`kernel_timing`, AMD
/// EPYC Zen 4).
const MIN_SPAN_TWO_BLOCKS: usize = 3;

/// A weight row's sums against each activation row, one vector per activation row.
type Sums = [__m512; MAX_ROWS];

/// Weight rows `js` (each `ks` steps of `w`) against `rows` activation rows
/// (`acts[r * ks + s]`), step by step. From 9 activation rows, or when they outgrow L1
/// ([`in_pairs`]), weight rows go in pairs so that each activation vector is loaded once for
/// both; activation rows that outgrow L1 go in spans of steps ([`span`]), the sums kept
/// between spans. Every (weight row, activation row) pair goes through the same operations
/// in the same order either way.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2. Slice lengths are checked here.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn packed_tile<W: Steps<Z>, const Z: usize>(
    w: &W,
    js: Range<usize>,
    acts: &[Acts<Z>],
    ks: usize,
    rows: usize,
    out: &mut Tile,
) {
    assert!(
        w.holds_steps(js.end, ks)
            && rows.checked_mul(ks).is_some_and(|len| len <= acts.len())
            && js.len() <= out.len()
    );
    let (pairs, span) = (in_pairs::<Z>(rows, ks), span::<Z>(rows, ks));
    let spans = span < ks;
    // Rows read in pairs or in spans prefetch the same block of a later row, the first at
    // least `PREFETCH` bytes ahead (`Weights::in_groups_of`).
    let grouped = w.in_groups_of(if pairs { 2 } else { 1 });
    let w = if pairs || spans { &grouped } else { w };
    // Sums kept between spans, set only if there are spans. Kept in a `Vec`, the kernels were
    // inlined here despite their `#[inline(never)]` (in this toolchain's IR the no-inline mark
    // sat on the calls, not on the functions) and the 1,536-wide products took 15-40% longer.
    let mut kept_store;
    let kept: &mut [Sums] = match spans {
        true => {
            kept_store = [[_mm512_setzero_ps(); MAX_ROWS]; CHUNK];
            &mut kept_store[..js.len()]
        }
        false => &mut [],
    };
    // A few activation rows go through a copy of the loop for their count, whose accumulators
    // stay in registers: up to 8, for one weight row or for pairs (whose 2 x 8 accumulators and
    // two unpacked blocks take 28 of the 32 vector registers; measured faster than with the
    // accumulators in memory). The copies are not inlined here: inlined, Q4_K at 2-4 rows
    // took 14-20% longer (`kernel_timing`, AMD EPYC Zen 5). Whole rows go through copies
    // without spans (`S` false), whose code has nothing of them. (Pairs of 2-8 rows come only
    // for Q6_K beyond L1, so in spans, and steps of two blocks go in pairs only from 9 rows:
    // their `two_rows` copies for 2-8 rows, and Q6_K's without spans, are compiled but not
    // called.)
    for ss in (0..ks).step_by(span).map(|s| s..ks.min(s + span)) {
        let mut i = 0;
        while i < js.len() {
            let j = js.start + i;
            if pairs && i + 1 < js.len() {
                let [o0, o1] = out.get_disjoint_mut([i, i + 1]).unwrap();
                let kept = kept.get_mut(i..i + 2).unwrap_or_default();
                by_count!(
                    rows,
                    [2, 3, 4, 5, 6, 7, 8],
                    spans,
                    two_rows::<W, Z>(w, j, acts, ks, rows, ss.clone(), kept, o0, o1)
                );
                i += 2;
            } else {
                let kept = kept.get_mut(i..i + 1).unwrap_or_default();
                by_count!(
                    rows,
                    [1, 2, 3, 4, 5, 6, 7, 8],
                    spans,
                    one_row::<W, Z>(w, j, acts, ks, rows, ss.clone(), kept, &mut out[i])
                );
                i += 1;
            }
        }
    }
}

/// The sum of one step of activations times one of weights, accumulated into `acc`.
///
/// # Safety
/// The CPU must have AVX-512 F and VNNI.
#[inline(always)]
unsafe fn step_dot<const Z: usize>(
    offset_log2: Option<u32>,
    (wv, scale, offset): &([__m512i; Z], __m512, __m512),
    av: &[__m512i; Z],
    a: &Acts<Z>,
    acc: __m512,
) -> __m512 {
    // A format stored plus an offset starts from minus the offset's products (`Acts::sums`)
    // rather than from zero, which takes them off without an instruction of its own.
    let mut s = match offset_log2 {
        Some(_) => _mm512_load_si512(a.sums.as_ptr() as *const _),
        None => _mm512_setzero_si512(),
    };
    // Steps of two blocks run two chains of four `vpdpbusd` rather than one of eight, added at
    // the end (the same sum: integer addition is exact): with few activation rows a chain's
    // latency, not the pipes, bounds a step. Q4_K, Q5_0 and Q8_0 took 1-6% less time per
    // product at 1-2 rows and up to 3% less at 4-8 (`kernel_timing`, AMD EPYC Zen 4,
    // interleaved); Q6_K's chains of four gained nothing from halves.
    match Z {
        8 => {
            let mut t = _mm512_setzero_si512();
            for z in (0..Z).step_by(2) {
                s = _mm512_dpbusd_epi32(s, wv[z], av[z]);
                t = _mm512_dpbusd_epi32(t, wv[z + 1], av[z + 1]);
            }
            s = _mm512_add_epi32(s, t);
        }
        _ => {
            for (wv, av) in wv.iter().zip(av) {
                s = _mm512_dpbusd_epi32(s, *wv, *av);
            }
        }
    }
    // Lane sums are below 2^24, so the conversion is exact.
    let scaled = _mm512_mul_ps(*scale, _mm512_load_ps(a.d.as_ptr()));
    match offset_log2 {
        Some(_) => _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scaled, acc),
        None => {
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scaled, acc);
            _mm512_fnmadd_ps(_mm512_load_ps(a.sums.as_ptr() as *const f32), *offset, acc)
        }
    }
}

/// # Safety
/// The CPU must have AVX-512 F (the step is 64-byte aligned by its type).
#[inline(always)]
unsafe fn load_act<const Z: usize>(a: &Acts<Z>) -> [__m512i; Z] {
    std::array::from_fn(|z| _mm512_load_si512(a.qs[z].as_ptr() as *const _))
}

/// Steps `ss` of weight row `j` against each activation row: `N` of them if `N` is not 0 (a
/// count known at compile time), else `rows`. With spans (`S`), the sums start from zero at
/// step 0, else from `kept[0]`, and end in `out` at the row's last step, else in `kept[0]`;
/// without, `ss` is the whole row.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2; `acts` holds `rows` rows of `ks` steps and
/// `w` row `j` of `ks` steps (checked by [`packed_tile`]). The rest is checked here.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn one_row<W: Steps<Z>, const Z: usize, const S: bool, const N: usize>(
    w: &W,
    j: usize,
    acts: &[Acts<Z>],
    ks: usize,
    rows: usize,
    ss: Range<usize>,
    kept: &mut [Sums],
    out: &mut [f32; MAX_ROWS],
) {
    let rows = checked::<S, N>(rows, ks, &ss, kept, 1);
    let (from_kept, to_kept) = (S && ss.start > 0, S && ss.end < ks);
    let mut acc = start(from_kept, kept, 0, rows);
    for s in ss {
        let u = w.step(j, s);
        for (r, acc) in acc[..rows].iter_mut().enumerate() {
            let a = acts.get_unchecked(r * ks + s);
            *acc = step_dot(W::OFFSET_LOG2, &u, &load_act(a), a, *acc);
        }
    }
    if to_kept {
        keep(&acc, kept, 0, rows);
    } else {
        add_each(&acc, rows, out);
    }
}

/// # Safety
/// As [`one_row`], for weight rows `j` and `j + 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn two_rows<W: Steps<Z>, const Z: usize, const S: bool, const N: usize>(
    w: &W,
    j: usize,
    acts: &[Acts<Z>],
    ks: usize,
    rows: usize,
    ss: Range<usize>,
    kept: &mut [Sums],
    out0: &mut [f32; MAX_ROWS],
    out1: &mut [f32; MAX_ROWS],
) {
    let rows = checked::<S, N>(rows, ks, &ss, kept, 2);
    let (from_kept, to_kept) = (S && ss.start > 0, S && ss.end < ks);
    let mut acc0 = start(from_kept, kept, 0, rows);
    let mut acc1 = start(from_kept, kept, 1, rows);
    for s in ss {
        let (u0, u1) = (w.step(j, s), w.step(j + 1, s));
        for r in 0..rows {
            let a = acts.get_unchecked(r * ks + s);
            let av = load_act(a);
            acc0[r] = step_dot(W::OFFSET_LOG2, &u0, &av, a, acc0[r]);
            acc1[r] = step_dot(W::OFFSET_LOG2, &u1, &av, a, acc1[r]);
        }
    }
    if to_kept {
        keep(&acc0, kept, 0, rows);
        keep(&acc1, kept, 1, rows);
    } else {
        add_each(&acc0, rows, out0);
        add_each(&acc1, rows, out1);
    }
}

/// The row count of a kernel call (`N` if it is not 0, else `rows`), after checking the call:
/// `N` is 0 or `rows`, at most [`MAX_ROWS`]; `bs` lies within the row and is all of it without
/// spans (`S`); with spans `kept` holds a sum for each of the call's `weight_rows`.
#[inline(always)]
fn checked<const S: bool, const N: usize>(
    rows: usize,
    kb: usize,
    bs: &Range<usize>,
    kept: &[Sums],
    weight_rows: usize,
) -> usize {
    assert!(
        (N == 0 || N == rows)
            && rows <= MAX_ROWS
            && bs.end <= kb
            && if S {
                kept.len() >= weight_rows
            } else {
                bs.len() == kb
            }
    );
    if N == 0 {
        rows
    } else {
        N
    }
}

/// The sums a weight row starts a span from: zero, or `kept[i]`'s first `rows` (element by
/// element, so that with a fixed row count the accumulators stay in registers).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2; if `from_kept`, `kept` holds more than `i`
/// sums.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn start(from_kept: bool, kept: &[Sums], i: usize, rows: usize) -> Sums {
    std::array::from_fn(|r| match from_kept && r < rows {
        true => *kept.get_unchecked(i).get_unchecked(r),
        false => _mm512_setzero_ps(),
    })
}

/// `acc`'s first `rows` sums into `kept[i]`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2; `kept` holds more than `i` sums.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn keep(acc: &Sums, kept: &mut [Sums], i: usize, rows: usize) {
    for (k, a) in kept.get_unchecked_mut(i).iter_mut().zip(acc).take(rows) {
        *k = *a;
    }
}

/// The lanes of each of the first `rows` accumulators added up, into `out`: with many rows,
/// all sixteen at once ([`add_lanes`]), else one by one ([`add_one`]); both take the same
/// tree, so the same bits (tested).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
#[inline(always)]
unsafe fn add_each(acc: &[__m512; MAX_ROWS], rows: usize, out: &mut [f32; MAX_ROWS]) {
    if rows >= ADD_ALL_FROM {
        *out = std::mem::transmute::<__m512, [f32; MAX_ROWS]>(add_lanes(acc));
    } else {
        for (o, acc) in out[..rows].iter_mut().zip(&acc[..rows]) {
            *o = add_one(*acc);
        }
    }
}

/// The sum of `v`'s lanes by halves, then quarters, then pairs: lanes l + (l + 8), then
/// + (l + 4) + (l + 12), then (0 + 2) + (1 + 3) ([`add_lanes`] takes the same tree).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
pub(super) unsafe fn add_one(v: __m512) -> f32 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let h = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
}

/// From how many rows [`add_each`] adds all sixteen accumulators' lanes at once.
const ADD_ALL_FROM: usize = 6;

/// The lanes of each of 16 vectors added up: lane `r` of the result is the sum of `v[r]`'s,
/// in a transposing tree (15 additions and 30 shuffles of whole vectors, about 3 operations a
/// sum against 7 for one vector's lanes alone). Each lane's sum takes the tree of
/// [`add_one`], whatever the other vectors hold.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
pub(super) unsafe fn add_lanes(v: &[__m512; 16]) -> __m512 {
    // Taken in the order that leaves the sums in order: the tree puts the sum of its input
    // t in lane 4 (t % 4) + t / 4.
    let v = |t: usize| v[4 * (t % 4) + t / 4];
    // Quarters 0 + 2 and 1 + 3 of two vectors: [a0+a2, a1+a3, b0+b2, b1+b3].
    let l1: [__m512; 8] = std::array::from_fn(|k| {
        let (a, b) = (v(2 * k), v(2 * k + 1));
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    // One quarter (four partial sums) per vector: [a, b, c, d].
    let l2: [__m512; 4] = std::array::from_fn(|k| {
        let (a, b) = (l1[2 * k], l1[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    // Within each quarter, two partial sums each of two vectors, then one each of four.
    let l3: [__m512; 2] = std::array::from_fn(|k| {
        let (a, b) = (l2[2 * k], l2[2 * k + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    });
    let (a, b) = (_mm512_castps_pd(l3[0]), _mm512_castps_pd(l3[1]));
    _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
    )
}
