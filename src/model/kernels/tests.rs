//! Every kernel family this CPU runs, against a dequantize-then-multiply reference and
//! candle's `vec_dot`, and for row-count independence. (AVX2 runs on AVX-512 machines too,
//! and AVX-VNNI on those that have it, so every family is tested there.)

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
    // Where the f16 scales are: left alone (random bits can be NaN or huge).
    let scales = match T::DTYPE {
        GgmlDType::Q4K | GgmlDType::Q5K => 0..4,   // d, dmin first
        GgmlDType::Q6K => size - 2..size,          // d last
        GgmlDType::Q4_1 | GgmlDType::Q5_1 => 0..4, // d, m first
        _ => 0..2,                                 // Q4_0, Q5_0, Q8_0: d first
    };
    // SAFETY: plain byte blocks.
    let bytes = unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, count * size) };
    let noise = random(bytes.len(), seed + 1);
    for (i, (b, r)) in bytes.iter_mut().zip(noise).enumerate() {
        if !scales.contains(&(i % size)) && i % 3 == 0 {
            *b = ((r + 1.0) * 127.9) as u8;
        }
    }
    w
}

/// Candle blocks as a packing source.
type Pack<T> = fn(&[T]) -> Source<'_>;

const Q4K: Pack<BlockQ4K> = |b| Source::Q4K(b);
const Q5K: Pack<BlockQ5K> = |b| Source::Q5K(b);
const Q6K: Pack<BlockQ6K> = |b| Source::Q6K(b);
const Q5_0: Pack<BlockQ5_0> = |b| Source::Q5_0(b);
const Q8_0: Pack<BlockQ8_0> = |b| Source::Q8_0(b);
const Q4_0: Pack<BlockQ4_0> = |b| Source::Q4_0(b);
const Q4_1: Pack<BlockQ4_1> = |b| Source::Q4_1(b);
const Q5_1: Pack<BlockQ5_1> = |b| Source::Q5_1(b);

/// Every packing (AVX-512's and AVX2's differ for Q5_0 and Q5_K), whether or not this CPU runs
/// it (packing is plain data).
const PACKINGS: [Kernels; 2] = [Kernels::Avx512, Kernels::Avx2];

fn dequantizes_like_candle<T: GgmlType>(pack: Pack<T>, cols: usize) {
    let rows = 5;
    let w: Vec<T> = blocks(rows * cols / T::BLCK_SIZE, 7);
    let mut want = vec![0f32; rows * cols];
    T::to_float(&w, &mut want);
    for kernels in PACKINGS {
        let packed = Packed::new(pack(&w), cols, kernels);
        let mut got = vec![0f32; rows * cols];
        for (r, row) in got.chunks_mut(cols).enumerate() {
            packed.dequantize_row(r, row);
        }
        assert_eq!(got, want, "{kernels} {:?}", T::DTYPE);
    }
    assert!(want.iter().any(|&v| v != 0.0));
}

#[test]
fn repacked_blocks_dequantize_exactly_like_candle() {
    dequantizes_like_candle(Q4K, 512);
    dequantizes_like_candle(Q5K, 512);
    dequantizes_like_candle(Q6K, 512);
    // 11 blocks of 32 (the last packed block holds 96 values: stored in half size)
    // and 14 (192 values: padded).
    for cols in [352, 448] {
        dequantizes_like_candle(Q5_0, cols);
        dequantizes_like_candle(Q8_0, cols);
        dequantizes_like_candle(Q4_0, cols);
        dequantizes_like_candle(Q4_1, cols);
        dequantizes_like_candle(Q5_1, cols);
    }
}

