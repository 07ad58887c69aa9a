//! The fastest setup of a job that fits its GPUs: multi-GPU strategy × precision × activation
//! checkpointing × micro-batch (× gradient accumulation to a global batch), each sized by its
//! upper bound on every rank and timed by the physical model plus the strategy's collectives
//! ([`Interconnect`]). One batch-symbolic trace per (strategy, precision, checkpointing)
//! answers every micro-batch, so a PyTorch model is traced a handful of times, not once per
//! point, and those traces run side by side, one tracer process per core.

use gpumem_core::estimate::{Estimate, Estimator};
use gpumem_core::job::{Engine, Precision, ZeroStage};
use gpumem_core::profile::GpuProfile;
use gpumem_core::utilization::{HostModel, physical};

use crate::{Checkpointing, SizeError, Strategy, Symbolic, Workload, WorkloadError, side_by_side};

/// Setups whose time per sample is this close to the fastest's count as as fast.
pub const TIE: f64 = 0.01;

/// What to search.
#[derive(Debug, Clone)]
pub struct Space {
    /// Multi-GPU strategies (`None`: one GPU, or the base job's own strategy).
    pub strategies: Vec<Option<Strategy>>,
    pub precisions: Vec<Precision>,
    pub checkpointing: Vec<Checkpointing>,
    /// Samples per optimizer step over every rank of the job's strategy (a whole multiple of its
    /// world size): micro-batches then divide each rank's share (the rest is gradient
    /// accumulation). `None`: micro-batches are powers of two up to the largest that fits, each
    /// its own step.
    pub global_batch: Option<u64>,
}

/// How fast a job's ranks exchange bytes: NCCL's bus bandwidth per rank (what nccl-tests
/// reports as busbw), which a ring collective moves (N−1)/N of its buffer per rank at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interconnect {
    pub bus_gbs: f64,
}

impl Interconnect {
    /// A GPU's usual link within one machine: NVLink on SXM parts (A100: ~230 GB/s bus
    /// bandwidth in all-reduce on 8 GPUs; H100/H200: ~360 GB/s), PCIe 4.0 elsewhere (~20 GB/s).
    /// Typical nccl-tests figures, not measurements of a given machine (`--bus-gbs` states one).
    pub fn for_gpu(device: &str) -> Interconnect {
        let d = device.to_ascii_lowercase();
        let bus_gbs = if d.contains("h100") && !d.contains("pcie") || d.contains("h200") {
            360.0
        } else if d.contains("a100") && !d.contains("pcie") {
            230.0
        } else {
            20.0
        };
        Interconnect { bus_gbs }
    }

    /// Seconds one rank spends in `strategy`'s collectives per micro-batch of a model with
    /// `parameters` trainable parameters in `precision`, stepping every `grad_accum`
    /// micro-batches; not overlapped with compute (an upper bound on their cost). DDP
    /// all-reduces the gradients each micro-batch (2·(N−1)/N of their bytes); ZeRO-1/2
    /// reduce-scatter them ((N−1)/N) and all-gather the updated 16-bit weights once per step;
    /// FSDP and ZeRO-3 gather the weights for forward and again for backward (once when FSDP
    /// keeps them) and reduce-scatter the gradients.
    pub fn comm_s(
        self,
        strategy: Option<Strategy>,
        parameters: u64,
        precision: Precision,
        grad_accum: u64,
    ) -> f64 {
        let Some(strategy) = strategy else { return 0.0 };
        let n = f64::from(strategy.world_size());
        let ring = (n - 1.0) / n;
        let word = if matches!(precision, Precision::Bf16 | Precision::Fp16) {
            2.0
        } else {
            4.0
        };
        let bytes = parameters as f64 * word;
        let moved = match strategy.engine() {
            Engine::Ddp { .. } => 2.0 * ring * bytes,
            Engine::Zero {
                stage: ZeroStage::One | ZeroStage::Two,
                ..
            } => ring * bytes + ring * bytes / grad_accum.max(1) as f64,
            Engine::Zero { .. } => 3.0 * ring * bytes,
            // A mixed-precision policy gathers in its 16-bit dtype and reduces in fp32. HSDP
            // gathers and reduce-scatters within a group of N/R ranks, then all-reduces its shard
            // across the R groups (counted at the same bandwidth).
            Engine::Fsdp {
                reshard_after_forward,
                param_dtype,
                ..
            } => {
                let replicas = strategy.replicas();
                let (gathered, reduced) = if param_dtype.is_some() {
                    (2.0, 4.0)
                } else {
                    (word, word)
                };
                let gathers = if reshard_after_forward { 2.0 } else { 1.0 };
                let (group, r) = (n / f64::from(replicas), f64::from(replicas));
                let within = (group - 1.0) / group;
                let across = if replicas > 1 {
                    2.0 * (r - 1.0) / r * reduced / group
                } else {
                    0.0
                };
                parameters as f64 * (within * (gathers * gathered + reduced) + across)
            }
        };
        moved / (self.bus_gbs.max(1e-3) * 1e9)
    }
}

