//! Convolution workspaces: the buffers cuDNN's chosen engine takes inside a convolution kernel
//! and gives back before it returns. Their sizes depend on the GPU, cuDNN and the
//! configuration, so a CPU-side trace cannot know them: `gpumem probe` measures them on the GPU
//! (from the caching allocator's own record of requests) into the profile's table, and the
//! replay looks each traced convolution up there.
//!
//! A lookup is *probed* (the configuration at that batch is in the table), *fitted* (estimated
//! from the table: the same configuration at another batch, scaled; or the nearest probed
//! configuration of the same kind, scaled by the bytes it moves) or *default* (nothing in the
//! table to go by: no workspace is modelled and the upper bound's allowance covers it).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::trace::{ConvPass, Event, MAX_ALLOC_BYTES, Trace};

/// One probed convolution: its configuration (the tracer's key, batch apart), the batch, and
/// the workspace requests of each pass in the order cuDNN makes them (usually one or none).
/// The same fields in the probe's report and the profile's table (other keys of a report row
/// are ignored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConvWorkspace {
    pub config: String,
    pub n: u64,
    #[serde(default)]
    pub fwd: Vec<u64>,
    #[serde(default)]
    pub bwd_data: Vec<u64>,
    #[serde(default)]
    pub bwd_filter: Vec<u64>,
}

impl ConvWorkspace {
    pub fn sizes(&self, pass: ConvPass) -> &[u64] {
        match pass {
            ConvPass::Forward => &self.fwd,
            ConvPass::BackwardData => &self.bwd_data,
            ConvPass::BackwardFilter => &self.bwd_filter,
        }
    }
}

/// Adds `newer` entries to `table`, a configuration at a batch measured again taking the new
/// figures; the table stays ordered by (configuration, batch). Returns (added, replaced).
pub fn merge(
    table: &mut Vec<ConvWorkspace>,
    newer: impl IntoIterator<Item = ConvWorkspace>,
) -> (usize, usize) {
    let mut by_key: std::collections::BTreeMap<(String, u64), ConvWorkspace> =
        std::mem::take(table)
            .into_iter()
            .map(|e| ((e.config.clone(), e.n), e))
            .collect();
    let (mut added, mut replaced) = (0, 0);
    for e in newer {
        if by_key.insert((e.config.clone(), e.n), e).is_some() {
            replaced += 1;
        } else {
            added += 1;
        }
    }
    *table = by_key.into_values().collect();
    (added, replaced)
}

/// Where a workspace size came from; an estimate reports the least certain of its lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkspaceSource {
    Probed,
    Fitted,
    Policy,
    Default,
}

impl WorkspaceSource {
    pub fn name(self) -> &'static str {
        match self {
            WorkspaceSource::Probed => "probed",
            WorkspaceSource::Fitted => "fitted",
            WorkspaceSource::Policy => "policy",
            WorkspaceSource::Default => "default",
        }
    }
}

/// How a profile sizes the workspaces of convolutions its probed table has nothing to go by:
/// the mechanism `gpumem probe` shows on cuDNN's tensor-core engines. For an NCHW (contiguous)
/// dense or grouped convolution other than 1×1 stride 1, each pass transposes its three tensors
/// (input, output and weight, or their gradients) to NHWC in one workspace, of their bytes
/// (cuDNN 9.19 on an H200: 1.00× in all three passes for fp32 and bf16, 3×3 to 7×7, strides 1–2;
/// bwd_filter up to 1.07×); depthwise, channels_last and 1×1 stride-1 convolutions take
/// (almost) none, and neither do image stems with few input channels.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkspacePolicy {
    /// Each pass's workspace as a multiple of its input, output and weight bytes.
    pub layout_transform: f64,
    /// Convolutions with fewer input channels take none.
    pub min_in_channels: u64,
    /// What the weight-gradient pass takes beyond the transposed tensors (its engines' partial
    /// sums; 2–8 MiB on the H200): it keeps that pass from reusing the block the others freed.
    #[serde(default)]
    pub bwd_filter_extra_mib: f64,
}

