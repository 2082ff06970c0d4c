//! From a validated [`Plan`] to an [`Engine`]: models loaded once per file, tables once per
//! path, costs measured once per machine where drafts are sized adaptively.

use super::validate::{DrafterNode, DrafterPlan, ModelPlan, Plan, TrimmedVocabulary};
use super::{PluginContext, Registry};
use crate::costs::{CostCache, CostEvent, ForwardCost, Subject, COSTS_ENV};
use crate::drafter::{
    AdaptiveCascade, BigramDrafter, Drafter, History, HorizontalCascade, MaxGramDrafter,
    NeuralDrafter, SharedHistory, VerticalCascade,
};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::model::{LoadedModel, ModelStore};
use crate::ngram::BigramTable;
use crate::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

impl Plan {
    /// The text the engine is to read for `message`: a user turn in the chat template of
    /// `tokenizer` (after the config's system message) if the config asks for it (`chat`), else
    /// `message` as it is. `cascade generate` reads its prompt this way.
    pub fn prompt_text(&self, tokenizer: &Tokenizer, message: &str) -> Result<String> {
        match self.chat {
            true => crate::chat::apply(tokenizer, self.system.as_deref(), message),
            false => Ok(message.to_string()),
        }
    }

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
            registry: &self.registry,
            store,
            tables: HashMap::new(),
            histories: HashMap::new(),
            progress,
            context: self.context,
            costs: None,
            adaptive: self.adaptive || self.drafter.as_ref().is_some_and(DrafterNode::has_adaptive),
        };
        let target = b.model(&self.target)?;
        let drafter = match &self.drafter {
            None => None,
            Some(node) => Some(b.drafter(node, &target, (&target, "target"))?),
        };
        let name = file_label(&self.target.path);
        let engine = Engine::new(
            Box::new(target.instance(&name, self.context)),
            drafter,
            target.tokenizer.clone(),
        );
        Ok(if self.adaptive {
            engine.with_adaptive(b.cost(&target)?, &self.acceptance)
        } else {
            engine
        })
    }
}

/// A model and the trimmed vocabulary a drafter scores with it (the tokens always scored).
pub type TrimmedModel = (Arc<LoadedModel>, Arc<[u32]>);

impl Plan {
    /// Every drafter with a trimmed vocabulary as a cost subject: its model, found in `store`
    /// (where building the plan loaded it), and the tokens it always scores.
    pub fn trimmed_vocabularies(&self, store: &ModelStore) -> Result<Vec<TrimmedModel>> {
        self.trimmed()
            .into_iter()
            .map(|(name, m, v)| {
                let model = store
                    .loaded()
                    .find(|x| x.path == m.path)
                    .cloned()
                    .ok_or_else(|| {
                        Error::config(m.path.display().to_string(), "the model was not loaded")
                    })?;
                let table = BigramTable::load(&v.table)?;
                table.check_tokenizer(&model.tokenizer, &v.table)?;
                let tokens = trimmed_tokens(v, &model, &table, name)?;
                Ok((model, tokens))
            })
            .collect()
    }
}

/// [`Plan::trimmed_vocabularies`] of several plans, each (model, tokens) pair once.
pub fn distinct_trimmed_vocabularies<'a>(
    plans: impl IntoIterator<Item = &'a Plan>,
    store: &ModelStore,
) -> Result<Vec<TrimmedModel>> {
    let mut distinct: Vec<TrimmedModel> = Vec::new();
    for plan in plans {
        for (model, tokens) in plan.trimmed_vocabularies(store)? {
            if !distinct
                .iter()
                .any(|(m, t)| m.path == model.path && *t == tokens)
            {
                distinct.push((model, tokens));
            }
        }
    }
    Ok(distinct)
}

