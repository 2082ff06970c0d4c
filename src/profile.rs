//! Where a forward pass spends its time, by section, when `CASCADE_PROFILE=1`.
//!
//! Off by default (one relaxed load per section). `cascade generate` prints the table to
//! standard error at the end when it is on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The sections of a transformer forward.
#[derive(Clone, Copy)]
pub enum Section {
    Embed,
    Norm,
    Qkv,
    Rope,
    Attention,
    AttnOut,
    GateUp,
    Down,
    Output,
}

const NAMES: [&str; 9] = [
    "embed",
    "norm",
    "qkv",
    "rope",
    "attention",
    "attn_out",
    "gate_up",
    "down",
    "output",
];
static NANOS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];
static ENABLED: OnceLock<AtomicBool> = OnceLock::new();

fn enabled() -> bool {
    ENABLED
        .get_or_init(|| AtomicBool::new(std::env::var("CASCADE_PROFILE").is_ok_and(|v| v == "1")))
        .load(Ordering::Relaxed)
}

/// Runs `f`, adding its time to `section` when profiling is on.
#[inline]
pub fn time<T>(section: Section, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let start = Instant::now();
    let out = f();
    NANOS[section as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// The accumulated times as a table, or `None` when profiling is off.
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let total: u64 = NANOS.iter().map(|n| n.load(Ordering::Relaxed)).sum();
    let mut out = String::from("| section | ms | share |\n|---|---|---|\n");
    for (name, n) in NAMES.iter().zip(&NANOS) {
        let n = n.load(Ordering::Relaxed);
        out += &format!(
            "| {name} | {:.1} | {:.1}% |\n",
            n as f64 / 1e6,
            100.0 * n as f64 / total.max(1) as f64
        );
    }
    Some(out)
}
