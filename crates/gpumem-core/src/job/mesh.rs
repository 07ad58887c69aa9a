//! A multi-GPU job's ranks as a device mesh (named dimensions and their degrees), and the
//! data-parallel engine that wraps the model over them. Later kinds of parallelism add
//! dimensions to [`Mesh`], not new strategy types.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::OptionError;

/// The most ranks a strategy is traced for.
pub const MAX_WORLD_SIZE: u32 = 1 << 16;

/// `DistributedDataParallel`'s default `bucket_cap_mb`.
pub const DDP_BUCKET_CAP_MB: u32 = 25;

/// A dimension of a device mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MeshDim {
    /// Data parallel, each rank a whole replica of the model states (DDP; HSDP's groups).
    Replicate,
    /// Data parallel, the model states sharded over the ranks (FSDP, ZeRO).
    Shard,
    /// Tensor parallel: each layer's weights split over the ranks (PyTorch's DTensor plans,
    /// with sequence parallelism between layers), under FSDP's engine.
    Tensor,
    /// Pipeline parallel: consecutive layers on each rank, micro-batches through them in a
    /// [`Schedule`]'s order.
    Pipeline,
    /// Context parallel: each rank its chunks of the sequence (head-tail balanced), attention
    /// over the whole sequence by ring attention (the other ranks' keys and values gathered),
    /// under FSDP's engine, whose shard ranks it joins (torchtitan's `dp_shard_cp`).
    Context,
    /// Expert parallel: a mixture-of-experts model's routed experts split over the ranks, the
    /// tokens sent to their experts and back by all-to-all. Its ranks are borrowed from the
    /// shard and tensor dimensions (torchtitan's and Megatron's way), not added to them.
    Expert,
}

impl MeshDim {
    pub const ALL: [MeshDim; 6] = [
        MeshDim::Replicate,
        MeshDim::Shard,
        MeshDim::Tensor,
        MeshDim::Pipeline,
        MeshDim::Context,
        MeshDim::Expert,
    ];

    /// As a job document spells it (`strategy.mesh.tensor`).
    pub fn name(self) -> &'static str {
        match self {
            MeshDim::Replicate => "replicate",
            MeshDim::Shard => "shard",
            MeshDim::Tensor => "tensor",
            MeshDim::Pipeline => "pipeline",
            MeshDim::Context => "context",
            MeshDim::Expert => "expert",
        }
    }
}

/// The ranks of a job as a mesh: the degree of each dimension (1 where the job does not split
/// along it). Invariant: every degree is at least 1 and their product but the expert
/// dimension's (which borrows its ranks), the world size, is at most [`MAX_WORLD_SIZE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mesh {
    degrees: [u32; 6],
}

impl Mesh {
    /// A mesh of the given dimensions (the others of degree 1).
    pub fn new(dims: &[(MeshDim, u32)]) -> Result<Mesh, OptionError> {
        let mut degrees = [1u32; 6];
        for &(dim, degree) in dims {
            if degree == 0 {
                return Err(OptionError::MeshDegree(dim.name()));
            }
            degrees[dim as usize] = degree;
        }
        let world: u64 = Mesh::ranks(&degrees).product();
        if world > u64::from(MAX_WORLD_SIZE) || degrees[MeshDim::Expert as usize] > MAX_WORLD_SIZE {
            return Err(OptionError::WorldSize(
                u32::try_from(world).unwrap_or(u32::MAX),
            ));
        }
        Ok(Mesh { degrees })
    }

    /// The mesh of `world_size` ranks as the older spelling (and a person's flags) state it for
    /// `engine`: DDP replicates over them, ZeRO shards over them, FSDP shards within
    /// `replicas` groups (HSDP where more than one).
    pub fn of_ranks(
        engine: EngineKind,
        world_size: u32,
        replicas: u32,
    ) -> Result<Mesh, OptionError> {
        match engine {
            EngineKind::Ddp => Mesh::new(&[(MeshDim::Replicate, world_size)]),
            EngineKind::Zero => Mesh::new(&[(MeshDim::Shard, world_size)]),
            EngineKind::Fsdp => {
                if replicas == 0 || !world_size.is_multiple_of(replicas) {
                    return Err(OptionError::Replicas {
                        replicas,
                        world_size,
                    });
                }
                Mesh::new(&[
                    (MeshDim::Replicate, replicas),
                    (MeshDim::Shard, world_size / replicas),
                ])
            }
        }
    }

    pub fn degree(&self, dim: MeshDim) -> u32 {
        self.degrees[dim as usize]
    }

    /// All ranks: the product of the degrees that add ranks (all but the expert dimension's).
    pub fn world_size(&self) -> u32 {
        Mesh::ranks(&self.degrees).map(|d| d as u32).product()
    }

