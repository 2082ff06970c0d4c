//! Prompt suites: one JSON object per line.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// One line of a prompt suite (JSONL).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SuitePrompt {
    /// The prompt's category (code-editing, chat, ...).
    pub category: String,
    /// The prompt text.
    pub prompt: String,
    /// Wrap the prompt in the model's chat template.
    #[serde(default)]
    pub chat: bool,
    /// The line of the suite file it was read from (from 1; 0 if not read from a file), for
    /// error messages.
    #[serde(skip)]
    pub line: usize,
}

/// Reads a JSONL prompt suite; errors name the line.
pub fn load_suite(path: &Path) -> Result<Vec<SuitePrompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::config(
            path.display().to_string(),
            format!("cannot read prompt suite: {e}"),
        )
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let at = || format!("{}:{}", path.display(), i + 1);
            let mut p: SuitePrompt =
                serde_json::from_str(l).map_err(|e| Error::config(at(), e.to_string()))?;
            p.line = i + 1;
            if p.category == "all" {
                return Err(Error::config(
                    at(),
                    "the category `all` is the report's name for the whole suite: rename it",
                ));
            }
            Ok(p)
        })
        .collect()
}

/// Keeps the first `n` prompts of each category.
pub fn per_category(suite: &mut Vec<SuitePrompt>, n: usize) {
    let mut seen = HashMap::new();
    suite.retain(|p| {
        let c = seen.entry(p.category.clone()).or_insert(0);
        *c += 1;
        *c <= n
    });
}
