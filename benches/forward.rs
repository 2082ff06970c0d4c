//! Forward-pass speed of the project's model code, per kernel family, beside candle-transformers'
//! `quantized_qwen2`, in one run on the same GGUF files.
//!
//! Prints, for the 1.5B target and the 0.5B draft: decode ms/token, r(k) = time of a forward
//! over k new tokens / time of one token for k = 2, 4, 8, 16, and a 512-token prefill in ms per
//! token; then c, the draft's decode cost relative to the target's.
//!
//! `cargo bench --bench forward` (models from `scripts/fetch-models.sh`) runs the kernel family
//! `CASCADE_KERNELS` names, or the best this CPU runs. Environment:
//! - `CASCADE_BENCH_KERNELS=all` (or a list such as `avx2,portable`): every family named, the
//!   timings interleaved so that they share the machine's noise;
//! - `CASCADE_BENCH_REPS`: repetitions (default 5; the median is reported);
//! - `CASCADE_BENCH_OWN=1`: skips candle-transformers (quicker, for kernel work);
//! - `CASCADE_BENCH_PREFILL=0`: skips the prefill;
//! - `CASCADE_BENCH_CONTEXT`: the context the forwards run after (default 64; attention over
//!   a long context is a large part of a forward);
//! - `CASCADE_BENCH_MODELS`: other GGUF files to time instead of the two, separated by commas
//!   (such as the Q5_K requantization the tests make in `target/tmp`).

use candle_core::{Device, Tensor};
use cascade::model::{Kernels, LoadedModel, Model, Transformer};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The context the forwards run after: `CASCADE_BENCH_CONTEXT`, else 64 tokens.
fn context() -> usize {
    std::env::var("CASCADE_BENCH_CONTEXT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}
const KS: [usize; 5] = [1, 2, 4, 8, 16];
const PREFILL: usize = 512;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + (i * 37) % 5000).collect()
}

/// Seconds for a forward over k new tokens after the context, own model.
fn own(model: &mut dyn Model, k: usize) -> f64 {
    model.truncate(context());
    let t = Instant::now();
    model.forward(&tokens(k)).unwrap();
    let s = t.elapsed().as_secs_f64();
    model.truncate(context());
    s
}

/// Seconds for a PREFILL-token prompt, own model.
fn prefill(model: &mut dyn Model) -> f64 {
    model.truncate(0);
    let t = Instant::now();
    model.prefill(&tokens(PREFILL)).unwrap();
    let s = t.elapsed().as_secs_f64();
    model.truncate(0);
    model.prefill(&tokens(context())).unwrap();
    s
}

/// The same with candle-transformers' quantized_qwen2 (no rollback: rebuild the cache each time).
fn reference(path: &Path, k: usize, reps: usize) -> f64 {
    use candle_transformers::models::quantized_qwen2::ModelWeights;
    let mut f = std::fs::File::open(path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut m = ModelWeights::from_gguf(content, &mut f, &Device::Cpu).unwrap();
    let prefix = Tensor::new(tokens(context()).as_slice(), &Device::Cpu)
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
        m.forward(&feed, context())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        if i > 0 {
            times.push(t.elapsed().as_secs_f64()); // the first run is a warm-up
        }
    }
    median(times)
}

/// The families to run: `CASCADE_BENCH_KERNELS` (`all` or a list), else the detected one.
fn families() -> Vec<Kernels> {
    match std::env::var("CASCADE_BENCH_KERNELS").ok().as_deref() {
        None | Some("") => vec![Kernels::detect().unwrap()],
        Some("all") => Kernels::supported(),
        Some(list) => list
            .split(',')
            .map(|name| Kernels::from_setting(Some(name)).unwrap())
            .collect(),
    }
}

struct Timings {
    /// Per k in KS: the forward times.
    forward: Vec<Vec<f64>>,
    prefill: Vec<f64>,
}

