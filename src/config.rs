//! Configuration in two layers: [`RawConfig`] mirrors the TOML and only checks what was typed
//! (unknown keys are errors); [`RawConfig::validate`] turns it into a [`Plan`] once, with errors
//! that name the TOML path. [`Plan::build`] loads the models into an [`Engine`].
//!
//! Drafters are named in `[drafters.NAME]` tables and reference each other by name, forming
//! any tree over the target:
//!
//! ```toml
//! [target]
//! model = "../models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
//! drafter = "cascade"
//! k = 6
//!
//! [drafters.mag]
//! kind = "max_gram"
//!
//! [drafters.small]            # vertical: the 0.5B reviews Max-Gram's drafts
//! kind = "vertical"
//! reviewer = "../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
//! draft = "mag"
//! k = 8                       # tokens asked of the inner drafter per review
//! lenience = 2.0
//!
//! [drafters.cascade]          # horizontal: 3 tokens from the cascade, the rest from Max-Gram
//! kind = "horizontal"
//! schedule = [["small", 3], ["mag", 8]]
//! ```
//!
//! The paper's K-matrix notation is accepted too (`kind = "k_matrix"`, see [`RawDrafter`]).

use crate::costs::{CostCache, ForwardCost};
use crate::drafter::{
    AdaptiveCascade, BigramDrafter, Drafter, HorizontalCascade, MaxGramDrafter, MaxGramPolicy,
    NeuralDrafter, VerticalCascade,
};
use crate::engine::{Engine, GenerateOptions};
use crate::error::{Error, Result};
use crate::model::{LoadedModel, ModelSource, ModelStore};
use crate::ngram::BigramTable;
use crate::sampling::Sampling;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The TOML file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub target: RawTarget,
    #[serde(default)]
    pub drafters: BTreeMap<String, RawDrafter>,
    #[serde(default)]
    pub sampling: Sampling,
    #[serde(default)]
    pub generation: RawGeneration,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTarget {
    pub model: ModelSource,
    /// A `tokenizer.json` to use instead of the one embedded in the GGUF.
    pub tokenizer: Option<PathBuf>,
    /// Name of the drafter in `[drafters]`; none means autoregressive decoding.
    pub drafter: Option<String>,
    /// Tokens drafted per target call.
    #[serde(default = "default_k")]
    pub k: usize,
    /// Lenience of the target's review; anything but 1 changes the output distribution.
    #[serde(default = "one")]
    pub lenience: f32,
    /// Must be true for `lenience != 1`: an explicit opt-in to inexact output.
    #[serde(default)]
    pub allow_inexact: bool,
    /// Size each draft by the drafters' learned acceptance and this machine's measured costs
    /// (`k` becomes an upper bound).
    #[serde(default)]
    pub adaptive: bool,
    /// Cap on the context length (tokens), below the model's own.
    pub context: Option<usize>,
}

