//! `cascade plan`: draft lengths, schedules and K matrices from what a bench report measured.
//!
//! Every review in a config's tree is planned with the same formula, because it is the same
//! operation: the target reviewing its draft, and each vertical cascade's reviewer reviewing
//! its inner drafter's. For a review level, the draft under it is split between drafters
//! (one drafter, or a horizontal schedule), and each split is rated by CS Drafting's
//! Theorem 4.1 with this machine's costs ([`theory::split_improvement`]): the acceptance `a_i`
//! and fill measured per position under the current split, the reviewer's measured forward
//! cost `c r(x)` for the `x` tokens it scores, and what the drafters cost.
//!
//! Levels are planned bottom-up. A vertical cascade's cost of emitting `n` tokens
//! ([`theory::emission_costs`]) under its best inner split becomes the cost of its part at
//! the level above; its inner split is chosen for the share of positions that level gives it
//! now.

use crate::bench::{Report, RunRecord};
use crate::config::{
    file_label, DrafterNode, DrafterPlan, KMatrixRole, ModelPlan, Plan, RawConfig,
};
use crate::costs::interpolate;
use crate::error::{Error, Result};
use crate::gate::{midpoints, Priors, BUCKETS, BUCKET_EDGES, PRIOR};
use crate::review::ReviewCounts;
use crate::theory::{self, Segment};
use std::path::Path;

/// The most splits of a draft among its parts that one level's search rates (a million: a
/// few seconds); 3 parts up to K = 16 make 968, 7 up to 64 about 1.3 billion.
const MAX_SPLITS: u128 = 1_000_000;

/// The plan for one review level.
#[derive(Clone, Debug)]
pub struct LevelPlan {
    /// The reviewing node.
    pub reviewer: Reviewing,
    /// The draft node under it, and its parts (one for a single drafter).
    pub draft: NodeRef,
    /// The parts of the draft node (one for a single drafter).
    pub parts: Vec<NodeRef>,
    /// Each part's measured acceptance, fill and cost.
    pub segments: Vec<Segment>,
    /// The config's current split.
    pub current: Vec<usize>,
    /// At the target: predicted speedup. Inside the tree: target calls per emitted token for
    /// the share the level above gives this cascade (lower is better).
    pub rating: Rating,
    /// Splits, best first, with their rating with verify = 1 call (the papers) and with the
    /// measured verify cost.
    pub ranked: Vec<(Vec<usize>, f64, f64)>,
    /// The current split's rating with the measured verify cost.
    pub current_value: f64,
}

/// What a level's ratings measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rating {
    /// Predicted speedup over autoregressive decoding (higher is better).
    Speedup,
    /// Cost per emitted token, for a share of `n` tokens.
    CostPerToken {
        /// Tokens the level above asks of this cascade.
        share: usize,
    },
}

/// Who reviews at a level.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reviewing {
    /// The target model.
    Target,
    /// A vertical cascade of the tree.
    Cascade(NodeRef),
}

/// A node of the drafter tree, by name and, if it was expanded from a K matrix, its place there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRef {
    /// The node's name.
    pub name: String,
    /// Its place in a K matrix, if it was expanded from one.
    pub k_matrix: Option<KMatrixRole>,
}

impl NodeRef {
    fn of(node: &DrafterNode) -> Self {
        Self {
            name: node.name.clone(),
            k_matrix: node.k_matrix.clone(),
        }
    }
}

impl std::fmt::Display for NodeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl std::fmt::Display for Reviewing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reviewing::Target => f.write_str("target"),
            Reviewing::Cascade(n) => f.write_str(&n.name),
        }
    }
}

impl LevelPlan {
    /// The best split (planning ranks at least one).
    pub fn best(&self) -> &[usize] {
        &self.ranked[0].0
    }
}

