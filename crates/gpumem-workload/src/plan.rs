//! The fastest setup of a job that fits its GPUs: multi-GPU strategy (data parallelism, and
//! FSDP over meshes with tensor, pipeline, context and expert parallelism) × precision ×
//! activation checkpointing × micro-batch (× gradient accumulation to a global batch), each
//! sized by its upper bound on every rank (every pipeline stage's) and timed by the physical
//! model plus the strategy's collectives ([`Interconnect`]) and a pipeline's bubble. One
//! batch-symbolic trace per (strategy, precision, checkpointing) and rank answers every
//! micro-batch, so a PyTorch model is traced a handful of times, not once per point, and those
//! traces run side by side, one tracer process per core.

use gpumem_core::estimate::{Estimate, Estimator};
use gpumem_core::job::{Engine, Mesh, MeshDim, Precision, ZeroStage};
use gpumem_core::profile::GpuProfile;
use gpumem_core::trace::Trace;
use gpumem_core::utilization::{HostModel, compute_floor_s, physical, step_ops};

use crate::{Checkpointing, Readings, SizeError, Strategy, Workload, WorkloadError, side_by_side};

/// Setups whose time per sample is this close to the fastest's count as as fast.
pub const TIE: f64 = 0.01;

/// What to search.
#[derive(Debug, Clone)]
pub struct Space {
    /// Multi-GPU strategies (`None`: one GPU, or the base job's own strategy).
    pub strategies: Vec<Option<Strategy>>,
    /// FSDP over meshes with model parallelism (tensor, pipeline, context, expert ranks).
    pub meshes: Vec<Strategy>,
    /// Whether every mesh is searched, or (the default search) only as far as a rank needs:
    /// see [`plan`].
    pub every_mesh: bool,
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
    /// keeps them) and reduce-scatter the gradients (once per step under FSDP's `no_sync`).
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
            // A mixed-precision policy gathers in its 16-bit dtype and reduces in fp32. FSDP
            // shards a rank's part of the model (its tensor shards, its stage's layers) over
            // the shard and context ranks, gathering and reduce-scattering within them; HSDP
            // then all-reduces its shard across the R replica groups (counted at the same
            // bandwidth). Tensor, context and expert parallelism's own collectives are the
            // trace's ([`traced_collective_bytes`]).
            Engine::Fsdp {
                reshard_after_forward,
                param_dtype,
                sync_each_batch,
                ..
            } => {
                let mesh = strategy.mesh();
                let degree = |d| f64::from(mesh.degree(d));
                let (gathered, reduced) = if param_dtype.is_some() {
                    (2.0, 4.0)
                } else {
                    (word, word)
                };
                let gathers = if reshard_after_forward { 2.0 } else { 1.0 };
                let part =
                    parameters as f64 / (degree(MeshDim::Tensor) * degree(MeshDim::Pipeline));
                let group = degree(MeshDim::Shard) * degree(MeshDim::Context);
                let r = degree(MeshDim::Replicate);
                let within = (group - 1.0) / group;
                let across = 2.0 * (r - 1.0) / r * reduced / group;
                // Under `no_sync` the gradients are reduced once per step, not per micro-batch.
                let per_step = if sync_each_batch {
                    1.0
                } else {
                    grad_accum.max(1) as f64
                };
                part * (within * (gathers * gathered + reduced / per_step) + across / per_step)
            }
        };
        moved / (self.bus_gbs.max(1e-3) * 1e9)
    }
}

/// Bytes one rank moves per step in the collectives its trace records as functional
/// collectives: DTensor's redistributions under tensor parallelism, ring attention's gathered
/// keys and values, the experts' all-to-all dispatch and combine (FSDP's own c10d calls are
/// [`Interconnect::comm_s`]'s, from the parameters). A ring moves at most an all-gather's output,
/// a reduce-scatter's or an all-to-all's input, and twice an all-reduce's per rank.
fn traced_collective_bytes(trace: &Trace) -> f64 {
    let moved: u64 = step_ops(trace)
        .map(|(name, _, read, written)| match name {
            "all_gather_into_tensor" => written,
            "reduce_scatter_tensor" | "all_to_all_single" => read,
            "all_reduce" => 2 * read,
            _ => 0,
        })
        .sum();
    moved as f64 / f64::from(trace.header.iterations.max(1))
}