    /// The ranks that each take samples of their own: the data-parallel ones (replicate ×
    /// shard). Tensor, pipeline and context ranks share their group's samples.
    pub fn data_parallel(&self) -> u32 {
        self.degree(MeshDim::Replicate) * self.degree(MeshDim::Shard)
    }

    /// The ranks FSDP applies over: the replicate, shard and context ones (context parallelism's
    /// ranks shard too, torchtitan's dp_shard_cp). 1: tensor or pipeline parallelism alone.
    pub fn fsdp_ranks(&self) -> u32 {
        self.data_parallel() * self.degree(MeshDim::Context)
    }

    /// The ranks that share each sample: the tensor, pipeline and context ones (world size
    /// over the data-parallel ranks).
    pub fn model_parallel(&self) -> u32 {
        self.world_size() / self.data_parallel()
    }

    /// The dimensions that add ranks, those above degree 1, as a person reads them: `shard 8 ×
    /// tensor 8` (the expert dimension borrows its ranks, so it is said apart).
    pub fn label(&self) -> String {
        MeshDim::ALL
            .into_iter()
            .filter(|&d| self.degree(d) > 1 && d != MeshDim::Expert)
            .map(|d| format!("{} {}", d.name(), self.degree(d)))
            .collect::<Vec<_>>()
            .join(" × ")
    }

    fn ranks(degrees: &[u32; 6]) -> impl Iterator<Item = u64> + '_ {
        MeshDim::ALL
            .into_iter()
            .filter(|&d| d != MeshDim::Expert)
            .map(|d| u64::from(degrees[d as usize]))
    }
}

/// A mesh as a job document states it: `{replicate = 2, shard = 4}` (absent: degree 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MeshValues {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicate: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert: Option<u32>,
}

impl MeshValues {
    fn dims(&self) -> Vec<(MeshDim, u32)> {
        let v = [
            self.replicate,
            self.shard,
            self.tensor,
            self.pipeline,
            self.context,
            self.expert,
        ];
        MeshDim::ALL
            .into_iter()
            .zip(v)
            .filter_map(|(d, n)| Some((d, n?)))
            .collect()
    }
}

impl From<Mesh> for MeshValues {
    fn from(m: Mesh) -> MeshValues {
        let at = |d| Some(m.degree(d)).filter(|&n| n > 1);
        MeshValues {
            replicate: at(MeshDim::Replicate),
            shard: at(MeshDim::Shard),
            tensor: at(MeshDim::Tensor),
            pipeline: at(MeshDim::Pipeline),
            context: at(MeshDim::Context),
            expert: at(MeshDim::Expert),
        }
    }
}

/// Most micro-batches a pipeline schedule is traced with.
pub const MAX_MICROBATCHES: u32 = 4096;

/// A pipeline schedule: the order in which a rank runs its micro-batches' forwards and
/// backwards (PyTorch's schedules of those names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Schedule {
    /// Every forward, then every backward: M micro-batches' activations in flight.
    #[serde(rename = "gpipe")]
    Gpipe,
    /// One backward per forward after a warm-up: min(M, stages − k) in flight on stage k.
    #[serde(rename = "1f1b")]
    OneForwardOneBackward,
    /// 1F1B over several chunks per rank (virtual stages), in PyTorch's order.
    #[serde(rename = "interleaved-1f1b")]
    Interleaved,
    /// Zero bubble: each backward split into its input's gradients (sent on at once) and its
    /// weights' (run later), over one or more chunks per rank, in PyTorch's order
    /// (`ScheduleInterleavedZeroBubble`).
    #[serde(rename = "zero-bubble")]
    ZeroBubble,
}

impl Schedule {
    pub const ALL: [Schedule; 4] = [
        Schedule::Gpipe,
        Schedule::OneForwardOneBackward,
        Schedule::Interleaved,
        Schedule::ZeroBubble,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Schedule::Gpipe => "gpipe",
            Schedule::OneForwardOneBackward => "1f1b",
            Schedule::Interleaved => "interleaved-1f1b",
            Schedule::ZeroBubble => "zero-bubble",
        }
    }

    pub fn parse(name: &str) -> Option<Schedule> {
        Schedule::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// How a pipeline-parallel job steps: its schedule, the micro-batches each rank's batch is
/// split into, and the chunks (virtual stages) each rank holds. Invariant (checked by
/// [`Pipeline::new`]): 1 to [`MAX_MICROBATCHES`] micro-batches; interleaved 1F1B holds at least
/// 2 chunks per rank, zero bubble at least 1, the others exactly 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pipeline {
    schedule: Schedule,
    microbatches: u32,
    virtual_stages: u32,
}

