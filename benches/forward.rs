//! Forward-pass speed of the project's model code against candle-transformers'
//! `quantized_qwen2`, side by side in one run on the same GGUF files.
//!
//! Prints decode ms/token for the 1.5B target and the 0.5B draft, and r(k) = time of a
//! forward over k new tokens / time of one token, for k = 1, 2, 4, 8, 16.
//!
//! `cargo bench --bench forward` (models from `scripts/fetch-models.sh`);
//! `CASCADE_BENCH_REPS` sets the repetitions (default 5, the median is reported);
//! `CASCADE_BENCH_OWN=1` skips candle-transformers (quicker, for kernel work).

use candle_core::{Device, Tensor};
use cascade::model::{LoadedModel, Model};
use std::path::Path;
use std::time::Instant;

const CONTEXT: usize = 64;
const KS: [usize; 5] = [1, 2, 4, 8, 16];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + (i * 37) % 5000).collect()
}

/// Seconds for a forward over k new tokens after a CONTEXT-token prefix, own model.
fn own(model: &mut dyn Model, k: usize, reps: usize) -> f64 {
    model.truncate(0);
    model.prefill(&tokens(CONTEXT)).unwrap();
    let feed = tokens(k);
    model.forward(&feed).unwrap(); // warm-up
    model.truncate(CONTEXT);
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                model.forward(&feed).unwrap();
                let s = t.elapsed().as_secs_f64();
                model.truncate(CONTEXT);
                s
            })
            .collect(),
    )
}

/// The same with candle-transformers' quantized_qwen2 (no rollback: rebuild the cache each time).
fn reference(path: &Path, k: usize, reps: usize) -> f64 {
    use candle_transformers::models::quantized_qwen2::ModelWeights;
    let mut f = std::fs::File::open(path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut m = ModelWeights::from_gguf(content, &mut f, &Device::Cpu).unwrap();
    let prefix = Tensor::new(tokens(CONTEXT).as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let feed = Tensor::new(tokens(k).as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mut times = Vec::new();
    for i in 0..=reps {
        m.clear_kv_cache();
        m.forward(&prefix, 0).unwrap();
        let t = Instant::now();
        m.forward(&feed, CONTEXT).unwrap().to_vec2::<f32>().unwrap();
        if i > 0 {
            times.push(t.elapsed().as_secs_f64()); // the first run is a warm-up
        }
    }
    median(times)
}

fn rows_label(n: usize) -> &'static [&'static str] {
    &["cascade", "candle-transformers"][..n]
}

fn main() {
    let reps: usize = std::env::var("CASCADE_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let models = [
        (
            "1.5B target",
            root.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        ),
        (
            "0.5B draft",
            root.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        ),
    ];
    println!(
        "forward over k new tokens after a {CONTEXT}-token context; median of {reps}; {} threads",
        candle_core::utils::get_num_threads()
    );
    println!("| model | code | decode ms/token | r(2) | r(4) | r(8) | r(16) |");
    println!("|---|---|---|---|---|---|---|");
    let mut decode = Vec::new();
    for (label, path) in &models {
        if !path.is_file() {
            eprintln!(
                "skipping {label}: {} missing (run scripts/fetch-models.sh)",
                path.display()
            );
            continue;
        }
        let loaded = LoadedModel::load(path, None, &mut |_, _| {}).unwrap();
        let mut m = loaded.instance(label, None);
        let own_t: Vec<f64> = KS.iter().map(|&k| own(&mut m, k, reps)).collect();
        drop(m);
        drop(loaded);
        let mut rows = vec![("cascade", own_t.clone())];
        if std::env::var("CASCADE_BENCH_OWN").is_err() {
            let ref_t = KS.iter().map(|&k| reference(path, k, reps)).collect();
            rows.push(("candle-transformers", ref_t));
        }
        for (code, t) in &rows {
            println!(
                "| {label} | {code} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
                t[0] * 1e3,
                t[1] / t[0],
                t[2] / t[0],
                t[3] / t[0],
                t[4] / t[0]
            );
        }
        decode.push(rows.iter().map(|(_, t)| t[0]).collect::<Vec<_>>());
    }
    if let [target, draft] = &decode[..] {
        let c: Vec<String> = rows_label(target.len())
            .iter()
            .zip(draft.iter().zip(target))
            .map(|(code, (d, t))| format!("{code} {:.2}", d / t))
            .collect();
        println!(
            "\ncost of the 0.5B draft relative to the 1.5B target (c): {}",
            c.join(", ")
        );
    }
}
