//! From the TOML as written to a validated [`Plan`]: every setting checked once, errors
//! naming the TOML path, model files resolved, the K-matrix notation expanded into a tree.

use super::schema::{RawConfig, RawDrafter, RawTarget, BUILT_IN_KINDS};
use super::Registry;
use crate::drafter::MaxGramPolicy;
use crate::engine::GenerateOptions;
use crate::error::{Error, Result};
use crate::gate::{Priors, BUCKETS, BUCKET_EDGES};
use crate::model::ModelSource;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A validated configuration: models resolved to files, settings checked.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The target model.
    pub target: ModelPlan,
    /// The drafter tree, if any.
    pub drafter: Option<DrafterNode>,
    /// The target sizes drafts adaptively.
    pub adaptive: bool,
    /// Where the target's gate starts its acceptance estimates, per drafter.
    pub acceptance: Vec<(String, Priors)>,
    /// Cap on the context length.
    pub context: Option<usize>,
    /// Generation settings.
    pub options: GenerateOptions,
    /// Wrap prompts in the chat template.
    pub chat: bool,
    /// System message for the chat template.
    pub system: Option<String>,
    /// The plug-in kinds the config was validated with (used again to build it).
    pub registry: Registry,
}

/// A draft model's trimmed vocabulary: the `tokens` most frequent tokens of `table`'s corpus.
#[derive(Clone, Debug)]
pub struct TrimmedVocabulary {
    /// How many of the most frequent tokens.
    pub tokens: usize,
    /// The bigram table holding the ranking.
    pub table: PathBuf,
}

/// A model file resolved to a path, with its tokenizer override.
#[derive(Clone, Debug)]
pub struct ModelPlan {
    /// The GGUF file.
    pub path: PathBuf,
    /// A `tokenizer.json` instead of the GGUF's own.
    pub tokenizer: Option<PathBuf>,
}

/// A node of the validated drafter tree.
#[derive(Clone, Debug)]
pub struct DrafterNode {
    /// The node's name (its `[drafters]` name, or one derived from a K matrix).
    pub name: String,
    /// What the node is.
    pub kind: DrafterPlan,
    /// Where the node sits in a K matrix it was expanded from.
    pub k_matrix: Option<KMatrixRole>,
}

/// A node's place in the K matrix `matrix` (the `[drafters]` name of a `k_matrix` drafter with
/// `reviewers` reviewer models).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KMatrixRole {
    /// The draft reviewed at level `row - 1` (row 1: the target's), built from row `row`.
    Level {
        /// The K matrix's `[drafters]` name.
        matrix: String,
        /// The row (1-based).
        row: usize,
        /// Number of reviewer models.
        reviewers: usize,
    },
    /// The vertical cascade of reviewer `d_index` (1-based).
    Reviewer {
        /// The K matrix's `[drafters]` name.
        matrix: String,
        /// The reviewer's index (1-based).
        index: usize,
        /// Number of reviewer models.
        reviewers: usize,
    },
}

impl Plan {
    /// Every model file the plan names, once each: the target first, then the drafters' and
    /// reviewers' models.
    pub fn models(&self) -> Vec<&ModelPlan> {
        let mut out = vec![&self.target];
        if let Some(d) = &self.drafter {
            d.models(&mut out);
        }
        out
    }
}

impl Plan {
    /// Runs the plan's Max-Gram drafters without their histories (a bench measures each run on
    /// its own, and leaves the files as they are): the names of the drafters that had one.
    pub fn without_histories(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(d) = &mut self.drafter {
            d.drop_histories(&mut out);
        }
        out
    }

    /// Every neural drafter with a trimmed vocabulary: its node's name, model and vocabulary.
    pub fn trimmed(&self) -> Vec<(&str, &ModelPlan, &TrimmedVocabulary)> {
        let mut out = Vec::new();
        if let Some(d) = &self.drafter {
            d.trimmed(&mut out);
        }
        out
    }
}

