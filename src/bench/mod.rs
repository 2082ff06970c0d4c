//! The bench harness: a prompt suite across configs, interleaved, against autoregressive
//! decoding of the same prompts in the same process, with the papers' metrics and the run-time
//! cost model's prediction beside the measured speedup.
//!
//! - [`suite`]: prompt suites;
//! - [`run`](mod@run): the runs, and `generate --compare`'s one-prompt version;
//! - [`measure`]: model costs measured in the same run;
//! - [`summary`]: aggregates per config and category;
//! - [`report`]: `report.json`, `report.md` and the charts.

pub mod measure;
mod plot;
pub mod report;
pub mod run;
pub mod suite;
pub mod summary;

pub use measure::{measure_costs, measure_store_costs, ModelCost, VerifyCost};
pub use report::{markdown, utc_now, Report};
pub use run::{
    compare, exact_greedy, record, run, speedup, BenchConfig, BenchOptions, Comparison, EarlyEnd,
    LevelRecord, RunRecord,
};
pub use suite::{load_suite, per_category, SuitePrompt};
pub use summary::{summarize, Summary};
