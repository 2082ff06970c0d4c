//! Where a model file comes from: a local path, or a Hugging Face repo resolved via hf-hub.

use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// A model file named in a config: `"path/to/model.gguf"` or
/// `{ repo = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", file = "...gguf", revision = "main" }`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A local file (relative to the config's folder).
    Path(PathBuf),
    /// A file of a Hugging Face repository, from the local hub cache.
    Hub {
        /// The repository, `owner/name`.
        repo: String,
        /// The file in it.
        file: String,
        /// The branch, tag or commit (default `main`).
        revision: String,
    },
}

fn main_revision() -> String {
    "main".into()
}

/// The table form of [`ModelSource::Hub`], read on its own so that a misspelt or missing key
/// is named (an untagged enum only says that neither form matched).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HubTable {
    repo: String,
    file: String,
    #[serde(default = "main_revision")]
    revision: String,
}

impl<'de> Deserialize<'de> for ModelSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::{self, MapAccess, Visitor};
        struct Source;
        impl<'de> Visitor<'de> for Source {
            type Value = ModelSource;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a path, or a table { repo, file, revision }")
            }
            fn visit_str<E: de::Error>(self, path: &str) -> std::result::Result<ModelSource, E> {
                Ok(ModelSource::Path(path.into()))
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                map: A,
            ) -> std::result::Result<ModelSource, A::Error> {
                let t = HubTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(ModelSource::Hub {
                    repo: t.repo,
                    file: t.file,
                    revision: t.revision,
                })
            }
        }
        d.deserialize_any(Source)
    }
}

/// The Hugging Face settings of the environment, read as Python's `huggingface_hub` reads
/// them, so that a model it fetched is found and a gated one downloads with its token.
#[derive(Clone, Debug)]
pub struct HubEnv {
    /// The hub cache: `HF_HUB_CACHE`, else `$HF_HOME/hub`, `HF_HOME` being
    /// `$XDG_CACHE_HOME/huggingface` (or `~/.cache/huggingface`) unless set.
    pub cache: PathBuf,
    /// `HF_TOKEN`, else the token `huggingface-cli login` saved (`HF_TOKEN_PATH`, else
    /// `$HF_HOME/token`).
    pub token: Option<String>,
    /// `HF_ENDPOINT` (a mirror), else huggingface.co.
    pub endpoint: Option<String>,
    /// `HF_HUB_OFFLINE` set to `1`, `true`, `yes` or `on`: never download.
    pub offline: bool,
}

impl HubEnv {
    /// The settings of this process's environment.
    pub fn from_env() -> Self {
        let var = |name| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        // A leading `~` stands for the home folder, as Python's `expanduser` reads it.
        let path = |v: String| match (v.strip_prefix("~/"), var("HOME")) {
            (Some(rest), Some(home)) => Path::new(&home).join(rest),
            _ => PathBuf::from(v),
        };
        let home = var("HF_HOME").map(path).unwrap_or_else(|| {
            let cache = var("XDG_CACHE_HOME").unwrap_or_else(|| "~/.cache".into());
            path(cache).join("huggingface")
        });
        let token_file = var("HF_TOKEN_PATH").map_or_else(|| home.join("token"), path);
        let saved_token = || {
            let token = std::fs::read_to_string(token_file).ok()?;
            Some(token.trim().to_string()).filter(|t| !t.is_empty())
        };
        Self {
            cache: var("HF_HUB_CACHE")
                .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
                .map_or_else(|| home.join("hub"), path),
            token: var("HF_TOKEN").or_else(saved_token),
            endpoint: var("HF_ENDPOINT").map(|e| e.trim_end_matches('/').to_string()),
            offline: is_true(var("HF_HUB_OFFLINE").as_deref()),
        }
    }
}

impl ModelSource {
    /// The local file for this source. Relative paths are taken from `base`. Hub files are
    /// looked up in the hub cache first, and downloaded only when missing and not offline, as
    /// the environment says ([`HubEnv`]).
    pub fn resolve(&self, base: &Path) -> Result<PathBuf> {
        match self {
            ModelSource::Path(p) => local_file(base, p),
            ModelSource::Hub { .. } => self.resolve_with(base, &HubEnv::from_env()),
        }
    }

    /// [`ModelSource::resolve`] with the given hub settings.
    pub fn resolve_with(&self, base: &Path, hub: &HubEnv) -> Result<PathBuf> {
        match self {
            ModelSource::Path(p) => local_file(base, p),
            ModelSource::Hub {
                repo,
                file,
                revision,
            } => {
                let hub_err = |reason: String| Error::Hub {
                    repo: repo.clone(),
                    file: file.clone(),
                    reason,
                };
                let cache = hf_hub::Cache::new(hub.cache.clone());
                let hub_repo = hf_hub::Repo::with_revision(
                    repo.clone(),
                    hf_hub::RepoType::Model,
                    revision.clone(),
                );
                if let Some(p) = cache.repo(hub_repo.clone()).get(file) {
                    return Ok(p);
                }
                // A commit's snapshot has no ref when Python's huggingface_hub fetched it by
                // its hash: hf-hub looks refs up only.
                let pinned = cache
                    .path()
                    .join(format!("models--{}", repo.replace('/', "--")))
                    .join("snapshots")
                    .join(revision)
                    .join(file);
                if is_commit(revision) && pinned.is_file() {
                    return Ok(pinned);
                }
                if hub.offline {
                    return Err(hub_err(format!(
                        "not in the cache at {} and HF_HUB_OFFLINE is set",
                        cache.path().display()
                    )));
                }
                let mut api = hf_hub::api::sync::ApiBuilder::from_cache(cache)
                    .with_token(hub.token.clone())
                    .with_progress(true);
                if let Some(endpoint) = &hub.endpoint {
                    api = api.with_endpoint(endpoint.clone());
                }
                let api = api.build().map_err(|e| hub_err(e.to_string()))?;
                api.repo(hub_repo)
                    .get(file)
                    .map_err(|e| hub_err(format!("download failed: {e}")))
            }
        }
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Path(p) => write!(f, "{}", p.display()),
            ModelSource::Hub { repo, file, .. } => write!(f, "{repo}/{file}"),
        }
    }
}

