//! The drafter contract: what a drafter is asked ([`Request`]), what it answers ([`Draft`]),
//! and the [`Drafter`] trait that neural models, tables, Max-Gram, cascades and plug-ins all
//! implement, so that any tree of them composes over a target.

use crate::costs::ForwardCost;
use crate::engine::SourceBuckets;
use crate::error::{Error, Result};
use crate::gate::{Gate, Source};
use crate::review::ReviewCounts;
use crate::sampling::{Dist, Rng, Sampling};
use serde::{Serialize, Serializer};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Proposed tokens, each with the distribution it was drawn from (`q` in the papers). A
/// deterministic drafter reports point masses.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    tokens: Vec<u32>,
    dists: Vec<Dist>,
}

impl Draft {
    /// An empty draft.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `token`, drawn from `dist`.
    pub fn push(&mut self, token: u32, dist: Dist) {
        self.tokens.push(token);
        self.dists.push(dist);
    }

    /// Appends another draft's tokens.
    pub fn append(&mut self, other: Draft) {
        self.tokens.extend(other.tokens);
        self.dists.extend(other.dists);
    }

    /// The drafted tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The distribution each token was drawn from.
    pub fn dists(&self) -> &[Dist] {
        &self.dists
    }

    /// Number of drafted tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether nothing was drafted.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.dists.truncate(len);
    }
}

/// What a drafter is asked for: up to [`Request::remaining`] tokens continuing a context,
/// sampled with [`Request::sampling`] from [`Request::rng`].
///
/// Before each token, a drafter calls [`Request::admit`] with its confidence in that token and
/// stops at the first `false`. The answer depends only on what the drafter knew before sampling
/// the token (its distribution for that position, its state, the committed text and past
/// reviews), never on the reviewer's view of the draft, so the review stays exact. With a
/// fixed draft length the gate admits up to the length; an adaptive one stops where the
/// expected tokens per second of the round are highest. A drafter stops after a token that ends
/// the generation ([`Request::ends`]): nothing after it could be kept.
pub struct Request<'a> {
    sampling: &'a Sampling,
    rng: &'a mut Rng,
    gate: &'a mut Gate,
    source: Source,
    /// The most tokens this request may admit, and how many it has.
    cap: usize,
    used: usize,
    /// The most tokens this drafter's run may reach from where this request began: the
    /// horizon over which its forwards are weighed ([`Request::worth_drafting`]); `cap`
    /// except for a drafter asked one token at a time ([`Request::step`]).
    horizon: usize,
    /// Whether the gate declined a token (rather than the cap ending the draft).
    declined: bool,
    /// The reviewer's vocabulary size: token ids must be below it.
    vocab: usize,
    /// Set when the generation is cancelled (its client left).
    cancel: Option<Arc<AtomicBool>>,
    /// The tokens the generation stops at (end of sequence): nothing drafted after one of
    /// them could be kept.
    ends: Arc<[u32]>,
}

impl<'a> Request<'a> {
    /// A request to `source` for up to `cap` tokens, admitted through `gate`, for a reviewer
    /// of `vocab` tokens.
    pub fn new(
        sampling: &'a Sampling,
        rng: &'a mut Rng,
        gate: &'a mut Gate,
        source: Source,
        cap: usize,
        vocab: usize,
    ) -> Self {
        Self {
            sampling,
            rng,
            gate,
            source,
            cap,
            used: 0,
            horizon: cap,
            declined: false,
            vocab,
            cancel: None,
            ends: Arc::new([]),
        }
    }

    /// The same request, given up when `cancel` is set (a drafter's long reading of the
    /// prompt stops between chunks).
    pub fn with_cancel(mut self, cancel: Option<Arc<AtomicBool>>) -> Self {
        self.cancel = cancel;
        self
    }

    /// The same request, for a generation that stops at any of `ends` (its end-of-sequence
    /// tokens; none when it goes on past them).
    pub fn with_ends(mut self, ends: Arc<[u32]>) -> Self {
        self.ends = ends;
        self
    }

    /// Whether `token` ends the generation: a drafter stops after proposing it, since nothing
    /// after it could be kept (the reviewer cuts a draft there in any case).
    pub fn ends(&self, token: u32) -> bool {
        self.ends.contains(&token)
    }

    /// Whether `draft` holds a token that ends the generation: a cascade asks no part for more.
    pub fn ended(&self, draft: &Draft) -> bool {
        draft.tokens().iter().any(|&t| self.ends(t))
    }

