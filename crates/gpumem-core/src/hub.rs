//! Models as people name them: a Hugging Face Hub id (`ORG/NAME`, optionally `@REVISION`), a
//! model directory, or its `config.json`. Each is read offline — from the local Hub cache as
//! `huggingface_hub` lays it out, never the weights — and becomes the tracer's
//! `hf:CLASS(key=value,…)` reference carrying every key of the config as the Hub states it, so
//! every form that names the same config names the same model (and the same trace).

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::job::HF_CODE_PREFIX;

/// Keys of a Hub `config.json` that say how the file was written or how the weights are stored,
/// not the model's structure. The training precision comes from the job, not from `torch_dtype`
/// (the weights' load dtype); `architectures` becomes the class.
const BOOKKEEPING: [&str; 7] = [
    "architectures",
    "_name_or_path",
    "transformers_version",
    "auto_map",
    "torch_dtype",
    "dtype",
    "model_type",
];

/// Where `huggingface_hub` keeps downloaded repositories (`models--ORG--NAME/…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubCache {
    root: PathBuf,
}

impl HubCache {
    /// The cache `huggingface_hub` uses in this environment: `HF_HUB_CACHE`, else the legacy
    /// `HUGGINGFACE_HUB_CACHE`, else `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else
    /// `~/.cache/huggingface/hub`.
    pub fn from_env() -> HubCache {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let root = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
            .unwrap_or_else(|| {
                var("HOME")
                    .unwrap_or_default()
                    .join(".cache")
                    .join("huggingface")
                    .join("hub")
            });
        HubCache { root }
    }

    pub fn at(root: impl Into<PathBuf>) -> HubCache {
        HubCache { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cached `config.json` of `id`: the snapshot its revision (`main` by default) points
    /// to, or the snapshot named by a commit hash.
    pub fn config(&self, id: &HubId) -> Result<PathBuf, HubError> {
        let repo = self
            .root
            .join(format!("models--{}", id.repo.replace('/', "--")));
        if !repo.is_dir() {
            return Err(HubError::NotCached {
                repo: id.repo.clone(),
                cache: self.root.clone(),
            });
        }
        let revision = id.revision.as_deref().unwrap_or("main");
        let commit = match std::fs::read_to_string(repo.join("refs").join(revision)) {
            Ok(c) => c.trim().to_string(),
            Err(_) => revision.to_string(), // a commit hash names its snapshot directly
        };
        let config = repo.join("snapshots").join(&commit).join("config.json");
        if config.is_file() {
            Ok(config)
        } else {
            Err(HubError::NoSnapshot {
                repo: id.repo.clone(),
                revision: revision.to_string(),
                looked: config,
            })
        }
    }
}

/// A Hub repository id, `NAME` or `ORG/NAME`, with an optional `@REVISION` (branch, tag or
/// commit). Invariant: each part is a non-empty run of the characters the Hub allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    repo: String,
    revision: Option<String>,
}

impl HubId {
    /// `None` unless `s` has the shape of a Hub id.
    pub fn parse(s: &str) -> Option<HubId> {
        let (repo, revision) = match s.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, Some(rev.to_string())),
            Some(_) => return None,
            None => (s, None),
        };
        let part = |p: &str| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let ok = match repo.split_once('/') {
            Some((org, name)) => part(org) && part(name),
            None => part(repo),
        };
        ok.then(|| HubId {
            repo: repo.to_string(),
            revision,
        })
    }

    pub fn repo(&self) -> &str {
        &self.repo
    }

    pub fn revision(&self) -> Option<&str> {
        self.revision.as_deref()
    }
}

impl fmt::Display for HubId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.repo)?;
        if let Some(r) = &self.revision {
            write!(f, "@{r}")?;
        }
        Ok(())
    }
}

/// How a model argument names a Hugging Face config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HubSource {
    /// A `config.json` (any `.json` file) on disk.
    ConfigFile(PathBuf),
    /// A model directory holding a `config.json` (a snapshot, a saved model).
    Directory(PathBuf),
    /// A repository id, read from the local Hub cache.
    Id(HubId),
}

