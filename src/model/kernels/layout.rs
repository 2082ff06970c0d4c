//! The kernel layouts: GGUF weight blocks repacked at load time so that every 32-bit lane of a
//! vector holds values of a single scale group.
//!
//! A layout is named by its vector width `V` in bytes: 256 values are `256 / V` vectors, and
//! lane `l` (4 bytes) of vector `z` holds values `gl + 4z .. gl + 4z + 4`, where `g = 1024 / V`
//! values form one lane's group. Every format has a layout of 32-byte vectors ([`NARROW`]): a
//! lane is a 32-value group, so AVX2's 16-bit products of a lane's eight vectors can be summed
//! before one widening per block (Q6_K, with one scale per 16 values, keeps its two halves
//! apart: vectors 0-3 hold the first 16 values of each lane, 4-7 the second). The AVX-512
//! kernels read most formats in it too, two blocks side by side in each 64-byte vector, one
//! scale a lane; Q6_K has a layout of 64-byte vectors ([`WIDE`]) for them, a lane being a
//! 16-value group, its scale group. A kernel sums integer products per lane and applies the
//! scales after. Formats with 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are gathered
//! eight blocks at a time, their rows padded with zero blocks to a multiple of 256 values. A
//! row whose last 256 values hold at most 128 (896 = 3.5 x 256 in Qwen2.5 0.5B, 576 and 640
//! in other small models) keeps that block apart in half size ([`Halves`], [`Rows`]): its
//! padding is the second half of every 32-byte vector (lanes 4-7), which is then neither
//! stored nor read.
//!
//! Everything here is portable code: packing, and dequantizing (bit for bit as candle does,
//! which the tests check), used for embedding lookups and the references.

use candle_core::quantized::k_quants::{
    BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0,
};
use half::f16;
use rayon::prelude::*;

/// Values per K-quant block, and per packed block of every format.
pub const QK: usize = 256;

// Mirrors of candle's block layouts (its fields are private); sizes are checked in `view`.
#[repr(C)]
pub(super) struct Q4K {
    d: u16,
    dmin: u16,
    scales: [u8; 12],
    qs: [u8; 128],
}
#[repr(C)]
pub(super) struct Q5K {
    d: u16,
    dmin: u16,
    scales: [u8; 12],
    qh: [u8; 32],
    qs: [u8; 128],
}
#[repr(C)]
pub(super) struct Q6K {
    ql: [u8; 128],
    qh: [u8; 64],
    scales: [i8; 16],
    d: u16,
}
#[repr(C)]
pub(super) struct Q8_0 {
    d: u16,
    qs: [i8; 32],
}
#[repr(C)]
pub(super) struct Q5_0 {
    d: u16,
    qh: [u8; 4],
    qs: [u8; 16],
}
#[repr(C)]
pub(super) struct Q4_0 {
    d: u16,
    qs: [u8; 16],
}
#[repr(C)]
pub(super) struct Q4_1 {
    d: u16,
    m: u16,
    qs: [u8; 16],
}
#[repr(C)]
pub(super) struct Q5_1 {
    d: u16,
    m: u16,
    qh: [u8; 4],
    qs: [u8; 16],
}

/// A mirror of candle's block `C`, which [`view`] reads `C` as.
///
/// # Safety
/// `C` and `Self` are `#[repr(C)]` structs of plain data (integers, `f16`, arrays of bytes)
/// without padding, so that every bit pattern of a `C` is a valid `Self`.
pub(super) unsafe trait Mirror<C> {}

// SAFETY: each mirror lists its candle block's fields, in order, an `f16` as a `u16`.
unsafe impl Mirror<BlockQ4K> for Q4K {}
// SAFETY: as above.
unsafe impl Mirror<BlockQ5K> for Q5K {}
// SAFETY: as above.
unsafe impl Mirror<BlockQ6K> for Q6K {}
// SAFETY: as above.
unsafe impl Mirror<BlockQ8_0> for Q8_0 {}
// SAFETY: as above.
unsafe impl Mirror<BlockQ5_0> for Q5_0 {}
// SAFETY: as above.
unsafe impl Mirror<BlockQ4_0> for Q4_0 {}
// SAFETY: as above.
unsafe impl Mirror<BlockQ4_1> for Q4_1 {}
// SAFETY: as above.
unsafe impl Mirror<BlockQ5_1> for Q5_1 {}

/// Reinterprets candle blocks as their mirror (checked at compile time: same size, and the
/// mirror's alignment no stricter).
pub(super) fn view<A, B: Mirror<A>>(a: &[A]) -> &[B] {
    const {
        assert!(std::mem::size_of::<A>() == std::mem::size_of::<B>());
        assert!(std::mem::align_of::<A>() >= std::mem::align_of::<B>());
    }
    // SAFETY: same size, compatible alignment (both checked above), and `B: Mirror<A>`: any
    // `A`'s bits are a valid `B`.
    unsafe { std::slice::from_raw_parts(a.as_ptr() as *const B, a.len()) }
}