/// A row's short last block, stored in half size, multiplies bit for bit as the
/// zero-padded block it replaces: the same rows padded with zero blocks to a multiple of 256
/// values (stored whole) give the same outputs, for each of 1 to 19 activation rows. Also for
/// rows of one short block alone (k = 96) and trimmed to a few of their rows.
#[test]
fn a_rows_short_last_block_multiplies_as_the_padded_block() {
    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }
    fn same<T: GgmlType>(pack: Pack<T>, k: usize) {
        let (n, m, padded) = (21, 19, k.next_multiple_of(QK));
        let w: Vec<T> = blocks(n * k / T::BLCK_SIZE, 8);
        let mut wide = Vec::with_capacity(n * padded / T::BLCK_SIZE);
        for row in w.chunks(k / T::BLCK_SIZE) {
            wide.extend_from_slice(row);
            wide.resize(wide.len() + (padded - k) / T::BLCK_SIZE, T::zeros());
        }
        let lhs = random(m * k, 9);
        let lhs_wide: Vec<f32> = lhs
            .chunks(k)
            .flat_map(|r| {
                r.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0.0, padded - k))
            })
            .collect();
        let picked = [20u32, 3, 3, 0, 11];
        for kernels in families() {
            let what = format!("{kernels} {:?} k = {k}", T::DTYPE);
            let (short, whole) = (
                Packed::new(pack(&w), k, kernels),
                Packed::new(pack(&wide), padded, kernels),
            );
            for rows in 1..=m {
                let (mut a, mut b) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                short.matmul((rows, k, n), &lhs[..rows * k], &mut a);
                whole.matmul((rows, padded, n), &lhs_wide[..rows * padded], &mut b);
                assert!(bits(&a) == bits(&b), "{what}, {rows} rows");
            }
            let (short, whole) = (
                short.select_rows(&picked, k),
                whole.select_rows(&picked, padded),
            );
            let (mut a, mut b) = (vec![0f32; m * picked.len()], vec![0f32; m * picked.len()]);
            short.matmul((m, k, picked.len()), &lhs, &mut a);
            whole.matmul((m, padded, picked.len()), &lhs_wide, &mut b);
            assert!(bits(&a) == bits(&b), "{what}, selected rows");
        }
    }
    for k in [96, 352, 896, 2080] {
        same(Q5_0, k);
        same(Q8_0, k);
        same(Q4_0, k);
        same(Q4_1, k);
        same(Q5_1, k);
    }
}

/// Detection agrees with the flags Linux lists for the CPU, so that no family the CPU runs
/// drops silently out of these tests (and of the CLI's every-family test).
#[test]
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn every_family_the_cpu_runs_is_detected() {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .expect("a flags line")
        .split_whitespace()
        .collect();
    let has = |f: &str| flags.contains(&f);
    let avx2 = has("avx2") && has("fma") && has("f16c");
    let avx512 = avx2 && has("avx512f") && has("avx512bw") && has("avx512_vnni") && has("avx512vl");
    let want: Vec<Kernels> = [
        (avx512, Kernels::Avx512),
        (avx2 && has("avx_vnni"), Kernels::AvxVnni),
        (avx2, Kernels::Avx2),
        (true, Kernels::Portable),
    ]
    .into_iter()
    .filter_map(|(runs, k)| runs.then_some(k))
    .collect();
    assert_eq!(Kernels::supported(), want);
}

/// The kernels this CPU runs (the portable path multiplies candle's blocks, not these).
fn families() -> Vec<Kernels> {
    let ks: Vec<Kernels> = Kernels::supported()
        .into_iter()
        .filter(|&k| k != Kernels::Portable)
        .collect();
    if ks.is_empty() {
        eprintln!("no kernel family runs on this CPU: kernels not tested");
    }
    ks
}