/// A model's file name, which names its instances (in messages and per-model counters).
pub fn file_label(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// Loads what a plan names, sharing model files and tables between the nodes that use them.
struct Builder<'a> {
    registry: &'a Registry,
    store: &'a mut ModelStore,
    tables: HashMap<PathBuf, Arc<BigramTable>>,
    histories: HashMap<PathBuf, SharedHistory>,
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
        self.subject_cost(model.into())
    }

    /// [`Builder::cost`] for a model, or a model with a trimmed vocabulary.
    fn subject_cost(&mut self, subject: Subject) -> Result<ForwardCost> {
        if self.costs.is_none() {
            let cache = CostCache::open(&CostCache::default_path())?;
            if let Some(newer) = cache.written_by_newer_build() {
                eprintln!(
                    "cascade: warning: {newer}: costs are measured for this run only; set \
                     {COSTS_ENV} to give this build a cache of its own"
                );
            }
            self.costs = Some(cache);
        }
        let cache = self.costs.as_mut().expect("opened above");
        let progress = &mut *self.progress;
        let cost = cache.costs(&[subject], false, &mut |event| match event {
            CostEvent::Measuring(_) => progress(&format!("{event} (once per machine)"), 0, 1),
            CostEvent::Contended { .. } | CostEvent::NotSaved(_) => warn_once(&event.to_string()),
        })?;
        Ok(cost.into_iter().next().expect("one model asked"))
    }

    /// The table in `path`, loaded once and checked against `model`'s tokenizer wherever it
    /// is used (models' vocabularies may differ: each is the beginning of the target's).
    fn table(&mut self, path: &Path, model: &LoadedModel) -> Result<Arc<BigramTable>> {
        let table = match self.tables.get(path) {
            Some(t) => t.clone(),
            None => {
                let t = Arc::new(BigramTable::load(path)?);
                self.tables.insert(path.to_path_buf(), t.clone());
                t
            }
        };
        table.check_tokenizer(&model.tokenizer, path)?;
        Ok(table)
    }

    /// The tokens the trimmed vocabulary `v` of drafter `name` always scores.
    fn vocabulary(
        &mut self,
        v: &TrimmedVocabulary,
        model: &LoadedModel,
        name: &str,
    ) -> Result<Arc<[u32]>> {
        let table = self.table(&v.table, model)?;
        trimmed_tokens(v, model, &table, name)
    }

    /// The drafter for `node` under `over` (a model and its name: the target, or a vertical
    /// cascade's reviewer), whose vocabulary or its beginning every model and table under it
    /// must use.
    fn drafter(
        &mut self,
        node: &DrafterNode,
        target: &LoadedModel,
        over: (&LoadedModel, &str),
    ) -> Result<Box<dyn Drafter>> {
        let name = node.name.as_str();
        Ok(match &node.kind {
            DrafterPlan::Model {
                model: m,
                vocabulary,
            } => {
                let model = self.model(m)?;
                check_vocab(over.0, over.1, &model, name)?;
                let instance = model.instance(&file_label(&m.path), self.context);
                let mut drafter = NeuralDrafter::new(name, Box::new(instance));
                let tokens = match vocabulary {
                    Some(v) => Some(self.vocabulary(v, &model, name)?),
                    None => None,
                };
                if self.adaptive {
                    let subject = Subject {
                        model: &model,
                        vocabulary: tokens.as_deref(),
                    };
                    drafter = drafter.with_cost(&self.subject_cost(subject)?);
                }
                Box::new(match tokens {
                    Some(t) => drafter.with_vocabulary(t),
                    None => drafter,
                })
            }
            DrafterPlan::Bigram { table, sample } => Box::new(BigramDrafter::new(
                name,
                self.table(table, over.0)?,
                *sample,
            )),
            DrafterPlan::MaxGram {
                table,
                policy,
                history,
            } => {
                let table = table
                    .as_deref()
                    .map(|t| self.table(t, over.0))
                    .transpose()?;
                let drafter = MaxGramDrafter::new(name, *policy, table);
                Box::new(match history {
                    Some((path, tokens)) => {
                        // Nodes naming one file share it (the first one's settings), and the
                        // first records: a node placed twice in the tree records once.
                        let shared = match self.histories.get(path) {
                            Some(h) => h.reader(),
                            None => {
                                let h = SharedHistory::from(History::open(
                                    path,
                                    target.tokenizer.fingerprint(),
                                    target.weights.vocab_size(),
                                    *tokens,
                                    policy.max_ngram,
                                )?);
                                self.histories.insert(path.clone(), h.clone());
                                h
                            }
                        };
                        drafter.with_history(shared)
                    }
                    None => drafter,
                })
            }
            DrafterPlan::Vertical {
                reviewer,
                inner,
                k,
                lenience,
                adaptive,
            } => {
                let model = self.model(reviewer)?;
                check_vocab(over.0, over.1, &model, name)?;
                let inner = self.drafter(inner, target, (&model, name))?;
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
                    .map(|n| self.drafter(n, target, over))
                    .collect::<Result<Vec<_>>>()?;
                Box::new(AdaptiveCascade::new(name, parts))
            }
            DrafterPlan::Plugin { kind, table, base } => {
                let reviewer = over.0;
                let context = PluginContext {
                    name,
                    table,
                    base,
                    tokenizer: &reviewer.tokenizer,
                    vocab: reviewer.weights.vocab_size(),
                    context: (target.weights.max_len(self.context))
                        .min(reviewer.weights.max_len(self.context)),
                };
                let drafter = self.registry.build(kind, &context).map_err(|e| match e {
                    Error::Config { .. } => e,
                    other => Error::config(format!("drafters.{name}"), other.to_string()),
                })?;
                if drafter.name() != name {
                    return Err(Error::config(
                        format!("drafters.{name}"),
                        format!(
                            "the `{kind}` plug-in named its drafter `{}`: `Drafter::name` must \
                             return the config's name (`PluginContext::name`), which acceptance \
                             priors and reports go by",
                            drafter.name()
                        ),
                    ));
                }
                drafter
            }
            DrafterPlan::Horizontal { parts } => {
                let parts = parts
                    .iter()
                    .map(|(n, tokens)| Ok((self.drafter(n, target, over)?, *tokens)))
                    .collect::<Result<Vec<_>>>()?;
                Box::new(HorizontalCascade::new(name, parts))
            }
        })
    }
}

