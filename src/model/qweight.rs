//! Quantized weight matrices read straight from GGUF, and a matmul whose rows are independent.
//!
//! A forward over k tokens must give, bit for bit, the logits of k one-token forwards: greedy
//! speculative decoding then equals greedy autoregressive decoding by construction, not by
//! luck with near-ties. Both paths keep that property:
//! - [`kernels`](super::kernels) (Q4_K, Q5_K, Q6_K, Q5_0, Q8_0, Q4_0, Q4_1 and Q5_1 repacked
//!   at load time, on CPUs with AVX2 or AVX-512 VNNI) unpack each weight block once for all
//!   activation rows, which is what makes verifying k draft tokens cheaper than k decode steps;
//! - otherwise candle's `vec_dot`: every output element is one dot product of a weight row
//!   with one quantized activation row, the same function whatever the number of rows.

use crate::error::{Error, Result};
use crate::model::kernels::{self, Kernels, Source};
use candle_core::quantized::gguf_file::TensorInfo;
use candle_core::quantized::k_quants::{self, GgmlType};
use candle_core::quantized::GgmlDType;
use half::f16;
use std::io::{Read, Seek, SeekFrom};

macro_rules! block_kinds {
    ($($variant:ident => $ty:ty),* $(,)?) => {
        /// The blocks of one weight matrix, in the GGUF's own quantization.
        enum Blocks { $($variant(Vec<$ty>)),* }

        impl Blocks {
            fn matmul(&self, mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) -> candle_core::Result<()> {
                match self { $(Blocks::$variant(b) => k_quants::matmul(mkn, lhs, b, dst)),* }
            }

            fn dequantize_row(&self, row: usize, blocks_per_row: usize, dst: &mut [f32]) {
                match self {
                    $(Blocks::$variant(b) => {
                        <$ty>::to_float(&b[row * blocks_per_row..(row + 1) * blocks_per_row], dst)
                    }),*
                }
            }

            fn dtype(&self) -> GgmlDType {
                match self { $(Blocks::$variant(_) => <$ty as GgmlType>::DTYPE),* }
            }

            /// The blocks of `parts` one after another, if they are all of one type.
            fn stack(parts: &[&Blocks]) -> Option<Blocks> {
                match parts.first()? {
                    $(Blocks::$variant(_) => {
                        let mut all = Vec::new();
                        for p in parts {
                            let Blocks::$variant(b) = p else { return None };
                            all.extend_from_slice(b);
                        }
                        Some(Blocks::$variant(all))
                    })*
                }
            }

            fn select_rows(&self, rows: &[u32], blocks_per_row: usize) -> Blocks {
                let kb = blocks_per_row;
                match self {
                    $(Blocks::$variant(b) => Blocks::$variant(
                        rows.iter().flat_map(|&r| &b[r as usize * kb..(r as usize + 1) * kb]).cloned().collect()
                    )),*
                }
            }
        }
    };
}

use k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0,
};
block_kinds! {
    F32 => f32, F16 => f16, Q4_0 => BlockQ4_0, Q4_1 => BlockQ4_1, Q5_0 => BlockQ5_0, Q5_1 => BlockQ5_1,
    Q8_0 => BlockQ8_0, Q2K => BlockQ2K, Q3K => BlockQ3K, Q4K => BlockQ4K, Q5K => BlockQ5K,
    Q6K => BlockQ6K,
}

/// A weight matrix of `rows` x `cols` (GGUF order: one row per output feature).
pub struct QWeight {
    storage: Storage,
    rows: usize,
    cols: usize,
}

enum Storage {
    /// As in the file (after any widening), multiplied by candle's `vec_dot`.
    Candle(Blocks),
    /// Repacked for a family of fast kernels.
    Packed(kernels::Packed),
}

