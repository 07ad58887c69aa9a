//! gpumem-torch: trace real PyTorch models through the `gpumem_trace` Python package.
//!
//! [`TorchTracer`] runs the tracer (embedded in this binary and unpacked into the cache directory)
//! with the user's interpreter (`GPUMEM_PYTHON`, else `python3`), caches each trace by
//! (reference, options, torch version, tracer version), and turns tracer failures into
//! [`BridgeError`]s carrying the tail of the Python error. [`TraceRequest`] is what to trace;
//! [`TorchTracer::symbolic`] traces a model at three batch sizes and fits a
//! [`gpumem_core::symbolic::SymbolicTrace`], so any batch size is answered without re-tracing.

use std::fs;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::UNIX_EPOCH;

use gpumem_core::depth;
use gpumem_core::symbolic::{SymbolicError, SymbolicTrace};
use gpumem_core::trace::Trace;
use gpumem_core::workload::{AttentionMask, Checkpointing, Options, Validate};

/// The tracer's sources, embedded so that `gpumem` needs only torch in the user's interpreter.
const SOURCES: [(&str, &str); 18] = [
    (
        "__init__.py",
        include_str!("../../../python/gpumem_trace/__init__.py"),
    ),
    (
        "__main__.py",
        include_str!("../../../python/gpumem_trace/__main__.py"),
    ),
    (
        "amp.py",
        include_str!("../../../python/gpumem_trace/amp.py"),
    ),
    (
        "cuda.py",
        include_str!("../../../python/gpumem_trace/cuda.py"),
    ),
    (
        "device.py",
        include_str!("../../../python/gpumem_trace/device.py"),
    ),
    (
        "distributed.py",
        include_str!("../../../python/gpumem_trace/distributed.py"),
    ),
    (
        "families.py",
        include_str!("../../../python/gpumem_trace/families.py"),
    ),
    (
        "loop.py",
        include_str!("../../../python/gpumem_trace/loop.py"),
    ),
    (
        "lora.py",
        include_str!("../../../python/gpumem_trace/lora.py"),
    ),
    (
        "models.py",
        include_str!("../../../python/gpumem_trace/models.py"),
    ),
    (
        "parallel.py",
        include_str!("../../../python/gpumem_trace/parallel.py"),
    ),
    (
        "pool.py",
        include_str!("../../../python/gpumem_trace/pool.py"),
    ),
    (
        "probe.py",
        include_str!("../../../python/gpumem_trace/probe.py"),
    ),
    (
        "record.py",
        include_str!("../../../python/gpumem_trace/record.py"),
    ),
    (
        "run.py",
        include_str!("../../../python/gpumem_trace/run.py"),
    ),
    (
        "sdpa.py",
        include_str!("../../../python/gpumem_trace/sdpa.py"),
    ),
    (
        "tracer.py",
        include_str!("../../../python/gpumem_trace/tracer.py"),
    ),
    (
        "zero.py",
        include_str!("../../../python/gpumem_trace/zero.py"),
    ),
];

use gpumem_core::workload::Strategy;

mod pool;
pub mod probe;

/// What to trace: a PyTorch reference at a batch size, the typed options of its loop, and what
/// the tracer needs of the target GPU. Built from a workload (`gpumem-workload`), or directly by
/// this crate's tests.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceRequest {
    pub model: String,
    /// The whole batch (a DataParallel job's is what the wrapper splits; the trace is GPU 0's).
    pub batch: u64,
    pub options: Options,
    /// Compute capability of the GPU the job will run on (`9.0`): with the installed torch it
    /// decides which attention kernel runs.
    pub gpu_capability: String,
    /// An attention kernel the profile forces (`flash`, `efficient`, `cudnn`, `math`).
    pub sdpa: Option<String>,
    pub iterations: u32,
}