impl DrafterNode {
    /// The nodes directly below this one (a K matrix's expanded parts included).
    fn children(&self) -> Vec<&DrafterNode> {
        match &self.kind {
            DrafterPlan::Vertical { inner, .. } => vec![inner],
            DrafterPlan::Horizontal { parts } => parts.iter().map(|(n, _)| n).collect(),
            DrafterPlan::Adaptive { parts } => parts.iter().collect(),
            _ => Vec::new(),
        }
    }

    /// [`DrafterNode::children`], to change.
    fn children_mut(&mut self) -> Vec<&mut DrafterNode> {
        match &mut self.kind {
            DrafterPlan::Vertical { inner, .. } => vec![inner],
            DrafterPlan::Horizontal { parts } => parts.iter_mut().map(|(n, _)| n).collect(),
            DrafterPlan::Adaptive { parts } => parts.iter_mut().collect(),
            _ => Vec::new(),
        }
    }

    fn trimmed<'a>(&'a self, out: &mut Vec<(&'a str, &'a ModelPlan, &'a TrimmedVocabulary)>) {
        if let DrafterPlan::Model {
            model,
            vocabulary: Some(v),
        } = &self.kind
        {
            out.push((&self.name, model, v));
        }
        self.children().into_iter().for_each(|n| n.trimmed(out));
    }

    fn models<'a>(&'a self, out: &mut Vec<&'a ModelPlan>) {
        let model = match &self.kind {
            DrafterPlan::Model { model, .. } => Some(model),
            DrafterPlan::Vertical { reviewer, .. } => Some(reviewer),
            _ => None,
        };
        if let Some(m) = model.filter(|m| !out.iter().any(|x| x.path == m.path)) {
            out.push(m);
        }
        self.children().into_iter().for_each(|n| n.models(out));
    }

    /// The names of this node and every node below it (a K matrix's expanded parts
    /// included: `cs.d1`, `cs.level1`).
    pub fn names<'a>(&'a self, out: &mut Vec<&'a str>) {
        out.push(&self.name);
        self.children().into_iter().for_each(|n| n.names(out));
    }

    /// Whether this node or one below it sizes its drafts adaptively.
    pub fn has_adaptive(&self) -> bool {
        matches!(self.kind, DrafterPlan::Vertical { adaptive: true, .. })
            || self.children().into_iter().any(DrafterNode::has_adaptive)
    }

    /// The most tokens this drafter drafts in a round whatever it is asked, if it has such a
    /// bound: a horizontal schedule's (a K matrix row's) sum.
    pub fn most_per_round(&self) -> Option<usize> {
        match &self.kind {
            DrafterPlan::Horizontal { parts } => Some(parts.iter().map(|(_, n)| n).sum()),
            _ => None,
        }
    }

    /// Leaves out the Max-Gram histories of this node and those below it: the names of the
    /// nodes that had one.
    fn drop_histories(&mut self, out: &mut Vec<String>) {
        if let DrafterPlan::MaxGram { history, .. } = &mut self.kind {
            if history.take().is_some() {
                out.push(self.name.clone());
            }
        }
        self.children_mut()
            .into_iter()
            .for_each(|n| n.drop_histories(out));
    }
}

/// A validated drafter node's kind and settings.
#[derive(Clone, Debug)]
pub enum DrafterPlan {
    /// A neural drafter.
    Model {
        /// Its model.
        model: ModelPlan,
        /// Its trimmed vocabulary, if any.
        vocabulary: Option<TrimmedVocabulary>,
    },
    /// A bigram table drafter.
    Bigram {
        /// The table file.
        table: PathBuf,
        /// Sample successors instead of taking the most likely.
        sample: bool,
    },
    /// Max-Gram.
    MaxGram {
        /// The bigram table to fall back on.
        table: Option<PathBuf>,
        /// Match lengths and fallback.
        policy: MaxGramPolicy,
        /// The file of earlier outputs, and the most tokens it keeps.
        history: Option<(PathBuf, usize)>,
    },
    /// A reviewer model over an inner drafter.
    Vertical {
        /// The reviewing model.
        reviewer: ModelPlan,
        /// The drafter it reviews.
        inner: Box<DrafterNode>,
        /// Tokens asked of the inner drafter per review.
        k: usize,
        /// Lenience of the review.
        lenience: f32,
        /// Size inner drafts adaptively.
        adaptive: bool,
    },
    /// A fixed schedule of parts.
    Horizontal {
        /// Each part and its token count, in draft order.
        parts: Vec<(DrafterNode, usize)>,
    },
    /// Parts tried cheapest first at every position.
    Adaptive {
        /// The parts, cheapest first.
        parts: Vec<DrafterNode>,
    },
    /// A registered plug-in kind with its table; relative paths in it are from `base`.
    Plugin {
        /// The registered kind.
        kind: String,
        /// Its table, `kind` removed.
        table: toml::Table,
        /// The config's folder, for relative paths in the table.
        base: PathBuf,
    },
}

