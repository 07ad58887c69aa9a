//! gpumem-workload: the one front door from a training job to its trace.
//!
//! A [`Workload`] is a model ([`ModelRef`]: a native family spec or a PyTorch reference), a batch
//! size and the typed [`Options`] of the loop around it, checked when it is made. It is traced
//! by the native families or by the PyTorch tracer ([`Workload::trace`]), and gives each of
//! its ranks that differ a [`Symbolic`] source of traces for any batch size
//! ([`Workload::readings`]). The CLI, the
//! simulator's task tracing and the daemon all go through here, so a job means the same thing
//! everywhere, and a [`gpumem_torch::TraceRequest`] is built in one place.

use gpumem_core::dataset::Measurement;
use gpumem_core::estimate::{Estimate, EstimateError, Estimator};
use gpumem_core::families::{JobOptions, MAX_BATCH, ModelSpec};
pub use gpumem_core::job::{
    Attention, AttentionMask, Checkpointing, HalfDtype, InputShape, LengthSchedule, LengthSource,
    Lora, OptionError, OptionOverrides, OptionValues, Options, Outputs, Strategy, TORCH_PREFIXES,
    TorchOnly, Validate, Zero, ZeroStage,
};
use gpumem_core::job::{MeshDim, RoutingImbalance};
use gpumem_core::model::ModelError;
pub use gpumem_core::model::ModelRef;
use gpumem_core::profile::GpuProfile;
use gpumem_core::run::{RunReport, StepSequence};
use gpumem_core::search::{self, SearchError};
use gpumem_core::symbolic::SymbolicTrace;
use gpumem_core::trace::{Trace, TraceHeader};
use gpumem_torch::{BridgeError, TorchTracer, TraceRequest};

pub mod accelerate;
pub mod deepspeed;
pub mod launch;
pub mod plan;
pub mod report;
pub mod train_config;

