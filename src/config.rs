//! Configuration in two layers: [`RawConfig`] mirrors the TOML and only checks what was typed
//! (unknown keys are errors); [`RawConfig::validate`] turns it into a [`Plan`] once, with errors
//! that name the TOML path. [`Plan::build`] loads the models into an [`Engine`].

use crate::drafter::{Drafter, NeuralDrafter};
use crate::engine::{Engine, GenerateOptions};
use crate::error::{Error, Result};
use crate::model::{LoadedModel, ModelSource, ModelStore};
use crate::sampling::Sampling;
use serde::Deserialize;
use std::collections::BTreeMap;
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
                let plan = match raw {
                    RawDrafter::Model { model, tokenizer } => {
                        DrafterPlan::Model(resolve(model, tokenizer, &format!("drafters.{name}"))?)
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
        let mut store = ModelStore::default();
        let mut load = |m: &ModelPlan, store: &mut ModelStore| -> Result<Arc<LoadedModel>> {
            let label = m
                .path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            store.load(&m.path, m.tokenizer.as_deref(), &mut |d, t| {
                progress(&label, d, t)
            })
        };
        let target = load(&self.target, &mut store)?;
        let drafter: Option<Box<dyn Drafter>> = match &self.drafter {
            None => None,
            Some((name, DrafterPlan::Model(m))) => {
                let model = load(m, &mut store)?;
                check_vocab(&target, "target", &model, name)?;
                Some(Box::new(NeuralDrafter::new(
                    name.clone(),
                    Box::new(model.instance(name, self.context)),
                )))
            }
        };
        Ok(Engine::new(
            Box::new(target.instance("target", self.context)),
            drafter,
            target.tokenizer.clone(),
        ))
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