/// Each family against a plain f32 reference, as accurate as candle's `vec_dot` and, where
/// both quantize activations alike (K-quants), within `candle_tol` of it (relative to the
/// largest output); and every row alike whatever the number of activation rows (1..=19) and
/// weight rows (odd counts included).
fn check<T: GgmlType>(pack: Pack<T>, k: usize, candle_tol: Option<f32>) {
    let (n, m) = (25, 19);
    let w: Vec<T> = blocks(n * k / T::BLCK_SIZE, 1);
    let lhs = random(m * k, 2);
    let want = reference(&w, m, k, n, &lhs);
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
    let mut candle = vec![0f32; m * n];
    k_quants::matmul((m, k, n), &lhs, &w, &mut candle).unwrap();
    let error = |x: &[f32]| {
        let e = x.iter().zip(&want).map(|(a, b)| (a - b).abs());
        e.fold(0f32, f32::max) / scale
    };
    for kernels in families() {
        let what = format!("{kernels} {:?} k = {k}", T::DTYPE);
        let packed = Packed::new(pack(&w), k, kernels);
        let mut got = vec![0f32; m * n];
        packed.matmul((m, k, n), &lhs, &mut got);
        // Close to the f32 reference (activation quantization costs some precision) ...
        for (g, r) in got.iter().zip(&want) {
            assert!((g - r).abs() <= 0.02 * scale, "{what}: {g} vs {r}");
        }
        // ... as close as candle's vec_dot path ...
        let (ours, theirs) = (error(&got), error(&candle));
        assert!(
            ours <= 1.5 * theirs,
            "{what}: error {ours} vs candle's {theirs}"
        );
        if let Some(tol) = candle_tol {
            for (g, c) in got.iter().zip(&candle) {
                assert!((g - c).abs() <= tol * scale, "{what}: {g} vs candle {c}");
            }
        }
        // ... and every row is computed alike whatever the number of rows.
        for rows in 1..=m {
            let mut part = vec![0f32; rows * n];
            packed.matmul((rows, k, n), &lhs[..rows * k], &mut part);
            assert!(
                part == got[..rows * n],
                "{what}: {rows} rows differ from {m}"
            );
        }
        for cols in [1, 7, 16, 17] {
            let mut part = vec![0f32; m * cols];
            packed.matmul((m, k, cols), &lhs, &mut part);
            for r in 0..m {
                let (a, b) = (&part[r * cols..(r + 1) * cols], &got[r * n..r * n + cols]);
                assert!(a == b, "{what}: {cols} weight rows differ from {n}");
            }
        }
    }
}

#[test]
fn q4k_kernels_match_references() {
    // 12 blocks: on AVX2, 19 rows reduce in three slabs, fewer rows in one; on AVX-512 (two
    // blocks a step), 6-10 rows go in spans of 3 steps (`span`) and from 9 rows weight rows
    // go in pairs (`in_pairs`). 35 blocks (the 1.5B's `down`: 17 steps of two blocks, then one
    // of one): spans from 2 rows; 44 blocks: spans from 2 rows, of 11 steps down to 3.
    check(Q4K, 3072, Some(1e-4));
    check(Q4K, 8960, Some(1e-4));
    check(Q4K, 11264, Some(1e-4));
}

#[test]
fn q5k_kernels_match_references() {
    check(Q5K, 3072, Some(1e-4));
    check(Q5K, 8960, Some(1e-4)); // an odd number of blocks: AVX-512 ends on a step of one
}

#[test]
fn q6k_kernels_match_references() {
    // On AVX-512 (a block a step): 12 blocks go in pairs and spans from 8 rows, 35 from 3.
    check(Q6K, 3072, Some(1e-4));
    check(Q6K, 8960, Some(1e-4));
}

/// [`check`] for a format with 32-value blocks, at the row lengths its packing treats apart.
fn check_per32<T: GgmlType>(pack: Pack<T>) {
    check(pack, 352, None); // a short last block (96 values), stored in half size
    check(pack, 448, None); // a last block of 192 values, padded
    check(pack, 1024, None);
    check(pack, 2080, None); // 9 packed blocks: 19 rows reduce in two slabs
    check(pack, 2304, None); // 9 whole blocks: AVX-512 ends on a step of one whole block
    check(pack, 8992, None); // 36 blocks, the last of 32 values: pairs and spans from 3 rows
}

#[test]
fn q5_0_kernels_match_references() {
    check_per32(Q5_0);
}

#[test]
fn q8_0_kernels_match_references() {
    check_per32(Q8_0);
}

#[test]
fn q4_0_kernels_match_references() {
    check_per32(Q4_0);
}

#[test]
fn q4_1_kernels_match_references() {
    check_per32(Q4_1);
}

#[test]
fn q5_1_kernels_match_references() {
    check_per32(Q5_1);
}

