//! AVX-512 VNNI matmul kernels for the Q4_K, Q6_K, Q5_0 and Q8_0 weights of the GGUF models.
//!
//! A verify forward multiplies each weight matrix by k+1 activation rows. These kernels unpack
//! every weight block once and then run it against all rows, so extra rows cost only their own
//! multiply-adds, not another pass over the weights.
//!
//! To make that per-row work small, weights are repacked at load time ([`Packed`]) into a
//! layout the activations share: 256 values are four 64-byte vectors, and lane `l` (4 bytes) of
//! vector `z` holds values `16l + 4z .. 16l + 4z + 4`. Each 32-bit lane then only ever sees
//! values of one 16-value group, which share a scale (and a min or offset), so an activation
//! row costs four `vpdpbusd` (64 products each), one conversion and two fused multiply-adds per
//! 256 values: the scales apply per lane after the integer sums. Q5_0 and Q8_0 (32-value
//! blocks) are gathered eight blocks at a time; their rows are padded to 256 values.
//!
//! Row independence is by construction: for each (weight row, activation row) pair the
//! arithmetic is the same sequence of operations whatever the number of rows (integer sums are
//! exact; the float accumulation runs block by block in a fixed order). So a forward over k
//! tokens gives bit for bit the logits of k one-token forwards.
//!
//! [`available`] tells whether the CPU has the instructions; otherwise callers use candle's
//! `vec_dot` (also row-independent, slower for many rows).

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0};
use candle_core::quantized::GgmlDType;
use half::f16;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Activation rows handled by one kernel call (accumulators live on the stack).
const MAX_ROWS: usize = 16;
/// Values per K-quant block (and per activation block).
const QK: usize = 256;

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
struct Q8_0 {
    d: u16,
    qs: [i8; 32],
}
#[repr(C)]
struct Q5_0 {
    d: u16,
    qh: [u8; 4],
    qs: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<Q4K>() == std::mem::size_of::<BlockQ4K>());
const _: () = assert!(std::mem::size_of::<Q6K>() == std::mem::size_of::<BlockQ6K>());
const _: () = assert!(std::mem::size_of::<Q8_0>() == std::mem::size_of::<BlockQ8_0>());
const _: () = assert!(std::mem::size_of::<Q5_0>() == std::mem::size_of::<BlockQ5_0>());

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

/// Where value `v` of a 256-value block lives in the kernel layout: (vector, byte).
const fn slot(v: usize) -> (usize, usize) {
    (v % 16 / 4, 4 * (v / 16) + v % 4)
}

/// A Q4_K block in the kernel layout: the nibbles of vector `z` are in `qs[64 * (z / 2)..]`,
/// low nibbles for even `z`, high for odd; one scale and one min per 32 values, unpacked.
#[repr(C)]
pub struct PackedQ4K {
    d: u16,
    dmin: u16,
    scales: [u8; 8],
    mins: [u8; 8],
    qs: [u8; 128],
}

/// A Q6_K block in the kernel layout: the low four bits as in [`PackedQ4K`], bits 4-5 of
/// vector `z` in bits `2z..2z + 2` of `qh`; values are stored plus 32; one scale per 16 values.
#[repr(C)]
pub struct PackedQ6K {
    d: u16,
    scales: [i8; 16],
    ql: [u8; 128],
    qh: [u8; 64],
}

/// Eight Q5_0 blocks (256 values) in the kernel layout: the low four bits as in [`PackedQ4K`],
/// bit 4 of vector `z`'s 64 values in `qh[z]`; values are stored plus 16; one scale per 32
/// values. Rows are padded to whole groups of eight blocks with zero blocks.
#[repr(C)]
pub struct PackedQ5_0 {
    d: [u16; 8],
    qs: [u8; 128],
    qh: [u64; 4],
}

