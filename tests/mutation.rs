//! No corrupted input crashes the loaders: a real GGUF file (SmolLM2-135M), the committed
//! bigram table and the example configs are mutated in thousands of seeded, deterministic
//! ways (truncation at every region boundary, bit flips, huge and zero lengths and counts,
//! wrong types, zeroed runs, out-of-range numbers in TOML). Every case must end in a normal
//! load or a clean `Error` with a message: never a panic, an abort, or an allocation beyond a
//! stated bound, which a counting global allocator measures.

mod common;

use cascade::config::RawConfig;
use cascade::model::gguf::{GgufFile, Layout};
use cascade::model::{Kernels, LoadedModel};
use cascade::ngram::BigramTable;
use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Counts live heap bytes and their peak, so a case's extra memory can be bounded.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        let now = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(now, Relaxed);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        let now = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(now, Relaxed);
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new: usize) -> *mut u8 {
        if new >= layout.size() {
            let now = LIVE.fetch_add(new - layout.size(), Relaxed) + new - layout.size();
            PEAK.fetch_max(now, Relaxed);
        } else {
            LIVE.fetch_sub(layout.size() - new, Relaxed);
        }
        System.realloc(ptr, layout, new)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The tests of this file measure memory one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// What one mutated input did.
#[derive(Default, Debug)]
struct Tally {
    loaded: usize,
    rejected: usize,
}

/// Runs `case`, which must return Ok or an error with a message, without panicking and
/// without allocating more than `bound` bytes above what was live before it.
fn check<T, E: std::fmt::Display>(
    what: &str,
    bound: usize,
    tally: &mut Tally,
    case: impl FnOnce() -> Result<T, E>,
) {
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let outcome = catch_unwind(AssertUnwindSafe(case));
    let extra = PEAK.load(Relaxed).saturating_sub(before);
    match outcome {
        Err(_) => panic!("{what}: the loader panicked"),
        Ok(Ok(_)) => tally.loaded += 1,
        Ok(Err(e)) => {
            assert!(!e.to_string().trim().is_empty(), "{what}: empty message");
            tally.rejected += 1;
        }
    }
    assert!(
        extra <= bound,
        "{what}: allocated {extra} bytes, more than the bound of {bound}"
    );
}

/// Offsets of the fields of a GGUF header, found by walking it.
#[derive(Default)]
struct Fields {
    /// u64 lengths and counts (strings, arrays, the two header counts).
    counts: Vec<usize>,
    /// u32 value types, array item types, tensor types and dimension counts.
    types: Vec<usize>,
    /// u64 tensor dimensions and data offsets.
    tensor_u64s: Vec<usize>,
}

fn walk(b: &[u8]) -> Fields {
    let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let mut f = Fields {
        counts: vec![8, 16],
        ..Default::default()
    };
    let (tensors, kvs) = (u64_at(8), u64_at(16));
    let mut at = 24;
    fn value(b: &[u8], at: &mut usize, kind: u32, f: &mut Fields) {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
        match kind {
            0 | 1 | 7 => *at += 1,
            2 | 3 => *at += 2,
            4..=6 => *at += 4,
            10..=12 => *at += 8,
            8 => {
                f.counts.push(*at);
                *at += 8 + u64_at(*at);
            }
            9 => {
                let item = u32_at(*at);
                f.types.push(*at);
                f.counts.push(*at + 4);
                let n = u64_at(*at + 4);
                *at += 12;
                for _ in 0..n {
                    value(b, at, item, f);
                }
            }
            _ => unreachable!("the original file is valid"),
        }
    }
    for _ in 0..kvs {
        value(b, &mut at, 8, &mut f);
        f.types.push(at);
        let kind = u32_at(at);
        at += 4;
        value(b, &mut at, kind, &mut f);
    }
    for _ in 0..tensors {
        value(b, &mut at, 8, &mut f);
        f.types.push(at);
        let dims = u32_at(at) as usize;
        at += 4;
        f.tensor_u64s.extend((0..dims).map(|d| at + 8 * d));
        at += 8 * dims;
        f.types.push(at);
        f.tensor_u64s.push(at + 4);
        at += 12;
    }
    f
}

/// One deterministic corruption of a byte buffer.
enum Mutation {
    Truncate(usize),
    Write(usize, Vec<u8>),
}

impl Mutation {
    fn describe(&self) -> String {
        match self {
            Mutation::Truncate(n) => format!("truncated to {n} bytes"),
            Mutation::Write(at, bytes) => format!("{bytes:02x?} written at byte {at}"),
        }
    }
}

/// Applies `m` to `data` in place, runs `f` on the result, and restores `data`.
fn with_mutation<R>(data: &mut [u8], m: &Mutation, f: impl FnOnce(&[u8]) -> R) -> R {
    match m {
        Mutation::Truncate(n) => f(&data[..*n]),
        Mutation::Write(at, bytes) => {
            let end = (*at + bytes.len()).min(data.len());
            let saved = data[*at..end].to_vec();
            data[*at..end].copy_from_slice(&bytes[..end - at]);
            let r = f(data);
            data[*at..end].copy_from_slice(&saved);
            r
        }
    }
}

fn gguf_mutations(data: &[u8], layout: &Layout, rng: &mut ChaCha8Rng) -> Vec<Mutation> {
    let fields = walk(data);
    let header = layout.tensor_infos_end as usize;
    let size = data.len();
    let mut m = Vec::new();
    // Truncation at and around every region boundary, and at random points of the header.
    let boundaries = [
        0,
        4,
        8,
        layout.header_end as usize,
        layout.metadata_end as usize,
        layout.tensor_infos_end as usize,
        layout.data_start as usize,
        size,
    ];
    for b in boundaries {
        for n in [b.saturating_sub(1), b, b + 1] {
            if n < size {
                m.push(Mutation::Truncate(n));
            }
        }
    }
    m.extend((0..100).map(|_| Mutation::Truncate(rng.random_range(0..header))));
    m.extend((0..10).map(|_| Mutation::Truncate(rng.random_range(header..size))));
    // Huge, zero and off-by-one lengths and counts; a sample of the many string lengths.
    let huge = |rng: &mut ChaCha8Rng, at: usize| -> Vec<u8> {
        let old = u64::from_le_bytes(data[at..at + 8].try_into().unwrap());
        let v = match rng.random_range(0..7) {
            0 => u64::MAX,
            1 => 1 << 62,
            2 => 1 << 40,
            3 => size as u64,
            4 => 0,
            5 => old.wrapping_add(1),
            _ => old.wrapping_sub(1),
        };
        v.to_le_bytes().to_vec()
    };
    let sample = |fields: &[usize], n: usize, rng: &mut ChaCha8Rng| -> Vec<usize> {
        (0..n.min(fields.len() * 3))
            .map(|_| fields[rng.random_range(0..fields.len())])
            .collect()
    };
    for at in sample(&fields.counts, 600, rng) {
        m.push(Mutation::Write(at, huge(rng, at)));
    }
    for at in sample(&fields.tensor_u64s, 400, rng) {
        m.push(Mutation::Write(at, huge(rng, at)));
    }
    for at in sample(&fields.types, 400, rng) {
        let v: u32 = match rng.random_range(0..3) {
            0 => rng.random_range(0..16),
            1 => rng.random_range(16..64),
            _ => u32::MAX,
        };
        m.push(Mutation::Write(at, v.to_le_bytes().to_vec()));
    }
    // Bit flips: half in the first 64 KiB (counts, metadata keys, small values), half over
    // the whole header (vocabulary, tensor infos).
    for i in 0..1000 {
        let at = rng.random_range(
            0..if i % 2 == 0 {
                header.min(1 << 16)
            } else {
                header
            },
        );
        m.push(Mutation::Write(
            at,
            vec![data[at] ^ (1 << rng.random_range(0..8))],
        ));
    }
    // Zeroed runs.
    for _ in 0..200 {
        let at = rng.random_range(0..header);
        m.push(Mutation::Write(at, vec![0; rng.random_range(1..64)]));
    }
    m
}

#[test]
fn a_corrupted_gguf_file_is_a_clean_error_or_a_normal_load() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let path = common::models_dir().join(common::SMOLLM2);
    let mut data = std::fs::read(&path).expect("scripts/fetch-models.sh fetches SmolLM2");
    let layout = GgufFile::from_reader(&path, Cursor::new(&data[..]))
        .unwrap()
        .layout;
    let kernels = Kernels::detect().unwrap();
    let load = |bytes: &[u8]| -> cascade::Result<LoadedModel> {
        let file = GgufFile::from_reader(&path, Cursor::new(bytes))?;
        LoadedModel::from_gguf(file, None, kernels, &mut |_, _| {})
    };
    // The bound: three times the file (the packed weights are about its size).
    let bound = 3 * data.len();
    let mut tally = Tally::default();
    check("the unmutated file", bound, &mut tally, || load(&data));
    assert_eq!(tally.loaded, 1, "the original file must load");

    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let mutations = gguf_mutations(&data, &layout, &mut rng);
    for m in &mutations {
        let what = m.describe();
        with_mutation(&mut data, m, |bytes| {
            check(&what, bound, &mut tally, || load(bytes))
        });
    }
    eprintln!("{} GGUF mutations: {tally:?}", mutations.len());
    assert!(mutations.len() >= 2500);
    // Most corruptions must be caught, not silently loaded.
    assert!(tally.rejected * 2 > mutations.len(), "{tally:?}");
}