/// Activations with an outlier in every 256 values, as real models have: formats with one
/// weight scale per 32 quantize activations per 32 too, so an outlier coarsens only its own
/// 32 values, and the AVX2 kernels stay as accurate as candle's per-32 `vec_dot`. (The
/// AVX-512 kernels still quantize activations per 256 for Q5_0 and Q8_0: not held to this.)
#[test]
fn an_outlier_activation_coarsens_only_its_own_32_values() {
    fn outliers<T: GgmlType>(pack: Pack<T>, k: usize) {
        let (n, m) = (9, 3);
        let w: Vec<T> = blocks(n * k / T::BLCK_SIZE, 4);
        let mut lhs = random(m * k, 5);
        for v in lhs.iter_mut().step_by(256) {
            *v *= 100.0;
        }
        let want = reference(&w, m, k, n, &lhs);
        let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
        let error = |x: &[f32]| {
            let e = x.iter().zip(&want).map(|(a, b)| (a - b).abs());
            e.fold(0f32, f32::max) / scale
        };
        let mut candle = vec![0f32; m * n];
        k_quants::matmul((m, k, n), &lhs, &w, &mut candle).unwrap();
        for kernels in families().into_iter().filter(|&f| f == Kernels::Avx2) {
            let mut got = vec![0f32; m * n];
            Packed::new(pack(&w), k, kernels).matmul((m, k, n), &lhs, &mut got);
            let (ours, theirs) = (error(&got), error(&candle));
            assert!(
                ours <= 1.5 * theirs,
                "{kernels} {:?}: error {ours} vs candle's {theirs}",
                T::DTYPE
            );
        }
    }
    outliers(Q5_0, 1024);
    outliers(Q8_0, 1024);
    outliers(Q4_0, 1024);
    outliers(Q4_1, 1024);
    outliers(Q5_1, 1024);
}

/// Extreme activations (a single huge value, all equal, zeros) and extreme weights (every
/// quant at its largest magnitude) stay within the 16-bit sums' range: the kernels agree with
/// the reference where saturation or overflow would show at once.
#[test]
fn extreme_values_do_not_overflow_the_16_bit_sums() {
    fn saturated<T: GgmlType>(pack: Pack<T>, k: usize, fill: u8) {
        let n = 3;
        let mut w: Vec<T> = blocks(n * k / T::BLCK_SIZE, 3);
        let size = std::mem::size_of::<T>();
        // SAFETY: plain byte blocks.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, w.len() * size) };
        for (i, b) in bytes.iter_mut().enumerate() {
            let off = i % size;
            let quant = match T::DTYPE {
                GgmlDType::Q4K | GgmlDType::Q5K => off >= 16, // after d, dmin, scales
                GgmlDType::Q6K => off < 192,                  // ql, qh
                GgmlDType::Q8_0 | GgmlDType::Q4_0 => off >= 2,
                GgmlDType::Q5_0 => off >= 2,
                GgmlDType::Q4_1 | GgmlDType::Q5_1 => off >= 4,
                _ => false,
            };
            if quant {
                *b = fill;
            }
        }
        for lhs in [vec![1.0f32; k], {
            let mut v = vec![1e-3f32; k];
            v[5] = 100.0;
            v
        }] {
            let want = reference(&w, 1, k, n, &lhs);
            let scale = want.iter().map(|v| v.abs()).fold(1e-6f32, f32::max);
            for kernels in families() {
                let packed = Packed::new(pack(&w), k, kernels);
                let mut got = vec![0f32; n];
                packed.matmul((1, k, n), &lhs, &mut got);
                for (g, r) in got.iter().zip(&want) {
                    assert!(
                        (g - r).abs() <= 0.02 * scale,
                        "{kernels} {:?} fill {fill:#x}: {g} vs {r}",
                        T::DTYPE
                    );
                }
            }
        }
    }
    for fill in [0xff, 0x00, 0x80, 0x7f] {
        saturated(Q4K, 512, fill);
        saturated(Q5K, 512, fill);
        saturated(Q6K, 512, fill);
        saturated(Q5_0, 256, fill);
        saturated(Q8_0, 256, fill);
        saturated(Q4_0, 256, fill);
        saturated(Q4_1, 256, fill);
        saturated(Q5_1, 256, fill);
    }
}

#[test]
fn kernel_family_settings() {
    assert_eq!(
        Kernels::from_setting(Some("portable")).unwrap(),
        Kernels::Portable
    );
    assert_eq!(
        Kernels::from_setting(None).unwrap(),
        Kernels::supported()[0]
    );
    assert_eq!(
        Kernels::from_setting(Some("")).unwrap(),
        Kernels::supported()[0]
    );
    let e = Kernels::from_setting(Some("sse9")).unwrap_err().to_string();
    assert_eq!(
        e,
        "CASCADE_KERNELS: unknown kernel family `sse9` (known: avx512, avxvnni, avx2, portable)"
    );
    for k in Kernels::ALL {
        match Kernels::from_setting(Some(k.name())) {
            Ok(got) => assert!(got == k && k.runs_here()),
            Err(e) => {
                assert!(!k.runs_here());
                assert!(e.to_string().contains("this CPU cannot run"), "{e}");
            }
        }
    }
}

