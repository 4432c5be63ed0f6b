//! The NVML backend: the real one. Reads every device's name, UUID, memory,
//! compute capability, utilization, MIG and accounting modes, and its
//! running compute processes with their memory. Where NVML accounting is on
//! (`nvidia-smi -am 1`), each process's exact lifetime maximum is read too,
//! including one last time right after the process has ended.
//!
//! MIG: under a card in MIG mode each MIG device (NVML's
//! `nvmlDeviceGetMigDeviceHandleByIndex`, up to the card's maximum count) is
//! read as a device of its own — its name (`NVIDIA A100-SXM4-40GB MIG
//! 1g.5gb`), `MIG-…` UUID, memory and processes — and listed after its card.
//! The card's own process list is not read then (in MIG mode it is an
//! aggregate, and privileged), so a process counts on its slice only.
//! NVML's accounting mode is not available on MIG devices: slice peaks are sampled.
//!
//! Privileges on a MIG card: nvml.h, "In MIG mode, if device handle is
//! provided, the API returns aggregate information, only if the caller has
//! appropriate privileges"; the container toolkit gives them with
//! `NVIDIA_MIG_MONITOR_DEVICES=all` and `CAP_SYS_ADMIN` (the chart's
//! `sidecar.migMonitoring`). Without them the card's own memory read is
//! refused (`NoPermission`): the card's MIG mode is read first, and on a
//! card in MIG mode a refused or failed memory read is noted, not fatal —
//! the card is listed (memory 0, the reason in `error`) and its slices with
//! their own memory, which each MIG handle answers. A process's own figure
//! NVML does not give (`UsedGpuMemory::Unavailable`, usual for an
//! unprivileged reader in MIG mode) is unknown, never 0: on a slice, whose
//! memory is isolated, the slice's own used memory less the known figures
//! stands in for it ([`fill_unknown`]); on a whole card, where other jobs'
//! memory counts too, it stays unknown (0 used, no peak from it).
//!
//! GPU and compute instance ids: nvml-wrapper 0.13 has no safe wrapper of
//! `nvmlDeviceGetGpuInstanceId` / `nvmlDeviceGetComputeInstanceId` (and
//! this crate forbids `unsafe`), so they come from a process's record on
//! the slice (NVML fills both) or, with drivers before R470, from the
//! `MIG-GPU-<card>/<gi>/<ci>` UUID; until then they are absent.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Mutex;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::source::{
    Backend, GpuInfo, GpuSource, MigSlice, ProcessObservation, SliceRef, SourceSample,
};
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
    /// A slice's GPU and compute instance ids, once seen.
    instance: (Option<u32>, Option<u32>),
}

/// A device of this node: a card by index, or the MIG device `.1` of card `.0`.
type DeviceKey = (u32, Option<u32>);

