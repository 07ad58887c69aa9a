//! The stable JSON report of one job's estimate (docs/json.md): what `gpumem estimate --json`
//! prints and what the Python API's `Estimate.to_dict()` returns, built here once so that both
//! say the same thing of the same job, to the byte.

use gpumem_core::allocator::AllocatorStats;
use gpumem_core::estimate::{Breakdown, Estimate, PeakAt, PhasePeak};
use gpumem_core::run::RunReport;
use gpumem_core::trace::{Trace, TraceHeader};
use gpumem_core::units::mib;
use gpumem_core::utilization::Utilization;
use gpumem_core::workspace::WorkspaceSource;
use serde::Serialize;

use crate::{Reading, Strategy};
use gpumem_core::job::RoutingImbalance;

/// One job's estimate as machine output: MiB figures (to 0.1) beside the exact bytes.
#[derive(Debug, Clone, Serialize)]
pub struct EstimateReport {
    pub model: String,
    pub batch_size: u64,
    pub estimator: &'static str,
    pub gpu: String,
    pub peak_mib: f64,
    pub peak_bytes: u64,
    pub upper_bound_mib: f64,
    pub upper_bound_bytes: u64,
    pub capacity_mib: f64,
    pub fits: bool,
    pub upper_bound_fits: bool,
    pub breakdown: serde_json::Map<String, serde_json::Value>,
    pub breakdown_bytes: Breakdown,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_at: Option<PeakAt>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_peak: Option<MomentReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<AllocatorStats>,
    /// Where the convolution workspaces' sizes came from: probed, fitted or default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_source: Option<WorkspaceSource>,
    /// bitsandbytes' paged optimizer state (CUDA managed memory), outside the peak.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_backed_mib: Option<f64>,
    /// Run-average DCGM fields (physical model, or learned models where given).
    pub utilization: UtilizationReport,
    /// Learned models' answers (the CLI's `--learned-model`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub learned: Vec<serde_json::Value>,
    /// Present where the spec means more than one network: each reading, sized; the answer
    /// above is the largest (its bound, the largest bound).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ambiguity: Option<Ambiguity>,
    /// A pipeline job: each stage's rank, the worst first (the estimate is that one's).
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub stages: Vec<StageReport>,
    /// An expert-parallel job bounded at a router imbalance: its worst rank at that imbalance
    /// (the estimate routes evenly; the upper bound covers this).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingReport>,
    /// A multi-GPU job's layout (its engine and mesh): the estimate is one rank's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    /// A multi-GPU job: the NCCL communicators its rank holds (the process groups its
    /// collectives ran on), whose buffers the profile's NCCL facts size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub communicators: Option<u32>,
    /// A ZeRO-2/3 job: DeepSpeed's own model-state figure, beside this estimate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deepspeed: Option<DeepSpeedFigure>,
    /// A job whose sequence length varies by step: its lengths and the run's reserved memory
    /// against its longest step's and the bound over any order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<RunReport>,
    /// A whole run (--whole-run): each part's peak, in the order the run reaches them.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub phases: Vec<PhasePeak>,
    /// A trainer config's kind, and every key used, not modelled (why) or not bearing on memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_config: Option<serde_json::Value>,
}

/// One pipeline stage's rank, sized.
#[derive(Debug, Clone, Serialize)]
pub struct StageReport {
    pub stage: u32,
    pub peak_mib: f64,
    pub peak_bytes: u64,
    pub upper_bound_mib: f64,
    pub upper_bound_bytes: u64,
}

/// An expert-parallel job's worst rank with its router at the imbalance the bound assumes.
#[derive(Debug, Clone, Serialize)]
pub struct RoutingReport {
    pub imbalance: f64,
    pub peak_mib: f64,
    pub peak_bytes: u64,
    pub upper_bound_mib: f64,
    pub upper_bound_bytes: u64,
}

/// What DeepSpeed's `estimate_zero*_model_states_mem_needs` gives for the job: model states
/// only (no activations, buffers or allocator), for comparison.
#[derive(Debug, Clone, Serialize)]
pub struct DeepSpeedFigure {
    pub formula: &'static str,
    pub gpu_mib: f64,
    pub gpu_bytes: u64,
    pub cpu_mib: f64,
    pub cpu_bytes: u64,
}