/// Development timing (not a test of speed): `KT=k,n [CASCADE_KERNELS=avx512] cargo test
/// --release --lib kernel_timing -- --ignored --nocapture` (AVX2 unless the family is named);
/// `KFMT=q6k` times one format, `KM=8,16` those row counts.
#[test]
#[ignore]
fn kernel_timing() {
    let spec = std::env::var("KT").unwrap_or("1536,8960".into());
    let v: Vec<usize> = spec.split(',').map(|x| x.parse().unwrap()).collect();
    let (k, n) = (v[0], v[1]);
    let reps: usize = std::env::var("KREPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let kq = k / 256 * 256;
    let w4: Vec<BlockQ4K> = blocks(n * kq / 256, 1);
    let w5k: Vec<BlockQ5K> = blocks(n * kq / 256, 1);
    let w6: Vec<BlockQ6K> = blocks(n * kq / 256, 1);
    let w5: Vec<BlockQ5_0> = blocks(n * k / 32, 1);
    let w8: Vec<BlockQ8_0> = blocks(n * k / 32, 1);
    let w40: Vec<BlockQ4_0> = blocks(n * k / 32, 1);
    let w41: Vec<BlockQ4_1> = blocks(n * k / 32, 1);
    let w51: Vec<BlockQ5_1> = blocks(n * k / 32, 1);
    let family = match std::env::var(super::KERNELS_ENV) {
        Ok(_) => Kernels::detect().unwrap(),
        Err(_) => Kernels::Avx2,
    };
    if family == Kernels::Portable {
        println!("portable: candle's vec_dot, no packed layout to time");
        return;
    }
    let all = [
        ("q4k", Packed::new(Q4K(&w4), kq, family)),
        ("q5k", Packed::new(Q5K(&w5k), kq, family)),
        ("q6k", Packed::new(Q6K(&w6), kq, family)),
        ("q5_0", Packed::new(Q5_0(&w5), k, family)),
        ("q8_0", Packed::new(Q8_0(&w8), k, family)),
        ("q4_0", Packed::new(Q4_0(&w40), k, family)),
        ("q4_1", Packed::new(Q4_1(&w41), k, family)),
        ("q5_1", Packed::new(Q5_1(&w51), k, family)),
    ];
    let only = std::env::var("KFMT").ok();
    let ms: Vec<usize> = std::env::var("KM")
        .map(|v| {
            v.split(',')
                .map(|x| {
                    x.trim()
                        .parse()
                        .expect("KM: row counts separated by commas")
                })
                .collect()
        })
        .unwrap_or(vec![1, 2, 4, 8, 16]);
    let names: Vec<&str> = all.iter().map(|(name, _)| *name).collect();
    if let Some(name) = only.as_deref().filter(|n| !names.contains(n)) {
        panic!("KFMT={name}: not one of {names:?}");
    }
    for (name, p) in &all {
        if only.as_deref().is_some_and(|o| o != *name) {
            continue;
        }
        let k = if name.ends_with('k') { kq } else { k };
        let mut line = format!("{name} k={k} n={n}:");
        for &m in &ms {
            let lhs = random(m * k, 2);
            let mut dst = vec![0f32; m * n];
            let best = (0..15)
                .map(|_| {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        p.matmul((m, k, n), &lhs, &mut dst);
                    }
                    t.elapsed().as_secs_f64() / reps as f64
                })
                .fold(f64::INFINITY, f64::min);
            line += &format!(" m={m} {:.2}", best / (m * n * k / 256) as f64 * 1e9);
        }
        println!("{line}");
    }
}