/// Eight Q8_0 blocks (256 values) in the kernel layout, values stored plus 128; one scale per
/// 32 values. Rows are padded like [`PackedQ5_0`].
#[repr(C)]
pub struct PackedQ8_0 {
    d: [u16; 8],
    qs: [u8; QK],
}

/// Value `v` (0..16) of a candle Q4_K block: 64-value chunks, low nibbles then high nibbles.
fn q4k_value(b: &Q4K, v: usize) -> u8 {
    let (chunk, i) = (v / 64, v % 64);
    let byte = b.qs[32 * chunk + i % 32];
    if i < 32 {
        byte & 15
    } else {
        byte >> 4
    }
}

/// Value `v` plus 32 (0..64) of a candle Q6_K block: per 128 values, four 32-value quarters
/// taking the low/high nibbles of `ql` and successive bit pairs of `qh`.
fn q6k_value(b: &Q6K, v: usize) -> u8 {
    let (half, quarter, l) = (v / 128, v % 128 / 32, v % 32);
    let ql = b.ql[64 * half + 32 * (quarter % 2) + l];
    let low = if quarter < 2 { ql & 15 } else { ql >> 4 };
    let high = (b.qh[32 * half + l] >> (2 * quarter)) & 3;
    low | (high << 4)
}

/// The low four bits of each value, at their slots.
fn pack_nibbles(value: impl Fn(usize) -> u8) -> [u8; 128] {
    let mut qs = [0u8; 128];
    for v in 0..QK {
        let (z, byte) = slot(v);
        qs[64 * (z / 2) + byte] |= (value(v) & 15) << (4 * (z % 2));
    }
    qs
}

fn unpack_nibble(qs: &[u8; 128], v: usize) -> u8 {
    let (z, byte) = slot(v);
    (qs[64 * (z / 2) + byte] >> (4 * (z % 2))) & 15
}

impl PackedQ4K {
    fn new(b: &Q4K) -> Self {
        let sm = q4k_unpacked_scales(&b.scales);
        Self {
            d: b.d,
            dmin: b.dmin,
            scales: sm[..8].try_into().unwrap(),
            mins: sm[8..].try_into().unwrap(),
            qs: pack_nibbles(|v| q4k_value(b, v)),
        }
    }

    /// The block as floats, computed exactly as candle's `to_float` does.
    fn dequantize(&self, y: &mut [f32]) {
        let (d, dmin) = (f16_to_f32(self.d), f16_to_f32(self.dmin));
        for (v, y) in y.iter_mut().enumerate() {
            let (sc, m) = (self.scales[v / 32], self.mins[v / 32]);
            *y = d * sc as f32 * unpack_nibble(&self.qs, v) as f32 - dmin * m as f32;
        }
    }
}

impl PackedQ6K {
    fn new(b: &Q6K) -> Self {
        let mut qh = [0u8; 64];
        for v in 0..QK {
            let (z, byte) = slot(v);
            qh[byte] |= (q6k_value(b, v) >> 4) << (2 * z);
        }
        Self {
            d: b.d,
            scales: b.scales,
            ql: pack_nibbles(|v| q6k_value(b, v)),
            qh,
        }
    }

    /// The block as floats, computed exactly as candle's `to_float` does.
    fn dequantize(&self, y: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for (v, y) in y.iter_mut().enumerate() {
            let (z, byte) = slot(v);
            let q = unpack_nibble(&self.ql, v) | (((self.qh[byte] >> (2 * z)) & 3) << 4);
            *y = d * self.scales[v / 16] as f32 * (q as i8 - 32) as f32;
        }
    }
}

/// Value `j` plus 16 (0..32) of a Q5_0 block: low nibbles then high nibbles, bit 4 from `qh`.
fn q5_0_value(b: &Q5_0, j: usize) -> u8 {
    let low = if j < 16 {
        b.qs[j] & 15
    } else {
        b.qs[j - 16] >> 4
    };
    let high = (u32::from_le_bytes(b.qh) >> j) & 1;
    low | ((high as u8) << 4)
}

