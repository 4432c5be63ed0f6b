//! The simulate backend: deterministic synthetic GPUs, and processes that
//! test workloads register over HTTP (`POST /v1/simulate/processes`,
//! `DELETE /v1/simulate/processes/{pid}`) to play a job's memory over time.
//! For demos and for testing the whole loop with no GPU.
//!
//! MIG: `--simulate-mig "0:1g.10gb,1g.10gb,3g.40gb;1:7g.80gb"` puts GPUs 0
//! and 1 in MIG mode with those slices (profiles of the simulated card, as
//! the catalog knows them, with their memory). Each slice is listed as its
//! own device after its card, as the NVML backend lists them, and a
//! process is registered on a slice with `"mig": <slice>` (its place on
//! the card, 0-based, in the order given).
//!
//! `--simulate-mig-parent-refused` plays a MIG node read without MIG
//! monitoring privileges, as NVML answers it: each card in MIG mode refuses
//! its own memory reading (`NoPermission`; listed with memory 0 and the
//! reason), its slices answer with their own memory, and NVML gives no
//! per-process figure on them (`UsedGpuMemory::Unavailable`), so each
//! process's memory is filled in from its slice's own use, as the NVML
//! backend does ([`super::nvml::fill_unknown`]).

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::attribution::JobKey;
use super::source::{
    Backend, GpuInfo, GpuSource, MigSlice, ProcessObservation, SliceRef, SourceSample,
};
use super::SidecarError;
use crate::core::catalog::{lookup_gpu, lookup_mig, GpuSpec};

/// The default simulated model.
pub const DEFAULT_MODEL: &str = "NVIDIA H100 80GB HBM3";

/// The default model's figures, used only when the catalog cannot resolve
/// it, so that `--backend simulate` works on its own: 81559 MiB is what
/// NVML reports as total for an H100 80GB HBM3 (nvidia-smi shows
/// "81559MiB"); compute capability 9.0 (NVIDIA CUDA GPUs list).
fn default_model_fallback() -> GpuSpec {
    GpuSpec {
        name: DEFAULT_MODEL.to_string(),
        memory_bytes: 81_559 * crate::core::units::MIB,
        compute_capability: "9.0".to_string(),
        bf16: true,
        fp8: true,
        // H100 SXM dense BF16 tensor throughput, NVIDIA H100 datasheet.
        bf16_tflops: 989.0,
        // H100 SXM dense FP32 (CUDA cores), the same datasheet.
        fp32_tflops: 66.9,
        // H100 SXM memory bandwidth, the same datasheet.
        memory_bandwidth_gbs: 3350.0,
    }
}

/// How the synthetic GPUs look.
#[derive(Debug, Clone)]
pub struct SimulateConfig {
    pub gpus: u32,
    /// A catalog GPU name.
    pub model: String,
    /// Overrides the catalog's memory (bytes).
    pub memory_bytes: Option<u64>,
    /// Seeds the synthetic UUIDs, so two simulated nodes differ.
    pub node: String,
    /// Synthetic demo jobs whose memory cycles deterministically (0: none).
    pub demo_jobs: u32,
    /// MIG slices by GPU index: the profiles of each GPU in MIG mode
    /// ([`parse_mig_layout`]); empty: no GPU in MIG mode.
    pub mig: BTreeMap<u32, Vec<String>>,
    /// Cards in MIG mode refuse their own reads (NoPermission) while their
    /// slices answer; per-process figures on slices are unavailable.
    pub mig_parent_refused: bool,
}

/// Most MIG slices one card holds: 7 compute slices, so seven `1g` instances
/// (NVIDIA MIG User Guide, "Supported MIG Profiles").
pub const MAX_MIG_SLICES: usize = 7;