pub(super) fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// The width of AVX-512's Q6_K layout: four 64-byte vectors, a 16-value group per lane.
pub const WIDE: usize = 64;
/// The width of every format's layout: eight 32-byte vectors, a 32-value group per lane.
pub const NARROW: usize = 32;

/// Where value `v` of a 256-value block lives in the layout of `V`-byte vectors:
/// (vector, byte in the vector).
const fn slot<const V: usize>(v: usize) -> (usize, usize) {
    let group = QK * 4 / V;
    (v % group / 4, 4 * (v / group) + v % 4)
}

/// The value at byte `byte` of vector `z` in the layout of `V`-byte vectors: the inverse of
/// [`slot`]. Packing gathers each output byte's values with it (a model's weights are packed
/// at every load, so this is most of the load time).
const fn value_at<const V: usize>(z: usize, byte: usize) -> usize {
    let group = QK * 4 / V;
    group * (byte / 4) + 4 * z + byte % 4
}

/// A block's 256 values in order, as stored (plus the format's offset).
type Values = [u8; QK];

/// A Q4_K block in the [`NARROW`] layout: the nibbles of vector `z` are in `qs[32 * (z / 2)..]`,
/// low nibbles for even `z`, high for odd; one scale and one min per 32 values, unpacked.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ4K {
    pub(super) d: u16,
    pub(super) dmin: u16,
    pub(super) scales: [u8; 8],
    pub(super) mins: [u8; 8],
    pub(super) qs: [u8; 128],
}

/// A Q5_K block: its low four bits, scales and mins as a [`PackedQ4K`], and bit 4 as `H`.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ5K<H> {
    pub(super) low: PackedQ4K,
    pub(super) qh: H,
}

/// Q5_K: bit 4 in bit planes (as [`PackedQ5_0Planes`]).
pub type PackedQ5KPlanes = PackedQ5K<[u8; 32]>;

/// A Q6_K block: the low four bits as in [`PackedQ4K`], bits 4-5 of vector `z` in bits
/// `2(z % 4)..2(z % 4) + 2` of `qh[V * (z / 4)..]`; values are stored plus 32; one scale per
/// 16 values.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ6K<const V: usize> {
    pub(super) d: u16,
    pub(super) scales: [i8; 16],
    pub(super) ql: [u8; 128],
    pub(super) qh: [u8; 64],
}

/// Eight Q5_0 blocks, in the [`NARROW`] layout: the low four bits as in
/// [`PackedQ4K`], bit 4 in bit planes: bit `z` of `qh[i]` is bit 4 of the value at byte `i` of
/// vector `z`, so that one load and a shift per vector recover them; values are stored plus 16;
/// one scale per 32 values.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ5_0Planes {
    pub(super) d: [u16; 8],
    pub(super) qs: [u8; 128],
    pub(super) qh: [u8; 32],
}

/// Eight Q8_0 blocks in the [`NARROW`] layout, vector `z` in `qs[32 * z..]`, values stored
/// plus 128; one scale per 32 values.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ8_0 {
    pub(super) d: [u16; 8],
    pub(super) qs: [u8; QK],
}

/// Eight Q4_0 blocks, nibbles as in [`PackedQ4K`]; values are stored plus 8; one scale per
/// 32 values.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ4_0 {
    pub(super) d: [u16; 8],
    pub(super) qs: [u8; 128],
}

/// Eight Q4_1 blocks, nibbles as in [`PackedQ4K`]; value = `d * q + m`, one `d` and one `m`
/// per 32 values.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ4_1 {
    pub(super) d: [u16; 8],
    pub(super) m: [u16; 8],
    pub(super) qs: [u8; 128],
}

/// Eight Q5_1 blocks, in the [`NARROW`] layout: the low four bits as in
/// [`PackedQ4K`], bit 4 in bit planes as in [`PackedQ5_0Planes`]; value = `d * q + m`, one `d`
/// and one `m` per 32 values.
#[derive(Clone)]
#[repr(C)]
pub struct PackedQ5_1Planes {
    pub(super) d: [u16; 8],
    pub(super) m: [u16; 8],
    pub(super) qs: [u8; 128],
    pub(super) qh: [u8; 32],
}

/// The first half of every `V`-byte vector in `x` (lanes 0-3 of a 32-byte vector): a block's
/// half that [`Halves`] keeps.
fn low_lanes<const V: usize, const N: usize, const H: usize>(x: &[u8; N]) -> [u8; H] {
    const { assert!(2 * H == N && N.is_multiple_of(V)) };
    std::array::from_fn(|i| x[V * (i / (V / 2)) + i % (V / 2)])
}