/// Why a workload could not be made or traced.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The model reference does not parse.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// An option is out of range or at odds with another (the message names which).
    #[error(transparent)]
    Options(#[from] OptionError),
    /// A native model with options only PyTorch models take.
    #[error(transparent)]
    TorchOnly(#[from] TorchOnly),
    /// The native families refuse the job (a pure precision, a tensor beyond any GPU).
    #[error(transparent)]
    Native(#[from] gpumem_core::families::JobError),
    /// A measured row's job, refused.
    #[error("line {line}: {source}")]
    Row {
        line: usize,
        source: Box<WorkloadError>,
    },
    /// The batch size is out of range.
    #[error("--batch {0} is out of range (1..={MAX_BATCH})")]
    Batch(u64),
    /// The PyTorch tracer could not trace it.
    #[error(transparent)]
    Tracer(#[from] BridgeError),
    /// A job whose sequence length or image size varies by step, where one is needed.
    #[error(
        "{0} needs one input shape, and this job's varies by step: give --seq-len N or --input CxHxW (the run's largest, for a bound of its steps)"
    )]
    OneLength(&'static str),
    /// A run's steps could not be joined (the loop keeps different tensors across steps at
    /// different lengths).
    #[error(transparent)]
    Run(#[from] gpumem_core::run::RunError),
}

impl WorkloadError {
    /// Whether the job as stated is wrong (the user's input), rather than the tracer or the
    /// model failing.
    pub fn is_input(&self) -> bool {
        match self {
            WorkloadError::Model(_)
            | WorkloadError::Options(_)
            | WorkloadError::TorchOnly(_)
            | WorkloadError::Native(_)
            | WorkloadError::Batch(_)
            | WorkloadError::OneLength(_)
            | WorkloadError::Tracer(BridgeError::Reference(_)) => true,
            WorkloadError::Row { source, .. } => source.is_input(),
            WorkloadError::Tracer(_) | WorkloadError::Run(_) => false,
        }
    }
}

/// Why a job could not be sized.
#[derive(Debug, thiserror::Error)]
pub enum SizeError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Estimate(#[from] EstimateError),
    /// Evaluating a symbolic trace or searching its batch sizes failed.
    #[error(transparent)]
    Search(#[from] SearchError),
}

impl From<gpumem_core::symbolic::SymbolicError> for SizeError {
    fn from(e: gpumem_core::symbolic::SymbolicError) -> Self {
        SizeError::Search(e.into())
    }
}

/// A job sized: its largest reading (the one with the largest peak: its workload, trace and
/// estimate, whose upper bound is raised to the largest of every reading's) and what each
/// reading needs (one entry unless the spec is ambiguous).
pub struct Sizing {
    pub workload: Workload,
    pub trace: Trace,
    pub estimate: Estimate,
    pub readings: Vec<Reading>,
}

impl Sizing {
    /// The machine report of the sizing on `profile` (utilization by the physical model).
    pub fn report(&self, profile: &GpuProfile) -> report::EstimateReport {
        let util = gpumem_core::utilization::physical(
            &self.trace,
            profile,
            &gpumem_core::utilization::HostModel::default(),
        );
        report::EstimateReport::new(
            &self.trace,
            &self.estimate,
            &util,
            self.workload.options().strategy,
            &self.readings,
            None,
        )
    }
}

/// A run of steps whose sequence length varies, sized (see [`Workload::run`]).
pub struct RunSizing {
    pub trace: Trace,
    pub estimate: Estimate,
    pub report: RunReport,
}

/// What a run's lengths were and which were traced.
struct RunLengths {
    summary: gpumem_core::job::LengthSummary,
    traced: Vec<u64>,
    rounded_up: bool,
}

/// One reading of a job, sized.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    pub model: String,
    /// A pipeline job's stage (its rank along the pipeline) this reading is.
    pub stage: Option<u32>,
    /// The router's stand-in of this reading: balanced (the estimate's), or the imbalance the
    /// upper bound assumes.
    pub routing: RoutingImbalance,
    pub peak_bytes: u64,
    pub upper_bound_bytes: u64,
}

/// A training job: what is trained, at which batch size, in which loop.
/// Invariant: the batch is in 1..=[`MAX_BATCH`], and a native model has no option only PyTorch
/// models take (the options hold their own invariant).
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    model: ModelRef,
    batch: u64,
    options: Options,
    /// Which of a pipeline job's stages is traced (0 where it has none): set by
    /// [`Workload::alternatives`], one job per stage.
    pipeline_rank: u32,
    /// The router's stand-in traced: balanced, or (set by [`Workload::alternatives`]) the
    /// imbalance an expert-parallel strategy's upper bound assumes.
    routing: RoutingImbalance,
}

impl Workload {
    pub fn new(model: ModelRef, batch: u64, options: Options) -> Result<Workload, WorkloadError> {
        if batch == 0 || batch > MAX_BATCH {
            return Err(WorkloadError::Batch(batch));
        }
        if model.is_native() {
            options.check_native()?;
        }
        Ok(Workload {
            model,
            batch,
            options,
            pipeline_rank: 0,
            routing: RoutingImbalance::BALANCED,
        })
    }

    /// A model reference parsed by the one prefix table, at `batch` with `options`.
    pub fn parse(model: &str, batch: u64, options: Options) -> Result<Workload, WorkloadError> {
        Workload::new(ModelRef::parse(model)?, batch, options)
    }

    /// A measured row's job: its model and batch, its own options over `defaults`. `Ok(None)`:
    /// the row names its model in a way gpumem cannot trace.
    pub fn of_row(
        row: &Measurement,
        defaults: &Options,
    ) -> Result<Option<Workload>, WorkloadError> {
        let Some(model) = row.model.clone() else {
            return Ok(None);
        };
        let in_row = |e: WorkloadError| WorkloadError::Row {
            line: row.line,
            source: Box::new(e),
        };
        let mut options = row.options.over(defaults).map_err(|e| in_row(e.into()))?;
        if model.is_native() {
            // A native row keeps only what a native model takes; its CSV columns for PyTorch
            // models (input, seq_len) describe nothing gpumem builds.
            options = options.native_part();
        }
        Workload::new(model, row.batch, options)
            .map(Some)
            .map_err(in_row)
    }

    pub fn model(&self) -> &ModelRef {
        &self.model
    }

    pub fn batch(&self) -> u64 {
        self.batch
    }

    /// The jobs this one may be: itself, one per reading of an ambiguous native spec (a
    /// dense CNN without `pool_every`), one per stage of a pipeline job (each stage's rank
    /// holds other layers), and each of those again at the router imbalance an expert-parallel
    /// strategy's upper bound assumes. Sizing takes the largest (the estimate the largest
    /// balanced one).
    pub fn alternatives(&self) -> Vec<Workload> {
        let imbalance = self
            .options
            .strategy
            .and_then(|s| s.routing_imbalance())
            .filter(|&r| r != RoutingImbalance::BALANCED);
        if let Some(strategy) = self.options.strategy.filter(|s| s.pipeline().is_some()) {
            return (0..strategy.mesh().degree(MeshDim::Pipeline))
                .map(|pipeline_rank| Workload {
                    pipeline_rank,
                    ..self.clone()
                })
                .flat_map(|w| w.with_routings(imbalance))
                .collect();
        }
        match &self.model {
            ModelRef::Native(spec) => spec
                .alternatives()
                .into_iter()
                .map(|m| Workload {
                    model: ModelRef::Native(m),
                    ..self.clone()
                })
                .collect(),
            ModelRef::Torch(_) => self.with_routings(imbalance),
        }
    }

    /// This job, and again at `imbalance` where there is one.
    fn with_routings(&self, imbalance: Option<RoutingImbalance>) -> Vec<Workload> {
        std::iter::once(self.clone())
            .chain(imbalance.map(|routing| Workload {
                routing,
                ..self.clone()
            }))
            .collect()
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Sizes every reading of this job (see [`Workload::alternatives`]) with `estimator` on
    /// `profile`, each traced by `trace` ([`Workload::trace`] or
    /// [`Workload::trace_for_reestimates`]): an ambiguous spec is answered by its largest network,
    /// under the largest bound.
    pub fn size(
        &self,
        profile: &GpuProfile,
        estimator: &dyn Estimator,
        trace: fn(&Workload, &GpuProfile) -> Result<Trace, WorkloadError>,
    ) -> Result<Sizing, SizeError> {
        let mut largest: Option<Sizing> = None;
        let mut readings = Vec::new();
        let alternatives = self.alternatives();
        let staged = self.is_pipeline();
        let traces = side_by_side(&alternatives, |w| trace(w, profile));
        for (w, t) in alternatives.into_iter().zip(traces) {
            let t = t?;
            let est = estimator.estimate(&t, profile)?;
            readings.push(Reading {
                model: t.header.model.clone(),
                stage: staged.then_some(w.pipeline_rank),
                routing: w.routing,
                peak_bytes: est.peak_bytes,
                upper_bound_bytes: est.upper_bound_bytes,
            });
            // The estimate is a balanced router's; the imbalanced readings raise the bound.
            if w.routing == RoutingImbalance::BALANCED
                && largest
                    .as_ref()
                    .is_none_or(|l| est.peak_bytes > l.estimate.peak_bytes)
            {
                largest = Some(Sizing {
                    workload: w,
                    trace: t,
                    estimate: est,
                    readings: Vec::new(),
                });
            }
        }
        let mut sizing = largest.expect("a job has at least one reading");
        sizing.estimate.upper_bound_bytes = readings
            .iter()
            .map(|r| r.upper_bound_bytes)
            .max()
            .unwrap_or(sizing.estimate.upper_bound_bytes);
        sizing.readings = readings;
        Ok(sizing)
    }

    /// The native families' options for this job on `profile`'s GPU and PyTorch release.
    fn native_job(&self, profile: &GpuProfile) -> JobOptions {
        JobOptions {
            optimizer: self.options.optimizer,
            precision: self.options.precision,
            ..JobOptions::on(profile, self.batch)
        }
    }

    /// The tracer's request for a PyTorch model on `profile`'s GPU; `None` for a native one.
    pub fn request(&self, profile: &GpuProfile) -> Option<TraceRequest> {
        match &self.model {
            ModelRef::Torch(r) => Some(TraceRequest {
                pipeline_rank: self.pipeline_rank,
                routing_imbalance: self.routing,
                ..TraceRequest::for_gpu(r, self.batch, self.options.clone(), profile)
            }),
            ModelRef::Native(_) => None,
        }
    }

    /// The training step's trace on `profile`'s GPU.
    pub fn trace(&self, profile: &GpuProfile) -> Result<Trace, WorkloadError> {
        self.trace_with(profile, false)
    }

    /// Like [`Workload::trace`], but a PyTorch model's tracer run also fits and caches its
    /// symbolic trace, so the next batch size of the same job needs no Python (for commands a
    /// user re-runs with another batch).
    pub fn trace_for_reestimates(&self, profile: &GpuProfile) -> Result<Trace, WorkloadError> {
        self.trace_with(profile, true)
    }

    fn trace_with(
        &self,
        profile: &GpuProfile,
        for_reestimates: bool,
    ) -> Result<Trace, WorkloadError> {
        if self.options.step_sizes().is_some() {
            // A run of steps of varying shapes: its trace is theirs, spliced in order.
            let (shapes, order, _) = self.run_shapes(profile)?;
            let refs: Vec<&Trace> = shapes.iter().collect();
            return Ok(StepSequence::new(&refs, order)?.splice(self.run_header(&shapes[0]))?);
        }
        match &self.model {
            ModelRef::Native(spec) => spec
                .trace(&self.native_job(profile))
                .map_err(WorkloadError::from),
            ModelRef::Torch(_) => {
                let req = self
                    .request(profile)
                    .expect("a PyTorch model has a request");
                let tracer = TorchTracer::from_env();
                Ok(if for_reestimates {
                    tracer.trace_for_reestimates(&req)?
                } else {
                    tracer.trace(&req)?
                })
            }
        }
    }

    /// This job's lengths drawn from its schedule, the traces of the lengths it traces (one
    /// job each at a fixed length, side by side), and each step's index among them.
    fn run_shapes(
        &self,
        profile: &GpuProfile,
    ) -> Result<(Vec<Trace>, Vec<usize>, RunLengths), WorkloadError> {
        let (schedule, axis) = self
            .options
            .step_sizes()
            .expect("a run has a schedule of sizes");
        let lengths = schedule.draw();
        let (traced, order, rounded_up) = gpumem_core::run::traced_lengths(&lengths);
        let jobs: Vec<Workload> = traced
            .iter()
            .map(|&l| Workload {
                options: self.options.at_step(axis, l),
                ..self.clone()
            })
            .collect();
        let shapes = side_by_side(&jobs, |w| w.trace(profile))
            .into_iter()
            .collect::<Result<Vec<Trace>, _>>()?;
        let info = RunLengths {
            summary: schedule.summary(&lengths, axis),
            traced,
            rounded_up,
        };
        Ok((shapes, order, info))
    }

    /// The header of this job's run: its first length's, stating the schedule.
    fn run_header(&self, first: &Trace) -> TraceHeader {
        TraceHeader {
            options: self.options.clone(),
            ..first.header.clone()
        }
    }

    /// A job whose sequence length varies by step sized as a run ([`gpumem_core::run`]): the
    /// drawn lengths' steps replayed in order through one allocator, `estimator`'s estimate of
    /// that run with its upper bound raised to cover any order of them, and the report (the
    /// run's reserved memory against its longest step's and the bound). `None` for a job of one
    /// length.
    pub fn run(
        &self,
        profile: &GpuProfile,
        estimator: &dyn Estimator,
    ) -> Result<Option<RunSizing>, SizeError> {
        if self.options.step_sizes().is_none() {
            return Ok(None);
        }
        let (shapes, order, info) = self.run_shapes(profile)?;
        let refs: Vec<&Trace> = shapes.iter().collect();
        let seq = StepSequence::new(&refs, order).map_err(WorkloadError::from)?;
        let (trace, estimate, report) = gpumem_core::run::size_run(
            &seq,
            self.run_header(&shapes[0]),
            profile,
            estimator,
            info.summary,
            info.traced,
            info.rounded_up,
        )
        .map_err(|e| match e {
            gpumem_core::run::RunError::Estimate(e) => SizeError::Estimate(e),
            e => SizeError::Workload(e.into()),
        })?;
        Ok(Some(RunSizing {
            trace,
            estimate,
            report,
        }))
    }

    fn is_pipeline(&self) -> bool {
        self.options
            .strategy
            .is_some_and(|s| s.pipeline().is_some())
    }

    /// The largest batch whose upper bound fits on `profile`'s GPU on every rank this job
    /// sizes, and the estimate of its worst rank there; `None` if even the smallest does not.
    /// A pipeline job's is the least of its stages' (each stage's memory grows with the batch),
    /// each stage searched on its own batch-symbolic trace.
    pub fn max_batch(
        &self,
        profile: &GpuProfile,
        estimator: &dyn Estimator,
    ) -> Result<Option<(u64, Estimate)>, SizeError> {
        self.readings(profile)?.max_batch(profile, estimator)
    }

    /// Every reading of this job (see [`Workload::alternatives`]) as a batch-symbolic trace,
    /// traced side by side.
    pub fn readings(&self, profile: &GpuProfile) -> Result<Readings, WorkloadError> {
        self.readings_of(self.alternatives(), profile)
    }

    /// [`Workload::readings`] of the pipeline stages `stages` picks (each with its reading at
    /// the router's imbalance, where there is one).
    pub fn stage_readings(
        &self,
        profile: &GpuProfile,
        stages: impl Fn(u32) -> bool,
    ) -> Result<Readings, WorkloadError> {
        let jobs = self
            .alternatives()
            .into_iter()
            .filter(|w| stages(w.pipeline_rank))
            .collect();
        self.readings_of(jobs, profile)
    }

    fn readings_of(
        &self,
        jobs: Vec<Workload>,
        profile: &GpuProfile,
    ) -> Result<Readings, WorkloadError> {
        if self.options.step_sizes().is_some() {
            return Err(WorkloadError::OneLength(
                "a batch-size search (max-batch, plan)",
            ));
        }
        let symbolic = side_by_side(&jobs, |w| w.one_rank_symbolic(profile))
            .into_iter()
            .collect::<Result<Vec<Symbolic>, _>>()?;
        Ok(Readings { jobs, symbolic })
    }

    /// Traces of this job's own rank (a pipeline's: `pipeline_rank`'s) at any batch size: the
    /// native families build each directly; a PyTorch model is traced once into a
    /// batch-symbolic trace, and a whole run by a tracer run at each batch size asked.
    fn one_rank_symbolic(&self, profile: &GpuProfile) -> Result<Symbolic, WorkloadError> {
        Ok(match &self.model {
            ModelRef::Native(spec) => Symbolic::Native(spec.clone(), self.native_job(profile)),
            // Traced at its own batch size first, so that a job the tracer refuses is refused
            // here, as a batch-symbolic trace's would be.
            // Context parallelism's input cut loops over the batch's rows (PyTorch's load
            // balancer): its traces do not align across batch sizes either.
            ModelRef::Torch(_)
                if self.options.whole_run.is_some()
                    || self
                        .options
                        .strategy
                        .is_some_and(|s| s.context_parallel() > 1) =>
            {
                Symbolic::PerBatch {
                    trainable: self.trace(profile)?.header.parameters,
                    job: Box::new(self.clone()),
                    profile: profile.clone(),
                }
            }
            ModelRef::Torch(_) => {
                let req = self
                    .request(profile)
                    .expect("a PyTorch model has a request");
                Symbolic::Torch {
                    trace: TorchTracer::from_env().symbolic(&req)?,
                    unit: self.options.batch_unit(),
                }
            }
        })
    }
}

/// A source of this job's traces by batch size.
#[derive(Debug, Clone)]
pub enum Symbolic {
    Native(ModelSpec, JobOptions),
    /// `unit`: [`Options::batch_unit`] (a DataParallel job's GPUs, a pipeline's
    /// micro-batches); its batch sizes are whole multiples of it.
    Torch {
        trace: SymbolicTrace,
        unit: u64,
    },
    /// A whole run, whose parts (the load, an evaluation of batches that follow the training
    /// batch, a save) no batch-symbolic trace carries, or a context-parallel job (whose input
    /// cut loops over the rows): `job` traced whole at each batch size asked, every trace
    /// cached as `estimate`'s is.
    PerBatch {
        job: Box<Workload>,
        profile: GpuProfile,
        trainable: Option<u64>,
    },
}

impl Symbolic {
    /// The trainable parameters a PyTorch model's tracer counted (`None` for a native model).
    pub fn trainable_parameters(&self) -> Option<u64> {
        match self {
            Symbolic::Native(..) => None,
            Symbolic::Torch { trace, .. } => trace.header().parameters,
            Symbolic::PerBatch { trainable, .. } => *trainable,
        }
    }

    /// The trace at `batch` (the whole batch).
    pub fn at(&self, batch: u64) -> Result<Trace, SizeError> {
        Ok(match self {
            Symbolic::Native(spec, job) => spec
                .trace(&JobOptions { batch, ..*job })
                .map_err(SearchError::from)?,
            Symbolic::Torch { trace, .. } => trace.at(batch)?,
            Symbolic::PerBatch { job, profile, .. } => {
                // The reading's own job (its stage, its routing) at `batch`.
                let at = Workload {
                    pipeline_rank: job.pipeline_rank,
                    routing: job.routing,
                    ..Workload::new(job.model.clone(), batch, job.options.clone())?
                };
                at.trace(profile)?
            }
        })
    }

    /// The largest batch that fits on `profile`'s GPU with its upper bound, and its estimate;
    /// `None` if even the smallest does not. A job is searched by whole multiples of its
    /// batch unit (a DataParallel job's rows per GPU, a pipeline's micro-batches).
    pub fn max_batch(
        &self,
        profile: &GpuProfile,
        estimator: &dyn Estimator,
    ) -> Result<Option<(u64, Estimate)>, SizeError> {
        let unit = match self {
            Symbolic::Native(..) => 1,
            Symbolic::Torch { unit, .. } => *unit,
            Symbolic::PerBatch { job, .. } => job.options.batch_unit(),
        };
        let best = search::max_batch_with(&mut |b| self.at(b * unit), profile, estimator)?;
        Ok(best.map(|(b, e)| (b * unit, e)))
    }
}

/// A job's readings (one per pipeline stage, and at the upper bound's router imbalance; see
/// [`Workload::alternatives`]) as batch-symbolic traces, sized together: the estimate is the
/// worst balanced reading's, the upper bound the largest of all, as [`Workload::size`] answers.
/// Invariant: one symbolic trace per job, in the same order, at least one.
#[derive(Debug, Clone)]
pub struct Readings {
    jobs: Vec<Workload>,
    symbolic: Vec<Symbolic>,
}

impl Readings {
    /// These readings and then `more`'s (a job's stages read in two goes, in stage order).
    pub fn join(mut self, more: Readings) -> Readings {
        self.jobs.extend(more.jobs);
        self.symbolic.extend(more.symbolic);
        self
    }

    /// The trainable parameters the tracer counted (the whole model's, on any reading).
    pub fn trainable_parameters(&self) -> Option<u64> {
        self.symbolic
            .iter()
            .find_map(Symbolic::trainable_parameters)
    }

    /// The worst rank's estimate at `batch` (its bound the largest reading's), and every
    /// balanced reading's trace (a pipeline's stages: each its own rank's time).
    pub fn at(
        &self,
        batch: u64,
        profile: &GpuProfile,
        estimator: &dyn Estimator,
    ) -> Result<(Estimate, Vec<Trace>), SizeError> {
        let mut worst: Option<Estimate> = None;
        let (mut bound, mut traces) = (0, Vec::new());
        for (w, s) in self.jobs.iter().zip(&self.symbolic) {
            let trace = s.at(batch)?;
            let e = estimator.estimate(&trace, profile)?;
            bound = bound.max(e.upper_bound_bytes);
            if w.routing == RoutingImbalance::BALANCED {
                if worst.as_ref().is_none_or(|w| e.peak_bytes > w.peak_bytes) {
                    worst = Some(e);
                }
                traces.push(trace);
            }
        }
        let mut worst = worst.expect("a job has a balanced reading");
        worst.upper_bound_bytes = bound;
        Ok((worst, traces))
    }

    /// The largest batch whose upper bound fits on every reading (the least of theirs);
    /// `None` if even the smallest does not fit on one of them.
    pub fn largest_fitting(
        &self,
        profile: &GpuProfile,
        estimator: &dyn Estimator,
    ) -> Result<Option<u64>, SizeError> {
        let mut least = u64::MAX;
        for s in &self.symbolic {
            match s.max_batch(profile, estimator)? {
                Some((b, _)) => least = least.min(b),
                None => return Ok(None),
            }
        }
        Ok(Some(least))
    }

    /// [`Readings::largest_fitting`], and the estimate there.
    pub fn max_batch(
        &self,
        profile: &GpuProfile,
        estimator: &dyn Estimator,
    ) -> Result<Option<(u64, Estimate)>, SizeError> {
        self.largest_fitting(profile, estimator)?
            .map(|b| Ok((b, self.at(b, profile, estimator)?.0)))
            .transpose()
    }
}

/// `f` of each item, in order, on up to one thread per core: each call may run a tracer process
/// (one core each), so a search or a simulation traces its models side by side. Not rayon's
/// pool: the CLI keeps that to one thread for candle's tiny networks.
pub fn side_by_side<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, items.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break mine };
                        mine.push((i, f(item)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_core::estimate::Replay;
    use gpumem_core::job::Optimizer;
    use gpumem_core::job::Precision;
    use gpumem_core::profile::builtin;

    const MLP: &str = "mlp:input=64,output=8,depth=2";

    #[test]
    fn a_workload_is_checked_when_made() {
        let e = Workload::parse(MLP, 0, Options::default())
            .unwrap_err()
            .to_string();
        assert_eq!(e, format!("--batch 0 is out of range (1..={MAX_BATCH})"));
        let e = Workload::parse(
            MLP,
            8,
            OptionValues {
                checkpointing: Checkpointing::Full,
                ..OptionValues::default()
            }
            .check()
            .unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("apply to PyTorch models"), "{e}");
        // Options out of range cannot be given at all: they refuse to be made.
        let e = OptionValues {
            data_parallel: 65,
            ..OptionValues::default()
        }
        .check()
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "data_parallel (--data-parallel) 65 is out of range (1..=64)"
        );
        assert!(Workload::parse("resnet50", 8, Options::default()).is_err());
        assert!(
            Workload::parse(
                "hf:gpt2",
                8,
                OptionValues {
                    checkpointing: Checkpointing::Full,
                    ..OptionValues::default()
                }
                .check()
                .unwrap()
            )
            .is_ok()
        );
    }

    #[test]
    fn native_workloads_trace_with_their_options_and_search_like_a_direct_trace() {
        let p = builtin("a100-40gb").unwrap();
        let w = Workload::parse(
            "mlp:input=4096,output=1000,depth=4",
            32,
            OptionValues {
                optimizer: Optimizer::SGD,
                precision: Precision::AmpBf16,
                ..OptionValues::default()
            }
            .check()
            .unwrap(),
        )
        .unwrap();
        assert!(w.request(&p).is_none());
        let t = w.trace(&p).unwrap();
        assert_eq!(
            (
                t.header.batch_size,
                t.header.options.optimizer.name(),
                t.header.options.precision.name()
            ),
            (32, "sgd".to_string(), "amp-bf16")
        );
        let sym = w.one_rank_symbolic(&p).unwrap();
        assert_eq!(sym.at(32).unwrap().events(), t.events());
        let (b, e) = sym.max_batch(&p, &Replay::default()).unwrap().unwrap();
        let direct = Replay::default().estimate(&sym.at(b).unwrap(), &p).unwrap();
        assert_eq!(e.peak_bytes, direct.peak_bytes);
        assert!(
            Replay::default()
                .estimate(&sym.at(b + 1).unwrap(), &p)
                .unwrap()
                .upper_bound_bytes
                > e.capacity_bytes
        );
    }

    #[test]
    fn a_torch_request_carries_the_typed_options_and_the_gpu() {
        let p = builtin("h200").unwrap();
        let o = OptionValues {
            seq_len: Some(128),
            outputs: Some(Outputs::Kept),
            ..OptionValues::default()
        }
        .check()
        .unwrap();
        let r = Workload::parse("hf:gpt2", 4, o.clone())
            .unwrap()
            .request(&p)
            .unwrap();
        assert_eq!(
            (
                r.model.as_str(),
                r.batch,
                &r.options,
                r.gpu_capability.as_str()
            ),
            ("hf:gpt2", 4, &o, p.compute_capability.as_str())
        );
    }
}

/// A job as a user states it to a cluster engine — a pod's annotations, a batch script's
/// directives: the texts of its model, batch size, precision and optimizer, its world size, and
/// the trainer config it runs with, checked when it is sized. The engines' front ends (the
/// Kubernetes webhook, the Slurm helper) read their own syntax into this and size it here, so
/// both mean the same job by the same words. Model and batch may come from the config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct StatedJob {
    pub model: Option<String>,
    pub batch: Option<String>,
    pub precision: Option<String>,
    pub optimizer: Option<String>,
    /// Ranks of the job (the config's own layout, or one rank, where not stated).
    pub world_size: Option<String>,
    pub train_config: Option<StatedConfig>,
}

/// A trainer config a job states: its text inline (a pod annotation) or a file to read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StatedConfig {
    /// The file (read when `text` is `None`; relative to `dir`), or the name errors give it.
    pub file: String,
    pub text: Option<String>,
    /// Where a relative `file`, and paths the config names, are read.
    pub dir: std::path::PathBuf,
    /// The trainer's kind (`TrainerKind`'s names); detected where `None`.
    pub kind: Option<String>,
}