fn main() {
    let reps: usize = std::env::var("CASCADE_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let with_prefill = std::env::var("CASCADE_BENCH_PREFILL").as_deref() != Ok("0");
    let families = families();
    let root = std::env::var_os("CASCADE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    let custom = std::env::var("CASCADE_BENCH_MODELS");
    let models: Vec<(String, PathBuf)> = match &custom {
        Ok(list) => list
            .split(',')
            .map(|p| {
                let path = PathBuf::from(p.trim());
                let name = path.file_stem().unwrap_or_default().to_string_lossy();
                (name.into_owned(), path)
            })
            .collect(),
        Err(_) => vec![
            (
                "1.5B target".into(),
                root.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            ),
            (
                "0.5B draft".into(),
                root.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            ),
        ],
    };
    println!("CPU: {}", cascade::costs::cpu_name());
    println!(
        "forward over k new tokens after a {}-token context; median of {reps}; {} threads; \
         prefill of {PREFILL} tokens",
        context(),
        candle_core::utils::get_num_threads()
    );
    println!("| model | code | decode ms/token | r(2) | r(4) | r(8) | r(16) | prefill ms/token |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut decode: Vec<Vec<(String, f64)>> = Vec::new();
    for (label, path) in &models {
        if !path.is_file() {
            let hint = match custom {
                Ok(_) => "named in CASCADE_BENCH_MODELS",
                Err(_) => "run scripts/fetch-models.sh",
            };
            eprintln!("skipping {label}: {} missing ({hint})", path.display());
            continue;
        }
        let mut instances: Vec<(Kernels, Transformer)> = families
            .iter()
            .map(|&k| {
                let loaded = LoadedModel::load_with(path, None, k, &mut |_, _| {}).unwrap();
                let mut m = loaded.instance(label, None);
                m.prefill(&tokens(context())).unwrap();
                for &k in &KS {
                    own(&mut m, k); // warm-up
                }
                (k, m)
            })
            .collect();
        let mut times: Vec<Timings> = families
            .iter()
            .map(|_| Timings {
                forward: vec![Vec::new(); KS.len()],
                prefill: Vec::new(),
            })
            .collect();
        // Interleaved: every family and k in each repetition.
        for rep in 0..reps {
            for ((_, m), t) in instances.iter_mut().zip(&mut times) {
                for (i, &k) in KS.iter().enumerate() {
                    t.forward[i].push(own(m, k));
                }
                // Prefill is slow on the portable path: a third of the repetitions.
                if with_prefill && rep % 3 == 0 {
                    t.prefill.push(prefill(m));
                }
            }
        }
        let mut rows: Vec<(String, Vec<f64>, Option<f64>)> = instances
            .iter()
            .zip(&times)
            .map(|((k, _), t)| {
                let f = t.forward.iter().cloned().map(median).collect();
                let p = (!t.prefill.is_empty()).then(|| median(t.prefill.clone()));
                (format!("cascade, {k}"), f, p)
            })
            .collect();
        drop(instances);
        if std::env::var("CASCADE_BENCH_OWN").is_err() {
            let ref_t = KS.iter().map(|&k| reference(path, k, reps)).collect();
            rows.push(("candle-transformers".into(), ref_t, None));
        }
        for (code, t, p) in &rows {
            let p = p.map_or("-".into(), |p| format!("{:.1}", p * 1e3 / PREFILL as f64));
            println!(
                "| {label} | {code} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {p} |",
                t[0] * 1e3,
                t[1] / t[0],
                t[2] / t[0],
                t[3] / t[0],
                t[4] / t[0]
            );
        }
        decode.push(
            rows.iter()
                .map(|(code, t, _)| (code.clone(), t[0]))
                .collect(),
        );
    }
    if let ([target, draft], Err(_)) = (&decode[..], &custom) {
        let c: Vec<String> = target
            .iter()
            .zip(draft)
            .map(|((code, t), (_, d))| format!("{code} {:.2}", d / t))
            .collect();
        println!(
            "\ncost of the 0.5B draft relative to the 1.5B target (c): {}",
            c.join("; ")
        );
    }
}
