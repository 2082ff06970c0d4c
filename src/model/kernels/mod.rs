//! Multi-row matmul kernels for quantized GGUF weights, in three instruction-set families.
//!
//! A verify forward multiplies each weight matrix by k+1 activation rows. These kernels unpack
//! every weight block once and then run it against all rows, so extra rows cost only their own
//! multiply-adds, not another pass over the weights (which is what a one-token decode is bound
//! by). The weights are repacked at load time into the layout of the family that multiplies
//! them ([`layout`]): AVX-512 VNNI ([`avx512`], Q4_K, Q5_K, Q6_K, Q5_0 and Q8_0 on 64-byte
//! vectors: Q6_K in a layout of its own, the others in AVX2's, two blocks a vector) and AVX2
//! with FMA and F16C ([`avx2`], the same five plus Q4_0, Q4_1 and Q5_1, on 32-byte vectors; on
//! an AVX-512 machine it also runs Q4_0, Q4_1 and Q5_1).
//! AVX-VNNI runs AVX2's layout with `vpdpbusd` for its products, to the same bits.
//!
//! Row independence is by construction in all: for each (weight row, activation row) pair
//! the arithmetic is the same sequence of operations whatever the number of rows (integer sums
//! are exact; the float accumulation runs block by block in a fixed order). So a forward over k
//! tokens gives bit for bit the logits of k one-token forwards. AVX-512 and AVX2 round
//! differently from each other, so their logits differ in the last bits, as two CPUs' would.
//!
//! [`Kernels::detect`] picks the best family this CPU runs, or the one `CASCADE_KERNELS`
//! names (`avx512`, `avxvnni`, `avx2`, `portable`); `portable` is candle's `vec_dot`, one dot
//! product per output (also row-independent, but every extra row costs a full pass over the
//! weights).

mod layout;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use crate::error::{Error, Result};
use candle_core::quantized::k_quants::{
    BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0,
};
use candle_core::quantized::GgmlDType;
use layout::{Rows, NARROW, QK, WIDE};
use std::ops::Range;

/// A family of matmul kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// AVX-512 F/BW/VNNI/VL (`vpdpbusd`).
    Avx512,
    /// AVX2 with FMA, F16C and AVX-VNNI (`vpdpbusd` on 32-byte vectors): AVX2's layout and
    /// bits, in fewer instructions.
    AvxVnni,
    /// AVX2 with FMA and F16C (`vpmaddubsw`).
    Avx2,
    /// candle's `vec_dot`, on any CPU.
    Portable,
}

/// The environment variable that forces a kernel family.
pub const KERNELS_ENV: &str = "CASCADE_KERNELS";

impl Kernels {
    /// Every family, best first.
    pub const ALL: [Kernels; 4] = [
        Kernels::Avx512,
        Kernels::AvxVnni,
        Kernels::Avx2,
        Kernels::Portable,
    ];

    /// The name used in `CASCADE_KERNELS` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Avx512 => "avx512",
            Kernels::AvxVnni => "avxvnni",
            Kernels::Avx2 => "avx2",
            Kernels::Portable => "portable",
        }
    }

    /// True if this CPU runs the family.
    pub fn runs_here(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512 => avx512::supported() && avx2::supported(),
            #[cfg(target_arch = "x86_64")]
            Kernels::AvxVnni => avx2::supported_vnni(),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2 => avx2::supported(),
            Kernels::Portable => true,
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The families this CPU runs, best first.
    pub fn supported() -> Vec<Kernels> {
        Self::ALL.into_iter().filter(|k| k.runs_here()).collect()
    }

    /// The family named by `CASCADE_KERNELS`, or the best this CPU runs.
    pub fn detect() -> Result<Kernels> {
        Self::from_setting(std::env::var(KERNELS_ENV).ok().as_deref())
    }

    /// The family named by `setting` (a `CASCADE_KERNELS` value), or the best this CPU runs.
    pub fn from_setting(setting: Option<&str>) -> Result<Kernels> {
        let Some(name) = setting.map(str::trim).filter(|s| !s.is_empty()) else {
            return Ok(Self::supported()[0]);
        };
        let names = |ks: &[Kernels]| ks.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ");
        let Some(k) = Self::ALL.into_iter().find(|k| k.name() == name) else {
            return Err(Error::config(
                KERNELS_ENV,
                format!(
                    "unknown kernel family `{name}` (known: {})",
                    names(&Self::ALL)
                ),
            ));
        };
        k.runnable()
    }

    /// This family, if this CPU runs it; else an error naming those it runs.
    pub fn runnable(self) -> Result<Kernels> {
        if self.runs_here() {
            return Ok(self);
        }
        let runs: Vec<_> = Self::supported().iter().map(|k| k.name()).collect();
        Err(Error::config(
            KERNELS_ENV,
            format!(
                "this CPU cannot run the {} kernels (it runs: {})",
                self.name(),
                runs.join(", ")
            ),
        ))
    }
}

