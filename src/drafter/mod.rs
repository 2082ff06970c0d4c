//! The built-in drafters: anything that proposes tokens for a reviewer to check.
//!
//! All implement the one [`Drafter`] trait (see [`crate::draft`]), so any tree of them
//! composes over a target: a cascade is a drafter that contains a reviewer model and other
//! drafters.

mod adaptive;
mod bigram;
mod history;
mod horizontal;
mod max_gram;
mod neural;
mod prediction;
mod vertical;

pub use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
pub use adaptive::AdaptiveCascade;
pub use bigram::BigramDrafter;
pub use history::{History, HistoryMatch, SharedHistory};
pub use horizontal::HorizontalCascade;
pub use max_gram::{Match, MaxGram, MaxGramDrafter, MaxGramPolicy};
pub use neural::NeuralDrafter;
pub use prediction::PredictionDrafter;
pub use vertical::VerticalCascade;
