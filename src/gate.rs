//! The gate of one review round: which draft positions are worth proposing.
//!
//! Every drafter asks it before each token ([`Request::admit`](crate::draft::Request::admit))
//! and before paying for one ([`Request::worth_drafting`](crate::draft::Request::worth_drafting)).
//! A fixed gate admits up to the requested length. An adaptive gate ([`Adaptive`]) sizes each
//! round for the best long-run speed. A round that drafts `n` positions emits
//!
//! ```text
//! E(n) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_n   tokens in   T(n) = D(n) + V(n + 1)   seconds,
//! ```
//!
//! where `a_i` is the chance that position `i` is accepted (learned from past reviews of the
//! same drafter at the same confidence), `D(n)` the drafting time and `V(x)` the reviewer's
//! measured time for a forward over `x` tokens. The long-run rate `ΣE / ΣT` is largest when
//! every round maximizes `E - λ T` with `λ` the best achievable rate (the renewal-reward
//! argument; iterating `λ` is Dinkelbach's method). So a position is drafted only if it adds
//! at least `λ` expected tokens per second it costs, with `λ` the rate the recent rounds
//! achieved, and never below plain decoding's `1 / V(1)`: an empty draft is a decode step, and
//! a round drafts only what beats both decoding and what drafting has been doing lately. A
//! drafter's forward pass is paid for before its token is seen, so it is weighed with the run
//! of positions it may start and with the chance that its token comes out confident enough to
//! be drafted at all (`Gate::worth_drafting`).
//! Every input is known before the position's token is sampled and none comes from the
//! reviewer's view of the current draft, so the review stays exact.
//!
//! A drafter that has not read the text yet (a draft model, before its first draft of a
//! sequence) must first catch up on all of it: a one-time cost that no single round repays.
//! It is an investment, made only if it costs at most [`INVEST_SHARE`] of the time the rest
//! of the generation is expected to take, and at most what the drafter would save in that
//! time if it were as right as a good draft model is ([`FRESH_ACCEPTANCE`];
//! `Gate::worth_catching_up`): a long prompt with a short answer is then drafted by the free
//! drafters alone, where reading the prompt would cost more than the draft model could save;
//! and on a CPU where verifying a token costs so much that a good draft model cannot beat
//! plain decoding, it never reads. How long the rest is expected to be
//! ([`expected_remaining`]) does not come from `max_new_tokens` alone, which users set far
//! above most answers: a declined drafter is asked again each round, and a generation that
//! runs long may earn the investment as it goes.

use crate::costs::ForwardCost;
use crate::engine::SourceBuckets;
use serde::Serialize;
use std::sync::Arc;

/// Who proposed a draft position: the drafter's name.
pub type Source = Arc<str>;

/// A proposed position: its drafter and that drafter's confidence in it.
#[derive(Clone, Debug, PartialEq)]
pub struct Position {
    /// The drafter that proposed it.
    pub source: Source,
    /// Its confidence, if it reports one.
    pub confidence: Option<f32>,
}

/// Upper edges of the confidence buckets; a last bucket holds positions without confidence.
pub const BUCKET_EDGES: [f32; 13] = [
    0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0,
];
/// Buckets, the no-confidence one included.
pub const BUCKETS: usize = BUCKET_EDGES.len() + 1;

/// A confidence's bucket; a NaN one (a plug-in's 0/0) counts as none, not as the highest.
fn bucket(confidence: Option<f32>) -> usize {
    match confidence.filter(|c| !c.is_nan()) {
        Some(c) => BUCKET_EDGES
            .iter()
            .position(|&e| c <= e)
            .unwrap_or(BUCKET_EDGES.len() - 1),
        None => BUCKET_EDGES.len(),
    }
}

/// Prior acceptance by confidence bucket, before any review (one value per bucket of
/// [`BUCKET_EDGES`], then one for positions without confidence). Bucket midpoints unless a
/// config gives measured ones (`[target.acceptance]`, written by `cascade plan`).
pub type Priors = [f64; BUCKETS];

/// The priors without measurement: each bucket's midpoint.
pub fn midpoints() -> Priors {
    std::array::from_fn(midpoint)
}

/// The middle of a bucket: the prior acceptance of its positions.
fn midpoint(b: usize) -> f64 {
    match b {
        b if b < BUCKET_EDGES.len() => {
            let low = if b == 0 { 0.0 } else { BUCKET_EDGES[b - 1] };
            ((low + BUCKET_EDGES[b]) / 2.0) as f64
        }
        _ => 0.5,
    }
}

/// Weight of a bucket's prior, in reviews.
pub(crate) const PRIOR: f64 = 2.0;
/// Per position learned in a bucket, older ones count this much less: about the last 12
/// matter, so that the estimates follow the text from one task to the next (a round teaches
/// every position it drafted, those after the first rejection too).
const DECAY: f64 = 0.92;
/// Weight of a round in the recent acceptance of first positions.
const FIRST_WEIGHT: f64 = 0.2;
/// Most rounds a declined drafter waits before it is tried again.
const MAX_BACKOFF: u32 = 64;
/// Weight of a round in the recent rate `λ`.
const RATE_WEIGHT: f64 = 0.1;
/// The largest share of the generation's expected remaining time a drafter may spend
/// catching up on the text before its first draft: about what a good draft model saves.
pub const INVEST_SHARE: f64 = 0.1;
/// The acceptance a drafter is assumed to reach before it has been reviewed: what a good draft
/// model reaches on its first positions. Optimistic, so that a new drafter gets tried; and what
/// a catch-up is weighed at, since a drafter that has not read the text has not been reviewed
/// on it.
pub const FRESH_ACCEPTANCE: f64 = 0.8;
/// Tokens a generation is expected to run before it has shown otherwise: a paragraph or a
/// function, what the prompt suite's answers mostly reach.
pub const TYPICAL_ANSWER: usize = 128;