impl Pipeline {
    pub fn new(
        schedule: Schedule,
        microbatches: u32,
        virtual_stages: u32,
    ) -> Result<Pipeline, OptionError> {
        if !(1..=MAX_MICROBATCHES).contains(&microbatches) {
            return Err(OptionError::Microbatches(microbatches));
        }
        let (least, most, needs) = match schedule {
            Schedule::Interleaved => (2, u32::MAX, "at least 2 chunks"),
            Schedule::ZeroBubble => (1, u32::MAX, "at least 1 chunk"),
            Schedule::Gpipe | Schedule::OneForwardOneBackward => (1, 1, "exactly 1 chunk"),
        };
        if !(least..=most).contains(&virtual_stages) {
            return Err(OptionError::VirtualStages {
                schedule: schedule.name(),
                virtual_stages,
                needs,
            });
        }
        Ok(Pipeline {
            schedule,
            microbatches,
            virtual_stages,
        })
    }

    /// 1F1B with as many micro-batches as stages: torchtitan's default.
    fn default_for(stages: u32) -> Pipeline {
        Pipeline {
            schedule: Schedule::OneForwardOneBackward,
            microbatches: stages.min(MAX_MICROBATCHES),
            virtual_stages: 1,
        }
    }

    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    pub fn microbatches(&self) -> u32 {
        self.microbatches
    }

    pub fn virtual_stages(&self) -> u32 {
        self.virtual_stages
    }
}

/// Most a router's imbalance is stated as (the configuration caps what it can mean anyway).
pub const MAX_ROUTING_IMBALANCE: f64 = 1024.0;

/// How unevenly a mixture-of-experts router spreads its tokens, as the upper bound assumes:
/// the traced rank's experts get this many times their even share of the token-expert
/// choices (as far as the choices allow; the tracer's `routing.py`). 1 is balanced, the
/// estimate's stand-in. Invariant: 1 to [`MAX_ROUTING_IMBALANCE`], held in thousandths so that
/// a strategy stays `Eq` and `Hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct RoutingImbalance(u32);

impl RoutingImbalance {
    pub const BALANCED: RoutingImbalance = RoutingImbalance(1000);

    pub fn new(factor: f64) -> Result<RoutingImbalance, OptionError> {
        if !(1.0..=MAX_ROUTING_IMBALANCE).contains(&factor) {
            return Err(OptionError::RoutingImbalance(factor));
        }
        Ok(RoutingImbalance((factor * 1000.0).round() as u32))
    }

    pub fn factor(self) -> f64 {
        f64::from(self.0) / 1000.0
    }
}

impl TryFrom<f64> for RoutingImbalance {
    type Error = OptionError;

    fn try_from(factor: f64) -> Result<RoutingImbalance, OptionError> {
        RoutingImbalance::new(factor)
    }
}

impl From<RoutingImbalance> for f64 {
    fn from(r: RoutingImbalance) -> f64 {
        r.factor()
    }
}

impl JsonSchema for RoutingImbalance {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "RoutingImbalance".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "The traced rank's experts' share of the router's choices, as a multiple of their even share (1: balanced).",
            "type": "number",
            "minimum": 1.0,
            "maximum": MAX_ROUTING_IMBALANCE,
        })
    }
}

/// A 16-bit floating-point dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum HalfDtype {
    Bf16,
    Fp16,
}

impl HalfDtype {
    pub fn name(self) -> &'static str {
        match self {
            HalfDtype::Bf16 => "bf16",
            HalfDtype::Fp16 => "fp16",
        }
    }
}

/// DeepSpeed ZeRO's stage: what it partitions over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ZeroStage {
    /// The optimizer state.
    One,
    /// And the gradients.
    Two,
    /// And the parameters.
    Three,
}

impl ZeroStage {
    pub fn new(stage: u8) -> Result<ZeroStage, OptionError> {
        match stage {
            1 => Ok(ZeroStage::One),
            2 => Ok(ZeroStage::Two),
            3 => Ok(ZeroStage::Three),
            other => Err(OptionError::ZeroStage(other)),
        }
    }

    pub fn number(self) -> u8 {
        match self {
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }
}

/// What of DeepSpeed's `zero_optimization` decides a rank's memory, in DeepSpeed's units
/// (elements) and with its defaults. `overlap_comm: None` is DeepSpeed's own default (on for
/// stage 3 only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Zero {
    pub reduce_bucket_size: u64,
    pub overlap_comm: Option<bool>,
    pub contiguous_gradients: bool,
    pub prefetch_bucket_size: u64,
    pub max_live_parameters: u64,
    pub max_reuse_distance: u64,
    pub param_persistence_threshold: u64,
    /// Master weights, optimizer state and fp32 gradients on the host (`offload_optimizer`).
    pub offload_optimizer: bool,
    /// Stage 3's parameter partitions on the host (`offload_param`).
    pub offload_param: bool,
}