/// What `cascade plan` prints for a level: its drafters' measured figures, the best splits,
/// the verdict, and a note where a pick rests on rates measured elsewhere.
impl std::fmt::Display for LevelPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rounded =
            |v: &[f64]| -> Vec<f64> { v.iter().map(|a| (a * 100.0).round() / 100.0).collect() };
        let what = match self.rating {
            Rating::Speedup => "predicted speedup".to_string(),
            Rating::CostPerToken { share } => format!("target calls per token, emitting {share}"),
        };
        let names: Vec<&str> = self.parts.iter().map(|p| p.name.as_str()).collect();
        writeln!(
            f,
            "{} reviews `{}` (drafting from {names:?}):",
            self.reviewer, self.draft
        )?;
        for (d, s) in self.parts.iter().zip(&self.segments) {
            let per_token = s.cost.get(1).copied().unwrap_or(0.0);
            // Past the measured positions (one per fill value), the pooled rate.
            let (measured, beyond) = s.accept.split_at(s.fill.len().min(s.accept.len()));
            let beyond = beyond
                .first()
                .map_or(String::new(), |a| format!(" then {a:.2}"));
            writeln!(
                f,
                "  {d}: kept by position {:?}{beyond} (not drafted counts as rejected), drafted in {:?} of reviews, {per_token:.3} target calls for one token",
                rounded(measured),
                rounded(&s.fill),
            )?;
        }
        writeln!(f, "| counts | {what} (verify = 1 call, the papers) | {what} (measured verify cost) |\n|---|---|---|")?;
        for (counts, paper, measured) in self.ranked.iter().take(8) {
            writeln!(f, "| {counts:?} | {paper:.3} | {measured:.3} |")?;
        }
        let (best, value) = (self.best(), self.ranked[0].2);
        let verdict = match self.rating {
            Rating::Speedup if value < 1.0 => ", slower than autoregressive decoding",
            _ => "",
        };
        write!(
            f,
            "current {:?}: {:.3}; best with the report's costs: {best:?} ({value:.3}{verdict})",
            self.current, self.current_value
        )?;
        // A part moved to earlier positions keeps the rates measured where it was: a guess.
        let starts = |counts: &[usize]| -> Vec<usize> {
            counts
                .iter()
                .scan(0, |at, n| Some(std::mem::replace(at, *at + n)))
                .collect()
        };
        for ((d, now), (then, n)) in self
            .parts
            .iter()
            .zip(starts(&self.current))
            .zip(starts(best).into_iter().zip(best))
        {
            if *n > 0 && then < now {
                write!(
                    f,
                    "\n  note: `{d}` was measured from position {} on; the best split puts it at {} with the same rates, so bench the written config to confirm",
                    now + 1,
                    then + 1
                )?;
            }
        }
        Ok(())
    }
}

/// What a bench report measured for one config.
pub struct Measured<'a> {
    report: &'a Report,
    runs: Vec<&'a RunRecord>,
}

impl<'a> Measured<'a> {
    /// A planner over `report`'s measurements of config `label`.
    pub fn new(report: &'a Report, label: &str) -> Result<Self> {
        let runs: Vec<&RunRecord> = report.runs.iter().filter(|r| r.config == label).collect();
        if runs.is_empty() {
            return Err(Error::Plan(format!(
                "the report has no results for config `{label}`"
            )));
        }
        if runs.iter().all(|r| r.drafted == 0) {
            return Err(Error::Plan(format!(
                "config `{label}` drafted nothing in the report: nothing to plan from"
            )));
        }
        Ok(Self { report, runs })
    }

    fn target_reviews(&self) -> ReviewCounts {
        let mut c = ReviewCounts::default();
        self.runs.iter().for_each(|r| c.add(&r.target));
        c
    }

    fn level_reviews(&self, node: &str) -> ReviewCounts {
        let mut c = ReviewCounts::default();
        for l in self.runs.iter().flat_map(|r| &r.levels) {
            if l.node == node {
                c.add(&l.reviews);
            }
        }
        c
    }

