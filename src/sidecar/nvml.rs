//! The NVML backend: the real one. Reads every device's name, UUID, memory,
//! compute capability, utilization, MIG and accounting modes, and its
//! running compute processes with their memory. Where NVML accounting is on
//! (`nvidia-smi -am 1`), each process's exact lifetime maximum is read too,
//! including one last time right after the process has ended.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Mutex;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

use super::source::{Backend, GpuInfo, GpuSource, ProcessObservation, SourceSample};
use super::SidecarError;

/// What the sidecar remembers about a device between samples.
#[derive(Debug, Clone, Default)]
struct Known {
    uuid: String,
    name: String,
    total: u64,
    compute_capability: Option<String>,
    /// PIDs seen at the last sample, to report accounting maxima of those that ended.
    pids: HashSet<u32>,
}

/// Reads GPUs through NVML.
pub struct NvmlSource {
    nvml: Nvml,
    count: u32,
    known: Mutex<HashMap<u32, Known>>,
}

/// The library name NVML is loaded by when no path is given.
pub const DEFAULT_LIB: &str = "libnvidia-ml.so.1";

impl NvmlSource {
    /// Loads and initializes NVML (from `lib` when given, else through the
    /// dynamic loader's search path). A failure says what was tried and what to do.
    pub fn open(lib: Option<PathBuf>) -> Result<Self, SidecarError> {
        Self::open_with_advice(lib, SIDECAR_ADVICE)
    }

    /// Like [`NvmlSource::open`], ending a failure with `advice`: the flags
    /// of the command that opens it (the sidecar's backends are no help to
    /// `suggest --gpu auto`).
    pub fn open_with_advice(lib: Option<PathBuf>, advice: &str) -> Result<Self, SidecarError> {
        let tried = match &lib {
            Some(p) => format!("loading NVML from {}", p.display()),
            None => format!(
                "loading {DEFAULT_LIB} through the dynamic loader (LD_LIBRARY_PATH, ld.so.cache)"
            ),
        };
        let result = match &lib {
            Some(p) => Nvml::builder().lib_path(OsStr::new(p)).init(),
            None => Nvml::init(),
        };
        let nvml = result
            .map_err(|e| SidecarError::Nvml(format!("{}{advice}", nvml_failure(&tried, &e))))?;
        let count = nvml.device_count().map_err(|e| {
            SidecarError::Nvml(format!(
                "NVML loaded but cannot count devices: {e}. Check that the NVIDIA driver is loaded (`nvidia-smi` works) and that this process may open /dev/nvidia*{advice}"
            ))
        })?;
        if count == 0 {
            tracing::warn!("NVML sees no GPU on this node");
        }
        Ok(Self {
            nvml,
            count,
            known: Mutex::new(HashMap::new()),
        })
    }