/// A named drafter.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum RawDrafter {
    /// Samples from a smaller model that shares the target's tokenizer.
    Model {
        model: ModelSource,
        tokenizer: Option<PathBuf>,
    },
    /// Follows a bigram table (built with `cascade ngram build`).
    Bigram {
        table: PathBuf,
        /// Sample successors from the table instead of taking the most likely.
        #[serde(default)]
        sample: bool,
    },
    /// Copies the continuation of the longest earlier match of the text's suffix, falling
    /// back to a bigram table when there is none.
    MaxGram {
        table: Option<PathBuf>,
        /// Longest suffix searched for.
        #[serde(default = "default_max_ngram")]
        max_ngram: usize,
        /// Shortest match worth drafting from.
        #[serde(default = "default_min_match")]
        min_match: usize,
        /// Tokens drafted from the bigram table when there is no match.
        #[serde(default = "default_bigram_tokens")]
        bigram_tokens: usize,
        /// A match of length n copies at most `n * length_per_match` tokens; 0 leaves it to
        /// the gate.
        #[serde(default = "default_length_per_match")]
        length_per_match: f32,
    },
    /// A reviewer model over another drafter (CS Drafting's vertical cascade).
    Vertical {
        reviewer: ModelSource,
        tokenizer: Option<PathBuf>,
        /// The inner drafter's name.
        draft: String,
        /// Tokens asked of the inner drafter per review.
        #[serde(default = "default_k")]
        k: usize,
        /// Lenience of this review (>= 1; 1 is exact).
        #[serde(default = "one")]
        lenience: f32,
        /// Size the inner drafts adaptively (`k` becomes an upper bound).
        #[serde(default)]
        adaptive: bool,
    },
    /// Each position of a draft from the cheapest drafter worth it there (a dynamic
    /// horizontal cascade): `drafters = ["mag", "small"]`, cheapest first.
    Adaptive { drafters: Vec<String> },
    /// Positions of one draft split between drafters (CS Drafting's horizontal cascade):
    /// `schedule = [["a", 2], ["b", 6]]` takes 2 tokens from `a`, then up to 6 from `b`.
    Horizontal { schedule: Vec<(String, usize)> },
    /// The paper's notation (CS Drafting, Algorithm 1 and Table 2). With reviewer models
    /// `d_1..d_n` (most capable first) and a final drafter `d_{n+1}` (`last`, usually
    /// Max-Gram), row `r` of `k_matrix` (1-based) builds the draft reviewed at level `r - 1`
    /// (row 1: the target's): `k_matrix[r][j]` tokens from `d_{r+j}`, where each `d_i` with
    /// `i <= n` is a vertical cascade reviewing the draft of row `i + 1`, and `d_{n+1}`
    /// drafts `last_k` tokens per review. Row `r` has `n + 2 - r` entries (the last one for
    /// `last`). Table 2's `k11, k12, k21` for base, small, Max-Gram is
    /// `k_matrix = [[k11, k12, 0], [k21, 0]]`.
    KMatrix {
        reviewers: Vec<ModelSource>,
        last: String,
        k_matrix: Vec<Vec<usize>>,
        #[serde(default = "default_last_k")]
        last_k: usize,
        #[serde(default = "one")]
        lenience: f32,
    },
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGeneration {
    #[serde(default = "default_max_new")]
    pub max_new_tokens: usize,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub stop: Vec<String>,
    /// Wrap the prompt in the model's chat template.
    #[serde(default)]
    pub chat: bool,
    /// System message for the chat template.
    pub system: Option<String>,
}

impl Default for RawGeneration {
    fn default() -> Self {
        Self {
            max_new_tokens: default_max_new(),
            seed: 0,
            stop: Vec::new(),
            chat: false,
            system: None,
        }
    }
}

fn default_k() -> usize {
    4
}
fn one() -> f32 {
    1.0
}
fn default_max_new() -> usize {
    256
}
fn default_last_k() -> usize {
    10
}
fn default_max_ngram() -> usize {
    MaxGramPolicy::default().max_ngram
}
fn default_min_match() -> usize {
    MaxGramPolicy::default().min_match
}
fn default_bigram_tokens() -> usize {
    MaxGramPolicy::default().bigram_tokens
}
fn default_length_per_match() -> f32 {
    MaxGramPolicy::default().length_per_match
}

/// A validated configuration: models resolved to files, settings checked.
#[derive(Clone, Debug)]
pub struct Plan {
    pub target: ModelPlan,
    pub drafter: Option<DrafterNode>,
    /// The target sizes drafts adaptively.
    pub adaptive: bool,
    pub context: Option<usize>,
    pub options: GenerateOptions,
    pub chat: bool,
    pub system: Option<String>,
}

#[derive(Clone, Debug)]
pub struct ModelPlan {
    pub path: PathBuf,
    pub tokenizer: Option<PathBuf>,
}

/// A node of the validated drafter tree.
#[derive(Clone, Debug)]
pub struct DrafterNode {
    pub name: String,
    pub kind: DrafterPlan,
}

impl DrafterNode {
    /// Whether this node or one below it sizes its drafts adaptively.
    pub fn has_adaptive(&self) -> bool {
        match &self.kind {
            DrafterPlan::Vertical {
                adaptive, inner, ..
            } => *adaptive || inner.has_adaptive(),
            DrafterPlan::Horizontal { parts } => parts.iter().any(|(n, _)| n.has_adaptive()),
            DrafterPlan::Adaptive { parts } => parts.iter().any(DrafterNode::has_adaptive),
            _ => false,
        }
    }
}