    /// A model's measured cost c and its forward cost points r(k); with a vocabulary trimmed
    /// to its `trimmed` most frequent tokens, the cost measured for the smallest trimmed set at
    /// least that large (a set holds the end-of-sequence tokens too, and a larger one costs
    /// more: an upper bound), else the whole model's.
    fn cost(&self, model: &ModelPlan, trimmed: Option<usize>) -> Result<(f64, &'a [(usize, f64)])> {
        let name = file_label(&model.path);
        let models = &self.report.models;
        let smallest_trimmed = trimmed.and_then(|n| {
            let sizes = models
                .iter()
                .filter_map(|m| Some((crate::costs::trimmed_size(&m.model, &name)?, m)));
            sizes
                .filter(|&(size, _)| size >= n)
                .min_by_key(|&(size, _)| size)
        });
        let m = smallest_trimmed
            .map(|(_, m)| m)
            .or_else(|| models.iter().find(|m| m.model == name));
        let m = m.ok_or_else(|| Error::Plan(format!("the report has no cost for `{name}`")))?;
        let r = &m.forward_cost;
        if !crate::costs::well_formed_ratios(r) {
            return Err(Error::Plan(format!(
                "the report's forward_cost of `{name}` must be (1, 1.0) then points of increasing k"
            )));
        }
        Ok((m.c_measured, r))
    }
}

/// One drafter's reviews at the target by confidence bucket, summed over a config's runs: where
/// an adaptive gate's estimates can start (`[target.acceptance]`) instead of bucket midpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredAcceptance {
    /// The drafter's name.
    pub drafter: String,
    /// Positions reviewed and accepted, per bucket.
    pub reviewed: [u64; BUCKETS],
    /// Of those, accepted.
    pub accepted: [u64; BUCKETS],
}

impl MeasuredAcceptance {
    /// Per bucket, the acceptance the gate would estimate after these reviews: the measured
    /// rate, pulled toward the bucket's midpoint with the gate's own prior weight (so a bucket
    /// with few reviews stays near it), to three decimals.
    pub fn priors(&self) -> Priors {
        let mid = midpoints();
        std::array::from_fn(|b| {
            let p = (self.accepted[b] as f64 + PRIOR * mid[b]) / (self.reviewed[b] as f64 + PRIOR);
            (p * 1000.0).round() / 1000.0
        })
    }
}

impl std::fmt::Display for MeasuredAcceptance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "| {} |", self.drafter)?;
        for (p, n) in self.priors().iter().zip(&self.reviewed) {
            write!(f, " {p:.2} ({n}) |")?;
        }
        Ok(())
    }
}

/// The header of a table of [`MeasuredAcceptance`] rows.
pub fn acceptance_header() -> String {
    let mut low = 0.0;
    let mut cols: Vec<String> = BUCKET_EDGES
        .iter()
        .map(|&e| {
            let c = format!("{low:.2}-{e:.2}");
            low = e;
            c
        })
        .collect();
    cols.push("none".into());
    format!(
        "| drafter | {} |\n|---|{}",
        cols.join(" | "),
        "---|".repeat(cols.len())
    )
}

impl Measured<'_> {
    /// Every drafter's reviews at the target by confidence bucket (empty if the config did not
    /// size its drafts adaptively).
    pub fn acceptance(&self) -> Vec<MeasuredAcceptance> {
        let mut out: Vec<MeasuredAcceptance> = Vec::new();
        for s in self.runs.iter().flat_map(|r| &r.acceptance_by_confidence) {
            let i = match out.iter().position(|m| m.drafter == s.drafter) {
                Some(i) => i,
                None => {
                    out.push(MeasuredAcceptance {
                        drafter: s.drafter.clone(),
                        reviewed: [0; BUCKETS],
                        accepted: [0; BUCKETS],
                    });
                    out.len() - 1
                }
            };
            for c in &s.buckets {
                let b = c
                    .up_to
                    .and_then(|e| BUCKET_EDGES.iter().position(|&x| x == e))
                    .unwrap_or(BUCKETS - 1);
                out[i].reviewed[b] += c.reviewed;
                out[i].accepted[b] += c.accepted;
            }
        }
        out
    }
}

