//! The training-step trace: what one or more iterations do to device memory, in order.
//!
//! A [`Trace`] is a [`TraceHeader`] plus a list of [`Event`]s. Traces are produced by the native
//! model families ([`crate::families`]) or read from a file (JSON Lines, see docs/trace-format.md).
//! Every trace that exists in memory has been validated: ids are allocated before they are freed
//! and never freed twice, so the estimators can replay it without checks.

use std::collections::HashMap;
use std::fmt;
use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use crate::job::{
    Optimizer, OptionError, OptionValues, Options, Precision, Strategy, StrategyValues, TorchOnly,
    Validate, is_native_spec,
};

/// Format name written into every header line.
pub const FORMAT_NAME: &str = "gpumem-trace";
/// The current trace format version. Readers accept exactly the versions they know.
pub const FORMAT_VERSION: u32 = 2;

/// What an allocation holds. Estimators report their breakdown by these.
/// How many [`Category`] values there are.
pub const CATEGORIES: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Parameter,
    Gradient,
    OptimizerState,
    Activation,
    Temporary,
    InputBatch,
    Workspace,
    /// CUDA managed memory outside PyTorch's caching allocator (bitsandbytes' paged optimizer
    /// state): resident while the GPU has room, paged out to the host by the driver under
    /// pressure. Not replayed through the allocator, not in the peak; reported beside it.
    HostBacked,
}

impl Category {
    pub const ALL: [Category; CATEGORIES] = [
        Category::Parameter,
        Category::Gradient,
        Category::OptimizerState,
        Category::Activation,
        Category::Temporary,
        Category::InputBatch,
        Category::Workspace,
        Category::HostBacked,
    ];
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn name(self) -> &'static str {
        match self {
            Category::Parameter => "parameter",
            Category::Gradient => "gradient",
            Category::OptimizerState => "optimizer_state",
            Category::Activation => "activation",
            Category::Temporary => "temporary",
            Category::InputBatch => "input_batch",
            Category::Workspace => "workspace",
            Category::HostBacked => "host_backed",
        }
    }
}

/// Where in the training loop an event happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Setup,
    Forward,
    Backward,
    Optimizer,
    ZeroGrad,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::ZeroGrad => "zero_grad",
        }
    }
}

/// A part of the whole run (docs/run.md): the model's load, the training steps, the trainer's
/// evaluation loop, generation, a checkpoint's save. A trace with no [`Event::RunPhase`] is the
/// training steps alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum RunPhase {
    Load,
    Train,
    Evaluate,
    Generate,
    Save,
}

impl RunPhase {
    pub const ALL: [RunPhase; 5] = [
        RunPhase::Load,
        RunPhase::Train,
        RunPhase::Evaluate,
        RunPhase::Generate,
        RunPhase::Save,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RunPhase::Load => "load",
            RunPhase::Train => "train",
            RunPhase::Evaluate => "evaluate",
            RunPhase::Generate => "generate",
            RunPhase::Save => "save",
        }
    }
}

/// A pass of a convolution, as a profile's workspace table names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum ConvPass {
    #[serde(rename = "fwd")]
    Forward,
    #[serde(rename = "bwd_data")]
    BackwardData,
    #[serde(rename = "bwd_filter")]
    BackwardFilter,
}

impl ConvPass {
    pub const ALL: [ConvPass; 3] = [
        ConvPass::Forward,
        ConvPass::BackwardData,
        ConvPass::BackwardFilter,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ConvPass::Forward => "fwd",
            ConvPass::BackwardData => "bwd_data",
            ConvPass::BackwardFilter => "bwd_filter",
        }
    }
}

/// `module` of an allocation that no module made (the optimizer, a loss computed outside one).
pub const NO_MODULE: u32 = u32::MAX;