impl HubSource {
    /// What `arg` names: an existing directory or `.json` file, else a Hub id with an `ORG/`
    /// part (a bare `NAME` is a Hub id only where the cache holds it, so a mistyped native spec
    /// still gets the native parser's error).
    pub fn of(arg: &str, cache: &HubCache) -> Option<HubSource> {
        let path = Path::new(arg);
        if path.is_dir() {
            return Some(HubSource::Directory(path.to_path_buf()));
        }
        if path.is_file() && path.extension().is_some_and(|e| e == "json") {
            return Some(HubSource::ConfigFile(path.to_path_buf()));
        }
        let id = HubId::parse(arg)?;
        (id.repo.contains('/') || cache.config(&id).is_ok()).then_some(HubSource::Id(id))
    }

    /// The config this source names, read.
    pub fn read(&self, cache: &HubCache) -> Result<HubModel, HubError> {
        HubModel::read(&self.config(cache)?)
    }

    /// Where the config this source names is.
    fn config(&self, cache: &HubCache) -> Result<PathBuf, HubError> {
        match self {
            HubSource::ConfigFile(p) => Ok(p.clone()),
            HubSource::Directory(d) => {
                let p = d.join("config.json");
                if !p.is_file() {
                    return Err(HubError::NoConfig { dir: d.clone() });
                }
                Ok(p)
            }
            HubSource::Id(id) => cache.config(id),
        }
    }

    /// The tracer's reference to this checkpoint run by its own code, as transformers'
    /// `trust_remote_code=True` runs it: `hf-code:DIR`, DIR the directory of its config
    /// (absolute), which must hold the code its `auto_map` names; a config that names none is
    /// the model transformers has, its `hf:` reference.
    pub fn code_reference(&self, cache: &HubCache) -> Result<String, HubError> {
        let config = self.config(cache)?;
        let value = read_json(&config)?;
        let Some(Value::Object(auto)) = value.get("auto_map") else {
            return Ok(HubModel::from_config_at(&config, value)?.reference());
        };
        let dir = config.parent().unwrap_or(Path::new("."));
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        for module in auto.values().filter_map(code_module) {
            let file = dir.join(format!("{module}.py"));
            if !file.is_file() {
                return Err(HubError::MissingCode { file });
            }
        }
        Ok(format!("{HF_CODE_PREFIX}{}", dir.display()))
    }
}