impl std::fmt::Display for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A weight matrix repacked for one family of kernels.
pub struct Packed {
    blocks: Blocks,
    kernels: Kernels,
}

/// Repacked blocks, by format and layout: Q6_K for the AVX-512 kernels in [`WIDE`], everything
/// else in [`NARROW`] (which the AVX-512 kernels take two blocks a step).
enum Blocks {
    Q6KWide(Rows<layout::PackedQ6K<WIDE>>),
    Q4K(Rows<layout::PackedQ4K>),
    Q5K(Rows<layout::PackedQ5KPlanes>),
    Q6K(Rows<layout::PackedQ6K<NARROW>>),
    Q5_0(Rows<layout::PackedQ5_0Planes, layout::HalfQ5_0Planes>),
    Q8_0(Rows<layout::PackedQ8_0, layout::HalfQ8_0>),
    Q4_0(Rows<layout::PackedQ4_0, layout::HalfQ4_0>),
    Q4_1(Rows<layout::PackedQ4_1, layout::HalfQ4_1>),
    Q5_1(Rows<layout::PackedQ5_1Planes, layout::HalfQ5_1Planes>),
}

/// `$f` over the packed rows `$b` of `$blocks`, whatever their format. `$f` is pasted into
/// each arm (not a closure: `?` in it returns from the enclosing function), where `$variant` is
/// the arm's constructor (`Blocks::Q4K`, ...) and `$same` a closure that takes another
/// `&Blocks`'s rows if it is of the same variant (`Option<&Rows<..>>`).
macro_rules! each_format {
    (@ $blocks:expr, $b:ident, $variant:ident, $same:ident, $f:expr; $($v:ident),*) => {
        match $blocks {
            $(Blocks::$v($b) => {
                let $variant = Blocks::$v;
                let $same = rows_of(|x| match x {
                    Blocks::$v(rows) => Some(rows),
                    _ => None,
                });
                $f
            })*
        }
    };
    ($blocks:expr, |$b:ident, $variant:ident, $same:ident| $f:expr) => {
        each_format!(@ $blocks, $b, $variant, $same, $f;
            Q6KWide, Q4K, Q5K, Q6K, Q5_0, Q8_0,
            Q4_0, Q4_1, Q5_1)
    };
}

/// `f` as it is, typed to return rows borrowed from its argument ([`each_format`]'s `$same`).
fn rows_of<T, F: Fn(&Blocks) -> Option<&T>>(f: F) -> F {
    f
}