/// The inverse of [`low_lanes`], the second half of every vector zero.
fn whole_lanes<const V: usize, const H: usize, const N: usize>(x: &[u8; H]) -> [u8; N] {
    const { assert!(2 * H == N && N.is_multiple_of(V)) };
    std::array::from_fn(|i| match i % V {
        b if b < V / 2 => x[V / 2 * (i / V) + b],
        _ => 0,
    })
}

/// The first four of eight scales (one per 32 values: those of a block's first half), and
/// back with zeros.
fn low_scales(d: &[u16; 8]) -> [u16; 4] {
    [d[0], d[1], d[2], d[3]]
}

fn whole_scales(d: &[u16; 4]) -> [u16; 8] {
    [d[0], d[1], d[2], d[3], 0, 0, 0, 0]
}

/// A block of a per-32 format whose first half (its first four 32-value blocks: lanes 0-3 of
/// each 32-byte vector) can be stored alone: the last block of a row whose last 256 values
/// hold at most 128, where the second half is padding, with zero scales, facing zero
/// activations. The kernels read such a half with half-width loads that zero the second half,
/// scales included; the weights read there differ from the padding's (Q8_0's are stored plus
/// 128) but meet zero activations, so every product and sum comes out as the padded block's
/// did, bit for bit.
pub(super) trait Halves: Sized {
    /// The first half alone.
    type Half;
    /// The block's first half.
    fn low(&self) -> Self::Half;
    /// The block of `half` with the second half zero bytes: zero scales, so they dequantize
    /// to zeros (signed, for Q8_0) as the padding [`Halves::low`] dropped did; only the first
    /// half is read.
    fn widen(half: &Self::Half) -> Self;
}

/// A matrix's packed blocks, row after row. A row whose last 256 values hold at most 128
/// keeps that block apart in half size: `tails[row]` ([`Halves`]).
#[derive(Clone)]
pub(super) struct Rows<B, H = B> {
    pub(super) blocks: Vec<B>,
    pub(super) tails: Vec<H>,
}

impl<B, H> Rows<B, H> {
    /// Rows of `kb` whole blocks each.
    pub(super) fn whole(blocks: Vec<B>) -> Self {
        Self {
            blocks,
            tails: Vec::new(),
        }
    }

    /// Blocks per row in `blocks`, of the `kb` a row spans.
    pub(super) fn per_row(&self, kb: usize) -> usize {
        kb - usize::from(!self.tails.is_empty())
    }
}

impl<B: Clone, H: Clone> Rows<B, H> {
    /// The rows of `parts` one after another, if all keep their last blocks apart or none do
    /// (as rows of one length do).
    pub(super) fn stack(parts: &[&Self]) -> Option<Self> {
        let split = !parts.first()?.tails.is_empty();
        if parts.iter().any(|p| p.tails.is_empty() == split) {
            return None;
        }
        Some(Self {
            blocks: parts
                .iter()
                .flat_map(|p| p.blocks.iter().cloned())
                .collect(),
            tails: parts.iter().flat_map(|p| p.tails.iter().cloned()).collect(),
        })
    }

    /// Rows `rows` (in that order) of rows spanning `kb` blocks.
    pub(super) fn select(&self, rows: &[u32], kb: usize) -> Self {
        let per_row = self.per_row(kb);
        let blocks = rows
            .iter()
            .flat_map(|&r| &self.blocks[r as usize * per_row..(r as usize + 1) * per_row])
            .cloned()
            .collect();
        let tails = if self.tails.is_empty() {
            Vec::new()
        } else {
            rows.iter()
                .map(|&r| self.tails[r as usize].clone())
                .collect()
        };
        Self { blocks, tails }
    }
}

impl<B: PackedBlock, H: PackedBlock> Rows<B, H> {
    /// Dequantizes block `i` of row `row` (of rows spanning `kb` blocks).
    pub(super) fn dequantize(&self, row: usize, i: usize, kb: usize, y: &mut [f32; QK]) {
        let per_row = self.per_row(kb);
        if i < per_row {
            self.blocks[row * per_row + i].dequantize(y)
        } else {
            self.tails[row].dequantize(y)
        }
    }
}

