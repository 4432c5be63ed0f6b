//! The JSON that crosses a process boundary, defined once: the node
//! sidecar's HTTP API (`docs/sidecar-api.md`) and the controller's HTTP API
//! for the Slurm hooks (`src/controller/api.rs`). Both servers serialize
//! these types and every client (the reconciler's sidecar client, the Slurm
//! TaskProlog and Epilog) deserializes them, so a field renamed on one side
//! fails to compile on the other instead of silently reading nothing.
//!
//! Serde types only: no I/O, no HTTP (docs/design.md, "Data flow").

/// The node sidecar's API.
pub mod sidecar {
    use chrono::{DateTime, Utc};
    use serde::{Deserialize, Serialize};

    /// Which implementation reads the GPUs.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
    #[serde(rename_all = "snake_case")]
    pub enum Backend {
        /// NVIDIA Management Library: the real one.
        Nvml,
        /// GPUs declared by hand in a YAML/TOML file; no per-job data.
        Inventory,
        /// Deterministic synthetic GPUs; processes registered over HTTP.
        Simulate,
    }

    impl Backend {
        /// The name used on the command line and in JSON.
        pub fn as_str(self) -> &'static str {
            match self {
                Backend::Nvml => "nvml",
                Backend::Inventory => "inventory",
                Backend::Simulate => "simulate",
            }
        }
    }

    impl std::fmt::Display for Backend {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.as_str())
        }
    }

    /// One GPU as the source sees it at one sampling instant.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct GpuInfo {
        /// Device index as NVML / nvidia-smi number it (not CUDA_VISIBLE_DEVICES order).
        pub index: u32,
        /// `GPU-…` UUID.
        pub uuid: String,
        /// Model name as NVML prints it, e.g. `NVIDIA H100 80GB HBM3`.
        pub name: String,
        pub memory_total_bytes: u64,
        pub memory_used_bytes: u64,
        pub memory_free_bytes: u64,
        /// CUDA compute capability, e.g. "9.0"; None when unknown.
        pub compute_capability: Option<String>,
        /// Fraction of the last sample period a kernel was running (0–1); None when unknown.
        pub utilization_ratio: Option<f64>,
        /// Whether MIG mode is on; None when unsupported or unknown.
        pub mig_enabled: Option<bool>,
        /// Whether NVML's accounting mode is on (exact per-process peaks); None when unknown.
        pub accounting_enabled: Option<bool>,
        /// False when reading the device failed at the last sample.
        pub healthy: bool,
        /// What failed, when unhealthy; on a healthy card in MIG mode, the
        /// reading NVML refused (its memory is then its slices').
        pub error: Option<String>,
        /// Set when this entry is a MIG slice of GPU `index` (a card in MIG
        /// mode is listed itself, then each of its slices); absent for a whole GPU.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub mig: Option<MigSlice>,
    }

    /// Where a MIG slice sits on its card. A slice is its own device: its
    /// own `uuid` (`MIG-…`), `name` (NVML's, e.g. `NVIDIA A100-SXM4-40GB MIG
    /// 1g.5gb`), memory and processes; `index` is its card's.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct MigSlice {
        /// The slice's place among its card's MIG devices (the index NVML's
        /// `nvmlDeviceGetMigDeviceHandleByIndex` takes, 0 to 6): with `index`,
        /// what identifies the slice on this node.
        pub device: u32,
        /// The MIG profile, e.g. `1g.5gb`.
        pub profile: String,
        /// The card's `GPU-…` UUID.
        pub parent_uuid: String,
        /// The GPU instance id, when known (NVML reports it with the
        /// slice's processes).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub gpu_instance_id: Option<u32>,
        /// The compute instance id within the GPU instance, when known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub compute_instance_id: Option<u32>,
    }

    /// A MIG slice as a job's device: its place on the card and its profile.
    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    pub struct SliceRef {
        /// [`MigSlice::device`].
        pub device: u32,
        /// [`MigSlice::profile`].
        pub profile: String,
    }

    /// How a peak was measured.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum PeakMethod {
        /// The largest value seen by sampling at the sidecar's interval.
        Sampled,
        /// NVML accounting's per-process maximum: exact.
        NvmlAccounting,
        /// Stated in the job's own log (torchtune and others print it), supplied to the sidecar.
        Log,
    }

    impl PeakMethod {
        /// The label value used in metrics and JSON.
        pub fn as_str(self) -> &'static str {
            match self {
                PeakMethod::Sampled => "sampled",
                PeakMethod::NvmlAccounting => "nvml_accounting",
                PeakMethod::Log => "log",
            }
        }
    }

    /// One GPU of a job, as served.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct JobGpuView {
        pub gpu: u32,
        /// The MIG slice of GPU `gpu` the job ran on; absent for a whole GPU.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub mig: Option<SliceRef>,
        pub current_bytes: u64,
        pub peak_bytes: u64,
        pub method: PeakMethod,
    }

    /// A job as served by `/v1/jobs` and `/v1/jobs/{id}`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct JobView {
        /// `namespace/pod`, a pod UID, or a Slurm job id.
        pub id: String,
        /// `pod`, `pod_uid` or `slurm`.
        pub kind: String,
        pub namespace: Option<String>,
        pub pod: Option<String>,
        pub pod_uid: Option<String>,
        pub slurm_job_id: Option<String>,
        pub node: String,
        /// False once none of its processes is seen any more.
        pub running: bool,
        /// Largest current per-GPU use (bytes).
        pub current_bytes: u64,
        /// Sum of current use over its GPUs (bytes).
        pub current_total_bytes: u64,
        /// The job's peak per GPU (bytes): the log-stated peak when supplied, else the measured one.
        pub peak_bytes: u64,
        /// How `peak_bytes` was measured.
        pub method: PeakMethod,
        /// The peak the sidecar measured itself, whatever the log says.
        pub measured_peak_bytes: u64,
        /// How `measured_peak_bytes` was measured.
        pub measured_method: PeakMethod,
        pub gpus: Vec<JobGpuView>,
        /// Processes seen at the last sample.
        pub processes: usize,
        pub first_seen: DateTime<Utc>,
        pub last_seen: DateTime<Utc>,
        pub ended_at: Option<DateTime<Utc>>,
    }

    /// `/v1/gpus` body.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct GpusResponse {
        pub node: String,
        pub backend: Backend,
        pub sampled_at: Option<DateTime<Utc>>,
        pub gpus: Vec<GpuInfo>,
    }

    /// `/v1/jobs` body.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct JobsResponse {
        pub node: String,
        pub backend: Backend,
        /// False for the inventory backend, which sees no processes.
        pub per_job_data: bool,
        pub jobs: Vec<JobView>,
    }

    /// `/healthz` body.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Health {
        /// `ok`, or `stale` when the sampler has not run for a while.
        pub status: String,
        pub node: String,
        pub backend: Backend,
        pub gpus: usize,
        pub unhealthy_gpus: Vec<u32>,
        pub tracked_jobs: usize,
        pub last_sample_age_seconds: Option<f64>,
    }

    /// Body of `POST /v1/jobs/{id}/log-peak`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct LogPeakRequest {
        /// Any JSON number, checked by [`check_log_peak`] (a negative or
        /// fractional one gets a reason, not serde's message).
        pub peak_bytes: serde_json::Number,
    }

    /// Body of every sidecar error response.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct ErrorBody {
        pub error: String,
    }
}