/// One event of a trace. Op names and module paths are interned: `op` and `module` index
/// [`Trace::ops`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A new storage of `bytes` on `stream`, made by kernel `op` on behalf of `module` (its path
    /// in the model, e.g. `layer4.2.conv3`; [`NO_MODULE`] if none). `slot` is the dense index of
    /// its id (see [`Trace::ids`]).
    Alloc {
        slot: u32,
        bytes: u64,
        category: Category,
        phase: Phase,
        op: u32,
        module: u32,
        stream: u32,
    },
    /// The storage in `slot` dies.
    Free { slot: u32 },
    /// A kernel: feeds the utilization model.
    Op {
        op: u32,
        flops: u64,
        bytes_read: u64,
        bytes_written: u64,
    },
    /// End of iteration `index` (0-based).
    Iteration { index: u32 },
    /// The events that follow belong to this part of the whole run (until the next such event).
    RunPhase { phase: RunPhase },
    /// `torch.cuda.empty_cache()`: the allocator gives its unused cached segments back (Hugging
    /// Face's evaluation loop does after each move of what it kept to the host).
    EmptyCache,
    /// The workspaces a convolution kernel takes and gives back before it returns. Their sizes
    /// depend on the GPU and cuDNN, so the trace names the convolution (`conv`, interned: its
    /// configuration without the batch; `n`: the batch) and the replay sizes them from the
    /// profile's workspace table.
    Workspace {
        conv: u32,
        n: u64,
        pass: ConvPass,
        phase: Phase,
        module: u32,
    },
}

/// Header: what the trace describes and who produced it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "HeaderDoc")]
pub struct TraceHeader {
    pub format: String,
    pub version: u32,
    pub model: String,
    pub batch_size: u64,
    /// The job's options in the job vocabulary (a version-1 header's `optimizer`, `precision`,
    /// `seq_len`, `strategy`, `world_size`, `data_parallel` and `validate` read into them).
    pub options: Options,
    pub producer: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framework: Option<String>,
    /// Trainable parameter count (the Horus formula needs it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<u64>,
    /// Sum of layer output features per sample (the Horus formula needs it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations_per_sample: Option<u64>,
    /// The most parameters one module holds directly (DeepSpeed's `largest_layer_params`;
    /// written for ZeRO jobs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest_layer_parameters: Option<u64>,
    /// A trace of the model cut to `depth` of its `blocks` identical blocks (the tracer's
    /// `depths`); [`crate::depth::extrapolate`] rebuilds the whole model's from three.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
    /// Ops whose allocations a wrapper (the tracer's ZeRO engine, DDP's bucket rebuild) sizes
    /// from the parameters and its config alone, never from the batch: what
    /// [`crate::symbolic::SymbolicTrace::transfer`] may hold constant where the cut traces do
    /// not show them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sized_by_parameters: Vec<String>,
    /// A whole run's evaluation: whose loop the trace ran (`transformers.Trainer 5.24.0`, the
    /// trainer's own code on the tracer's stand-in CUDA, or gpumem's restatement of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation_loop: Option<String>,
    /// The process groups the traced rank's collectives ran on: each an NCCL communicator on a
    /// GPU, whose buffers live outside the allocator (see [`Trace::communicators`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub communicators: Vec<Communicator>,
    pub iterations: u32,
}

/// A process group a rank's collectives ran on: PyTorch's name for it and its ranks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Communicator {
    pub name: String,
    pub ranks: u32,
}

impl TraceHeader {
    pub fn new(model: impl Into<String>, batch_size: u64) -> Self {
        TraceHeader {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            model: model.into(),
            batch_size,
            options: Options::default(),
            producer: format!("gpumem-native/{}", env!("CARGO_PKG_VERSION")),
            framework: None,
            parameters: None,
            activations_per_sample: None,
            largest_layer_parameters: None,
            blocks: None,
            depth: None,
            sized_by_parameters: Vec::new(),
            evaluation_loop: None,
            communicators: Vec::new(),
            iterations: 0,
        }
    }
}

/// A header line as written, of either version: version 2 states `options`; version 1 stated
/// a few of them as fields of their own.
#[derive(Deserialize)]
struct HeaderDoc {
    format: String,
    version: u32,
    model: String,
    batch_size: u64,
    #[serde(default)]
    options: Option<serde_json::Value>,
    #[serde(default)]
    seq_len: Option<u64>,
    #[serde(default)]
    optimizer: Option<String>,
    #[serde(default)]
    precision: Option<String>,
    #[serde(default)]
    strategy: Option<String>,
    #[serde(default)]
    world_size: Option<u32>,
    #[serde(default)]
    data_parallel: Option<u32>,
    #[serde(default)]
    validate: Option<String>,
    producer: String,
    #[serde(default)]
    framework: Option<String>,
    #[serde(default)]
    parameters: Option<u64>,
    #[serde(default)]
    activations_per_sample: Option<u64>,
    #[serde(default)]
    largest_layer_parameters: Option<u64>,
    #[serde(default)]
    blocks: Option<u32>,
    #[serde(default)]
    depth: Option<u32>,
    #[serde(default)]
    sized_by_parameters: Vec<String>,
    #[serde(default)]
    evaluation_loop: Option<String>,
    #[serde(default)]
    communicators: Vec<Communicator>,
    iterations: u32,
}

