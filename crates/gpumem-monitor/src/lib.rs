//! gpumem-monitor: what the GPUs are doing now.
//!
//! [`Monitor`] is the trait consumers sample (the dataset collector, the daemon); a
//! [`GpuReading`] holds one GPU's memory in use and total, NVML's utilization, the memory of each
//! process on it, and DCGM's profiling fields ([`Dcgm`]: SMACT, SMOCC, GRACT, DRAMA, FP32A) when
//! available. Implementations:
//! - [`NvmlMonitor`]: NVML through nvml-wrapper (the driver library is loaded at run time, so this
//!   builds and fails cleanly without a GPU), plus [`DcgmiStream`] when `dcgmi` is installed.
//! - [`FakeMonitor`]: GPUs described by profiles whose usage a test, the CPU-only collector or a
//!   `--fake-gpus` daemon sets through a shared [`FakeGpus`] handle.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// DCGM profiling fields, fractions 0–1 (run averages or the latest sample).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Dcgm {
    pub gract: f64,
    pub smact: f64,
    pub smocc: f64,
    pub dram: f64,
    pub fp32: f64,
}

/// One GPU now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuReading {
    pub index: u32,
    pub name: String,
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// NVML's "GPU utilization" (share of time a kernel ran), 0–1.
    pub util: f64,
    /// (pid, bytes) of each compute process.
    pub processes: Vec<(u32, u64)>,
    pub dcgm: Option<Dcgm>,
}

/// The driver stack.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SystemInfo {
    pub driver: String,
    pub cuda: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MonitorError {
    #[error("NVML: {0}")]
    Nvml(String),
    #[error("no GPU {0} (this machine has {1})")]
    NoSuchGpu(u32, usize),
}

/// Something that can tell what the GPUs are doing.
pub trait Monitor: Send {
    fn gpu_count(&self) -> usize;
    fn read(&mut self, gpu: u32) -> Result<GpuReading, MonitorError>;
    fn system(&self) -> SystemInfo;
}

/// NVML, and DCGM through `dcgmi dmon` when it is installed.
pub struct NvmlMonitor {
    nvml: nvml_wrapper::Nvml,
    dcgm: Option<DcgmiStream>,
}

impl NvmlMonitor {
    /// Loads the driver's NVML; starts `dcgmi dmon` for `gpus` (all when `None`) at `period_ms`
    /// if dcgmi is available.
    pub fn new(gpus: Option<&[u32]>, period_ms: u32) -> Result<NvmlMonitor, MonitorError> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| MonitorError::Nvml(e.to_string()))?;
        let all: Vec<u32> = (0..nvml.device_count().unwrap_or(0)).collect();
        let watch = gpus.unwrap_or(&all);
        let dcgm = if watch.is_empty() {
            None
        } else {
            DcgmiStream::start(watch, period_ms)
        };
        Ok(NvmlMonitor { nvml, dcgm })
    }
}

impl Monitor for NvmlMonitor {
    fn gpu_count(&self) -> usize {
        self.nvml.device_count().unwrap_or(0) as usize
    }

    fn read(&mut self, gpu: u32) -> Result<GpuReading, MonitorError> {
        let nv = |e: nvml_wrapper::error::NvmlError| MonitorError::Nvml(e.to_string());
        if gpu as usize >= self.gpu_count() {
            return Err(MonitorError::NoSuchGpu(gpu, self.gpu_count()));
        }
        let d = self.nvml.device_by_index(gpu).map_err(nv)?;
        let mem = d.memory_info().map_err(nv)?;
        let util = d
            .utilization_rates()
            .map(|u| f64::from(u.gpu) / 100.0)
            .unwrap_or(0.0);
        let processes = d
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                let used = match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                };
                (p.pid, used)
            })
            .collect();
        Ok(GpuReading {
            index: gpu,
            name: d.name().unwrap_or_default(),
            used_bytes: mem.used,
            total_bytes: mem.total,
            util,
            processes,
            dcgm: self.dcgm.as_ref().and_then(|s| s.latest(gpu)),
        })
    }

    fn system(&self) -> SystemInfo {
        let cuda = self
            .nvml
            .sys_cuda_driver_version()
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
            .unwrap_or_default();
        SystemInfo {
            driver: self.nvml.sys_driver_version().unwrap_or_default(),
            cuda,
        }
    }
}

/// A running `dcgmi dmon` whose latest line per GPU is kept by a reader thread.
pub struct DcgmiStream {
    child: Child,
    latest: Arc<Mutex<Vec<Option<Dcgm>>>>,
}

/// DCGM field ids in the order [`parse_dmon_line`] reads them: GRACT, SMACT, SMOCC, DRAMA, FP32A.
pub const DCGM_FIELDS: &str = "1001,1002,1003,1005,1007";

impl DcgmiStream {
    /// `None` when dcgmi is not installed or does not start.
    pub fn start(gpus: &[u32], period_ms: u32) -> Option<DcgmiStream> {
        let ids: Vec<String> = gpus.iter().map(u32::to_string).collect();
        let mut child = Command::new("dcgmi")
            .args([
                "dmon",
                "-i",
                &ids.join(","),
                "-e",
                DCGM_FIELDS,
                "-d",
                &period_ms.max(100).to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let out = child.stdout.take()?;
        let latest = Arc::new(Mutex::new(vec![
            None;
            gpus.iter()
                .max()
                .map_or(0, |m| *m as usize + 1)
        ]));
        let sink = latest.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some((gpu, d)) = parse_dmon_line(&line)
                    && let Ok(mut l) = sink.lock()
                    && let Some(slot) = l.get_mut(gpu as usize)
                {
                    *slot = Some(d);
                }
            }
        });
        Some(DcgmiStream { child, latest })
    }

    pub fn latest(&self, gpu: u32) -> Option<Dcgm> {
        self.latest
            .lock()
            .ok()?
            .get(gpu as usize)
            .copied()
            .flatten()
    }
}