#[test]
fn a_corrupted_bigram_table_is_a_clean_error() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("ngram/qwen2.5-coder-cpython311.bigram");
    let mut data = std::fs::read(&path).unwrap();
    let bound = 3 * data.len();
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    let size = data.len();
    let mut tally = Tally::default();
    for n in [0, 7, 8, 12, 20, 24, 28, 32, 35, 36, size - 4, size - 1] {
        with_mutation(&mut data, &Mutation::Truncate(n), |b| {
            check(&format!("truncated to {n}"), bound, &mut tally, || {
                BigramTable::from_bytes(b, &path)
            })
        });
    }
    assert_eq!(tally.loaded, 0);
    // Corruptions with the checksum fixed up, so validation behind it is exercised too.
    for i in 0..1500 {
        let at = match i % 3 {
            0 => rng.random_range(8..28),
            _ => rng.random_range(0..size - 4),
        };
        let bytes = match i % 5 {
            0 => vec![0xff; 4],
            1 => vec![0; rng.random_range(1..16)],
            _ => vec![data[at] ^ (1 << rng.random_range(0..8))],
        };
        let m = Mutation::Write(at, bytes);
        let fix_crc = i % 2 == 0;
        with_mutation(&mut data, &m, |b| {
            let mut b = b.to_vec();
            if fix_crc {
                let sum = crc32fast::hash(&b[..size - 4]);
                b[size - 4..].copy_from_slice(&sum.to_le_bytes());
            }
            check(&m.describe(), bound, &mut tally, || {
                BigramTable::from_bytes(&b, &path)
            })
        });
    }
    eprintln!("bigram table mutations: {tally:?}");
    assert!(tally.rejected > 1000, "{tally:?}");
}