    /// The tokens the generation stops at, for a cascade to pass on to its own reviews.
    pub fn end_tokens(&self) -> Arc<[u32]> {
        self.ends.clone()
    }

    /// Whether the generation was cancelled: a drafter should return what it has.
    pub fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
    }

    /// The flag [`Request::cancelled`] reads, for a cascade to pass on to its own reviews.
    pub fn cancel_flag(&self) -> Option<Arc<AtomicBool>> {
        self.cancel.clone()
    }

    /// Tokens this drafter may still propose (an upper bound: [`Request::admit`] may stop it
    /// earlier).
    pub fn remaining(&self) -> usize {
        self.cap.saturating_sub(self.used)
    }

    /// The sampling settings drafts are drawn with.
    pub fn sampling(&self) -> &Sampling {
        self.sampling
    }

    /// The generator a drafter draws its randomness from.
    pub fn rng(&mut self) -> &mut Rng {
        self.rng
    }

    /// Asks to propose one more token, with the drafter's `confidence` in it (a probability-like
    /// score in [0, 1] that grows with the chance of acceptance, computed before the token is
    /// sampled; `None` if the drafter has none). Returns false when the draft should stop here,
    /// and from then on: a position the gate declined ends the draft, as the gate's plan of the
    /// round assumes.
    pub fn admit(&mut self, confidence: Option<f32>) -> bool {
        if self.used >= self.cap || self.declined {
            return false;
        }
        if !self.gate.admit(&self.source, confidence) {
            self.declined = true;
            return false;
        }
        self.used += 1;
        true
    }

    /// Whether the gate declined a token of this request: asked again at the same place, the
    /// drafter would be declined again.
    pub fn declined(&self) -> bool {
        self.declined
    }

    /// Whether another token is worth `cost` seconds of drafting, before paying for it (a
    /// neural drafter asks before each forward pass), when each later token of the drafter's
    /// run would cost `then` seconds (a draft model's first forward of a round also catches
    /// up on the text since its last draft, so it costs more than the ones after it).
    pub fn worth_drafting(&mut self, cost: f64, then: f64) -> bool {
        let max = self.horizon_left();
        self.remaining() > 0 && self.gate.worth_drafting(&self.source, cost, then, max)
    }

    /// Tokens this drafter's run may still reach: what its next forward is weighed over.
    fn horizon_left(&self) -> usize {
        self.horizon.saturating_sub(self.used)
    }

    /// Whether to spend `cost` seconds reading the text before a first draft (a draft model
    /// prefilling the prompt): a one-time cost that only later rounds repay, so it is weighed
    /// against the rest of the generation rather than this round. If not, the drafter proposes
    /// nothing this round.
    pub fn worth_catching_up(&mut self, cost: f64) -> bool {
        let max = self.horizon_left();
        self.gate.worth_catching_up(&self.source, cost, None, max)
    }

    /// [`Request::worth_catching_up`] for a model of measured `cost` (free if unknown) reading
    /// `tokens` of text from the start (a prefill: on average each token attends to half),
    /// and only if drafting with it, at that cost, is expected to save more than the reading.
    pub fn worth_reading(&mut self, tokens: usize, cost: Option<&ForwardCost>) -> bool {
        let max = self.horizon_left();
        let Some(c) = cost else {
            return self.gate.worth_catching_up(&self.source, 0.0, None, max);
        };
        // After reading, a round's first forward feeds two tokens (the reviewer's last and
        // the new one), the others one.
        let run = (c.seconds_at(2, tokens), c.seconds_at(1, tokens));
        self.gate.worth_catching_up(
            &self.source,
            c.seconds_at(tokens, tokens / 2),
            Some(run),
            max,
        )
    }

    /// Tokens admitted through this request so far.
    pub fn admitted(&self) -> usize {
        self.used
    }

    /// A request for a part of this draft: up to `cap` more tokens from `source`, sharing this
    /// request's gate (a horizontal cascade asks its parts this way).
    pub fn part(&mut self, source: &Source, cap: usize) -> Request<'_> {
        let cap = cap.min(self.remaining());
        self.part_within(source, cap, cap)
    }

    /// A part of one token whose drafter's forwards are still weighed over the rest of the
    /// draft: for a draft model taking turns with cheaper drafters position by position (its
    /// run goes on at the next ask, unless a cheaper one has taken the position).
    pub fn step(&mut self, source: &Source) -> Request<'_> {
        let (cap, horizon) = (self.remaining().min(1), self.horizon_left());
        self.part_within(source, cap, horizon)
    }

    fn part_within(&mut self, source: &Source, cap: usize, horizon: usize) -> Request<'_> {
        Request {
            sampling: self.sampling,
            rng: self.rng,
            gate: self.gate,
            source: source.clone(),
            cap,
            used: 0,
            horizon,
            declined: false,
            vocab: self.vocab,
            cancel: self.cancel.clone(),
            ends: self.ends.clone(),
        }
    }

    /// Counts `n` tokens a part admitted toward this request's cap (a draft longer than the
    /// cap, or than what was admitted and counted, fails [`Request::check`]).
    pub fn count_part(&mut self, n: usize) {
        self.used += n;
    }

    /// Whether the reviewer's vocabulary has `token`: a copied id may lie beyond a reviewer
    /// whose vocabulary is the beginning of the target's.
    pub fn fits(&self, token: u32) -> bool {
        (token as usize) < self.vocab
    }

    /// Marks this request as declined by the gate: for a cascade that, asked again where its
    /// draft ends, would be declined again there (one of its parts was).
    pub fn set_declined(&mut self) {
        self.declined = true;
    }

    /// Holds a drafter's answer to its contract: exactly the tokens admitted, no more than
    /// asked, one distribution per token, ids inside the reviewer's vocabulary, probabilities
    /// that sum to 1 within 1e-3. `who` names the drafter in the error. A dense distribution over fewer ids than
    /// the reviewer's (a drafter model whose vocabulary is the beginning of the target's) is
    /// filled in with zeros. A distribution off by more than rounding
    /// (in f64) but within that bound is rescaled to sum to 1: sampling normalizes its
    /// weights, so the token was drawn from the rescaled one, and the review must read its q.
    pub fn check(&self, draft: &mut Draft, who: &str) -> Result<()> {
        let vocab = self.vocab;
        let broke = |what: String| Err(Error::Drafter(format!("`{who}` {what}")));
        if draft.tokens.len() != draft.dists.len() {
            return broke(format!(
                "returned {} tokens but {} distributions",
                draft.tokens.len(),
                draft.dists.len()
            ));
        }
        if draft.len() > self.cap {
            return broke(format!(
                "returned {} tokens, more than the {} asked",
                draft.len(),
                self.cap
            ));
        }
        if draft.len() != self.used {
            return broke(format!(
                "returned {} tokens but {} were admitted (call `Request::admit` once before each token)",
                draft.len(),
                self.used
            ));
        }
        if let Some(&t) = draft.tokens.iter().find(|&&t| t as usize >= vocab) {
            return broke(format!(
                "proposed token id {t}, outside the vocabulary ({vocab} tokens)"
            ));
        }
        for (i, (&t, dist)) in draft.tokens.iter().zip(&mut draft.dists).enumerate() {
            let inside = match dist {
                Dist::Point(x) => (*x as usize) < vocab,
                Dist::Dense(p) => p.len() <= vocab,
                Dist::Sparse(s) => s.iter().all(|&(x, _)| (x as usize) < vocab),
            };
            if !inside {
                return broke(format!(
                    "reported a distribution at position {i} that does not fit the vocabulary ({vocab} tokens; a dense one has at most one probability per token)"
                ));
            }
            // The review reads q(x) as given, while sampling normalizes: weights that do not
            // sum to 1, or a token listed twice, would misstate what the token was drawn from.
            let total = match dist {
                Dist::Point(_) => 1.0,
                Dist::Dense(p) => sum(p),
                Dist::Sparse(s) => {
                    let mut ids: Vec<u32> = s.iter().map(|&(x, _)| x).collect();
                    ids.sort_unstable();
                    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
                        return broke(format!(
                            "reported a sparse distribution at position {i} that lists token {} twice",
                            w[0]
                        ));
                    }
                    s.iter()
                        .map(|&(_, p)| if p >= 0.0 { f64::from(p) } else { f64::NAN })
                        .sum()
                }
            };
            if total.is_nan() {
                return broke(format!(
                    "reported a distribution at position {i} with a negative or NaN probability"
                ));
            }
            if (total - 1.0).abs() > 1e-3 {
                return broke(format!(
                    "reported a distribution at position {i} whose probabilities sum to {}, not 1",
                    total as f32
                ));
            }
            if (total - 1.0).abs() > f64::from(f32::EPSILON) {
                dist.rescale(1.0 / total);
            }
            // A drafter of a narrower vocabulary (the beginning of the reviewer's) gives the
            // ids it lacks no probability.
            if let Dist::Dense(p) = dist {
                p.resize(vocab, 0.0);
            }
            let p = dist.prob(t);
            if p.is_nan() || p <= 0.0 {
                return broke(format!(
                    "proposed token {t} at position {i}, to which the distribution reported with it gives probability {p} (report the distribution the token was drawn from)"
                ));
            }
        }
        Ok(())
    }
}