impl WorkspacePolicy {
    /// Checked when a profile is read.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !(self.layout_transform >= 0.0 && self.layout_transform <= 16.0) {
            return Err("conv_workspace_policy.layout_transform must be between 0 and 16");
        }
        if !(self.bwd_filter_extra_mib >= 0.0 && self.bwd_filter_extra_mib <= 1024.0) {
            return Err("conv_workspace_policy.bwd_filter_extra_mib must be between 0 and 1024");
        }
        Ok(())
    }

    fn sizes(&self, shape: &Shape, n: u64, pass: ConvPass) -> Vec<u64> {
        if !shape.transposed_by_cudnn || shape.in_channels < self.min_in_channels {
            return Vec::new();
        }
        let extra = if pass == ConvPass::BackwardFilter {
            self.bwd_filter_extra_mib * crate::units::MIB as f64
        } else {
            0.0
        };
        let bytes = ((shape.in_per_sample + shape.out_per_sample) * n as f64 + shape.weight)
            * self.layout_transform
            + extra;
        vec![bytes.ceil().min(MAX_ALLOC_BYTES as f64) as u64]
    }
}

/// What the fitted model and the policy need of a configuration: the kind of kernel (dtype,
/// layout, kernel window, stride, how channels are grouped), the bytes one sample moves and the
/// weight's bytes.
#[derive(Debug, Clone, PartialEq)]
struct Shape {
    kind: String,
    in_per_sample: f64,
    out_per_sample: f64,
    weight: f64,
    in_channels: u64,
    /// NCHW tensors of a dense or grouped convolution that is not a 1×1 stride-1 one: what
    /// cuDNN's tensor-core engines transpose to NHWC first.
    transposed_by_cudnn: bool,
}

impl Shape {
    /// Parses the tracer's key (`in=C×H×W;w=K×C/g×R×S;stride=..;pad=..;dil=..;groups=g;
    /// dtype=..;layout=..[;transposed=1;opad=..]`); None if it is not one.
    fn parse(config: &str) -> Option<Shape> {
        let kv: HashMap<&str, &str> = config
            .split(';')
            .filter_map(|p| p.split_once('='))
            .collect();
        let dims = |k: &str| -> Option<Vec<u64>> {
            kv.get(k)?.split('x').map(|d| d.parse().ok()).collect()
        };
        let (input, weight) = (dims("in")?, dims("w")?);
        let (stride, pad, dil) = (dims("stride")?, dims("pad")?, dims("dil")?);
        let groups: u64 = kv.get("groups")?.parse().ok()?;
        let elem = match *kv.get("dtype")? {
            "float32" => 4.0,
            "float64" => 8.0,
            _ => 2.0,
        };
        let spatial = input.len().checked_sub(1)?;
        if weight.len() != spatial + 2
            || stride.len() != spatial
            || pad.len() != spatial
            || dil.len() != spatial
        {
            return None;
        }
        let transposed = kv.get("transposed") == Some(&"1");
        let mut out = if transposed {
            weight[1] * groups
        } else {
            weight[0]
        } as f64;
        for i in 0..spatial {
            let (h, k) = (input[i + 1] as f64, weight[i + 2] as f64);
            let o = if transposed {
                (h - 1.0) * stride[i] as f64 - 2.0 * pad[i] as f64 + dil[i] as f64 * (k - 1.0) + 1.0
            } else {
                ((h + 2.0 * pad[i] as f64 - dil[i] as f64 * (k - 1.0) - 1.0) / stride[i] as f64)
                    .floor()
                    + 1.0
            };
            out *= o.max(1.0);
        }
        let grouping = if groups == 1 {
            "dense"
        } else if groups == input[0] {
            "depthwise"
        } else {
            "grouped"
        };
        let kind = format!(
            "{};{};{};w={:?};stride={:?};{}",
            kv.get("dtype")?,
            kv.get("layout").unwrap_or(&"contiguous"),
            grouping,
            &weight[2..],
            stride,
            if transposed { "transposed" } else { "" }
        );
        let pointwise = weight[2..].iter().all(|&k| k == 1) && stride.iter().all(|&s| s == 1);
        let contiguous = kv.get("layout").is_none_or(|l| *l == "contiguous");
        Some(Shape {
            kind,
            in_per_sample: input.iter().product::<u64>() as f64 * elem,
            out_per_sample: out * elem,
            weight: weight.iter().product::<u64>() as f64 * elem,
            in_channels: input[0],
            transposed_by_cudnn: contiguous && grouping != "depthwise" && !pointwise,
        })
    }
}