/// Reads GPUs through NVML.
pub struct NvmlSource {
    nvml: Nvml,
    count: u32,
    known: Mutex<HashMap<DeviceKey, Known>>,
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
        // MIG mode first: on a card in MIG mode the card's own memory is an
        // aggregate NVML may refuse (NoPermission) while its slices answer.
        let mig_enabled = dev.mig_mode().ok().map(|m| m.current == 1);
        let memory = card_memory(
            mig_enabled,
            dev.memory_info().map(|m| (m.total, m.used, m.free)),
        )?;
        let (mem_total, mem_used, mem_free, memory_note) = match memory {
            Ok((t, u, f)) => (t, u, f, None),
            Err(note) => (0, 0, 0, Some(note)),
        };
        if mem_total > 0 {
            known.total = mem_total;
        }
        // Optional readings: unsupported on some devices (MIG instances, old
        // boards), which is not a fault of the device.
        let utilization_ratio = dev
            .utilization_rates()
            .ok()
            .map(|u| f64::from(u.gpu.min(100)) / 100.0);
        let accounting = dev.is_accounting_enabled().unwrap_or(false);
        // In MIG mode the slices' processes are read on the slices.
        let procs = if mig_enabled == Some(true) {
            Vec::new()
        } else {
            dev.running_compute_processes()
                .map_err(|e| format!("running processes: {e}"))?
        };
        let mut out = Vec::with_capacity(procs.len());
        let mut now_pids = HashSet::with_capacity(procs.len());
        for p in procs {
            now_pids.insert(p.pid);
            // Unknown on a whole card: other jobs' memory is in the card's
            // figure, so nothing stands in for it (0 used, no peak from it).
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
                mig: None,
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
                        mig: None,
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
                memory_total_bytes: mem_total,
                memory_used_bytes: mem_used,
                memory_free_bytes: mem_free,
                compute_capability: known.compute_capability.clone(),
                utilization_ratio,
                mig_enabled,
                accounting_enabled: Some(accounting),
                healthy: true,
                error: memory_note,
                mig: None,
            },
            out,
        ))
    }

    /// Reads the MIG devices of card `card` (in MIG mode) into `sample`,
    /// each as its own device; a slice that cannot be read is listed
    /// unhealthy, the others are still read.
    fn read_slices(
        &self,
        card: &GpuInfo,
        known: &mut HashMap<DeviceKey, Known>,
        sample: &mut SourceSample,
    ) {
        let index = card.index;
        let dev = match self.nvml.device_by_index(index) {
            Ok(d) => d,
            Err(error) => {
                tracing::warn!(gpu = index, %error, "cannot reopen a MIG-mode GPU to read its slices");
                return;
            }
        };
        let max = match dev.mig_device_count() {
            Ok(n) => n,
            Err(error) => {
                tracing::warn!(gpu = index, %error, "cannot count the MIG devices");
                return;
            }
        };
        for d in 0..max {
            let slice = match dev.mig_device_by_index(d) {
                Ok(s) => s,
                // No MIG device at this place: the card is not fully partitioned.
                Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue,
                Err(error) => {
                    tracing::warn!(gpu = index, mig = d, %error, "cannot open a MIG device");
                    continue;
                }
            };
            let k = known.entry((index, Some(d))).or_default();
            match read_slice(&slice, card, d, k) {
                Ok((gpu, procs)) => {
                    sample.gpus.push(gpu);
                    sample.processes.extend(procs);
                }
                Err(error) => {
                    tracing::warn!(gpu = index, mig = d, %error, "MIG device read failed; reported unhealthy");
                    sample.gpus.push(GpuInfo {
                        mig: Some(slice_info(card, d, k)),
                        ..unhealthy(index, k, error)
                    });
                }
            }
        }
    }
}

/// A device that could not be read, with what is known of it.
fn unhealthy(index: u32, k: &Known, error: String) -> GpuInfo {
    GpuInfo {
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
        mig: None,
    }
}

/// Reads one MIG device `d` of `card`: name, UUID, memory (the slice's
/// own: NVML's memory info on a MIG handle) and its processes.
fn read_slice(
    slice: &Device<'_>,
    card: &GpuInfo,
    d: u32,
    known: &mut Known,
) -> Result<(GpuInfo, Vec<ProcessObservation>), String> {
    // Read every sample, not cached as a card's are: an administrator may
    // destroy and create MIG instances while the sidecar runs, and the
    // device at this place is then another slice.
    let uuid = slice.uuid().map_err(|e| format!("uuid: {e}"))?;
    if uuid != known.uuid {
        known.name = slice.name().map_err(|e| format!("name: {e}"))?;
        known.instance = legacy_mig_uuid_ids(&uuid);
        known.uuid = uuid;
    }
    // A MIG device has its card's architecture.
    known.compute_capability = card.compute_capability.clone();
    let mem = slice.memory_info().map_err(|e| format!("memory: {e}"))?;
    known.total = mem.total;
    let procs = slice
        .running_compute_processes()
        .map_err(|e| format!("running processes: {e}"))?;
    let slice_ref = SliceRef {
        device: d,
        profile: mig_profile_of(&known.name),
    };
    let figures: Vec<Option<u64>> = procs
        .iter()
        .map(|p| match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => Some(b),
            UsedGpuMemory::Unavailable => None,
        })
        .collect();
    let used = fill_unknown(&figures, mem.used);
    let mut out = Vec::with_capacity(procs.len());
    for (p, used_bytes) in procs.into_iter().zip(used) {
        if p.gpu_instance_id.is_some() {
            known.instance = (p.gpu_instance_id, p.compute_instance_id);
        }
        out.push(ProcessObservation {
            pid: p.pid,
            gpu: card.index,
            mig: Some(slice_ref.clone()),
            used_bytes,
            max_bytes: None,
            running: true,
            job: None,
        });
    }
    Ok((
        GpuInfo {
            index: card.index,
            uuid: known.uuid.clone(),
            name: known.name.clone(),
            memory_total_bytes: mem.total,
            memory_used_bytes: mem.used,
            memory_free_bytes: mem.free,
            compute_capability: known.compute_capability.clone(),
            utilization_ratio: None,
            mig_enabled: None,
            accounting_enabled: Some(false),
            healthy: true,
            error: None,
            mig: Some(slice_info(card, d, known)),
        },
        out,
    ))
}