/// The sum of probabilities in f64, as sampling adds them; NaN if one is negative or NaN
/// (eight lanes: vectorized).
fn sum(p: &[f32]) -> f64 {
    let checked = |v: f32| if v >= 0.0 { f64::from(v) } else { f64::NAN };
    let mut lanes = [0.0f64; 8];
    let mut chunks = p.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += checked(v);
        }
    }
    let rest: f64 = chunks.remainder().iter().map(|&v| checked(v)).sum();
    lanes.iter().sum::<f64>() + rest
}

/// A greedy draft of up to `k` tokens (the unit tests' drafters use ids below 2^20).
#[cfg(test)]
pub(crate) fn propose(drafter: &mut dyn Drafter, context: &[u32], k: usize) -> Draft {
    propose_ending(drafter, context, k, &[])
}

/// [`propose`] for a generation that stops at `ends`.
#[cfg(test)]
pub(crate) fn propose_ending(
    drafter: &mut dyn Drafter,
    context: &[u32],
    k: usize,
    ends: &[u32],
) -> Draft {
    use rand::SeedableRng;
    let mut rng = Rng::seed_from_u64(0);
    let sampling = Sampling::greedy();
    propose_within(
        drafter,
        context,
        (k, 1 << 20),
        &sampling,
        &mut rng,
        ends.into(),
    )
    .expect("the drafter failed")
}