/// The controller's HTTP API (`POST /v1/suggest`, `POST /v1/runs`).
pub mod api {
    use serde::{Deserialize, Serialize};

    use crate::core::advisor::Strategy;
    use crate::core::catalog::GpuSpec;
    use crate::core::request::ArchNumbers;
    use crate::core::settings::Pins;
    use crate::core::workload::{
        Attention, FieldNames, Framework, LoraTarget, Method as TrainMethod, Optimizer, Sharding,
        WorkloadField,
    };

    /// A workload as the Slurm hooks describe it: a catalog model (or its
    /// architecture numbers) plus the scientific numbers. Resolved with the
    /// model catalog on the controller.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct WorkloadSpec {
        /// Catalog model id (`meta-llama/Llama-3.1-8B`, `llama-3.1-8b`, a
        /// torchtune name); empty when `architecture` gives the model.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub model: String,
        /// The model by its numbers, for a model not in the catalog (the
        /// TrainingJob's `architecture`, in snake_case).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub architecture: Option<ArchNumbers>,
        /// full, lora or qlora; default the method the model name implies, else full.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub method: Option<TrainMethod>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub lora_rank: Option<u32>,
        /// Default: the framework's default targets (as `gpufit suggest`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub lora_targets: Option<Vec<LoraTarget>>,
        pub seq_len: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub global_batch: Option<u32>,
        /// Data-parallel GPUs; default 1.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub gpus: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub optimizer: Option<Optimizer>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub sharding: Option<Sharding>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub framework: Option<Framework>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub attention: Option<Attention>,
    }

    /// The GPU of a suggestion: a catalog name, or a full spec with live values
    /// (which win over the catalog).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(untagged)]
    pub enum GpuRef {
        Name(String),
        Spec(GpuSpec),
    }

    /// The JSON request's names for the workload's fields:
    /// `workload.lora_rank`, `workload.architecture.kv_heads`.
    pub struct JsonNames;

    impl FieldNames for JsonNames {
        fn name(&self, field: WorkloadField) -> String {
            format!("workload.{}", field.domain_name())
        }
    }

    /// Body of `POST /v1/suggest`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SuggestRequest {
        pub workload: WorkloadSpec,
        pub gpu: GpuRef,
        /// Default balanced.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub strategy: Option<Strategy>,
        #[serde(default)]
        pub pins: Pins,
        /// CPU cores the job has per GPU (its pod's or Slurm job's, never
        /// the server's), for the data-loader workers; absent: unknown.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub cpus_per_gpu: Option<u32>,
    }

    /// Body of an error response.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct ErrorBody {
        pub error: String,
        pub status: u16,
    }

    /// Body of a `201` answer to `POST /v1/runs`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct RunCreated {
        pub id: i64,
    }

    /// Body of `GET /healthz`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct HealthBody {
        pub status: String,
    }
}