impl Default for Zero {
    fn default() -> Self {
        Zero {
            reduce_bucket_size: 500_000_000,
            overlap_comm: None,
            contiguous_gradients: true,
            prefetch_bucket_size: 50_000_000,
            max_live_parameters: 1_000_000_000,
            max_reuse_distance: 1_000_000_000,
            param_persistence_threshold: 100_000,
            offload_optimizer: false,
            offload_param: false,
        }
    }
}

/// The data-parallel engine that wraps the model (traced with PyTorch's own wrapper on a fake
/// process group; ZeRO modelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Engine {
    /// `DistributedDataParallel`: `bucket_cap_mb` its gradient buckets (MiB, PyTorch's 25),
    /// `bucket_view` its `gradient_as_bucket_view`. Replicates over the whole mesh.
    Ddp {
        bucket_cap_mb: u32,
        bucket_view: bool,
    },
    /// FSDP2 (`fully_shard` on each repeated block, then the model): parameters, gradients and
    /// optimizer state sharded over the mesh's `shard` ranks, each layer's parameters gathered
    /// for its forward and backward; `reshard_after_forward` frees them between the two;
    /// `param_dtype`: `MixedPrecisionPolicy`'s (layers gathered and computed in it, gradients
    /// reduced into fp32 shards); a `replicate` dimension makes it HSDP (replicated across
    /// the groups); `cpu_offload`: `CPUOffloadPolicy` (shards, gradients and the optimizer
    /// step on the host; each layer's shards copied to the GPU for its all-gather);
    /// `sync_each_batch`: under gradient accumulation each micro-batch's gradients are
    /// reduce-scattered as backward makes them (torchtitan, torchtune, Lightning's Trainer,
    /// accelerate's `sync_each_batch=True`), else they accumulate unsharded until the last
    /// micro-batch (FSDP's `no_sync`/`set_requires_gradient_sync(False)`, as accelerate, Hugging
    /// Face's Trainer and Fabric run accumulation): a whole unsharded copy of the gradients.
    /// Invariant ([`Strategy::new`]): false where the mesh has no ranks to shard over.
    Fsdp {
        reshard_after_forward: bool,
        param_dtype: Option<HalfDtype>,
        cpu_offload: bool,
        sync_each_batch: bool,
    },
    /// DeepSpeed ZeRO over the mesh's `shard` ranks, modelled from its config (DeepSpeed need
    /// not be installed).
    Zero { stage: ZeroStage, zero: Zero },
}

impl Engine {
    pub fn kind(&self) -> EngineKind {
        match self {
            Engine::Ddp { .. } => EngineKind::Ddp,
            Engine::Fsdp { .. } => EngineKind::Fsdp,
            Engine::Zero { .. } => EngineKind::Zero,
        }
    }
}

/// Which engine, as a job document names it (`strategy.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Ddp,
    Fsdp,
    Zero,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Ddp => "ddp",
            EngineKind::Fsdp => "fsdp",
            EngineKind::Zero => "zero",
        }
    }
}

/// How a multi-GPU job is laid out: its mesh and its data-parallel engine; the trace is one
/// rank's, the batch that rank's. Invariant (checked by [`Strategy::new`], through which every
/// strategy is made — flags, job files, JSON, trace headers): 2 to [`MAX_WORLD_SIZE`] ranks;
/// the mesh has only the dimensions gpumem models (replicate, shard, tensor); DDP only
/// replicates; FSDP shards (HSDP: at least 2 ranks in each group), and is the engine tensor
/// parallelism composes with — with a tensor dimension its shard dimension may be 1 (tensor
/// parallelism alone: no FSDP applied, as torchtitan applies none at `dp_shard` 1), and then
/// its own settings (CPU offload, a mixed-precision dtype) are refused; ZeRO only shards;
/// DDP's buckets and ZeRO's reduce bucket are not empty; ZeRO offloads parameters only at
/// stage 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "StrategyValues", into = "StrategyValues")]
pub struct Strategy {
    mesh: Mesh,
    engine: Engine,
    /// Present exactly where the mesh has pipeline stages.
    pipeline: Option<Pipeline>,
    /// Present exactly where the mesh has expert-parallel ranks: the upper bound's routing.
    routing: Option<RoutingImbalance>,
    /// Present exactly where the mesh has tensor-parallel ranks: whether sequence parallelism
    /// splits the norms and the stream between layers over the sequence (torchtitan's, and
    /// Megatron-LM's `--sequence-parallel`), else they stay whole on every rank.
    sequence_parallel: Option<bool>,
}

