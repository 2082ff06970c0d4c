//! Drafter kinds a library user adds to configs.
//!
//! ```no_run
//! use cascade::config::{PluginContext, RawConfig, Registry};
//! use cascade::drafter::{Drafter, MaxGramDrafter, MaxGramPolicy};
//! use std::path::Path;
//!
//! let mut registry = Registry::default();
//! // `[drafters.quick] kind = "my_max_gram"` in a config now builds this drafter.
//! registry.register("my_max_gram", |cx: &PluginContext| -> cascade::Result<Box<dyn Drafter>> {
//!     cx.only(&["max_ngram"])?;
//!     let policy = MaxGramPolicy { max_ngram: cx.usize("max_ngram")?.unwrap_or(8), ..Default::default() };
//!     Ok(Box::new(MaxGramDrafter::new(cx.name, policy, None)))
//! });
//! let plan = RawConfig::load(Path::new("my.toml"))?.validate_with(Path::new("."), &registry)?;
//! # Ok::<(), cascade::Error>(())
//! ```

use crate::draft::Drafter;
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Builds a plug-in drafter from its config table.
type Constructor = dyn Fn(&PluginContext) -> Result<Box<dyn Drafter>> + Send + Sync;

/// Drafter kinds registered under names, usable in configs like the built-in kinds.
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<String, Arc<Constructor>>,
}

/// What a plug-in's constructor gets: its node's name and table, and the tokenizer,
/// vocabulary size and context length of the model reviewing its drafts (the target, or the
/// reviewer of the vertical cascade it sits under).
pub struct PluginContext<'a> {
    /// The drafter's name in `[drafters]`, which its [`Drafter::name`] must return: acceptance
    /// priors and reports go by it.
    pub name: &'a str,
    /// Its table as written, `kind` removed.
    pub table: &'a toml::Table,
    /// The config's folder: relative paths in the table are from here.
    pub base: &'a Path,
    /// The reviewer's tokenizer (drafts must use its token ids).
    pub tokenizer: &'a Tokenizer,
    /// The reviewer's vocabulary size: every drafted id is below it.
    pub vocab: usize,
    /// The context length (the config's `context`, capped at the target's and the
    /// reviewer's): the longest sequence a draft may continue.
    pub context: usize,
}

impl Registry {
    /// Registers `kind` (replacing a kind registered before under that name).
    ///
    /// # Panics
    /// If `kind` is a built-in kind ([`BUILT_IN_KINDS`](super::BUILT_IN_KINDS)), which configs
    /// would go on building instead of the plug-in.
    pub fn register(
        &mut self,
        kind: &str,
        build: impl Fn(&PluginContext) -> Result<Box<dyn Drafter>> + Send + Sync + 'static,
    ) -> &mut Self {
        assert!(
            !super::BUILT_IN_KINDS.contains(&kind),
            "cannot register a drafter kind named `{kind}`: it is a built-in kind"
        );
        self.kinds.insert(kind.to_string(), Arc::new(build));
        self
    }

    /// Whether `kind` is registered.
    pub fn has(&self, kind: &str) -> bool {
        self.kinds.contains_key(kind)
    }

    /// The registered kinds, comma-separated (`none` if there are none).
    pub fn kinds(&self) -> String {
        if self.kinds.is_empty() {
            "none".into()
        } else {
            self.kinds.keys().cloned().collect::<Vec<_>>().join(", ")
        }
    }

    /// Builds a drafter of `kind` (validation checked that it is registered).
    pub(crate) fn build(&self, kind: &str, context: &PluginContext) -> Result<Box<dyn Drafter>> {
        let build = self.kinds.get(kind).ok_or_else(|| {
            Error::config(
                format!("drafters.{}.kind", context.name),
                format!("unknown drafter kind `{kind}`"),
            )
        })?;
        build(context)
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.kinds.keys()).finish()
    }
}

impl PluginContext<'_> {
    /// The TOML path of `key` in this drafter's table, for error messages.
    pub fn at(&self, key: &str) -> String {
        format!("drafters.{}.{key}", self.name)
    }

    /// An error about `key` of this drafter's table.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::config(self.at(key), message)
    }

    /// Fails on keys of the table other than `known`, naming them.
    pub fn only(&self, known: &[&str]) -> Result<()> {
        match self.table.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(self.error(k, format!("unknown key (known: {})", known.join(", ")))),
            None => Ok(()),
        }
    }

    /// The string at `key`, if present.
    pub fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.error(key, "must be a string")),
        }
    }

    /// The non-negative integer at `key`, if present.
    pub fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) if *n >= 0 => Ok(Some(*n as usize)),
            Some(_) => Err(self.error(key, "must be an integer >= 0")),
        }
    }

    /// The finite number at `key` (an integer or a float), if present.
    pub fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) => Ok(Some(*n as f64)),
            Some(toml::Value::Float(x)) if x.is_finite() => Ok(Some(*x)),
            Some(_) => Err(self.error(key, "must be a finite number")),
        }
    }

    /// The boolean at `key`, if present.
    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Boolean(b)) => Ok(Some(*b)),
            Some(_) => Err(self.error(key, "must be true or false")),
        }
    }

    /// The list of strings at `key`, if present.
    pub fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    toml::Value::String(s) => Ok(s.clone()),
                    _ => Err(self.error(key, "must be a list of strings")),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(_) => Err(self.error(key, "must be a list of strings")),
        }
    }

    /// A file named at `key`, relative to the config's folder; an error if it does not exist.
    pub fn file(&self, key: &str) -> Result<Option<PathBuf>> {
        let Some(p) = self.str(key)? else {
            return Ok(None);
        };
        let path = self.base.join(p);
        if path.is_file() {
            Ok(Some(path))
        } else {
            Err(self.error(key, crate::files::not_a_file(&path)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each accessor reads its type, refuses another with the key's TOML path, and reads a
    /// missing key as `None`.
    #[test]
    fn a_plug_ins_table_is_read_by_type() {
        let table: toml::Table =
            toml::from_str("n = 3\nx = 0.5\nflag = true\nname = \"a\"\nnan = nan\n").unwrap();
        let tokenizer = crate::tokenizer::Tokenizer::from_parts(
            tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default()),
            vec![],
        );
        let cx = PluginContext {
            name: "p",
            table: &table,
            base: Path::new("."),
            tokenizer: &tokenizer,
            vocab: 1,
            context: 1,
        };
        assert_eq!(cx.usize("n").unwrap(), Some(3));
        assert_eq!(cx.f64("n").unwrap(), Some(3.0));
        assert_eq!(cx.f64("x").unwrap(), Some(0.5));
        assert_eq!(cx.bool("flag").unwrap(), Some(true));
        assert_eq!(cx.str("name").unwrap(), Some("a"));
        assert_eq!(cx.bool("missing").unwrap(), None);
        let e = |r: Result<Option<f64>>| r.unwrap_err().to_string();
        assert_eq!(e(cx.f64("nan")), "drafters.p.nan: must be a finite number");
        assert_eq!(
            e(cx.f64("flag")),
            "drafters.p.flag: must be a finite number"
        );
        assert_eq!(
            cx.bool("n").unwrap_err().to_string(),
            "drafters.p.n: must be true or false"
        );
    }
}