/// An activation row holding a NaN or an infinity gives non-finite outputs, as plain
/// arithmetic does (a model gone wrong is then caught by the NaN check on the logits), for
/// every format and family, whether the bad value is alone or fills the row; the other rows
/// are untouched.
#[test]
fn a_non_finite_activation_gives_non_finite_outputs() {
    fn case<T: GgmlType>(pack: Pack<T>, k: usize) {
        let n = 9;
        let w: Vec<T> = blocks(n * k / T::BLCK_SIZE, 3);
        let clean = random(3 * k, 4);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for whole_row in [false, true] {
                let mut lhs = clean.clone();
                match whole_row {
                    true => lhs[k..2 * k].fill(bad),
                    false => lhs[k + 37] = bad,
                }
                for kernels in families() {
                    let what = format!("{kernels} {:?} {bad} (whole row: {whole_row})", T::DTYPE);
                    let packed = Packed::new(pack(&w), k, kernels);
                    let (mut got, mut want) = (vec![0f32; 3 * n], vec![0f32; 3 * n]);
                    packed.matmul((3, k, n), &lhs, &mut got);
                    packed.matmul((3, k, n), &clean, &mut want);
                    assert!(
                        got[n..2 * n].iter().all(|v| !v.is_finite()),
                        "{what}: {got:?}"
                    );
                    assert!(
                        got[..n] == want[..n] && got[2 * n..] == want[2 * n..],
                        "{what}"
                    );
                }
            }
        }
    }
    case(Q4K, 512);
    case(Q5K, 512);
    case(Q6K, 512);
    for k in [352, 512] {
        case(Q5_0, k);
        case(Q8_0, k);
        case(Q4_0, k);
        case(Q4_1, k);
        case(Q5_1, k);
    }
}

/// The AVX2 kernels' two orders, half by half over a group's rows (AVX2-only builds) and
/// whole row by row (builds with AVX-512's registers), give the same bits for every format,
/// with and without short last blocks, at 1 to 19 activation rows: a build runs only one of
/// them, so this is where the other is tested. Where the CPU has `vpdpbusd` (AVX-VNNI's VEX
/// form, AVX-512's EVEX form), its products give those bits too, in both orders.
#[test]
#[cfg(target_arch = "x86_64")]
fn the_avx2_orders_and_vnni_give_the_same_bits() {
    use avx2::{EvexDpbusd, Maddubs, Products, VexDpbusd};
    if !Kernels::Avx2.runs_here() {
        eprintln!("no AVX2 on this CPU: orders not tested");
        return;
    }
    let (vex, evex) = (Kernels::AvxVnni.runs_here(), Kernels::Avx512.runs_here());
    if !vex {
        eprintln!("no AVX-VNNI on this CPU: its products not tested");
    }
    if !evex {
        eprintln!("no AVX-512 VNNI on this CPU: its 32-byte products not tested");
    }
    /// The bits of `packed` (an AVX2 packing) times `lhs`, in one order and with `P`.
    fn bits<P: Products, const HALF_BY_HALF: bool>(
        packed: &Packed,
        mkn: (usize, usize, usize),
        lhs: &[f32],
    ) -> Vec<u32> {
        let mut dst = vec![0f32; mkn.0 * mkn.2];
        macro_rules! run {
            ($($variant:ident),*) => {
                match &packed.blocks {
                    $(Blocks::$variant(b) => avx2::matmul_in_order::<_, _, HALF_BY_HALF, P>(
                        &b.blocks, &b.tails, mkn, lhs, &mut dst,
                    ),)*
                    _ => unreachable!("not an AVX2 packing"),
                }
            };
        }
        // SAFETY: the caller checked that the CPU runs AVX2 and `P`'s products; the kernels
        // check the lengths.
        unsafe { run!(Q4K, Q5K, Q6K, Q5_0, Q8_0, Q4_0, Q4_1, Q5_1) };
        dst.iter().map(|v| v.to_bits()).collect()
    }
    /// [`bits`] half by half, then row by row.
    fn orders<P: Products>(
        packed: &Packed,
        mkn: (usize, usize, usize),
        lhs: &[f32],
    ) -> [Vec<u32>; 2] {
        [
            bits::<P, true>(packed, mkn, lhs),
            bits::<P, false>(packed, mkn, lhs),
        ]
    }
    let same = |(dtype, packed): (GgmlDType, Packed), k: usize| {
        let (packed, n, m) = (&packed, 21, 19);
        let lhs = random(m * k, 13);
        for rows in 1..=m {
            let (mkn, lhs) = ((rows, k, n), &lhs[..rows * k]);
            let what = format!("{dtype:?} k = {k}, {rows} rows");
            let [a, row_by_row] = orders::<Maddubs>(packed, mkn, lhs);
            assert!(a == row_by_row, "{what}: the orders differ");
            assert!(a.iter().any(|&v| v != 0), "{what}: all zero");
            let same_as_a = |products: &str, [half, row]: [Vec<u32>; 2]| {
                assert!(half == a, "{what}: {products} half by half differs");
                assert!(row == a, "{what}: {products} row by row differs");
            };
            if vex {
                same_as_a("VEX", orders::<VexDpbusd>(packed, mkn, lhs));
            }
            if evex {
                same_as_a("EVEX", orders::<EvexDpbusd>(packed, mkn, lhs));
            }
        }
    };
    /// 21 weight rows of `k` values of format `T`, in AVX2's layout.
    fn packed<T: GgmlType>(pack: Pack<T>, k: usize) -> (GgmlDType, Packed) {
        let w: Vec<T> = blocks(21 * k / T::BLCK_SIZE, 12);
        (T::DTYPE, Packed::new(pack(&w), k, Kernels::Avx2))
    }
    same(packed(Q4K, 1536), 1536);
    same(packed(Q5K, 1536), 1536);
    same(packed(Q6K, 1536), 1536);
    for k in [896, 2080] {
        same(packed(Q5_0, k), k);
        same(packed(Q8_0, k), k);
        same(packed(Q4_0, k), k);
        same(packed(Q4_1, k), k);
        same(packed(Q5_1, k), k);
    }
}