/// Where slice `d` of `card` sits, as far as it is known.
fn slice_info(card: &GpuInfo, d: u32, k: &Known) -> MigSlice {
    MigSlice {
        device: d,
        profile: mig_profile_of(&k.name),
        parent_uuid: card.uuid.clone(),
        gpu_instance_id: k.instance.0,
        compute_instance_id: k.instance.1,
    }
}

/// The profile in a MIG device's NVML name: `NVIDIA A100-SXM4-40GB MIG
/// 1g.5gb` → `1g.5gb`; the whole name when it has no ` MIG ` part.
pub fn mig_profile_of(name: &str) -> String {
    name.rsplit_once(" MIG ")
        .map_or(name, |(_, p)| p)
        .trim()
        .to_string()
}

/// The GPU and compute instance ids in a MIG UUID of drivers before R470
/// (`MIG-GPU-<card uuid>/<gi>/<ci>`); later drivers' `MIG-<uuid>` carries none.
pub fn legacy_mig_uuid_ids(uuid: &str) -> (Option<u32>, Option<u32>) {
    let Some(rest) = uuid.strip_prefix("MIG-GPU-") else {
        return (None, None);
    };
    let mut parts = rest.split('/').skip(1).map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(gi), ci) => (Some(gi), ci),
        _ => (None, None),
    }
}

/// What a card's own memory reading gives: `Ok(Ok(figures))`;
/// `Ok(Err(note))` on a card in MIG mode whose reading failed (not fatal:
/// its slices are read on their own — the note says why and what to do);
/// `Err` on any other card, which is then unhealthy.
pub fn card_memory(
    mig_enabled: Option<bool>,
    reading: Result<(u64, u64, u64), NvmlError>,
) -> Result<Result<(u64, u64, u64), String>, String> {
    match reading {
        Ok(m) => Ok(Ok(m)),
        Err(e) if mig_enabled == Some(true) => Ok(Err(refused_card_note(&e.to_string()))),
        // nvml-wrapper calls nvmlDeviceGetMemoryInfo_v2, which drivers
        // before R510 do not export.
        Err(e @ NvmlError::FailedToLoadSymbol(_)) => Err(format!(
            "memory: {e} (the NVIDIA driver is older than R510: upgrade it)"
        )),
        Err(e) => Err(format!("memory: {e}")),
    }
}

/// Why a MIG-mode card lists no memory of its own, and how to get it.
pub fn refused_card_note(error: &str) -> String {
    format!(
        "memory: {error} (a card in MIG mode gives its aggregate memory only to a privileged reader: \
         NVIDIA_MIG_MONITOR_DEVICES=all and CAP_SYS_ADMIN, the chart's sidecar.migMonitoring); \
         its slices are read on their own"
    )
}