impl TraceRequest {
    /// A request with default options for an A100 (compute capability 8.0).
    pub fn new(model: impl Into<String>, batch: u64) -> Self {
        TraceRequest {
            model: model.into(),
            batch,
            options: Options::default(),
            gpu_capability: "8.0".into(),
            sdpa: None,
            iterations: 3,
        }
    }

    /// A request at `batch` for a job that will run on `profile`'s GPU (its attention kernel).
    pub fn for_gpu(
        model: impl Into<String>,
        batch: u64,
        options: Options,
        profile: &gpumem_core::profile::GpuProfile,
    ) -> Self {
        TraceRequest {
            options,
            gpu_capability: profile.compute_capability.clone(),
            sdpa: profile.sdpa.map(|b| b.name().to_string()),
            ..TraceRequest::new(model, batch)
        }
    }

    /// The tracer's arguments, except the batch sizes and output files.
    pub fn args(&self) -> Vec<String> {
        let o = &self.options;
        let mut a = vec![
            self.model.clone(),
            "--optimizer".into(),
            o.optimizer.name().into(),
            "--precision".into(),
            o.precision.name().into(),
            "--gpu-capability".into(),
            self.gpu_capability.clone(),
            "--iterations".into(),
            self.iterations.to_string(),
            "--grad-accum".into(),
            o.grad_accum.to_string(),
        ];
        if let Some(i) = o.input {
            a.extend(["--input".into(), i.to_string()]);
        }
        if let Some(s) = o.seq_len {
            a.extend(["--seq-len".into(), s.to_string()]);
        }
        if o.data_parallel > 1 {
            a.extend(["--data-parallel".into(), o.data_parallel.to_string()]);
        }
        if o.validate != Validate::None {
            a.extend(["--validate".into(), o.validate.name().into()]);
        }
        if let Some(s) = &self.sdpa {
            a.extend(["--sdpa".into(), s.clone()]);
        }
        if let Some(out) = o.outputs {
            a.extend(["--outputs".into(), out.name().into()]);
        }
        if o.attention_mask != AttentionMask::None {
            a.extend(["--attention-mask".into(), o.attention_mask.name().into()]);
        }
        if o.checkpointing != Checkpointing::Off {
            a.push("--checkpointing".into());
        }
        if o.checkpointing == Checkpointing::Selective {
            a.push("--selective".into());
        }
        if o.channels_last {
            a.push("--channels-last".into());
        }
        match o.strategy {
            Some(Strategy::Ddp {
                world_size,
                bucket_cap_mb,
                bucket_view,
            }) => {
                a.extend([
                    "--strategy".into(),
                    "ddp".into(),
                    "--world-size".into(),
                    world_size.to_string(),
                    "--bucket-cap-mb".into(),
                    bucket_cap_mb.to_string(),
                ]);
                if bucket_view {
                    a.push("--gradient-as-bucket-view".into());
                }
            }
            Some(Strategy::Fsdp {
                world_size,
                reshard_after_forward,
                param_dtype,
                replicas,
                cpu_offload,
            }) => {
                a.extend([
                    "--strategy".into(),
                    "fsdp".into(),
                    "--world-size".into(),
                    world_size.to_string(),
                ]);
                if cpu_offload {
                    a.push("--cpu-offload".into());
                }
                if replicas > 1 {
                    a.extend(["--replicas".into(), replicas.to_string()]);
                }
                if !reshard_after_forward {
                    a.push("--no-reshard-after-forward".into());
                }
                if let Some(d) = param_dtype {
                    a.extend(["--fsdp-param-dtype".into(), d.name().into()]);
                }
            }
            Some(
                s @ Strategy::Zero {
                    world_size, zero, ..
                },
            ) => {
                let zero = serde_json::to_string(&zero).expect("plain numbers and flags serialise");
                a.extend([
                    "--strategy".into(),
                    s.name().into(),
                    "--world-size".into(),
                    world_size.to_string(),
                    "--zero".into(),
                    zero,
                ]);
            }
            None => {}
        }
        if let Some(l) = &o.lora {
            a.extend([
                "--lora-rank".into(),
                l.rank.to_string(),
                "--lora-alpha".into(),
                l.alpha.to_string(),
                "--lora-targets".into(),
                l.targets.join(","),
            ]);
            if l.dropout > 0.0 {
                a.extend(["--lora-dropout".into(), l.dropout.to_string()]);
            }
            if let Some(q) = l.quant {
                a.extend([
                    "--lora-quant".into(),
                    if q.nf4 { "nf4" } else { "fp4" }.into(),
                ]);
                if !q.double_quant {
                    a.push("--lora-single-quant".into());
                }
            }
        }
        a
    }
}

