//! Where forward passes spend their time, by section, when `CASCADE_PROFILE=1`.
//!
//! Off by default (one relaxed load per section). Reading a prompt (a model's prefill: the
//! target's, and a drafter's catch-up on text it has not seen, unless the few tokens ride in
//! its next forward) is counted apart from the forwards that generate (decode, draft and
//! verify steps): a long prompt's reading would otherwise hide them.
//! `cascade generate` prints the table to standard error at the end when it is on.

use std::cell::Cell;
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
/// Nanoseconds per section: `[0]` generating (decode, draft and verify forwards), `[1]`
/// reading prompts.
static NANOS: [[AtomicU64; 9]; 2] = [const { [const { AtomicU64::new(0) }; 9] }; 2];
static ENABLED: OnceLock<AtomicBool> = OnceLock::new();

thread_local! {
    /// Whether this thread is reading a prompt ([`reading`]).
    static READING: Cell<bool> = const { Cell::new(false) };
}

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
    let phase = READING.with(Cell::get) as usize;
    NANOS[phase][section as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// Runs `f` (a model reading a prompt), its sections counted as reading.
pub fn reading<T>(f: impl FnOnce() -> T) -> T {
    /// Restores the thread's flag however `f` ends (a server worker goes on after a panic).
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            READING.with(|r| r.set(self.0));
        }
    }
    let _restore = Restore(READING.with(|r| r.replace(true)));
    f()
}

/// Forgets the times so far (a run's measurement of its forward costs, before it generates).
pub fn reset() {
    NANOS
        .iter()
        .flatten()
        .for_each(|n| n.store(0, Ordering::Relaxed));
}

/// The accumulated times as a table, or `None` when profiling is off.
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let ms = |phase: usize, s: usize| NANOS[phase][s].load(Ordering::Relaxed) as f64 / 1e6;
    let totals: [f64; 2] = std::array::from_fn(|p| (0..NAMES.len()).map(|s| ms(p, s)).sum());
    let share = |p: usize, s: usize| 100.0 * ms(p, s) / totals[p].max(1e-9);
    let mut out = String::from(
        "| section | generating, ms | share | reading prompts, ms | share |\n\
         |---|---|---|---|---|\n",
    );
    for (s, name) in NAMES.iter().enumerate() {
        out += &format!(
            "| {name} | {:.1} | {:.1}% | {:.1} | {:.1}% |\n",
            ms(0, s),
            share(0, s),
            ms(1, s),
            share(1, s)
        );
    }
    out += &format!("| total | {:.1} | | {:.1} | |\n", totals[0], totals[1]);
    Some(out)
}