#[derive(Clone, Debug)]
pub enum DrafterPlan {
    Model(ModelPlan),
    Bigram {
        table: PathBuf,
        sample: bool,
    },
    MaxGram {
        table: Option<PathBuf>,
        policy: MaxGramPolicy,
    },
    Vertical {
        reviewer: ModelPlan,
        inner: Box<DrafterNode>,
        k: usize,
        lenience: f32,
        adaptive: bool,
    },
    Horizontal {
        parts: Vec<(DrafterNode, usize)>,
    },
    Adaptive {
        parts: Vec<DrafterNode>,
    },
}

impl RawConfig {
    /// Parses TOML text; `origin` names the file in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| Error::config(origin, e.to_string().trim_end()))
    }

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::config(
                path.display().to_string(),
                format!("cannot read config: {e}"),
            )
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Checks every setting and resolves model files (relative paths from `base`).
    pub fn validate(&self, base: &Path) -> Result<Plan> {
        let t = &self.target;
        if t.k == 0 {
            return Err(Error::config(
                "target.k",
                "must be >= 1 (tokens drafted per target call)",
            ));
        }
        check_lenience("target.lenience", t.lenience)?;
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
        if t.context == Some(0) {
            return Err(Error::config("target.context", "must be >= 1"));
        }
        self.sampling
            .validate()
            .map_err(|e| Error::config("sampling", e.to_string()))?;
        let v = Validator { raw: self, base };
        let drafter = match &t.drafter {
            None => None,
            Some(name) => Some(v.node(name, "target.drafter", &mut Vec::new())?),
        };
        Ok(Plan {
            target: v.model(&t.model, &t.tokenizer, "target")?,
            drafter,
            adaptive: t.adaptive,
            context: t.context,
            options: GenerateOptions {
                max_new_tokens: self.generation.max_new_tokens,
                sampling: self.sampling,
                seed: self.generation.seed,
                k: t.k,
                lenience: t.lenience,
                stop: self.generation.stop.clone(),
            },
            chat: self.generation.chat,
            system: self.generation.system.clone(),
        })
    }
}

fn check_lenience(at: &str, l: f32) -> Result<()> {
    if l >= 1.0 && l.is_finite() {
        Ok(())
    } else {
        Err(Error::config(
            at,
            format!("must be a finite number >= 1, got {l}"),
        ))
    }
}

struct Validator<'a> {
    raw: &'a RawConfig,
    base: &'a Path,
}