/// Why a trace could not be had.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// The model reference or an option is wrong (the tracer's exit code 2).
    #[error("{0}")]
    BadReference(String),
    /// The interpreter could not be run, or torch is missing.
    #[error("{0}")]
    Python(String),
    /// The model itself failed, or the tracer timed out.
    #[error("{0}")]
    Model(String),
    #[error("{0}")]
    Io(String),
}

/// Runs the tracer and caches its traces.
#[derive(Debug, Clone)]
pub struct TorchTracer {
    pub python: String,
    pub cache_dir: PathBuf,
    /// Seconds before a trace is abandoned.
    pub timeout_s: u64,
}

/// A name for a temporary file or directory, unique per process and call: the threads of one
/// process (parallel tests, a daemon's requests) may write the same cache entry at once.
fn temp_suffix() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "tmp{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// FNV-1a: a stable hash for cache keys (std's hasher may change between releases).
fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text
        .lines()
        .filter(|l| {
            !l.trim().is_empty()
                && !l.contains("Failed to initialize NumPy")
                && !l.contains("_conversion_method_template")
        })
        .collect();
    v[v.len().saturating_sub(lines)..].join(" | ")
}

impl TorchTracer {
    /// Interpreter from `GPUMEM_PYTHON` (else `python3`); cache under `GPUMEM_CACHE`, else
    /// `$XDG_CACHE_HOME/gpumem`, else `~/.cache/gpumem`.
    pub fn from_env() -> Self {
        let python = std::env::var("GPUMEM_PYTHON")
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "python3".into());
        let cache_dir = std::env::var_os("GPUMEM_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("gpumem")))
            .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/gpumem")))
            .unwrap_or_else(|| std::env::temp_dir().join("gpumem"));
        let timeout_s = std::env::var("GPUMEM_TRACE_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(900);
        TorchTracer {
            python,
            cache_dir,
            timeout_s,
        }
    }

    fn io(&self, what: &Path, e: std::io::Error) -> BridgeError {
        BridgeError::Io(format!("{}: {e}", what.display()))
    }

    /// Unpacks the embedded tracer (once per version of its sources); returns its parent dir.
    fn package_dir(&self) -> Result<PathBuf, BridgeError> {
        let digest = fnv(&SOURCES
            .iter()
            .flat_map(|(n, s)| [*n, *s])
            .collect::<Vec<_>>());
        let root = self.cache_dir.join(format!("tracer-{digest:016x}"));
        let pkg = root.join("gpumem_trace");
        if !pkg.join("tracer.py").exists() {
            let tmp = self
                .cache_dir
                .join(format!("tracer-{digest:016x}.{}", temp_suffix()));
            let tpkg = tmp.join("gpumem_trace");
            fs::create_dir_all(&tpkg).map_err(|e| self.io(&tpkg, e))?;
            for (name, text) in SOURCES {
                fs::write(tpkg.join(name), text).map_err(|e| self.io(&tpkg, e))?;
            }
            if fs::rename(&tmp, &root).is_err() {
                // Another process won the race; its copy is identical.
                let _ = fs::remove_dir_all(&tmp);
            }
        }
        Ok(root)
    }

    /// The torch version of the interpreter, remembered per interpreter and re-checked only when
    /// torch's version file changes (so cache hits spawn no Python).
    pub fn torch_version(&self) -> Result<String, BridgeError> {
        let memo = self
            .cache_dir
            .join(format!("python-{:016x}.txt", fnv(&[&self.python])));
        if let Ok(text) = fs::read_to_string(&memo) {
            let mut it = text.lines();
            if let (Some(ver), Some(file), Some(stamp)) = (it.next(), it.next(), it.next())
                && mtime(Path::new(file)).map(|m| m.to_string()) == Some(stamp.to_string())
            {
                return Ok(ver.to_string());
            }
        }
        let out = Command::new(&self.python)
            .args(["-c", "import importlib.util as u, importlib.metadata as m; s=u.find_spec('torch'); print(m.version('torch')); print(s.submodule_search_locations[0] + '/version.py')"])
            .output()
            .map_err(|e| BridgeError::Python(format!("cannot run the Python interpreter `{}`: {e} (set GPUMEM_PYTHON)", self.python)))?;
        if !out.status.success() {
            return Err(BridgeError::Python(format!(
                "torch is not installed for `{}` ({}); install it there or set GPUMEM_PYTHON",
                self.python,
                tail(&String::from_utf8_lossy(&out.stderr), 1)
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut it = text.lines();
        let ver = it.next().unwrap_or("unknown").trim().to_string();
        if let Some(file) = it.next()
            && let Some(stamp) = mtime(Path::new(file.trim()))
        {
            let _ = fs::create_dir_all(&self.cache_dir);
            let _ = fs::write(&memo, format!("{ver}\n{}\n{stamp}\n", file.trim()));
        }
        Ok(ver)
    }

    fn cache_key(&self, req: &TraceRequest, torch: &str) -> u64 {
        // A user's model file is part of the key: editing it must not serve a stale trace.
        let user_file = req
            .model
            .strip_prefix("py:")
            .and_then(|r| r.rsplit_once(':'))
            .map(|(path, _)| mtime(Path::new(path)).unwrap_or(0).to_string())
            .unwrap_or_default();
        fnv(&[
            &format!("{req:?}"),
            torch,
            env!("CARGO_PKG_VERSION"),
            &format!("{:x}", fnv(&SOURCES.map(|s| s.1))),
            &user_file,
        ])
    }

    fn cache_path(&self, req: &TraceRequest, torch: &str) -> PathBuf {
        self.cache_dir
            .join("traces")
            .join(format!("{:016x}.jsonl", self.cache_key(req, torch)))
    }

    /// Where the batch-symbolic trace of `req`'s model and options (any batch) is kept.
    fn symbolic_path(&self, req: &TraceRequest, torch: &str) -> PathBuf {
        let key = self.cache_key(
            &TraceRequest {
                batch: 0,
                ..req.clone()
            },
            torch,
        );
        self.cache_dir
            .join("traces")
            .join(format!("{key:016x}.sym.json"))
    }

    fn cached_symbolic(&self, req: &TraceRequest, torch: &str) -> Option<SymbolicTrace> {
        let f = fs::File::open(self.symbolic_path(req, torch)).ok()?;
        SymbolicTrace::read(BufReader::new(f)).ok()
    }

    /// Batch sizes a symbolic trace of `req` is fitted at, besides `with` where given: whole
    /// multiples of a DataParallel job's GPU count (every GPU gets the same rows), so the fit is
    /// exact at any multiple.
    fn fit_batches(req: &TraceRequest, with: Option<u64>) -> Vec<u64> {
        let gpus = u64::from(req.options.data_parallel.max(1));
        let mut batches: Vec<u64> = with.into_iter().collect();
        for b in SymbolicTrace::FIT_BATCHES.map(|b| b * gpus) {
            if batches.len() < SymbolicTrace::FIT_BATCHES.len() && !batches.contains(&b) {
                batches.push(b);
            }
        }
        batches
    }

    /// The trace for `req`: evaluated from the model's batch-symbolic trace where one is
    /// cached, else from the trace cache, else by running the tracer.
    pub fn trace(&self, req: &TraceRequest) -> Result<Trace, BridgeError> {
        self.trace_with(req, false)
    }

    /// [`TorchTracer::trace`], and where the tracer must run, two more batch sizes in the same
    /// process to fit the model's batch-symbolic trace: the next batch size of this model and
    /// options then costs no Python at all (what a user trying batch sizes wants).
    pub fn trace_for_reestimates(&self, req: &TraceRequest) -> Result<Trace, BridgeError> {
        self.trace_with(req, true)
    }

    fn trace_with(&self, req: &TraceRequest, fit: bool) -> Result<Trace, BridgeError> {
        let torch = self.torch_version()?;
        let symbolic_ok = req
            .batch
            .is_multiple_of(u64::from(req.options.data_parallel.max(1)));
        if symbolic_ok
            && let Some(sym) = self.cached_symbolic(req, &torch)
            && let Ok(t) = sym.at(req.batch)
        {
            return Ok(t);
        }
        let path = self.cache_path(req, &torch);
        if let Some(t) = read_trace(&path) {
            return Ok(t);
        }
        let batches = if fit && symbolic_ok {
            Self::fit_batches(req, Some(req.batch))
        } else {
            vec![req.batch]
        };
        let mut traces = self.run_and_cache(req, &torch, &batches)?;
        if traces.len() == SymbolicTrace::FIT_BATCHES.len() {
            let _ = self.cache_symbolic(req, &torch, &traces);
        }
        Ok(traces.swap_remove(0))
    }

    /// Runs the tracer once for `batches` (the first is `req`'s own batch size where it matters)
    /// and caches each trace; returns them in that order. A model with many identical blocks
    /// is traced cut to [`depth::DEPTHS`] and rebuilt at its whole depth
    /// ([`depth::extrapolate`]) — or whole, where its strategy's buffers span blocks — at
    /// one batch size only; at the others it is traced cut to the shallowest depth, and
    /// [`SymbolicTrace::transfer`] carries what the batch does to those cut traces' events over
    /// to that whole trace. Where either does not hold, it is traced whole after all.
    fn run_and_cache(
        &self,
        req: &TraceRequest,
        torch: &str,
        batches: &[u64],
    ) -> Result<Vec<Trace>, BridgeError> {
        let dir = self.cache_dir.join("traces");
        fs::create_dir_all(&dir).map_err(|e| self.io(&dir, e))?;
        let jobs: Vec<(PathBuf, PathBuf)> = batches
            .iter()
            .map(|&b| {
                let path = self.cache_path(
                    &TraceRequest {
                        batch: b,
                        ..req.clone()
                    },
                    torch,
                );
                let tmp = path.with_extension(temp_suffix());
                (path, tmp)
            })
            .collect();
        let tmps: Vec<&Path> = jobs.iter().map(|(_, tmp)| tmp.as_path()).collect();
        // The tracer takes the whole depth at the first batch size it is given: the one with
        // the largest odd factor, at which a block's tensors least often coincide in size with
        // one another (the model's sizes are mostly powers of two; at 4, a 2048-token batch's
        // activation may weigh what a 4096-wide weight does), which SymbolicTrace::transfer
        // cannot tell apart.
        let lead = (0..batches.len())
            .max_by_key(|&i| {
                (
                    batches[i] >> batches[i].trailing_zeros(),
                    std::cmp::Reverse(i),
                )
            })
            .unwrap_or(0);
        let order: Vec<usize> = std::iter::once(lead)
            .chain((0..batches.len()).filter(|&i| i != lead))
            .collect();
        self.run(
            req,
            &order.iter().map(|&i| batches[i]).collect::<Vec<_>>(),
            &order.iter().map(|&i| tmps[i]).collect::<Vec<_>>(),
            true,
        )?;
        // Cut to the shallowest depth at every batch size: what the batch does to each event.
        let shallowest = |out: &Path| depth_path(out, depth::DEPTHS[0]);
        let cut: Option<Vec<Trace>> =
            if carries_batch(batches) && tmps.iter().all(|t| shallowest(t).exists()) {
                Some(
                    tmps.iter()
                        .zip(batches)
                        .map(|(t, &b)| self.read_tracer_output(req, &shallowest(t), b))
                        .collect::<Result<_, _>>()?,
                )
            } else {
                None
            };
        let mut traces: Vec<Option<Trace>> = vec![None; batches.len()];
        for (i, (&tmp, &b)) in tmps.iter().zip(batches).enumerate() {
            if tmp.exists() {
                traces[i] = Some(self.read_tracer_output(req, tmp, b)?);
            } else if i == lead || cut.is_none() {
                traces[i] = self.rebuild_depth(req, tmp, b)?;
            }
        }
        if let (Some(cut), Some(whole)) = (&cut, &traces[lead])
            && let Ok(sym) = SymbolicTrace::transfer(whole, cut)
        {
            for (t, &b) in traces.iter_mut().zip(batches) {
                if t.is_none() {
                    *t = sym.at(b).ok();
                }
            }
        }
        for tmp in &tmps {
            let _ = fs::remove_file(shallowest(tmp));
        }
        let whole: Vec<usize> = (0..batches.len())
            .filter(|&i| traces[i].is_none())
            .collect();
        if !whole.is_empty() {
            let again: Vec<&Path> = whole.iter().map(|&i| tmps[i]).collect();
            self.run(
                req,
                &whole.iter().map(|&i| batches[i]).collect::<Vec<_>>(),
                &again,
                false,
            )?;
            for &i in &whole {
                traces[i] = Some(self.read_tracer_output(req, tmps[i], batches[i])?);
            }
        }
        let mut out = Vec::new();
        for ((path, tmp), t) in jobs.iter().zip(traces) {
            let t = t.expect("every batch traced, cut or whole");
            if !tmp.exists() {
                // Rebuilt from cut traces: cached as the tracer's own would be.
                let mut w =
                    std::io::BufWriter::new(fs::File::create(tmp).map_err(|e| self.io(tmp, e))?);
                t.write(&mut w)
                    .and_then(|()| w.flush())
                    .map_err(|e| self.io(tmp, e))?;
            }
            fs::rename(tmp, path).map_err(|e| self.io(path, e))?;
            out.push(t);
        }
        Ok(out)
    }

    fn read_tracer_output(
        &self,
        req: &TraceRequest,
        path: &Path,
        batch: u64,
    ) -> Result<Trace, BridgeError> {
        let f = fs::File::open(path).map_err(|e| self.io(path, e))?;
        Trace::read(BufReader::new(f)).map_err(|e| {
            BridgeError::Model(format!(
                "the tracer wrote a bad trace for {} at batch {batch}: {e}",
                req.model
            ))
        })
    }

    /// The whole model's trace from the cut ones the tracer wrote next to `out` (removed);
    /// `None` where the events one block adds do not repeat.
    fn rebuild_depth(
        &self,
        req: &TraceRequest,
        out: &Path,
        batch: u64,
    ) -> Result<Option<Trace>, BridgeError> {
        let paths = depth::DEPTHS.map(|d| depth_path(out, d));
        let read: Result<Vec<Trace>, BridgeError> = paths
            .iter()
            .map(|p| self.read_tracer_output(req, p, batch))
            .collect();
        for p in &paths {
            let _ = fs::remove_file(p);
        }
        let cut: [Trace; 3] = read?.try_into().map_err(|_| {
            BridgeError::Model(format!(
                "the tracer wrote no trace for {} at batch {batch}",
                req.model
            ))
        })?;
        let blocks = cut[0].header.blocks.unwrap_or(0);
        Ok(depth::extrapolate(&cut, blocks).ok())
    }

    /// Fits and stores the symbolic trace; a model whose traces do not align (batch-dependent
    /// control flow) has none, and is traced per batch size.
    fn cache_symbolic(
        &self,
        req: &TraceRequest,
        torch: &str,
        traces: &[Trace],
    ) -> Result<SymbolicTrace, SymbolicError> {
        let sym = SymbolicTrace::fit(traces)?;
        let path = self.symbolic_path(req, torch);
        let tmp = path.with_extension(temp_suffix());
        let written = fs::File::create(&tmp).ok().and_then(|f| {
            let mut w = std::io::BufWriter::new(f);
            sym.write(&mut w).ok()?;
            w.flush().ok()
        });
        if written.is_some() {
            let _ = fs::rename(&tmp, &path);
        } else {
            let _ = fs::remove_file(&tmp);
        }
        Ok(sym)
    }

    /// `python -m MODULE` with the embedded package importable (the tracer, or the workload
    /// runner `gpumem_trace.run`).
    pub fn module_command(&self, module: &str) -> Result<Command, BridgeError> {
        let pkg = self.package_dir()?;
        let mut pythonpath = pkg.into_os_string();
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            pythonpath.push(":");
            pythonpath.push(old);
        }
        let mut cmd = Command::new(&self.python);
        cmd.arg("-m")
            .arg(module)
            .env("PYTHONPATH", pythonpath)
            .env("PYTHONDONTWRITEBYTECODE", "1");
        Ok(cmd)
    }

    /// `cut`: with `--depths` (see [`TorchTracer::run_and_cache`]). In a fork of this process's
    /// tracer pool where it runs (see the `pool` module), else as a process of its own.
    fn run(
        &self,
        req: &TraceRequest,
        batches: &[u64],
        outs: &[&Path],
        cut: bool,
    ) -> Result<(), BridgeError> {
        let mut argv = req.args();
        argv.push("--batch".into());
        argv.extend(batches.iter().map(u64::to_string));
        argv.push("--out".into());
        argv.extend(outs.iter().map(|o| o.to_string_lossy().into_owned()));
        argv.extend(["--timeout".into(), self.timeout_s.to_string()]);
        if cut {
            argv.push("--depths".into());
            argv.extend(depth::DEPTHS.map(|d| d.to_string()));
            if carries_batch(batches) {
                argv.push("--slopes".into());
            }
        }
        let pool = outs
            .iter()
            .all(|o| o.to_str().is_some())
            .then(|| self.pool())
            .flatten();
        let log = self
            .cache_dir
            .join("traces")
            .join(format!("tracer.{}.log", temp_suffix()));
        let pooled = pool.and_then(|p| p.run(&argv, &log).ok()).map(|code| {
            let stderr = fs::read_to_string(&log).unwrap_or_default();
            let _ = fs::remove_file(&log);
            (code, stderr)
        });
        let (code, stderr) = match pooled {
            Some(done) => done,
            None => {
                let mut cmd = self.module_command("gpumem_trace")?;
                let res = cmd.args(&argv).output().map_err(|e| {
                    BridgeError::Python(format!(
                        "cannot run the Python interpreter `{}`: {e} (set GPUMEM_PYTHON)",
                        self.python
                    ))
                })?;
                (
                    res.status.code(),
                    String::from_utf8_lossy(&res.stderr).into_owned(),
                )
            }
        };
        if code == Some(0) {
            return Ok(());
        }
        for out in outs {
            let _ = fs::remove_file(out);
            for d in depth::DEPTHS {
                let _ = fs::remove_file(depth_path(out, d));
            }
        }
        let msg = tail(&stderr, 3);
        let msg = msg
            .strip_prefix("gpumem_trace: ")
            .unwrap_or(&msg)
            .to_string();
        Err(match code {
            Some(2) => BridgeError::BadReference(msg),
            Some(3) | Some(4) => BridgeError::Model(format!("tracer failed: {msg}")),
            Some(c) => BridgeError::Python(format!("tracer failed (exit status {c}): {msg}")),
            None => BridgeError::Python(format!("tracer failed (ended by a signal): {msg}")),
        })
    }

    /// This interpreter's tracer pool, started at its first trace.
    fn pool(&self) -> Option<std::sync::Arc<pool::Pool>> {
        let pkg = self.package_dir().ok()?;
        pool::Pool::shared(format!("{}\n{}", self.python, pkg.display()), || {
            self.module_command("gpumem_trace.pool").ok()
        })
    }

    /// The batch-symbolic trace of `req`'s model and options: from the cache, or fitted from
    /// traces at [`SymbolicTrace::FIT_BATCHES`] (one tracer run).
    pub fn symbolic(&self, req: &TraceRequest) -> Result<SymbolicTrace, BridgeError> {
        let torch = self.torch_version()?;
        if let Some(sym) = self.cached_symbolic(req, &torch) {
            return Ok(sym);
        }
        let batches = Self::fit_batches(req, None);
        let cached: Vec<Option<Trace>> = batches
            .iter()
            .map(|&b| {
                read_trace(&self.cache_path(
                    &TraceRequest {
                        batch: b,
                        ..req.clone()
                    },
                    &torch,
                ))
            })
            .collect();
        let traces = if cached.iter().all(Option::is_some) {
            cached.into_iter().flatten().collect()
        } else {
            self.run_and_cache(req, &torch, &batches)?
        };
        self.cache_symbolic(req, &torch, &traces)
            .map_err(|e| BridgeError::Model(format!("{}: its traces do not align across batch sizes ({e}); trace each batch size instead", req.model)))
    }
}

/// Whether a cut run of `batches` traces the whole depth at one of them and carries the batch
/// over from the model cut to the shallowest depth at each (`--slopes`).
fn carries_batch(batches: &[u64]) -> bool {
    batches.len() >= SymbolicTrace::FIT_BATCHES.len()
}

/// Where the tracer writes `out`'s trace cut to `depth` blocks.
fn depth_path(out: &Path, depth: u32) -> PathBuf {
    let mut p = out.as_os_str().to_owned();
    p.push(format!(".depth{depth}"));
    PathBuf::from(p)
}

fn read_trace(path: &Path) -> Option<Trace> {
    Trace::read(BufReader::new(fs::File::open(path).ok()?)).ok()
}

fn mtime(p: &Path) -> Option<u128> {
    fs::metadata(p)
        .ok()?
        .modified()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments() {
        use gpumem_core::workload::InputShape;
        let mut r = TraceRequest::new("timm:resnet50", 8);
        r.options.input = InputShape::parse("3x160x160");
        r.options.checkpointing = Checkpointing::Full;
        let a = r.args().join(" ");
        assert!(
            a.starts_with("timm:resnet50 --optimizer adam --precision fp32 --gpu-capability 8.0"),
            "{a}"
        );
        assert!(
            a.contains("--input 3x160x160") && a.ends_with("--checkpointing"),
            "{a}"
        );
    }

    #[test]
    fn every_tracer_source_is_embedded() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/gpumem_trace");
        let mut on_disk: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".py"))
            .collect();
        on_disk.sort();
        let embedded: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            on_disk, embedded,
            "SOURCES must list python/gpumem_trace/*.py, sorted"
        );
    }

    #[test]
    fn a_missing_interpreter_is_a_clear_error() {
        let t = TorchTracer {
            python: "/nonexistent/python".into(),
            cache_dir: std::env::temp_dir().join("gpumem-bridge-test"),
            timeout_s: 5,
        };
        let e = t
            .trace(&TraceRequest::new("timm:resnet50", 2))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot run the Python interpreter `/nonexistent/python`"),
            "{e}"
        );
    }
}