/// Defines the half of a per-32 block ([`Halves`]) in the layout of `$v`-byte vectors: its
/// scale arrays (four of eight kept) and its vector arrays (the first half of every vector,
/// half the bytes), dequantized through the whole block.
macro_rules! halves {
    ($($(#[$doc:meta])* $half:ident of $whole:ty, $v:ident {
        scales: $($s:ident),+; lanes: $($l:ident: $n:literal),+
    })*) => {$(
        $(#[$doc])*
        #[derive(Clone)]
        #[repr(C)]
        pub struct $half {
            $(pub(super) $s: [u16; 4],)+
            $(pub(super) $l: [u8; $n],)+
        }

        impl Halves for $whole {
            type Half = $half;
            fn low(&self) -> $half {
                $half { $($s: low_scales(&self.$s),)+ $($l: low_lanes::<$v, _, _>(&self.$l),)+ }
            }
            fn widen(h: &$half) -> Self {
                Self { $($s: whole_scales(&h.$s),)+ $($l: whole_lanes::<$v, _, _>(&h.$l),)+ }
            }
        }

        impl PackedBlock for $half {
            fn dequantize(&self, y: &mut [f32; QK]) {
                <$whole as Halves>::widen(self).dequantize(y)
            }
        }
    )*};
}

halves! {
    /// Lanes 0-3 of a [`PackedQ5_0Planes`].
    HalfQ5_0Planes of PackedQ5_0Planes, NARROW { scales: d; lanes: qs: 64, qh: 16 }
    /// Lanes 0-3 of a [`PackedQ8_0`] in the [`NARROW`] layout.
    HalfQ8_0 of PackedQ8_0, NARROW { scales: d; lanes: qs: 128 }
    /// Lanes 0-3 of a [`PackedQ4_0`] in the [`NARROW`] layout.
    HalfQ4_0 of PackedQ4_0, NARROW { scales: d; lanes: qs: 64 }
    /// Lanes 0-3 of a [`PackedQ4_1`] in the [`NARROW`] layout.
    HalfQ4_1 of PackedQ4_1, NARROW { scales: d, m; lanes: qs: 64 }
    /// Lanes 0-3 of a [`PackedQ5_1Planes`].
    HalfQ5_1Planes of PackedQ5_1Planes, NARROW { scales: d, m; lanes: qs: 64, qh: 16 }
}

/// The values (0..16) of a candle Q4_K block: 64-value chunks, low nibbles then high nibbles.
fn q4k_values(b: &Q4K) -> Values {
    let mut out = [0u8; QK];
    for (out, qs) in out.chunks_exact_mut(64).zip(b.qs.chunks_exact(32)) {
        for (i, &q) in qs.iter().enumerate() {
            (out[i], out[32 + i]) = (q & 15, q >> 4);
        }
    }
    out
}

/// The values (0..32) of a candle Q5_K block: Q4_K's nibbles, and bit 4 of sub-block `s`'s
/// value `l` at bit `s` of `qh[l]`.
fn q5k_values(b: &Q5K) -> Values {
    let mut out = q4k_values(&Q4K {
        d: b.d,
        dmin: b.dmin,
        scales: b.scales,
        qs: b.qs,
    });
    for (v, out) in out.iter_mut().enumerate() {
        *out |= ((b.qh[v % 32] >> (v / 32)) & 1) << 4;
    }
    out
}

/// Bit 4 of each value in [`NARROW`] bit planes: bit `z` of byte `i` is that of the value at
/// byte `i` of vector `z`.
fn high_planes(values: &Values) -> [u8; 32] {
    std::array::from_fn(|byte| {
        (0..QK / NARROW).fold(0, |h, z| {
            h | (values[value_at::<NARROW>(z, byte)] >> 4) << z
        })
    })
}

/// Bit 4 of value `v` from [`high_planes`].
fn plane_bit(qh: &[u8; 32], v: usize) -> u8 {
    let (z, byte) = slot::<NARROW>(v);
    (qh[byte] >> z) & 1
}

/// Value `v` (0..32) of a block stored as [`NARROW`] nibbles and bit planes.
fn five_bits_in_planes(qs: &[u8; 128], qh: &[u8; 32], v: usize) -> u8 {
    unpack_nibble::<NARROW>(qs, v) | plane_bit(qh, v) << 4
}

/// The values plus 32 (0..64) of a candle Q6_K block: per 128 values, four 32-value quarters
/// taking the low/high nibbles of `ql` and successive bit pairs of `qh` (what packing places,
/// spelled out for its test).
#[cfg(test)]
fn q6k_values(b: &Q6K) -> Values {
    let mut out = [0u8; QK];
    for (half, out) in out.chunks_exact_mut(128).enumerate() {
        let (ql, qh) = (
            &b.ql[64 * half..64 * half + 64],
            &b.qh[32 * half..32 * half + 32],
        );
        for (quarter, out) in out.chunks_exact_mut(32).enumerate() {
            for (l, out) in out.iter_mut().enumerate() {
                let q = ql[32 * (quarter % 2) + l];
                let low = if quarter < 2 { q & 15 } else { q >> 4 };
                *out = low | ((qh[l] >> (2 * quarter)) & 3) << 4;
            }
        }
    }
    out
}

/// The values (0..16) of a 32-value block whose 16 bytes hold low nibbles then high nibbles
/// (what packing places, spelled out for its test, as the next).
#[cfg(test)]
fn nibble32_values(qs: &[u8; 16]) -> [u8; 32] {
    std::array::from_fn(|j| if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 })
}