impl Strategy {
    pub fn new(mesh: Mesh, mut engine: Engine) -> Result<Strategy, OptionError> {
        let world_size = mesh.world_size();
        let (replicate, shard) = (mesh.degree(MeshDim::Replicate), mesh.degree(MeshDim::Shard));
        let (tensor, stages) = (mesh.degree(MeshDim::Tensor), mesh.degree(MeshDim::Pipeline));
        let (context, expert) = (mesh.degree(MeshDim::Context), mesh.degree(MeshDim::Expert));
        // How FSDP accumulates is moot where it has no ranks to shard over (tensor or pipeline
        // parallelism alone): held false there, so one mesh is one strategy.
        if let Engine::Fsdp {
            sync_each_batch, ..
        } = &mut engine
            && mesh.fsdp_ranks() == 1
        {
            *sync_each_batch = false;
        }
        // FSDP's engine alone splits a model's layers, sequence or experts.
        let beyond_data = [
            MeshDim::Tensor,
            MeshDim::Pipeline,
            MeshDim::Context,
            MeshDim::Expert,
        ]
        .into_iter()
        .find(|&d| mesh.degree(d) > 1);
        match engine {
            Engine::Ddp { .. } | Engine::Zero { .. } if beyond_data.is_some() => {
                return Err(OptionError::EngineDim {
                    engine: engine.kind().name(),
                    dim: beyond_data.map_or("", MeshDim::name),
                });
            }
            // torchtitan's rule (its ParallelDims, no tensor parallelism inside the experts).
            Engine::Fsdp { .. } if !(shard * context * tensor).is_multiple_of(expert) => {
                return Err(OptionError::ExpertRanks {
                    expert,
                    borrowed: shard * context * tensor,
                });
            }
            Engine::Fsdp {
                param_dtype,
                cpu_offload,
                ..
            } if mesh.fsdp_ranks() == 1 && (param_dtype.is_some() || cpu_offload) => {
                return Err(OptionError::NoShards(if cpu_offload {
                    "cpu_offload"
                } else {
                    "param_dtype"
                }));
            }
            _ => {}
        }
        match engine {
            Engine::Ddp { .. } if shard > 1 => {
                return Err(OptionError::EngineDim {
                    engine: "ddp",
                    dim: "shard",
                });
            }
            Engine::Zero { .. } if replicate > 1 => {
                return Err(OptionError::EngineDim {
                    engine: "zero",
                    dim: "replicate",
                });
            }
            Engine::Fsdp { .. } if replicate > 1 && shard < 2 => {
                return Err(OptionError::Replicas {
                    replicas: replicate,
                    world_size,
                });
            }
            _ => {}
        }
        // DeepSpeed runs ZeRO on one GPU too (its offload and partitioned optimizer there); DDP
        // and FSDP on one rank are no strategy at all.
        let least = if matches!(engine, Engine::Zero { .. }) {
            1
        } else {
            2
        };
        if !(least..=MAX_WORLD_SIZE).contains(&world_size) {
            return Err(OptionError::WorldSize(world_size));
        }
        match engine {
            Engine::Ddp {
                bucket_cap_mb: 0, ..
            } => Err(OptionError::BucketCap),
            Engine::Zero { zero, .. } if zero.reduce_bucket_size == 0 => {
                Err(OptionError::ReduceBucket)
            }
            Engine::Zero { stage, zero } if zero.offload_param && stage != ZeroStage::Three => {
                Err(OptionError::OffloadParam)
            }
            _ => Ok(Strategy {
                mesh,
                engine,
                pipeline: (stages > 1).then(|| Pipeline::default_for(stages)),
                routing: (expert > 1).then_some(RoutingImbalance::BALANCED),
                sequence_parallel: (tensor > 1).then_some(true),
            }),
        }
    }

    /// This strategy bounding its expert-parallel ranks' memory with `routing`'s imbalance;
    /// refused where the mesh has no expert-parallel ranks.
    pub fn with_routing_imbalance(
        self,
        routing: RoutingImbalance,
    ) -> Result<Strategy, OptionError> {
        match self.routing {
            Some(_) => Ok(Strategy {
                routing: Some(routing),
                ..self
            }),
            None => Err(OptionError::NoExperts),
        }
    }

