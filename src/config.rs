//! Configuration in two layers: [`RawConfig`] mirrors the TOML and only checks what was typed
//! (unknown keys are errors); [`RawConfig::validate`] turns it into a [`Plan`] once, with errors
//! that name the TOML path. [`Plan::build`] loads the models into an [`Engine`].

use crate::drafter::{BigramDrafter, Drafter, MaxGramDrafter, MaxGramPolicy, NeuralDrafter};
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
    },
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

/// A validated configuration: models resolved to files, settings checked.
#[derive(Clone, Debug)]
pub struct Plan {
    pub target: ModelPlan,
    pub drafter: Option<(String, DrafterPlan)>,
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
        let resolve = |src: &ModelSource, tok: &Option<PathBuf>, at: &str| -> Result<ModelPlan> {
            let path = src.resolve(base, None)?;
            let tokenizer = tok.as_ref().map(|p| base.join(p));
            if let Some(p) = &tokenizer {
                if !p.is_file() {
                    return Err(Error::config(
                        format!("{at}.tokenizer"),
                        format!("file not found: {}", p.display()),
                    ));
                }
            }
            Ok(ModelPlan { path, tokenizer })
        };
        if t.k == 0 {
            return Err(Error::config(
                "target.k",
                "must be >= 1 (tokens drafted per target call)",
            ));
        }
        if !(t.lenience >= 1.0 && t.lenience.is_finite()) {
            return Err(Error::config(
                "target.lenience",
                format!("must be a finite number >= 1, got {}", t.lenience),
            ));
        }
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
        let drafter = match &t.drafter {
            None => None,
            Some(name) => {
                let raw = self.drafters.get(name).ok_or_else(|| {
                    let known: Vec<&str> = self.drafters.keys().map(String::as_str).collect();
                    Error::config(
                        "target.drafter",
                        format!(
                            "unknown drafter `{name}` (defined in [drafters]: {})",
                            list(&known)
                        ),
                    )
                })?;
                let at = format!("drafters.{name}");
                let table = |p: &PathBuf| -> Result<PathBuf> {
                    let p = base.join(p);
                    if p.is_file() {
                        Ok(p)
                    } else {
                        Err(Error::config(
                            format!("{at}.table"),
                            format!("file not found: {}", p.display()),
                        ))
                    }
                };
                let plan = match raw {
                    RawDrafter::Model { model, tokenizer } => {
                        DrafterPlan::Model(resolve(model, tokenizer, &at)?)
                    }
                    RawDrafter::Bigram { table: t, sample } => DrafterPlan::Bigram {
                        table: table(t)?,
                        sample: *sample,
                    },
                    RawDrafter::MaxGram {
                        table: t,
                        max_ngram,
                        min_match,
                        bigram_tokens,
                    } => {
                        if *max_ngram == 0 {
                            return Err(Error::config(format!("{at}.max_ngram"), "must be >= 1"));
                        }
                        if *min_match == 0 || min_match > max_ngram {
                            return Err(Error::config(
                                format!("{at}.min_match"),
                                format!("must be between 1 and max_ngram ({max_ngram})"),
                            ));
                        }
                        DrafterPlan::MaxGram {
                            table: t.as_ref().map(table).transpose()?,
                            policy: MaxGramPolicy {
                                max_ngram: *max_ngram,
                                min_match: *min_match,
                                bigram_tokens: *bigram_tokens,
                            },
                        }
                    }
                };
                Some((name.clone(), plan))
            }
        };
        Ok(Plan {
            target: resolve(&t.model, &t.tokenizer, "target")?,
            drafter,
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

fn list(names: &[&str]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

impl Plan {
    /// Loads the models (each file once) and assembles the engine. `progress(what, done, total)`
    /// reports loading.
    pub fn build(&self, progress: &mut dyn FnMut(&str, usize, usize)) -> Result<Engine> {
        let mut b = Builder {
            store: ModelStore::default(),
            tables: HashMap::new(),
            progress,
            context: self.context,
        };
        let target = b.model(&self.target)?;
        let drafter = match &self.drafter {
            None => None,
            Some((name, plan)) => Some(b.drafter(name, plan, &target)?),
        };
        Ok(Engine::new(
            Box::new(target.instance("target", self.context)),
            drafter,
            target.tokenizer.clone(),
        ))
    }
}

/// Loads what a plan names, sharing model files and tables between the nodes that use them.
struct Builder<'a> {
    store: ModelStore,
    tables: HashMap<PathBuf, Arc<BigramTable>>,
    progress: &'a mut dyn FnMut(&str, usize, usize),
    context: Option<usize>,
}

impl Builder<'_> {
    fn model(&mut self, m: &ModelPlan) -> Result<Arc<LoadedModel>> {
        let label = m
            .path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let progress = &mut *self.progress;
        self.store
            .load(&m.path, m.tokenizer.as_deref(), &mut |d, t| {
                progress(&label, d, t)
            })
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

    /// The drafter `name` for `target` (whose vocabulary it must share).
    fn drafter(
        &mut self,
        name: &str,
        plan: &DrafterPlan,
        target: &LoadedModel,
    ) -> Result<Box<dyn Drafter>> {
        Ok(match plan {
            DrafterPlan::Model(m) => {
                let model = self.model(m)?;
                check_vocab(target, "target", &model, name)?;
                Box::new(NeuralDrafter::new(
                    name,
                    Box::new(model.instance(name, self.context)),
                ))
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