/// Refuses a draft length `k` above [`MAX_DRAFT`](crate::config::MAX_DRAFT), as a config
/// does, for callers that set it in code (a draft's logits take a row of the vocabulary each).
pub(crate) fn check_draft_length(k: usize) -> Result<()> {
    let most = crate::config::MAX_DRAFT;
    match k <= most {
        true => Ok(()),
        false => Err(Error::config(
            "k",
            format!("must be at most {most} (tokens drafted per target call), got {k}"),
        )),
    }
}

/// One draft of up to `k` tokens (at most [`MAX_DRAFT`](crate::config::MAX_DRAFT), as in a
/// config) from `drafter` with a fixed-length gate, held to the contract for a reviewer of
/// `vocab` tokens: for a library user trying a drafter on its own. Returns the drafter's errors
/// and contract violations. It asks for one draft only: it does not call
/// [`Drafter::start`] or [`Drafter::commit`], which a generation calls around its drafts
/// (a drafter that reads the text there should be started on `context` first).
pub fn try_propose(
    drafter: &mut dyn Drafter,
    context: &[u32],
    k: usize,
    vocab: usize,
    sampling: &Sampling,
    rng: &mut Rng,
) -> Result<Draft> {
    check_draft_length(k)?;
    propose_within(drafter, context, (k, vocab), sampling, rng, Arc::new([]))
}

/// [`try_propose`] for a generation that stops at `ends`.
fn propose_within(
    drafter: &mut dyn Drafter,
    context: &[u32],
    (k, vocab): (usize, usize),
    sampling: &Sampling,
    rng: &mut Rng,
    ends: Arc<[u32]>,
) -> Result<Draft> {
    let mut gate = Gate::fixed();
    let source = drafter.name().into();
    let mut request = Request::new(sampling, rng, &mut gate, source, k, vocab).with_ends(ends);
    let mut draft = drafter.draft(context, &mut request)?;
    request.check(&mut draft, drafter.name())?;
    Ok(draft)
}

/// A source of draft tokens.
///
/// The caller owns the sequence and passes it whole. Between two [`Drafter::commit`] calls the
/// contexts passed to [`Drafter::draft`] all extend the last committed sequence, possibly with
/// speculative tokens (inside a cascade, tokens another drafter or a reviewer produced). A
/// drafter keeps whatever state it likes (a KV cache, an index) and drops what no longer
/// matches. Plug-ins implement it and are used as `Box<dyn Drafter>`, or named in configs
/// through a [`Registry`](crate::config::Registry).
pub trait Drafter: Send {
    /// A short name for reports and for the adaptive gate's learned acceptance, which is kept
    /// per name and review level (drafters that share a name there share what is learned).
    fn name(&self) -> &str;