/// The 5-bit values (0..32) of a 32-value block: nibbles as [`nibble32_values`], bit 4 of
/// value `j` in bit `j` of `qh` (Q5_0, stored plus 16, and Q5_1).
#[cfg(test)]
fn five_bit_values(qs: &[u8; 16], qh: [u8; 4]) -> [u8; 32] {
    let (low, qh) = (nibble32_values(qs), u32::from_le_bytes(qh));
    std::array::from_fn(|j| low[j] | (((qh >> j) & 1) as u8) << 4)
}

/// [`pack_nibbles`]`::<NARROW>` of eight 32-value blocks whose 16 bytes `qs` hold low nibbles
/// then high nibbles ([`nibble32_values`]): a block per lane.
fn nibbles8(qs: [&[u8; 16]; 8]) -> [u8; 128] {
    lane_nibbles::<NARROW>(|v| (&qs[v / 32][v % 16..], v % 32 >= 16))
}

/// [`high_planes`] of eight 32-value blocks whose bit 4 of value `j` is bit `j` of `qh`
/// ([`five_bit_values`]): byte `4 * block + r` holds, at bit `z`, bit `4z + r`.
fn planes8(qh: [[u8; 4]; 8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (run, qh) in out.chunks_exact_mut(4).zip(qh) {
        let qh = u32::from_le_bytes(qh);
        for (r, out) in run.iter_mut().enumerate() {
            *out = (0..8).fold(0, |h, z| h | (((qh >> (4 * z + r)) & 1) as u8) << z);
        }
    }
    out
}

/// Eight 32-value blocks' values, in order.
fn values8<T>(b: [&T; 8], values: impl Fn(&T) -> [u8; 32]) -> Values {
    let mut out = [0u8; QK];
    for (out, b) in out.chunks_exact_mut(32).zip(b) {
        out.copy_from_slice(&values(b));
    }
    out
}

/// The low four bits of each value, at their slots.
fn pack_nibbles<const V: usize>(values: &Values) -> [u8; 128] {
    std::array::from_fn(|p| {
        let (z, byte) = (2 * (p / V), p % V);
        values[value_at::<V>(z, byte)] & 15 | (values[value_at::<V>(z + 1, byte)] & 15) << 4
    })
}

fn unpack_nibble<const V: usize>(qs: &[u8; 128], v: usize) -> u8 {
    let (z, byte) = slot::<V>(v);
    (qs[V * (z / 2) + byte] >> (4 * (z % 2))) & 15
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

/// `pack` over `blocks` on every core: packing is most of a model's load time.
fn pack_each<T: Sync, P: Send>(blocks: &[T], pack: impl Fn(&T) -> P + Sync + Send) -> Vec<P> {
    blocks.par_iter().map(pack).collect()
}

/// A packed block of 256 values.
pub(super) trait PackedBlock {
    /// The block as floats, computed exactly as candle's `to_float` does.
    fn dequantize(&self, y: &mut [f32; QK]);
}

impl PackedQ4K {
    fn new(b: &Q4K) -> Self {
        let sm = q4k_unpacked_scales(&b.scales);
        Self {
            d: b.d,
            dmin: b.dmin,
            scales: sm[..8].try_into().unwrap(),
            mins: sm[8..].try_into().unwrap(),
            qs: q4k_narrow_nibbles(&b.qs),
        }
    }
}

/// [`pack_nibbles`]`::<NARROW>` of [`q4k_values`]: Q4_K is most of the 1.5B, and packing
/// byte by byte was most of its load.
fn q4k_narrow_nibbles(qs: &[u8; 128]) -> [u8; 128] {
    // 64 values per 32 bytes, the low nibbles first.
    lane_nibbles::<NARROW>(|v| (&qs[32 * (v / 64) + v % 32..], v % 64 >= 32))
}

/// Where a Q6_K value's four low bits are in candle's `ql` (byte, high nibble) and its two
/// high bits in `qh` (byte, shift): each 128-value half in 64 bytes of `ql` and 32 of `qh`,
/// its quarters in the low nibbles of `ql`'s two 32-byte runs, then in the high ones.
fn q6k_source(v: usize) -> ((usize, bool), (usize, u32)) {
    let (half, quarter, l) = (v / 128, v % 128 / 32, v % 32);
    (
        (64 * half + 32 * (quarter % 2) + l, quarter >= 2),
        (32 * half + l, 2 * quarter as u32),
    )
}

/// [`pack_nibbles`]`::<V>` of a block's values, four bytes at a time: each 4-byte run of the
/// layout holds four consecutive values of a lane, in the low nibbles, and the next vector's
/// four in the high ones. `at(v)` is where value `v`'s nibble is: the source bytes from the
/// one holding it, and whether it is the high nibble; the formats this packs keep a lane's
/// four values in four consecutive bytes, the next vector's four bytes on, in the same nibble.
fn lane_nibbles<'a, const V: usize>(at: impl Fn(usize) -> (&'a [u8], bool)) -> [u8; 128] {
    const LOW: u64 = 0x0F0F_0F0F;
    let mut out = [0u8; 128];
    for (p, run) in out.chunks_exact_mut(4).enumerate() {
        let (z, byte) = (2 * (4 * p / V), 4 * p % V);
        let (src, high) = at(value_at::<V>(z, byte));
        let x = u64::from_le_bytes(src[..8].try_into().unwrap());
        let x = if high { x >> 4 } else { x };
        // Bytes 0..4 are vector z's values, bytes 4..8 vector z + 1's.
        let packed = (x & LOW) | ((x >> 28) & (LOW << 4));
        run.copy_from_slice(&(packed as u32).to_le_bytes());
    }
    out
}

