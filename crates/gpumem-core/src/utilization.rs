//! How busy a training job keeps the GPU: a physical model from the trace's kernels.
//!
//! Each `op` event becomes a kernel whose time is the larger of its compute time (FLOPs at the
//! profile's peak for the precision the kernel runs in, times an efficiency) and its memory time
//! (bytes at the profile's bandwidth, times an efficiency), plus a fixed start-up cost. The host
//! issues kernels one by one (a dispatch cost per kernel plus a per-step overhead); a step takes
//! the longer of the GPU's and the host's time. From there, DCGM's run-average fields follow:
//! - GRACT: fraction of the step some kernel runs;
//! - SMACT: the same, weighted by the share of SMs a kernel's grid covers;
//! - SMOCC: SMACT weighted by the warps a kernel keeps resident per SM;
//! - DRAMA: bytes moved over the step's peak-bandwidth capacity;
//! - FP32A: non-tensor-core FP32 FLOPs over the step's FP32 capacity.
//!
//! [`physical`] returns a [`Utilization`]; [`HostModel`] holds the host-side costs.

use serde::{Deserialize, Serialize};

use crate::profile::GpuProfile;
use crate::trace::{Event, RunPhase, Trace};

/// Run-average DCGM profiling fields, fractions 0–1.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Utilization {
    pub smact: f64,
    pub smocc: f64,
    pub gract: f64,
    pub dram: f64,
    pub fp32: f64,
    /// Seconds per training step.
    pub step_s: f64,
}

/// Host-side costs of one training step (PyTorch eager on a recent CPU).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostModel {
    /// CPU time to dispatch one kernel through the framework.
    pub dispatch_s: f64,
    /// Python, data-loader hand-off and bookkeeping per step.
    pub step_overhead_s: f64,
    /// Data loading per sample on the host (a map-style DataLoader in the main process).
    pub per_sample_s: f64,
}

impl Default for HostModel {
    fn default() -> Self {
        HostModel {
            dispatch_s: 8e-6,
            step_overhead_s: 1e-3,
            per_sample_s: 6e-6,
        }
    }
}

/// Fractions of the peak rates that real kernels reach.
const COMPUTE_EFFICIENCY: f64 = 0.7;
const MEMORY_EFFICIENCY: f64 = 0.8;
/// Launch-to-finish floor of any kernel.
const KERNEL_FLOOR_S: f64 = 2e-6;
/// Output elements one SM takes per wave: a 128×128 GEMM tile; 1024 threads of an elementwise grid.
const TILE_ELEMENTS: f64 = 16384.0;
const THREADS_PER_SM: f64 = 1024.0;
/// Resident warps over the SM's maximum: GEMM/conv kernels trade occupancy for registers.
const TENSOR_OCCUPANCY: f64 = 0.25;
const ELEMENTWISE_OCCUPANCY: f64 = 0.7;

/// What a kernel's arithmetic runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// cuDNN convolutions (TF32 by default in fp32 training) and cuBLAS GEMMs.
    Conv,
    Gemm,
    Elementwise,
}

/// Ops that launch no kernel: views (a new tensor over the same memory) and allocations. The
/// tracer records them (the host dispatches them), but a view of a 1 GB buffer reads nothing.
const NO_KERNEL: [&str; 17] = [
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "unsqueeze",
    "squeeze",
    "permute",
    "expand",
    "alias",
    "detach",
    "select",
    "slice",
    "narrow",
    "as_strided",
    "unbind",
    "empty",
    "empty_strided",
];

fn unit(op: &str) -> Unit {
    if op.starts_with("conv") {
        Unit::Conv
    } else if matches!(
        op,
        // torchao's float8 matmuls: timed as the job's others (the profiles state no float8 rate).
        "addmm" | "mm" | "bmm" | "baddbmm" | "matmul" | "linear" | "addbmm" | "_scaled_mm"
    ) || op.contains("attention")
    {
        Unit::Gemm
    } else {
        Unit::Elementwise
    }
}

/// Peak FLOP/s of a kernel on `unit` for a trace in `precision`.
fn peak_flops(profile: &GpuProfile, unit: Unit, precision: &str) -> f64 {
    let t = &profile.tflops;
    let tflops = match (unit, precision) {
        (Unit::Elementwise, _) => t.fp32,
        // Autocast and pure 16-bit training alike run their matmuls on the 16-bit tensor cores.
        (_, "amp-fp16" | "fp16") => t.fp16,
        (_, "amp-bf16" | "bf16") => t.bf16,
        // PyTorch's defaults: cudnn.allow_tf32 = True, cuda.matmul.allow_tf32 = False.
        (Unit::Conv, _) => t.tf32,
        (Unit::Gemm, _) => t.fp32,
    };
    tflops.max(1e-3) * 1e12
}