/// Per-process figures of one MIG slice, the unknown ones (`None`) filled
/// from the slice's own used memory (isolated: only its processes hold
/// it), less the known figures, shared evenly — so the slice's processes
/// together hold what the slice reports, and an unknown figure is never
/// read as 0 while the slice holds memory.
pub fn fill_unknown(figures: &[Option<u64>], slice_used: u64) -> Vec<u64> {
    let known: u64 = figures
        .iter()
        .flatten()
        .fold(0u64, |a, b| a.saturating_add(*b));
    let unknown = figures.iter().filter(|f| f.is_none()).count() as u64;
    let each = match unknown {
        0 => 0,
        n => slice_used.saturating_sub(known) / n,
    };
    figures.iter().map(|f| f.unwrap_or(each)).collect()
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
            let k = known.entry((index, None)).or_default();
            match self.read_device(index, k) {
                Ok((gpu, procs)) => {
                    let mig_mode = gpu.mig_enabled == Some(true);
                    sample.gpus.push(gpu.clone());
                    sample.processes.extend(procs);
                    if mig_mode {
                        self.read_slices(&gpu, &mut known, &mut sample);
                    }
                }
                Err(error) => {
                    tracing::warn!(gpu = index, %error, "GPU read failed; reported unhealthy");
                    sample.gpus.push(unhealthy(index, k, error));
                }
            }
        }
        sample
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_is_read_from_nvmls_mig_device_name() {
        assert_eq!(mig_profile_of("NVIDIA A100-SXM4-40GB MIG 1g.5gb"), "1g.5gb");
        assert_eq!(
            mig_profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me"),
            "1g.10gb+me"
        );
        assert_eq!(mig_profile_of("NVIDIA H200 MIG 7g.141gb"), "7g.141gb");
        assert_eq!(mig_profile_of("Odd Name"), "Odd Name");
    }

    #[test]
    fn a_refused_memory_read_is_fatal_only_on_a_card_not_in_mig_mode() {
        let figures = (100, 40, 60);
        assert_eq!(card_memory(Some(true), Ok(figures)), Ok(Ok(figures)));
        assert_eq!(card_memory(None, Ok(figures)), Ok(Ok(figures)));
        let refused = card_memory(Some(true), Err(NvmlError::NoPermission))
            .expect("not fatal in MIG mode")
            .expect_err("no figures");
        assert!(
            refused.contains("CAP_SYS_ADMIN") && refused.contains("NVIDIA_MIG_MONITOR_DEVICES"),
            "{refused}"
        );
        for mig in [None, Some(false)] {
            let err = card_memory(mig, Err(NvmlError::NoPermission)).expect_err("fatal");
            assert!(err.starts_with("memory:"), "{err}");
        }
        let old = card_memory(Some(false), Err(NvmlError::FailedToLoadSymbol("x".into())))
            .expect_err("fatal");
        assert!(old.contains("R510"), "{old}");
    }

    #[test]
    fn unknown_process_figures_on_a_slice_share_the_slices_own_use() {
        const GIB: u64 = 1 << 30;
        // One process, figure unknown: the slice's use is its.
        assert_eq!(fill_unknown(&[None], 3 * GIB), [3 * GIB]);
        // Known figures stay; the rest of the slice's use is shared.
        assert_eq!(
            fill_unknown(&[Some(GIB), None, None], 5 * GIB),
            [GIB, 2 * GIB, 2 * GIB]
        );
        assert_eq!(
            fill_unknown(&[Some(GIB), Some(2 * GIB)], 9 * GIB),
            [GIB, 2 * GIB]
        );
        // Known figures above the slice's own (a racy read): no underflow.
        assert_eq!(fill_unknown(&[Some(4 * GIB), None], GIB), [4 * GIB, 0]);
        assert!(fill_unknown(&[], GIB).is_empty());
    }

    #[test]
    fn instance_ids_come_from_old_mig_uuids_only() {
        assert_eq!(
            legacy_mig_uuid_ids("MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/7/0"),
            (Some(7), Some(0))
        );
        assert_eq!(
            legacy_mig_uuid_ids("MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"),
            (None, None)
        );
        assert_eq!(legacy_mig_uuid_ids("MIG-GPU-x/y/z"), (None, None));
        assert_eq!(legacy_mig_uuid_ids("GPU-abc"), (None, None));
    }
}
