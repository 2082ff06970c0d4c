//! Model costs for a report: measured in the bench's own run, every model side by side.

use crate::config::file_label;
use crate::costs;
use crate::error::{Error, Result};
use crate::model::{LoadedModel, ModelStore};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A model's measured cost (JSON `models[]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelCost {
    /// The model file's name.
    pub model: String,
    /// Its number of weights.
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

/// Measures r(k) for the target and the cost coefficient of every other model.
pub fn measure_costs(
    target: &LoadedModel,
    others: &[&LoadedModel],
) -> Result<(VerifyCost, Vec<ModelCost>)> {
    let models: Vec<&LoadedModel> = std::iter::once(target)
        .chain(others.iter().copied())
        .collect();
    let subjects: Vec<costs::Subject> = models.iter().map(|&m| m.into()).collect();
    let costs::Measurement {
        costs: measured,
        cpu_share,
    } = costs::measure(&subjects, REPS)?;
    let (t, tp) = (
        measured[0].decode_seconds,
        target.weights.param_count() as f64,
    );
    let costs: Vec<ModelCost> = models
        .iter()
        .zip(&measured)
        .map(|(m, c)| ModelCost {
            model: file_label(&m.path),
            params: m.weights.param_count(),
            decode_ms: c.decode_seconds * 1e3,
            forward_cost: c.ratios.clone(),
            c_measured: c.decode_seconds / t,
            c_params: m.weights.param_count() as f64 / tp,
            cpu_share,
        })
        .collect();
    Ok((costs[0].forward_cost.clone(), costs))
}

/// [`measure_costs`] for the models of `store`, the one at `target` being the target.
pub fn measure_store_costs(
    store: &ModelStore,
    target: &Path,
) -> Result<(VerifyCost, Vec<ModelCost>)> {
    let loaded: Vec<_> = store.loaded().collect();
    let (t, others): (Vec<_>, Vec<_>) = loaded.into_iter().partition(|m| m.path == target);
    let t = t.first().ok_or_else(|| {
        Error::config(
            target.display().to_string(),
            "the target model was not loaded",
        )
    })?;
    let others: Vec<&LoadedModel> = others.into_iter().map(|m| m.as_ref()).collect();
    measure_costs(t, &others)
}