/// Writes measured acceptance into the config document as `[target.acceptance]`.
pub fn write_acceptance(doc: &mut toml::Value, measured: &[MeasuredAcceptance]) -> Result<()> {
    let table: toml::map::Map<String, toml::Value> = measured
        .iter()
        .map(|m| {
            let values = m.priors().iter().map(|&p| toml::Value::Float(p)).collect();
            (m.drafter.clone(), toml::Value::Array(values))
        })
        .collect();
    *entry(doc, &["target", "acceptance"])? = toml::Value::Table(table);
    Ok(())
}

/// Plans every review level of `plan` (bottom-up; the target's last) for drafts of at most
/// `max_k` tokens.
pub fn plan_levels(m: &Measured, plan: &Plan, max_k: usize) -> Result<Vec<LevelPlan>> {
    let drafter = plan
        .drafter
        .as_ref()
        .ok_or_else(|| Error::Plan("the config has no drafter: nothing to plan".into()))?;
    let mut levels = Vec::new();
    let k = plan.options.k;
    let reviews = m.target_reviews();
    let (_, verify) = m.cost(&plan.target, None)?;
    let level = Level {
        reviewer: Reviewing::Target,
        c: 1.0,
        verify,
        share: k,
    };
    plan_level(m, &level, drafter, k, &reviews, max_k, &mut levels)?;
    Ok(levels)
}

/// A reviewer: who, its cost per one-token forward (target calls), r(k), and the number of
/// tokens the level above wants from it per draft.
struct Level<'a> {
    reviewer: Reviewing,
    c: f64,
    verify: &'a [(usize, f64)],
    share: usize,
}

/// A part's costs: drafting `n` tokens with the current settings below it, and with the best.
struct PartCost {
    current: Vec<f64>,
    best: Vec<f64>,
}

fn plan_level(
    m: &Measured,
    level: &Level,
    draft: &DrafterNode,
    k: usize,
    reviews: &ReviewCounts,
    max_k: usize,
    out: &mut Vec<LevelPlan>,
) -> Result<PartCost> {
    let parts: Vec<(&DrafterNode, usize)> = match &draft.kind {
        DrafterPlan::Horizontal { parts } => parts.iter().map(|(d, n)| (d, *n)).collect(),
        _ => vec![(draft, k)],
    };
    // A schedule longer than the level's `k` drafts only its first `k` positions.
    let mut left = k;
    let current: Vec<usize> = parts
        .iter()
        .map(|&(_, n)| {
            let n = n.min(left);
            left -= n;
            n
        })
        .collect();
    // The measured acceptance and fill, cut at the current split. Beyond a part's measured
    // positions, its acceptance is the rate pooled over them (not the last position's, which
    // rests on the fewest reviews).
    let (accept, fill) = (reviews.chain_acceptance(), reviews.fill());
    let cut = |v: &[f64], from: usize, n: usize| -> Vec<f64> {
        let end = (from + n).min(v.len());
        v[from.min(end)..end].to_vec()
    };
    let pooled = |from: usize, n: usize| -> Option<f64> {
        let at = |i: usize| reviews.accepted_at.get(i).copied().unwrap_or(0) as f64;
        let before = |i: usize| {
            if i == 0 {
                reviews.reviews as f64
            } else {
                at(i - 1)
            }
        };
        let range = from..(from + n).min(reviews.accepted_at.len());
        let tried: f64 = range.clone().map(before).sum();
        (tried > 0.0).then(|| range.map(at).sum::<f64>() / tried)
    };
    let horizon = max_k.max(k);
    let mut segments_now = Vec::new();
    let mut segments_best = Vec::new();
    let mut offset = 0;
    for (i, &(node, _)) in parts.iter().enumerate() {
        // A single drafter's measured positions all belong to it.
        let n = if parts.len() == 1 {
            accept.len()
        } else {
            current[i]
        };
        let cost = part_cost(m, node, current[i], horizon, out)?;
        let mut measured_accept = cut(&accept, offset, n);
        measured_accept.extend(pooled(offset, n));
        let seg = |cost: Vec<f64>| Segment {
            accept: measured_accept.clone(),
            fill: cut(&fill, offset, n),
            cost,
        };
        segments_now.push(seg(cost.current));
        segments_best.push(seg(cost.best));
        offset += n;
    }
    let (c, r) = (level.c, level.verify);
    let measured = move |x: f64| c * interpolate(r, x);
    let paper = move |_: f64| c;
    let target = level.reviewer == Reviewing::Target;
    let rating = if target {
        Rating::Speedup
    } else {
        Rating::CostPerToken {
            share: level.share.max(1),
        }
    };
    let rate = |segs: &[Segment], counts: &[usize], verify: &dyn Fn(f64) -> f64| -> f64 {
        match rating {
            Rating::Speedup => theory::split_improvement(segs, counts, verify),
            Rating::CostPerToken { share } => {
                theory::emission_costs(segs, counts, verify, share)[share] / share as f64
            }
        }
    };
    let count = theory::split_count(parts.len(), max_k);
    if count > MAX_SPLITS {
        return Err(Error::Plan(format!(
            "{} drafters sharing up to {max_k} positions make {count} splits to rate, more \
             than {MAX_SPLITS}: give a smaller --max-k",
            parts.len()
        )));
    }
    let mut ranked: Vec<(Vec<usize>, f64, f64)> = theory::splits(parts.len(), max_k)
        .into_iter()
        .map(|s| {
            let p = rate(&segments_best, &s, &paper);
            let v = rate(&segments_best, &s, &measured);
            (s, p, v)
        })
        .collect();
    let better = |a: f64, b: f64| {
        if target {
            b.total_cmp(&a)
        } else {
            a.total_cmp(&b)
        }
    };
    ranked.sort_by(|a, b| better(a.2, b.2));
    if ranked.is_empty() {
        return Err(Error::Plan(format!(
            "`{}`: no split of at most {max_k} tokens to rate",
            draft.name
        )));
    }
    let current_value = rate(&segments_now, &current, &measured);
    let costs = PartCost {
        current: theory::emission_costs(&segments_now, &current, &measured, horizon),
        best: theory::emission_costs(&segments_best, &ranked[0].0, &measured, horizon),
    };
    out.push(LevelPlan {
        reviewer: level.reviewer.clone(),
        draft: NodeRef::of(draft),
        parts: parts.iter().map(|(d, _)| NodeRef::of(d)).collect(),
        segments: segments_best,
        current,
        rating,
        ranked,
        current_value,
    });
    Ok(costs)
}