/// One setup, sized and timed.
#[derive(Debug, Clone)]
pub struct Setup {
    pub strategy: Option<Strategy>,
    pub precision: Precision,
    pub checkpointing: Checkpointing,
    pub micro_batch: u64,
    pub grad_accum: u64,
    pub estimate: Estimate,
    /// Seconds per micro-batch step: forward, backward and optimizer by the physical model,
    /// plus `comm_s`.
    pub step_s: f64,
    /// Of `step_s`, the strategy's collectives.
    pub comm_s: f64,
}

impl Setup {
    /// Seconds per sample: what ranks setups (for a fixed global batch, the time of its step
    /// over the batch; the optimizer's step is counted once per micro-batch, a small
    /// overestimate for many accumulation steps).
    pub fn seconds_per_sample(&self) -> f64 {
        self.step_s / self.micro_batch as f64
    }
}

/// A (strategy, precision, checkpointing) that could not be planned, and why.
#[derive(Debug)]
pub struct Skipped {
    pub strategy: Option<Strategy>,
    pub precision: Precision,
    pub checkpointing: Checkpointing,
    pub reason: SkipReason,
}

/// Why a setup was not planned.
#[derive(Debug, thiserror::Error)]
pub enum SkipReason {
    /// The model cannot take the setup: its options, or the tracer's refusal (no blocks to
    /// checkpoint or shard, a precision the families refuse, FSDP2 on an old torch).
    #[error(transparent)]
    Refused(WorkloadError),
    /// What every rank holds of the model states alone exceeds the GPU (not traced).
    #[error(
        "its model states alone do not fit: what every rank holds of the {:.1} M trainable parameters, their gradients and {optimizer}'s states needs {:.0} MiB",
        *.trainable as f64 / 1e6,
        gpumem_core::units::bytes_to_mib(*.bytes)
    )]
    ModelStates {
        trainable: u64,
        optimizer: String,
        bytes: u64,
    },
}

/// The search's answer: every setup that fits, fastest first (among those within [`TIE`] of the
/// fastest, the one with the smallest upper bound first); the largest micro-batch that does
/// not fit per pair (where the search reached one); the pairs that could not be traced.
#[derive(Debug, Default)]
pub struct Plan {
    pub fits: Vec<Setup>,
    pub too_big: Vec<Setup>,
    pub skipped: Vec<Skipped>,
}

/// The micro-batches to try: divisors of the global batch, or powers of two and `max` itself —
/// those up to `max` (the largest that fits), and the next one above it, to show it does not.
fn micro_batches(global: Option<u64>, max: u64) -> Vec<u64> {
    let candidates: Vec<u64> = match global {
        Some(g) => (1..=g).filter(|m| g % m == 0).collect(),
        None => {
            let mut v: Vec<u64> = std::iter::successors(Some(1u64), |b| b.checked_mul(2))
                .take_while(|b| *b <= max.saturating_mul(2))
                .collect();
            v.push(max);
            v.sort_unstable();
            v.dedup();
            v
        }
    };
    let above = candidates.iter().copied().find(|m| *m > max);
    candidates
        .into_iter()
        .filter(|m| *m <= max)
        .chain(above)
        .collect()
}