/// Why a spec is ambiguous, and what each of its readings needs.
#[derive(Debug, Clone, Serialize)]
pub struct Ambiguity {
    pub note: &'static str,
    pub readings: Vec<ReadingReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReadingReport {
    pub model: String,
    pub peak_mib: f64,
    pub upper_bound_mib: f64,
}

/// The breakdown at the peak of reserved memory, where it is not the allocated peak's.
#[derive(Debug, Clone, Serialize)]
pub struct MomentReport {
    pub peak_at: PeakAt,
    pub allocated_mib: f64,
    pub reserved_mib: f64,
    pub breakdown: serde_json::Map<String, serde_json::Value>,
    pub breakdown_bytes: Breakdown,
}

#[derive(Debug, Clone, Serialize)]
pub struct UtilizationReport {
    pub smact: f64,
    pub smocc: f64,
    pub gract: f64,
    pub dram: f64,
    pub fp32: f64,
    pub step_ms: f64,
}

/// Why the dense CNN specs of the seed are sized twice.
pub const DENSE_AMBIGUITY: &str = "a dense CNN without pool_every: the seed's runs drew the transition interval at random (5 or the depth rule); both networks are sized and the larger is given (add pool_every=5 or pool_every=0 to choose)";

fn breakdown_mib(b: &Breakdown) -> serde_json::Map<String, serde_json::Value> {
    b.items()
        .iter()
        .map(|(k, v)| (format!("{k}_mib"), serde_json::json!(mib(*v))))
        .collect()
}

impl EstimateReport {
    /// The report of `est`, the estimate of `trace` (`util`: its utilization); `strategy`,
    /// where the job states one, adds DeepSpeed's figure for ZeRO-2/3; more than one of
    /// `readings`, the ambiguity; `run`, a run whose lengths vary.
    pub fn new(
        trace: &Trace,
        est: &Estimate,
        util: &Utilization,
        strategy: Option<Strategy>,
        readings: &[Reading],
        run: Option<RunReport>,
    ) -> EstimateReport {
        EstimateReport {
            model: trace.header.model.clone(),
            batch_size: trace.header.batch_size,
            estimator: est.estimator,
            gpu: est.gpu.clone(),
            peak_mib: mib(est.peak_bytes),
            peak_bytes: est.peak_bytes,
            upper_bound_mib: mib(est.upper_bound_bytes),
            upper_bound_bytes: est.upper_bound_bytes,
            capacity_mib: mib(est.capacity_bytes),
            fits: est.fits,
            upper_bound_fits: est.upper_bound_bytes <= est.capacity_bytes,
            breakdown: breakdown_mib(&est.breakdown),
            breakdown_bytes: est.breakdown,
            peak_at: est.peak_at.clone(),
            reserved_peak: est.reserved_peak.as_ref().map(|m| MomentReport {
                peak_at: m.at.clone(),
                allocated_mib: mib(m.allocated),
                reserved_mib: mib(m.reserved),
                breakdown: breakdown_mib(&m.breakdown),
                breakdown_bytes: m.breakdown,
            }),
            allocator: est.allocator,
            workspace_source: est.workspace_source,
            host_backed_mib: (est.host_backed_bytes > 0).then(|| mib(est.host_backed_bytes)),
            utilization: UtilizationReport {
                smact: util.smact,
                smocc: util.smocc,
                gract: util.gract,
                dram: util.dram,
                fp32: util.fp32,
                step_ms: util.step_s * 1e3,
            },
            learned: Vec::new(),
            stages: stages(readings),
            routing: readings
                .iter()
                .filter(|r| r.routing != RoutingImbalance::BALANCED)
                .max_by_key(|r| r.peak_bytes)
                .map(|r| RoutingReport {
                    imbalance: r.routing.factor(),
                    peak_mib: mib(r.peak_bytes),
                    peak_bytes: r.peak_bytes,
                    upper_bound_mib: mib(r.upper_bound_bytes),
                    upper_bound_bytes: r.upper_bound_bytes,
                }),
            ambiguity: (readings.len() > 1
                && readings
                    .iter()
                    .all(|r| r.stage.is_none() && r.routing == RoutingImbalance::BALANCED))
            .then(|| Ambiguity {
                note: DENSE_AMBIGUITY,
                readings: readings
                    .iter()
                    .map(|r| ReadingReport {
                        model: r.model.clone(),
                        peak_mib: mib(r.peak_bytes),
                        upper_bound_mib: mib(r.upper_bound_bytes),
                    })
                    .collect(),
            }),
            strategy,
            communicators: strategy.map(|_| trace.communicators()),
            deepspeed: deepspeed_figure(strategy, &trace.header),
            run,
            phases: est.phases.clone(),
            train_config: None,
        }
    }
}

/// The stages among `readings` (their balanced routing's), the worst (largest peak) first.
fn stages(readings: &[Reading]) -> Vec<StageReport> {
    let mut out: Vec<StageReport> = readings
        .iter()
        .filter(|r| r.routing == RoutingImbalance::BALANCED)
        .filter_map(|r| {
            Some(StageReport {
                stage: r.stage?,
                peak_mib: mib(r.peak_bytes),
                peak_bytes: r.peak_bytes,
                upper_bound_mib: mib(r.upper_bound_bytes),
                upper_bound_bytes: r.upper_bound_bytes,
            })
        })
        .collect();
    out.sort_by_key(|s| (std::cmp::Reverse(s.peak_bytes), s.stage));
    out
}

fn deepspeed_figure(strategy: Option<Strategy>, header: &TraceHeader) -> Option<DeepSpeedFigure> {
    let strategy = strategy?;
    let states = crate::deepspeed::model_states(
        strategy,
        header.parameters?,
        header.largest_layer_parameters.unwrap_or(0),
    )?;
    let formula = if strategy.name() == "zero2" {
        "estimate_zero2_model_states_mem_needs"
    } else {
        "estimate_zero3_model_states_mem_needs"
    };
    Some(DeepSpeedFigure {
        formula,
        gpu_mib: mib(states.gpu_bytes),
        gpu_bytes: states.gpu_bytes,
        cpu_mib: mib(states.cpu_bytes),
        cpu_bytes: states.cpu_bytes,
    })
}