/// What drafting `n` tokens costs a part, for `n` in `0..=horizon` (planning the levels
/// inside a vertical cascade first).
fn part_cost(
    m: &Measured,
    node: &DrafterNode,
    share: usize,
    horizon: usize,
    out: &mut Vec<LevelPlan>,
) -> Result<PartCost> {
    let linear = |c: f64| (0..=horizon).map(|n| n as f64 * c).collect::<Vec<_>>();
    Ok(match &node.kind {
        DrafterPlan::Model { model, vocabulary } => {
            let c = linear(m.cost(model, vocabulary.as_ref().map(|v| v.tokens))?.0);
            PartCost {
                current: c.clone(),
                best: c,
            }
        }
        DrafterPlan::Bigram { .. } | DrafterPlan::MaxGram { .. } => PartCost {
            current: linear(0.0),
            best: linear(0.0),
        },
        DrafterPlan::Vertical {
            reviewer, inner, k, ..
        } => {
            let (c, verify) = m.cost(reviewer, None)?;
            let level = Level {
                reviewer: Reviewing::Cascade(NodeRef::of(node)),
                c,
                verify,
                share,
            };
            let reviews = m.level_reviews(&node.name);
            plan_level(m, &level, inner, *k, &reviews, horizon, out)?
        }
        DrafterPlan::Horizontal { .. } => {
            return Err(Error::Plan(format!(
                "`{}`: a horizontal schedule directly inside another is not planned",
                node.name
            )))
        }
        DrafterPlan::Adaptive { .. } => {
            return Err(Error::Plan(format!(
                "`{}`: an adaptive cascade sizes its drafts while generating; it is not planned",
                node.name
            )))
        }
        DrafterPlan::Plugin { kind, .. } => {
            return Err(Error::Plan(format!(
                "`{}`: a plug-in drafter (kind `{kind}`) has no measured cost to plan with",
                node.name
            )))
        }
    })
}

