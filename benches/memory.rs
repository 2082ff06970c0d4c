//! Memory of long runs: the resident set after generating 256 and 4,096 tokens, beside the KV
//! cache's growth between them computed from the model's dimensions. A leak per round would
//! show as growth well beyond the cache's.
//!
//! `cargo bench --bench memory` runs SmolLM2-135M (the quickest real model; its 8,192-token
//! context holds the run) with Max-Gram drafting, greedy, end-of-sequence ignored.
//! `CASCADE_MEMORY_MODEL` names another GGUF file in `models/`.

use cascade::drafter::{MaxGramDrafter, MaxGramPolicy};
use cascade::engine::{Engine, GenerateOptions};
use cascade::model::LoadedModel;
use std::path::PathBuf;

/// Resident set size in bytes, from /proc/self/statm.
fn rss() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: f64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096.0
}

fn main() {
    let file = std::env::var("CASCADE_MEMORY_MODEL")
        .unwrap_or_else(|_| "smollm2-135m-instruct-q4_1.gguf".into());
    let path = std::env::var_os("CASCADE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"))
        .join(&file);
    let model = LoadedModel::load(&path, None, &mut |_, _| {}).expect("scripts/fetch-models.sh");
    let c = model.weights.config.clone();
    let drafter = MaxGramDrafter::new("mag", MaxGramPolicy::default(), None);
    let mut engine = Engine::new(
        Box::new(model.instance("target", None)),
        Some(Box::new(drafter)),
        model.tokenizer.clone(),
    );
    let prompt = model
        .tokenizer
        .encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
        .unwrap();
    let mut rows = Vec::new();
    for n in [256, 4096] {
        let opts = GenerateOptions {
            max_new_tokens: n,
            ignore_eos: true,
            k: 8,
            ..GenerateOptions::default()
        };
        let out = engine.generate(&prompt, &opts, &mut |_| {}).unwrap();
        assert_eq!(out.stats.generated_tokens, n);
        rows.push((n, rss(), out.stats.target_calls));
    }
    let per_token = (c.layers * 2 * c.kv_heads * c.head_dim * 4) as f64;
    let kv_growth = per_token * (rows[1].0 - rows[0].0) as f64;
    let rss_growth = rows[1].1 - rows[0].1;
    let mib = |b: f64| b / (1 << 20) as f64;
    println!(
        "{file}: {} layers x {} KV heads x {} dims: KV cache {:.1} KiB per token",
        c.layers,
        c.kv_heads,
        c.head_dim,
        per_token / 1024.0
    );
    for (n, rss, calls) in &rows {
        println!(
            "after {n:>5} tokens ({calls} target calls): resident set {:.1} MiB",
            mib(*rss)
        );
    }
    println!(
        "growth 256 -> 4096: resident set {:.1} MiB, KV cache {:.1} MiB computed ({:+.1}%)",
        mib(rss_growth),
        mib(kv_growth),
        100.0 * (rss_growth / kv_growth - 1.0)
    );
}