/// A profile's probed workspaces, indexed for the replay, and its policy for the rest.
#[derive(Debug)]
pub struct WorkspaceTable<'a> {
    exact: HashMap<(&'a str, u64), &'a ConvWorkspace>,
    by_config: HashMap<&'a str, Vec<&'a ConvWorkspace>>,
    by_kind: HashMap<String, Vec<(Shape, &'a ConvWorkspace)>>,
    policy: Option<WorkspacePolicy>,
}

impl<'a> WorkspaceTable<'a> {
    pub fn new(entries: &'a [ConvWorkspace], policy: Option<WorkspacePolicy>) -> Self {
        let mut t = WorkspaceTable {
            exact: HashMap::new(),
            by_config: HashMap::new(),
            by_kind: HashMap::new(),
            policy,
        };
        for e in entries {
            t.exact.insert((e.config.as_str(), e.n), e);
            t.by_config.entry(e.config.as_str()).or_default().push(e);
            if let Some(s) = Shape::parse(&e.config) {
                t.by_kind.entry(s.kind.clone()).or_default().push((s, e));
            }
        }
        t
    }

    /// The convolutions of `trace` (configuration, batch) whose workspaces are not in the
    /// table: what a probe of this job should measure.
    pub fn unprobed(&self, trace: &Trace) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = Vec::new();
        for ev in trace.events() {
            if let Event::Workspace { conv, n, .. } = *ev {
                let config = trace.op_name(conv);
                if !self.exact.contains_key(&(config, n))
                    && !out.iter().any(|(c, m)| c == config && *m == n)
                {
                    out.push((config.to_string(), n));
                }
            }
        }
        out
    }

    /// The workspace requests of `pass` of convolution `config` at batch `n`, and where they
    /// came from: the table, else the policy, else none.
    pub fn lookup(&self, config: &str, n: u64, pass: ConvPass) -> (Vec<u64>, WorkspaceSource) {
        if let Some(found) = self.table_sizes(config, n, pass) {
            return found;
        }
        match (self.policy, Shape::parse(config)) {
            (Some(policy), Some(shape)) => (policy.sizes(&shape, n, pass), WorkspaceSource::Policy),
            _ => (Vec::new(), WorkspaceSource::Default),
        }
    }

    /// Probed, or fitted from what was probed; None when the table has nothing to go by.
    fn table_sizes(
        &self,
        config: &str,
        n: u64,
        pass: ConvPass,
    ) -> Option<(Vec<u64>, WorkspaceSource)> {
        if let Some(e) = self.exact.get(&(config, n)) {
            return Some((e.sizes(pass).to_vec(), WorkspaceSource::Probed));
        }
        if n == 0 {
            return None;
        }
        // Scaled sizes stay within what one allocation may be (a profile's n is at least 1).
        let scale = |sizes: &[u64], f: f64| {
            sizes
                .iter()
                .map(|&b| (b as f64 * f).ceil().min(MAX_ALLOC_BYTES as f64) as u64)
                .collect::<Vec<_>>()
        };
        // The same configuration at another batch: the nearest probed batch, scaled (cuDNN's
        // workspaces grow with the tensors; the engine may differ, which the bound covers).
        if let Some(same) = self.by_config.get(config) {
            let e = same
                .iter()
                .min_by_key(|e| e.n.abs_diff(n))
                .expect("non-empty by construction");
            return Some((
                scale(e.sizes(pass), n as f64 / e.n as f64),
                WorkspaceSource::Fitted,
            ));
        }
        // The nearest configuration of the same kind, by the bytes its tensors hold, scaled by
        // the ratio of those bytes.
        let shape = Shape::parse(config)?;
        let kin = self.by_kind.get(&shape.kind)?;
        let bytes = |s: &Shape, n: u64| (s.in_per_sample + s.out_per_sample) * n as f64;
        let want = bytes(&shape, n);
        let distance = |s: &Shape, m: u64| {
            ((s.in_per_sample * m as f64) / (shape.in_per_sample * n as f64))
                .ln()
                .abs()
                + ((s.out_per_sample * m as f64) / (shape.out_per_sample * n as f64))
                    .ln()
                    .abs()
        };
        let (s, e) = kin
            .iter()
            .min_by(|a, b| distance(&a.0, a.1.n).total_cmp(&distance(&b.0, b.1.n)))
            .expect("non-empty by construction");
        let ratio = want / bytes(s, e.n);
        Some((
            scale(e.sizes(pass), if ratio.is_finite() { ratio } else { 0.0 }),
            WorkspaceSource::Fitted,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: &str = "in=64x56x56;w=64x64x3x3;stride=1x1;pad=1x1;dil=1x1;groups=1;dtype=float32;layout=contiguous";

    fn entry(config: &str, n: u64, fwd: u64) -> ConvWorkspace {
        ConvWorkspace {
            config: config.into(),
            n,
            fwd: vec![fwd],
            bwd_data: vec![],
            bwd_filter: vec![7],
        }
    }

    #[test]
    fn exact_then_same_configuration_then_nearest_of_its_kind() {
        let other = C.replace("in=64x56x56", "in=64x28x28");
        let entries = [entry(C, 32, 1000), entry(&other, 32, 400)];
        let t = WorkspaceTable::new(&entries, None);
        assert_eq!(
            t.lookup(C, 32, ConvPass::Forward),
            (vec![1000], WorkspaceSource::Probed)
        );
        assert_eq!(
            t.lookup(C, 32, ConvPass::BackwardData),
            (vec![], WorkspaceSource::Probed),
            "probed as none"
        );
        assert_eq!(
            t.lookup(C, 64, ConvPass::Forward),
            (vec![2000], WorkspaceSource::Fitted)
        );
        // 64×42×42 sits between the two probed ones; its nearest (by bytes) is 28×28 at 32.
        let unseen = C.replace("in=64x56x56", "in=64x36x36");
        let (sizes, source) = t.lookup(&unseen, 32, ConvPass::Forward);
        assert_eq!(source, WorkspaceSource::Fitted);
        assert!(sizes[0] > 400 && sizes[0] < 1000, "{sizes:?}");
        // A kind never probed (a 5×5 kernel): nothing to fit from.
        let kind = C
            .replace("w=64x64x3x3", "w=64x64x5x5")
            .replace("pad=1x1", "pad=2x2");
        assert_eq!(
            t.lookup(&kind, 32, ConvPass::Forward),
            (vec![], WorkspaceSource::Default)
        );
        assert_eq!(
            WorkspaceTable::new(&[], None).lookup(C, 32, ConvPass::Forward),
            (vec![], WorkspaceSource::Default)
        );
    }

    #[test]
    fn the_policy_sizes_what_the_table_cannot() {
        let policy = WorkspacePolicy {
            layout_transform: 1.0,
            min_in_channels: 8,
            bwd_filter_extra_mib: 0.0,
        };
        let t = WorkspaceTable::new(&[], Some(policy));
        // 3×3: input + output (64×56×56 fp32 each, batch 2) + weight (64×64×3×3).
        let want = 2 * 2 * 64 * 56 * 56 * 4 + 64 * 64 * 9 * 4;
        for pass in ConvPass::ALL {
            assert_eq!(t.lookup(C, 2, pass), (vec![want], WorkspaceSource::Policy));
        }
        // What cuDNN runs without transposing: 1×1 stride 1, channels_last, depthwise, stems.
        let pointwise = C
            .replace("w=64x64x3x3", "w=64x64x1x1")
            .replace("pad=1x1", "pad=0x0");
        let last = C.replace("contiguous", "channels_last");
        let depthwise = C
            .replace("w=64x64x3x3", "w=64x1x3x3")
            .replace("groups=1", "groups=64");
        let stem = C
            .replace("in=64x56x56", "in=3x56x56")
            .replace("w=64x64", "w=64x3");
        for config in [pointwise, last, depthwise, stem] {
            assert_eq!(
                t.lookup(&config, 2, ConvPass::Forward),
                (vec![], WorkspaceSource::Policy),
                "{config}"
            );
        }
        // A probed table wins; the policy only fills in.
        let entries = [entry(C, 32, 1000)];
        let t = WorkspaceTable::new(&entries, Some(policy));
        assert_eq!(
            t.lookup(C, 32, ConvPass::Forward),
            (vec![1000], WorkspaceSource::Probed)
        );
        let kind = C
            .replace("w=64x64x3x3", "w=64x64x5x5")
            .replace("pad=1x1", "pad=2x2");
        assert_eq!(
            t.lookup(&kind, 32, ConvPass::Forward).1,
            WorkspaceSource::Policy
        );
        assert!(
            WorkspacePolicy {
                layout_transform: f64::NAN,
                min_in_channels: 8,
                bwd_filter_extra_mib: 0.0
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn the_key_parses_into_bytes_moved() {
        let s = Shape::parse(C).unwrap();
        assert_eq!(
            (s.in_per_sample, s.out_per_sample),
            (64.0 * 56.0 * 56.0 * 4.0, 64.0 * 56.0 * 56.0 * 4.0)
        );
        let strided = Shape::parse(&C.replace("stride=1x1", "stride=2x2")).unwrap();
        assert_eq!(strided.out_per_sample, 64.0 * 28.0 * 28.0 * 4.0);
        assert!(Shape::parse("in=3x3;w=1").is_none());
    }
}