/// Writes the best settings of `levels` into the config document `doc` (parsed from the
/// file `raw` was read from): draft lengths `k`, schedules, K-matrix rows and `last_k`.
/// Returns a warning for each K-matrix setting whose copies were planned otherwise: from two
/// reviewers on, a reviewer stands in several places of the tree, which share one row and one
/// `last_k`; the one planned last (nearest the target) is written.
pub fn write_best(
    raw: &RawConfig,
    doc: &mut toml::Value,
    levels: &[LevelPlan],
) -> Result<Vec<String>> {
    let _ = raw;
    // Each K-matrix setting written so far: its value and the place it was planned for.
    let mut written: Vec<(String, toml::Value, String)> = Vec::new();
    let mut warnings = Vec::new();
    let mut note = |key: String, value: &toml::Value, place: &str| match written
        .iter_mut()
        .find(|(k, ..)| *k == key)
    {
        Some((_, v, p)) if v != value => {
            warnings.push(format!(
                "{key}: planned {v} for `{p}` and {value} for `{place}`, which share it; \
                     wrote {value}"
            ));
            (*v, *p) = (value.clone(), place.to_string());
        }
        Some(_) => {}
        None => written.push((key, value.clone(), place.to_string())),
    };
    for l in levels {
        let best = l.best();
        let total = best.iter().sum::<usize>() as i64;
        // The reviewer's draft length.
        match &l.reviewer {
            Reviewing::Target => *entry(doc, &["target", "k"])? = total.into(),
            Reviewing::Cascade(NodeRef {
                name,
                k_matrix:
                    Some(KMatrixRole::Reviewer {
                        matrix,
                        index,
                        reviewers,
                    }),
                ..
            }) => {
                if index == reviewers {
                    let value = toml::Value::from(total);
                    note(format!("drafters.{matrix}.last_k"), &value, name);
                    *entry(doc, &["drafters", matrix, "last_k"])? = value;
                } // else the row written below sums to it
            }
            Reviewing::Cascade(n) => *entry(doc, &["drafters", &n.name, "k"])? = total.into(),
        }
        // The split.
        match &l.draft.k_matrix {
            Some(KMatrixRole::Level {
                matrix,
                row,
                reviewers,
            }) => {
                // Row `row` (1-based) has columns d_row..d_n and the last drafter.
                let mut cells = vec![0i64; reviewers + 2 - row];
                for (part, &count) in l.parts.iter().zip(best) {
                    let col = match &part.k_matrix {
                        Some(KMatrixRole::Reviewer { index, .. }) => index - row,
                        _ => reviewers + 1 - row,
                    };
                    cells[col] = count as i64;
                }
                let rows = entry(doc, &["drafters", matrix, "k_matrix"])?;
                let slot = rows
                    .as_array_mut()
                    .and_then(|r| r.get_mut(row - 1))
                    .ok_or_else(|| {
                        Error::Plan(format!("drafters.{matrix}.k_matrix lacks row {row}"))
                    })?;
                let value = toml::Value::Array(cells.into_iter().map(toml::Value::from).collect());
                note(
                    format!("drafters.{matrix}.k_matrix[{}]", row - 1),
                    &value,
                    &l.draft.name,
                );
                *slot = value;
            }
            _ if l.parts.len() > 1 => {
                let kept: Vec<toml::Value> = l
                    .parts
                    .iter()
                    .zip(best)
                    .filter(|(_, n)| **n > 0)
                    .map(|(d, n)| {
                        toml::Value::Array(vec![d.name.as_str().into(), (*n as i64).into()])
                    })
                    .collect();
                *entry(doc, &["drafters", &l.draft.name, "schedule"])? = toml::Value::Array(kept);
            }
            _ => {}
        }
    }
    Ok(warnings)
}