/// A local model file; a relative path is taken from `base`.
fn local_file(base: &Path, p: &Path) -> Result<PathBuf> {
    let p = base.join(p); // an absolute `p` replaces `base`
    if p.is_file() {
        // One file, one path: configs that name it differently share one load.
        Ok(std::fs::canonicalize(&p).unwrap_or(p))
    } else {
        Err(Error::ModelNotFound(p))
    }
}

/// Whether an environment flag is set, spelt as Hugging Face's own tools accept it.
fn is_true(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        ["1", "true", "yes", "on"]
            .iter()
            .any(|t| v.trim().eq_ignore_ascii_case(t))
    })
}

/// Whether `revision` is a commit hash (40 hex digits) rather than a branch or tag.
fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hub settings with the cache at `cache`, as `HF_HUB_CACHE` gives them (the variables
    /// are not set here: that would race with other tests' reads).
    fn hub(cache: &Path, offline: bool) -> HubEnv {
        HubEnv {
            cache: cache.to_path_buf(),
            token: None,
            endpoint: None,
            offline,
        }
    }

    /// Lays out a hub cache the way hf-hub writes it: refs/<revision> names a snapshot.
    fn fake_cache(root: &Path, repo: &str, revision: &str, file: &str) -> PathBuf {
        let dir = root.join(format!("models--{}", repo.replace('/', "--")));
        std::fs::create_dir_all(dir.join("refs")).unwrap();
        std::fs::write(dir.join("refs").join(revision), "abc123").unwrap();
        let snap = dir.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join(file), b"GGUF").unwrap();
        snap.join(file)
    }

    #[test]
    fn hub_source_resolves_from_local_cache_without_network() {
        let tmp = tempfile::tempdir().unwrap();
        let expected = fake_cache(tmp.path(), "Org/Model-GGUF", "main", "m.gguf");
        let src: ModelSource =
            toml::from_str::<toml::Value>("m = { repo = \"Org/Model-GGUF\", file = \"m.gguf\" }")
                .unwrap()["m"]
                .clone()
                .try_into()
                .unwrap();
        let got = src
            .resolve_with(Path::new("."), &hub(tmp.path(), false))
            .unwrap();
        assert_eq!(got, expected);
    }

    #[test]
    fn hf_hub_offline_takes_hugging_faces_spellings() {
        for on in ["1", "true", "TRUE", "Yes", "on", " 1 "] {
            assert!(is_true(Some(on)), "{on:?}");
        }
        for off in [
            None,
            Some(""),
            Some("0"),
            Some("false"),
            Some("no"),
            Some("off"),
        ] {
            assert!(!is_true(off), "{off:?}");
        }
    }

    /// A snapshot fetched by its commit hash, with no ref naming it, is found offline.
    #[test]
    fn a_pinned_commit_resolves_without_a_ref() {
        let tmp = tempfile::tempdir().unwrap();
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snap = tmp.path().join("models--Org--M/snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("m.gguf"), b"GGUF").unwrap();
        let src = ModelSource::Hub {
            repo: "Org/M".into(),
            file: "m.gguf".into(),
            revision: commit.into(),
        };
        let got = src.resolve_with(Path::new("."), &hub(tmp.path(), true));
        assert_eq!(got.unwrap(), snap.join("m.gguf"));
    }

    /// A misspelt key of the table form is named, as every other config key is.
    #[test]
    fn a_misspelt_hub_key_is_named() {
        let parse = |t: &str| {
            toml::from_str::<toml::Value>(t).unwrap()["m"]
                .clone()
                .try_into::<ModelSource>()
                .unwrap_err()
                .to_string()
                .trim_end()
                .to_string()
        };
        assert_eq!(
            parse("m = { repo = \"a/b\", fil = \"x.gguf\" }"),
            "unknown field `fil`, expected one of `repo`, `file`, `revision`"
        );
        assert_eq!(parse("m = { repo = \"a/b\" }"), "missing field `file`");
        assert_eq!(
            parse("m = 3"),
            "invalid type: integer `3`, expected a path, or a table { repo, file, revision }"
        );
    }

    #[test]
    fn hub_source_missing_offline_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let src = ModelSource::Hub {
            repo: "Org/Absent".into(),
            file: "x.gguf".into(),
            revision: "main".into(),
        };
        let err = src
            .resolve_with(Path::new("."), &hub(tmp.path(), true))
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("cannot resolve model Org/Absent/x.gguf: not in the cache"),
            "{err}"
        );
    }

    #[test]
    fn relative_path_is_taken_from_the_config_dir() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("m.gguf"), b"x").unwrap();
        let src = ModelSource::Path("m.gguf".into());
        assert_eq!(src.resolve(tmp.path()).unwrap(), tmp.path().join("m.gguf"));
        let err = ModelSource::Path("nope.gguf".into())
            .resolve(tmp.path())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "model file not found: {}",
                tmp.path().join("nope.gguf").display()
            )
        );
    }
}
