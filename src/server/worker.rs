//! The engine thread: requests come in FIFO through a bounded channel, one generation runs at
//! a time, and text goes back to the request's handler as it is committed.

use super::metrics::Metrics;
use crate::draft::{Draft, Drafter, NodeStats, Request};
use crate::drafter::{AdaptiveCascade, PredictionDrafter};
use crate::engine::{Engine, FinishReason, GenerateOptions, Generation};
use crate::error::Result;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::UnboundedSender;

/// One request's work.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Its options; `cancel` is set when the client goes away.
    pub opts: GenerateOptions,
    /// Number of choices: seeds `opts.seed..opts.seed + n`.
    pub n: usize,
    /// Tokens of the text the client expects back.
    pub prediction: Option<Vec<u32>>,
    pub events: UnboundedSender<Event>,
    /// Whether the job waits, has started, or lost its client while waiting.
    pub ticket: Ticket,
}

/// A queued job's state, shared by its handler and the engine thread: whichever of the two
/// moves it out of waiting first (starting it, or its client leaving) takes it off the
/// queue's count, exactly once.
#[derive(Clone, Default)]
pub struct Ticket(Arc<AtomicU8>);

impl Ticket {
    const WAITING: u8 = 0;
    const STARTED: u8 = 1;
    const LEFT: u8 = 2;

    /// The engine takes the job: true if it was still waiting.
    pub fn start(&self) -> bool {
        self.move_to(Self::STARTED)
    }

    /// The client left: true if the job was still waiting.
    pub fn leave(&self) -> bool {
        self.move_to(Self::LEFT)
    }

    fn move_to(&self, state: u8) -> bool {
        self.0
            .compare_exchange(Self::WAITING, state, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// What the engine thread reports about a job.
pub enum Event {
    Text {
        index: usize,
        text: String,
    },
    Done {
        index: usize,
        generation: Box<Generation>,
    },
    Failed(String),
}

/// The config's drafter, lent to each request's tree (alone, or behind a prediction).
struct Lent {
    name: String,
    drafter: Arc<Mutex<Box<dyn Drafter>>>,
}

impl Lent {
    fn new(drafter: &Arc<Mutex<Box<dyn Drafter>>>) -> Self {
        let name = drafter
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .name()
            .to_string();
        Self {
            name,
            drafter: drafter.clone(),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Box<dyn Drafter>) -> R) -> R {
        f(&mut self.drafter.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drafter for Lent {
    fn name(&self) -> &str {
        &self.name
    }
    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        self.with(|d| d.draft(context, request))
    }
    fn commit(&mut self, context: &[u32]) {
        self.with(|d| d.commit(context))
    }
    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.with(|d| d.start(prompt))
    }
    fn finish(&mut self, output: &[u32]) -> Result<()> {
        self.with(|d| d.finish(output))
    }
    fn forget(&mut self) {
        self.with(|d| d.forget())
    }
    fn stats(&self) -> NodeStats {
        self.with(|d| d.stats())
    }
}

/// The text of a panic's payload.
fn panic_message(panic: &(dyn Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    format!("the engine failed on this request ({text})")
}

/// Runs jobs until the channel closes. `abort` cancels whatever runs (shutdown's grace
/// period is over).
pub fn run(mut engine: Engine, jobs: Receiver<Job>, metrics: Arc<Metrics>, abort: Arc<AtomicBool>) {
    // However this thread ends, `/health` says so.
    struct Stopped(Arc<Metrics>);
    impl Drop for Stopped {
        fn drop(&mut self) {
            self.0.engine_stopped.store(true, Ordering::Relaxed);
        }
    }
    let _stopped = Stopped(metrics.clone());
    let base = engine.drafter.take().map(|d| Arc::new(Mutex::new(d)));
    while let Ok(job) = jobs.recv() {
        // A client that left while queued (its handler or stream dropped) costs nothing; it
        // gave its place in the queue back when it left.
        if job.ticket.start() {
            metrics.queued.fetch_sub(1, Ordering::Relaxed);
        }
        let left = job
            .opts
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed));
        if left || job.events.is_closed() {
            metrics.cancelled();
            continue;
        }
        // Past the grace period, queued requests are not started: dropping the job tells
        // its handler the server is shutting down.
        if abort.load(Ordering::Relaxed) {
            metrics.cancelled();
            continue;
        }
        // A panic (a bug) here fails this request too, not the server.
        let drafter = catch_unwind(AssertUnwindSafe(|| {
            let lent = base
                .as_ref()
                .map(|b| Box::new(Lent::new(b)) as Box<dyn Drafter>);
            match &job.prediction {
                None => lent,
                Some(p) => {
                    let pred: Box<dyn Drafter> =
                        Box::new(PredictionDrafter::new("prediction", p.clone(), 32));
                    Some(match lent {
                        None => pred,
                        Some(l) => {
                            Box::new(AdaptiveCascade::new("prediction+drafter", vec![pred, l]))
                        }
                    })
                }
            }
        }));
        engine.drafter = match drafter {
            Ok(d) => d,
            Err(panic) => {
                metrics.failed();
                let _ = job.events.send(Event::Failed(panic_message(&*panic)));
                continue;
            }
        };
        for index in 0..job.n {
            let mut opts = job.opts.clone();
            opts.seed = opts.seed.wrapping_add(index as u64);
            let cancel = opts.cancel.clone().unwrap_or_default();
            let events = &job.events;
            // A panic (a bug) fails this request, not the server: the caches, which it may
            // have left half-updated, are emptied and the next request starts afresh.
            let gone = || events.is_closed() || abort.load(Ordering::Relaxed);
            let out = catch_unwind(AssertUnwindSafe(|| {
                // Checked between the prompt's chunks too: a long prompt takes a while.
                let mut reading = |_, _| {
                    if gone() {
                        cancel.store(true, Ordering::Relaxed);
                    }
                };
                engine
                    .generate_with_progress(&job.prompt, &opts, &mut reading, &mut |piece| {
                        if gone() {
                            cancel.store(true, Ordering::Relaxed);
                        } else if !piece.is_empty() {
                            let _ = events.send(Event::Text {
                                index,
                                text: piece.to_string(),
                            });
                        }
                    })
                    .map_err(|e| e.to_string())
            }))
            .unwrap_or_else(|panic| {
                engine.forget();
                Err(panic_message(&*panic) + "; its caches were emptied")
            });
            for w in out.iter().flat_map(|g| &g.warnings) {
                eprintln!("cascade: warning: {w}");
            }
            match out {
                Ok(g) if g.finish_reason == FinishReason::Cancelled => {
                    metrics.generated(&g);
                    metrics.cancelled();
                    break;
                }
                Ok(g) => {
                    metrics.generated(&g);
                    let _ = events.send(Event::Done {
                        index,
                        generation: Box::new(g),
                    });
                }
                Err(e) => {
                    metrics.failed();
                    let _ = events.send(Event::Failed(e));
                    break;
                }
            }
        }
        engine.drafter = None;
    }
}