impl QWeight {
    /// Reads tensor `name` described by `info` from a GGUF file, for the `kernels` family.
    ///
    /// With a fast family, Q4_K, Q5_K, Q6_K, Q5_0, Q8_0, Q4_0, Q4_1 and Q5_1 weights are
    /// repacked for it.
    /// With the portable one, Q5_0 is widened losslessly to Q8_0: a Q5_0 value is a 5-bit
    /// integer times the block scale, which Q8_0 holds exactly with the same scale, and
    /// candle's Q8_0 dot product is SIMD where its Q5_0 one is scalar (the 0.5B draft would be
    /// slower than the target).
    /// Blocks that are repacked are read into `scratch` (grown as needed, kept for the next
    /// tensor).
    pub fn read<R: Read + Seek>(
        reader: &mut R,
        data_offset: u64,
        name: &str,
        info: &TensorInfo,
        kernels: Kernels,
        scratch: &mut Vec<u64>,
    ) -> Result<Self> {
        let dims = info.shape.dims();
        let (rows, cols) = match *dims {
            [cols] => (1, cols),
            [rows, cols] => (rows, cols),
            _ => {
                return Err(bad(format!(
                    "tensor {name} has shape {dims:?}, expected 1 or 2 dims"
                )))
            }
        };
        let dtype = info.ggml_dtype;
        if cols % dtype.block_size() != 0 {
            return Err(bad(format!(
                "tensor {name}: row length {cols} is not a multiple of the {dtype:?} block size"
            )));
        }
        let n_blocks = rows * cols / dtype.block_size();
        reader.seek(SeekFrom::Start(data_offset + info.offset))?;
        if kernels != Kernels::Portable {
            let pack = |source| Some(kernels::Packed::new(source, cols, kernels));
            let packed = match dtype {
                GgmlDType::Q4K => pack(Source::Q4K(read_into(reader, n_blocks, scratch)?)),
                GgmlDType::Q5K => pack(Source::Q5K(read_into(reader, n_blocks, scratch)?)),
                GgmlDType::Q6K => pack(Source::Q6K(read_into(reader, n_blocks, scratch)?)),
                GgmlDType::Q5_0 => pack(Source::Q5_0(read_into(reader, n_blocks, scratch)?)),
                GgmlDType::Q8_0 => pack(Source::Q8_0(read_into(reader, n_blocks, scratch)?)),
                GgmlDType::Q4_0 => pack(Source::Q4_0(read_into(reader, n_blocks, scratch)?)),
                GgmlDType::Q4_1 => pack(Source::Q4_1(read_into(reader, n_blocks, scratch)?)),
                GgmlDType::Q5_1 => pack(Source::Q5_1(read_into(reader, n_blocks, scratch)?)),
                _ => None,
            };
            if let Some(p) = packed {
                return Ok(Self {
                    storage: Storage::Packed(p),
                    rows,
                    cols,
                });
            }
        }
        let blocks = match dtype {
            GgmlDType::F32 => Blocks::F32(read_blocks(reader, n_blocks)?),
            GgmlDType::F16 => Blocks::F16(read_blocks(reader, n_blocks)?),
            GgmlDType::Q4_0 => Blocks::Q4_0(read_blocks(reader, n_blocks)?),
            GgmlDType::Q4_1 => Blocks::Q4_1(read_blocks(reader, n_blocks)?),
            GgmlDType::Q5_0 => Blocks::Q5_0(read_blocks(reader, n_blocks)?),
            GgmlDType::Q5_1 => Blocks::Q5_1(read_blocks(reader, n_blocks)?),
            GgmlDType::Q8_0 => Blocks::Q8_0(read_blocks(reader, n_blocks)?),
            GgmlDType::Q2K => Blocks::Q2K(read_blocks(reader, n_blocks)?),
            GgmlDType::Q3K => Blocks::Q3K(read_blocks(reader, n_blocks)?),
            GgmlDType::Q4K => Blocks::Q4K(read_blocks(reader, n_blocks)?),
            GgmlDType::Q5K => Blocks::Q5K(read_blocks(reader, n_blocks)?),
            GgmlDType::Q6K => Blocks::Q6K(read_blocks(reader, n_blocks)?),
            other => return Err(bad(format!("tensor {name}: unsupported type {other:?}"))),
        };
        let storage = match blocks {
            Blocks::Q5_0(b) => Storage::Candle(Blocks::Q8_0(widen_q5_0(&b))),
            blocks => Storage::Candle(blocks),
        };
        Ok(Self {
            storage,
            rows,
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The quantization the matmul runs on (after any load-time conversion).
    pub fn dtype(&self) -> GgmlDType {
        match &self.storage {
            Storage::Candle(b) => b.dtype(),
            Storage::Packed(p) => p.dtype(),
        }
    }

    /// `dst[m, rows] = lhs[m, cols] x selfᵀ`; each output row depends only on its input row.
    pub fn matmul(&self, lhs: &[f32], dst: &mut [f32]) -> Result<()> {
        let m = lhs.len() / self.cols;
        debug_assert_eq!(m * self.cols, lhs.len());
        let mkn = (m, self.cols, self.rows);
        match &self.storage {
            Storage::Packed(p) => p.matmul(mkn, lhs, dst),
            Storage::Candle(blocks) => blocks.matmul(mkn, lhs, dst)?,
        }
        Ok(())
    }

    /// A matrix of the rows `rows` of this one, in that order (a draft model's output
    /// projection trimmed to part of the vocabulary). Panics if a row is out of range.
    pub fn select_rows(&self, rows: &[u32]) -> Self {
        assert!(rows.iter().all(|&r| (r as usize) < self.rows));
        let storage = match &self.storage {
            Storage::Candle(b) => {
                Storage::Candle(b.select_rows(rows, self.cols / self.dtype().block_size()))
            }
            Storage::Packed(p) => Storage::Packed(p.select_rows(rows, self.cols)),
        };
        Self {
            storage,
            rows: rows.len(),
            cols: self.cols,
        }
    }

    /// Whether [`QWeight::stack`] takes `self` and `other` together.
    fn stacks_with(&self, other: &QWeight) -> bool {
        let kernels = |w: &QWeight| match &w.storage {
            Storage::Candle(_) => None,
            Storage::Packed(p) => Some(p.kernels()),
        };
        self.cols == other.cols && self.dtype() == other.dtype() && kernels(self) == kernels(other)
    }

    /// The rows of `parts` one after another, as one matrix, if they are of one quantization,
    /// stored alike (packed for the same kernels, or not) and as long: multiplying the stack
    /// gives each part's outputs bit for bit (every output depends only on its own weight row
    /// and activation row), with the activations quantized once and one pass of the threads.
    fn stack(parts: &[&QWeight]) -> Option<Self> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let candle: Option<Vec<&Blocks>> = parts
            .iter()
            .map(|p| match &p.storage {
                Storage::Candle(b) => Some(b),
                Storage::Packed(_) => None,
            })
            .collect();
        let packed: Option<Vec<&kernels::Packed>> = parts
            .iter()
            .map(|p| match &p.storage {
                Storage::Packed(p) => Some(p),
                Storage::Candle(_) => None,
            })
            .collect();
        let storage = match (candle, packed) {
            (Some(b), _) => Storage::Candle(Blocks::stack(&b)?),
            (_, Some(p)) => Storage::Packed(kernels::Packed::stack(&p)?),
            _ => return None, // some packed, some not
        };
        Some(Self {
            storage,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols,
        })
    }

    /// Dequantizes row `row` (an embedding lookup, or a 1-D weight such as a norm).
    pub fn row(&self, row: usize, dst: &mut [f32]) {
        match &self.storage {
            Storage::Candle(b) => b.dequantize_row(row, self.cols / self.dtype().block_size(), dst),
            Storage::Packed(p) => p.dequantize_row(row, &mut dst[..self.cols]),
        }
    }

    /// The whole tensor as f32 (for small 1-D weights: norms, biases).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, chunk) in out.chunks_mut(self.cols).enumerate() {
            self.row(r, chunk);
        }
        out
    }
}