/// How much longer a pipeline's step takes than its stage's work: its bubble, (S − 1) idle
/// micro-batch slots over S stages and M micro-batches, shrunk by the V chunks per rank of the
/// interleaved schedules; none for zero bubble (its weights' backwards fill it).
fn bubble(strategy: Option<Strategy>) -> f64 {
    let Some((stages, pipeline)) =
        strategy.and_then(|s| Some((s.mesh().degree(MeshDim::Pipeline), s.pipeline()?)))
    else {
        return 1.0;
    };
    if pipeline.schedule() == gpumem_core::job::Schedule::ZeroBubble {
        return 1.0;
    }
    1.0 + f64::from(stages - 1) / f64::from(pipeline.virtual_stages() * pipeline.microbatches())
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
    /// Seconds per micro-batch step: forward, backward and optimizer by the physical model
    /// (the slowest pipeline stage's, with the bubble), plus `comm_s`.
    pub step_s: f64,
    /// Of `step_s`, the strategy's collectives.
    pub comm_s: f64,
    /// The least `step_s` could be: its slowest rank's arithmetic at the GPU's peak
    /// ([`compute_floor_s`]).
    pub floor_s: f64,
}

impl Setup {
    /// Seconds of one rank per sample: what ranks setups (for a fixed global batch, the time
    /// of its step over the rank's share of the batch; the optimizer's step is counted once
    /// per micro-batch, a small overestimate for many accumulation steps). A rank of a mesh
    /// shares each of its samples with its tensor, pipeline and context ranks.
    pub fn seconds_per_sample(&self) -> f64 {
        let sharing = self.strategy.map_or(1, |s| s.mesh().model_parallel());
        self.step_s * f64::from(sharing) / self.micro_batch as f64
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
    /// The rank's share of the global batch is not a whole number of the pipeline's
    /// micro-batches.
    #[error(
        "a rank's {share} samples of the global batch do not split into the pipeline's {unit} micro-batches"
    )]
    Unit { share: u64, unit: u64 },
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