    /// This strategy with sequence parallelism on or off; refused without tensor-parallel
    /// ranks, and off where a pipeline or context parallelism would take the stream split.
    pub fn with_sequence_parallel(self, on: bool) -> Result<Strategy, OptionError> {
        if self.sequence_parallel.is_none() {
            return Err(OptionError::SequenceParallel(
                "applies to tensor parallelism (strategy.mesh.tensor)",
            ));
        }
        if !on && self.pipeline.is_some() {
            return Err(OptionError::SequenceParallel(
                "off is not sized with pipeline stages (their stream is split over the sequence)",
            ));
        }
        if !on && self.context_parallel() > 1 {
            return Err(OptionError::SequenceParallel(
                "off is not sized with context parallelism",
            ));
        }
        Ok(Strategy {
            sequence_parallel: Some(on),
            ..self
        })
    }

    /// Whether sequence parallelism splits the stream, where the mesh has tensor-parallel ranks.
    pub fn sequence_parallel(&self) -> Option<bool> {
        self.sequence_parallel
    }

    /// The router imbalance the upper bound assumes, where the mesh has expert-parallel ranks.
    pub fn routing_imbalance(&self) -> Option<RoutingImbalance> {
        self.routing
    }

    /// The context-parallel ranks (1 where the job has none).
    pub fn context_parallel(&self) -> u32 {
        self.mesh.degree(MeshDim::Context)
    }

    /// The expert-parallel ranks (1 where the job has none).
    pub fn expert_parallel(&self) -> u32 {
        self.mesh.degree(MeshDim::Expert)
    }

    /// This strategy stepping its pipeline stages as `pipeline` says; refused where the mesh
    /// has no pipeline stages.
    pub fn with_pipeline(self, pipeline: Pipeline) -> Result<Strategy, OptionError> {
        match self.pipeline {
            Some(_) => Ok(Strategy {
                pipeline: Some(pipeline),
                ..self
            }),
            None => Err(OptionError::PipelineSetting("schedule")),
        }
    }

    /// The pipeline's stages, schedule and micro-batches, where the mesh has stages.
    pub fn pipeline(&self) -> Option<Pipeline> {
        self.pipeline
    }

    /// DDP over `world_size` ranks.
    pub fn ddp(
        world_size: u32,
        bucket_cap_mb: u32,
        bucket_view: bool,
    ) -> Result<Self, OptionError> {
        let engine = Engine::Ddp {
            bucket_cap_mb,
            bucket_view,
        };
        Strategy::new(Mesh::of_ranks(engine.kind(), world_size, 1)?, engine)
    }

    /// FSDP2 over `world_size` ranks in `replicas` groups (HSDP where more than one).
    pub fn fsdp(
        world_size: u32,
        replicas: u32,
        reshard_after_forward: bool,
        param_dtype: Option<HalfDtype>,
        cpu_offload: bool,
    ) -> Result<Self, OptionError> {
        let engine = Engine::Fsdp {
            reshard_after_forward,
            param_dtype,
            cpu_offload,
            sync_each_batch: false,
        };
        Strategy::new(Mesh::of_ranks(engine.kind(), world_size, replicas)?, engine)
    }

    /// ZeRO at `stage` over `world_size` ranks.
    pub fn zero(stage: ZeroStage, world_size: u32, zero: Zero) -> Result<Self, OptionError> {
        let engine = Engine::Zero { stage, zero };
        Strategy::new(Mesh::of_ranks(engine.kind(), world_size, 1)?, engine)
    }

    pub fn mesh(&self) -> Mesh {
        self.mesh
    }

    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// All ranks (GPUs) of the job.
    pub fn world_size(&self) -> u32 {
        self.mesh.world_size()
    }

    /// FSDP's replica groups (HSDP where more than one); 1 for the others.
    pub fn replicas(&self) -> u32 {
        match self.engine {
            Engine::Fsdp { .. } => self.mesh.degree(MeshDim::Replicate),
            _ => 1,
        }
    }

    /// The tensor-parallel ranks (1 where the job has none).
    pub fn tensor_parallel(&self) -> u32 {
        self.mesh.degree(MeshDim::Tensor)
    }