/// The batch-symbolic trace of `base`'s model under `options`; `Ok(Err(why))` for a setup the
/// model cannot take (its options; the tracer's refusal: no blocks to checkpoint or shard, a
/// precision the families refuse, FSDP2 on an old torch), which the plan skips; the tracer
/// missing altogether is an error.
fn setup_trace(
    base: &Workload,
    options: Result<crate::Options, crate::OptionError>,
    profile: &GpuProfile,
) -> Result<Result<Symbolic, SkipReason>, WorkloadError> {
    let traced = options
        .map_err(WorkloadError::from)
        .and_then(|o| Workload::new(base.model().clone(), 1, o))
        .and_then(|w| w.symbolic(profile));
    match traced {
        Ok(s) => Ok(Ok(s)),
        Err(e)
            if e.is_input() || matches!(&e, WorkloadError::Tracer(b) if b.is_model_failure()) =>
        {
            Ok(Err(SkipReason::Refused(e)))
        }
        Err(e) => Err(e),
    }
}

/// The least memory a rank of `strategy` holds at once for the model states of `trainable`
/// parameters, where that is large: DDP's replica of the parameters and their gradients in the
/// weights' dtype and of the optimizer's states (torch's in that dtype; bitsandbytes' 8-bit
/// ones a byte each; paged ones not counted, as they may sit on the host), alive together at the
/// optimizer's step; ZeRO-1/2's flat copy of the parameters beside the rank's partition of the
/// fp32 master weights and optimizer states (none when offloaded), and stage 1's gradients, all
/// kept until backward ends (without `overlap_comm`). `None` for the sharded strategies and
/// with LoRA, whose adapters' dtype only the trace knows.
fn model_states_floor(
    strategy: Option<Strategy>,
    trainable: u64,
    precision: Precision,
    options: &crate::Options,
) -> Option<u64> {
    if options.lora.is_some() {
        return None;
    }
    let word = if matches!(precision, Precision::Bf16 | Precision::Fp16) {
        2
    } else {
        4
    };
    let strategy = strategy?;
    match strategy.engine() {
        Engine::Ddp { .. } => {
            let states = options.optimizer.state_floor(word);
            trainable.checked_mul(2 * word + states)
        }
        Engine::Zero {
            stage: stage @ (ZeroStage::One | ZeroStage::Two),
            zero,
        } => {
            let world_size = strategy.world_size();
            // ZeRO takes Adam, AdamW and SGD only (`OptionError::ZeroOptimizer`).
            options.optimizer.zero_family()?;
            let states = options.optimizer.state_floor(1);
            let master = if zero.offload_optimizer {
                0
            } else {
                trainable / u64::from(world_size) * 4 * (1 + states)
            };
            let grads = if stage == ZeroStage::One && !zero.overlap_comm.unwrap_or(false) {
                word
            } else {
                0
            };
            trainable.checked_mul(word + grads)?.checked_add(master)
        }
        _ => None,
    }
}

/// One (strategy, precision, checkpointing) setup's micro-batches: those that fit, and the
/// next one up that does not; its trainable parameters.
struct MicroBatches {
    trainable: Option<u64>,
    fits: Vec<Setup>,
    too_big: Vec<Setup>,
}

/// Sizes and times the micro-batches of one setup from its batch-symbolic trace.
fn size(
    sym: &Symbolic,
    (strategy, precision, checkpointing): (Option<Strategy>, Precision, Checkpointing),
    profile: &GpuProfile,
    estimator: &dyn Estimator,
    space: &Space,
    link: Interconnect,
) -> Result<MicroBatches, SizeError> {
    let host = HostModel::default();
    let mut sized = MicroBatches {
        trainable: sym.trainable_parameters(),
        fits: Vec::new(),
        too_big: Vec::new(),
    };
    let world = u64::from(strategy.map_or(1, |s| s.world_size()));
    let rank_batch = space.global_batch.map(|g| g / world);
    let Some((max, _)) = sym.max_batch(profile, estimator)? else {
        let estimate = estimator.estimate(&sym.at(1)?, profile)?;
        sized.too_big.push(Setup {
            strategy,
            precision,
            checkpointing,
            micro_batch: 1,
            grad_accum: rank_batch.unwrap_or(1),
            estimate,
            step_s: 0.0,
            comm_s: 0.0,
        });
        return Ok(sized);
    };
    for m in micro_batches(rank_batch, max) {
        let trace = sym.at(m)?;
        let estimate = estimator.estimate(&trace, profile)?;
        let grad_accum = rank_batch.map_or(1, |g| g / m);
        let comm_s = link.comm_s(
            strategy,
            trace.header.parameters.unwrap_or(0),
            precision,
            grad_accum,
        );
        let step_s = physical(&trace, profile, &host).step_s + comm_s;
        let setup = Setup {
            strategy,
            precision,
            checkpointing,
            micro_batch: m,
            grad_accum,
            step_s,
            comm_s,
            estimate,
        };
        if m > max {
            sized.too_big.push(setup);
        } else {
            sized.fits.push(setup);
        }
    }
    Ok(sized)
}