/// Which stated field is wrong (each engine names it its own way: an annotation, a key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatedField {
    Model,
    Batch,
    Precision,
    Optimizer,
    WorldSize,
    TrainConfig,
}

impl StatedField {
    pub fn key(self) -> &'static str {
        match self {
            StatedField::Model => "model",
            StatedField::Batch => "batch",
            StatedField::Precision => "precision",
            StatedField::Optimizer => "optimizer",
            StatedField::WorldSize => "world_size",
            StatedField::TrainConfig => "train_config",
        }
    }
}

/// What is wrong with a stated field.
#[derive(Debug, thiserror::Error)]
pub enum StatedProblem {
    #[error("`{0}` is not a whole number")]
    NotWhole(String),
    #[error("{0} is out of range (1..={MAX_BATCH})")]
    Batch(u64),
    #[error("missing (state it, or a train_config that names it)")]
    Missing,
    #[error(transparent)]
    Name(#[from] gpumem_core::UnknownName),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Config(#[from] train_config::TrainConfigError),
    #[error(transparent)]
    Job(Box<WorkloadError>),
}

/// Why a stated job could not be sized.
#[derive(Debug, thiserror::Error)]
pub enum StatedError {
    /// A field is malformed or out of range.
    #[error("{message}")]
    Invalid {
        field: StatedField,
        #[source]
        message: StatedProblem,
    },
    /// A PyTorch model, and the caller may not run the tracer.
    #[error("{0} must be traced by PyTorch to be sized")]
    NeedsTrace(String),
    /// The tracer or the estimator failed.
    #[error(transparent)]
    Size(SizeError),
}

impl StatedConfig {
    /// The config, read (a Python torchtitan config through the tracer's interpreter).
    pub fn read(&self) -> Result<train_config::TrainConfig, train_config::TrainConfigError> {
        let kind = self
            .kind
            .as_deref()
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(train_config::TrainerKind::parse)
            .transpose()
            .map_err(|e| train_config::TrainConfigError::Field {
                file: self.file.clone(),
                field: "(kind)".into(),
                why: e.to_string(),
            })?;
        match &self.text {
            Some(text) => train_config::read_text(&self.file, text, &self.dir, kind),
            None => {
                // A relative file is read in `dir` (named as given where that is here); a Python
                // `MODULE:FUNCTION` is no path.
                let here = self.dir.as_os_str() == "." || train_config::is_python_spec(&self.file);
                let spec = match here {
                    true => self.file.clone(),
                    false => self.dir.join(&self.file).to_string_lossy().into_owned(),
                };
                train_config::read_file(&spec, kind, &TorchTracer::from_env())
            }
        }
    }
}

impl StatedJob {
    /// What names the job in messages: its model, else its config.
    pub fn name(&self) -> String {
        match (&self.model, &self.train_config) {
            (Some(m), _) => m.trim().to_string(),
            (None, Some(c)) => c.file.clone(),
            (None, None) => "the job".into(),
        }
    }