impl RawConfig {
    /// Checks every setting and resolves model files (relative paths from `base`), with the
    /// built-in drafter kinds only.
    pub fn validate(&self, base: &Path) -> Result<Plan> {
        self.validate_with(base, &Registry::default())
    }

    /// [`RawConfig::validate`] with the plug-in kinds of `registry` too.
    pub fn validate_with(&self, base: &Path, registry: &Registry) -> Result<Plan> {
        let t = &self.target;
        in_range(
            "target.k",
            t.k,
            1,
            MAX_DRAFT,
            "tokens drafted per target call",
        )?;
        crate::review::check_lenience("target.lenience", t.lenience)?;
        if t.lenience != 1.0 && !t.allow_inexact {
            return Err(Error::config(
                "target.lenience",
                format!(
                    "lenience {} at the target changes the output distribution; \
                     set target.allow_inexact = true to accept that",
                    t.lenience
                ),
            ));
        }
        if let Some(c) = t.context {
            in_range("target.context", c, 1, MAX_CONTEXT, "tokens")?;
        }
        in_range(
            "generation.max_new_tokens",
            self.generation.max_new_tokens,
            1,
            MAX_CONTEXT,
            "tokens",
        )?;
        if let Some(i) = self.generation.stop.iter().position(String::is_empty) {
            return Err(Error::config(
                format!("generation.stop[{i}]"),
                "a stop string is empty (it would stop before any text)",
            ));
        }
        self.sampling
            .validate()
            .map_err(|e| Error::config("sampling", e.to_string()))?;
        // A kind nobody registered is an error even in a table nothing refers to.
        for (name, d) in &self.drafters {
            if let RawDrafter::Plugin { kind, .. } = d {
                if !registry.has(kind) {
                    return Err(unknown_kind(name, kind, registry));
                }
            }
        }
        let v = Validator {
            raw: self,
            base,
            registry,
            built: Default::default(),
        };
        let drafter = match &t.drafter {
            None => None,
            Some(name) => Some(v.node(name, "target.drafter", &mut Vec::new())?),
        };
        let acceptance = acceptance(t, &self.drafters, drafter.as_ref())?;
        Ok(Plan {
            target: v.model(&t.model, "target.model", &t.tokenizer, "target.tokenizer")?,
            drafter,
            adaptive: t.adaptive,
            acceptance,
            context: t.context,
            options: GenerateOptions {
                max_new_tokens: self.generation.max_new_tokens,
                sampling: self.sampling,
                seed: self.generation.seed,
                k: t.k,
                lenience: t.lenience,
                stop: self.generation.stop.clone(),
                cancel: None,
                ignore_eos: false,
            },
            chat: self.generation.chat,
            system: self.generation.system.clone(),
            registry: registry.clone(),
        })
    }
}