/// Packs rows of `cols` values stored as 32-value blocks into groups of eight, padding each
/// row with `zero` blocks to a multiple of 256 values.
fn pack_groups<T, P>(blocks: &[T], cols: usize, zero: &T, pack: impl Fn([&T; 8]) -> P) -> Vec<P> {
    let per_row = cols / 32;
    blocks
        .chunks_exact(per_row)
        .flat_map(|row| {
            (0..per_row.div_ceil(8))
                .map(|g| pack(std::array::from_fn(|i| row.get(8 * g + i).unwrap_or(zero))))
                .collect::<Vec<_>>()
        })
        .collect()
}

impl PackedQ5_0 {
    fn new(b: [&Q5_0; 8]) -> Self {
        let value = |v: usize| q5_0_value(b[v / 32], v % 32);
        let mut qh = [0u64; 4];
        for v in 0..QK {
            let (z, byte) = slot(v);
            qh[z] |= ((value(v) >> 4) as u64) << byte;
        }
        Self {
            d: b.map(|b| b.d),
            qs: pack_nibbles(value),
            qh,
        }
    }

    /// The blocks as floats, computed exactly as candle's `to_float` does.
    fn dequantize(&self, y: &mut [f32]) {
        for (v, y) in y.iter_mut().enumerate() {
            let (z, byte) = slot(v);
            let q = unpack_nibble(&self.qs, v) | ((((self.qh[z] >> byte) & 1) as u8) << 4);
            *y = (q as i32 - 16) as f32 * f16_to_f32(self.d[v / 32]);
        }
    }
}

impl PackedQ8_0 {
    fn new(b: [&Q8_0; 8]) -> Self {
        let mut qs = [0u8; QK];
        for v in 0..QK {
            let (z, byte) = slot(v);
            qs[64 * z + byte] = (b[v / 32].qs[v % 32] as u8) ^ 0x80;
        }
        Self {
            d: b.map(|b| b.d),
            qs,
        }
    }

    /// The blocks as floats, computed exactly as candle's `to_float` does.
    fn dequantize(&self, y: &mut [f32]) {
        for (v, y) in y.iter_mut().enumerate() {
            let (z, byte) = slot(v);
            *y = ((self.qs[64 * z + byte] ^ 0x80) as i8) as f32 * f16_to_f32(self.d[v / 32]);
        }
    }
}

/// The 6-bit scales (bytes 0..8) and mins (bytes 8..16) of a Q4_K block's sub-blocks.
fn q4k_unpacked_scales(s: &[u8; 12]) -> [u8; 16] {
    let mut out = [0u8; 16];
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
}

/// Weight blocks repacked for the kernels (only worth it, and only done, where they run).
pub enum Packed {
    Q4K(Vec<PackedQ4K>),
    Q6K(Vec<PackedQ6K>),
    Q5_0(Vec<PackedQ5_0>),
    Q8_0(Vec<PackedQ8_0>),
}

impl Packed {
    pub fn q4k(blocks: &[BlockQ4K]) -> Self {
        Self::Q4K(view::<_, Q4K>(blocks).iter().map(PackedQ4K::new).collect())
    }

    pub fn q6k(blocks: &[BlockQ6K]) -> Self {
        Self::Q6K(view::<_, Q6K>(blocks).iter().map(PackedQ6K::new).collect())
    }

    /// Rows of `cols` values (a multiple of 32).
    pub fn q5_0(blocks: &[BlockQ5_0], cols: usize) -> Self {
        let zero = Q5_0 {
            d: 0,
            qh: [0; 4],
            qs: [0; 16],
        };
        Self::Q5_0(pack_groups(view(blocks), cols, &zero, PackedQ5_0::new))
    }