/// Reads a MIG layout, `GPU:PROFILE,PROFILE…` per GPU, GPUs separated by
/// `;` (`0:1g.10gb,1g.10gb,3g.40gb;1:7g.80gb`). Profiles are checked
/// against the card when the source is built.
pub fn parse_mig_layout(text: &str) -> Result<BTreeMap<u32, Vec<String>>, String> {
    let mut out = BTreeMap::new();
    for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (gpu, profiles) = part.split_once(':').ok_or_else(|| {
            format!("`{part}`: give GPU:PROFILE,PROFILE… (e.g. 0:1g.10gb,3g.40gb)")
        })?;
        let gpu: u32 = gpu
            .trim()
            .parse()
            .map_err(|_| format!("`{part}`: `{}` is not a GPU index", gpu.trim()))?;
        let profiles: Vec<String> = profiles
            .split(',')
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        if profiles.is_empty() {
            return Err(format!(
                "`{part}`: GPU {gpu} needs at least one MIG profile"
            ));
        }
        if out.insert(gpu, profiles).is_some() {
            return Err(format!("GPU {gpu} is given twice"));
        }
    }
    Ok(out)
}

/// One simulated MIG slice.
#[derive(Debug, Clone)]
struct SimSlice {
    spec: GpuSpec,
    profile: String,
    uuid: String,
}

/// A demo job's memory cycle: it rises for half the period, then falls.
pub const DEMO_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);
/// PIDs of demo processes start here, clear of test-registered ones.
pub const DEMO_PID_BASE: u32 = 4_000_000;

/// A process registered by a test workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimProcess {
    pub pid: u32,
    /// GPU index.
    pub gpu: u32,
    pub job: SimJob,
    pub memory_bytes: u64,
    /// The MIG slice of `gpu` it runs on (its place on the card, 0-based);
    /// required on a GPU in MIG mode, refused on one that is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<u32>,
}

/// Which job a simulated process belongs to: `{"namespace","pod"}` or `{"slurm_job_id"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SimJob {
    Pod { namespace: String, pod: String },
    Slurm { slurm_job_id: String },
}

impl SimJob {
    pub fn key(&self) -> JobKey {
        match self {
            SimJob::Pod { namespace, pod } => JobKey::Pod {
                namespace: namespace.clone(),
                pod: pod.clone(),
            },
            SimJob::Slurm { slurm_job_id } => JobKey::Slurm {
                slurm_job_id: slurm_job_id.clone(),
            },
        }
    }
}

/// Most simulated processes held at once: registration is an HTTP input.
pub const MAX_SIM_PROCESSES: usize = 4096;

/// Deterministic synthetic GPUs plus registered processes.
pub struct SimulatedSource {
    spec: GpuSpec,
    gpus: u32,
    uuids: Vec<String>,
    /// MIG slices by GPU index (GPUs not in MIG mode are absent).
    slices: BTreeMap<u32, Vec<SimSlice>>,
    processes: Mutex<BTreeMap<u32, SimProcess>>,
    demo_jobs: u32,
    started: std::time::Instant,
    mig_parent_refused: bool,
}

impl SimulatedSource {
    /// Resolves the model through the catalog (memory override allowed).
    pub fn new(cfg: &SimulateConfig) -> Result<Self, SidecarError> {
        if cfg.demo_jobs > 256 {
            return Err(SidecarError::Config(format!(
                "--simulate-demo-jobs {} is out of range: give 0 to 256",
                cfg.demo_jobs
            )));
        }
        if cfg.gpus == 0 || cfg.gpus > 64 {
            return Err(SidecarError::Config(format!(
                "--simulate-gpus {} is out of range: give 1 to 64",
                cfg.gpus
            )));
        }
        let mut spec = match lookup_gpu(&cfg.model) {
            Ok(s) => s,
            Err(_) if cfg.model == DEFAULT_MODEL => default_model_fallback(),
            Err(e) => match cfg.memory_bytes {
                Some(m) => GpuSpec {
                    name: cfg.model.clone(),
                    memory_bytes: m,
                    compute_capability: String::new(),
                    bf16: false,
                    fp8: false,
                    bf16_tflops: 0.0,
                    fp32_tflops: 0.0,
                    memory_bandwidth_gbs: 0.0,
                },
                None => {
                    return Err(SidecarError::Config(format!(
                    "--simulate-model: {e}; or give --simulate-memory for a GPU not in the catalog"
                )))
                }
            },
        };
        if let Some(m) = cfg.memory_bytes {
            spec.memory_bytes = m;
        }
        let seed = fnv1a(cfg.node.as_bytes());
        let uuids = (0..cfg.gpus)
            .map(|i| synthetic_uuid("GPU", seed, &[u64::from(i)]))
            .collect();
        let slices = mig_slices(cfg, &spec, seed)?;
        Ok(Self {
            spec,
            gpus: cfg.gpus,
            uuids,
            slices,
            processes: Mutex::new(BTreeMap::new()),
            demo_jobs: cfg.demo_jobs,
            started: std::time::Instant::now(),
            mig_parent_refused: cfg.mig_parent_refused,
        })
    }