/// The batch-symbolic traces of `base`'s model under `options`, one per rank that differs (a
/// pipeline's stages), and the batch unit (a pipeline's micro-batches); `Ok(Err(why))` for a
/// setup the model cannot take (its options; the tracer's refusal: no blocks to checkpoint or
/// shard, a precision the families refuse, FSDP2 on an old torch), which the plan skips; the
/// tracer missing altogether is an error.
///
/// A pipeline fits only where each of its stages does, and a stage's memory grows with the
/// micro-batch: its first stage (under 1F1B the one with the most micro-batches in flight) is
/// traced alone first, and where even one micro-batch of it does not fit, the other stages are
/// not traced — the setup is too big, sized by that stage alone.
fn setup_trace(
    base: &Workload,
    options: Result<crate::Options, crate::OptionError>,
    profile: &GpuProfile,
    estimator: &dyn Estimator,
) -> Result<Result<(Readings, u64), SkipReason>, SizeError> {
    let refused = |e: WorkloadError| {
        if e.is_input() || matches!(&e, WorkloadError::Tracer(b) if b.is_model_failure()) {
            Ok(Err(SkipReason::Refused(e)))
        } else {
            Err(SizeError::from(e))
        }
    };
    let job = match options
        .map_err(WorkloadError::from)
        .and_then(|o| Workload::new(base.model().clone(), 1, o))
    {
        Ok(job) => job,
        Err(e) => return refused(e),
    };
    let unit = job.options().batch_unit();
    if job
        .options()
        .strategy
        .is_some_and(|s| s.pipeline().is_some())
    {
        let first = match job.stage_readings(profile, |stage| stage == 0) {
            Ok(r) => r,
            Err(e) => return refused(e),
        };
        if first.largest_fitting(profile, estimator)?.is_none() {
            return Ok(Ok((first, unit)));
        }
        return match job.stage_readings(profile, |stage| stage != 0) {
            Ok(rest) => Ok(Ok((first.join(rest), unit))),
            Err(e) => refused(e),
        };
    }
    match job.readings(profile) {
        Ok(r) => Ok(Ok((r, unit))),
        Err(e) => refused(e),
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

/// A setup: its strategy, precision and activation checkpointing.
type Key = (Option<Strategy>, Precision, Checkpointing);

/// A setup's micro-batches sized, or why it was not planned.
type Sized = Result<Result<MicroBatches, SkipReason>, SizeError>;

/// Sizes and times the micro-batches of one setup from its ranks' batch-symbolic traces;
/// `unit`: the batch's (a pipeline's micro-batches), which every micro-batch is a multiple of.
fn size(
    (readings, unit): &(Readings, u64),
    (strategy, precision, checkpointing): Key,
    profile: &GpuProfile,
    estimator: &dyn Estimator,
    space: &Space,
    link: Interconnect,
) -> Sized {
    let host = HostModel::default();
    let unit = *unit;
    let mut sized = MicroBatches {
        trainable: readings.trainable_parameters(),
        fits: Vec::new(),
        too_big: Vec::new(),
    };
    let data_parallel = u64::from(strategy.map_or(1, |s| s.mesh().data_parallel()));
    let rank_batch = space.global_batch.map(|g| g / data_parallel);
    if let Some(share) = rank_batch.filter(|b| b % unit != 0) {
        return Ok(Err(SkipReason::Unit { share, unit }));
    }
    let setup = |micro_batch, grad_accum, estimate, traces: &[Trace]| {
        // The slowest rank sets the pace; a pipeline's ranks also wait out its bubble.
        let traced = traces
            .iter()
            .map(|t| {
                (
                    physical(t, profile, &host).step_s * bubble(strategy),
                    traced_collective_bytes(t) / (link.bus_gbs.max(1e-3) * 1e9),
                )
            })
            .max_by(|a, b| (a.0 + a.1).total_cmp(&(b.0 + b.1)))
            .unwrap_or_default();
        let parameters = traces
            .first()
            .and_then(|t| t.header.parameters)
            .unwrap_or(0);
        let comm_s = link.comm_s(strategy, parameters, precision, grad_accum) + traced.1;
        let floor_s = traces
            .iter()
            .map(|t| compute_floor_s(t, profile))
            .fold(0.0, f64::max);
        Setup {
            strategy,
            precision,
            checkpointing,
            micro_batch,
            grad_accum,
            estimate,
            step_s: traced.0 + comm_s,
            comm_s,
            floor_s,
        }
    };
    let Some(max) = readings.largest_fitting(profile, estimator)? else {
        let (estimate, traces) = readings.at(unit, profile, estimator)?;
        let accum = rank_batch.map_or(1, |b| b / unit);
        sized.too_big.push(setup(unit, accum, estimate, &traces));
        return Ok(Ok(sized));
    };
    for m in micro_batches(rank_batch.map(|b| b / unit), max / unit) {
        let m = m * unit;
        let (estimate, traces) = readings.at(m, profile, estimator)?;
        let s = setup(m, rank_batch.map_or(1, |g| g / m), estimate, &traces);
        if m > max {
            sized.too_big.push(s);
        } else {
            sized.fits.push(s);
        }
    }
    Ok(Ok(sized))
}

/// What the search has learnt of a precision and checkpointing: whether a setup of theirs
/// already fits a rank's whole share of the global batch in one micro-batch (without a global
/// batch: fits at all), and the least arithmetic of a sample at the GPU's peak on their
/// data-parallel setups' traces (infinite before one is traced). No mesh splits that
/// arithmetic into less (tensor and context ranks share it, stages divide it), so it floors
/// every mesh's time per sample — up to the optimizer's share of it, counted per sample at the
/// micro-batch traced.
fn learnt(
    plan: &Plan,
    space: &Space,
    (precision, checkpointing): (Precision, Checkpointing),
) -> (bool, f64) {
    let mine = |s: &&Setup| s.precision == precision && s.checkpointing == checkpointing;
    let settled = plan
        .fits
        .iter()
        .filter(mine)
        .any(|s| space.global_batch.is_none() || s.grad_accum == 1);
    let arithmetic = plan
        .fits
        .iter()
        .chain(&plan.too_big)
        .filter(mine)
        .filter(|s| s.strategy.is_none_or(|s| s.mesh().model_parallel() == 1))
        .map(|s| s.floor_s / s.micro_batch as f64)
        .fold(f64::INFINITY, f64::min);
    (settled, arithmetic)
}

/// The least time per sample `mesh` could take at `precision`, a sample's arithmetic taking
/// `arithmetic`: that arithmetic with the pipeline's bubble, and FSDP's collectives over the
/// rank's whole share in one micro-batch (known from the parameters before a trace).
fn mesh_floor(
    mesh: Strategy,
    precision: Precision,
    arithmetic: f64,
    parameters: u64,
    space: &Space,
    link: Interconnect,
) -> f64 {
    let share = space
        .global_batch
        .map(|g| g / u64::from(mesh.mesh().data_parallel()));
    let comm = share.map_or(0.0, |b| {
        link.comm_s(Some(mesh), parameters, precision, 1) * f64::from(mesh.mesh().model_parallel())
            / b as f64
    });
    arithmetic * bubble(Some(mesh)) + comm
}

/// Plans `base` (its model and fixed options; its strategy where `space` lists none, and its
/// precision, checkpointing and batch are searched) on `profile`, every rank's GPU.
/// `traced(done, of)` hears how many of the `of` (strategy, precision, checkpointing) setups
/// are traced (the cold part: a tracer run each per rank that differs), first with none.
///
/// The meshes of model parallelism are searched after data parallelism, level by level — by
/// the ranks that share a sample, 2, 4, 8, … — and, unless `space.every_mesh`, for a precision
/// and checkpointing only up to one level past the first at which one of their setups fits,
/// and not past one that fits a rank's whole share in one micro-batch: more model parallelism
/// adds collectives and bubbles to the same arithmetic, and pays only where it lets a rank
/// take a larger micro-batch, which the next level shows. Within a level a mesh is traced only
/// where its floor ([`mesh_floor`]) beats the fastest setup found, and a pipeline's other
/// stages only where its first fits ([`setup_trace`]).
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
    let mut kinds = Vec::new();
    for &precision in &space.precisions {
        for &checkpointing in &space.checkpointing {
            kinds.push((precision, checkpointing));
        }
    }
    let pairs: Vec<Key> = strategies
        .iter()
        .flat_map(|&s| kinds.iter().map(move |&(p, c)| (s, p, c)))
        .collect();
    // Each setup's traces are tracer processes of their own (Python, one core each): side by
    // side, each sized as soon as it is traced, beside the traces still running.
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
    let trace_each = |pairs: &[Key]| {
        let sized = side_by_side(pairs, |&(strategy, precision, checkpointing)| -> Sized {
            let readings = setup_trace(
                base,
                options(strategy, precision, checkpointing),
                profile,
                estimator,
            );
            traced(done.fetch_add(1, Relaxed) + 1, of.load(Relaxed));
            match readings? {
                Ok(r) => size(
                    &r,
                    (strategy, precision, checkpointing),
                    profile,
                    estimator,
                    space,
                    link,
                ),
                Err(reason) => Ok(Err(reason)),
            }
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
    out.add(setups)?;
    let mut levels: Vec<u32> = space
        .meshes
        .iter()
        .map(|s| s.mesh().model_parallel())
        .collect();
    levels.sort_unstable();
    levels.dedup();
    // Within a level, the precisions and checkpointing of least arithmetic first: once one
    // fits, the others may no longer be worth a mesh.
    kinds.sort_by(|&a, &b| {
        learnt(&out, space, a)
            .1
            .total_cmp(&learnt(&out, space, b).1)
    });
    let parameters = trainable.unwrap_or(0);
    // The level (0: data parallelism) at which each precision and checkpointing first fit.
    let fit_at = |out: &Plan, k: (Precision, Checkpointing)| {
        out.fits.iter().any(|s| (s.precision, s.checkpointing) == k)
    };
    let mut first_fit: Vec<Option<usize>> = kinds
        .iter()
        .map(|&k| fit_at(&out, k).then_some(0))
        .collect();
    for (level, n) in levels.into_iter().enumerate().map(|(i, n)| (i + 1, n)) {
        for (i, &(precision, checkpointing)) in kinds.iter().enumerate() {
            let (settled, arithmetic) = learnt(&out, space, (precision, checkpointing));
            let searched =
                space.every_mesh || !settled && first_fit[i].is_none_or(|first| level <= first + 1);
            let fastest = out
                .fits
                .iter()
                .map(Setup::seconds_per_sample)
                .fold(f64::INFINITY, f64::min);
            let meshes: Vec<Key> = space
                .meshes
                .iter()
                .filter(|s| searched && s.mesh().model_parallel() == n)
                .filter(|&&s| {
                    space.every_mesh
                        || arithmetic.is_infinite()
                        || mesh_floor(s, precision, arithmetic, parameters, space, link) < fastest
                })
                .map(|&s| (Some(s), precision, checkpointing))
                .collect();
            of.fetch_add(meshes.len(), Relaxed);
            out.add(trace_each(&meshes))?;
            if first_fit[i].is_none() && fit_at(&out, (precision, checkpointing)) {
                first_fit[i] = Some(level);
            }
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

impl Plan {
    /// Adds sized setups: those that fit, those too big, and the skipped with why.
    fn add(&mut self, setups: Vec<(Key, Sized)>) -> Result<(), SizeError> {
        for ((strategy, precision, checkpointing), sized) in setups {
            match sized? {
                Ok(sized) => {
                    self.fits.extend(sized.fits);
                    self.too_big.extend(sized.too_big);
                }
                Err(reason) => self.skipped.push(Skipped {
                    strategy,
                    precision,
                    checkpointing,
                    reason,
                }),
            }
        }
        Ok(())
    }
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
        // FSDP on a mesh gathers and reduces a rank's tensor shard within its 4 shard ranks:
        // 1 GB of its 2 GB, 3/4 of it twice gathered and once reduced; tensor parallelism alone
        // leaves the collectives to its trace.
        let fsdp = Strategy::fsdp(8, 1, true, None, false).unwrap().engine();
        let mesh =
            |dims: &[(MeshDim, u32)]| Some(Strategy::new(Mesh::new(dims).unwrap(), fsdp).unwrap());
        let on = mesh(&[(MeshDim::Shard, 4), (MeshDim::Tensor, 2)]);
        assert!((link.comm_s(on, p, Precision::Bf16, 1) - 0.0225).abs() < 1e-12);
        assert_eq!(
            link.comm_s(mesh(&[(MeshDim::Tensor, 2)]), p, Precision::Bf16, 1),
            0.0
        );
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
    fn meshes_of_model_parallelism_divide_the_gpus() {
        let h100 = builtin("h100-80gb-sxm").unwrap();
        let base = Workload::parse(
            "hf:LlamaForCausalLM(hidden_size=64)",
            1,
            crate::Options::default(),
        )
        .unwrap();
        let request = |r: PlanRequest| {
            r.space(&base, &h100)
                .map(|(space, ..)| {
                    let mut meshes: Vec<String> =
                        space.meshes.iter().map(|s| s.mesh().label()).collect();
                    meshes.sort();
                    (meshes, space.every_mesh)
                })
                .map_err(|e| e.as_flag())
        };
        let gpus = |n| PlanRequest {
            gpus: Some(n),
            ..PlanRequest::default()
        };
        // The defaults on 8 GPUs: TP 1–8 × PP 1–8 whose ranks divide 8, FSDP over the rest;
        // no context parallelism on short sequences, no expert parallelism.
        let (meshes, every) = request(gpus(8)).unwrap();
        assert!(!every);
        assert_eq!(meshes.len(), 9, "{meshes:?}");
        for m in [
            "shard 4 × tensor 2",
            "tensor 8",
            "tensor 2 × pipeline 4",
            "pipeline 8",
        ] {
            assert!(meshes.contains(&m.to_string()), "{m}: {meshes:?}");
        }
        // Tensor parallelism stays within a machine.
        let (meshes, _) = request(PlanRequest {
            gpus_per_node: Some(2),
            ..gpus(8)
        })
        .unwrap();
        assert!(
            meshes
                .iter()
                .all(|m| !m.contains("tensor 4") && !m.contains("tensor 8"))
        );
        // Listed degrees: every mesh of them, searched whole.
        let (meshes, every) = request(PlanRequest {
            tp: vec![2],
            pp: vec![1, 2],
            cp: vec![1, 2],
            ..gpus(8)
        })
        .unwrap();
        assert!(every);
        assert_eq!(
            meshes,
            [
                "shard 2 × tensor 2 × context 2",
                "shard 2 × tensor 2 × pipeline 2",
                "shard 4 × tensor 2",
                "tensor 2 × pipeline 2 × context 2"
            ]
        );
        // Data parallelism alone where FSDP is not searched; degrees need GPUs and FSDP.
        let ddp = PlanRequest {
            strategies: vec!["ddp".into()],
            ..gpus(8)
        };
        assert_eq!(request(ddp.clone()).unwrap().0.len(), 0);
        for (bad, says) in [
            (
                PlanRequest { tp: vec![2], ..ddp },
                "--tp and the other mesh degrees search FSDP's meshes",
            ),
            (
                PlanRequest {
                    tp: vec![16],
                    ..gpus(16)
                },
                "--tp 16 spans machines of 8 GPUs",
            ),
            (
                PlanRequest {
                    pp: vec![3],
                    ..gpus(8)
                },
                "--tp and the other degrees listed make no mesh of 8 GPUs",
            ),
        ] {
            let e = request(bad).unwrap_err();
            assert!(e.starts_with(says), "{e}");
        }
    }

    #[test]
    fn a_pipeline_waits_out_its_bubble() {
        use gpumem_core::job::{Pipeline, Schedule};
        let mesh = |stages| {
            Strategy::new(
                Mesh::new(&[(MeshDim::Pipeline, stages)]).unwrap(),
                Strategy::fsdp(2, 1, true, None, false).unwrap().engine(),
            )
            .unwrap()
        };
        assert_eq!(bubble(None), 1.0);
        // 1F1B over 4 stages and as many micro-batches: 3 idle slots to 4 busy.
        assert_eq!(bubble(Some(mesh(4))), 1.75);
        let with = |schedule, m, v| {
            mesh(4)
                .with_pipeline(Pipeline::new(schedule, m, v).unwrap())
                .unwrap()
        };
        assert_eq!(bubble(Some(with(Schedule::Gpipe, 12, 1))), 1.25);
        assert_eq!(
            bubble(Some(with(Schedule::Interleaved, 12, 3))),
            1.0 + 3.0 / 36.0
        );
        assert_eq!(bubble(Some(with(Schedule::ZeroBubble, 12, 2))), 1.0);
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
            meshes: Vec::new(),
            every_mesh: false,
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
    /// With `gpus` and FSDP among the strategies: the degrees of tensor, pipeline, context
    /// and expert parallelism to search FSDP's meshes over (empty: the defaults, see
    /// [`PlanRequest::meshes`]). Listing any searches every mesh of them.
    pub tp: Vec<u32>,
    pub pp: Vec<u32>,
    pub cp: Vec<u32>,
    pub ep: Vec<u32>,
    /// GPUs per machine: tensor parallelism stays within one (`None`: 8).
    pub gpus_per_node: Option<u32>,
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
        let fsdp = strategies
            .iter()
            .any(|s| s.is_some_and(|s| matches!(s.engine(), Engine::Fsdp { .. })));
        let listed = listed_any(self);
        let meshes = match self.gpus {
            Some(n) if n > 1 && fsdp => self.meshes(n, base.options().seq_len)?,
            _ if listed || self.gpus_per_node.is_some() => {
                return Err(PlanInputError::new(
                    if listed { "tp" } else { "gpus_per_node" },
                    " and the other mesh degrees search FSDP's meshes: they need gpus (more than one) and fsdp among the strategies",
                ));
            }
            _ => Vec::new(),
        };
        let space = Space {
            strategies,
            meshes,
            every_mesh: listed,
            precisions,
            checkpointing,
            global_batch: self.global_batch,
        };
        Ok((space, link, world))
    }

    /// FSDP's meshes over `gpus` GPUs with model parallelism: every combination of the listed
    /// degrees (where listed; a combination FSDP's mesh refuses is an error) or of the defaults —
    /// tensor parallelism in powers of two up to a machine's GPUs, pipelines of 2, 4 and 8
    /// stages, context parallelism in powers of two up to 8 from sequences of 16,384 tokens
    /// (below, none), no expert parallelism — whose ranks divide the GPUs (the defaults'
    /// invalid combinations left out). FSDP shards over the rest; each pipeline runs 1F1B over
    /// as many micro-batches as stages (torchtitan's default).
    fn meshes(&self, gpus: u32, seq_len: Option<u64>) -> Result<Vec<Strategy>, PlanInputError> {
        let per_node = self.gpus_per_node.unwrap_or(8);
        if per_node == 0 {
            return Err(PlanInputError::new("gpus_per_node", " must be at least 1"));
        }
        let powers = |most: u32| -> Vec<u32> {
            std::iter::successors(Some(1u32), |d| d.checked_mul(2))
                .take_while(|&d| d <= most)
                .collect()
        };
        let long = seq_len.is_some_and(|s| s >= 16_384);
        let degrees = |listed: &Vec<u32>, default: Vec<u32>| {
            if listed.is_empty() {
                default
            } else {
                listed.clone()
            }
        };
        let tp = degrees(&self.tp, powers(per_node.min(8)));
        let pp = degrees(&self.pp, powers(8));
        let cp = degrees(&self.cp, if long { powers(8) } else { vec![1] });
        let ep = degrees(&self.ep, vec![1]);
        let fsdp = Strategy::try_from(planned("fsdp", gpus).expect("fsdp is a strategy"))
            .map_err(|e| PlanInputError::new("gpus", format!(": {e}")))?
            .engine();
        if let Some(t) = tp.iter().find(|&&t| t > per_node) {
            return Err(PlanInputError::new(
                "tp",
                format!(" {t} spans machines of {per_node} GPUs (gpus_per_node)"),
            ));
        }
        let mut combinations = Vec::new();
        for &t in &tp {
            for &p in &pp {
                for &c in &cp {
                    combinations.extend(ep.iter().map(|&e| (t, p, c, e)));
                }
            }
        }
        let mut out = Vec::new();
        for (t, p, c, e) in combinations {
            let group = t.saturating_mul(p).saturating_mul(c);
            if group == 1 && e == 1 {
                continue; // FSDP alone: a strategy of its own
            }
            if group == 0 || !gpus.is_multiple_of(group) {
                continue; // not a mesh of these GPUs
            }
            let mesh = Mesh::new(&[
                (MeshDim::Shard, gpus / group),
                (MeshDim::Tensor, t),
                (MeshDim::Pipeline, p),
                (MeshDim::Context, c),
                (MeshDim::Expert, e),
            ]);
            match mesh.and_then(|m| Strategy::new(m, fsdp)) {
                Ok(s) => out.push(s),
                Err(_) if !listed_any(self) => {}
                Err(err) => {
                    return Err(PlanInputError::new(
                        "tp",
                        format!(" {t} × pp {p} × cp {c} × ep {e}: {err}"),
                    ));
                }
            }
        }
        if out.is_empty() && listed_any(self) {
            return Err(PlanInputError::new(
                "tp",
                format!(" and the other degrees listed make no mesh of {gpus} GPUs"),
            ));
        }
        Ok(out)
    }
}

/// Whether a request lists any mesh degree.
fn listed_any(r: &PlanRequest) -> bool {
    [&r.tp, &r.pp, &r.cp, &r.ep].iter().any(|d| !d.is_empty())
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
        .map(|n| match planned(n, world) {
            Some(named) if all.contains(&n) => Strategy::try_from(named)
                .map(Some)
                .map_err(|e| refused(format!(": {e}"))),
            _ => Err(refused(format!(
                ": `{n}` is not ddp, fsdp, zero1, zero2 or zero3"
            ))),
        })
        .collect()
}

/// The strategy `name` as the plan sets it up over `world` ranks: the engine's defaults, but
/// FSDP reduces each micro-batch's gradients (`sync_each_batch`), since a setup is sized by one
/// micro-batch's trace and its accumulation then costs no memory.
fn planned(name: &str, world: u32) -> Option<gpumem_core::job::StrategyValues> {
    let named = gpumem_core::job::StrategyValues::named(name, world)?;
    Some(gpumem_core::job::StrategyValues {
        sync_each_batch: (named.kind == gpumem_core::job::EngineKind::Fsdp).then_some(true),
        ..named
    })
}

/// A strategy's mesh as `gpumem plan --json` lists it: its dimensions above degree 1.
fn mesh_json(strategy: Option<Strategy>) -> serde_json::Value {
    strategy.map_or(serde_json::Value::Null, |s| {
        MeshDim::ALL
            .into_iter()
            .filter(|&d| s.mesh().degree(d) > 1)
            .map(|d| (d.name().to_string(), serde_json::json!(s.mesh().degree(d))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    })
}

impl Setup {
    /// The setup as `gpumem plan --json` lists it.
    pub fn to_json(&self) -> serde_json::Value {
        let mib = gpumem_core::units::mib;
        let pipeline = self.strategy.and_then(|s| s.pipeline()).map(|p| {
            serde_json::json!({"schedule": p.schedule().name(), "microbatches": p.microbatches()})
        });
        serde_json::json!({
            "strategy": self.strategy.map(|s| s.name()), "world_size": self.strategy.map(|s| s.world_size()),
            "mesh": mesh_json(self.strategy), "pipeline": pipeline,
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
            "skipped": self.skipped.iter().map(|s| serde_json::json!({"strategy": s.strategy.map(|s| s.name()), "mesh": mesh_json(s.strategy), "precision": s.precision.name(), "checkpointing": s.checkpointing.name(), "reason": s.reason.to_string()})).collect::<Vec<_>>(),
        })
    }
}
