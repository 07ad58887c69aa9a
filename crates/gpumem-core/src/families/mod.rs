//! The seed's synthetic model families, built natively (no Python): [`Mlp`], [`Cnn`] and
//! [`Transformer`] turn a spec string such as
//! `mlp:input=2346,output=197,depth=2,arch=pyramid,act=relu,dropout=0.338,batchnorm=true` into an op
//! graph ([`crate::graph::Graph`]) identical in structure to the seed's PyTorch generator, and
//! [`ModelSpec::trace`] turns that into a training-step trace. The exact recipes are in
//! ../shared/docs/synthetic-families.md and the seed's generator scripts.

mod cnn;
mod facts;
mod mlp;
mod transformer;

pub use cnn::{Cnn, CnnArch};
pub use facts::ModelFacts;
pub use mlp::{Mlp, MlpArch, MlpHead};
pub use transformer::{Transformer, TransformerArch};

use std::collections::BTreeMap;

use crate::UnknownName;
use crate::graph::Graph;
use crate::job::Optimizer;
use crate::job::Precision;
use crate::profile::{CUBLAS_WORKSPACE_BYTES, GpuProfile};
use crate::step::{TorchBehaviour, TrainingLoop};
use crate::trace::{Trace, TraceHeader};

/// A native model: one of the three families.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSpec {
    Mlp(Mlp),
    Cnn(Cnn),
    Transformer(Transformer),
}

/// Options of the training job around the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobOptions {
    pub batch: u64,
    pub optimizer: Optimizer,
    pub precision: Precision,
    pub torch: TorchBehaviour,
    pub cublas_workspace: u64,
}

impl JobOptions {
    pub fn new(batch: u64) -> Self {
        JobOptions {
            batch,
            optimizer: Optimizer::ADAM,
            precision: Precision::Fp32,
            torch: TorchBehaviour::V2_1,
            cublas_workspace: CUBLAS_WORKSPACE_BYTES,
        }
    }

    /// Defaults for a job on `profile`'s GPU and PyTorch release (its cuBLAS workspace size and
    /// the release's optimizer and zero_grad behaviour).
    pub fn on(profile: &GpuProfile, batch: u64) -> Self {
        JobOptions {
            torch: TorchBehaviour::parse(&profile.torch),
            cublas_workspace: profile.cublas_workspace(),
            ..JobOptions::new(batch)
        }
    }
}

/// Largest batch size gpumem accepts (anything larger is a typo).
pub const MAX_BATCH: u64 = 1 << 24;

/// A model spec (or a seed dataset's file name) that does not describe a native model. Each
/// message is one line naming the family and the key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error(
        "model spec `{0}` has no `family:` prefix (mlp:, cnn: or transformer:; or a PyTorch reference: torchvision:, timm:, hf:, smp:, py:; or a Hub id ORG/NAME, a model directory or its config.json)"
    )]
    NoFamily(String),
    #[error("unknown model family `{0}` (expected mlp, cnn or transformer)")]
    UnknownFamily(String),
    #[error("{family} spec: `{item}` is not key=value")]
    NotKeyValue { family: String, item: String },
    #[error("{family} spec: key `{key}` given twice")]
    DuplicateKey { family: String, key: String },
    #[error("{family} spec: missing key `{key}`")]
    MissingKey { family: String, key: String },
    #[error("{family} spec: unknown key `{key}`")]
    UnknownKey { family: String, key: String },
    #[error("{family} spec: {key}=`{value}` is not a whole number")]
    NotWholeNumber {
        family: String,
        key: String,
        value: String,
    },
    #[error("{family} spec: {key}=`{value}` is not a number")]
    NotNumber {
        family: String,
        key: String,
        value: String,
    },
    #[error("{family} spec: {key}=`{value}` is not true or false")]
    NotBool {
        family: String,
        key: String,
        value: String,
    },
    #[error("{family} spec: {key}={value} is out of range ({min}..={max})")]
    OutOfRange {
        family: String,
        key: String,
        value: i128,
        min: u64,
        max: u64,
    },
    #[error("{family} spec: {key}={value} is out of range ({min}..={max})")]
    FloatOutOfRange {
        family: String,
        key: String,
        value: f64,
        min: f64,
        max: f64,
    },
    /// A word key (`arch`, `head`) with a value the family does not have.
    #[error("{family} spec: unknown {key} `{value}` (expected {expected})")]
    UnknownChoice {
        family: &'static str,
        key: &'static str,
        value: String,
        expected: String,
    },
    #[error(transparent)]
    Activation(#[from] UnknownName),
    #[error("transformer spec: embed={embed} is not divisible by heads={heads}")]
    HeadsDoNotDivide { embed: u64, heads: u64 },
    #[error("transformer spec: arch=hybrid needs layers >= 2")]
    HybridNeedsTwoLayers,
    #[error("cnn spec: act=identity is not in the CNN family")]
    CnnIdentity,
    /// A seed dataset row's `Filename` ([`Mlp::from_seed_filename`]).
    #[error("seed filename `{name}`: {problem}")]
    SeedFilename {
        name: String,
        problem: SeedFilenameProblem,
    },
}