    /// The demo processes at `elapsed` since start: job `i` runs on GPU
    /// `i % gpus` (on a GPU in MIG mode, on its slice `(i / gpus) % slices`);
    /// its memory is a triangle wave between 10 % and 10 % + 60 % / (jobs on
    /// that GPU) of its device, phase-shifted per job, so a demo dashboard
    /// shows rises, peaks and falls and the peaks survive.
    pub fn demo_processes(&self, elapsed: std::time::Duration) -> Vec<SimProcess> {
        let per_gpu = self.demo_jobs.div_ceil(self.gpus).max(1) as f64;
        let period = DEMO_PERIOD.as_secs_f64();
        (0..self.demo_jobs)
            .map(|i| {
                let gpu = i % self.gpus;
                let (mig, total) = match self.slices.get(&gpu) {
                    Some(slices) if !slices.is_empty() => {
                        let d = (i / self.gpus) as usize % slices.len();
                        (Some(d as u32), slices[d].spec.memory_bytes as f64)
                    }
                    _ => (None, self.spec.memory_bytes as f64),
                };
                let phase = (elapsed.as_secs_f64() / period + f64::from(i) / 7.0).fract();
                let tri = 1.0 - (2.0 * phase - 1.0).abs();
                let bytes = total * (0.1 + 0.6 * tri) / per_gpu;
                SimProcess {
                    pid: DEMO_PID_BASE + i,
                    gpu,
                    job: if i % 2 == 0 {
                        SimJob::Pod {
                            namespace: "demo".into(),
                            pod: format!("demo-train-{i}"),
                        }
                    } else {
                        SimJob::Slurm {
                            slurm_job_id: format!("{}", 90_000 + i),
                        }
                    },
                    memory_bytes: bytes as u64,
                    mig,
                }
            })
            .collect()
    }

    /// Registers a process or updates its memory (same PID).
    pub fn upsert(&self, p: SimProcess) -> Result<(), SidecarError> {
        if p.gpu >= self.gpus {
            return Err(SidecarError::BadRequest(format!(
                "gpu {} does not exist: this simulated node has GPUs 0..{}",
                p.gpu,
                self.gpus - 1
            )));
        }
        let capacity = match (self.slices.get(&p.gpu), p.mig) {
            (None, None) => self.spec.memory_bytes,
            (Some(slices), Some(d)) => match slices.get(d as usize) {
                Some(slice) => slice.spec.memory_bytes,
                None => {
                    return Err(SidecarError::BadRequest(format!(
                        "gpu {} has MIG slices 0..{}: no slice {d}",
                        p.gpu,
                        slices.len() - 1
                    )))
                }
            },
            // A card in MIG mode runs nothing itself: CUDA sees only its slices.
            (Some(slices), None) => {
                return Err(SidecarError::BadRequest(format!(
                    "gpu {} is in MIG mode: give \"mig\": the slice (0..{})",
                    p.gpu,
                    slices.len() - 1
                )))
            }
            (None, Some(_)) => {
                return Err(SidecarError::BadRequest(format!(
                    "gpu {} is not in MIG mode: leave out \"mig\"",
                    p.gpu
                )))
            }
        };
        if p.memory_bytes > capacity {
            return Err(SidecarError::BadRequest(format!(
                "memory_bytes {} is more than {}'s {capacity} bytes",
                p.memory_bytes,
                match p.mig {
                    Some(d) => format!("GPU {} MIG slice {d}", p.gpu),
                    None => format!("GPU {}", p.gpu),
                }
            )));
        }
        let mut procs = lock(&self.processes);
        if !procs.contains_key(&p.pid) && procs.len() >= MAX_SIM_PROCESSES {
            return Err(SidecarError::BadRequest(format!(
                "at most {MAX_SIM_PROCESSES} simulated processes: DELETE some first"
            )));
        }
        procs.insert(p.pid, p);
        Ok(())
    }