impl Drop for DcgmiStream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One data line of `dcgmi dmon -e 1001,1002,1003,1005,1007`: `GPU 0  0.512  0.433  0.201 …`.
/// Header lines and `N/A` values give `None`.
pub fn parse_dmon_line(line: &str) -> Option<(u32, Dcgm)> {
    let mut words = line.split_whitespace();
    if words.next()? != "GPU" {
        return None;
    }
    let gpu: u32 = words.next()?.parse().ok()?;
    let v: Vec<f64> = words
        .map(|w| w.parse::<f64>().ok())
        .collect::<Option<Vec<_>>>()?;
    let [gract, smact, smocc, dram, fp32] = v[..] else {
        return None;
    };
    Some((
        gpu,
        Dcgm {
            gract,
            smact,
            smocc,
            dram,
            fp32,
        },
    ))
}

/// What a fake GPU is doing; set through [`FakeGpus`].
#[derive(Debug, Clone, PartialEq)]
pub struct FakeGpu {
    pub name: String,
    pub total_bytes: u64,
    /// Memory of the driver and other tenants, always present.
    pub base_bytes: u64,
    /// (pid, bytes) of the processes on it.
    pub processes: Vec<(u32, u64)>,
    pub dcgm: Dcgm,
}

/// A shared handle on fake GPUs.
pub type FakeGpus = Arc<Mutex<Vec<FakeGpu>>>;

/// GPUs that exist only in memory.
pub struct FakeMonitor {
    pub gpus: FakeGpus,
}

impl FakeMonitor {
    /// `count` GPUs called `name` with `total_bytes` each.
    pub fn new(count: usize, name: &str, total_bytes: u64) -> FakeMonitor {
        let gpu = FakeGpu {
            name: name.into(),
            total_bytes,
            base_bytes: 0,
            processes: Vec::new(),
            dcgm: Dcgm::default(),
        };
        FakeMonitor {
            gpus: Arc::new(Mutex::new(vec![gpu; count])),
        }
    }
}

impl Monitor for FakeMonitor {
    fn gpu_count(&self) -> usize {
        self.gpus.lock().map_or(0, |g| g.len())
    }

    fn read(&mut self, gpu: u32) -> Result<GpuReading, MonitorError> {
        let gpus = self
            .gpus
            .lock()
            .map_err(|_| MonitorError::Nvml("fake monitor poisoned".into()))?;
        let g = gpus
            .get(gpu as usize)
            .ok_or(MonitorError::NoSuchGpu(gpu, gpus.len()))?;
        let used = g.base_bytes + g.processes.iter().map(|p| p.1).sum::<u64>();
        Ok(GpuReading {
            index: gpu,
            name: g.name.clone(),
            used_bytes: used.min(g.total_bytes),
            total_bytes: g.total_bytes,
            util: g.dcgm.gract,
            processes: g.processes.clone(),
            dcgm: Some(g.dcgm),
        })
    }

    fn system(&self) -> SystemInfo {
        SystemInfo {
            driver: "fake".into(),
            cuda: "fake".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dmon_lines() {
        assert_eq!(
            parse_dmon_line("GPU 1     0.512  0.433  0.201  0.100  0.050"),
            Some((
                1,
                Dcgm {
                    gract: 0.512,
                    smact: 0.433,
                    smocc: 0.201,
                    dram: 0.1,
                    fp32: 0.05
                }
            ))
        );
        assert_eq!(
            parse_dmon_line("#Entity   GRACT  SMACT  SMOCC  DRAMA  FP32A"),
            None
        );
        assert_eq!(parse_dmon_line("ID"), None);
        assert_eq!(
            parse_dmon_line("GPU 0     N/A    N/A    N/A    N/A    N/A"),
            None
        );
        assert_eq!(parse_dmon_line("GPU 0     0.1 0.2"), None, "too few fields");
    }

    #[test]
    fn fake_gpus_report_what_is_set() {
        let mut m = FakeMonitor::new(2, "A100", 40 << 30);
        m.gpus.lock().unwrap()[1].processes.push((42, 3 << 30));
        let r = m.read(1).unwrap();
        assert_eq!(
            (r.used_bytes, r.total_bytes, r.processes.clone()),
            (3 << 30, 40 << 30, vec![(42, 3 << 30)])
        );
        assert_eq!(m.read(0).unwrap().used_bytes, 0);
        assert_eq!(m.read(2).unwrap_err(), MonitorError::NoSuchGpu(2, 2));
    }

    #[test]
    fn nvml_fails_cleanly_without_a_driver() {
        // On machines with a GPU this succeeds; either way it must not panic.
        match NvmlMonitor::new(Some(&[0]), 100) {
            Ok(mut m) => assert!(m.gpu_count() == 0 || m.read(0).is_ok()),
            Err(MonitorError::Nvml(msg)) => assert!(!msg.is_empty()),
            Err(e) => panic!("{e}"),
        }
    }
}