/// What is wrong with a seed dataset's `Filename`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeedFilenameProblem {
    #[error("missing `{0}`")]
    Missing(&'static str),
    #[error("{what} `{value}` is not a whole number")]
    NotWholeNumber { what: &'static str, value: String },
    #[error("dropout rate `{0}` is not a number")]
    NotRate(String),
    #[error("sizes must be positive")]
    ZeroSize,
}

/// The values of a seed file name's `key:value` fields, given its keys (`"depth:"`) in order
/// (values may hold `_`, as `act:leaky_relu` does, so the keys delimit them). `.out` is dropped.
pub(crate) fn seed_fields<'a>(
    name: &'a str,
    keys: &[&'static str],
) -> Result<Vec<&'a str>, SeedFilenameProblem> {
    let mut rest = name.trim().trim_end_matches(".out");
    let mut values = Vec::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        let key = if i == 0 {
            k.to_string()
        } else {
            format!("_{k}")
        };
        let start = rest.find(&key).ok_or(SeedFilenameProblem::Missing(k))?;
        if i > 0 {
            values.push(&rest[..start]);
        }
        rest = &rest[start + key.len()..];
    }
    values.push(rest);
    Ok(values)
}

/// The seed's file-name readers share their field checks.
pub(crate) struct SeedValues<'a> {
    pub name: &'a str,
    pub keys: &'a [&'static str],
    pub values: Vec<&'a str>,
}

impl<'a> SeedValues<'a> {
    pub fn read(name: &'a str, keys: &'a [&'static str]) -> Result<Self, SpecError> {
        let values = seed_fields(name, keys).map_err(|problem| SpecError::SeedFilename {
            name: name.to_string(),
            problem,
        })?;
        Ok(SeedValues { name, keys, values })
    }

    fn bad(&self, problem: SeedFilenameProblem) -> SpecError {
        SpecError::SeedFilename {
            name: self.name.to_string(),
            problem,
        }
    }

    pub fn uint(&self, i: usize) -> Result<u64, SpecError> {
        let v = self.values[i];
        match v.parse::<u64>() {
            Ok(0) => Err(self.bad(SeedFilenameProblem::ZeroSize)),
            Ok(n) => Ok(n),
            Err(_) => Err(self.bad(SeedFilenameProblem::NotWholeNumber {
                what: self.keys[i].trim_end_matches(':'),
                value: v.to_string(),
            })),
        }
    }

    pub fn rate(&self, i: usize) -> Result<f64, SpecError> {
        let v = self.values[i];
        v.parse::<f64>()
            .ok()
            .filter(|r| (0.0..1.0).contains(r))
            .ok_or_else(|| self.bad(SeedFilenameProblem::NotRate(v.to_string())))
    }

    pub fn flag(&self, i: usize) -> bool {
        self.values[i] == "True"
    }

    pub fn word(&self, i: usize) -> &'a str {
        self.values[i]
    }
}

/// Job options a native model cannot be traced under.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("batch size {0} is out of range (1..={MAX_BATCH})")]
    BatchOutOfRange(u64),
    /// A tensor of the job would exceed what any GPU (or a trace) holds.
    #[error("a tensor of this job would take about {:.2e} bytes (over 1 PiB): it does not fit on any GPU", *.bytes as f64)]
    TooLarge { bytes: u64 },
    #[error("--precision {} (pure low precision) applies to PyTorch models; the native families train in fp32 or under autocast (amp-fp16, amp-bf16)", .0.name())]
    PurePrecision(Precision),
    #[error(transparent)]
    Optimizer(#[from] crate::step::NotNative),
}

impl ModelSpec {
    /// The families' spec prefixes (before the `:`).
    pub const FAMILIES: [&str; 3] = crate::job::NATIVE_FAMILIES;