/// Plans `base` (its model and fixed options; its strategy where `space` lists none, and its
/// precision, checkpointing and batch are searched) on `profile`, every rank's GPU.
/// `traced(done, of)` hears how many of the `of` (strategy, precision, checkpointing) setups
/// are traced (the cold part: a tracer run each), first with none.
pub fn plan(
    base: &Workload,
    profile: &GpuProfile,
    estimator: &dyn Estimator,
    space: &Space,
    link: Interconnect,
    traced: &(dyn Fn(usize, usize) + Sync),
) -> Result<Plan, SizeError> {
    let strategies = if space.strategies.is_empty() {
        vec![base.options().strategy]
    } else {
        space.strategies.clone()
    };
    let mut pairs = Vec::new();
    for &strategy in &strategies {
        for &precision in &space.precisions {
            for &checkpointing in &space.checkpointing {
                pairs.push((strategy, precision, checkpointing));
            }
        }
    }
    // Each pair's trace is a tracer process of its own (Python, one core each): side by side,
    // each sized as soon as it is traced, beside the traces still running.
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let (done, of) = (AtomicUsize::new(0), AtomicUsize::new(pairs.len()));
    traced(0, pairs.len());
    let options = |strategy, precision, checkpointing| {
        crate::OptionValues {
            precision,
            checkpointing,
            grad_accum: 1,
            strategy,
            ..base.options().values()
        }
        .check()
    };
    let trace_each = |pairs: &[(Option<Strategy>, Precision, Checkpointing)]| {
        let sized = side_by_side(pairs, |&(strategy, precision, checkpointing)| -> Result<Result<MicroBatches, SkipReason>, SizeError> {
            let sym = setup_trace(base, options(strategy, precision, checkpointing), profile);
            traced(done.fetch_add(1, Relaxed) + 1, of.load(Relaxed));
            Ok(match sym? {
                Ok(sym) => Ok(size(&sym, (strategy, precision, checkpointing), profile, estimator, space, link)?),
                Err(reason) => Err(reason),
            })
        });
        pairs.iter().copied().zip(sized).collect::<Vec<_>>()
    };
    // DDP and ZeRO-1/2 hold a whole copy of the parameters (DDP: of all model states) on every
    // rank: where what they hold alone exceeds the GPU, those setups are not traced. The other
    // setups, traced first, count the parameters.
    let floored = |s: &Option<Strategy>| {
        matches!(
            s.map(|s| s.engine()),
            Some(
                Engine::Ddp { .. }
                    | Engine::Zero {
                        stage: ZeroStage::One | ZeroStage::Two,
                        ..
                    }
            )
        )
    };
    let (bounded, others): (Vec<_>, Vec<_>) = pairs.into_iter().partition(|(s, ..)| floored(s));
    let mut setups = trace_each(&others);
    let trainable = setups
        .iter()
        .find_map(|(_, sized)| sized.as_ref().ok()?.as_ref().ok()?.trainable);
    let mut out = Plan::default();
    let mut to_trace = Vec::new();
    for (strategy, precision, checkpointing) in bounded {
        // A setup the options refuse (ZeRO under amp-fp16) says so instead, untraced.
        let valid = options(strategy, precision, checkpointing).is_ok();
        match trainable.filter(|_| valid).and_then(|n| {
            Some((
                n,
                model_states_floor(strategy, n, precision, base.options())?,
            ))
        }) {
            Some((n, bytes)) if bytes > profile.capacity_bytes() => {
                of.fetch_sub(1, Relaxed);
                let reason = SkipReason::ModelStates {
                    trainable: n,
                    optimizer: base.options().optimizer.name(),
                    bytes,
                };
                out.skipped.push(Skipped {
                    strategy,
                    precision,
                    checkpointing,
                    reason,
                });
            }
            _ => to_trace.push((strategy, precision, checkpointing)),
        }
    }
    setups.extend(trace_each(&to_trace));
    for ((strategy, precision, checkpointing), sized) in setups {
        match sized? {
            Ok(sized) => {
                out.fits.extend(sized.fits);
                out.too_big.extend(sized.too_big);
            }
            Err(reason) => out.skipped.push(Skipped {
                strategy,
                precision,
                checkpointing,
                reason,
            }),
        }
    }
    out.fits
        .sort_by(|a, b| a.seconds_per_sample().total_cmp(&b.seconds_per_sample()));
    // Within 1% of the fastest, the physical model cannot tell setups apart: the one that needs
    // least memory leads (it leaves the GPU room, or other jobs a share of it).
    if let Some(fastest) = out.fits.first().map(Setup::seconds_per_sample) {
        let near = out
            .fits
            .iter()
            .take_while(|s| s.seconds_per_sample() <= fastest * (1.0 + TIE))
            .count();
        if let Some(i) = (0..near).min_by_key(|&i| out.fits[i].estimate.upper_bound_bytes) {
            let lead = out.fits.remove(i);
            out.fits.insert(0, lead);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn collectives_cost_what_their_rings_move() {
        let link = Interconnect { bus_gbs: 100.0 };
        let (p, zero) = (1_000_000_000u64, crate::Zero::default());
        let ddp = Strategy::ddp(4, 25, false).unwrap();
        // 2 · 3/4 · 4 GB over 100 GB/s.
        assert!((link.comm_s(Some(ddp), p, Precision::Fp32, 1) - 0.06).abs() < 1e-12);
        assert_eq!(link.comm_s(None, p, Precision::Fp32, 1), 0.0);
        let z = |stage| Some(Strategy::zero(ZeroStage::new(stage).unwrap(), 4, zero).unwrap());
        // bf16: 2 GB; ZeRO-2 reduce-scatters each micro-batch, gathers weights once per 4.
        assert!((link.comm_s(z(2), p, Precision::Bf16, 4) - (0.015 + 0.015 / 4.0)).abs() < 1e-12);
        assert!((link.comm_s(z(3), p, Precision::Bf16, 4) - 0.045).abs() < 1e-12);
        assert_eq!(
            Interconnect::for_gpu("NVIDIA H100 80GB HBM3 (SXM5)").bus_gbs,
            360.0
        );
        assert_eq!(Interconnect::for_gpu("NVIDIA H100 PCIe 80GB").bus_gbs, 20.0);
        assert_eq!(
            Interconnect::for_gpu("NVIDIA A100-SXM4-40GB").bus_gbs,
            230.0
        );
    }

    use super::*;
    use gpumem_core::estimate::Replay;
    use gpumem_core::job::Optimizer;
    use gpumem_core::profile::builtin;

    #[test]
    fn a_rank_holds_at_least_its_copy_of_the_model_states() {
        use crate::Zero;
        let adam = crate::Options::default();
        let ddp = Some(Strategy::ddp(4, 25, false).unwrap());
        assert_eq!(
            model_states_floor(ddp, 1000, Precision::AmpBf16, &adam),
            Some(16_000),
            "fp32 weights, gradients, two moments"
        );
        assert_eq!(
            model_states_floor(ddp, 1000, Precision::Bf16, &adam),
            Some(8_000)
        );
        let with = |optimizer| {
            crate::OptionValues {
                optimizer,
                ..adam.values()
            }
            .check()
            .unwrap()
        };
        assert_eq!(
            model_states_floor(ddp, 1000, Precision::Fp32, &with(Optimizer::SGD)),
            Some(8_000)
        );
        assert_eq!(
            model_states_floor(ddp, 1000, Precision::Fp32, &with(Optimizer::SGD_MOMENTUM)),
            Some(12_000)
        );
        assert_eq!(
            model_states_floor(
                ddp,
                1000,
                Precision::Fp32,
                &with(Optimizer::parse("adamw8bit").unwrap())
            ),
            Some(10_000)
        );
        assert_eq!(
            model_states_floor(
                ddp,
                1000,
                Precision::Fp32,
                &with(Optimizer::parse("paged-adamw8bit").unwrap())
            ),
            Some(8_000),
            "paged states may sit on the host"
        );
        let zero =
            |stage, zero| Some(Strategy::zero(ZeroStage::new(stage).unwrap(), 4, zero).unwrap());
        // Flat parameters, then a quarter of the fp32 master weights and two moments.
        assert_eq!(
            model_states_floor(zero(2, Zero::default()), 1000, Precision::Bf16, &adam),
            Some(2_000 + 3_000)
        );
        assert_eq!(
            model_states_floor(zero(1, Zero::default()), 1000, Precision::Bf16, &adam),
            Some(4_000 + 3_000),
            "and every gradient"
        );
        assert_eq!(
            model_states_floor(
                zero(
                    1,
                    Zero {
                        overlap_comm: Some(true),
                        ..Zero::default()
                    }
                ),
                1000,
                Precision::Bf16,
                &adam
            ),
            Some(5_000)
        );
        assert_eq!(
            model_states_floor(
                zero(
                    2,
                    Zero {
                        offload_optimizer: true,
                        ..Zero::default()
                    }
                ),
                1000,
                Precision::AmpBf16,
                &adam
            ),
            Some(4_000)
        );
        assert_eq!(
            model_states_floor(zero(3, Zero::default()), 1000, Precision::Bf16, &adam),
            None,
            "sharded"
        );
        assert_eq!(model_states_floor(None, 1000, Precision::Bf16, &adam), None);
        let lora = crate::OptionValues {
            lora: Some(crate::Lora::new(8, 16.0, vec!["q_proj".into()], 0.0, None).unwrap()),
            ..adam.values()
        }
        .check()
        .unwrap();
        assert_eq!(model_states_floor(ddp, 1000, Precision::Fp32, &lora), None);
    }

    #[test]
    fn micro_batches_divide_the_global_batch_or_double() {
        assert_eq!(micro_batches(Some(12), 100), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(
            micro_batches(Some(12), 4),
            vec![1, 2, 3, 4, 6],
            "the next one above the largest that fits, to show it does not"
        );
        assert_eq!(
            micro_batches(None, 100),
            vec![1, 2, 4, 8, 16, 32, 64, 100, 128]
        );
        assert_eq!(micro_batches(None, 64), vec![1, 2, 4, 8, 16, 32, 64, 128]);
    }

    #[test]
    fn the_fastest_setup_that_fits_comes_first() {
        let t4 = builtin("t4").unwrap();
        let base = Workload::parse(
            "mlp:input=4096,output=10,depth=6,arch=uniform",
            1,
            crate::Options::default(),
        )
        .unwrap();
        let space = Space {
            strategies: Vec::new(),
            precisions: vec![Precision::Fp32, Precision::AmpFp16],
            checkpointing: vec![Checkpointing::Off],
            global_batch: Some(4096),
        };
        let link = Interconnect::for_gpu(&t4.name);
        let p = plan(&base, &t4, &Replay::default(), &space, link, &|_, _| ()).unwrap();
        assert!(!p.fits.is_empty());
        assert!(
            p.fits
                .windows(2)
                .all(|w| w[0].seconds_per_sample() <= w[1].seconds_per_sample())
        );
        assert!(
            p.fits
                .iter()
                .all(|s| s.estimate.upper_bound_bytes <= t4.capacity_bytes()
                    && s.micro_batch * s.grad_accum == 4096)
        );
        assert!(
            p.too_big
                .iter()
                .all(|s| s.estimate.upper_bound_bytes > t4.capacity_bytes())
        );
        // The same micro-batch trains faster in mixed precision on a T4's tensor cores.
        let best = &p.fits[0];
        assert_eq!(best.precision, Precision::AmpFp16, "{best:?}");
        // Checkpointing is for PyTorch models: skipped with the reason, not an error.
        let space = Space {
            checkpointing: vec![Checkpointing::Full],
            ..space
        };
        let p = plan(&base, &t4, &Replay::default(), &space, link, &|_, _| ()).unwrap();
        assert!(
            p.fits.is_empty()
                && p.skipped.len() == 2
                && p.skipped[0]
                    .reason
                    .to_string()
                    .contains("apply to PyTorch models")
        );
    }
}

/// A plan as its callers state it (the command's flags, the package's arguments), before it
/// is checked against the model and the GPU: [`PlanRequest::space`] turns it into a [`Space`].
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlanRequest {
    /// GPUs of the job: every strategy of `strategies` is planned over all of them (`None`:
    /// one GPU, or the base job's own strategy).
    pub gpus: Option<u32>,
    /// With `gpus`: ddp, fsdp, zero1, zero2, zero3 (empty: all five).
    pub strategies: Vec<String>,
    /// Empty: fp32, amp-bf16 where the GPU has bf16, amp-fp16.
    pub precisions: Vec<String>,
    /// both (off and full), all (and selective), on, or one mode (`None`: both).
    pub checkpointing: Option<String>,
    /// Samples per optimizer step over every rank.
    pub global_batch: Option<u64>,
    /// NCCL bus bandwidth per rank, GB/s (`None`: the GPU's usual link).
    pub bus_gbs: Option<f64>,
}

/// A [`PlanRequest`] field that is wrong: `field` as the package spells it (`global_batch`),
/// `rest` the message after it; each caller names the field its own way.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInputError {
    pub field: &'static str,
    pub rest: String,
}

impl PlanInputError {
    fn new(field: &'static str, rest: impl Into<String>) -> PlanInputError {
        PlanInputError {
            field,
            rest: rest.into(),
        }
    }

    /// The message, the field named as a command-line flag (`--global-batch`).
    pub fn as_flag(&self) -> String {
        format!("--{}{}", self.field.replace('_', "-"), self.rest)
    }

    /// The message, the field named as the package's argument (`global_batch`).
    pub fn as_argument(&self) -> String {
        format!("{}{}", self.field, self.rest)
    }
}

impl PlanRequest {
    /// What to search for `base` on `profile` (each of the job's GPUs), how fast its ranks
    /// talk, and the job's world size.
    pub fn space(
        &self,
        base: &Workload,
        profile: &GpuProfile,
    ) -> Result<(Space, Interconnect, u64), PlanInputError> {
        let native = base.model().is_native();
        let precisions: Vec<Precision> = if self.precisions.is_empty() {
            let bf16 = profile.cc_major() >= 8;
            [Precision::Fp32, Precision::AmpBf16, Precision::AmpFp16]
                .into_iter()
                .filter(|p| bf16 || *p != Precision::AmpBf16)
                .collect()
        } else {
            self.precisions
                .iter()
                .map(|p| {
                    Precision::parse(p)
                        .map_err(|e| PlanInputError::new("precisions", format!(": {e}")))
                })
                .collect::<Result<_, _>>()?
        };
        use Checkpointing::{Full, Off, Selective};
        let checkpointing = match self.checkpointing.as_deref().unwrap_or("both") {
            "both" | "all" if native => vec![Off],
            "both" => vec![Off, Full],
            "all" => vec![Off, Full, Selective],
            "on" | "full" => vec![Full],
            "selective" => vec![Selective],
            "off" => vec![Off],
            other => match Checkpointing::parse(other) {
                Ok(mode) => vec![mode],
                Err(_) => {
                    return Err(PlanInputError::new(
                        "checkpointing",
                        format!(
                            " `{other}` is not both, all, on, or one mode ({})",
                            Checkpointing::EXPECTED
                        ),
                    ));
                }
            },
        };
        let gpus = self.gpus.unwrap_or(1);
        if !(1..=gpumem_core::job::MAX_WORLD_SIZE).contains(&gpus) {
            return Err(PlanInputError::new(
                "gpus",
                format!(" {gpus} is not 1 to {}", gpumem_core::job::MAX_WORLD_SIZE),
            ));
        }
        let world = u64::from(base.options().strategy.map_or(gpus, |s| s.world_size()));
        let strategies = match self.gpus {
            Some(_) if base.options().strategy.is_some() => {
                return Err(PlanInputError::new(
                    "gpus",
                    " plans the strategies over the GPUs: not with the job's own strategy",
                ));
            }
            Some(_) if native => {
                return Err(PlanInputError::new(
                    "gpus",
                    " plans multi-GPU strategies, which apply to PyTorch models",
                ));
            }
            Some(1) => vec![None],
            Some(n) => named_strategies(&self.strategies, n)?,
            None if !self.strategies.is_empty() => {
                return Err(PlanInputError::new("strategies", " need gpus"));
            }
            None => Vec::new(),
        };
        if let Some(bus) = self.bus_gbs
            && !(bus.is_finite() && bus > 0.0)
        {
            return Err(PlanInputError::new(
                "bus_gbs",
                format!(" {bus} must be a positive number"),
            ));
        }
        let link = self.bus_gbs.map_or_else(
            || Interconnect::for_gpu(&profile.name),
            |bus_gbs| Interconnect { bus_gbs },
        );
        if let Some(g) = self.global_batch
            && (g == 0 || g % world != 0)
        {
            return Err(PlanInputError::new(
                "global_batch",
                format!(" {g} must be a positive multiple of the world size ({world})"),
            ));
        }
        let space = Space {
            strategies,
            precisions,
            checkpointing,
            global_batch: self.global_batch,
        };
        Ok((space, link, world))
    }
}

/// `strategies` over `world` ranks (all five where none are listed).
fn named_strategies(names: &[String], world: u32) -> Result<Vec<Option<Strategy>>, PlanInputError> {
    let all = ["ddp", "fsdp", "zero1", "zero2", "zero3"];
    let names: Vec<&str> = if names.is_empty() {
        all.to_vec()
    } else {
        names.iter().map(String::as_str).collect()
    };
    let refused = |rest: String| PlanInputError::new("strategies", rest);
    names
        .into_iter()
        .map(
            |n| match gpumem_core::job::StrategyValues::named(n, world) {
                Some(named) if all.contains(&n) => Strategy::try_from(named)
                    .map(Some)
                    .map_err(|e| refused(format!(": {e}"))),
                _ => Err(refused(format!(
                    ": `{n}` is not ddp, fsdp, zero1, zero2 or zero3"
                ))),
            },
        )
        .collect()
}

impl Setup {
    /// The setup as `gpumem plan --json` lists it.
    pub fn to_json(&self) -> serde_json::Value {
        let mib = gpumem_core::units::mib;
        serde_json::json!({
            "strategy": self.strategy.map(|s| s.name()), "world_size": self.strategy.map(|s| s.world_size()),
            "precision": self.precision.name(), "checkpointing": self.checkpointing.name(), "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
            "peak_mib": mib(self.estimate.peak_bytes), "upper_bound_mib": mib(self.estimate.upper_bound_bytes),
            "step_s": self.step_s, "comm_s": self.comm_s,
            "samples_per_s": if self.step_s > 0.0 { self.micro_batch as f64 / self.step_s } else { 0.0 },
        })
    }
}

impl Plan {
    /// `gpumem plan --json`: the plan of `model` on `profile` for a job of `world` ranks.
    pub fn to_json(
        &self,
        model: &str,
        profile: &GpuProfile,
        space: &Space,
        world: u64,
        link: Interconnect,
    ) -> serde_json::Value {
        serde_json::json!({
            "model": model, "gpu": profile.name, "capacity_mib": profile.capacity_mib, "global_batch": space.global_batch, "world_size": world, "bus_gbs": link.bus_gbs,
            "setups": self.fits.iter().map(Setup::to_json).collect::<Vec<_>>(),
            "too_big": self.too_big.iter().map(Setup::to_json).collect::<Vec<_>>(),
            "skipped": self.skipped.iter().map(|s| serde_json::json!({"strategy": s.strategy.map(|s| s.name()), "precision": s.precision.name(), "checkpointing": s.checkpointing.name(), "reason": s.reason.to_string()})).collect::<Vec<_>>(),
        })
    }
}