fn bad(reason: String) -> Error {
    Error::BadModelFile {
        path: Default::default(),
        reason,
    }
}

/// Fills `blocks` from `reader` (`GgmlType`s are `repr(C)` byte layouts of the GGUF blocks).
fn fill<T: GgmlType, R: Read>(reader: &mut R, blocks: &mut [T]) -> Result<()> {
    // SAFETY: the bytes of `blocks`; T is a repr(C) block of integers and f16s, valid for any
    // bit pattern.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(
            blocks.as_mut_ptr() as *mut u8,
            std::mem::size_of_val(blocks),
        )
    };
    Ok(reader.read_exact(bytes)?)
}

/// Reads `n` blocks into `scratch`, grown as needed (the header check bounds `n` by the
/// file's size).
fn read_into<'s, T: GgmlType, R: Read>(
    reader: &mut R,
    n: usize,
    scratch: &'s mut Vec<u64>,
) -> Result<&'s [T]> {
    const { assert!(std::mem::align_of::<T>() <= std::mem::align_of::<u64>()) };
    let words = n
        .checked_mul(std::mem::size_of::<T>())
        .expect("the header check bounds a tensor's size by the file's")
        .div_ceil(std::mem::size_of::<u64>());
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
    // SAFETY: `scratch` holds at least `n` blocks' bytes (just ensured), aligned for `T`
    // (checked at compile time); T is valid for any bit pattern.
    let blocks = unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr() as *mut T, n) };
    fill(reader, blocks)?;
    Ok(blocks)
}

