//! Model costs for a report: measured in the bench's own run, every model side by side.

use crate::config::{distinct_trimmed_vocabularies, Plan};
use crate::costs;
use crate::error::{Error, Result};
use crate::model::ModelStore;
use serde::{Deserialize, Serialize};

/// A model's measured cost (JSON `models[]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelCost {
    /// The model file's name, with the size of its trimmed vocabulary if it scores one
    /// (`model.gguf (vocabulary 32770)`: the name drafters' forward calls are counted under).
    pub model: String,
    /// The number of weights in its file.
    pub params: usize,
    /// Median one-token decode time after a 64-token context.
    pub decode_ms: f64,
    /// (k, r(k)): this model's forward over k tokens relative to one token (a reviewer's
    /// verify cost).
    pub forward_cost: Vec<(usize, f64)>,
    /// `decode_ms` relative to the target's: the measured cost coefficient c.
    pub c_measured: f64,
    /// Parameter count relative to the target's (the paper's "model size" cost model).
    pub c_params: f64,
    /// The CPU share of the measurement ([`costs::Measurement::cpu_share`]).
    #[serde(default)]
    pub cpu_share: Option<f64>,
}

impl ModelCost {
    /// The CPU share of the measurement if other work had the CPU meanwhile, so that the
    /// cost came out too high.
    pub fn contended(&self) -> Option<f64> {
        costs::contended(self.cpu_share)
    }
}

/// Measured (k, r(k)) points: a target forward over k tokens relative to one token.
pub type VerifyCost = Vec<(usize, f64)>;

/// Repetitions of the measurement in a bench run.
const REPS: usize = 8;

/// Measures r(k) for the target (the first subject) and the cost coefficient of every other
/// subject: a model, or a model scoring a trimmed vocabulary (named as such).
pub fn measure_costs(subjects: &[costs::Subject]) -> Result<(VerifyCost, Vec<ModelCost>)> {
    let Some(target) = subjects.first() else {
        return Err(Error::config("bench", "no model to measure"));
    };
    let costs::Measurement {
        costs: measured,
        cpu_share,
    } = costs::measure(subjects, REPS)?;
    let target = target.model;
    let (t, tp) = (
        measured[0].decode_seconds,
        target.weights.param_count() as f64,
    );
    let costs: Vec<ModelCost> = subjects
        .iter()
        .zip(&measured)
        .map(|(&s, c)| ModelCost {
            model: costs::CostCache::label(s),
            params: s.model.weights.param_count(),
            decode_ms: c.decode_seconds * 1e3,
            forward_cost: c.ratios.clone(),
            c_measured: c.decode_seconds / t,
            c_params: s.model.weights.param_count() as f64 / tp,
            cpu_share,
        })
        .collect();
    Ok((costs[0].forward_cost.clone(), costs))
}

/// [`measure_costs`] for the models of `store`, where `plans` were built: the first plan's
/// target, every other model, and every drafter's trimmed vocabulary.
pub fn measure_store_costs(
    store: &ModelStore,
    plans: &[&Plan],
) -> Result<(VerifyCost, Vec<ModelCost>)> {
    let target = &plans
        .first()
        .ok_or_else(|| Error::config("bench", "no config to measure the models of"))?
        .target
        .path;
    let loaded: Vec<_> = store.loaded().collect();
    let (t, others): (Vec<_>, Vec<_>) = loaded.into_iter().partition(|m| &m.path == target);
    let t = t.first().ok_or_else(|| {
        Error::config(
            target.display().to_string(),
            "the target model was not loaded",
        )
    })?;
    let trimmed = distinct_trimmed_vocabularies(plans.iter().copied(), store)?;
    let subjects: Vec<costs::Subject> = std::iter::once(t.as_ref().into())
        .chain(others.into_iter().map(|m| m.as_ref().into()))
        .chain(trimmed.iter().map(|(m, v)| costs::Subject {
            model: m,
            vocabulary: Some(v),
        }))
        .collect();
    measure_costs(&subjects)
}