/// Tokens a generation that has emitted `generated` and may emit `remaining` more is expected to
/// go on for: as many as it has emitted (a text that has run `g` tokens is as likely as not to
/// run `g` more), at least [`TYPICAL_ANSWER`], at most `remaining`. Bounding a catch-up by this
/// instead of `remaining` keeps a large `max_new_tokens` from paying for reading a long prompt
/// whose answer is short. The drafter is asked again in later rounds and reads the text once
/// [`INVEST_SHARE`] of the time the tokens out so far take at the recent rate outweighs the
/// reading (the break-even rule of renting versus buying), which also grows with the text.
pub fn expected_remaining(generated: usize, remaining: usize) -> usize {
    remaining.min(generated.max(TYPICAL_ANSWER))
}

/// How one drafter's proposals fare at one review level.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// What each bucket's estimate starts from.
    prior: Priors,
    /// Per bucket, recent (decayed) positions and their chances to be kept: the estimate.
    recent: [(f64, f64); BUCKETS],
    /// Per bucket, all reviews and acceptances: the report.
    total: [(u64, u64); BUCKETS],
    /// Recent acceptance of this drafter's first position in a round: its chance before it
    /// has drafted anything.
    first: f64,
    /// Recent share of this drafter's paid forward passes whose token was admitted: a
    /// forward whose token comes out too unsure to draft costs as much as one whose token is
    /// drafted. One share for a run's first forward and the later ones alike, so that the
    /// retries of a declined drafter keep it up to date.
    admitted: f64,
    /// Rounds a declined drafter waits before it is tried again (doubling while tries fail),
    /// and rounds it has waited.
    backoff: u32,
    waited: u32,
}

impl Default for Calibration {
    fn default() -> Self {
        Self {
            prior: midpoints(),
            recent: [(0.0, 0.0); BUCKETS],
            total: [(0, 0); BUCKETS],
            first: FRESH_ACCEPTANCE,
            admitted: 1.0,
            backoff: 1,
            waited: 0,
        }
    }
}

impl Calibration {
    /// The chance that a position proposed with `confidence` is accepted.
    pub fn estimate(&self, confidence: Option<f32>) -> f64 {
        let b = bucket(confidence);
        let (n, a) = self.recent[b];
        (a + PRIOR * self.prior[b]) / (n + PRIOR)
    }

    /// A position proposed with `confidence` was kept with chance `chance`.
    fn learn(&mut self, confidence: Option<f32>, chance: f64) {
        let b = bucket(confidence);
        let (n, a) = self.recent[b];
        self.recent[b] = (n * DECAY + 1.0, a * DECAY + chance);
    }

    /// A position proposed with `confidence` was reviewed, and kept or not (the report).
    fn count(&mut self, confidence: Option<f32>, accepted: bool) {
        let b = bucket(confidence);
        self.total[b].0 += 1;
        self.total[b].1 += accepted as u64;
    }

    /// Reviews and acceptances per bucket, since the engine was built.
    pub fn buckets(&self) -> Vec<BucketCount> {
        (0..BUCKETS)
            .filter(|&b| self.total[b].0 > 0)
            .map(|b| BucketCount {
                up_to: BUCKET_EDGES.get(b).copied(),
                reviewed: self.total[b].0,
                accepted: self.total[b].1,
            })
            .collect()
    }
}

/// Reviews of one confidence bucket.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct BucketCount {
    /// The bucket's upper edge; `None` for positions proposed without confidence.
    pub up_to: Option<f32>,
    /// Positions of the bucket the reviewer reached.
    pub reviewed: u64,
    /// Those it accepted.
    pub accepted: u64,
}

/// Adaptive drafting at one review level: the reviewer's measured forward cost and what it has
/// learned of each drafter below it.
#[derive(Clone, Debug)]
pub struct Adaptive {
    verify: ForwardCost,
    drafters: Vec<(Source, Calibration)>,
    /// Recent rounds' emitted tokens per predicted second: `λ`.
    rate: f64,
    /// Plain decoding's recent rate (one token per predicted decode step).
    decoding: f64,
    /// Tokens the generation is expected to emit still, if known ([`Adaptive::set_horizon`]).
    horizon: Option<usize>,
}

impl Adaptive {
    /// A gate for a reviewer with forward cost `verify`.
    pub fn new(verify: ForwardCost) -> Self {
        let decoding = 1.0 / verify.seconds(1);
        Self {
            verify,
            drafters: Vec::new(),
            rate: decoding,
            decoding,
            horizon: None,
        }
    }

    /// The generation has emitted `generated` tokens and may emit at most `remaining` more: a
    /// drafter's catch-up on the text must cost at most [`INVEST_SHARE`] of the time the
    /// [`expected_remaining`] tokens take. Without a horizon every catch-up is made that the
    /// drafter could repay (`Gate::worth_catching_up`).
    pub fn set_horizon(&mut self, generated: usize, remaining: usize) {
        self.horizon = Some(expected_remaining(generated, remaining));
    }

    /// The rate a drafted position must beat: the recent rate, at least plain decoding's.
    fn lambda(&self) -> f64 {
        self.rate.max(self.decoding)
    }

    /// Starts the estimates of each named drafter from its measured acceptance by confidence
    /// bucket instead of the bucket midpoints.
    pub fn with_priors(mut self, priors: &[(String, Priors)]) -> Self {
        for (name, prior) in priors {
            let source: Source = name.as_str().into();
            self.calibration_mut(&source).prior = *prior;
        }
        self
    }

    /// What this level learned of `source`.
    pub fn calibration(&self, source: &str) -> Option<&Calibration> {
        self.drafters
            .iter()
            .find(|(s, _)| &**s == source)
            .map(|(_, c)| c)
    }

    fn calibration_mut(&mut self, source: &Source) -> &mut Calibration {
        let i = match self.drafters.iter().position(|(s, _)| s == source) {
            Some(i) => i,
            None => {
                self.drafters.push((source.clone(), Calibration::default()));
                self.drafters.len() - 1
            }
        };
        &mut self.drafters[i].1
    }