/// A config file's JSON, its problems naming the file.
fn read_json(path: &Path) -> Result<Value, HubError> {
    let text = std::fs::read_to_string(path).map_err(|e| HubError::Read {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| HubError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// The module of an `auto_map` entry (`modeling_qwen.QWenLMHeadModel`, or a tokenizer's pair),
/// where it is in the checkpoint's own directory (not `REPO--module.Class`, another repository's).
fn code_module(entry: &Value) -> Option<&str> {
    let class = match entry {
        Value::String(s) => s.as_str(),
        Value::Array(a) => a.iter().find_map(Value::as_str)?,
        _ => return None,
    };
    let (module, _) = class.rsplit_once('.')?;
    (!module.contains("--")).then_some(module)
}

/// A Hugging Face model config, read. Invariant: `class` is the config's first architecture and
/// `keys` its structural keys (bookkeeping dropped, labels as their count).
#[derive(Debug, Clone, PartialEq)]
pub struct HubModel {
    class: String,
    keys: Map<String, Value>,
}

impl HubModel {
    pub fn read(path: &Path) -> Result<HubModel, HubError> {
        Self::from_config_at(path, read_json(path)?)
    }

    /// [`HubModel::from_config`] of the config read from `path`, its problem naming the file.
    fn from_config_at(path: &Path, config: Value) -> Result<HubModel, HubError> {
        Self::from_config(config).map_err(|problem| HubError::Config {
            path: path.to_path_buf(),
            problem,
        })
    }

    /// A config as JSON: its class from `architectures`, its keys as the Hub states them.
    pub fn from_config(config: Value) -> Result<HubModel, ConfigProblem> {
        let Value::Object(mut keys) = config else {
            return Err(ConfigProblem::NotObject);
        };
        let class = match keys.get("architectures") {
            Some(Value::Array(a)) => match a.first() {
                Some(Value::String(c)) if !c.is_empty() => c.clone(),
                _ => return Err(ConfigProblem::NoArchitecture),
            },
            _ => return Err(ConfigProblem::NoArchitecture),
        };
        if !class.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(ConfigProblem::BadArchitecture(class));
        }
        keys.retain(|k, _| !BOOKKEEPING.contains(&k.as_str()));
        // The labels matter only by their count (the classifier's width), which `num_labels`
        // states as the config's own constructor reads it.
        if let Some(Value::Object(labels)) = keys.remove("id2label") {
            keys.remove("label2id");
            keys.insert("num_labels".into(), Value::from(labels.len()));
        }
        Ok(HubModel { class, keys })
    }

    pub fn class(&self) -> &str {
        &self.class
    }

    /// The tracer's reference: `hf:CLASS(key=JSON,…)`, keys sorted, each value as compact JSON
    /// (strings quoted, nested objects whole), which the tracer's `hf:` parser reads back.
    pub fn reference(&self) -> String {
        let keys: Vec<String> = self.keys.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("hf:{}({})", self.class, keys.join(","))
    }
}

/// What is wrong with a config's contents.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigProblem {
    #[error("is not a JSON object")]
    NotObject,
    #[error("has no `architectures` entry naming the model class; name it: hf:CLASS(key=value,…)")]
    NoArchitecture,
    #[error("names architecture `{0}`, which is not a class name")]
    BadArchitecture(String),
}

/// Why a Hub id, directory or config file does not give a model. One line each, naming the
/// path or repository.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HubError {
    #[error(
        "`{repo}` is not in the Hugging Face cache at {cache} (gpumem reads configs offline): download its config with `hf download {repo} config.json`, set HF_HUB_CACHE, or give a config.json path"
    )]
    NotCached { repo: String, cache: PathBuf },
    #[error(
        "`{repo}` is cached, but not at revision `{revision}` (no {looked}); download its config again or name a cached revision with {repo}@REVISION"
    )]
    NoSnapshot {
        repo: String,
        revision: String,
        looked: PathBuf,
    },
    #[error("{dir} has no config.json")]
    NoConfig { dir: PathBuf },
    #[error(
        "{file} is missing: `hf-code:` runs the checkpoint's own modeling files; download them with the config (`hf download REPO --include '*.py' config.json`)"
    )]
    MissingCode { file: PathBuf },
    #[error("`hf-code:{named}`: `{named}` is no Hub id (ORG/NAME), model directory or config.json")]
    NotModel { named: String },
    #[error("{path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{path}: not JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("{path} {problem}")]
    Config {
        path: PathBuf,
        problem: ConfigProblem,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hub_ids_have_the_hubs_shape() {
        let id = HubId::parse("meta-llama/Llama-3.1-8B@main").unwrap();
        assert_eq!(
            (id.repo(), id.revision.as_deref()),
            ("meta-llama/Llama-3.1-8B", Some("main"))
        );
        assert!(HubId::parse("gpt2").is_some());
        for bad in [
            "a/b/c",
            "/abs",
            "a/",
            "hf:x",
            "x@",
            "./x",
            "a b/c",
            "mlp:depth=2",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_reference_keeps_structure_and_drops_bookkeeping() {
        let m = HubModel::from_config(json!({
            "architectures": ["ViTForImageClassification"],
            "model_type": "vit",
            "torch_dtype": "float32",
            "hidden_size": 768,
            "hidden_act": "gelu",
            "id2label": {"0": "a", "1": "b", "2": "c"},
            "label2id": {"a": 0, "b": 1, "c": 2},
            "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}
        }))
        .unwrap();
        assert_eq!(
            m.reference(),
            r#"hf:ViTForImageClassification(hidden_act="gelu",hidden_size=768,num_labels=3,rope_scaling={"factor":8.0,"rope_type":"llama3"})"#
        );
    }

    #[test]
    fn a_config_without_an_architecture_is_refused() {
        for c in [
            json!({"model_type": "llama"}),
            json!({"architectures": []}),
            json!([1]),
        ] {
            assert!(HubModel::from_config(c).is_err());
        }
        assert_eq!(
            HubModel::from_config(json!({"architectures": ["x(y)"]})),
            Err(ConfigProblem::BadArchitecture("x(y)".into()))
        );
    }

    #[test]
    fn the_cache_resolves_refs_and_commits() {
        let root = std::env::temp_dir().join(format!("gpumem-hub-{}", std::process::id()));
        let repo = root.join("models--org--name");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots/abc123")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc123").unwrap();
        std::fs::write(
            repo.join("snapshots/abc123/config.json"),
            r#"{"architectures": ["GPT2LMHeadModel"], "n_layer": 2}"#,
        )
        .unwrap();
        let cache = HubCache::at(&root);
        for arg in ["org/name", "org/name@abc123"] {
            let src = HubSource::of(arg, &cache).unwrap();
            assert_eq!(
                src.read(&cache).unwrap().reference(),
                "hf:GPT2LMHeadModel(n_layer=2)"
            );
        }
        let e = HubSource::of("org/name@v2", &cache)
            .unwrap()
            .read(&cache)
            .unwrap_err();
        assert!(matches!(e, HubError::NoSnapshot { .. }), "{e}");
        let e = HubSource::of("org/other", &cache)
            .unwrap()
            .read(&cache)
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("`org/other` is not in the Hugging Face cache"),
            "{e}"
        );
        // A bare name is a Hub id only where it is cached.
        assert_eq!(HubSource::of("resnet50", &cache), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// `hf-code:`: a checkpoint named as any Hub source becomes its directory, where its config
    /// names code of its own and the directory holds it.
    #[test]
    fn a_checkpoints_own_code_is_its_directory() {
        let root = std::env::temp_dir().join(format!("gpumem-hub-code-{}", std::process::id()));
        let snapshot = root.join("models--org--remote/snapshots/abc123");
        std::fs::create_dir_all(root.join("models--org--remote/refs")).unwrap();
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::write(root.join("models--org--remote/refs/main"), "abc123").unwrap();
        std::fs::write(
            snapshot.join("config.json"),
            r#"{"architectures": ["QWenLMHeadModel"], "auto_map": {
                "AutoConfig": "configuration_qwen.QWenConfig",
                "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
                "AutoTokenizer": ["other/repo--tokenization.Tok", null]}}"#,
        )
        .unwrap();
        let cache = HubCache::at(&root);
        let code = |arg: &str| {
            crate::model::ModelRef::parse_in(&format!("hf-code:{arg}"), &cache)
                .map(|m| m.to_string())
                .map_err(|e| e.to_string())
        };
        // The modeling files the auto_map names in this repository must be there.
        let e = code("org/remote").unwrap_err();
        assert!(e.contains("configuration_qwen.py is missing"), "{e}");
        for f in ["configuration_qwen.py", "modeling_qwen.py"] {
            std::fs::write(snapshot.join(f), "").unwrap();
        }
        let dir = std::fs::canonicalize(&snapshot).unwrap();
        let want = format!("hf-code:{}", dir.display());
        assert_eq!(code("org/remote").unwrap(), want);
        assert_eq!(code(&snapshot.display().to_string()).unwrap(), want);
        assert_eq!(
            code(&snapshot.join("config.json").display().to_string()).unwrap(),
            want
        );
        // A config without code of its own is the model transformers has (as
        // trust_remote_code=True loads it); a name that is no source is one line.
        let plain = root.join("plain");
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(
            plain.join("config.json"),
            r#"{"architectures": ["GPT2LMHeadModel"]}"#,
        )
        .unwrap();
        assert_eq!(
            code(&plain.display().to_string()).unwrap(),
            "hf:GPT2LMHeadModel()"
        );
        let e = code("resnet50").unwrap_err();
        assert_eq!(
            e,
            "`hf-code:resnet50`: `resnet50` is no Hub id (ORG/NAME), model directory or config.json"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