/// `[target.acceptance]`: for an adaptive target, one value in [0, 1] per confidence bucket
/// for drafters of the config, or of its tree (a K matrix's parts, as `plan --write` names
/// them).
fn acceptance(
    t: &RawTarget,
    drafters: &BTreeMap<String, RawDrafter>,
    tree: Option<&DrafterNode>,
) -> Result<Vec<(String, Priors)>> {
    let mut in_tree = Vec::new();
    if let Some(node) = tree {
        node.names(&mut in_tree);
    }
    if !t.acceptance.is_empty() && !t.adaptive {
        return Err(Error::config(
            "target.acceptance",
            "starts an adaptive gate's estimates: it needs `adaptive = true`",
        ));
    }
    t.acceptance
        .iter()
        .map(|(name, values)| {
            let at = format!("target.acceptance.{name}");
            if !drafters.contains_key(name) && !in_tree.contains(&name.as_str()) {
                return Err(Error::config(
                    at,
                    format!(
                        "unknown drafter `{name}` (defined in [drafters]: {})",
                        drafters.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
            let priors: Priors = values.as_slice().try_into().map_err(|_| {
                Error::config(
                    &at,
                    format!(
                        "expected {BUCKETS} values (one per confidence bucket up to {}, then \
                         positions without confidence), got {}",
                        BUCKET_EDGES.map(|e| e.to_string()).join(", "),
                        values.len()
                    ),
                )
            })?;
            if let Some(v) = priors.iter().find(|v| !(0.0..=1.0).contains(*v)) {
                return Err(Error::config(
                    at,
                    format!("values must be in [0, 1], got {v}"),
                ));
            }
            Ok((name.clone(), priors))
        })
        .collect()
}

fn unknown_kind(name: &str, kind: &str, registry: &Registry) -> Error {
    Error::config(
        format!("drafters.{name}.kind"),
        format!(
            "unknown drafter kind `{kind}` (built in: {}; registered: {})",
            BUILT_IN_KINDS.join(", "),
            registry.kinds()
        ),
    )
}

/// The most tokens one draft may hold: a verify scores at most this many plus one rows.
pub const MAX_DRAFT: usize = 64;
/// The longest context (and generation) a config may ask for.
pub const MAX_CONTEXT: usize = 1 << 24;
/// The longest suffix Max-Gram may match.
pub const MAX_NGRAM: usize = 1024;
/// The most tokens a Max-Gram history may keep (8 bytes each in memory).
pub const MAX_HISTORY: usize = 1 << 22;

/// Checks that the count at TOML path `at` lies in `lo..=hi`.
fn in_range(at: &str, value: usize, lo: usize, hi: usize, what: &str) -> Result<()> {
    if (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(Error::config(
            at,
            format!("must be between {lo} and {hi} ({what}), got {value}"),
        ))
    }
}

struct Validator<'a> {
    raw: &'a RawConfig,
    base: &'a Path,
    registry: &'a Registry,
    /// Drafters built so far: one per place a name is referenced.
    built: std::cell::Cell<usize>,
}

/// Most drafters in a tree, counting a drafter named in several places once per place: each
/// place is built on its own, so drafters that each name another twice would double the tree
/// at every level.
pub const MAX_DRAFTERS: usize = 256;
/// Most drafters nested inside one another (each resolved by recursion).
pub const MAX_DEPTH: usize = 32;

impl Validator<'_> {
    /// A model file named at the TOML path `at`, and its tokenizer override (at `tok_at`).
    fn model(
        &self,
        src: &ModelSource,
        at: &str,
        tok: &Option<PathBuf>,
        tok_at: &str,
    ) -> Result<ModelPlan> {
        let path = src
            .resolve(self.base)
            .map_err(|e| Error::config(at, e.to_string()))?;
        let tokenizer = tok.as_ref().map(|p| self.base.join(p));
        if let Some(p) = &tokenizer {
            if !p.is_file() {
                return Err(Error::config(tok_at, crate::files::not_a_file(p)));
            }
        }
        let tokenizer = tokenizer.map(|p| std::fs::canonicalize(&p).unwrap_or(p));
        Ok(ModelPlan { path, tokenizer })
    }

    fn file(&self, p: &Path, at: String) -> Result<PathBuf> {
        let p = self.base.join(p);
        if p.is_file() {
            Ok(p)
        } else {
            Err(Error::config(at, crate::files::not_a_file(&p)))
        }
    }

    /// The drafter `name`, referenced at `at`; `stack` holds the names being resolved above
    /// it, to refuse cycles.
    fn node(&self, name: &str, at: &str, stack: &mut Vec<String>) -> Result<DrafterNode> {
        let raw = self.raw.drafters.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.raw.drafters.keys().map(String::as_str).collect();
            let known = if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            };
            Error::config(
                at,
                format!("unknown drafter `{name}` (defined in [drafters]: {known})"),
            )
        })?;
        if stack.iter().any(|s| s == name) {
            let cycle = [&stack[..], &[name.to_string()]].concat().join(" -> ");
            return Err(Error::config(at, format!("drafters form a cycle: {cycle}")));
        }
        if stack.len() == MAX_DEPTH {
            return Err(Error::config(
                at,
                format!(
                    "drafters nest more than {MAX_DEPTH} deep: {} -> ...",
                    stack[0]
                ),
            ));
        }
        self.built.set(self.built.get() + 1);
        if self.built.get() > MAX_DRAFTERS {
            return Err(Error::config(
                at,
                format!(
                    "the drafter tree holds more than {MAX_DRAFTERS} drafters (a drafter named in \
                     several places is built once per place)"
                ),
            ));
        }
        stack.push(name.to_string());
        let here = format!("drafters.{name}");
        let kind = match raw {
            RawDrafter::Model {
                model,
                tokenizer,
                vocabulary,
                vocabulary_table,
            } => {
                let vocabulary = match (vocabulary, vocabulary_table) {
                    (None, None) => None,
                    (Some(n), Some(t)) => {
                        in_range(&format!("{here}.vocabulary"), *n, 1, MAX_CONTEXT, "tokens")?;
                        Some(TrimmedVocabulary {
                            tokens: *n,
                            table: self.file(t, format!("{here}.vocabulary_table"))?,
                        })
                    }
                    (Some(_), None) => {
                        return Err(Error::config(
                            format!("{here}.vocabulary"),
                            "needs `vocabulary_table`: a bigram table (`cascade ngram build`) whose corpus ranks the tokens",
                        ))
                    }
                    (None, Some(_)) => {
                        return Err(Error::config(
                            format!("{here}.vocabulary_table"),
                            "is read only with `vocabulary` (how many of its most frequent tokens to score)",
                        ))
                    }
                };
                DrafterPlan::Model {
                    model: self.model(
                        model,
                        &format!("{here}.model"),
                        tokenizer,
                        &format!("{here}.tokenizer"),
                    )?,
                    vocabulary,
                }
            }
            RawDrafter::Bigram { table, sample } => DrafterPlan::Bigram {
                table: self.file(table, format!("{here}.table"))?,
                sample: *sample,
            },
            RawDrafter::MaxGram {
                table,
                max_ngram,
                min_match,
                bigram_tokens,
                length_per_match,
                history,
                history_tokens,
            } => {
                in_range(
                    &format!("{here}.history_tokens"),
                    *history_tokens,
                    16,
                    MAX_HISTORY,
                    "tokens",
                )?;
                let history = match history {
                    Some(p) if self.base.join(p).is_dir() => {
                        return Err(Error::config(
                            format!("{here}.history"),
                            crate::files::not_a_file(&self.base.join(p)),
                        ))
                    }
                    Some(p) => Some((self.base.join(p), *history_tokens)),
                    None => None,
                };
                if !(length_per_match.is_finite() && *length_per_match >= 0.0) {
                    return Err(Error::config(
                        format!("{here}.length_per_match"),
                        format!("must be a finite number >= 0 (0: no cap), got {length_per_match}"),
                    ));
                }
                in_range(
                    &format!("{here}.max_ngram"),
                    *max_ngram,
                    1,
                    MAX_NGRAM,
                    "tokens",
                )?;
                in_range(
                    &format!("{here}.bigram_tokens"),
                    *bigram_tokens,
                    0,
                    MAX_DRAFT,
                    "tokens",
                )?;
                if *bigram_tokens > 0 && table.is_none() {
                    return Err(Error::config(
                        format!("{here}.bigram_tokens"),
                        "drafts from the bigram table, and this drafter names none (`table`)",
                    ));
                }
                if *min_match == 0 || min_match > max_ngram {
                    return Err(Error::config(
                        format!("{here}.min_match"),
                        format!("must be between 1 and max_ngram ({max_ngram})"),
                    ));
                }
                DrafterPlan::MaxGram {
                    table: table
                        .as_ref()
                        .map(|t| self.file(t, format!("{here}.table")))
                        .transpose()?,
                    policy: MaxGramPolicy {
                        max_ngram: *max_ngram,
                        min_match: *min_match,
                        bigram_tokens: *bigram_tokens,
                        length_per_match: *length_per_match,
                    },
                    history,
                }
            }
            RawDrafter::Vertical {
                reviewer,
                tokenizer,
                draft,
                k,
                lenience,
                adaptive,
            } => {
                in_range(
                    &format!("{here}.k"),
                    *k,
                    1,
                    MAX_DRAFT,
                    "tokens asked of the inner drafter",
                )?;
                crate::review::check_lenience(format_args!("{here}.lenience"), *lenience)?;
                DrafterPlan::Vertical {
                    reviewer: self.model(
                        reviewer,
                        &format!("{here}.reviewer"),
                        tokenizer,
                        &format!("{here}.tokenizer"),
                    )?,
                    inner: Box::new(self.node(draft, &format!("{here}.draft"), stack)?),
                    k: *k,
                    lenience: *lenience,
                    adaptive: *adaptive,
                }
            }
            RawDrafter::Plugin { kind, table } => {
                if !self.registry.has(kind) {
                    return Err(unknown_kind(name, kind, self.registry));
                }
                DrafterPlan::Plugin {
                    kind: kind.clone(),
                    table: table.clone(),
                    base: self.base.to_path_buf(),
                }
            }
            RawDrafter::Adaptive { drafters } => {
                if drafters.is_empty() {
                    return Err(Error::config(
                        format!("{here}.drafters"),
                        "must list at least one drafter",
                    ));
                }
                // Each position goes to one of the parts: a part listed twice is a slip.
                if let Some((i, d)) =
                    (drafters.iter().enumerate()).find(|&(i, d)| drafters[..i].contains(d))
                {
                    return Err(Error::config(
                        format!("{here}.drafters[{i}]"),
                        format!("`{d}` is listed twice"),
                    ));
                }
                let parts = drafters
                    .iter()
                    .enumerate()
                    .map(|(i, d)| self.node(d, &format!("{here}.drafters[{i}]"), stack))
                    .collect::<Result<Vec<_>>>()?;
                DrafterPlan::Adaptive { parts }
            }
            RawDrafter::Horizontal { schedule } => {
                if schedule.is_empty() {
                    return Err(Error::config(
                        format!("{here}.schedule"),
                        "must list at least one [drafter, tokens] pair",
                    ));
                }
                let mut parts = Vec::new();
                for (i, (part, tokens)) in schedule.iter().enumerate() {
                    let at = format!("{here}.schedule[{i}]");
                    in_range(
                        &at,
                        *tokens,
                        1,
                        MAX_DRAFT,
                        &format!("tokens drafted by `{part}`"),
                    )?;
                    parts.push((self.node(part, &at, stack)?, *tokens));
                }
                DrafterPlan::Horizontal { parts }
            }
            RawDrafter::KMatrix {
                reviewers,
                last,
                k_matrix,
                last_k,
                lenience,
            } => {
                crate::review::check_lenience(format_args!("{here}.lenience"), *lenience)?;
                in_range(&format!("{here}.last_k"), *last_k, 1, MAX_DRAFT, "tokens")?;
                let models = reviewers
                    .iter()
                    .enumerate()
                    .map(|(i, r)| self.model(r, &format!("{here}.reviewers[{i}]"), &None, ""))
                    .collect::<Result<Vec<_>>>()?;
                let last = self.node(last, &format!("{here}.last"), stack)?;
                let tree = k_matrix_tree(name, &models, last, k_matrix, *last_k, *lenience)?;
                stack.pop();
                return Ok(DrafterNode {
                    name: name.to_string(),
                    k_matrix: Some(KMatrixRole::Level {
                        matrix: name.to_string(),
                        row: 1,
                        reviewers: models.len(),
                    }),
                    ..tree
                });
            }
        };
        stack.pop();
        Ok(DrafterNode {
            name: name.to_string(),
            kind,
            k_matrix: None,
        })
    }
}