/// The tokens the trimmed vocabulary `v` of drafter `name` always scores: the `v.tokens` most
/// frequent of `table`'s corpus (its table, checked against `model`'s tokenizer), and the
/// end-of-sequence tokens.
pub fn trimmed_tokens(
    v: &TrimmedVocabulary,
    model: &LoadedModel,
    table: &BigramTable,
    name: &str,
) -> Result<Arc<[u32]>> {
    let size = model.weights.vocab_size();
    if v.tokens >= size {
        return Err(Error::config(
            format!("drafters.{name}.vocabulary"),
            format!(
                "{} is not below the model's vocabulary ({size} tokens): leave it out to score every token",
                v.tokens
            ),
        ));
    }
    let ranking = table.ranking();
    if ranking.is_empty() {
        return Err(Error::config(
            format!("drafters.{name}.vocabulary_table"),
            format!(
                "{} has no token ranking (an older format); rebuild it with `cascade ngram build`",
                v.table.display()
            ),
        ));
    }
    let eos = model.tokenizer.eos_ids();
    let mut tokens: Vec<u32> = ranking[..v.tokens.min(ranking.len())]
        .iter()
        .chain(eos)
        .copied()
        .collect();
    tokens.sort_unstable();
    tokens.dedup();
    Ok(tokens.into())
}

/// A drafter must speak its reviewer's vocabulary (the target's, or a vertical cascade's
/// reviewer's): its tokens are the reviewer's at the same ids, and its logits no
/// wider than the reviewer's. It may have fewer: the larger models of a family pad theirs
/// further (Qwen2.5 7B to 32B have 152,064 ids, the 0.5B to 3B 151,936), and a drafter never
/// proposes the ids it lacks, which the review still samples.
pub fn check_vocab(
    reviewer: &LoadedModel,
    reviewer_name: &str,
    drafter: &LoadedModel,
    drafter_name: &str,
) -> Result<()> {
    let (t, d) = (&reviewer.tokenizer, &drafter.tokenizer);
    // The reviewer's fingerprint over the ids compared (all of them if the drafter has more).
    let target_fp = t.fingerprint_of_first(d.vocab_size().min(t.vocab_size()));
    if d.vocab_size() > t.vocab_size() || target_fp != d.fingerprint() {
        return Err(Error::VocabMismatch {
            target: reviewer_name.into(),
            drafter: drafter_name.into(),
            target_vocab: t.vocab_size(),
            drafter_vocab: d.vocab_size(),
            target_fp,
            drafter_fp: d.fingerprint(),
        });
    }
    let (tw, dw) = (reviewer.weights.vocab_size(), drafter.weights.vocab_size());
    if dw > tw {
        return Err(Error::config(
            format!("drafters.{drafter_name}"),
            format!(
                "its model scores {dw} ids, more than the {tw} of `{reviewer_name}`: a drafter's \
                 logits may be no wider than its reviewer's"
            ),
        ));
    }
    Ok(())
}

/// Prints a warning on standard error, once per process: every engine a bench builds, and a
/// model that is both target and drafter, asks the same costs again.
fn warn_once(warning: &str) {
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if !said.iter().any(|w| w == warning) {
        eprintln!("cascade: warning: {warning}");
        said.push(warning.to_string());
    }
}