    /// Ends a process; false when it was not registered.
    pub fn remove(&self, pid: u32) -> bool {
        lock(&self.processes).remove(&pid).is_some()
    }

    /// Every registered process.
    pub fn processes(&self) -> Vec<SimProcess> {
        lock(&self.processes).values().cloned().collect()
    }
}

/// The MIG slices `cfg.mig` asks for on `card`: each profile resolved
/// through the catalog (its memory is the slice's), at most
/// [`MAX_MIG_SLICES`] per card and no more memory than the card has.
fn mig_slices(
    cfg: &SimulateConfig,
    card: &GpuSpec,
    seed: u64,
) -> Result<BTreeMap<u32, Vec<SimSlice>>, SidecarError> {
    let bad = |m: String| SidecarError::Config(format!("--simulate-mig: {m}"));
    let mut out = BTreeMap::new();
    for (gpu, profiles) in &cfg.mig {
        if *gpu >= cfg.gpus {
            return Err(bad(format!(
                "GPU {gpu} does not exist: --simulate-gpus {} gives GPUs 0..{}",
                cfg.gpus,
                cfg.gpus - 1
            )));
        }
        if profiles.len() > MAX_MIG_SLICES {
            return Err(bad(format!(
                "GPU {gpu}: {} slices, a card holds at most {MAX_MIG_SLICES}",
                profiles.len()
            )));
        }
        let mut slices = Vec::with_capacity(profiles.len());
        for (device, profile) in profiles.iter().enumerate() {
            let slice = lookup_mig(&card.name, profile).map_err(|e| {
                bad(format!(
                    "GPU {gpu}: `{profile}` is not a MIG profile of {} ({e}); `gpufit gpus` lists them",
                    card.name
                ))
            })?;
            let profile = slice
                .name
                .rsplit_once(" MIG ")
                .map_or(profile.as_str(), |(_, p)| p)
                .to_string();
            slices.push(SimSlice {
                uuid: synthetic_uuid("MIG", seed, &[u64::from(*gpu), 1 << 32 | device as u64]),
                spec: slice,
                profile,
            });
        }
        let total: u64 = slices.iter().map(|s| s.spec.memory_bytes).sum();
        if total > card.memory_bytes {
            return Err(bad(format!(
                "GPU {gpu}: the slices hold {total} bytes, more than the card's {}",
                card.memory_bytes
            )));
        }
        out.insert(*gpu, slices);
    }
    Ok(out)
}