    /// Rows of `cols` values (a multiple of 32).
    pub fn q8_0(blocks: &[BlockQ8_0], cols: usize) -> Self {
        let zero = Q8_0 { d: 0, qs: [0; 32] };
        Self::Q8_0(pack_groups(view(blocks), cols, &zero, PackedQ8_0::new))
    }

    /// The quantization the blocks came from.
    pub fn dtype(&self) -> GgmlDType {
        match self {
            Packed::Q4K(_) => GgmlDType::Q4K,
            Packed::Q6K(_) => GgmlDType::Q6K,
            Packed::Q5_0(_) => GgmlDType::Q5_0,
            Packed::Q8_0(_) => GgmlDType::Q8_0,
        }
    }

    /// Dequantizes row `row` (of `dst.len()` values) into `dst`.
    pub fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        let kb = dst.len().div_ceil(QK);
        let mut block = [0f32; QK];
        for (i, y) in dst.chunks_mut(QK).enumerate() {
            let b = row * kb + i;
            match self {
                Packed::Q4K(p) => p[b].dequantize(&mut block),
                Packed::Q6K(p) => p[b].dequantize(&mut block),
                Packed::Q5_0(p) => p[b].dequantize(&mut block),
                Packed::Q8_0(p) => p[b].dequantize(&mut block),
            }
            y.copy_from_slice(&block[..y.len()]);
        }
    }

    /// `dst[m x n] = lhs[m x k] x Wᵀ` for `n` weight rows of `k` values.
    /// Callers check [`available`] first.
    pub fn matmul(&self, (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
        assert!(available());
        assert_eq!(lhs.len(), m * k);
        assert!(dst.len() >= m * n);
        #[cfg(target_arch = "x86_64")]
        match self {
            Packed::Q4K(b) => packed_matmul(b, (m, k, n), lhs, dst),
            Packed::Q6K(b) => packed_matmul(b, (m, k, n), lhs, dst),
            Packed::Q5_0(b) => packed_matmul(b, (m, k, n), lhs, dst),
            Packed::Q8_0(b) => packed_matmul(b, (m, k, n), lhs, dst),
        }
    }
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

#[cfg(target_arch = "x86_64")]
fn packed_matmul<B: Unpack + Sync>(
    w: &[B],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let (acts, kb) = (ActBlock::quantize(lhs, m, k), k.div_ceil(QK));
    for_each_output(m, n, dst, |js, r0, rows, out| unsafe {
        packed_tile(w, js, &acts[r0 * kb..], kb, rows, out)
    });
}

/// 256 activations quantized to 8 bits with one scale (as candle's Q8_K, up to the sign
/// convention and rounding ties), in the kernel layout, with the sum of each 16-value group
/// times the scale (for the mins and offsets).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct ActBlock {
    qs: [i8; QK],
    sums: [f32; 16],
    d: f32,
}

#[cfg(target_arch = "x86_64")]
impl ActBlock {
    /// Quantizes `m` rows of `k` values, block by block (a row's last block padded with zeros,
    /// as the weights are).
    fn quantize(lhs: &[f32], m: usize, k: usize) -> Vec<ActBlock> {
        let mut out = Vec::with_capacity(m * k.div_ceil(QK));
        for row in lhs.chunks_exact(k) {
            for x in row.chunks(QK) {
                let mut padded = [0f32; QK];
                padded[..x.len()].copy_from_slice(x);
                // SAFETY: kernels run only where `available()`.
                out.push(unsafe { Self::quantize_block(&padded) });
            }
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn quantize_block(x: &[f32]) -> ActBlock {
        let p = x.as_ptr();
        let mut amax = _mm512_setzero_ps();
        for g in 0..16 {
            amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(p.add(16 * g))));
        }
        let amax = _mm512_reduce_max_ps(amax);
        let mut block = ActBlock {
            qs: [0; QK],
            sums: [0.0; 16],
            d: amax / 127.0,
        };
        if amax == 0.0 {
            return block;
        }
        let iscale = _mm512_set1_ps(127.0 / amax);
        // Group g (values 16g..16g + 16) becomes lane g of the four vectors: 4 bytes in each.
        let lanes = block.qs.as_mut_ptr() as *mut u32;
        for g in 0..16 {
            let v = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * g)), iscale);
            let q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            let bytes: [u32; 4] = std::mem::transmute(_mm512_cvtsepi32_epi8(q));
            for (z, b) in bytes.into_iter().enumerate() {
                *lanes.add(16 * z + g) = b;
            }
            block.sums[g] = _mm512_reduce_add_epi32(q) as f32 * block.d;
        }
        block
    }
}