/// Makes the file paths of a config document absolute (relative ones are taken from `base`,
/// the config's folder), so that the written config works wherever it is written.
pub fn absolute_paths(doc: &mut toml::Value, base: &Path) {
    const PATH_KEYS: [&str; 7] = [
        "model",
        "tokenizer",
        "table",
        "vocabulary_table",
        "history",
        "reviewer",
        "reviewers",
    ];
    let fix = |v: &mut toml::Value| {
        if let Some(p) = v.as_str() {
            // A file not there yet (a history the first run creates) is made absolute too.
            let p = base.join(p);
            let p = std::fs::canonicalize(&p)
                .or_else(|_| std::path::absolute(&p))
                .unwrap_or(p);
            *v = p.display().to_string().into();
        } // a table is a hub source
    };
    let fix_section = |t: &mut toml::Value| {
        for key in PATH_KEYS {
            match t.get_mut(key) {
                Some(toml::Value::Array(a)) => a.iter_mut().for_each(fix),
                Some(v) => fix(v),
                None => {}
            }
        }
    };
    let Some(doc) = doc.as_table_mut() else {
        return;
    };
    for (name, section) in doc.iter_mut() {
        match name.as_str() {
            "target" => fix_section(section),
            "drafters" => section
                .as_table_mut()
                .into_iter()
                .flat_map(|d| d.iter_mut().map(|(_, v)| v))
                .for_each(fix_section),
            _ => {}
        }
    }
}

/// The value at `path` in a TOML document, created in its table if missing.
fn entry<'d>(doc: &'d mut toml::Value, path: &[&str]) -> Result<&'d mut toml::Value> {
    let (last, tables) = path.split_last().expect("a non-empty path");
    let mut at = doc;
    for key in tables {
        at = at
            .get_mut(*key)
            .ok_or_else(|| Error::Plan(format!("the config has no [{}]", path[..2].join("."))))?;
    }
    let table = at
        .as_table_mut()
        .ok_or_else(|| Error::Plan(format!("`{}` is not a table", tables.join("."))))?;
    Ok(table
        .entry(last.to_string())
        .or_insert(toml::Value::Integer(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `plan --write` makes every path absolute, a file the first run creates (a history)
    /// included, so that the written config runs from wherever it is.
    #[test]
    fn written_paths_are_absolute_for_files_not_there_yet() {
        let text = "[target]\nmodel = \"m.gguf\"\n\
                    [drafters.mag]\nkind = \"max_gram\"\nhistory = \"../runs/outputs.hist\"\n";
        let mut doc: toml::Value = toml::from_str(text).unwrap();
        absolute_paths(&mut doc, Path::new("no-such-folder"));
        for path in [&doc["target"]["model"], &doc["drafters"]["mag"]["history"]] {
            let path = Path::new(path.as_str().unwrap());
            assert!(path.is_absolute(), "{}", path.display());
        }
        let history = doc["drafters"]["mag"]["history"].as_str().unwrap();
        assert!(
            history.ends_with("no-such-folder/../runs/outputs.hist"),
            "{history}"
        );
    }

    /// A trimmed draft model is planned at the cost measured for the smallest trimmed set at
    /// least as large as its own, and at the whole model's cost where none was measured.
    #[test]
    fn a_trimmed_vocabulary_is_planned_at_its_measured_cost() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/bench/report.json");
        let mut report: Report =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let file = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
        let whole = report
            .models
            .iter()
            .find(|m| m.model == file)
            .unwrap()
            .clone();
        for (size, c) in [(16386, 0.25), (32770, 0.3)] {
            report.models.push(crate::bench::ModelCost {
                model: crate::costs::subject_label(file, Some(size)),
                c_measured: c,
                ..whole.clone()
            });
        }
        let m = Measured::new(&report, "speculative").unwrap();
        let model = ModelPlan {
            path: Path::new("models").join(file),
            tokenizer: None,
        };
        let c = |trimmed| m.cost(&model, trimmed).unwrap().0;
        assert_eq!(c(None), whole.c_measured);
        assert_eq!(c(Some(16384)), 0.25);
        assert_eq!(c(Some(32768)), 0.3);
        assert_eq!(c(Some(20000)), 0.3);
        assert_eq!(c(Some(65536)), whole.c_measured);
    }
}