    /// The name a person uses: `ddp`, `fsdp`, `hsdp`, `zero1`, `zero2`, `zero3`, and `tp` for
    /// tensor parallelism alone (with FSDP it is `fsdp` or `hsdp`; the mesh says the rest).
    pub fn name(&self) -> &'static str {
        // Context parallelism's ranks are FSDP's too: with them, it is FSDP.
        let data_parallel = self.mesh.degree(MeshDim::Replicate)
            * self.mesh.degree(MeshDim::Shard)
            * self.mesh.degree(MeshDim::Context);
        let (tensor, stages) = (
            self.mesh.degree(MeshDim::Tensor) > 1,
            self.mesh.degree(MeshDim::Pipeline) > 1,
        );
        match self.engine {
            Engine::Fsdp { .. } if data_parallel == 1 && stages && tensor => "pp+tp",
            Engine::Fsdp { .. } if data_parallel == 1 && stages => "pp",
            Engine::Fsdp { .. } if data_parallel == 1 => "tp",
            Engine::Ddp { .. } => "ddp",
            Engine::Fsdp { .. } if self.replicas() > 1 => "hsdp",
            Engine::Fsdp { .. } => "fsdp",
            Engine::Zero {
                stage: ZeroStage::One,
                ..
            } => "zero1",
            Engine::Zero {
                stage: ZeroStage::Two,
                ..
            } => "zero2",
            Engine::Zero {
                stage: ZeroStage::Three,
                ..
            } => "zero3",
        }
    }

    pub fn zero_stage(&self) -> Option<ZeroStage> {
        match self.engine {
            Engine::Zero { stage, .. } => Some(stage),
            _ => None,
        }
    }
}

/// A strategy as a job document states it: its engine (`kind`), its `mesh`, and the engine's
/// own settings. The older spelling (`world_size`, and FSDP's `replicas`) still reads, and is
/// never written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StrategyValues {
    pub kind: EngineKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh: Option<MeshValues>,
    /// The older spelling of the mesh: all ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    /// The older spelling of FSDP's `mesh.replicate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// DDP: gradient bucket size, MiB (PyTorch's 25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_cap_mb: Option<u32>,
    /// DDP: `gradient_as_bucket_view`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_view: Option<bool>,
    /// FSDP: `reshard_after_forward` (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reshard_after_forward: Option<bool>,
    /// FSDP: `MixedPrecisionPolicy.param_dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_dtype: Option<HalfDtype>,
    /// FSDP: `CPUOffloadPolicy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_offload: Option<bool>,
    /// FSDP: each micro-batch's gradients reduce-scattered as they are made (default false:
    /// accumulated unsharded until the last micro-batch, FSDP's `no_sync`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_each_batch: Option<bool>,
    /// ZeRO: the stage, 1 to 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<u8>,
    /// ZeRO: `zero_optimization`'s settings (DeepSpeed's defaults where absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<Zero>,
    /// Pipeline stages: the schedule (default 1f1b).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<Schedule>,
    /// Pipeline stages: micro-batches per rank's batch (default: the stages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatches: Option<u32>,
    /// Pipeline stages: chunks per rank (interleaved schedules: default 2; the others 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_stages: Option<u32>,
    /// Expert-parallel ranks: the router imbalance the upper bound assumes (default 1,
    /// balanced, as the estimate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_imbalance: Option<RoutingImbalance>,
    /// Tensor-parallel ranks: sequence parallelism between layers (default true; written
    /// only where false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_parallel: Option<bool>,
}

impl StrategyValues {
    /// `kind` with nothing else stated.
    pub fn of(kind: EngineKind) -> StrategyValues {
        StrategyValues {
            kind,
            mesh: None,
            world_size: None,
            replicas: None,
            bucket_cap_mb: None,
            bucket_view: None,
            reshard_after_forward: None,
            param_dtype: None,
            cpu_offload: None,
            sync_each_batch: None,
            stage: None,
            zero: None,
            schedule: None,
            microbatches: None,
            virtual_stages: None,
            routing_imbalance: None,
            sequence_parallel: None,
        }
    }

    /// A strategy as a person names it (`ddp`, `fsdp`, `hsdp`, `zero1`…`zero3`; a ZeRO stage
    /// out of range is left for the check to refuse) over `world_size` ranks, its settings the
    /// engine's defaults; `None` for a name that is none of those.
    pub fn named(name: &str, world_size: u32) -> Option<StrategyValues> {
        let (kind, stage) = match name {
            "ddp" => (EngineKind::Ddp, None),
            "fsdp" | "hsdp" => (EngineKind::Fsdp, None),
            zero => {
                let digits = zero.strip_prefix("zero")?;
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                (EngineKind::Zero, Some(digits.parse().unwrap_or(u8::MAX)))
            }
        };
        Some(StrategyValues {
            world_size: Some(world_size),
            stage,
            ..StrategyValues::of(kind)
        })
    }
}

impl TryFrom<StrategyValues> for Strategy {
    type Error = OptionError;