impl PackedBlock for PackedQ4K {
    fn dequantize(&self, y: &mut [f32; QK]) {
        let (d, dmin) = (f16_to_f32(self.d), f16_to_f32(self.dmin));
        for (v, y) in y.iter_mut().enumerate() {
            let (sc, m) = (self.scales[v / 32], self.mins[v / 32]);
            *y = d * sc as f32 * unpack_nibble::<NARROW>(&self.qs, v) as f32 - dmin * m as f32;
        }
    }
}

impl<H> PackedQ5K<H> {
    /// `b` repacked, bit 4 stored by `high`.
    fn new(b: &Q5K, high: impl Fn(&Values) -> H) -> Self {
        let (sm, values) = (q4k_unpacked_scales(&b.scales), q5k_values(b));
        let low = PackedQ4K {
            d: b.d,
            dmin: b.dmin,
            scales: sm[..8].try_into().unwrap(),
            mins: sm[8..].try_into().unwrap(),
            qs: pack_nibbles::<NARROW>(&values),
        };
        Self {
            low,
            qh: high(&values),
        }
    }

    /// The block as floats, as candle computes them, given bit 4 of each value.
    fn dequantize_with(&self, y: &mut [f32; QK], high: impl Fn(usize) -> u8) {
        let low = &self.low;
        let (d, dmin) = (f16_to_f32(low.d), f16_to_f32(low.dmin));
        for (v, y) in y.iter_mut().enumerate() {
            let (sc, m) = (low.scales[v / 32], low.mins[v / 32]);
            let q = unpack_nibble::<NARROW>(&low.qs, v) | high(v) << 4;
            *y = d * sc as f32 * q as f32 - dmin * m as f32;
        }
    }
}

impl PackedBlock for PackedQ5KPlanes {
    fn dequantize(&self, y: &mut [f32; QK]) {
        self.dequantize_with(y, |v| plane_bit(&self.qh, v))
    }
}

impl<const V: usize> PackedQ6K<V> {
    /// `b` repacked four bytes at a time (byte by byte, it was most of the 1.5B's load after
    /// Q4_K's): a lane's four consecutive values are in consecutive bytes of `ql` and `qh`.
    fn new(b: &Q6K) -> Self {
        let mut qh = [0u8; 64];
        for (p, run) in qh.chunks_exact_mut(4).enumerate() {
            // Bits 2i..2i + 2 of each byte: the high bits of vector z + i's values.
            let (z, byte) = (4 * (4 * p / V), 4 * p % V);
            let bits = (0..4).fold(0u32, |bits, i| {
                let (at, shift) = q6k_source(value_at::<V>(z + i, byte)).1;
                let y = u32::from_le_bytes(b.qh[at..at + 4].try_into().unwrap());
                bits | ((y >> shift) & 0x0303_0303) << (2 * i)
            });
            run.copy_from_slice(&bits.to_le_bytes());
        }
        Self {
            d: b.d,
            scales: b.scales,
            ql: lane_nibbles::<V>(|v| {
                let (at, high) = q6k_source(v).0;
                (&b.ql[at..], high)
            }),
            qh,
        }
    }
}

impl<const V: usize> PackedBlock for PackedQ6K<V> {
    fn dequantize(&self, y: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        for (v, y) in y.iter_mut().enumerate() {
            let (z, byte) = slot::<V>(v);
            let high = (self.qh[V * (z / 4) + byte] >> (2 * (z % 4))) & 3;
            let q = unpack_nibble::<V>(&self.ql, v) | (high << 4);
            *y = d * self.scales[v / 16] as f32 * (q as i8 - 32) as f32;
        }
    }
}

impl PackedQ5_0Planes {
    fn new(b: [&Q5_0; 8]) -> Self {
        Self {
            d: b.map(|b| b.d),
            qs: nibbles8(b.map(|b| &b.qs)),
            qh: planes8(b.map(|b| b.qh)),
        }
    }
}

impl PackedBlock for PackedQ5_0Planes {
    fn dequantize(&self, y: &mut [f32; QK]) {
        for (v, y) in y.iter_mut().enumerate() {
            let q = five_bits_in_planes(&self.qs, &self.qh, v);
            *y = (q as i32 - 16) as f32 * f16_to_f32(self.d[v / 32]);
        }
    }
}