#[test]
fn a_corrupted_config_is_a_clean_error() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let mut tally = Tally::default();
    let bound = 64 << 20;
    let replacements = [
        "0",
        "-1",
        "18446744073709551615",
        "99999999999999999999",
        "4294967296",
        "1e309",
        "nan",
        "inf",
        "-inf",
        "0.5",
        "\"x\"",
        "[]",
        "{}",
        "\"\"",
        "\"no-such-drafter\"",
    ];
    let mut cases = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let origin = path.display().to_string();
        let mut run = |text: &str, what: String| {
            cases += 1;
            check(&what, bound, &mut tally, || {
                RawConfig::parse(text, &origin)?.validate(&dir)
            })
        };
        run(&text, format!("{origin} as committed"));
        // Truncation at every line end and at random bytes.
        for (i, _) in text.match_indices('\n') {
            run(&text[..i], format!("{origin} cut at byte {i}"));
        }
        // Every value of every `key = value` line replaced by each odd value.
        for (l, line) in text.lines().enumerate() {
            let Some((key, _)) = line.split_once(" = ") else {
                continue;
            };
            for r in replacements {
                let edited: Vec<String> = text
                    .lines()
                    .enumerate()
                    .map(|(i, x)| {
                        if i == l {
                            format!("{key} = {r}")
                        } else {
                            x.to_string()
                        }
                    })
                    .collect();
                run(
                    &edited.join("\n"),
                    format!("{origin} line {l}: {key} = {r}"),
                );
            }
        }
        // Random byte flips and deletions.
        for _ in 0..100 {
            let mut b = text.clone().into_bytes();
            let at = rng.random_range(0..b.len());
            if rng.random_bool(0.5) {
                b[at] ^= 1 << rng.random_range(0..7);
            } else {
                b.remove(at);
            }
            if let Ok(t) = String::from_utf8(b) {
                run(&t, format!("{origin} byte {at} changed"));
            }
        }
    }
    eprintln!("{cases} config mutations: {tally:?}");
    assert!(cases > 1000, "{cases}");
    assert!(tally.rejected * 2 > cases, "{tally:?}");
}