/// Vectors of mixed magnitudes (2^-30..2^30, so that the order of additions shows) and
/// signs, with zeros, infinities and NaNs in some lanes.
fn accumulators<const L: usize>(count: usize, seed: u64) -> Vec<[f32; L]> {
    let x = random(count * L, 40 + seed);
    (0..count)
        .map(|r| {
            std::array::from_fn(|l| {
                let i = L * r + l;
                let e = ((x[(i * 7 + 3) % x.len()] * 30.0) as i32).clamp(-30, 30);
                match (seed % 20, i % 53) {
                    (1, 0) => f32::INFINITY,
                    (2, 5) => f32::NEG_INFINITY,
                    (3, 9) => f32::NAN,
                    (4, _) if i.is_multiple_of(3) => 0.0,
                    _ => x[i] * 2f32.powi(e),
                }
            })
        })
        .collect()
}

/// The same bits, NaN for NaN.
fn same_sums(all: &[f32], each: &[f32], what: &str) -> usize {
    for (r, (a, e)) in all.iter().zip(each).enumerate() {
        let same = a.to_bits() == e.to_bits() || (a.is_nan() && e.is_nan());
        assert!(same, "{what}, vector {r}: {a} against {e}");
    }
    all.iter().filter(|a| a.is_finite()).count()
}

/// Adding a group's accumulators' lanes all at once gives each the bits of adding its lanes
/// alone (the kernels take one or the other by the number of rows, and a k-token verify must
/// equal k one-token forwards): AVX-512's sixteen against [`avx512::add_one`], AVX2's eight
/// against [`avx2::add_one`].
#[test]
#[cfg(target_arch = "x86_64")]
fn adding_accumulators_at_once_matches_one_by_one() {
    use std::arch::x86_64::*;
    let mut cases = 0;
    for seed in 0..200u64 {
        if Kernels::Avx512.runs_here() {
            let v = accumulators::<16>(16, seed);
            // SAFETY: the CPU runs AVX-512 (checked); the arrays are 64 bytes each.
            let (all, each) = unsafe {
                let vs: [__m512; 16] = std::array::from_fn(|r| _mm512_loadu_ps(v[r].as_ptr()));
                let all: [f32; 16] = std::mem::transmute(avx512::add_lanes(&vs));
                (all, vs.map(|v| avx512::add_one(v)))
            };
            cases += same_sums(&all, &each, &format!("avx512, seed {seed}"));
        }
        if Kernels::Avx2.runs_here() {
            let v = accumulators::<8>(8, seed);
            // SAFETY: the CPU runs AVX2 (checked); the arrays are 32 bytes each.
            let all: [f32; 8] = unsafe {
                let vs: [__m256; 8] = std::array::from_fn(|r| _mm256_loadu_ps(v[r].as_ptr()));
                std::mem::transmute(avx2::add_lanes(&vs))
            };
            // SAFETY: as above.
            let each: Vec<f32> = v
                .iter()
                .map(|v| avx2::add_one(unsafe { _mm256_loadu_ps(v.as_ptr()) }))
                .collect();
            cases += same_sums(&all, &each, &format!("avx2, seed {seed}"));
        }
    }
    if families().is_empty() {
        return;
    }
    assert!(cases > 1000);
}