impl PackedQ8_0 {
    fn new(b: [&Q8_0; 8]) -> Self {
        let values = values8(b, |b| b.qs.map(|q| q as u8 ^ 0x80));
        let qs = std::array::from_fn(|p| values[value_at::<NARROW>(p / NARROW, p % NARROW)]);
        Self {
            d: b.map(|b| b.d),
            qs,
        }
    }
}

impl PackedBlock for PackedQ8_0 {
    fn dequantize(&self, y: &mut [f32; QK]) {
        for (v, y) in y.iter_mut().enumerate() {
            let (z, byte) = slot::<NARROW>(v);
            *y = ((self.qs[NARROW * z + byte] ^ 0x80) as i8) as f32 * f16_to_f32(self.d[v / 32]);
        }
    }
}

impl PackedQ4_0 {
    fn new(b: [&Q4_0; 8]) -> Self {
        Self {
            d: b.map(|b| b.d),
            qs: nibbles8(b.map(|b| &b.qs)),
        }
    }
}

impl PackedBlock for PackedQ4_0 {
    fn dequantize(&self, y: &mut [f32; QK]) {
        for (v, y) in y.iter_mut().enumerate() {
            let q = unpack_nibble::<NARROW>(&self.qs, v) as i16 - 8;
            *y = q as f32 * f16_to_f32(self.d[v / 32]);
        }
    }
}

impl PackedQ4_1 {
    fn new(b: [&Q4_1; 8]) -> Self {
        Self {
            d: b.map(|b| b.d),
            m: b.map(|b| b.m),
            qs: nibbles8(b.map(|b| &b.qs)),
        }
    }
}

impl PackedBlock for PackedQ4_1 {
    fn dequantize(&self, y: &mut [f32; QK]) {
        for (v, y) in y.iter_mut().enumerate() {
            let (d, m) = (f16_to_f32(self.d[v / 32]), f16_to_f32(self.m[v / 32]));
            *y = unpack_nibble::<NARROW>(&self.qs, v) as f32 * d + m;
        }
    }
}

impl PackedQ5_1Planes {
    fn new(b: [&Q5_1; 8]) -> Self {
        Self {
            d: b.map(|b| b.d),
            m: b.map(|b| b.m),
            qs: nibbles8(b.map(|b| &b.qs)),
            qh: planes8(b.map(|b| b.qh)),
        }
    }
}

impl PackedBlock for PackedQ5_1Planes {
    fn dequantize(&self, y: &mut [f32; QK]) {
        for (v, y) in y.iter_mut().enumerate() {
            let q = five_bits_in_planes(&self.qs, &self.qh, v);
            let (d, m) = (f16_to_f32(self.d[v / 32]), f16_to_f32(self.m[v / 32]));
            *y = q as f32 * d + m;
        }
    }
}

pub(super) fn pack_q4k(blocks: &[BlockQ4K]) -> Rows<PackedQ4K> {
    Rows::whole(pack_each(view::<_, Q4K>(blocks), PackedQ4K::new))
}

pub(super) fn pack_q5k(blocks: &[BlockQ5K]) -> Rows<PackedQ5KPlanes> {
    let pack = |b: &Q5K| PackedQ5K::new(b, high_planes);
    Rows::whole(pack_each(view::<_, Q5K>(blocks), pack))
}

pub(super) fn pack_q6k<const V: usize>(blocks: &[BlockQ6K]) -> Rows<PackedQ6K<V>> {
    Rows::whole(pack_each(view::<_, Q6K>(blocks), PackedQ6K::new))
}

const Q5_0_ZERO: Q5_0 = Q5_0 {
    d: 0,
    qh: [0; 4],
    qs: [0; 16],
};

const Q8_0_ZERO: Q8_0 = Q8_0 { d: 0, qs: [0; 32] };

// Zero blocks hold the value 0 - 8 times a zero scale: zero.
const Q4_0_ZERO: Q4_0 = Q4_0 { d: 0, qs: [0; 16] };

const Q4_1_ZERO: Q4_1 = Q4_1 {
    d: 0,
    m: 0,
    qs: [0; 16],
};

const Q5_1_ZERO: Q5_1 = Q5_1 {
    d: 0,
    m: 0,
    qh: [0; 4],
    qs: [0; 16],
};