/// Reads `n` blocks into a vector of their own.
fn read_blocks<T: GgmlType, R: Read>(reader: &mut R, n: usize) -> Result<Vec<T>> {
    let mut v: Vec<T> = vec![T::zeros(); n];
    fill(reader, &mut v)?;
    Ok(v)
}

/// Matrices that multiply the same activations (a layer's queries, keys and values; its
/// feed-forward gate and up projections), each run of neighbours that [`QWeight::stack`]
/// takes multiplied as one matrix: the activations are quantized once and the threads
/// started once per run, and every output comes out as the part alone would give it.
pub struct Stacked {
    runs: Vec<QWeight>,
    /// Each part's run, first column in the run's output rows, and width.
    parts: Vec<(usize, usize, usize)>,
}

impl Stacked {
    /// Panics if the parts are not all as wide (they multiply the same activations).
    pub fn new(parts: Vec<QWeight>) -> Self {
        assert!(
            parts.windows(2).all(|w| w[0].cols == w[1].cols),
            "stacked matrices multiply the same activations: their rows are as long"
        );
        let mut runs: Vec<Vec<QWeight>> = Vec::new();
        for p in parts {
            match runs.last_mut() {
                Some(run) if run[0].stacks_with(&p) => run.push(p),
                _ => runs.push(vec![p]),
            }
        }
        let mut places = Vec::new();
        for (i, run) in runs.iter().enumerate() {
            let mut offset = 0;
            for p in run {
                places.push((i, offset, p.rows));
                offset += p.rows;
            }
        }
        let runs = runs
            .into_iter()
            .map(|mut run| match run.len() {
                1 => run.pop().unwrap(),
                _ => QWeight::stack(&run.iter().collect::<Vec<_>>())
                    .expect("stacks_with checked the parts"),
            })
            .collect();
        Self {
            runs,
            parts: places,
        }
    }

    /// The weights, all parts together.
    pub fn params(&self) -> usize {
        self.runs.iter().map(|r| r.rows * r.cols).sum()
    }

    /// Multiplies `lhs` (rows of the parts' common width) by every run, into `outs` (one
    /// buffer per run, resized as needed): read the results with [`Stacked::part`].
    pub fn matmul(&self, lhs: &[f32], outs: &mut Vec<Vec<f32>>) -> Result<()> {
        let m = lhs.len() / self.runs[0].cols;
        outs.resize_with(self.runs.len(), Vec::new);
        for (run, out) in self.runs.iter().zip(outs.iter_mut()) {
            out.resize(m * run.rows, 0.0);
            run.matmul(lhs, out)?;
        }
        Ok(())
    }

    /// Part `i`'s outputs for activation row `row`, from [`Stacked::matmul`]'s `outs`.
    pub fn part<'a>(&self, outs: &'a [Vec<f32>], i: usize, row: usize) -> &'a [f32] {
        let (run, first, width) = self.parts[i];
        let at = row * self.runs[run].rows + first;
        &outs[run][at..at + width]
    }
}

const Q5_0_BYTES: usize = 22; // f16 scale, 4 bytes of high bits, 16 bytes of low nibbles
const Q8_0_BYTES: usize = 34; // f16 scale, 32 signed bytes

/// Q5_0 block: value j = ((low nibble j) | (high bit j) << 4) - 16, times scale d.
/// The Q8_0 block with the same d and those integers represents exactly the same values.
fn q5_0_to_q8_0(src: &[u8; Q5_0_BYTES], dst: &mut [u8; Q8_0_BYTES]) {
    dst[..2].copy_from_slice(&src[..2]);
    let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
    let qs = &src[6..];
    for j in 0..16 {
        let lo = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        dst[2 + j] = (lo as i8 - 16) as u8;
        dst[2 + j + 16] = (hi as i8 - 16) as u8;
    }
}