/// Every output of a matmul gets the value of its own (activation row, weight row), in tiles
/// that start at whole tiles of rows, whatever the passes: several passes of one tile or more,
/// rows longer than a pass, one pass, no rows.
#[test]
fn every_output_is_written_whatever_the_passes() {
    for (m, n, row_bytes) in [
        (0, 5, 100),
        (1, 1, 1),
        (37, 21, PASS_BYTES * 3),
        (70, 33, PASS_BYTES / 20),
        (150, 17, PASS_BYTES / 40),
        (50, 40, 100),
    ] {
        let mut dst = vec![f32::NAN; m * n];
        for_each_output((m, n), row_bytes, &mut dst, |js, r0, rows, out| {
            assert!(r0 % MAX_ROWS == 0 && (1..=MAX_ROWS).contains(&rows) && js.len() <= CHUNK);
            for (col, j) in out.iter_mut().zip(js) {
                for (r, o) in col[..rows].iter_mut().enumerate() {
                    *o = ((r0 + r) * 1000 + j) as f32;
                }
            }
        });
        for (i, v) in dst.iter().enumerate() {
            let want = (i / n * 1000 + i % n) as f32;
            assert_eq!(*v, want, "m {m}, n {n}, row_bytes {row_bytes}, output {i}");
        }
    }
    // The cases above span several passes of one tile and of two.
    assert_eq!(pass_rows(PASS_BYTES * 3), MAX_ROWS);
    assert_eq!(pass_rows(PASS_BYTES / 20), MAX_ROWS);
    assert_eq!(pass_rows(PASS_BYTES / 40), 2 * MAX_ROWS);
}

/// A pass beyond what the output holds panics before anything is written.
#[test]
#[should_panic(expected = "a pass to row 37 of 117 columns in an output of 4200 values")]
fn each_tile_checks_its_output_bound() {
    let n = 7 * CHUNK + 5;
    let mut dst = vec![0f32; 4200];
    let out = &Dst(dst.as_mut_ptr(), dst.len());
    let f = |_: Range<usize>, _: usize, _: usize, _: &mut Tile| {};
    // SAFETY: this is the only task.
    unsafe { each_tile(3..37, n, 0..8, out, &f) };
}

/// A task's chunks of weight rows (several, as candle's pool hands them out) meet every tile
/// of the pass: every output of the task's columns is written, and no other.
#[test]
fn each_tile_writes_its_columns_and_no_other() {
    let (m, n) = (40, 7 * CHUNK + 5);
    let pass = 3..37;
    for chunks in [0..8, 1..6, 7..8, 3..3] {
        let mut dst = vec![f32::NAN; m * n];
        let f = |js: Range<usize>, r0: usize, rows: usize, out: &mut Tile| {
            assert!((1..=MAX_ROWS).contains(&rows) && js.len() <= CHUNK);
            for (col, j) in out.iter_mut().zip(js) {
                for (r, o) in col[..rows].iter_mut().enumerate() {
                    *o = ((r0 + r) * 1000 + j) as f32;
                }
            }
        };
        let out = &Dst(dst.as_mut_ptr(), dst.len());
        // SAFETY: this is the only task.
        unsafe { each_tile(pass.clone(), n, chunks.clone(), out, &f) };
        let columns = chunks.start * CHUNK..n.min(chunks.end * CHUNK);
        for (i, v) in dst.iter().enumerate() {
            let (r, j) = (i / n, i % n);
            match pass.contains(&r) && columns.contains(&j) {
                true => assert_eq!(*v, (r * 1000 + j) as f32, "{chunks:?}"),
                false => assert!(v.is_nan(), "{chunks:?}: wrote {r}, {j}"),
            }
        }
    }
}