/// A repacked block unpacked into registers: the four value vectors (unsigned bytes), and per
/// 32-bit lane the scale of its values and the offset to subtract per unit of activation sum.
#[cfg(target_arch = "x86_64")]
trait Unpack {
    unsafe fn unpack(&self) -> ([__m512i; 4], __m512, __m512);
}

/// The low four bits of 256 values, stored as [`pack_nibbles`] does, as the four vectors.
#[cfg(target_arch = "x86_64")]
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

/// Lane indices `l / 2`: one entry per 32 values spread over the two 16-value lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn halves() -> __m512i {
    _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0)
}

#[cfg(target_arch = "x86_64")]
impl Unpack for PackedQ4K {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn unpack(&self) -> ([__m512i; 4], __m512, __m512) {
        let w = nibbles(&self.qs);
        // Scales then mins, one per 32 values: lane l takes entry l / 2.
        let sm = _mm512_cvtepu8_epi32(_mm_loadu_si128(self.scales.as_ptr() as *const _));
        let pair = |first: i32| {
            let idx = _mm512_add_epi32(halves(), _mm512_set1_epi32(first));
            _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(idx, sm))
        };
        let scale = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(self.d)), pair(0));
        let offset = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(self.dmin)), pair(8));
        (w, scale, offset)
    }
}

#[cfg(target_arch = "x86_64")]
impl Unpack for PackedQ6K {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn unpack(&self) -> ([__m512i; 4], __m512, __m512) {
        let (low, m30) = (nibbles(&self.ql), _mm512_set1_epi8(0x30));
        // Bits 4-5 of vector z are bits 2z..2z + 2 of `qh`: move them to bits 4-5.
        let h = _mm512_loadu_si512(self.qh.as_ptr() as *const _);
        let high = [
            _mm512_slli_epi16(h, 4),
            _mm512_slli_epi16(h, 2),
            h,
            _mm512_srli_epi16(h, 2),
        ];
        let w = std::array::from_fn(|z| _mm512_or_si512(low[z], _mm512_and_si512(high[z], m30)));
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(self.scales.as_ptr() as *const _));
        let scale = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(self.d)), _mm512_cvtepi32_ps(sc));
        // Values are stored plus 32.
        (w, scale, _mm512_mul_ps(scale, _mm512_set1_ps(32.0)))
    }
}

/// One scale per 32 values (eight f16s) as one per 16-value lane.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn lane_scales(d: &[u16; 8]) -> __m512 {
    let d = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr() as *const _)));
    _mm512_permutexvar_ps(halves(), d)
}

#[cfg(target_arch = "x86_64")]
impl Unpack for PackedQ5_0 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn unpack(&self) -> ([__m512i; 4], __m512, __m512) {
        let (low, sixteen) = (nibbles(&self.qs), _mm512_set1_epi8(16));
        let w = std::array::from_fn(|z| _mm512_mask_add_epi8(low[z], self.qh[z], low[z], sixteen));
        let scale = lane_scales(&self.d);
        // Values are stored plus 16.
        (w, scale, _mm512_mul_ps(scale, _mm512_set1_ps(16.0)))
    }
}

