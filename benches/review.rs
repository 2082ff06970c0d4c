//! The verifier step and the sampling transform over a real vocabulary size (151,936, Qwen2.5).
//!
//! `cargo bench --bench review`

use cascade::model::Logits;
use cascade::review::review;
use cascade::sampling::{Dist, Sampling};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
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

fn sampling(c: &mut Criterion) {
    let row = logits(1);
    let mut group = c.benchmark_group("distribution");
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
        // A point-mass draft of each row's argmax: every token is reviewed (the worst case).
        let draft: Vec<u32> = (0..k)
            .map(|i| cascade::sampling::argmax(l.row(i)))
            .collect();
        let q: Vec<Dist> = draft.iter().map(|&t| Dist::Point(t)).collect();
        let mut rng = cascade::sampling::Rng::seed_from_u64(0);
        group.bench_with_input(BenchmarkId::new("t0.7_topp0.9", k), &k, |b, _| {
            b.iter(|| black_box(review(&draft, &q, &l, &s, 1.0, &mut rng, None)))
        });
    }
    group.finish();
}

criterion_group!(benches, sampling, verify);
criterion_main!(benches);
