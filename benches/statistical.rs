//! Statistical drafters: Max-Gram proposal time at growing context lengths (it must stay
//! flat), bigram lookups, and loading the shipped bigram table.
//!
//! `cargo bench --bench statistical`

use cascade::drafter::MaxGram;
use cascade::ngram::BigramTable;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;
use std::path::Path;

/// A token stream with the statistics of text: a skewed vocabulary and repeated phrases.
fn text_like(n: usize) -> Vec<u32> {
    let mut s = 0x2545f4914f6cdd1du64;
    let mut rand = move |m: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % m
    };
    let mut out: Vec<u32> = Vec::with_capacity(n);
    while out.len() < n {
        if out.len() > 64 && rand(4) == 0 {
            let start = rand(out.len() as u64 - 32) as usize;
            let len = 4 + rand(24) as usize;
            let copy: Vec<u32> = out[start..start + len].to_vec();
            out.extend(copy);
        } else {
            let r = rand(1000);
            out.push((r * r / 1000) as u32 + rand(30000) as u32 * (rand(8) == 0) as u32);
        }
    }
    out.truncate(n);
    out
}

fn max_gram(c: &mut Criterion) {
    let mut group = c.benchmark_group("max_gram_round");
    for n in [1_000, 8_000, 32_000] {
        let tokens = text_like(n + 64);
        let mut index = MaxGram::new(16);
        index.start(&tokens[..n / 2]);
        tokens[n / 2..n].iter().for_each(|&t| index.push(t));
        // One round: commit a token, propose 8, roll the commit back (so the context stays n).
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            let mut i = 0;
            b.iter(|| {
                index.push(tokens[n + i % 64]);
                let p = index.propose(8);
                index.truncate(n);
                i += 1;
                black_box(p)
            })
        });
    }
    group.finish();
}

fn bigram(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("ngram/qwen2.5-coder-cpython311.bigram");
    c.bench_function("bigram_table_load", |b| {
        b.iter(|| black_box(BigramTable::load(&path).unwrap()))
    });
    let table = BigramTable::load(&path).unwrap();
    c.bench_function("bigram_lookup_x1000", |b| {
        b.iter(|| {
            let mut t = 13u32;
            for _ in 0..1000 {
                t = table.most_likely(t).unwrap_or(t + 1) % table.vocab_size() as u32;
            }
            black_box(t)
        })
    });
}

criterion_group!(benches, max_gram, bigram);
criterion_main!(benches);