#[cfg(target_arch = "x86_64")]
impl Unpack for PackedQ8_0 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn unpack(&self) -> ([__m512i; 4], __m512, __m512) {
        let q = self.qs.as_ptr() as *const __m512i;
        let w = std::array::from_fn(|z| _mm512_loadu_si512(q.add(z)));
        let scale = lane_scales(&self.d);
        // Values are stored plus 128.
        (w, scale, _mm512_mul_ps(scale, _mm512_set1_ps(128.0)))
    }
}

/// Weight rows per task.
const CHUNK: usize = 16;

/// Dot products of up to `CHUNK` weight rows with up to `MAX_ROWS` activation rows.
type Tile = [[f32; MAX_ROWS]; CHUNK];

/// Runs `f(weight_rows, first_act_row, act_rows, out)` over every tile of at most `CHUNK`
/// weight rows and `MAX_ROWS` activation rows, in parallel over weight rows (on candle's
/// spinning thread pool: a decode step makes ~200 small matmuls, so wake-up latency matters),
/// scattering `out[weight_row][act_row]` into `dst`.
fn for_each_output(
    m: usize,
    n: usize,
    dst: &mut [f32],
    f: impl Fn(Range<usize>, usize, usize, &mut Tile) + Sync,
) {
    struct Dst(*mut f32);
    // SAFETY: every (row, column) of dst is written by exactly one task.
    unsafe impl Sync for Dst {}
    let dst = Dst(dst.as_mut_ptr());
    let dst = &dst;
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |chunks| {
        let mut out = [[0f32; MAX_ROWS]; CHUNK];
        for c in chunks {
            let js = c * CHUNK..n.min((c + 1) * CHUNK);
            for r0 in (0..m).step_by(MAX_ROWS) {
                let rows = (m - r0).min(MAX_ROWS);
                f(js.clone(), r0, rows, &mut out);
                for (j, col) in js.clone().zip(&out) {
                    for (r, &v) in col[..rows].iter().enumerate() {
                        unsafe { *dst.0.add((r0 + r) * n + j) = v };
                    }
                }
            }
        }
    });
}

/// How far ahead (in bytes) the kernels prefetch weights: with many activation rows a block
/// takes long enough to compute that the next ones can be fetched meanwhile.
const PREFETCH: usize = 1024;

/// Activation rows above which weight rows go in pairs (measured: slower at 4 rows, even at 8,
/// 20% faster at 16).
const PAIR_ABOVE: usize = 8;

/// Repacked weight rows `js` (each `kb` blocks of `w`) against `rows` activation rows
/// (`acts[r * kb + b]`), block by block. With many activation rows, weight rows go in pairs so
/// that each activation vector is loaded once for both; every (weight row, activation row)
/// pair goes through the same operations either way.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn packed_tile<B: Unpack>(
    w: &[B],
    js: Range<usize>,
    acts: &[ActBlock],
    kb: usize,
    rows: usize,
    out: &mut Tile,
) {
    let (first, n) = (js.start, js.len());
    let mut i = 0;
    while i < n {
        let row = |i: usize| &w[(first + i) * kb..(first + i + 1) * kb];
        if rows > PAIR_ABOVE && i + 1 < n {
            let [o0, o1] = out.get_disjoint_mut([i, i + 1]).unwrap();
            two_rows(row(i), row(i + 1), acts, kb, rows, o0, o1);
            i += 2;
        } else {
            one_row(row(i), acts, kb, rows, &mut out[i]);
            i += 1;
        }
    }
}

/// Prefetches the weights `PREFETCH` bytes after block `x`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch<B>(x: &B) {
    let ahead = (x as *const B as *const i8).add(PREFETCH);
    for line in 0..std::mem::size_of::<B>().div_ceil(64) {
        _mm_prefetch::<_MM_HINT_T0>(ahead.add(64 * line));
    }
}