/// A deterministic UUID-shaped id (`GPU-…`, `MIG-…`) from the node's seed
/// and `parts`.
fn synthetic_uuid(prefix: &str, seed: u64, parts: &[u64]) -> String {
    let bytes: Vec<u8> = std::iter::once(seed)
        .chain(parts.iter().copied())
        .flat_map(u64::to_le_bytes)
        .collect();
    let h = fnv1a(&bytes);
    format!(
        "{prefix}-{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        (h >> 32) as u32,
        (h >> 16) as u16,
        (h >> 4) as u16 & 0xfff,
        h as u16 & 0xfff,
        (seed ^ h) & 0xffff_ffff_ffff
    )
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// FNV-1a, 64 bit: a stable hash for deterministic synthetic ids.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl GpuSource for SimulatedSource {
    fn backend(&self) -> Backend {
        Backend::Simulate
    }

    fn sample(&self) -> SourceSample {
        let procs = lock(&self.processes);
        let demo = self.demo_processes(self.started.elapsed());
        // Memory in use by device: (GPU, None) for a whole GPU, (GPU, Some(slice)).
        let mut used: BTreeMap<(u32, Option<u32>), u64> = BTreeMap::new();
        let mut processes = Vec::with_capacity(procs.len() + demo.len());
        for p in procs.values().chain(demo.iter()) {
            let u = used.entry((p.gpu, p.mig)).or_default();
            *u = u.saturating_add(p.memory_bytes);
            let mig = p.mig.and_then(|d| {
                let slice = self.slices.get(&p.gpu)?.get(d as usize)?;
                Some(SliceRef {
                    device: d,
                    profile: slice.profile.clone(),
                })
            });
            processes.push(ProcessObservation {
                pid: p.pid,
                gpu: p.gpu,
                mig,
                used_bytes: p.memory_bytes,
                max_bytes: None,
                running: true,
                job: Some(p.job.key()),
            });
        }
        if self.mig_parent_refused {
            // NVML gives no per-process figure on the slices: each slice's
            // processes share its own use, as the NVML backend fills them.
            let mut by_slice: BTreeMap<(u32, u32), Vec<usize>> = BTreeMap::new();
            for (i, p) in processes.iter().enumerate() {
                if let Some(m) = &p.mig {
                    by_slice.entry((p.gpu, m.device)).or_default().push(i);
                }
            }
            for ((gpu, d), at) in by_slice {
                let slice_used = used.get(&(gpu, Some(d))).copied().unwrap_or(0);
                let filled = super::nvml::fill_unknown(&vec![None; at.len()], slice_used);
                for (i, b) in at.into_iter().zip(filled) {
                    processes[i].used_bytes = b;
                }
            }
        }
        let compute_capability = (!self.spec.compute_capability.is_empty())
            .then(|| self.spec.compute_capability.clone());
        let mut gpus = Vec::with_capacity(self.gpus as usize);
        for i in 0..self.gpus {
            let slices = self.slices.get(&i);
            let used_on = |mig: Option<u32>| used.get(&(i, mig)).copied().unwrap_or(0);
            // A card in MIG mode holds what its slices hold.
            let card_used = match slices {
                Some(s) => (0..s.len() as u32).map(|d| used_on(Some(d))).sum(),
                None => used_on(None),
            }
            .min(self.spec.memory_bytes);
            let card = GpuInfo {
                index: i,
                uuid: self.uuids[i as usize].clone(),
                name: self.spec.name.clone(),
                memory_total_bytes: self.spec.memory_bytes,
                memory_used_bytes: card_used,
                memory_free_bytes: self.spec.memory_bytes - card_used,
                compute_capability: compute_capability.clone(),
                // Deterministic: busy while anything holds memory on it.
                utilization_ratio: Some(if card_used > 0 { 1.0 } else { 0.0 }),
                mig_enabled: Some(slices.is_some()),
                accounting_enabled: Some(false),
                healthy: true,
                error: None,
                mig: None,
            };
            // What the NVML backend lists for a MIG-mode card NVML refuses.
            let card = match (
                slices.is_some() && self.mig_parent_refused,
                super::nvml::card_memory(
                    Some(true),
                    Err(nvml_wrapper::error::NvmlError::NoPermission),
                ),
            ) {
                (true, Ok(Err(note))) => GpuInfo {
                    memory_total_bytes: 0,
                    memory_used_bytes: 0,
                    memory_free_bytes: 0,
                    utilization_ratio: None,
                    error: Some(note),
                    ..card
                },
                _ => card,
            };
            gpus.push(card);
            for (d, slice) in slices.into_iter().flatten().enumerate() {
                let total = slice.spec.memory_bytes;
                let used = used_on(Some(d as u32)).min(total);
                gpus.push(GpuInfo {
                    index: i,
                    uuid: slice.uuid.clone(),
                    name: slice.spec.name.clone(),
                    memory_total_bytes: total,
                    memory_used_bytes: used,
                    memory_free_bytes: total - used,
                    compute_capability: compute_capability.clone(),
                    // NVML reports no utilization for a MIG device.
                    utilization_ratio: None,
                    mig_enabled: None,
                    accounting_enabled: Some(false),
                    healthy: true,
                    error: None,
                    mig: Some(MigSlice {
                        device: d as u32,
                        profile: slice.profile.clone(),
                        parent_uuid: self.uuids[i as usize].clone(),
                        // Synthetic: NVML numbers GPU instances by placement;
                        // here one compute instance (0) per GPU instance.
                        gpu_instance_id: Some(d as u32 + 1),
                        compute_instance_id: Some(0),
                    }),
                });
            }
        }
        SourceSample { gpus, processes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(node: &str) -> SimulateConfig {
        SimulateConfig {
            gpus: 8,
            model: DEFAULT_MODEL.into(),
            memory_bytes: None,
            node: node.into(),
            demo_jobs: 0,
            mig: BTreeMap::new(),
            mig_parent_refused: false,
        }
    }

    #[test]
    fn simulated_gpus_are_deterministic_per_node_and_distinct() {
        let a = SimulatedSource::new(&cfg("n1")).expect("simulate").sample();
        let b = SimulatedSource::new(&cfg("n1")).expect("simulate").sample();
        let c = SimulatedSource::new(&cfg("n2")).expect("simulate").sample();
        assert_eq!(a.gpus, b.gpus);
        assert_ne!(a.gpus[0].uuid, c.gpus[0].uuid);
        let mut uuids: Vec<_> = a.gpus.iter().map(|g| g.uuid.clone()).collect();
        uuids.dedup();
        assert_eq!(uuids.len(), 8);
        assert!(a
            .gpus
            .iter()
            .all(|g| g.name == DEFAULT_MODEL && g.memory_used_bytes == 0));
    }

    #[test]
    fn registered_processes_fill_their_gpu_and_bad_ones_are_refused() {
        let s = SimulatedSource::new(&cfg("n")).expect("simulate");
        let job = SimJob::Slurm {
            slurm_job_id: "5".into(),
        };
        s.upsert(SimProcess {
            pid: 1,
            gpu: 2,
            job: job.clone(),
            memory_bytes: 1000,
            mig: None,
        })
        .expect("valid process");
        let sample = s.sample();
        assert_eq!(sample.gpus[2].memory_used_bytes, 1000);
        assert_eq!(sample.gpus[2].utilization_ratio, Some(1.0));
        assert_eq!(sample.processes.len(), 1);
        assert!(s
            .upsert(SimProcess {
                pid: 2,
                gpu: 8,
                job: job.clone(),
                memory_bytes: 1,
                mig: None,
            })
            .is_err());
        assert!(s
            .upsert(SimProcess {
                pid: 2,
                gpu: 0,
                job,
                memory_bytes: u64::MAX,
                mig: None,
            })
            .is_err());
        assert!(s.remove(1));
        assert!(!s.remove(1));
    }

    #[test]
    fn demo_jobs_rise_peak_and_fall_within_their_gpu() {
        let mut c = cfg("n");
        c.demo_jobs = 16;
        let s = SimulatedSource::new(&c).expect("simulate");
        let total = s.spec.memory_bytes;
        let at = |secs: f64| s.demo_processes(std::time::Duration::from_secs_f64(secs));
        assert_eq!(at(0.0), at(0.0), "deterministic");
        assert_eq!(at(0.0).len(), 16);
        let job0: Vec<u64> = (0..=60).map(|t| at(f64::from(t))[0].memory_bytes).collect();
        let (min, max) = (job0.iter().min().copied(), job0.iter().max().copied());
        assert!(max > min, "memory moves");
        let peak_at = job0.iter().position(|b| Some(*b) == max).unwrap_or(0);
        assert!(
            peak_at > 0 && peak_at < 60,
            "rises then falls: peak at {peak_at}"
        );
        for t in 0..60 {
            let mut per_gpu = [0u64; 8];
            for p in at(f64::from(t)) {
                per_gpu[p.gpu as usize] += p.memory_bytes;
            }
            assert!(per_gpu.iter().all(|u| *u <= total));
        }
    }

    #[test]
    fn unknown_model_without_memory_is_a_clear_error() {
        let mut c = cfg("n");
        c.model = "NVIDIA Imaginary 9000".into();
        let err = SimulatedSource::new(&c)
            .err()
            .expect("unknown model refused");
        assert!(err.to_string().contains("--simulate-memory"), "{err}");
        c.memory_bytes = Some(1 << 30);
        let s = SimulatedSource::new(&c).expect("memory given");
        assert_eq!(s.sample().gpus[0].memory_total_bytes, 1 << 30);
    }

    fn mig_cfg(layout: &str) -> SimulateConfig {
        SimulateConfig {
            gpus: 2,
            model: "NVIDIA A100-SXM4-40GB".into(),
            mig: parse_mig_layout(layout).expect("a valid layout"),
            ..cfg("n")
        }
    }

    #[test]
    fn mig_slices_are_devices_with_their_catalog_memory_after_their_card() {
        let s = SimulatedSource::new(&mig_cfg("0:1g.5gb,1g.5gb,3g.20gb")).expect("simulate");
        let gpus = s.sample().gpus;
        let names: Vec<(u32, &str)> = gpus.iter().map(|g| (g.index, g.name.as_str())).collect();
        assert_eq!(
            names,
            [
                (0, "NVIDIA A100-SXM4-40GB"),
                (0, "NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
                (0, "NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
                (0, "NVIDIA A100-SXM4-40GB MIG 3g.20gb"),
                (1, "NVIDIA A100-SXM4-40GB"),
            ]
        );
        assert_eq!(gpus[0].mig_enabled, Some(true));
        assert_eq!(gpus[4].mig_enabled, Some(false));
        for g in &gpus[1..4] {
            // NVML's MIG device name resolves to the slice: its memory,
            // the card's capabilities.
            let spec = lookup_gpu(&g.name).expect("the slice name resolves");
            assert_eq!(g.memory_total_bytes, spec.memory_bytes);
            assert!(spec.bf16 && !spec.fp8 && spec.compute_capability == "8.0");
            let m = g.mig.as_ref().expect("a slice");
            assert_eq!(m.parent_uuid, gpus[0].uuid);
            assert!(g.uuid.starts_with("MIG-"), "{}", g.uuid);
        }
        assert_eq!(gpus[1].memory_total_bytes, 4864 * crate::core::units::MIB);
        let devices: Vec<u32> = gpus[1..4]
            .iter()
            .filter_map(|g| g.mig.as_ref().map(|m| m.device))
            .collect();
        assert_eq!(devices, [0, 1, 2]);
        assert_ne!(
            gpus[1].uuid, gpus[2].uuid,
            "two slices of one profile differ"
        );
    }

    #[test]
    fn a_process_on_a_slice_fills_that_slice_and_its_card_only() {
        let s = SimulatedSource::new(&mig_cfg("0:1g.5gb,3g.20gb")).expect("simulate");
        let job = SimJob::Slurm {
            slurm_job_id: "5".into(),
        };
        let p = |pid: u32, gpu: u32, mig: Option<u32>, memory_bytes: u64| SimProcess {
            pid,
            gpu,
            job: job.clone(),
            memory_bytes,
            mig,
        };
        s.upsert(p(1, 0, Some(1), 3 << 30))
            .expect("slice 1 holds 3 GiB");
        let sample = s.sample();
        let used: Vec<u64> = sample.gpus.iter().map(|g| g.memory_used_bytes).collect();
        assert_eq!(used, [3 << 30, 0, 3 << 30, 0]);
        assert_eq!(
            sample.processes[0].mig,
            Some(SliceRef {
                device: 1,
                profile: "3g.20gb".into()
            })
        );
        for (bad, want) in [
            (p(2, 0, None, 1), "is in MIG mode"),
            (p(2, 0, Some(2), 1), "no slice 2"),
            (p(2, 1, Some(0), 1), "not in MIG mode"),
            // 5 GiB does not fit a 1g.5gb slice (4.75 GiB).
            (p(2, 0, Some(0), 5 << 30), "more than GPU 0 MIG slice 0"),
        ] {
            let err = s.upsert(bad).expect_err("refused").to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn bad_mig_layouts_are_clear_errors() {
        for (layout, want) in [
            ("1g.5gb", "GPU:PROFILE"),
            ("x:1g.5gb", "not a GPU index"),
            ("0:", "at least one"),
            ("0:1g.5gb;0:1g.5gb", "twice"),
        ] {
            let err = parse_mig_layout(layout).expect_err("refused");
            assert!(err.contains(want), "{layout}: {err}");
        }
        for (layout, want) in [
            ("5:1g.5gb", "does not exist"),
            ("0:1g.18gb", "not a MIG profile"),
            (
                "0:1g.5gb,1g.5gb,1g.5gb,1g.5gb,1g.5gb,1g.5gb,1g.5gb,1g.5gb",
                "at most 7",
            ),
            ("0:7g.40gb,1g.5gb", "more than the card"),
        ] {
            let err = SimulatedSource::new(&mig_cfg(layout))
                .err()
                .expect("refused")
                .to_string();
            assert!(err.contains(want), "{layout}: {err}");
        }
    }

    #[test]
    fn demo_jobs_on_a_mig_card_run_on_its_slices_within_their_memory() {
        let mut c = mig_cfg("0:1g.5gb,3g.20gb");
        c.demo_jobs = 8;
        let s = SimulatedSource::new(&c).expect("simulate");
        let slice_memory = |d: u32| s.slices[&0][d as usize].spec.memory_bytes;
        let mut slices_used = std::collections::BTreeSet::new();
        for t in 0..60 {
            for p in s.demo_processes(std::time::Duration::from_secs(t)) {
                assert_eq!(p.gpu == 0, p.mig.is_some(), "{p:?}");
                if let Some(d) = p.mig {
                    assert!(p.memory_bytes <= slice_memory(d), "{p:?}");
                    slices_used.insert(d);
                }
                s.upsert(p).expect("a demo process is a valid process");
            }
        }
        assert_eq!(slices_used.len(), 2, "both slices get demo jobs");
    }

    #[test]
    fn a_refused_parent_lists_no_card_memory_and_fills_process_figures_from_the_slice() {
        let mut c = mig_cfg("0:1g.5gb,3g.20gb");
        c.mig_parent_refused = true;
        let s = SimulatedSource::new(&c).expect("simulate");
        let job = SimJob::Slurm {
            slurm_job_id: "5".into(),
        };
        for (pid, d, bytes) in [(1, 1, 3 << 30), (2, 1, 1 << 30), (3, 0, 1 << 30)] {
            s.upsert(SimProcess {
                pid,
                gpu: 0,
                job: job.clone(),
                memory_bytes: bytes,
                mig: Some(d),
            })
            .expect("valid");
        }
        let sample = s.sample();
        let card = &sample.gpus[0];
        assert!(card.healthy && card.memory_total_bytes == 0, "{card:?}");
        assert!(card
            .error
            .as_deref()
            .is_some_and(|e| e.contains("CAP_SYS_ADMIN")));
        // Slices answer with their own memory.
        assert_eq!(sample.gpus[2].memory_used_bytes, 4 << 30);
        // Per-process figures unknown: the slice's 4 GiB shared by its two processes.
        let used: Vec<(u32, u64)> = sample
            .processes
            .iter()
            .map(|p| (p.pid, p.used_bytes))
            .collect();
        assert_eq!(used, [(1, 2 << 30), (2, 2 << 30), (3, 1 << 30)]);
        // The whole card (GPU 1, not in MIG mode) reads as before.
        assert_eq!(
            sample.gpus[3].memory_total_bytes,
            40960 * crate::core::units::MIB
        );
        assert!(sample.gpus[3].error.is_none());
    }
}