    fn read_device(
        &self,
        index: u32,
        known: &mut Known,
    ) -> Result<(GpuInfo, Vec<ProcessObservation>), String> {
        let dev = self
            .nvml
            .device_by_index(index)
            .map_err(|e| format!("cannot open device {index}: {e}"))?;
        if known.uuid.is_empty() {
            known.uuid = dev.uuid().map_err(|e| format!("uuid: {e}"))?;
            known.name = dev.name().map_err(|e| format!("name: {e}"))?;
            known.compute_capability = dev
                .cuda_compute_capability()
                .ok()
                .map(|c| format!("{}.{}", c.major, c.minor));
        }
        let mem = dev.memory_info().map_err(|e| match e {
            // nvml-wrapper calls nvmlDeviceGetMemoryInfo_v2, which drivers
            // before R510 do not export.
            nvml_wrapper::error::NvmlError::FailedToLoadSymbol(_) => {
                format!("memory: {e} (the NVIDIA driver is older than R510: upgrade it)")
            }
            _ => format!("memory: {e}"),
        })?;
        known.total = mem.total;
        // Optional readings: unsupported on some devices (MIG instances, old
        // boards), which is not a fault of the device.
        let utilization_ratio = dev
            .utilization_rates()
            .ok()
            .map(|u| f64::from(u.gpu.min(100)) / 100.0);
        let mig_enabled = dev.mig_mode().ok().map(|m| m.current == 1);
        let accounting = dev.is_accounting_enabled().unwrap_or(false);
        let procs = dev
            .running_compute_processes()
            .map_err(|e| format!("running processes: {e}"))?;
        let mut out = Vec::with_capacity(procs.len());
        let mut now_pids = HashSet::with_capacity(procs.len());
        for p in procs {
            now_pids.insert(p.pid);
            let used = match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            };
            let max_bytes = accounting
                .then(|| {
                    dev.accounting_stats_for(p.pid)
                        .ok()
                        .and_then(|s| s.max_memory_usage)
                })
                .flatten();
            out.push(ProcessObservation {
                pid: p.pid,
                gpu: index,
                used_bytes: used,
                max_bytes,
                running: true,
                job: None,
            });
        }
        if accounting {
            // Processes that ended since the last sample: their exact maximum
            // may be above anything sampled (a peak just before exit).
            for pid in known.pids.difference(&now_pids) {
                if let Some(max) = dev
                    .accounting_stats_for(*pid)
                    .ok()
                    .and_then(|s| s.max_memory_usage)
                {
                    out.push(ProcessObservation {
                        pid: *pid,
                        gpu: index,
                        used_bytes: 0,
                        max_bytes: Some(max),
                        running: false,
                        job: None,
                    });
                }
            }
        }
        known.pids = now_pids;
        Ok((
            GpuInfo {
                index,
                uuid: known.uuid.clone(),
                name: known.name.clone(),
                memory_total_bytes: mem.total,
                memory_used_bytes: mem.used,
                memory_free_bytes: mem.free,
                compute_capability: known.compute_capability.clone(),
                utilization_ratio,
                mig_enabled,
                accounting_enabled: Some(accounting),
                healthy: true,
                error: None,
            },
            out,
        ))
    }
}

/// What the sidecar (and `gpus --live`) can do instead of NVML.
pub const SIDECAR_ADVICE: &str = ". If libnvidia-ml.so.1 is installed somewhere the loader does not look, add its directory to LD_LIBRARY_PATH or pass --nvml-lib PATH \
     (in a container: run it with the NVIDIA container toolkit, e.g. `--gpus all` or the nvidia RuntimeClass). \
     On a node without NVML, run with `--backend inventory --inventory FILE` (GPUs declared by hand) or `--backend simulate` (synthetic GPUs)";

/// The start-up failure message: what was tried, what happened, what to do.
pub fn nvml_start_message(tried: &str, err: &dyn std::fmt::Display) -> String {
    format!("{}{SIDECAR_ADVICE}", nvml_failure(tried, err))
}

fn nvml_failure(tried: &str, err: &dyn std::fmt::Display) -> String {
    format!(
        "cannot start the nvml backend: {tried} failed: {err}. \
         Is the NVIDIA driver installed and loaded (does `nvidia-smi` work)?"
    )
}

impl GpuSource for NvmlSource {
    fn backend(&self) -> Backend {
        Backend::Nvml
    }

    fn sample(&self) -> SourceSample {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let mut sample = SourceSample::default();
        for index in 0..self.count {
            let k = known.entry(index).or_default();
            match self.read_device(index, k) {
                Ok((gpu, procs)) => {
                    sample.gpus.push(gpu);
                    sample.processes.extend(procs);
                }
                Err(error) => {
                    tracing::warn!(gpu = index, %error, "GPU read failed; reported unhealthy");
                    sample.gpus.push(GpuInfo {
                        index,
                        uuid: k.uuid.clone(),
                        name: k.name.clone(),
                        memory_total_bytes: k.total,
                        memory_used_bytes: 0,
                        memory_free_bytes: 0,
                        compute_capability: k.compute_capability.clone(),
                        utilization_ratio: None,
                        mig_enabled: None,
                        accounting_enabled: None,
                        healthy: false,
                        error: Some(error),
                    });
                }
            }
        }
        sample
    }
}