/// The training steps' ops of `trace`, each as (name, flops, bytes read, bytes written):
/// outside a whole run every op, inside one those after `RunPhase::Train` until the next part
/// begins.
pub fn step_ops(trace: &Trace) -> impl Iterator<Item = (&str, u64, u64, u64)> {
    let mut stepping = !trace.is_whole_run();
    trace.events().iter().filter_map(move |ev| {
        if let Event::RunPhase { phase } = *ev {
            stepping = phase == RunPhase::Train;
        }
        match *ev {
            Event::Op {
                op,
                flops,
                bytes_read,
                bytes_written,
            } if stepping => Some((trace.op_name(op), flops, bytes_read, bytes_written)),
            _ => None,
        }
    })
}

/// The least seconds a step of `trace` takes under [`physical`]: its kernels' arithmetic at the
/// GPU's attainable peak alone, no memory traffic, no launch cost, no host. A search's floor:
/// no setup doing the same arithmetic is faster.
pub fn compute_floor_s(trace: &Trace, profile: &GpuProfile) -> f64 {
    let precision = trace.header.options.precision.name();
    let seconds: f64 = step_ops(trace)
        .filter(|(name, ..)| !NO_KERNEL.contains(name))
        .map(|(name, flops, ..)| {
            flops as f64 / (peak_flops(profile, unit(name), precision) * COMPUTE_EFFICIENCY)
        })
        .sum();
    seconds / trace.header.iterations.max(1) as f64
}