    /// Parses `family:key=value,...`.
    pub fn parse(spec: &str) -> Result<ModelSpec, SpecError> {
        let (family, rest) = spec
            .split_once(':')
            .ok_or_else(|| SpecError::NoFamily(spec.to_string()))?;
        let mut kv = Keys::parse(family, rest)?;
        let m = match family {
            "mlp" => ModelSpec::Mlp(Mlp::from_keys(&mut kv)?),
            "cnn" => ModelSpec::Cnn(Cnn::from_keys(&mut kv)?),
            "transformer" => ModelSpec::Transformer(Transformer::from_keys(&mut kv)?),
            other => return Err(SpecError::UnknownFamily(other.to_string())),
        };
        kv.finish()?;
        Ok(m)
    }

    /// The networks this spec may mean: itself, or both readings of an ambiguous one (a dense
    /// CNN without `pool_every`).
    pub fn alternatives(&self) -> Vec<ModelSpec> {
        match self {
            ModelSpec::Cnn(c) => c.alternatives().into_iter().map(ModelSpec::Cnn).collect(),
            other => vec![other.clone()],
        }
    }

    pub fn family(&self) -> &'static str {
        match self {
            ModelSpec::Mlp(_) => "mlp",
            ModelSpec::Cnn(_) => "cnn",
            ModelSpec::Transformer(_) => "transformer",
        }
    }

    /// The op graph of one training step at `batch`.
    pub fn graph(&self, batch: u64, precision: Precision) -> Graph {
        match self {
            ModelSpec::Mlp(m) => m.graph(batch, precision),
            ModelSpec::Cnn(m) => m.graph(batch, precision),
            ModelSpec::Transformer(m) => m.graph(batch, precision),
        }
    }

    /// Dataset size of the seed's loop (the short last batch of an epoch is replayed).
    fn samples(&self) -> Option<u64> {
        match self {
            ModelSpec::Mlp(m) => m.samples,
            ModelSpec::Cnn(m) => m.samples,
            ModelSpec::Transformer(m) => m.samples,
        }
    }

    /// Batch of the warm-up forward the seed's scripts run before training, if any.
    fn warmup(&self, batch: u64) -> Option<u64> {
        match self {
            ModelSpec::Mlp(m) => m.summary.then_some(2),
            ModelSpec::Cnn(m) => m.summary.then_some(batch),
            ModelSpec::Transformer(m) => m.summary.then_some(batch),
        }
    }

    pub fn to_spec_string(&self) -> String {
        match self {
            ModelSpec::Mlp(m) => m.to_string(),
            ModelSpec::Cnn(m) => m.to_string(),
            ModelSpec::Transformer(m) => m.to_string(),
        }
    }

    /// An upper bound of the elements of the job's largest tensor at batch `batch` (in floating
    /// point: it is there to refuse jobs whose sizes would not fit in bytes at all).
    fn largest_elements(&self, batch: u64) -> f64 {
        let b = batch as f64;
        match self {
            ModelSpec::Mlp(m) => m
                .layer_sizes()
                .iter()
                .map(|&(i, o)| (b * i.max(o) as f64).max(i as f64 * o as f64))
                .fold(0.0, f64::max),
            ModelSpec::Cnn(c) => {
                // Dense blocks grow by 32 channels a layer; others stay under the family's cap.
                let channels = c.channels.max(c.filters).max(2048) as f64 + 32.0 * c.depth as f64;
                b * channels * (c.input as f64).powi(2)
            }
            ModelSpec::Transformer(t) => {
                let (seq, wide) = (t.seq as f64, t.embed.max(t.ff).max(t.classes) as f64);
                (b * t.heads as f64 * seq * seq)
                    .max(b * seq * wide)
                    .max(t.vocab as f64 * t.embed as f64)
            }
        }
    }

    /// The training-step trace of this model under `job`.
    pub fn trace(&self, job: &JobOptions) -> Result<Trace, JobError> {
        if job.batch == 0 || job.batch > MAX_BATCH {
            return Err(JobError::BatchOutOfRange(job.batch));
        }
        if job.precision.is_pure() {
            return Err(JobError::PurePrecision(job.precision));
        }
        crate::step::native(job.optimizer)?;
        // Checked before the graph is built: its sizes are whole numbers that must not wrap.
        let bytes = self.largest_elements(job.batch) * 4.0;
        if bytes > crate::trace::MAX_ALLOC_BYTES as f64 {
            return Err(JobError::TooLarge {
                bytes: bytes as u64,
            }); // saturates
        }
        let mut lp = TrainingLoop::new(job.optimizer, job.precision, job.batch, self.samples());
        lp.torch = job.torch;
        lp.cublas_workspace = job.cublas_workspace;
        lp.warmup_batch = self.warmup(job.batch);
        let mut header = TraceHeader::new(self.to_spec_string(), job.batch);
        let g = self.graph(job.batch, job.precision);
        header.parameters = Some(g.parameter_count());
        header.activations_per_sample = Some(g.activations_per_sample);
        let precision = job.precision;
        let mut first = Some(g);
        Ok(lp.trace(header, &mut |b| match first.take() {
            Some(g) if b == job.batch => g,
            _ => self.graph(b, precision),
        }))
    }
}