/// Rows of `cols` values of a per-32 format, packed eight blocks at a time on every core (a
/// row padded with `zero` blocks to a multiple of 256 values), each row's last block kept
/// apart in half size if it holds at most 128 values (packed there, not copied out after:
/// the copy was a tenth of the 0.5B's load).
fn pack_per32<C, T: Sync + Mirror<C>, P: Halves + Send>(
    blocks: &[C],
    cols: usize,
    zero: &T,
    pack: impl Fn([&T; 8]) -> P + Sync,
) -> Rows<P, P::Half>
where
    P::Half: Send,
{
    let blocks: &[T] = view(blocks);
    let per_row = cols / 32;
    let tailed = (1..=QK / 2).contains(&(cols % QK));
    let whole = cols.div_ceil(QK) - usize::from(tailed);
    let group =
        |row: &[T], g: usize| pack(std::array::from_fn(|i| row.get(8 * g + i).unwrap_or(zero)));
    let rows = || blocks.par_chunks_exact(per_row);
    Rows {
        blocks: rows()
            .flat_map_iter(|row| (0..whole).map(move |g| group(row, g)))
            .collect(),
        tails: match tailed {
            true => rows().map(|row| group(row, whole).low()).collect(),
            false => Vec::new(),
        },
    }
}

pub(super) fn pack_q5_0(
    blocks: &[BlockQ5_0],
    cols: usize,
) -> Rows<PackedQ5_0Planes, HalfQ5_0Planes> {
    pack_per32(blocks, cols, &Q5_0_ZERO, PackedQ5_0Planes::new)
}

pub(super) fn pack_q8_0(blocks: &[BlockQ8_0], cols: usize) -> Rows<PackedQ8_0, HalfQ8_0> {
    pack_per32(blocks, cols, &Q8_0_ZERO, PackedQ8_0::new)
}

pub(super) fn pack_q4_0(blocks: &[BlockQ4_0], cols: usize) -> Rows<PackedQ4_0, HalfQ4_0> {
    pack_per32(blocks, cols, &Q4_0_ZERO, PackedQ4_0::new)
}

pub(super) fn pack_q4_1(blocks: &[BlockQ4_1], cols: usize) -> Rows<PackedQ4_1, HalfQ4_1> {
    pack_per32(blocks, cols, &Q4_1_ZERO, PackedQ4_1::new)
}

pub(super) fn pack_q5_1(
    blocks: &[BlockQ5_1],
    cols: usize,
) -> Rows<PackedQ5_1Planes, HalfQ5_1Planes> {
    pack_per32(blocks, cols, &Q5_1_ZERO, PackedQ5_1Planes::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eight-byte packing of Q4_K's nibbles places every value where the layout's map
    /// does (the kernel tests then check the values against candle's).
    #[test]
    fn q4k_nibbles_packed_eight_bytes_at_a_time_follow_the_layout() {
        let mut state = 7u64;
        for _ in 0..20 {
            let qs: [u8; 128] = std::array::from_fn(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                (state >> 56) as u8
            });
            let b = Q4K {
                d: 0,
                dmin: 0,
                scales: [0; 12],
                qs,
            };
            assert_eq!(
                q4k_narrow_nibbles(&qs),
                pack_nibbles::<NARROW>(&q4k_values(&b))
            );
        }
    }

    /// The per-32 formats' nibbles and bit planes, packed lane by lane, are those of the
    /// layout's map.
    #[test]
    fn per32_nibbles_and_planes_packed_by_lanes_follow_the_layout() {
        let mut state = 5u64;
        let mut byte = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            (state >> 56) as u8
        };
        for _ in 0..20 {
            let qs: [[u8; 16]; 8] = std::array::from_fn(|_| std::array::from_fn(|_| byte()));
            let qh: [[u8; 4]; 8] = std::array::from_fn(|_| std::array::from_fn(|_| byte()));
            let values: Values =
                std::array::from_fn(|v| five_bit_values(&qs[v / 32], qh[v / 32])[v % 32]);
            assert_eq!(
                nibbles8(std::array::from_fn(|i| &qs[i])),
                pack_nibbles::<NARROW>(&values)
            );
            assert_eq!(planes8(qh), high_planes(&values));
        }
    }

    /// Q6_K packed four bytes at a time holds, in both layouts, the values of candle's block
    /// where the layout's map puts them.
    #[test]
    fn q6k_packed_four_bytes_at_a_time_follows_the_layout() {
        fn check<const V: usize>(b: &Q6K) {
            let (packed, values) = (PackedQ6K::<V>::new(b), q6k_values(b));
            for (v, &want) in values.iter().enumerate() {
                let (z, byte) = slot::<V>(v);
                let low = unpack_nibble::<V>(&packed.ql, v);
                let high = (packed.qh[V * (z / 4) + byte] >> (2 * (z % 4))) & 3;
                assert_eq!(low | high << 4, want, "value {v}, {V}-byte vectors");
            }
        }
        let mut state = 11u64;
        let mut byte = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            (state >> 56) as u8
        };
        for _ in 0..20 {
            let b = Q6K {
                ql: std::array::from_fn(|_| byte()),
                qh: std::array::from_fn(|_| byte()),
                scales: [0; 16],
                d: 0,
            };
            check::<WIDE>(&b);
            check::<NARROW>(&b);
        }
    }
}
