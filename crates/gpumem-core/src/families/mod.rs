//! The seed's synthetic model families, built natively (no Python): [`Mlp`], [`Cnn`] and
//! [`Transformer`] turn a spec string such as
//! `mlp:input=2346,output=197,depth=2,arch=pyramid,act=relu,dropout=0.338,batchnorm=true` into an op
//! graph ([`crate::graph::Graph`]) identical in structure to the seed's PyTorch generator, and
//! [`ModelSpec::trace`] turns that into a training-step trace. The exact recipes are in
//! ../shared/docs/synthetic-families.md and the seed's generator scripts.

mod cnn;
mod mlp;
mod transformer;

pub use cnn::{Cnn, CnnArch};
pub use mlp::{Mlp, MlpArch, MlpHead};
pub use transformer::{Transformer, TransformerArch};

use std::collections::BTreeMap;

use crate::graph::{Graph, Precision};
use crate::profile::{CUBLAS_WORKSPACE_BYTES, GpuProfile};
use crate::step::{Optimizer, TorchBehaviour, TrainingLoop};
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
            optimizer: Optimizer::Adam,
            precision: Precision::Fp32,
            torch: TorchBehaviour::V2_1,
            cublas_workspace: CUBLAS_WORKSPACE_BYTES,
        }
    }

    /// Defaults for a job on `profile`'s GPU and PyTorch release (its cuBLAS workspace size and
    /// the release's optimizer and zero_grad behaviour).
    pub fn on(profile: &GpuProfile, batch: u64) -> Self {
        JobOptions { torch: TorchBehaviour::parse(&profile.torch), cublas_workspace: profile.cublas_workspace(), ..JobOptions::new(batch) }
    }
}

/// Largest batch size gpumem accepts (anything larger is a typo).
pub const MAX_BATCH: u64 = 1 << 24;

