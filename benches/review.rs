//! The verifier step and the sampling transform over a real vocabulary size (151,936, Qwen2.5).
//!
//! `cargo bench --bench review`

use cascade::model::Logits;
use cascade::review::review;
use cascade::sampling::{Dist, Sampling};
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use rand::SeedableRng;
use std::hint::black_box;

const VOCAB: usize = 151_936;

fn logits(rows: usize) -> Logits {
    let mut s = 0x9e3779b97f4a7c15u64;
    let data = (0..rows * VOCAB)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 10_000) as f32 / 1000.0
        })
        .collect();
    Logits::new(data, VOCAB)
}

/// A row shaped like a language model's: a few likely tokens and a long tail (token `i` of
/// the ranking at `-1.3 ln(i + 1)`, the ranking shuffled over the ids).
fn long_tail() -> Vec<f32> {
    (0..VOCAB)
        .map(|i| -1.3 * (((i * 7919) % VOCAB + 1) as f32).ln())
        .collect()
}

fn sampling(c: &mut Criterion) {
    let row = logits(1);
    let tail = long_tail();
    let mut group = c.benchmark_group("distribution");
    let t1_topp = Sampling {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.95,
    };
    group.bench_function("t1_topp0.95_long_tail", |b| {
        b.iter(|| black_box(t1_topp.distribution(&tail)))
    });
    for (label, s) in [
        ("greedy", Sampling::greedy()),
        (
            "t0.7",
            Sampling {
                temperature: 0.7,
                top_k: 0,
                top_p: 1.0,
            },
        ),
        (
            "t0.7_topk40",
            Sampling {
                temperature: 0.7,
                top_k: 40,
                top_p: 1.0,
            },
        ),
        (
            "t0.7_topp0.9",
            Sampling {
                temperature: 0.7,
                top_k: 0,
                top_p: 0.9,
            },
        ),
    ] {
        group.bench_function(label, |b| b.iter(|| black_box(s.distribution(row.row(0)))));
    }
    group.finish();
}

fn verify(c: &mut Criterion) {
    let mut group = c.benchmark_group("review");
    let s = Sampling {
        temperature: 0.7,
        top_k: 0,
        top_p: 0.9,
    };
    for k in [1usize, 4, 8] {
        let l = logits(k + 1);
        // Each row's argmax, proposed from the target's own distribution: every token is
        // kept, so every position and the bonus token are reviewed (the most work).
        let draft: Vec<u32> = (0..k)
            .map(|i| cascade::sampling::argmax(l.row(i)))
            .collect();
        let q: Vec<Dist> = (0..k).map(|i| s.distribution(l.row(i))).collect();
        let mut rng = cascade::sampling::Rng::seed_from_u64(0);
        // Fresh logits each time (they keep the distributions a review computes), made and
        // dropped outside the timing.
        group.bench_with_input(BenchmarkId::new("t0.7_topp0.9", k), &k, |b, _| {
            b.iter_batched_ref(
                || Logits::new(l.values().to_vec(), VOCAB),
                |l| black_box(review(&draft, &q, l, &s, 1.0, &mut rng, None)),
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, sampling, verify);
criterion_main!(benches);