    /// Every drafter's reviews by confidence bucket since the last [`Adaptive::start_sequence`].
    pub fn report(&self) -> Vec<SourceBuckets> {
        self.drafters
            .iter()
            .map(|(s, c)| SourceBuckets {
                drafter: s.to_string(),
                buckets: c.buckets(),
            })
            .collect()
    }

    /// A new sequence begins: the reported counts and the recent rates (`λ`, and plain
    /// decoding's at the text's length) start over as a new gate's, what was learned of each
    /// drafter's acceptance is kept. `λ` is the rate of the text so far, which says nothing of
    /// a new prompt's: carried over from a text that Max-Gram copied fast, it made a draft
    /// model not worth reading the next prompt for (in `cascade bench`, the code-editing
    /// prompts after the code-completion ones were drafted without the 0.5B, which a fresh
    /// process reads them with).
    pub fn start_sequence(&mut self) {
        self.drafters
            .iter_mut()
            .for_each(|(_, c)| c.total = [(0, 0); BUCKETS]);
        self.decoding = 1.0 / self.verify.seconds(1);
        self.rate = self.decoding;
    }

    /// Learns from a round: `gate`'s positions were reviewed up to the first rejection, and
    /// the first `accepted` were kept; `chances[i]` is position `i`'s chance to be kept given
    /// the draft before it ([`crate::review::keep_chance`], the exact review's, even under an
    /// experimental review rule), for every drafted position.
    ///
    /// The estimates learn from the chances of all the positions, those after the first
    /// rejection too (the reviewer scores them in the same forward). Learning from the
    /// reviewed positions alone, a drafter whose first positions failed in a new text went on
    /// with its later positions' estimates from the text before, which it could never revise:
    /// at T = 0.7, Max-Gram went on drafting 5-9 tokens of copies into summaries that never
    /// kept one, on what the document-QA answers before them had taught. The report counts
    /// the reviewed positions and what was kept.
    pub fn learn(&mut self, gate: &Gate, accepted: usize, chances: &[f64]) {
        let positions = gate.positions();
        let reviewed = positions.len().min(accepted + 1);
        debug_assert_eq!(chances.len(), positions.len());
        for (p, &chance) in positions.iter().zip(chances) {
            self.calibration_mut(&p.source).learn(p.confidence, chance);
        }
        let mut first_kept: Vec<&Source> = Vec::new();
        for (i, p) in positions[..reviewed].iter().enumerate() {
            let kept = i < accepted;
            let first = i == 0 || positions[i - 1].source != p.source;
            let c = self.calibration_mut(&p.source);
            c.count(p.confidence, kept);
            if first {
                c.first = (1.0 - FIRST_WEIGHT) * c.first + FIRST_WEIGHT * kept as u8 as f64;
                if kept {
                    c.backoff = 1;
                    first_kept.push(&p.source);
                }
            }
        }
        if let Some(Policy {
            declined,
            retried,
            paid,
            ..
        }) = &gate.policy
        {
            for (s, admitted) in paid {
                let c = self.calibration_mut(s);
                let admitted = admitted.unwrap_or(false) as u8 as f64;
                c.admitted = (1.0 - FIRST_WEIGHT) * c.admitted + FIRST_WEIGHT * admitted;
            }
            for s in declined {
                self.calibration_mut(s).waited += 1;
            }
            for s in retried {
                let c = self.calibration_mut(s);
                c.waited = 0;
                if !first_kept.contains(&s) {
                    c.backoff = (c.backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        if let Some(p) = gate.prediction() {
            // A catch-up pays over the rounds after it, not in this one.
            let rate = (accepted + 1) as f64 / (p.seconds - p.invested);
            self.rate = (1.0 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * rate;
            self.decoding = (1.0 - RATE_WEIGHT) * self.decoding + RATE_WEIGHT / p.decode_seconds;
        }
    }
}

/// What the cost model predicts for a round.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// Expected tokens emitted.
    pub tokens: f64,
    /// Expected seconds: drafting (catch-ups included) and the reviewer's forward.
    pub seconds: f64,
    /// Of those, seconds a drafter spent catching up on the text before its first draft.
    pub invested: f64,
    /// Seconds of a plain decode step at the round's context.
    pub decode_seconds: f64,
    /// Of the seconds, the drafters' forward passes (catch-ups excluded).
    pub drafting: f64,
}

/// The gate of one round.
#[derive(Debug, Default)]
pub struct Gate {
    positions: Vec<Position>,
    policy: Option<Policy>,
}

/// An adaptive gate's round so far.
#[derive(Debug)]
struct Policy {
    adaptive: Adaptive,
    /// Each admitted position's estimated chance of acceptance.
    chances: Vec<f64>,
    /// P(every position so far is accepted), E(n), D(n) in seconds.
    all_kept: f64,
    expected: f64,
    drafting: f64,
    /// Seconds of catch-ups made this round ([`Gate::worth_catching_up`]).
    invested: f64,
    /// The last admitted position's source and acceptance estimate.
    last: Option<(Source, f64)>,
    /// Drafters declined before their first position this round, and drafters tried again
    /// after waiting although they did not pay.
    declined: Vec<Source>,
    retried: Vec<Source>,
    /// The forward passes paid for ([`Gate::worth_drafting`]): the drafter, and whether the
    /// token it gave was admitted (`None` until the drafter's next [`Gate::admit`]; a forward
    /// whose token was never offered bought nothing either).
    paid: Vec<(Source, Option<bool>)>,
    /// Tokens the reviewer catches up on in its scoring pass besides the last one, and the
    /// context its scoring pass attends over.
    behind: usize,
    context: usize,
}

impl Policy {
    /// Whether `gain` more expected tokens pay for `cost` more drafting seconds and a draft of
    /// `n + 1` positions instead of `n`: at least `λ` tokens per second.
    fn pays(&self, n: usize, gain: f64, cost: f64) -> bool {
        gain >= self.adaptive.lambda() * (cost + self.verify(n + 1) - self.verify(n))
    }

    /// What a run of `m` = 1..=`max` more positions from one drafter, after `n` drafted
    /// positions that are all kept with chance `kept`, adds to `E - λ T`: each position kept
    /// with chance `a` (so the `i`-th with `kept a^i`), the first costing `cost` seconds of
    /// drafting and each later one `then`.
    fn runs(
        &self,
        (n, kept): (usize, f64),
        a: f64,
        (cost, then): (f64, f64),
        max: usize,
    ) -> impl Iterator<Item = (usize, f64)> + '_ {
        let lambda = self.adaptive.lambda();
        (1..=max).scan((0.0, kept, 0.0), move |(gain, kept, drafting), m| {
            *kept *= a;
            *gain += *kept;
            *drafting += if m == 1 { cost } else { then };
            let extra = *drafting + self.verify(n + m) - self.verify(n);
            Some((m, *gain - lambda * extra))
        })
    }

    /// The most that a run from one drafter adds to this round's `E - λ T` ([`Policy::runs`]
    /// after the `n` positions drafted so far). Positive if some run length pays for itself;
    /// the first position alone may not (a draft model's first forward also catches up on
    /// the text since its last draft).
    fn run_value(&self, n: usize, a: f64, cost: (f64, f64), max: usize) -> f64 {
        self.runs((n, self.all_kept), a, cost, max)
            .map(|(_, v)| v)
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// The share of the time at the recent rate `λ` that one drafter's runs save if each of
    /// its positions is accepted with chance `a`, at best over run lengths up to `max` (0 if
    /// none saves): a run of `m` adds its value ([`Policy::runs`] from an empty draft) to a
    /// round of `m + 1` tokens.
    fn savings(&self, a: f64, cost: (f64, f64), max: usize) -> f64 {
        self.runs((0, 1.0), a, cost, max)
            .map(|(m, v)| v / (m + 1) as f64)
            .fold(0.0, f64::max)
    }

    /// Seconds of the reviewer's scoring pass over a draft of `n` positions.
    fn verify(&self, n: usize) -> f64 {
        self.adaptive
            .verify
            .seconds_at(self.behind + n + 1, self.context)
    }
}

impl Gate {
    /// A gate that admits up to the requested length.
    pub fn fixed() -> Self {
        Self::default()
    }

    /// A gate that admits what raises the expected rate, with what `adaptive` has learned.
    pub fn adaptive(adaptive: Adaptive) -> Self {
        Self::adaptive_at(adaptive, 0, 0)
    }

    /// [`Gate::adaptive`] for a reviewer scoring after `context` tokens, whose scoring pass also
    /// feeds `behind` tokens it has not seen (a cascade's reviewer after text other drafters
    /// produced).
    pub fn adaptive_at(adaptive: Adaptive, behind: usize, context: usize) -> Self {
        Self {
            positions: Vec::new(),
            policy: Some(Policy {
                adaptive,
                chances: Vec::new(),
                all_kept: 1.0,
                expected: 1.0,
                drafting: 0.0,
                invested: 0.0,
                last: None,
                declined: Vec::new(),
                retried: Vec::new(),
                paid: Vec::new(),
                behind,
                context,
            }),
        }
    }

    /// Whether to draft one more position, proposed by `source` with `confidence`.
    pub(crate) fn admit(&mut self, source: &Source, confidence: Option<f32>) -> bool {
        let admitted = self.decide(source, confidence);
        let paid = self.policy.as_mut().and_then(|p| p.paid.last_mut());
        if let Some((_, outcome @ None)) = paid.filter(|(s, _)| s == source) {
            *outcome = Some(admitted);
        }
        admitted
    }

    fn decide(&mut self, source: &Source, confidence: Option<f32>) -> bool {
        let n = self.positions.len();
        if let Some(p) = &mut self.policy {
            let a = p.adaptive.calibration(source).map_or_else(
                || Calibration::default().estimate(confidence),
                |c| c.estimate(confidence),
            );
            let gain = p.all_kept * a;
            let pays = p.pays(n, gain, 0.0);
            if crate::engine::trace() {
                eprintln!(
                    "  {source} position {n}: confidence {confidence:.3?}, acceptance {a:.2}, λ {:.1}/s: {}",
                    p.adaptive.lambda(),
                    if pays { "drafted" } else { "declined" }
                );
            }
            if !pays {
                return false;
            }
            p.expected += gain;
            p.all_kept *= a;
            p.chances.push(a);
            p.last = Some((source.clone(), a));
        }
        self.positions.push(Position {
            source: source.clone(),
            confidence,
        });
        true
    }

    /// Whether another position is worth `cost` seconds of `source`'s drafting (a forward
    /// pass, whose token is then offered to [`Gate::admit`]), each later position of its run
    /// costing `then`, and at most `max` positions to come; if so the cost counts as spent.
    /// The forward is weighed with the run it may start, so that a drafter whose first
    /// forward costs more (catching up) is not declined for that alone, and with the chance
    /// that its token comes out admitted at all.
    pub(crate) fn worth_drafting(
        &mut self,
        source: &Source,
        cost: f64,
        then: f64,
        max: usize,
    ) -> bool {
        let n = self.positions.len();
        let Some(p) = &mut self.policy else {
            return true;
        };
        let calibration = p.adaptive.calibration(source).cloned().unwrap_or_default();
        // The next position is expected to fare like this drafter's last one this round, or
        // like its recent first positions, times the chance that its token is admitted.
        let run = matches!(&p.last, Some((s, _)) if s == source);
        let a = match &p.last {
            Some((s, a)) if s == source => *a,
            _ => calibration.first,
        } * calibration.admitted;
        let pays = p.run_value(n, a, (cost, then), max) > 0.0;
        // A drafter declined before its first position of the round is retried now and then
        // (once a round at most), so that what it learned does not go stale; but not if it
        // could not pay even when always right. One that has drafted this round, and is asked
        // again after a cheaper drafter took a position over, is neither retried nor counted
        // as declined: it is being used.
        let fresh = !run
            && !self.positions.iter().any(|q| q.source == *source)
            && !p.retried.contains(source)
            && !p.declined.contains(source);
        let retry = fresh
            && calibration.waited >= calibration.backoff
            && p.run_value(n, 1.0, (cost, then), max) > 0.0;
        if crate::engine::trace() {
            eprintln!(
                "  {source} before position {n}: {:.1} ms (then {:.1} ms) for acceptance {a:.2}: {}",
                cost * 1e3,
                then * 1e3,
                if pays {
                    "pays"
                } else if retry {
                    "retried"
                } else {
                    "declined"
                }
            );
        }
        if pays || retry {
            if !pays {
                p.retried.push(source.clone());
            }
            p.drafting += cost;
            p.paid.push((source.clone(), None));
            true
        } else {
            if fresh {
                p.declined.push(source.clone());
            }
            false
        }
    }

    /// Whether `source` should spend `cost` seconds catching up on the text before its
    /// first draft (a one-time cost the rounds after it repay); if so the cost counts as
    /// spent. A fixed gate always says yes; an adaptive one if the cost is at most
    /// [`INVEST_SHARE`] of the expected remaining tokens' time at the recent rate `λ`, and,
    /// if the drafter's costs are known (`run`: its first forward of a run and each later one,
    /// in seconds; at most `max` positions a round), at most what it would save in that time
    /// at [`FRESH_ACCEPTANCE`]. A drafter that could not beat `λ` even then is not worth
    /// reading for at all. (That acceptance, not its learned one: a drafter that has not read
    /// the text does not draft, so what it learned on earlier texts could not recover; and
    /// not always right, which on a CPU where a verified token costs half a decode step had
    /// a draft model read prompts to save 1-3% and lose the reading.)
    pub(crate) fn worth_catching_up(
        &mut self,
        source: &Source,
        cost: f64,
        run: Option<(f64, f64)>,
        max: usize,
    ) -> bool {
        let Some(p) = &mut self.policy else {
            return true;
        };
        let share = run.map_or(INVEST_SHARE, |run| {
            INVEST_SHARE.min(p.savings(FRESH_ACCEPTANCE, run, max))
        });
        let budget = p
            .adaptive
            .horizon
            .map_or(f64::INFINITY, |h| share * h as f64 / p.adaptive.lambda());
        let worth = share > 0.0 && cost <= budget;
        if crate::engine::trace() {
            eprintln!(
                "  {source} catching up: {:.1} ms against a budget of {:.1} ms: {}",
                cost * 1e3,
                budget * 1e3,
                if worth { "made" } else { "not made" }
            );
        }
        if worth {
            p.invested += cost;
        }
        worth
    }

    /// Keeps the first `len` admitted positions: the reviewer verifies only those (a draft
    /// is cut after a token that ends the generation). What the round is predicted to emit
    /// and cost follows.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.positions.truncate(len);
        if let Some(p) = &mut self.policy {
            p.chances.truncate(len);
            p.all_kept = 1.0;
            p.expected = 1.0;
            for a in &p.chances {
                p.all_kept *= a;
                p.expected += p.all_kept;
            }
        }
    }

    /// The admitted positions, in draft order.
    pub fn positions(&self) -> &[Position] {
        &self.positions
    }

    /// For an adaptive gate, as the cost model predicts the round: its expected tokens, its
    /// expected seconds (drafting and the reviewer's forward), and the seconds plain decoding
    /// takes per token at this context.
    pub fn prediction(&self) -> Option<Prediction> {
        self.policy.as_ref().map(|p| Prediction {
            tokens: p.expected,
            seconds: p.invested + p.drafting + p.verify(self.positions.len()),
            invested: p.invested,
            drafting: p.drafting,
            decode_seconds: p.adaptive.verify.seconds_at(1, p.context),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verify() -> ForwardCost {
        // 50 ms per token; each extra token scored costs 10 ms.
        ForwardCost {
            decode_seconds: 0.05,
            ratios: (1..=16).map(|k| (k, 1.0 + 0.2 * (k - 1) as f64)).collect(),
            per_context: Vec::new(),
        }
    }

    /// Each position's chance in a round whose first `accepted` positions were kept, as a
    /// review of a drafter that is either right or wrong: 1 for those, 0 for the rest.
    fn outcomes(gate: &Gate, accepted: usize) -> Vec<f64> {
        (0..gate.positions().len())
            .map(|i| (i < accepted) as u8 as f64)
            .collect()
    }

    /// Admits `confidences` from a free drafter until the gate stops it.
    fn admitted(a: &Adaptive, confidences: &[f32]) -> usize {
        let mut gate = Gate::adaptive(a.clone());
        let s: Source = "d".into();
        confidences
            .iter()
            .take_while(|&&c| gate.admit(&s, Some(c)))
            .count()
    }

    #[test]
    fn a_free_drafter_drafts_while_tokens_are_likely_enough_to_pay_for_their_verification() {
        let a = Adaptive::new(verify());
        // Priors: bucket midpoints. With 10 ms per scored token against 50 ms per round, a
        // position pays if it adds more than 0.2 * (current expected tokens) / (current rounds'
        // cost in units of 50 ms): likely tokens keep going, unlikely ones stop at once.
        assert_eq!(admitted(&a, &[0.99; 8]), 8);
        assert_eq!(admitted(&a, &[0.05; 8]), 0);
        assert!(admitted(&a, &[0.75; 8]) < 8);
        // A NaN confidence is none, not the highest bucket's: not drafted as 0.99's are.
        assert_eq!(bucket(Some(f32::NAN)), bucket(None));
        assert!(admitted(&a, &[f32::NAN; 8]) < 8);
    }

    /// A round cut to its first positions (the reviewer cuts a draft after a token that ends
    /// the generation) is predicted and learned from as a round that drafted only those.
    #[test]
    fn a_truncated_round_is_the_shorter_round() {
        let a = Adaptive::new(verify());
        let s: Source = "d".into();
        let (mut long, mut short) = (Gate::adaptive(a.clone()), Gate::adaptive(a.clone()));
        for c in [0.99, 0.95, 0.9] {
            assert!(long.admit(&s, Some(c)));
        }
        assert!(short.admit(&s, Some(0.99)));
        long.truncate(1);
        assert_eq!(long.positions(), short.positions());
        assert_eq!(long.prediction(), short.prediction());
        long.truncate(5); // past the end: nothing to cut
        assert_eq!(long.prediction(), short.prediction());
    }

    #[test]
    fn a_catch_up_is_made_only_within_its_share_of_the_remaining_time() {
        let s: Source = "d".into();
        let mut a = Adaptive::new(verify());
        // No horizon, or a fixed gate: every catch-up is made.
        assert!(Gate::adaptive(a.clone()).worth_catching_up(&s, 100.0, None, 8));
        assert!(Gate::fixed().worth_catching_up(&s, 100.0, None, 8));
        // 100 tokens at plain decoding's 20 tokens/s take 5 s: a catch-up may cost 0.5 s.
        a.set_horizon(0, 100);
        let budget = INVEST_SHARE * 100.0 * 0.05;
        assert!(!Gate::adaptive(a.clone()).worth_catching_up(&s, budget * 1.01, None, 8));
        let mut gate = Gate::adaptive(a.clone());
        assert!(gate.worth_catching_up(&s, budget * 0.99, None, 8));
        // It counts in the round's predicted time, not in the rate the round achieved.
        let p = gate.prediction().unwrap();
        assert_eq!(p.invested, budget * 0.99);
        assert_eq!(p.seconds, p.invested + 0.05);
        let rate = a.rate;
        a.learn(&gate, 0, &outcomes(&gate, 0));
        assert!((a.rate - rate).abs() < 1e-9, "{} vs {rate}", a.rate);
    }

    /// The recent rate is the text's own: after a text that a free drafter copied fast, a new
    /// sequence weighs a catch-up at plain decoding's rate again, as a fresh gate does.
    #[test]
    fn a_new_sequence_weighs_a_catch_up_at_plain_decodings_rate() {
        let (mag, small): (Source, Source) = ("mag".into(), "small".into());
        let mut a = Adaptive::new(verify());
        a.set_horizon(0, 100);
        // 100 tokens at plain decoding's 20 tokens/s take 5 s: a catch-up may cost 0.5 s.
        let cost = INVEST_SHARE * 100.0 * 0.05 * 0.9;
        let worth =
            |a: &Adaptive| Gate::adaptive(a.clone()).worth_catching_up(&small, cost, None, 8);
        assert!(worth(&a));
        // Rounds of 8 copied tokens, all accepted: 9 tokens in 120 ms, 75 tokens/s.
        for _ in 0..30 {
            let mut gate = Gate::adaptive(a.clone());
            let n = (0..8).take_while(|_| gate.admit(&mag, Some(0.99))).count();
            assert_eq!(n, 8);
            a.learn(&gate, n, &outcomes(&gate, n));
        }
        assert!(
            !worth(&a),
            "at the copied text's rate the reading would not pay"
        );
        a.start_sequence();
        assert!(worth(&a));
    }

    /// Plain decoding's rate follows the text's length, and a new sequence starts it again at
    /// a short text's: after a long text, where decoding is slow, a new prompt's catch-up is
    /// weighed at a short text's faster decoding.
    #[test]
    fn a_new_sequence_weighs_a_catch_up_at_a_short_texts_decoding() {
        let small: Source = "small".into();
        // 10 us per token of context: 100 ms a step after 5,064 tokens, 50 ms at the start.
        let cost = ForwardCost {
            per_context: vec![(1, 1e-5)],
            ..verify()
        };
        let mut a = Adaptive::new(cost);
        a.set_horizon(0, 100);
        // 100 tokens at 20 tokens/s take 5 s, at 10 tokens/s 10 s: a catch-up of 0.75 s fits
        // a tenth of the latter only.
        let worth =
            |a: &Adaptive| Gate::adaptive(a.clone()).worth_catching_up(&small, 0.75, None, 8);
        assert!(!worth(&a));
        for _ in 0..60 {
            let gate = Gate::adaptive_at(a.clone(), 0, 5_064);
            a.learn(&gate, 0, &outcomes(&gate, 0));
        }
        assert!(worth(&a), "after a long text, decoding is slow");
        a.start_sequence();
        assert!(!worth(&a));
    }

    #[test]
    fn a_large_token_limit_does_not_pay_for_a_catch_up_until_the_answer_runs_long() {
        let s: Source = "d".into();
        let mut a = Adaptive::new(verify());
        // A 1 s catch-up needs 10 s of expected decoding: 200 tokens at 20 tokens/s.
        let worth = |a: &Adaptive| Gate::adaptive(a.clone()).worth_catching_up(&s, 1.0, None, 8);
        a.set_horizon(0, 10_000);
        assert!(!worth(&a), "expected: a typical answer, not the limit");
        a.set_horizon(150, 9_850);
        assert!(!worth(&a));
        a.set_horizon(201, 9_799);
        assert!(
            worth(&a),
            "an answer of 201 tokens is expected to run as long again"
        );
        // Never past the limit.
        a.set_horizon(201, 150);
        assert!(!worth(&a));
        assert_eq!(expected_remaining(0, 64), 64);
        assert_eq!(expected_remaining(0, 1000), TYPICAL_ANSWER);
        assert_eq!(expected_remaining(500, 1000), 500);
    }

    #[test]
    fn positions_after_a_rejection_teach_their_buckets_too() {
        let mut a = Adaptive::new(verify());
        let s: Source = "mag".into();
        // Runs of five: a first position at confidence 0.6, four later ones at 0.95.
        let run = || {
            let mut gate = Gate::fixed();
            assert!(gate.admit(&s, Some(0.6)));
            (0..4).for_each(|_| assert!(gate.admit(&s, Some(0.95))));
            gate
        };
        let later = |a: &Adaptive| a.calibration("mag").unwrap().estimate(Some(0.95));
        // A text where every run was kept.
        for _ in 0..20 {
            a.learn(&run(), 5, &[1.0; 5]);
        }
        assert!(later(&a) > 0.9);
        // A text where none is: each first position is rejected, and the reviewer's scores of
        // the positions after it say that they would have been too.
        for _ in 0..10 {
            a.learn(&run(), 0, &[0.0; 5]);
        }
        assert!(later(&a) < 0.3, "{}", later(&a));
        // The report counts what the review reached: the later positions of the first text only.
        let counts = a.calibration("mag").unwrap().buckets();
        let reviewed: Vec<(u64, u64)> = counts.iter().map(|c| (c.reviewed, c.accepted)).collect();
        assert_eq!(reviewed, [(30, 20), (80, 80)]);
    }

    #[test]
    fn learned_acceptance_overrides_the_confidence() {
        let mut a = Adaptive::new(verify());
        let s: Source = "d".into();
        // Reviews show that this drafter's 0.99s are never accepted.
        for _ in 0..20 {
            let mut gate = Gate::fixed();
            assert!(gate.admit(&s, Some(0.99)));
            a.learn(&gate, 0, &outcomes(&gate, 0));
        }
        assert!(a.calibration("d").unwrap().estimate(Some(0.99)) < 0.2);
        assert_eq!(admitted(&a, &[0.99; 8]), 0);
        let counts = a.calibration("d").unwrap().buckets();
        assert_eq!(
            counts,
            [BucketCount {
                up_to: Some(0.99),
                reviewed: 20,
                accepted: 0
            }]
        );
    }

    #[test]
    fn a_costly_drafter_is_asked_only_when_it_pays_and_retried_after_a_backoff() {
        let mut a = Adaptive::new(verify());
        let s: Source = "neural".into();
        // A drafter costing 20 ms per token (it would pay if it were always right: 30 ms a
        // token with its verification, against 50 ms), never accepted: after a few failures
        // it is declined, then retried after 1, 2, 4 ... rounds.
        let mut tried = Vec::new();
        for round in 0..40 {
            let mut gate = Gate::adaptive(a.clone());
            if gate.worth_drafting(&s, 0.02, 0.02, 8) {
                tried.push(round);
                gate.admit(&s, Some(0.5));
            }
            a.learn(&gate, 0, &outcomes(&gate, 0));
        }
        assert!(tried.len() < 12, "tried in rounds {tried:?}");
        assert!(tried.windows(2).any(|w| w[1] - w[0] >= 8), "{tried:?}");
        // A cheap, likely drafter is always worth it.
        let mut gate = Gate::adaptive(Adaptive::new(verify()));
        assert!(gate.worth_drafting(&"mag".into(), 0.0, 0.0, 8));
    }

    #[test]
    fn a_drafter_that_could_not_pay_even_if_always_right_is_never_asked() {
        // 45 ms per token and 10 ms to verify it, against a 50 ms decode step: a round of n
        // such tokens, all accepted, emits n + 1 tokens in 50 + 55n ms, never faster than
        // decoding. It is not asked, not retried, and not worth reading a prompt for.
        let s: Source = "neural".into();
        let mut a = Adaptive::new(verify());
        a.set_horizon(0, 1000);
        for _ in 0..100 {
            let mut gate = Gate::adaptive(a.clone());
            assert!(!gate.worth_drafting(&s, 0.045, 0.045, 16));
            assert!(!gate.worth_catching_up(&s, 0.001, Some((0.045, 0.045)), 16));
            a.learn(&gate, 0, &outcomes(&gate, 0));
        }
        // At 20 ms a token the same prompt is read, within a tenth of the remaining time.
        let mut gate = Gate::adaptive(a.clone());
        assert!(gate.worth_catching_up(&s, 0.001, Some((0.02, 0.02)), 16));
        assert!(!gate.worth_catching_up(&s, 1.0, Some((0.02, 0.02)), 16));
    }

    #[test]
    fn a_drafter_that_pays_only_when_nearly_always_right_is_not_read_for() {
        // 35 ms per token and 10 ms to verify it, against a 50 ms decode step: always right,
        // each token saves a tenth of a step; right as often as a good draft model, it loses.
        // Reading the text for it is not worth even a microsecond.
        let s: Source = "neural".into();
        let mut a = Adaptive::new(verify());
        a.set_horizon(0, 1000);
        let mut gate = Gate::adaptive(a);
        assert!(!gate.worth_catching_up(&s, 1e-6, Some((0.035, 0.035)), 16));
        // At 20 ms a token (0.6 of a step with its verification) it is read.
        assert!(gate.worth_catching_up(&s, 1e-6, Some((0.02, 0.02)), 16));
    }

    #[test]
    fn a_forward_whose_token_is_too_unsure_to_draft_counts_against_its_drafter() {
        // 15 ms per token: worth paying for while its tokens are admitted (and accepted). Its
        // tokens come out too unsure to draft: what it paid buys nothing, so it stops being
        // asked, though no token of it was ever rejected.
        let s: Source = "neural".into();
        let mut a = Adaptive::new(verify());
        let mut paid = 0;
        for _ in 0..20 {
            let mut gate = Gate::adaptive(a.clone());
            if gate.worth_drafting(&s, 0.015, 0.015, 8) {
                paid += 1;
                assert!(!gate.admit(&s, Some(0.01)));
            }
            a.learn(&gate, 0, &outcomes(&gate, 0));
        }
        assert!(paid < 10, "paid for {paid} forwards");
        let c = a.calibration("neural").unwrap();
        assert!(c.admitted < 0.5 && c.buckets().is_empty(), "{c:?}");
        // Its tokens turn sure and right: the retries after its backoff learn it, and it is
        // asked every round again.
        let mut paid = Vec::new();
        for round in 0..200 {
            let mut gate = Gate::adaptive(a.clone());
            let asked = gate.worth_drafting(&s, 0.015, 0.015, 1);
            if asked {
                paid.push(round);
                assert!(gate.admit(&s, Some(0.99)));
            }
            a.learn(&gate, asked as usize, &outcomes(&gate, asked as usize));
        }
        assert!(
            (180..200).all(|r| paid.contains(&r)),
            "paid in rounds {paid:?}"
        );
    }

    /// Rounds where `s` drafts a sure first token (accepted), then offers tokens with
    /// `later` confidence while the gate pays for them; the positions drafted in each.
    fn runs_of(a: &mut Adaptive, s: &Source, later: f32, rounds: usize) -> Vec<usize> {
        (0..rounds)
            .map(|_| {
                let mut gate = Gate::adaptive(a.clone());
                let mut drafted = 0;
                while drafted < 4 && gate.worth_drafting(s, 0.005, 0.005, 4 - drafted) {
                    let confidence = if drafted == 0 { 0.99 } else { later };
                    if !gate.admit(s, Some(confidence)) {
                        break;
                    }
                    drafted += 1;
                }
                a.learn(&gate, drafted, &outcomes(&gate, drafted));
                drafted
            })
            .collect()
    }

    #[test]
    fn a_drafter_whose_later_tokens_were_unsure_drafts_whole_runs_again_once_they_are_sure() {
        // The forwards after a sure first token give unsure ones for a while: runs shrink to
        // one token. Once those tokens are sure again, what the drafter learns from its first
        // forwards brings its runs back (a separate share for later forwards, never paid
        // for once low, would keep them at one token for good).
        let s: Source = "neural".into();
        let mut a = Adaptive::new(verify());
        let unsure = runs_of(&mut a, &s, 0.01, 40);
        assert!(unsure[30..].iter().all(|&n| n == 1), "{unsure:?}");
        let sure = runs_of(&mut a, &s, 0.99, 100);
        assert!(sure[80..].iter().all(|&n| n == 4), "{sure:?}");
    }

    #[test]
    fn a_costly_drafter_that_beats_decoding_waits_while_recent_rounds_do_better() {
        let neural: Source = "neural".into();
        let mag: Source = "mag".into();
        // 20 ms per token, first positions usually accepted: worth it against decoding.
        let fresh = Adaptive::new(verify());
        assert!(Gate::adaptive(fresh.clone()).worth_drafting(&neural, 0.02, 0.02, 8));
        // After rounds where free copies emitted 6 tokens each, 20 ms buys too little.
        let mut a = fresh;
        for _ in 0..40 {
            let mut gate = Gate::adaptive(a.clone());
            for _ in 0..5 {
                assert!(gate.admit(&mag, Some(0.999)));
            }
            a.learn(&gate, 5, &outcomes(&gate, 5));
        }
        assert!(a.lambda() > 2.5 / verify().seconds(1), "{}", a.lambda());
        assert!(!Gate::adaptive(a.clone()).worth_drafting(&neural, 0.02, 0.02, 8));
        // Copies are still worth their verification.
        assert!(Gate::adaptive(a).admit(&mag, Some(0.999)));
    }

    #[test]
    fn measured_priors_decide_the_first_rounds() {
        // Midpoint priors draft a free drafter's 0.65-confidence tokens while 0.65^n pays for
        // a verify row (0.2 of a decode step): three of them. A measured prior of 0.05 for that
        // bucket declines them from the first round, before any review.
        let a = Adaptive::new(verify());
        assert_eq!(admitted(&a, &[0.65; 4]), 3);
        let mut prior = midpoints();
        prior[bucket(Some(0.65))] = 0.05;
        let a = Adaptive::new(verify()).with_priors(&[("d".to_string(), prior)]);
        assert_eq!(admitted(&a, &[0.65; 4]), 0);
        // Other buckets keep their midpoints.
        assert_eq!(admitted(&a, &[0.99; 4]), 4);
    }

    /// A draft model asked again within a round, after a cheaper drafter took a position
    /// over (the dynamic cascade asks it position by position), counts as declined once a
    /// round at most, and once it has drafted in the round it is neither declined nor retried.
    #[test]
    fn a_draft_model_asked_again_within_a_round_is_declined_and_retried_once_at_most() {
        let (model, copy): (Source, Source) = ("m".into(), "c".into());
        let mut a = Adaptive::new(verify());
        // A 35 ms forward at the fresh 0.8 acceptance does not pay at 20 tokens/s (0.8 tokens
        // for 35 ms and a 10 ms verify row, 0.9 tokens' time); always right, it would (a
        // retry is possible).
        let ask = |gate: &mut Gate| gate.worth_drafting(&model, 0.035, 0.035, 8);
        let mut gate = Gate::adaptive(a.clone());
        assert!(!ask(&mut gate));
        assert!(gate.admit(&copy, Some(0.99)));
        assert!(!ask(&mut gate));
        a.learn(&gate, 1, &outcomes(&gate, 1));
        assert_eq!(a.calibration("m").unwrap().waited, 1);
        // The next round it is retried (it waited one round), drafts, and after the copy is
        // asked again: not retried a second time.
        let mut gate = Gate::adaptive(a.clone());
        assert!(ask(&mut gate));
        assert!(gate.admit(&model, Some(0.99)));
        assert!(gate.admit(&copy, Some(0.99)));
        assert!(!ask(&mut gate));
        a.learn(&gate, 0, &outcomes(&gate, 0));
        let c = a.calibration("m").unwrap();
        assert_eq!((c.waited, c.backoff), (0, 2));
    }

    #[test]
    fn a_fixed_gate_admits_everything_and_predicts_nothing() {
        let mut gate = Gate::fixed();
        let s: Source = "d".into();
        assert!((0..100).all(|_| gate.admit(&s, Some(0.0))));
        assert!(gate.worth_drafting(&s, 1e9, 1e9, 1));
        assert_eq!(gate.prediction(), None);
    }
}