/// Why a header's job is refused: its options, or options its model cannot take.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("field format: expected \"{FORMAT_NAME}\", found \"{0}\"")]
    Format(String),
    #[error("field version: this gpumem reads versions 1 and {FORMAT_VERSION}, found {0}")]
    Version(u32),
    #[error("field options: {0}")]
    Options(#[source] serde_json::Error),
    #[error("field {0}: a version-{FORMAT_VERSION} header states it in options")]
    Moved(&'static str),
    #[error("field options: {0}")]
    Invalid(#[from] OptionError),
    #[error("field {0}")]
    Name(#[from] crate::UnknownName),
    #[error("field options: {0}")]
    TorchOnly(#[from] TorchOnly),
}

impl TryFrom<HeaderDoc> for TraceHeader {
    type Error = HeaderError;

    fn try_from(d: HeaderDoc) -> Result<TraceHeader, HeaderError> {
        if d.format != FORMAT_NAME {
            return Err(HeaderError::Format(d.format));
        }
        let options = match d.version {
            FORMAT_VERSION => {
                let moved = [
                    ("seq_len", d.seq_len.is_some()),
                    ("optimizer", d.optimizer.is_some()),
                    ("precision", d.precision.is_some()),
                    ("strategy", d.strategy.is_some()),
                    ("world_size", d.world_size.is_some()),
                    ("data_parallel", d.data_parallel.is_some()),
                    ("validate", d.validate.is_some()),
                ];
                if let Some((field, _)) = moved.iter().find(|(_, set)| *set) {
                    return Err(HeaderError::Moved(field));
                }
                match d.options {
                    Some(v) => {
                        serde_json::from_value::<Options>(v).map_err(HeaderError::Options)?
                    }
                    None => Options::default(),
                }
            }
            1 => {
                let strategy = match d.strategy.as_deref() {
                    None => None,
                    Some(name) => Some(Strategy::try_from(
                        StrategyValues::named(name, d.world_size.unwrap_or(1)).ok_or_else(
                            || {
                                crate::UnknownName::new(
                                    "strategy",
                                    name,
                                    "ddp, fsdp, hsdp, zero1, zero2 or zero3",
                                )
                            },
                        )?,
                    )?),
                };
                OptionValues {
                    optimizer: Optimizer::parse(d.optimizer.as_deref().unwrap_or("adam"))?,
                    precision: Precision::parse(d.precision.as_deref().unwrap_or("fp32"))?,
                    // A native transformer's stated its sequence length, which its spec holds.
                    seq_len: d.seq_len.filter(|_| !is_native_spec(&d.model)),
                    data_parallel: d.data_parallel.unwrap_or(1),
                    validate: Validate::parse(d.validate.as_deref().unwrap_or("none"))?,
                    strategy,
                    ..OptionValues::default()
                }
                .check()?
            }
            other => return Err(HeaderError::Version(other)),
        };
        if is_native_spec(&d.model) {
            options.check_native()?;
        }
        Ok(TraceHeader {
            format: d.format,
            version: FORMAT_VERSION,
            model: d.model,
            batch_size: d.batch_size,
            options,
            producer: d.producer,
            framework: d.framework,
            parameters: d.parameters,
            activations_per_sample: d.activations_per_sample,
            largest_layer_parameters: d.largest_layer_parameters,
            blocks: d.blocks,
            depth: d.depth,
            sized_by_parameters: d.sized_by_parameters,
            evaluation_loop: d.evaluation_loop,
            communicators: d.communicators,
            iterations: d.iterations,
        })
    }
}

/// A validated trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub header: TraceHeader,
    /// Private: only the builder (and a symbolic trace evaluated from valid traces) makes them.
    pub(crate) events: Vec<Event>,
    /// Interned names: kernels' op names and modules' paths.
    pub(crate) ops: Vec<String>,
    /// The producer's id for each dense slot.
    pub(crate) ids: Vec<u64>,
}

/// Why a trace was rejected. `line` is 1-based (the header is line 1); 0 when built in memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", if *.line > 0 { format!("line {}: ", .line) } else { String::new() })]
pub struct TraceError {
    pub line: usize,
    pub message: String,
}

fn err(line: usize, message: impl Into<String>) -> TraceError {
    TraceError {
        line,
        message: message.into(),
    }
}

/// Largest single allocation a trace may ask for (1 PiB): anything above is a corrupt size.
pub const MAX_ALLOC_BYTES: u64 = 1 << 50;

/// A multiplicative hasher for integer ids (the default SipHash costs more than the rest of
/// reading a trace line).
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Builds a trace event by event, checking ids as it goes. Used by every producer and the reader.
#[derive(Debug)]
pub struct TraceBuilder {
    header: TraceHeader,
    events: Vec<Event>,
    ops: Vec<String>,
    op_index: HashMap<String, u32>,
    ids: Vec<u64>,
    live: IdMap<u32>,
    next_id: u64,
    iterations: u32,
}

impl TraceBuilder {
    pub fn new(header: TraceHeader) -> Self {
        TraceBuilder {
            header,
            events: Vec::new(),
            ops: Vec::new(),
            op_index: HashMap::new(),
            ids: Vec::new(),
            live: IdMap::default(),
            next_id: 1,
            iterations: 0,
        }
    }

    pub fn intern(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.op_index.get(name) {
            return i;
        }
        let i = self.ops.len() as u32;
        self.ops.push(name.to_string());
        self.op_index.insert(name.to_string(), i);
        i
    }

    /// Allocation with a fresh id chosen by the builder; returns the id.
    pub fn alloc(&mut self, bytes: u64, category: Category, phase: Phase, op: &str) -> u64 {
        let id = self.next_id;
        self.alloc_with_id(0, id, bytes, category, phase, op, None, 0)
            .expect("fresh ids are unique and sizes come from the producer");
        id
    }

    /// Allocation with a caller-chosen id (ids may be reused after they are freed).
    #[allow(clippy::too_many_arguments)]
    pub fn alloc_with_id(
        &mut self,
        line: usize,
        id: u64,
        bytes: u64,
        category: Category,
        phase: Phase,
        op: &str,
        module: Option<&str>,
        stream: u32,
    ) -> Result<(), TraceError> {
        if bytes > MAX_ALLOC_BYTES {
            return Err(err(
                line,
                format!("alloc of id {id}: size {bytes} bytes is absurd (over 1 PiB)"),
            ));
        }
        if self.live.contains_key(&id) {
            return Err(err(line, format!("alloc of id {id}, which is still live")));
        }
        let op = self.intern(op);
        let module = module.map_or(NO_MODULE, |m| self.intern(m));
        let slot = self.ids.len() as u32;
        self.ids.push(id);
        self.live.insert(id, slot);
        self.next_id = self.next_id.max(id + 1);
        self.events.push(Event::Alloc {
            slot,
            bytes,
            category,
            phase,
            op,
            module,
            stream,
        });
        Ok(())
    }

    pub fn free(&mut self, id: u64) {
        self.free_at(0, id).expect("producer frees only live ids");
    }

    pub fn free_at(&mut self, line: usize, id: u64) -> Result<(), TraceError> {
        match self.live.remove(&id) {
            Some(slot) => {
                self.events.push(Event::Free { slot });
                Ok(())
            }
            None if self.ids.contains(&id) => Err(err(line, format!("double free of id {id}"))),
            None => Err(err(line, format!("free of unknown id {id}"))),
        }
    }

    pub fn op(&mut self, name: &str, flops: u64, bytes_read: u64, bytes_written: u64) {
        let op = self.intern(name);
        self.events.push(Event::Op {
            op,
            flops,
            bytes_read,
            bytes_written,
        });
    }

    pub fn workspace(
        &mut self,
        conv: &str,
        n: u64,
        pass: ConvPass,
        phase: Phase,
        module: Option<&str>,
    ) {
        let conv = self.intern(conv);
        let module = module.map_or(NO_MODULE, |m| self.intern(m));
        self.events.push(Event::Workspace {
            conv,
            n,
            pass,
            phase,
            module,
        });
    }

    pub fn iteration_end(&mut self) {
        self.events.push(Event::Iteration {
            index: self.iterations,
        });
        self.iterations += 1;
    }

    /// The events that follow belong to `phase` of the whole run.
    pub fn run_phase(&mut self, phase: RunPhase) {
        self.events.push(Event::RunPhase { phase });
    }

    pub fn empty_cache(&mut self) {
        self.events.push(Event::EmptyCache);
    }

    pub fn is_live(&self, id: u64) -> bool {
        self.live.contains_key(&id)
    }

    pub fn finish(mut self) -> Trace {
        self.header.iterations = self.iterations;
        Trace {
            header: self.header,
            events: self.events,
            ops: self.ops,
            ids: self.ids,
        }
    }
}

/// One line of the file format (after the header line), flat for speed: `ev` says which
/// fields must be present. Op names borrow from the line.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line<'a> {
    ev: &'a str,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bytes: Option<serde_json::Number>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    category: Option<Category>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    phase: Option<Phase>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    op: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    module: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stream: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    flops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bytes_read: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bytes_written: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    index: Option<u32>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    conv: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    n: Option<u64>,
    #[serde(default, rename = "pass", skip_serializing_if = "Option::is_none")]
    pass: Option<ConvPass>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<RunPhase>,
}

fn need<T>(v: Option<T>, line: usize, ev: &str, field: &str) -> Result<T, TraceError> {
    v.ok_or_else(|| err(line, format!("{ev} event: missing field `{field}`")))
}

impl Trace {
    /// Reads the JSON Lines format. Errors name the 1-based line and what is wrong.
    pub fn read(mut reader: impl BufRead) -> Result<Trace, TraceError> {
        let mut text = String::new();
        reader
            .read_to_string(&mut text)
            .map_err(|e| err(0, format!("cannot read: {e}")))?;
        let mut lines = text.lines();
        let first = match lines.next() {
            None => return Err(err(1, "empty trace: expected a header line")),
            Some(l) => l,
        };
        let doc: HeaderDoc = serde_json::from_str(first)
            .map_err(|e| err(1, format!("bad header: {}", one_line(&e))))?;
        let header = TraceHeader::try_from(doc).map_err(|e| err(1, e.to_string()))?;
        let mut b = TraceBuilder::new(header);
        for (i, line) in lines.enumerate() {
            let n = i + 2;
            if line.trim().is_empty() {
                continue;
            }
            let l: Line = serde_json::from_str(line).map_err(|e| err(n, one_line(&e)))?;
            match l.ev {
                "alloc" => {
                    let id = need(l.id, n, "alloc", "id")?;
                    let bytes = need(l.bytes, n, "alloc", "bytes")?;
                    let bytes = match (bytes.as_u64(), bytes.as_i64()) {
                        (Some(b), _) => b,
                        (None, Some(neg)) => {
                            return Err(err(n, format!("field bytes: negative size {neg}")));
                        }
                        (None, None) => {
                            return Err(err(
                                n,
                                format!(
                                    "field bytes: size {bytes} is not a whole number of bytes or overflows"
                                ),
                            ));
                        }
                    };
                    let category = need(l.category, n, "alloc", "category")?;
                    let phase = need(l.phase, n, "alloc", "phase")?;
                    let op = need(l.op, n, "alloc", "op")?;
                    b.alloc_with_id(
                        n,
                        id,
                        bytes,
                        category,
                        phase,
                        &op,
                        l.module.as_deref(),
                        l.stream.unwrap_or(0),
                    )?;
                }
                "free" => b.free_at(n, need(l.id, n, "free", "id")?)?,
                "op" => {
                    let op = need(l.op, n, "op", "op")?;
                    b.op(
                        &op,
                        l.flops.unwrap_or(0),
                        l.bytes_read.unwrap_or(0),
                        l.bytes_written.unwrap_or(0),
                    );
                }
                "iteration" => {
                    let index = need(l.index, n, "iteration", "index")?;
                    if index != b.iterations {
                        return Err(err(
                            n,
                            format!(
                                "field index: expected iteration {}, found {index}",
                                b.iterations
                            ),
                        ));
                    }
                    b.iteration_end();
                }
                "workspace" => {
                    let conv = need(l.conv, n, "workspace", "conv")?;
                    let batch = need(l.n, n, "workspace", "n")?;
                    if batch == 0 || batch > MAX_ALLOC_BYTES {
                        return Err(err(
                            n,
                            format!("field n: batch {batch} is out of range (1..=2^50)"),
                        ));
                    }
                    let pass = need(l.pass, n, "workspace", "pass")?;
                    let phase = need(l.phase, n, "workspace", "phase")?;
                    b.workspace(&conv, batch, pass, phase, l.module.as_deref());
                }
                "run_phase" => b.run_phase(need(l.name, n, "run_phase", "name")?),
                "empty_cache" => b.empty_cache(),
                other => {
                    return Err(err(
                        n,
                        format!(
                            "unknown event `{other}` (expected alloc, free, op, iteration, workspace, run_phase or empty_cache)"
                        ),
                    ));
                }
            }
        }
        Ok(b.finish())
    }

    /// Writes the JSON Lines format; `read` of the output gives back an equal trace.
    pub fn write(&self, mut w: impl Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut w, &self.header)?;
        writeln!(w)?;
        for ev in &self.events {
            let line = match *ev {
                Event::Alloc {
                    slot,
                    bytes,
                    category,
                    phase,
                    op,
                    module,
                    stream,
                } => Line {
                    ev: "alloc",
                    id: Some(self.ids[slot as usize]),
                    bytes: Some(bytes.into()),
                    category: Some(category),
                    phase: Some(phase),
                    op: Some(self.ops[op as usize].as_str().into()),
                    module: self.module(module).map(Into::into),
                    stream: (stream != 0).then_some(stream),
                    ..Default::default()
                },
                Event::Free { slot } => Line {
                    ev: "free",
                    id: Some(self.ids[slot as usize]),
                    ..Default::default()
                },
                Event::Op {
                    op,
                    flops,
                    bytes_read,
                    bytes_written,
                } => Line {
                    ev: "op",
                    op: Some(self.ops[op as usize].as_str().into()),
                    flops: Some(flops),
                    bytes_read: Some(bytes_read),
                    bytes_written: Some(bytes_written),
                    ..Default::default()
                },
                Event::Iteration { index } => Line {
                    ev: "iteration",
                    index: Some(index),
                    ..Default::default()
                },
                Event::RunPhase { phase } => Line {
                    ev: "run_phase",
                    name: Some(phase),
                    ..Default::default()
                },
                Event::EmptyCache => Line {
                    ev: "empty_cache",
                    ..Default::default()
                },
                Event::Workspace {
                    conv,
                    n,
                    pass,
                    phase,
                    module,
                } => Line {
                    ev: "workspace",
                    conv: Some(self.ops[conv as usize].as_str().into()),
                    n: Some(n),
                    pass: Some(pass),
                    phase: Some(phase),
                    module: self.module(module).map(Into::into),
                    ..Default::default()
                },
            };
            serde_json::to_writer(&mut w, &line)?;
            writeln!(w)?;
        }
        Ok(())
    }

    /// The path of interned module `module`, if any.
    /// The events in order.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The interned name `op` of an event (an op name or a module path).
    pub fn op_name(&self, op: u32) -> &str {
        &self.ops[op as usize]
    }

    /// Every interned name, by index.
    pub fn op_names(&self) -> &[String] {
        &self.ops
    }

    pub fn module(&self, module: u32) -> Option<&str> {
        (module != NO_MODULE).then(|| self.ops[module as usize].as_str())
    }

    /// The part of the whole run event `event` belongs to (`None`: not a whole run's trace).
    pub fn run_phase_at(&self, event: usize) -> Option<RunPhase> {
        self.events
            .get(..=event)?
            .iter()
            .rev()
            .find_map(|ev| match *ev {
                Event::RunPhase { phase } => Some(phase),
                _ => None,
            })
    }

    /// Whether the trace is a whole run's (it names its parts), not the training steps alone.
    pub fn is_whole_run(&self) -> bool {
        self.events
            .iter()
            .any(|ev| matches!(ev, Event::RunPhase { .. }))
    }

    /// Number of dense slots (one per allocation event).
    pub fn slots(&self) -> usize {
        self.ids.len()
    }

    /// The largest output (bytes written) of any kernel whose op name is in `names`.
    /// The NCCL communicators the traced rank holds: one per process group its collectives
    /// ran on, as the tracer saw them; a trace that names none (older, or a native family's)
    /// holds one where it is a rank of a multi-GPU job, none otherwise.
    pub fn communicators(&self) -> u32 {
        match self.header.communicators.len() {
            0 => u32::from(self.header.options.strategy.is_some()),
            n => u32::try_from(n).unwrap_or(u32::MAX),
        }
    }

    /// Whether the job runs a convolution (and so loads cuDNN): the trace names its
    /// workspaces.
    pub fn runs_convolutions(&self) -> bool {
        self.events
            .iter()
            .any(|ev| matches!(ev, Event::Workspace { .. }))
    }

    pub fn largest_output(&self, names: &[&str]) -> u64 {
        let wanted: Vec<u32> = self
            .ops
            .iter()
            .enumerate()
            .filter(|(_, n)| names.contains(&n.as_str()))
            .map(|(i, _)| i as u32)
            .collect();
        self.events
            .iter()
            .filter_map(|ev| match *ev {
                Event::Op {
                    op, bytes_written, ..
                } if wanted.contains(&op) => Some(bytes_written),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Total FLOPs and bytes moved per iteration, from the op events.
    pub fn op_totals(&self) -> OpTotals {
        let mut t = OpTotals::default();
        for ev in &self.events {
            if let Event::Op {
                flops,
                bytes_read,
                bytes_written,
                ..
            } = *ev
            {
                t.kernels += 1;
                t.flops += flops;
                t.bytes += bytes_read + bytes_written;
            }
        }
        let iters = self.header.iterations.max(1) as u64;
        OpTotals {
            kernels: t.kernels / iters,
            flops: t.flops / iters,
            bytes: t.bytes / iters,
        }
    }
}

/// Per-iteration kernel work of a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OpTotals {
    pub kernels: u64,
    pub flops: u64,
    pub bytes: u64,
}

fn one_line(e: &impl fmt::Display) -> String {
    e.to_string().replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_line() -> String {
        serde_json::to_string(&TraceHeader::new("t", 4)).unwrap()
    }

    fn read(body: &str) -> Result<Trace, TraceError> {
        Trace::read(format!("{}\n{}", header_line(), body).as_bytes())
    }

    #[test]
    fn round_trip() {
        let mut b = TraceBuilder::new(TraceHeader::new("m", 8));
        let a = b.alloc(1000, Category::Parameter, Phase::Setup, "p");
        b.op("mm", 10, 20, 30);
        let c = b.alloc(24, Category::Activation, Phase::Forward, "mm");
        b.free(c);
        b.workspace(
            "in=3x8x8;w=4x3x3x3",
            8,
            ConvPass::BackwardData,
            Phase::Backward,
            Some("conv1"),
        );
        b.iteration_end();
        b.run_phase(RunPhase::Save);
        b.empty_cache();
        b.free(a);
        let t = b.finish();
        let mut out = Vec::new();
        t.write(&mut out).unwrap();
        assert_eq!(Trace::read(out.as_slice()).unwrap(), t);
    }

    #[test]
    fn errors_name_line_and_field() {
        let alloc = r#"{"ev":"alloc","id":1,"bytes":10,"category":"activation","phase":"forward","op":"x"}"#;
        assert_eq!(
            read(r#"{"ev":"free","id":3}"#).unwrap_err().to_string(),
            "line 2: free of unknown id 3"
        );
        let e = read(&format!(
            "{alloc}\n{{\"ev\":\"free\",\"id\":1}}\n{{\"ev\":\"free\",\"id\":1}}"
        ))
        .unwrap_err();
        assert_eq!(e.to_string(), "line 4: double free of id 1");
        let e = read(&alloc.replace("10", "-5")).unwrap_err();
        assert_eq!(e.to_string(), "line 2: field bytes: negative size -5");
        let e = read(&alloc.replace("10", "99999999999999999999999")).unwrap_err();
        assert!(
            e.to_string().starts_with("line 2: field bytes: size"),
            "{e}"
        );
        let e = read(r#"{"ev":"alloc","id":1"#).unwrap_err();
        assert!(e.to_string().starts_with("line 2: EOF"), "{e}");
        let e = read(&alloc.replace("activation", "weights")).unwrap_err();
        assert!(e.to_string().contains("unknown variant `weights`"), "{e}");
        assert!(
            Trace::read("".as_bytes())
                .unwrap_err()
                .to_string()
                .contains("empty trace")
        );
        let e = Trace::read(r#"{"format":"x"}"#.as_bytes()).unwrap_err();
        assert!(e.to_string().starts_with("line 1: bad header"), "{e}");
    }
}