/// Per-step utilization of `trace` on `profile`: of its training steps alone where it is a whole
/// run's (the load, the evaluation and the save are not steps).
pub fn physical(trace: &Trace, profile: &GpuProfile, host: &HostModel) -> Utilization {
    let bandwidth = profile.memory_bandwidth_gbs.max(1e-3) * 1e9;
    let sms = f64::from(profile.sm_count.max(1));
    let precision = trace.header.options.precision.name();
    let (mut busy, mut sm_busy, mut occupied, mut dram, mut fp32, mut kernels, mut host_ops) =
        (0.0, 0.0, 0.0, 0.0, 0.0, 0u64, 0u64);
    for (name, flops, bytes_read, bytes_written) in step_ops(trace) {
        if NO_KERNEL.contains(&name) {
            host_ops += 1;
            continue;
        }
        let unit = unit(name);
        let bytes = (bytes_read + bytes_written) as f64;
        let compute = flops as f64 / (peak_flops(profile, unit, precision) * COMPUTE_EFFICIENCY);
        let memory = bytes / (bandwidth * MEMORY_EFFICIENCY);
        let time = compute.max(memory) + KERNEL_FLOOR_S;
        let outputs = bytes_written as f64 / 4.0;
        let (coverage, occupancy) = match unit {
            Unit::Elementwise => (
                (outputs / (THREADS_PER_SM * sms)).min(1.0),
                ELEMENTWISE_OCCUPANCY,
            ),
            _ => (
                (outputs / (TILE_ELEMENTS * sms)).clamp(1.0 / sms, 1.0),
                TENSOR_OCCUPANCY,
            ),
        };
        let coverage = coverage.max(1.0 / sms);
        busy += time;
        sm_busy += time * coverage;
        occupied += time * coverage * occupancy;
        dram += bytes / bandwidth;
        if unit == Unit::Elementwise || (unit == Unit::Gemm && precision == "fp32") {
            fp32 += flops as f64 / (profile.tflops.fp32.max(1e-3) * 1e12);
        }
        kernels += 1;
    }
    let iterations = trace.header.iterations.max(1) as f64;
    let host_s = ((kernels + host_ops) as f64 * host.dispatch_s) / iterations
        + host.step_overhead_s
        + host.per_sample_s * trace.header.batch_size as f64;
    let step = (busy / iterations).max(host_s);
    if step <= 0.0 {
        return Utilization::default();
    }
    let per_step = |x: f64| (x / iterations / step).clamp(0.0, 1.0);
    Utilization {
        smact: per_step(sm_busy),
        smocc: per_step(occupied),
        gract: per_step(busy),
        dram: per_step(dram),
        fp32: per_step(fp32),
        step_s: step,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::{JobOptions, ModelSpec};
    use crate::profile::builtin;

    fn util(spec: &str, batch: u64, gpu: &str) -> Utilization {
        let trace = ModelSpec::parse(spec)
            .unwrap()
            .trace(&JobOptions::new(batch))
            .unwrap();
        physical(&trace, &builtin(gpu).unwrap(), &HostModel::default())
    }

    #[test]
    fn fields_are_fractions_and_ordered() {
        let u = util(
            "mlp:input=4096,output=10,depth=6,arch=uniform,act=relu",
            512,
            "a100-40gb",
        );
        for x in [u.smact, u.smocc, u.gract, u.dram, u.fp32] {
            assert!((0.0..=1.0).contains(&x), "{u:?}");
        }
        assert!(u.smocc <= u.smact && u.smact <= u.gract, "{u:?}");
    }

    #[test]
    fn bigger_batches_keep_the_gpu_busier() {
        let small = util(
            "mlp:input=256,output=10,depth=3,arch=uniform,act=relu",
            8,
            "a100-40gb",
        );
        let large = util(
            "mlp:input=4096,output=10,depth=3,arch=uniform,act=relu",
            1024,
            "a100-40gb",
        );
        assert!(small.gract < 0.5, "a tiny job is launch-bound: {small:?}");
        assert!(
            large.gract > small.gract && large.smact > small.smact,
            "{small:?} {large:?}"
        );
    }

    #[test]
    fn no_step_is_faster_than_its_arithmetic() {
        let h100 = builtin("h100-80gb-sxm").unwrap();
        for (spec, batch) in [
            (
                "mlp:input=4096,output=10,depth=6,arch=uniform,act=relu",
                1024,
            ),
            ("mlp:input=256,output=10,depth=3,arch=uniform,act=relu", 8),
        ] {
            let trace = ModelSpec::parse(spec)
                .unwrap()
                .trace(&JobOptions::new(batch))
                .unwrap();
            let floor = compute_floor_s(&trace, &h100);
            let step = physical(&trace, &h100, &HostModel::default()).step_s;
            assert!(floor > 0.0 && floor < step, "{floor} {step}");
        }
    }

    #[test]
    fn a_faster_gpu_takes_less_time_per_step() {
        let spec = "mlp:input=4096,output=10,depth=6,arch=uniform,act=relu";
        let a100 = util(spec, 1024, "a100-40gb");
        let h100 = util(spec, 1024, "h100-80gb-sxm");
        assert!(h100.step_s < a100.step_s, "{a100:?} {h100:?}");
    }

    /// A whole run's step time is its training steps': the load's, the evaluation's and the
    /// save's ops do not lengthen it.
    #[test]
    fn a_whole_run_is_timed_by_its_training_steps() {
        use crate::trace::{TraceBuilder, TraceHeader};
        let a100 = builtin("a100-40gb").unwrap();
        let timed = |whole: bool| {
            let mut b = TraceBuilder::new(TraceHeader::new("m", 8));
            if whole {
                b.run_phase(RunPhase::Load);
                b.op("mm", 1 << 40, 1 << 30, 1 << 30);
                b.run_phase(RunPhase::Train);
            }
            b.op("mm", 1 << 36, 1 << 26, 1 << 26);
            b.iteration_end();
            if whole {
                b.run_phase(RunPhase::Evaluate);
                b.op("mm", 1 << 40, 1 << 30, 1 << 30);
            }
            physical(&b.finish(), &a100, &HostModel::default())
        };
        assert_eq!(timed(true), timed(false));
    }

    #[test]
    fn matmuls_run_on_tensor_cores_in_pure_16_bit_as_under_autocast() {
        let a100 = builtin("a100-40gb").unwrap();
        for (pure, amp) in [("bf16", "amp-bf16"), ("fp16", "amp-fp16")] {
            assert_eq!(
                peak_flops(&a100, Unit::Gemm, pure),
                peak_flops(&a100, Unit::Gemm, amp)
            );
            assert!(
                peak_flops(&a100, Unit::Gemm, pure) > 10.0 * peak_flops(&a100, Unit::Gemm, "fp32"),
                "312 against 19.5 TFLOP/s"
            );
        }
    }
}