    /// The workload the texts state (reading the trainer config, where one is stated).
    pub fn workload(&self) -> Result<Workload, StatedError> {
        let invalid = |field, message: StatedProblem| StatedError::Invalid { field, message };
        // An empty text states nothing (an annotation or key left blank): the default.
        let given = |t: &Option<String>| {
            t.as_deref()
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(str::to_string)
        };
        let whole = |field, t: &Option<String>| {
            given(t)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| invalid(field, StatedProblem::NotWhole(v.clone())))
                })
                .transpose()
        };
        let batch = whole(StatedField::Batch, &self.batch)?;
        let ranks = |e: OptionError| {
            invalid(
                StatedField::WorldSize,
                StatedProblem::Job(Box::new(e.into())),
            )
        };
        let world = whole(StatedField::WorldSize, &self.world_size)?
            .map(|w| match u32::try_from(w) {
                Ok(w) if (1..=gpumem_core::job::MAX_WORLD_SIZE).contains(&w) => Ok(w),
                _ => Err(ranks(OptionError::WorldSize(
                    u32::try_from(w).unwrap_or(u32::MAX),
                ))),
            })
            .transpose()?;
        let mut options = OptionValues::default();
        if let Some(p) = given(&self.precision) {
            options.precision = gpumem_core::job::Precision::parse(&p)
                .map_err(|e| invalid(StatedField::Precision, e.into()))?;
        }
        if let Some(o) = given(&self.optimizer) {
            options.optimizer = gpumem_core::job::Optimizer::parse(&o)
                .map_err(|e| invalid(StatedField::Optimizer, e.into()))?;
        }
        let (model, batch, options) = match &self.train_config {
            Some(c) => {
                let config = c
                    .read()
                    .map_err(|e| invalid(StatedField::TrainConfig, e.into()))?;
                config
                    .job(given(&self.model), batch, options, world)
                    .map_err(|e| invalid(StatedField::TrainConfig, e.into()))?
            }
            None => {
                // Ranks without a config: data parallel over them (DDP, PyTorch's buckets).
                if let Some(w) = world.filter(|w| *w > 1) {
                    let ddp = Strategy::ddp(w, gpumem_core::job::DDP_BUCKET_CAP_MB, false);
                    options.strategy = Some(ddp.map_err(ranks)?);
                }
                (given(&self.model), batch, options.check().map_err(ranks)?)
            }
        };
        let model = model.ok_or_else(|| invalid(StatedField::Model, StatedProblem::Missing))?;
        let batch = batch.ok_or_else(|| invalid(StatedField::Batch, StatedProblem::Missing))?;
        let model =
            ModelRef::parse(model.trim()).map_err(|e| invalid(StatedField::Model, e.into()))?;
        Workload::new(model, batch, options).map_err(|e| match e {
            WorkloadError::Batch(b) => invalid(StatedField::Batch, StatedProblem::Batch(b)),
            e => invalid(StatedField::Model, StatedProblem::Job(Box::new(e))),
        })
    }

    /// The replay estimate of the job (its largest reading, under the largest bound) on
    /// `profile`. Without `may_trace`, a PyTorch model is refused rather than traced.
    pub fn size(&self, profile: &GpuProfile, may_trace: bool) -> Result<Estimate, StatedError> {
        // A trainer config describes a PyTorch job: refused before its file is even read.
        if !may_trace && self.train_config.is_some() {
            return Err(StatedError::NeedsTrace(self.name()));
        }
        let workload = self.workload()?;
        if !may_trace && !workload.model().is_native() {
            return Err(StatedError::NeedsTrace(self.name()));
        }
        let replay = gpumem_core::estimate::by_name("replay").expect("replay is an estimator");
        workload
            .size(profile, replay.as_ref(), Workload::trace)
            .map(|s| s.estimate)
            .map_err(|e| match e {
                SizeError::Workload(e) if e.is_input() => StatedError::Invalid {
                    field: StatedField::Model,
                    message: StatedProblem::Job(Box::new(e)),
                },
                e => StatedError::Size(e),
            })
    }
}
