//! Counters for `GET /metrics`, in the Prometheus text format.

use crate::engine::Generation;
use crate::review::ReviewCounts;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Server-wide counters, updated by the handlers and the engine thread.
#[derive(Default)]
pub struct Metrics {
    /// Requests waiting for the engine.
    pub queued: AtomicUsize,
    /// The engine thread has ended (shutdown, or a failure outside any one request).
    pub engine_stopped: AtomicBool,
    totals: Mutex<Totals>,
}

#[derive(Default)]
struct Totals {
    requests: usize,
    rejected: usize,
    failed: usize,
    cancelled: usize,
    generated: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    target_calls: usize,
    drafted: usize,
    accepted: usize,
    decode_seconds: f64,
    reviews: ReviewCounts,
    latency_sum: f64,
    latency_count: usize,
}

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut Totals)) {
        f(&mut self.totals.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A request turned away because the queue was full.
    pub fn rejected(&self) {
        self.with(|t| t.rejected += 1)
    }

    pub fn failed(&self) {
        self.with(|t| t.failed += 1)
    }

    pub fn cancelled(&self) {
        self.with(|t| t.cancelled += 1)
    }

    /// A finished generation; `latency` is from arrival to its end, in seconds.
    pub fn generated(&self, g: &Generation) {
        self.with(|t| {
            let s = &g.stats;
            t.generated += s.generated_tokens;
            t.prompt_tokens += s.prompt_tokens;
            t.cached_tokens += s.cached_tokens;
            t.target_calls += s.target_calls;
            t.drafted += s.drafted;
            t.accepted += s.accepted;
            t.decode_seconds += s.decode_seconds;
            t.reviews.add(&s.reviews);
        })
    }

    /// A request answered, `latency` seconds after it arrived.
    pub fn answered(&self, latency: f64) {
        self.with(|t| {
            t.requests += 1;
            t.latency_sum += latency;
            t.latency_count += 1;
        })
    }

    /// The Prometheus exposition of every counter.
    pub fn render(&self) -> String {
        let t = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(
                out,
                "# HELP cascade_{name} {help}\n# TYPE cascade_{name} {kind}"
            );
            for (labels, v) in samples {
                let _ = writeln!(out, "cascade_{name}{labels} {v}");
            }
        };
        let scalars = [
            (
                "requests_total",
                "counter",
                "Requests answered.",
                t.requests as f64,
            ),
            (
                "requests_rejected_total",
                "counter",
                "Requests refused with 429 (queue full).",
                t.rejected as f64,
            ),
            (
                "requests_failed_total",
                "counter",
                "Requests whose generation failed.",
                t.failed as f64,
            ),
            (
                "requests_cancelled_total",
                "counter",
                "Generations cancelled by a client that went away.",
                t.cancelled as f64,
            ),
            (
                "queue_depth",
                "gauge",
                "Requests waiting for the engine.",
                self.queued.load(Ordering::Relaxed) as f64,
            ),
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of the requests (cached ones included).",
                t.prompt_tokens as f64,
            ),
            (
                "prompt_tokens_cached_total",
                "counter",
                "Prompt tokens found in the cache (the start a prompt shares with the previous one).",
                t.cached_tokens as f64,
            ),
            (
                "tokens_generated_total",
                "counter",
                "Tokens generated.",
                t.generated as f64,
            ),
            (
                "tokens_per_second",
                "gauge",
                "Generated tokens per second of decoding, over all requests.",
                t.generated as f64 / t.decode_seconds.max(1e-9),
            ),
            (
                "target_calls_total",
                "counter",
                "Target forward passes after the prompt.",
                t.target_calls as f64,
            ),
            (
                "drafted_tokens_total",
                "counter",
                "Tokens drafted for the target's review.",
                t.drafted as f64,
            ),
            (
                "accepted_tokens_total",
                "counter",
                "Drafted tokens the target accepted.",
                t.accepted as f64,
            ),
        ];
        for (name, kind, help, value) in scalars {
            metric(name, kind, help, &[(String::new(), value)]);
        }
        let by_position: Vec<(String, f64)> = t
            .reviews
            .acceptance_by_position()
            .iter()
            .enumerate()
            .map(|(i, a)| (format!("{{position=\"{}\"}}", i + 1), *a))
            .collect();
        metric("acceptance_by_position", "gauge", "Share of reviews that accepted draft position i, given every earlier one was accepted.", &by_position);
        let _ = writeln!(out, "# HELP cascade_request_duration_seconds Time from a request's arrival to its last byte.\n# TYPE cascade_request_duration_seconds summary");
        let _ = writeln!(
            out,
            "cascade_request_duration_seconds_sum {}",
            t.latency_sum
        );
        let _ = writeln!(
            out,
            "cascade_request_duration_seconds_count {}",
            t.latency_count
        );
        out
    }
}