    /// Proposes tokens continuing `context`, asking `request` to admit each one first (see
    /// [`Request`]) and returning exactly the admitted ones (possibly none). Each token must be drawn from
    /// the distribution reported with it, computed with `request.sampling()` (at temperature
    /// 0, its argmax): the review is exact only then.
    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft>;

    /// A new sequence begins with `prompt`: its counters start over. A draft model may keep
    /// the part of its cache the new prompt repeats from the previous sequence.
    fn start(&mut self, _prompt: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Drops what a draft model cached of earlier sequences, so that the next one is read
    /// from its first token (benches measure each generation on its own).
    fn forget(&mut self) {}

    /// The committed sequence is now `context`: it extends the previous committed sequence
    /// (with a prefix of the last draft and the reviewer's token). It will not change again.
    fn commit(&mut self, _context: &[u32]) {}

    /// The sequence ended, having generated `output` after its prompt (at an end-of-sequence
    /// token, the length limit, a stop string or the context's end; not when the generation
    /// failed or was cancelled). A drafter that learns across sequences records it here
    /// (Max-Gram's history file). An error does not lose the output: the engine reports it
    /// among the generation's warnings.
    fn finish(&mut self, _output: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Counters of this node and the nodes below it.
    fn stats(&self) -> NodeStats {
        NodeStats::new(self.name(), NodeKind::Plugin("plugin".into()))
    }
}

/// What kind of node of a drafter tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeKind {
    /// A neural model drafting token by token.
    Model,
    /// A bigram table.
    Bigram,
    /// Max-Gram.
    MaxGram,
    /// Copies from text the client expects back (a server request's `prediction`).
    Prediction,
    /// A reviewer model over an inner drafter: its reviews are a cascade level.
    Vertical,
    /// Parts of one draft from several drafters, in a fixed schedule.
    Horizontal,
    /// Parts of one draft from several drafters, each drafting while its confidence pays.
    Adaptive,
    /// A plug-in, with the kind its `stats` names (`plugin` unless it overrides
    /// [`Drafter::stats`]). An adaptive cascade asks a part of kind [`NodeKind::Model`] one
    /// token at a time, any other for a run.
    Plugin(String),
}

impl NodeKind {
    /// The name used in configs and reports.
    pub fn name(&self) -> &str {
        match self {
            NodeKind::Model => "model",
            NodeKind::Bigram => "bigram",
            NodeKind::MaxGram => "max_gram",
            NodeKind::Prediction => "prediction",
            NodeKind::Vertical => "vertical",
            NodeKind::Horizontal => "horizontal",
            NodeKind::Adaptive => "adaptive",
            NodeKind::Plugin(kind) => kind,
        }
    }
}

impl Serialize for NodeKind {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Counters of one node of a drafter tree, since the sequence started.
#[derive(Clone, Debug, Serialize)]
pub struct NodeStats {
    /// The node's name.
    pub name: String,
    /// What the node is.
    pub kind: NodeKind,
    /// This node's own model (its instance name), if it has one.
    pub model: Option<String>,
    /// Forward passes of this node's own model (drafting or reviewing).
    pub forward_calls: usize,
    /// For a reviewing node: its reviews of the inner drafter's proposals, by position.
    #[serde(flatten)]
    pub reviews: ReviewCounts,
    /// For a reviewing node with adaptive drafting: its reviews by confidence bucket.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub acceptance_by_confidence: Vec<SourceBuckets>,
    /// The counters of the nodes under this one.
    pub children: Vec<NodeStats>,
}

impl NodeStats {
    /// A node with no model and no counters yet.
    pub fn new(name: &str, kind: NodeKind) -> Self {
        Self {
            name: name.to_string(),
            kind,
            model: None,
            forward_calls: 0,
            reviews: ReviewCounts::default(),
            acceptance_by_confidence: Vec::new(),
            children: Vec::new(),
        }
    }

    /// Forward passes per model over the whole tree.
    pub fn model_calls(&self, into: &mut BTreeMap<String, usize>) {
        if let Some(m) = &self.model {
            *into.entry(m.clone()).or_default() += self.forward_calls;
        }
        self.children.iter().for_each(|c| c.model_calls(into));
    }

    /// Calls `f` on this node and every node below it, parents first.
    pub fn visit(&self, f: &mut dyn FnMut(&NodeStats)) {
        f(self);
        self.children.iter().for_each(|c| c.visit(f));
    }
}