    fn try_from(v: StrategyValues) -> Result<Strategy, OptionError> {
        let kind = v.kind;
        let foreign = |setting: &'static str, set: bool, owner: EngineKind| {
            if set && kind != owner {
                Err(OptionError::Setting {
                    setting,
                    owner: owner.name(),
                    kind: kind.name(),
                })
            } else {
                Ok(())
            }
        };
        foreign("bucket_cap_mb", v.bucket_cap_mb.is_some(), EngineKind::Ddp)?;
        foreign("bucket_view", v.bucket_view.is_some(), EngineKind::Ddp)?;
        foreign(
            "reshard_after_forward",
            v.reshard_after_forward.is_some(),
            EngineKind::Fsdp,
        )?;
        foreign("param_dtype", v.param_dtype.is_some(), EngineKind::Fsdp)?;
        foreign("cpu_offload", v.cpu_offload.is_some(), EngineKind::Fsdp)?;
        foreign(
            "sync_each_batch",
            v.sync_each_batch.is_some(),
            EngineKind::Fsdp,
        )?;
        foreign("replicas", v.replicas.is_some(), EngineKind::Fsdp)?;
        foreign("stage", v.stage.is_some(), EngineKind::Zero)?;
        foreign("zero", v.zero.is_some(), EngineKind::Zero)?;
        let engine = match kind {
            EngineKind::Ddp => Engine::Ddp {
                bucket_cap_mb: v.bucket_cap_mb.unwrap_or(DDP_BUCKET_CAP_MB),
                bucket_view: v.bucket_view.unwrap_or(false),
            },
            EngineKind::Fsdp => Engine::Fsdp {
                reshard_after_forward: v.reshard_after_forward.unwrap_or(true),
                param_dtype: v.param_dtype,
                cpu_offload: v.cpu_offload.unwrap_or(false),
                sync_each_batch: v.sync_each_batch.unwrap_or(false),
            },
            EngineKind::Zero => Engine::Zero {
                stage: ZeroStage::new(v.stage.ok_or(OptionError::NoStage)?)?,
                zero: v.zero.unwrap_or_default(),
            },
        };
        if v.mesh.is_some() && (v.world_size.is_some() || v.replicas.is_some()) {
            return Err(OptionError::TwoMeshes);
        }
        let mesh = match (v.mesh, v.world_size) {
            (Some(m), _) => Mesh::new(&m.dims())?,
            (None, Some(world_size)) => Mesh::of_ranks(kind, world_size, v.replicas.unwrap_or(1))?,
            (None, None) => return Err(OptionError::NoMesh),
        };
        let mut strategy = Strategy::new(mesh, engine)?;
        if let Some(routing) = v.routing_imbalance {
            strategy = strategy.with_routing_imbalance(routing)?;
        }
        if let Some(on) = v.sequence_parallel {
            strategy = strategy.with_sequence_parallel(on)?;
        }
        let Some(default) = strategy.pipeline else {
            for (setting, set) in [
                ("schedule", v.schedule.is_some()),
                ("microbatches", v.microbatches.is_some()),
                ("virtual_stages", v.virtual_stages.is_some()),
            ] {
                if set {
                    return Err(OptionError::PipelineSetting(setting));
                }
            }
            return Ok(strategy);
        };
        let schedule = v.schedule.unwrap_or(default.schedule);
        let interleaved = if schedule == Schedule::Interleaved {
            2
        } else {
            1
        };
        strategy.with_pipeline(Pipeline::new(
            schedule,
            v.microbatches.unwrap_or(default.microbatches),
            v.virtual_stages.unwrap_or(interleaved),
        )?)
    }
}

impl From<Strategy> for StrategyValues {
    fn from(s: Strategy) -> StrategyValues {
        let mut v = StrategyValues {
            mesh: Some(s.mesh.into()),
            ..StrategyValues::of(s.engine.kind())
        };
        match s.engine {
            Engine::Ddp {
                bucket_cap_mb,
                bucket_view,
            } => {
                v.bucket_cap_mb = Some(bucket_cap_mb);
                v.bucket_view = Some(bucket_view);
            }
            Engine::Fsdp {
                reshard_after_forward,
                param_dtype,
                cpu_offload,
                sync_each_batch,
            } => {
                v.reshard_after_forward = Some(reshard_after_forward);
                v.param_dtype = param_dtype;
                v.cpu_offload = cpu_offload.then_some(true);
                v.sync_each_batch = sync_each_batch.then_some(true);
            }
            Engine::Zero { stage, zero } => {
                v.stage = Some(stage.number());
                v.zero = Some(zero);
            }
        }
        v.routing_imbalance = s.routing.filter(|&r| r != RoutingImbalance::BALANCED);
        v.sequence_parallel = s.sequence_parallel.filter(|&on| !on);
        if let Some(p) = s.pipeline {
            v.schedule = Some(p.schedule);
            v.microbatches = Some(p.microbatches);
            v.virtual_stages = Some(p.virtual_stages);
        }
        v
    }
}

impl JsonSchema for Strategy {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        StrategyValues::schema_name()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        StrategyValues::json_schema(g)
    }
}