/// Expands the K-matrix notation (see [`RawDrafter::KMatrix`]) into vertical and horizontal
/// nodes.
fn k_matrix_tree(
    name: &str,
    reviewers: &[ModelPlan],
    last: DrafterNode,
    k: &[Vec<usize>],
    last_k: usize,
    lenience: f32,
) -> Result<DrafterNode> {
    let n = reviewers.len();
    let at = format!("drafters.{name}.k_matrix");
    if n == 0 {
        return Err(Error::config(
            format!("drafters.{name}.reviewers"),
            "must list at least one model",
        ));
    }
    // Each level expands the levels below it once per entry: a few reviewers at most.
    in_range(&format!("drafters.{name}.reviewers"), n, 1, 6, "models")?;
    if k.len() != n {
        return Err(Error::config(
            at,
            format!("expected {n} rows (one per reviewer), got {}", k.len()),
        ));
    }
    for (r, row) in k.iter().enumerate() {
        if row.len() != n + 1 - r {
            return Err(Error::config(
                format!("{at}[{r}]"),
                format!(
                    "expected {} entries (drafters d{}..d{} and the last), got {}",
                    n + 1 - r,
                    r + 1,
                    n,
                    row.len()
                ),
            ));
        }
        if row.iter().all(|&c| c == 0) {
            return Err(Error::config(
                format!("{at}[{r}]"),
                "drafts nothing: at least one entry must be >= 1",
            ));
        }
        let total = row.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
        in_range(
            &format!("{at}[{r}]"),
            total.unwrap_or(usize::MAX),
            1,
            MAX_DRAFT,
            "tokens drafted per review, the sum of the row",
        )?;
    }
    // level(r): the draft reviewed at level r (0-based row r), a horizontal node over
    // d_{r+1}..d_n (each reviewing level(i)) and the last drafter. A reviewer stands in
    // several places from two reviewers on (d2 in level 1, and inside d1): each place is
    // named by its path (`cs.d2`, `cs.d1.d2`), so that its counters and learned acceptance
    // are its own.
    fn level(
        r: usize,
        (name, path): (&str, &str),
        reviewers: &[ModelPlan],
        last: &DrafterNode,
        k: &[Vec<usize>],
        last_k: usize,
        l: f32,
    ) -> DrafterNode {
        let n = reviewers.len();
        let mut parts = Vec::new();
        for (j, &count) in k[r].iter().enumerate() {
            if count == 0 {
                continue;
            }
            let i = r + j; // 0-based drafter index; i == n is the last drafter
            let node = if i == n {
                last.clone()
            } else {
                let here = format!("{path}.d{}", i + 1);
                let inner = if i + 1 < n {
                    level(i + 1, (name, &here), reviewers, last, k, last_k, l)
                } else {
                    last.clone()
                };
                let inner_k = if i + 1 < n {
                    k[i + 1].iter().sum()
                } else {
                    last_k
                };
                DrafterNode {
                    name: here,
                    k_matrix: Some(KMatrixRole::Reviewer {
                        matrix: name.to_string(),
                        index: i + 1,
                        reviewers: n,
                    }),
                    kind: DrafterPlan::Vertical {
                        reviewer: reviewers[i].clone(),
                        inner: Box::new(inner),
                        k: inner_k,
                        lenience: l,
                        adaptive: false,
                    },
                }
            };
            parts.push((node, count));
        }
        DrafterNode {
            name: format!("{path}.level{}", r + 1),
            kind: DrafterPlan::Horizontal { parts },
            k_matrix: Some(KMatrixRole::Level {
                matrix: name.to_string(),
                row: r + 1,
                reviewers: n,
            }),
        }
    }
    Ok(level(
        0,
        (name, name),
        reviewers,
        &last,
        k,
        last_k,
        lenience,
    ))
}