/// The sum of one activation block times one weight block, accumulated into `acc`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_dot(
    (wv, scale, offset): &([__m512i; 4], __m512, __m512),
    av: &[__m512i; 4],
    a: &ActBlock,
    acc: __m512,
) -> __m512 {
    let mut s = _mm512_setzero_si512();
    for (wv, av) in wv.iter().zip(av) {
        s = _mm512_dpbusd_epi32(s, *wv, *av);
    }
    // Lane sums are below 2^24, so the conversion is exact.
    let scaled = _mm512_mul_ps(*scale, _mm512_set1_ps(a.d));
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scaled, acc);
    _mm512_fnmadd_ps(_mm512_load_ps(a.sums.as_ptr()), *offset, acc)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_act(a: &ActBlock) -> [__m512i; 4] {
    let q = a.qs.as_ptr() as *const __m512i;
    std::array::from_fn(|z| _mm512_load_si512(q.add(z)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn one_row<B: Unpack>(
    w: &[B],
    acts: &[ActBlock],
    kb: usize,
    rows: usize,
    out: &mut [f32; MAX_ROWS],
) {
    let mut acc = [_mm512_setzero_ps(); MAX_ROWS];
    for (b, x) in w.iter().enumerate() {
        prefetch(x);
        let u = x.unpack();
        for (r, acc) in acc[..rows].iter_mut().enumerate() {
            let a = &acts[r * kb + b];
            *acc = block_dot(&u, &load_act(a), a, *acc);
        }
    }
    for (o, acc) in out[..rows].iter_mut().zip(&acc[..rows]) {
        *o = _mm512_reduce_add_ps(*acc);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn two_rows<B: Unpack>(
    w0: &[B],
    w1: &[B],
    acts: &[ActBlock],
    kb: usize,
    rows: usize,
    out0: &mut [f32; MAX_ROWS],
    out1: &mut [f32; MAX_ROWS],
) {
    let mut acc0 = [_mm512_setzero_ps(); MAX_ROWS];
    let mut acc1 = [_mm512_setzero_ps(); MAX_ROWS];
    for (b, (x0, x1)) in w0.iter().zip(w1).enumerate() {
        prefetch(x0);
        prefetch(x1);
        let (u0, u1) = (x0.unpack(), x1.unpack());
        for r in 0..rows {
            let a = &acts[r * kb + b];
            let av = load_act(a);
            acc0[r] = block_dot(&u0, &av, a, acc0[r]);
            acc1[r] = block_dot(&u1, &av, a, acc1[r]);
        }
    }
    for (out, acc) in [(out0, acc0), (out1, acc1)] {
        for (o, acc) in out[..rows].iter_mut().zip(&acc[..rows]) {
            *o = _mm512_reduce_add_ps(*acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::{self, GgmlType};

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

    /// Random blocks: quantized random floats, with random bytes over part of the quants (every
    /// bit pattern of the quants is valid) to reach values the quantizer rarely produces.
    fn blocks<T: GgmlType>(count: usize, seed: u64) -> Vec<T> {
        let mut w = vec![T::zeros(); count];
        T::from_float(&random(count * T::BLCK_SIZE, seed), &mut w);
        let size = std::mem::size_of::<T>();
        // SAFETY: plain byte blocks.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, count * size) };
        let noise = random(bytes.len(), seed + 1);
        for (i, (b, r)) in bytes.iter_mut().zip(noise).enumerate() {
            // Leave the f16 scales alone (random bits can be NaN or huge).
            let (off, keep) = match size {
                144 => (i % size, 4),            // Q4_K: d, dmin first
                210 => (size - 1 - i % size, 2), // Q6_K: d last
                _ => (i % size, 2),              // Q5_0, Q8_0: d first
            };
            if off >= keep && i % 3 == 0 {
                *b = ((r + 1.0) * 127.9) as u8;
            }
        }
        w
    }

    /// Random blocks for rows of `cols` values, repacked.
    type Pack<T> = fn(&[T], usize) -> Packed;

    fn dequantizes_like_candle<T: GgmlType>(pack: Pack<T>, cols: usize) {
        let rows = 5;
        let w: Vec<T> = blocks(rows * cols / T::BLCK_SIZE, 7);
        let mut want = vec![0f32; rows * cols];
        T::to_float(&w, &mut want);
        let packed = pack(&w, cols);
        let mut got = vec![0f32; rows * cols];
        for (r, row) in got.chunks_mut(cols).enumerate() {
            packed.dequantize_row(r, row);
        }
        assert_eq!(got, want);
        assert!(want.iter().any(|&v| v != 0.0));
    }

    #[test]
    fn repacked_blocks_dequantize_exactly_like_candle() {
        dequantizes_like_candle::<BlockQ4K>(|w, _| Packed::q4k(w), 512);
        dequantizes_like_candle::<BlockQ6K>(|w, _| Packed::q6k(w), 512);
        // 11 blocks of 32: rows padded to 512 values.
        dequantizes_like_candle::<BlockQ5_0>(Packed::q5_0, 352);
        dequantizes_like_candle::<BlockQ8_0>(Packed::q8_0, 352);
    }

    /// The kernel against a plain f32 reference, as accurate as candle's `vec_dot` and, where
    /// both quantize activations alike (K-quants), within `candle_tol` of it (relative to the
    /// largest output); and every row alike whatever the number of rows.
    fn check<T: GgmlType>(pack: Pack<T>, k: usize, candle_tol: Option<f32>) {
        if !available() {
            eprintln!("AVX-512 VNNI not available: kernel not tested on this CPU");
            return;
        }
        let (n, m) = (25, 19);
        let w: Vec<T> = blocks(n * k / T::BLCK_SIZE, 1);
        let packed = pack(&w, k);
        let lhs = random(m * k, 2);
        let mut got = vec![0f32; m * n];
        packed.matmul((m, k, n), &lhs, &mut got);
        // Close to the f32 reference (activation quantization costs some precision) ...
        let want = reference(&w, m, k, n, &lhs);
        let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (g, r) in got.iter().zip(&want) {
            assert!((g - r).abs() <= 0.02 * scale, "{g} vs {r}");
        }
        // ... as close as candle's vec_dot path ...
        let mut candle = vec![0f32; m * n];
        k_quants::matmul((m, k, n), &lhs, &w, &mut candle).unwrap();
        let error = |x: &[f32]| {
            let e = x.iter().zip(&want).map(|(a, b)| (a - b).abs());
            e.fold(0f32, f32::max) / scale
        };
        let (ours, theirs) = (error(&got), error(&candle));
        assert!(ours <= 1.5 * theirs, "error {ours} vs candle's {theirs}");
        if let Some(tol) = candle_tol {
            for (g, c) in got.iter().zip(&candle) {
                assert!((g - c).abs() <= tol * scale, "{g} vs candle {c}");
            }
        }
        // ... and every row is computed alike whatever the number of rows.
        for rows in [1, 2, 5, 9, 16, 17] {
            let mut part = vec![0f32; rows * n];
            packed.matmul((rows, k, n), &lhs[..rows * k], &mut part);
            assert!(part == got[..rows * n], "{rows} rows differ from {m}");
        }
    }

    #[test]
    fn q4k_kernel_matches_references() {
        check::<BlockQ4K>(|w, _| Packed::q4k(w), 3072, Some(1e-4));
    }

    #[test]
    fn q6k_kernel_matches_references() {
        check::<BlockQ6K>(|w, _| Packed::q6k(w), 3072, Some(1e-4));
    }

    #[test]
    fn q5_0_kernel_matches_references() {
        check::<BlockQ5_0>(Packed::q5_0, 352, None);
        check::<BlockQ5_0>(Packed::q5_0, 1024, None);
    }

    #[test]
    fn q8_0_kernel_matches_references() {
        check::<BlockQ8_0>(Packed::q8_0, 352, None);
        check::<BlockQ8_0>(Packed::q8_0, 1024, None);
    }
}