/// The training-loop keys every family's spec string ends with.
pub(crate) fn write_loop_keys(
    f: &mut std::fmt::Formatter<'_>,
    samples: Option<u64>,
    summary: bool,
) -> std::fmt::Result {
    if let Some(s) = samples {
        write!(f, ",samples={s}")?;
    }
    if summary {
        write!(f, ",summary=true")?;
    }
    Ok(())
}

/// `key=value` pairs of a spec; every key must be used.
pub(crate) struct Keys {
    family: String,
    map: BTreeMap<String, String>,
}

impl Keys {
    fn parse(family: &str, rest: &str) -> Result<Self, SpecError> {
        let mut map = BTreeMap::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| SpecError::NotKeyValue {
                family: family.into(),
                item: item.into(),
            })?;
            if map
                .insert(k.trim().to_string(), v.trim().to_string())
                .is_some()
            {
                return Err(SpecError::DuplicateKey {
                    family: family.into(),
                    key: k.into(),
                });
            }
        }
        Ok(Keys {
            family: family.into(),
            map,
        })
    }

    fn take(&mut self, key: &str) -> Option<String> {
        self.map.remove(key)
    }

    pub(crate) fn uint(
        &mut self,
        key: &str,
        default: Option<u64>,
        min: u64,
        max: u64,
    ) -> Result<u64, SpecError> {
        let family = self.family.clone();
        match self.map.remove(key) {
            None => default.ok_or_else(|| SpecError::MissingKey {
                family,
                key: key.into(),
            }),
            Some(v) => {
                let Ok(n) = v.parse::<i128>() else {
                    return Err(SpecError::NotWholeNumber {
                        family,
                        key: key.into(),
                        value: v,
                    });
                };
                if n < min as i128 || n > max as i128 {
                    return Err(SpecError::OutOfRange {
                        family,
                        key: key.into(),
                        value: n,
                        min,
                        max,
                    });
                }
                Ok(n as u64)
            }
        }
    }

    /// `None` where the spec does not state `key`.
    pub(crate) fn optional_uint(
        &mut self,
        key: &str,
        min: u64,
        max: u64,
    ) -> Result<Option<u64>, SpecError> {
        if !self.map.contains_key(key) {
            return Ok(None);
        }
        self.uint(key, None, min, max).map(Some)
    }

    pub(crate) fn float(
        &mut self,
        key: &str,
        default: f64,
        min: f64,
        max: f64,
    ) -> Result<f64, SpecError> {
        let family = self.family.clone();
        match self.map.remove(key) {
            None => Ok(default),
            Some(v) => {
                let Ok(x) = v.parse::<f64>() else {
                    return Err(SpecError::NotNumber {
                        family,
                        key: key.into(),
                        value: v,
                    });
                };
                if !(min..=max).contains(&x) {
                    return Err(SpecError::FloatOutOfRange {
                        family,
                        key: key.into(),
                        value: x,
                        min,
                        max,
                    });
                }
                Ok(x)
            }
        }
    }

    pub(crate) fn boolean(&mut self, key: &str, default: bool) -> Result<bool, SpecError> {
        match self.map.remove(key).as_deref() {
            None => Ok(default),
            Some("true" | "True" | "1" | "yes") => Ok(true),
            Some("false" | "False" | "0" | "no") => Ok(false),
            Some(v) => Err(SpecError::NotBool {
                family: self.family.clone(),
                key: key.into(),
                value: v.into(),
            }),
        }
    }

    pub(crate) fn word(&mut self, key: &str, default: Option<&str>) -> Result<String, SpecError> {
        let v = self.take(key).or_else(|| default.map(String::from));
        v.ok_or_else(|| SpecError::MissingKey {
            family: self.family.clone(),
            key: key.into(),
        })
    }

    fn finish(self) -> Result<(), SpecError> {
        match self.map.into_keys().next() {
            Some(key) => Err(SpecError::UnknownKey {
                family: self.family,
                key,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_job_too_large_for_any_gpu_is_an_error_not_a_panic() {
        for (spec, batch) in [
            ("cnn:classes=10,filters=2048,depth=1,input=4096", 1 << 24),
            (
                "transformer:vocab=16000000,embed=65536,layers=1,heads=1024,ff=262144,seq=1048576,classes=1000000",
                1 << 24,
            ),
        ] {
            let e = ModelSpec::parse(spec)
                .unwrap()
                .trace(&JobOptions::new(batch))
                .unwrap_err();
            assert!(
                matches!(e, JobError::TooLarge { .. })
                    && e.to_string().ends_with("it does not fit on any GPU"),
                "{spec}: {e}"
            );
        }
    }

    use super::*;

    #[test]
    fn spec_errors_are_one_line() {
        let e = |s: &str| ModelSpec::parse(s).unwrap_err().to_string();
        assert_eq!(
            e("resnet"),
            "model spec `resnet` has no `family:` prefix (mlp:, cnn: or transformer:; or a PyTorch reference: torchvision:, timm:, hf:, smp:, py:; or a Hub id ORG/NAME, a model directory or its config.json)"
        );
        assert_eq!(
            e("rnn:x=1"),
            "unknown model family `rnn` (expected mlp, cnn or transformer)"
        );
        assert_eq!(
            e("mlp:input=10,output=2,depth=2,arch=pyramid,act=swoosh"),
            "unknown activation `swoosh` (expected one of relu, leaky_relu, prelu, elu, selu, tanh, softplus, swish, mish, gelu, identity)"
        );
        assert_eq!(
            e("mlp:input=10,output=2,depth=2,color=red"),
            "mlp spec: unknown key `color`"
        );
        assert_eq!(
            e("mlp:input=-3,output=2,depth=2"),
            "mlp spec: input=-3 is out of range (1..=1048576)"
        );
        assert_eq!(e("mlp:output=2,depth=2"), "mlp spec: missing key `input`");
        assert_eq!(
            e("mlp:input=4,output=2,depth=2,dropout=x"),
            "mlp spec: dropout=`x` is not a number"
        );
        assert_eq!(
            e("mlp:input=4,output=2,depth=2,dropout=1.5"),
            "mlp spec: dropout=1.5 is out of range (0..=0.999)"
        );
        assert_eq!(
            e("mlp:input=4,output=2,depth=2,input=5"),
            "mlp spec: key `input` given twice"
        );
        assert_eq!(
            e("mlp:input=4,output=2,depth=x"),
            "mlp spec: depth=`x` is not a whole number"
        );
        assert_eq!(
            e("mlp:input=4,output=2,depth=2,batchnorm=maybe"),
            "mlp spec: batchnorm=`maybe` is not true or false"
        );
        assert_eq!(
            e("mlp:input=4,output=2,depth=2,arch=tower"),
            "mlp spec: unknown arch `tower` (expected pyramid, uniform, bottleneck or gradual)"
        );
        assert_eq!(
            e("cnn:classes=10,filters=8,depth=2,input=32,act=identity"),
            "cnn spec: act=identity is not in the CNN family"
        );
        assert_eq!(
            e("transformer:vocab=10,embed=10,layers=2,heads=3,ff=8,seq=4,classes=2"),
            "transformer spec: embed=10 is not divisible by heads=3"
        );
        assert_eq!(e("mlp:input"), "mlp spec: `input` is not key=value");
    }

    #[test]
    fn batch_is_checked() {
        let m = ModelSpec::parse("mlp:input=10,output=2,depth=1").unwrap();
        assert_eq!(
            m.trace(&JobOptions::new(0)).unwrap_err().to_string(),
            format!("batch size 0 is out of range (1..={MAX_BATCH})")
        );
        assert!(m.trace(&JobOptions::new(MAX_BATCH + 1)).is_err());
    }

    #[test]
    fn specs_round_trip() {
        for s in [
            "mlp:input=2346,output=197,depth=2,arch=pyramid,act=relu,dropout=0.338,batchnorm=true",
            "cnn:channels=3,classes=100,filters=32,depth=8,input=64,arch=residual,act=gelu,dropout=0.1,batchnorm=true,pooling=true,pool_every=5",
            "transformer:vocab=1000,embed=128,layers=2,heads=4,ff=256,dropout=0.1,seq=64,classes=10,arch=hybrid",
        ] {
            let m = ModelSpec::parse(s).unwrap();
            assert_eq!(ModelSpec::parse(&m.to_spec_string()).unwrap(), m, "{s}");
        }
    }
}