/// The Q8_0 blocks holding exactly the values of `blocks`.
fn widen_q5_0(blocks: &[BlockQ5_0]) -> Vec<BlockQ8_0> {
    // The byte views below are only in bounds if the blocks are exactly these sizes.
    const {
        assert!(std::mem::size_of::<BlockQ5_0>() == Q5_0_BYTES);
        assert!(std::mem::size_of::<BlockQ8_0>() == Q8_0_BYTES);
    }
    let n = blocks.len();
    let mut v: Vec<BlockQ8_0> = vec![BlockQ8_0::zeros(); n];
    // SAFETY: both are repr(C) blocks of bytes and f16s, any bit pattern valid.
    let src = unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, n * Q5_0_BYTES) };
    let dst = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, n * Q8_0_BYTES) };
    for (s, d) in src
        .chunks_exact(Q5_0_BYTES)
        .zip(dst.chunks_exact_mut(Q8_0_BYTES))
    {
        q5_0_to_q8_0(s.try_into().unwrap(), d.try_into().unwrap());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q5_0_widening_is_lossless() {
        // Random Q5_0 blocks (any bytes are valid, but keep the scale finite).
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut raw = vec![0u8; 64 * Q5_0_BYTES];
        for b in raw.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *b = state as u8;
        }
        for block in raw.chunks_exact_mut(Q5_0_BYTES) {
            block[..2].copy_from_slice(&f16::from_f32(0.0123).to_le_bytes());
        }
        let q5: Vec<BlockQ5_0> = read_blocks(&mut raw.as_slice(), 64).unwrap();
        let q8 = widen_q5_0(&q5);
        let (mut a, mut b) = (vec![0f32; 64 * 32], vec![0f32; 64 * 32]);
        BlockQ5_0::to_float(&q5, &mut a);
        BlockQ8_0::to_float(&q8, &mut b);
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != 0.0));
    }

    /// A `rows x cols` matrix of random `T` blocks, read as from a GGUF file for `kernels`.
    fn random_weight<T: GgmlType>(
        rows: usize,
        cols: usize,
        seed: u32,
        kernels: Kernels,
    ) -> QWeight {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect();
        let mut blocks = vec![T::zeros(); rows * cols / T::BLCK_SIZE];
        T::from_float(&values, &mut blocks);
        let size = blocks.len() * std::mem::size_of::<T>();
        // SAFETY: plain byte blocks.
        let bytes = unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, size) };
        let info = TensorInfo {
            ggml_dtype: T::DTYPE,
            shape: (rows, cols).into(),
            offset: 0,
        };
        let mut reader = std::io::Cursor::new(bytes);
        QWeight::read(&mut reader, 0, "w", &info, kernels, &mut Vec::new()).unwrap()
    }

    /// A stack gives each part's outputs bit for bit, in every family this CPU runs; a part of
    /// another format, or stored otherwise, starts a new run. At 896 columns the per-32
    /// formats keep their rows' last blocks in half size (the 0.5B's widths), and on the
    /// portable path Q5_0, widened to Q8_0, stacks with Q8_0.
    #[test]
    fn stacked_matrices_multiply_as_their_parts() {
        type Parts = fn(Kernels) -> Vec<QWeight>;
        let k_quants: Parts = |k| {
            vec![
                random_weight::<BlockQ4K>(48, 512, 1, k),
                random_weight::<BlockQ4K>(16, 512, 2, k),
                random_weight::<BlockQ6K>(32, 512, 3, k),
                random_weight::<BlockQ6K>(16, 512, 4, k),
                random_weight::<BlockQ4K>(16, 512, 5, k),
            ]
        };
        let per32: Parts = |k| {
            vec![
                random_weight::<BlockQ5_0>(32, 896, 6, k),
                random_weight::<BlockQ5_0>(16, 896, 7, k),
                random_weight::<BlockQ8_0>(16, 896, 8, k),
                random_weight::<BlockQ5_1>(32, 896, 9, k),
                random_weight::<BlockQ5_1>(16, 896, 10, k),
                random_weight::<f32>(16, 896, 11, k),
            ]
        };
        for kernels in Kernels::supported() {
            let portable = kernels == Kernels::Portable;
            for (parts, runs) in [(k_quants, 3), (per32, if portable { 3 } else { 4 })] {
                let stacked = Stacked::new(parts(kernels));
                assert_eq!(stacked.runs.len(), runs, "{kernels}");
                let cols = stacked.runs[0].cols;
                for m in [1, 3, 9] {
                    let lhs: Vec<f32> =
                        (0..m * cols).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
                    let mut outs = Vec::new();
                    stacked.matmul(&lhs, &mut outs).unwrap();
                    for (i, part) in parts(kernels).iter().enumerate() {
                        let mut want = vec![0f32; m * part.rows()];
                        part.matmul(&lhs, &mut want).unwrap();
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        for (r, want) in want.chunks(part.rows()).enumerate() {
                            let got = stacked.part(&outs, i, r);
                            assert_eq!(
                                bits(got),
                                bits(want),
                                "{kernels}, part {i}, {m} rows, row {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}