/// The formats the kernels multiply, as candle's blocks.
pub enum Source<'a> {
    Q4K(&'a [BlockQ4K]),
    Q5K(&'a [BlockQ5K]),
    Q6K(&'a [BlockQ6K]),
    Q5_0(&'a [BlockQ5_0]),
    Q8_0(&'a [BlockQ8_0]),
    Q4_0(&'a [BlockQ4_0]),
    Q4_1(&'a [BlockQ4_1]),
    Q5_1(&'a [BlockQ5_1]),
}

impl Packed {
    /// Repacks rows of `cols` values (a multiple of the format's block size) for `kernels`.
    ///
    /// Panics if `kernels` is [`Kernels::Portable`], which multiplies candle's blocks as they
    /// are.
    /// Packing is plain data, so any family's layout can be built (and tested) anywhere;
    /// [`Packed::matmul`] runs only where the family does.
    pub fn new(source: Source, cols: usize, kernels: Kernels) -> Self {
        assert!(
            kernels != Kernels::Portable,
            "the portable path does not repack"
        );
        // Q6_K, whose scales are per 16 values, takes AVX-512's layout under its kernels;
        // everything else AVX2's.
        let blocks = match source {
            Source::Q6K(b) if kernels == Kernels::Avx512 => Blocks::Q6KWide(layout::pack_q6k(b)),
            Source::Q4K(b) => Blocks::Q4K(layout::pack_q4k(b)),
            Source::Q5K(b) => Blocks::Q5K(layout::pack_q5k(b)),
            Source::Q6K(b) => Blocks::Q6K(layout::pack_q6k(b)),
            Source::Q5_0(b) => Blocks::Q5_0(layout::pack_q5_0(b, cols)),
            Source::Q8_0(b) => Blocks::Q8_0(layout::pack_q8_0(b, cols)),
            Source::Q4_0(b) => Blocks::Q4_0(layout::pack_q4_0(b, cols)),
            Source::Q4_1(b) => Blocks::Q4_1(layout::pack_q4_1(b, cols)),
            Source::Q5_1(b) => Blocks::Q5_1(layout::pack_q5_1(b, cols)),
        };
        Self { blocks, kernels }
    }

    /// The family the blocks are packed for.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The quantization the blocks came from.
    pub fn dtype(&self) -> GgmlDType {
        match &self.blocks {
            Blocks::Q4K(_) => GgmlDType::Q4K,
            Blocks::Q5K(_) => GgmlDType::Q5K,
            Blocks::Q6K(_) | Blocks::Q6KWide(_) => GgmlDType::Q6K,
            Blocks::Q5_0(_) => GgmlDType::Q5_0,
            Blocks::Q8_0(_) => GgmlDType::Q8_0,
            Blocks::Q4_0(_) => GgmlDType::Q4_0,
            Blocks::Q4_1(_) => GgmlDType::Q4_1,
            Blocks::Q5_1(_) => GgmlDType::Q5_1,
        }
    }

    /// The weight rows `rows` (in that order) of a matrix of `cols` values per row: rows are
    /// stored one after another, so their blocks are copied as they are.
    pub fn select_rows(&self, rows: &[u32], cols: usize) -> Self {
        let kb = cols.div_ceil(QK);
        let blocks = each_format!(&self.blocks, |b, variant, _same| variant(
            b.select(rows, kb)
        ));
        Self {
            blocks,
            kernels: self.kernels,
        }
    }

    /// The rows of `parts` one after another, if they are packed alike (one format, one
    /// family's layout) from rows of the same length.
    pub fn stack(parts: &[&Packed]) -> Option<Packed> {
        let kernels = parts.first()?.kernels;
        if parts.iter().any(|p| p.kernels != kernels) {
            return None;
        }
        let blocks = each_format!(&parts[0].blocks, |_b, variant, same| {
            let rows: Option<Vec<_>> = parts.iter().map(|p| same(&p.blocks)).collect();
            variant(layout::Rows::stack(&rows?)?)
        });
        Some(Self { blocks, kernels })
    }

    /// Dequantizes row `row` (of `dst.len()` values) into `dst`.
    pub fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        let kb = dst.len().div_ceil(QK);
        let mut block = [0f32; QK];
        for (i, y) in dst.chunks_mut(QK).enumerate() {
            each_format!(&self.blocks, |p, _variant, _same| p
                .dequantize(row, i, kb, &mut block));
            y.copy_from_slice(&block[..y.len()]);
        }
    }

    /// `dst[m x n] = lhs[m x k] x Wᵀ` for `n` weight rows of `k` values.
    ///
    /// Panics if the slices are shorter than the shape says.
    pub fn matmul(&self, mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
        // Only x86-64 runs a packing family (`Kernels::runs_here`).
        #[cfg(not(target_arch = "x86_64"))]
        panic!("the {:?} kernels do not run on this CPU", self.kernels);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Packed::new` only packs for a fast family, in the layout of the family that
        // multiplies the format; that family runs on this CPU (checked here; an AVX-512 CPU
        // that runs that family also runs AVX2 and AVX-512 VL: `Kernels::runs_here`), and each
        // family's products are those it was detected for. The kernels check the lengths.
        unsafe {
            assert!(self.kernels.runs_here());
            // AVX2's kernels, with `vpdpbusd` where the family has it: the same bits in fewer
            // instructions. The AVX-512 family runs Q4_0, Q4_1 and Q5_1 with them, in the EVEX
            // form every AVX-512 VNNI CPU has: they quantize activations per 32 values, as the
            // weights' scales are (the AVX-512 kernels per 256), and on AMD Zen 4 Q4_1 in the
            // AVX-512 kernels' two-block steps took 10-65% longer per product at 1-4 rows
            // (`kernel_timing`; the same at 8), where a decode step spends its time.
            macro_rules! narrow {
                ($b:expr) => {
                    match self.kernels {
                        Kernels::AvxVnni => avx2::matmul::<_, _, avx2::VexDpbusd>(
                            &$b.blocks, &$b.tails, mkn, lhs, dst,
                        ),
                        Kernels::Avx512 => avx2::matmul::<_, _, avx2::EvexDpbusd>(
                            &$b.blocks, &$b.tails, mkn, lhs, dst,
                        ),
                        _ => avx2::matmul::<_, _, avx2::Maddubs>(
                            &$b.blocks, &$b.tails, mkn, lhs, dst,
                        ),
                    }
                };
            }
            // The AVX-512 kernels, two blocks of AVX2's layout a step.
            macro_rules! two_blocks {
                ($b:expr) => {
                    avx512::matmul_two_blocks($b, mkn, lhs, dst)
                };
            }
            let avx512 = self.kernels == Kernels::Avx512;
            match &self.blocks {
                Blocks::Q6KWide(b) if avx512 => avx512::matmul_q6k(&b.blocks, mkn, lhs, dst),
                Blocks::Q6KWide(_) => {
                    unreachable!("AVX-512's Q6_K layout packed for {:?}", self.kernels)
                }
                Blocks::Q4K(b) if avx512 => two_blocks!(b),
                Blocks::Q5K(b) if avx512 => two_blocks!(b),
                Blocks::Q5_0(b) if avx512 => two_blocks!(b),
                Blocks::Q8_0(b) if avx512 => two_blocks!(b),
                Blocks::Q4K(b) => narrow!(b),
                Blocks::Q5K(b) => narrow!(b),
                Blocks::Q6K(b) => narrow!(b),
                Blocks::Q5_0(b) => narrow!(b),
                Blocks::Q8_0(b) => narrow!(b),
                Blocks::Q4_0(b) => narrow!(b),
                Blocks::Q4_1(b) => narrow!(b),
                Blocks::Q5_1(b) => narrow!(b),
            }
        }
    }
}

/// The output of a matmul as its tasks write it: its start and length.
struct Dst(*mut f32, usize);
// SAFETY: every (row, column) of dst is written by exactly one task.
unsafe impl Sync for Dst {}

/// Activation rows handled by one kernel call (accumulators live on the stack).
const MAX_ROWS: usize = 16;

/// Weight rows per task.
pub(super) const CHUNK: usize = 16;

/// Dot products of up to `CHUNK` weight rows with up to `MAX_ROWS` activation rows.
type Tile = [[f32; MAX_ROWS]; CHUNK];

/// Runs `f(weight_rows, first_act_row, act_rows, out)` over every tile of at most `CHUNK`
/// weight rows and `MAX_ROWS` activation rows, in parallel over weight rows (on candle's
/// spinning thread pool: a decode step makes ~200 small matmuls, so wake-up latency matters),
/// scattering `out[weight_row][act_row]` into `dst` (`m x n`, row-major). Activation rows
/// taking `row_bytes` each once quantized go in passes of [`PASS_BYTES`] over the weights;
/// within a pass, each task takes its weight rows past one 16-row tile of activations after
/// another ([`each_tile`]).
///
/// Panics if `dst` holds fewer than `m * n` values.
fn for_each_output(
    (m, n): (usize, usize),
    row_bytes: usize,
    dst: &mut [f32],
    f: impl Fn(Range<usize>, usize, usize, &mut Tile) + Sync,
) {
    assert!(
        m.checked_mul(n).is_some_and(|len| dst.len() >= len),
        "output holds {} values, not {m} x {n}",
        dst.len()
    );
    let dst = Dst(dst.as_mut_ptr(), dst.len());
    let dst = &dst;
    let rows = pass_rows(row_bytes);
    for pass in (0..m).step_by(rows).map(|p| p..m.min(p + rows)) {
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |chunks| {
            // SAFETY: each task gets its own chunks of weight rows.
            unsafe { each_tile(pass.clone(), n, chunks, dst, &f) }
        });
    }
}

/// Activation rows per pass for rows of `row_bytes`: as many whole tiles as fit in
/// [`PASS_BYTES`], at least one.
fn pass_rows(row_bytes: usize) -> usize {
    (PASS_BYTES / row_bytes.max(1) / MAX_ROWS).max(1) * MAX_ROWS
}

/// The activation bytes a pass over the weights takes at most, unless one tile's rows take
/// more (a prompt's rows are quantized at once; each pass multiplies as many of them as this
/// by every weight row), so that they stay in a core's L2 cache (2 MB on the Intel Xeon this
/// was measured on, 512 KB on Zen 3) while the weights stream past. In one pass, the rows of
/// a 733-token prompt (1.7 MB for the 1.5B's `gate`, 9.9 MB for its `down`) came from L3 for
/// every 16 weight rows. 256 KB measured the same as 512 KB there, within the noise. (That
/// was with each chunk of 16 weight rows meeting every tile in turn; since [`each_tile`] takes
/// tiles outer, a pass's rows are read once per grab of the pool, 8 a thread, and passes were
/// not measured again.)
const PASS_BYTES: usize = 512 << 10;

/// [`for_each_output`]'s work for weight-row chunks `chunks` and activation rows `pass`: every
/// chunk meets one tile of activation rows before any meets the next, so that the tile stays
/// in L1 (or, for long rows, L2) while the task's weight rows (1/16 of the matrix with two
/// threads: candle's pool hands out 8 grabs a thread) come past it from L2 or L3. Chunk by
/// chunk instead, every chunk read all of the pass's activations (up to 512 KB) from L2
/// again: in a 512-token prefill of the 1.5B (AMD EPYC Zen 5), `gate` and `up` took 11-13%
/// longer with the AVX-512 kernels and 4-6% with the AVX2 ones, and the whole prefill 5-9% and
/// 1-3%. Panels of 256 KB of weights within a task measured the same or a little slower.
///
/// Panics if `dst` holds fewer than `pass.end x n` values.
///
/// # Safety
/// `dst` was made from a `&mut [f32]` of `dst.1` values that nothing else reads or writes
/// during the call, and no other task writes the columns of `chunks` while this one runs.
unsafe fn each_tile(
    pass: Range<usize>,
    n: usize,
    chunks: Range<usize>,
    dst: &Dst,
    f: &(impl Fn(Range<usize>, usize, usize, &mut Tile) + Sync),
) {
    assert!(
        pass.end.checked_mul(n).is_some_and(|len| len <= dst.1),
        "a pass to row {} of {n} columns in an output of {} values",
        pass.end,
        dst.1
    );
    let mut out = [[0f32; MAX_ROWS]; CHUNK];
    for r0 in pass.clone().step_by(MAX_ROWS) {
        let rows = (pass.end - r0).min(MAX_ROWS);
        for c in chunks.clone() {
            let js = c * CHUNK..n.min((c + 1) * CHUNK);
            f(js.clone(), r0, rows, &mut out);
            for (j, col) in js.clone().zip(&out) {
                for (r, &v) in col[..rows].iter().enumerate() {
                    // SAFETY: r0 + r < pass.end and j < n, so the index is below pass.end * n,
                    // within `dst` (asserted above); the caller gives this task columns j alone.
                    unsafe { *dst.0.add((r0 + r) * n + j) = v };
                }
            }
        }
    }
}

/// A matrix's weight rows as the kernels read them: `full` blocks each in `w`, then each row's
/// last block in `tails` if that is not empty (in half size: `layout::Rows`).
#[cfg(target_arch = "x86_64")]
struct Weights<'a, B, H> {
    w: &'a [B],
    tails: &'a [H],
    full: usize,
    /// How many weight rows on [`Weights::block`] prefetches the same block: 0 for
    /// [`PREFETCH`] bytes ahead instead.
    rows_ahead: usize,
}

/// A block of [`Weights`]: whole, or a row's half-size last block.
#[cfg(target_arch = "x86_64")]
enum Part<'a, B, H> {
    Whole(&'a B),
    Half(&'a H),
}

#[cfg(target_arch = "x86_64")]
impl<'a, B, H> Weights<'a, B, H> {
    /// Rows of `kb` blocks each, read one after another: [`Weights::block`] prefetches
    /// [`PREFETCH`] bytes ahead.
    fn new(w: &'a [B], tails: &'a [H], kb: usize) -> Self {
        assert!(kb > 0, "a weight row of no blocks");
        let full = kb - usize::from(!tails.is_empty());
        Self {
            w,
            tails,
            full,
            rows_ahead: 0,
        }
    }

    /// The same rows read `rows` at a time, block by block (AVX-512's rows in pairs, or one
    /// at a time through spans of blocks): [`Weights::block`]
    /// prefetches the same block of a later group's rows, the first at least [`PREFETCH`]
    /// bytes ahead. For rows longer than that (the 1.5B's `down`: 5 KB), a fixed distance
    /// ahead lands in the rows being read and never reaches the next group's later rows,
    /// which then came from memory unannounced (measured: the 1.5B's 8-token verify 3%
    /// slower); for short rows (its `gate`: 864 bytes) the next group alone is too near for
    /// the memory to keep up.
    fn in_groups_of(&self, rows: usize) -> Self {
        let group_bytes = (rows * self.full * size_of::<B>()).max(1);
        Self {
            rows_ahead: rows * PREFETCH.div_ceil(group_bytes),
            ..*self
        }
    }

    /// Whether rows `..end` of `kb` blocks are all there.
    fn holds(&self, end: usize, kb: usize) -> bool {
        end.checked_mul(self.full)
            .is_some_and(|len| len <= self.w.len())
            && (self.full == kb || end <= self.tails.len())
    }

    /// Block `b` of row `j`, prefetching ahead.
    ///
    /// # Safety
    /// `j` is below an `end` for which [`Weights::holds`] is true, and `b` below its `kb`.
    #[inline(always)]
    unsafe fn block(&self, j: usize, b: usize) -> Part<'a, B, H> {
        // The address prefetched may lie past the end of the weights: it is computed with
        // wrapping arithmetic and only prefetched, never read (a prefetch does not fault).
        let ahead = |x: *const u8, row_bytes: usize| match self.rows_ahead {
            0 => x.wrapping_add(PREFETCH),
            rows => x.wrapping_add(rows * row_bytes),
        };
        if b < self.full {
            let x = self.w.get_unchecked(j * self.full + b);
            prefetch::<B>(ahead(x as *const B as _, self.full * size_of::<B>()));
            Part::Whole(x)
        } else {
            let x = self.tails.get_unchecked(j);
            prefetch::<H>(ahead(x as *const H as _, size_of::<H>()));
            Part::Half(x)
        }
    }
}

/// How far ahead (in bytes) the kernels prefetch weights: far enough for a one-token decode,
/// which streams the weights from memory, to keep the memory busy (measured on an Intel Xeon:
/// decode 10-12% faster than at 1 KB on both families, 8 KB no better, prefills unchanged).
/// Rows read in pairs or in spans of blocks prefetch by rows instead
/// ([`Weights::in_groups_of`]).
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

/// Prefetches the cache lines of a block of type `B` at `at`, which need not be readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch<B>(at: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    for line in 0..size_of::<B>().div_ceil(64) {
        // SAFETY: SSE is part of x86-64; a prefetch never dereferences its address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64 * line) as *const i8) };
    }
}

#[cfg(test)]
mod tests;