impl Validator<'_> {
    fn model(&self, src: &ModelSource, tok: &Option<PathBuf>, at: &str) -> Result<ModelPlan> {
        let path = src.resolve(self.base, None)?;
        let tokenizer = tok.as_ref().map(|p| self.base.join(p));
        if let Some(p) = &tokenizer {
            if !p.is_file() {
                return Err(Error::config(
                    format!("{at}.tokenizer"),
                    format!("file not found: {}", p.display()),
                ));
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
            Err(Error::config(
                at,
                format!("file not found: {}", p.display()),
            ))
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
        stack.push(name.to_string());
        let here = format!("drafters.{name}");
        let kind = match raw {
            RawDrafter::Model { model, tokenizer } => {
                DrafterPlan::Model(self.model(model, tokenizer, &here)?)
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
            } => {
                if !(length_per_match.is_finite() && *length_per_match >= 0.0) {
                    return Err(Error::config(
                        format!("{here}.length_per_match"),
                        format!("must be a finite number >= 0 (0: no cap), got {length_per_match}"),
                    ));
                }
                if *max_ngram == 0 {
                    return Err(Error::config(format!("{here}.max_ngram"), "must be >= 1"));
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
                if *k == 0 {
                    return Err(Error::config(
                        format!("{here}.k"),
                        "must be >= 1 (tokens asked of the inner drafter)",
                    ));
                }
                check_lenience(&format!("{here}.lenience"), *lenience)?;
                DrafterPlan::Vertical {
                    reviewer: self.model(reviewer, tokenizer, &here)?,
                    inner: Box::new(self.node(draft, &format!("{here}.draft"), stack)?),
                    k: *k,
                    lenience: *lenience,
                    adaptive: *adaptive,
                }
            }
            RawDrafter::Adaptive { drafters } => {
                if drafters.is_empty() {
                    return Err(Error::config(
                        format!("{here}.drafters"),
                        "must list at least one drafter",
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
                    if *tokens == 0 {
                        return Err(Error::config(
                            at,
                            format!("`{part}` must draft at least 1 token"),
                        ));
                    }
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
                check_lenience(&format!("{here}.lenience"), *lenience)?;
                if *last_k == 0 {
                    return Err(Error::config(format!("{here}.last_k"), "must be >= 1"));
                }
                let models = reviewers
                    .iter()
                    .enumerate()
                    .map(|(i, r)| self.model(r, &None, &format!("{here}.reviewers[{i}]")))
                    .collect::<Result<Vec<_>>>()?;
                let last = self.node(last, &format!("{here}.last"), stack)?;
                k_matrix_tree(name, &models, last, k_matrix, *last_k, *lenience)?.kind
            }
        };
        stack.pop();
        Ok(DrafterNode {
            name: name.to_string(),
            kind,
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
    }
    // level(r): the draft reviewed at level r (0-based row r), a horizontal node over
    // d_{r+1}..d_n (each reviewing level(i)) and the last drafter.
    fn level(
        r: usize,
        name: &str,
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
                let inner = if i + 1 < n {
                    level(i + 1, name, reviewers, last, k, last_k, l)
                } else {
                    last.clone()
                };
                let inner_k = if i + 1 < n {
                    k[i + 1].iter().sum()
                } else {
                    last_k
                };
                DrafterNode {
                    name: format!("{name}.d{}", i + 1),
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
            name: format!("{name}.level{}", r + 1),
            kind: DrafterPlan::Horizontal { parts },
        }
    }
    Ok(level(0, name, reviewers, &last, k, last_k, lenience))
}

impl Plan {
    /// Loads the models (each file once) and assembles the engine. `progress(what, done, total)`
    /// reports loading.
    pub fn build(&self, progress: &mut dyn FnMut(&str, usize, usize)) -> Result<Engine> {
        self.build_with(&mut ModelStore::default(), progress)
    }

    /// [`Plan::build`] with model files shared through `store` (several plans in one process).
    pub fn build_with(
        &self,
        store: &mut ModelStore,
        progress: &mut dyn FnMut(&str, usize, usize),
    ) -> Result<Engine> {
        let mut b = Builder {
            store,
            tables: HashMap::new(),
            progress,
            context: self.context,
            costs: None,
            adaptive: self.adaptive || self.drafter.as_ref().is_some_and(DrafterNode::has_adaptive),
        };
        let target = b.model(&self.target)?;
        let drafter = match &self.drafter {
            None => None,
            Some(node) => Some(b.drafter(node, &target)?),
        };
        let name = file_label(&self.target.path);
        let engine = Engine::new(
            Box::new(target.instance(&name, self.context)),
            drafter,
            target.tokenizer.clone(),
        );
        Ok(if self.adaptive {
            engine.with_adaptive(b.cost(&target)?)
        } else {
            engine
        })
    }
}

/// A model's file name, which names its instances (in messages and per-model counters).
pub fn file_label(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// Loads what a plan names, sharing model files and tables between the nodes that use them.
struct Builder<'a> {
    store: &'a mut ModelStore,
    tables: HashMap<PathBuf, Arc<BigramTable>>,
    progress: &'a mut dyn FnMut(&str, usize, usize),
    context: Option<usize>,
    /// Opened when an adaptive node needs a measured cost.
    costs: Option<CostCache>,
    /// Some review in the tree is adaptive: drafters get their measured costs.
    adaptive: bool,
}

impl Builder<'_> {
    fn model(&mut self, m: &ModelPlan) -> Result<Arc<LoadedModel>> {
        let what = format!("loading {}", file_label(&m.path));
        let progress = &mut *self.progress;
        self.store
            .load(&m.path, m.tokenizer.as_deref(), &mut |d, t| {
                progress(&what, d, t)
            })
    }

    /// The measured forward cost of `model` on this machine (measured now if not cached).
    fn cost(&mut self, model: &LoadedModel) -> Result<ForwardCost> {
        if self.costs.is_none() {
            self.costs = Some(CostCache::open(&CostCache::default_path())?);
        }
        let cache = self.costs.as_mut().expect("opened above");
        let progress = &mut *self.progress;
        let cost = cache.costs(&[model], false, &mut |names| {
            progress(
                &format!("measuring {} (once per machine)", names.join(", ")),
                0,
                1,
            )
        })?;
        Ok(cost.into_iter().next().expect("one model asked"))
    }

    fn table(&mut self, path: &Path, target: &LoadedModel) -> Result<Arc<BigramTable>> {
        if let Some(t) = self.tables.get(path) {
            return Ok(t.clone());
        }
        let table = Arc::new(BigramTable::load(path)?);
        table.check_tokenizer(&target.tokenizer, path)?;
        self.tables.insert(path.to_path_buf(), table.clone());
        Ok(table)
    }

    /// The drafter for `node` over `target` (whose vocabulary every model must share).
    fn drafter(&mut self, node: &DrafterNode, target: &LoadedModel) -> Result<Box<dyn Drafter>> {
        let name = node.name.as_str();
        Ok(match &node.kind {
            DrafterPlan::Model(m) => {
                let model = self.model(m)?;
                check_vocab(target, "target", &model, name)?;
                let instance = model.instance(&file_label(&m.path), self.context);
                let drafter = NeuralDrafter::new(name, Box::new(instance));
                Box::new(if self.adaptive {
                    drafter.with_cost(&self.cost(&model)?)
                } else {
                    drafter
                })
            }
            DrafterPlan::Bigram { table, sample } => Box::new(BigramDrafter::new(
                name,
                self.table(table, target)?,
                *sample,
            )),
            DrafterPlan::MaxGram { table, policy } => {
                let table = table
                    .as_deref()
                    .map(|t| self.table(t, target))
                    .transpose()?;
                Box::new(MaxGramDrafter::new(name, *policy, table))
            }
            DrafterPlan::Vertical {
                reviewer,
                inner,
                k,
                lenience,
                adaptive,
            } => {
                let model = self.model(reviewer)?;
                check_vocab(target, "target", &model, name)?;
                let inner = self.drafter(inner, target)?;
                let instance = model.instance(&file_label(&reviewer.path), self.context);
                let cascade = VerticalCascade::new(name, Box::new(instance), inner, *k, *lenience);
                Box::new(match (adaptive, self.adaptive) {
                    (true, _) => cascade.with_adaptive(self.cost(&model)?),
                    (false, true) => cascade.with_cost(self.cost(&model)?),
                    _ => cascade,
                })
            }
            DrafterPlan::Adaptive { parts } => {
                let parts = parts
                    .iter()
                    .map(|n| self.drafter(n, target))
                    .collect::<Result<Vec<_>>>()?;
                Box::new(AdaptiveCascade::new(name, parts))
            }
            DrafterPlan::Horizontal { parts } => {
                let parts = parts
                    .iter()
                    .map(|(n, tokens)| Ok((self.drafter(n, target)?, *tokens)))
                    .collect::<Result<Vec<_>>>()?;
                Box::new(HorizontalCascade::new(name, parts))
            }
        })
    }
}

/// A drafter must speak the target's vocabulary: same tokens at the same ids, same logits width.
pub fn check_vocab(
    target: &LoadedModel,
    target_name: &str,
    drafter: &LoadedModel,
    drafter_name: &str,
) -> Result<()> {
    let (t, d) = (&target.tokenizer, &drafter.tokenizer);
    if t.fingerprint() != d.fingerprint()
        || target.weights.vocab_size() != drafter.weights.vocab_size()
    {
        return Err(Error::VocabMismatch {
            target: target_name.into(),
            drafter: drafter_name.into(),
            target_vocab: t.vocab_size(),
            drafter_vocab: d.vocab_size(),
            target_fp: t.fingerprint(),
            drafter_fp: d.fingerprint(),
        });
    }
    Ok(())
}