impl ModelSpec {
    /// Parses `family:key=value,...`.
    pub fn parse(spec: &str) -> Result<ModelSpec, String> {
        let (family, rest) = spec.split_once(':').ok_or_else(|| format!("model spec `{spec}` has no `family:` prefix (mlp:, cnn: or transformer:)"))?;
        let mut kv = Keys::parse(family, rest)?;
        let m = match family {
            "mlp" => ModelSpec::Mlp(Mlp::from_keys(&mut kv)?),
            "cnn" => ModelSpec::Cnn(Cnn::from_keys(&mut kv)?),
            "transformer" => ModelSpec::Transformer(Transformer::from_keys(&mut kv)?),
            other => return Err(format!("unknown model family `{other}` (expected mlp, cnn or transformer)")),
        };
        kv.finish()?;
        Ok(m)
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

    /// The training-step trace of this model under `job`.
    pub fn trace(&self, job: &JobOptions) -> Result<Trace, String> {
        if job.batch == 0 || job.batch > MAX_BATCH {
            return Err(format!("batch size {} is out of range (1..={MAX_BATCH})", job.batch));
        }
        if job.precision.is_pure() {
            return Err(format!("--precision {} (pure low precision) applies to PyTorch models; the native families train in fp32 or under autocast (amp-fp16, amp-bf16)", job.precision.name()));
        }
        let mut lp = TrainingLoop::new(job.optimizer, job.precision, job.batch, self.samples());
        lp.torch = job.torch;
        lp.cublas_workspace = job.cublas_workspace;
        lp.warmup_batch = self.warmup(job.batch);
        let mut header = TraceHeader::new(self.to_spec_string(), job.batch);
        let g = self.graph(job.batch, job.precision);
        header.parameters = Some(g.parameter_count());
        header.activations_per_sample = Some(g.activations_per_sample);
        if let ModelSpec::Transformer(t) = self {
            header.seq_len = Some(t.seq);
        }
        let precision = job.precision;
        let mut first = Some(g);
        Ok(lp.trace(header, &mut |b| match first.take() {
            Some(g) if b == job.batch => g,
            _ => self.graph(b, precision),
        }))
    }
}

/// The training-loop keys every family's spec string ends with.
pub(crate) fn write_loop_keys(f: &mut std::fmt::Formatter<'_>, samples: Option<u64>, summary: bool) -> std::fmt::Result {
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
    fn parse(family: &str, rest: &str) -> Result<Self, String> {
        let mut map = BTreeMap::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| format!("{family} spec: `{item}` is not key=value"))?;
            if map.insert(k.trim().to_string(), v.trim().to_string()).is_some() {
                return Err(format!("{family} spec: key `{k}` given twice"));
            }
        }
        Ok(Keys { family: family.into(), map })
    }

    fn take(&mut self, key: &str) -> Option<String> {
        self.map.remove(key)
    }

    pub(crate) fn uint(&mut self, key: &str, default: Option<u64>, min: u64, max: u64) -> Result<u64, String> {
        let fam = &self.family;
        match self.map.remove(key) {
            None => default.ok_or_else(|| format!("{fam} spec: missing key `{key}`")),
            Some(v) => {
                let n: i128 = v.parse().map_err(|_| format!("{fam} spec: {key}=`{v}` is not a whole number"))?;
                if n < min as i128 || n > max as i128 {
                    return Err(format!("{fam} spec: {key}={n} is out of range ({min}..={max})"));
                }
                Ok(n as u64)
            }
        }
    }

    pub(crate) fn float(&mut self, key: &str, default: f64, min: f64, max: f64) -> Result<f64, String> {
        let fam = &self.family;
        match self.map.remove(key) {
            None => Ok(default),
            Some(v) => {
                let x: f64 = v.parse().map_err(|_| format!("{fam} spec: {key}=`{v}` is not a number"))?;
                if !(min..=max).contains(&x) {
                    return Err(format!("{fam} spec: {key}={x} is out of range ({min}..={max})"));
                }
                Ok(x)
            }
        }
    }

    pub(crate) fn boolean(&mut self, key: &str, default: bool) -> Result<bool, String> {
        let fam = &self.family;
        match self.map.remove(key).as_deref() {
            None => Ok(default),
            Some("true" | "True" | "1" | "yes") => Ok(true),
            Some("false" | "False" | "0" | "no") => Ok(false),
            Some(v) => Err(format!("{fam} spec: {key}=`{v}` is not true or false")),
        }
    }

    pub(crate) fn word(&mut self, key: &str, default: Option<&str>) -> Result<String, String> {
        let v = self.take(key).or_else(|| default.map(String::from));
        v.ok_or_else(|| format!("{} spec: missing key `{key}`", self.family))
    }

    fn finish(self) -> Result<(), String> {
        match self.map.keys().next() {
            Some(k) => Err(format!("{} spec: unknown key `{k}`", self.family)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_errors_are_one_line() {
        let e = |s: &str| ModelSpec::parse(s).unwrap_err();
        assert_eq!(e("resnet"), "model spec `resnet` has no `family:` prefix (mlp:, cnn: or transformer:)");
        assert_eq!(e("rnn:x=1"), "unknown model family `rnn` (expected mlp, cnn or transformer)");
        assert_eq!(e("mlp:input=10,output=2,depth=2,arch=pyramid,act=swoosh"), "unknown activation `swoosh` (expected one of relu, leaky_relu, prelu, elu, selu, tanh, softplus, swish, mish, gelu, identity)");
        assert_eq!(e("mlp:input=10,output=2,depth=2,color=red"), "mlp spec: unknown key `color`");
        assert_eq!(e("mlp:input=-3,output=2,depth=2"), "mlp spec: input=-3 is out of range (1..=1048576)");
        assert_eq!(e("mlp:output=2,depth=2"), "mlp spec: missing key `input`");
        assert_eq!(e("mlp:input=4,output=2,depth=2,dropout=x"), "mlp spec: dropout=`x` is not a number");
    }

    #[test]
    fn batch_is_checked() {
        let m = ModelSpec::parse("mlp:input=10,output=2,depth=1").unwrap();
        assert!(m.trace(&JobOptions::new(0)).unwrap_err().contains("out of range"));
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
