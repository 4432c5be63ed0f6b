//! The `TrainingJob` custom resource (`gpufit.io/v1alpha1`, short name `tj`).
//!
//! The Rust types here are the source of truth: `gpufit crd` prints the
//! CustomResourceDefinition generated from them, `crds/trainingjob.yaml` is
//! that output checked in, and a test fails when the two differ. Every field
//! carries a `///` doc, which becomes the schema description `kubectl explain`
//! shows.

use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::core::advisor::{Strategy, SuggestionSource};
use crate::core::settings::{DataLoaderSettings, Dtype, EngineeringSettings, Pins};
use crate::core::workload::{Attention, Framework, Method, Optimizer, Sharding};

/// API group of every gpufit resource and annotation prefix.
pub const GROUP: &str = "gpufit.io";

// === TrainingJob spec ===

/// A training job whose engineering settings (micro batch, gradient
/// accumulation, precision, activation checkpointing, compile, data loader)
/// gpufit chooses. gpufit creates a `batch/v1` Job from `template` with the
/// settings injected, watches it, learns from its peak GPU memory and retries
/// with a smaller micro batch after a CUDA out-of-memory failure.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpufit.io",
    version = "v1alpha1",
    kind = "TrainingJob",
    plural = "trainingjobs",
    singular = "trainingjob",
    shortname = "tj",
    category = "gpufit",
    namespaced,
    status = "TrainingJobStatus",
    doc = "A GPU training job whose engineering settings (micro batch, gradient accumulation, precision, activation checkpointing, compile, data loader) gpufit chooses, injects into a batch/v1 Job and learns from.",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase","description":"Pending, Running, Succeeded, Failed or Invalid"}"#,
    printcolumn = r#"{"name":"GPU","type":"string","jsonPath":".status.gpu","description":"GPU model the job runs on"}"#,
    printcolumn = r#"{"name":"Micro Batch","type":"integer","jsonPath":".status.suggestion.settings.microBatchSize","description":"Micro batch size gpufit chose"}"#,
    printcolumn = r#"{"name":"Dtype","type":"string","jsonPath":".status.suggestion.settings.dtype","description":"Training precision"}"#,
    printcolumn = r#"{"name":"Confidence","type":"number","jsonPath":".status.suggestion.confidence","description":"Confidence of the suggestion (0-1)"}"#,
    printcolumn = r#"{"name":"Peak GiB","type":"number","jsonPath":".status.peakGiB","description":"Measured peak GPU memory of the last finished attempt"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct TrainingJobSpec {
    /// What is trained: model, method, sequence length, optimizer, global
    /// batch, GPUs and sharding. gpufit reads these and never changes them.
    pub workload: WorkloadSpec,
    /// How close to the GPU's memory gpufit aims: `conservative` (70 %),
    /// `balanced` (85 %, default) or `aggressive` (93 %).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    /// Engineering settings you fix yourself. A pinned field is kept as is;
    /// gpufit only warns when it predicts the pinned value runs out of memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pins: Option<PinsSpec>,
    /// `Inject` (default): settings are written into the Job. `Recommend`:
    /// the Job runs as written; the suggestion goes to status and an
    /// annotation only. When unset, the TrainingJob's `gpufit.io/mode`
    /// annotation, then the namespace's `gpufit.io/mode` label decide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// How many times a CUDA out-of-memory failure is retried with the next,
    /// smaller suggestion before the TrainingJob fails (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_retry_limit: Option<u32>,
    /// GPU model the job gets, as NVML prints it (`NVIDIA A100-SXM4-80GB`).
    /// Only needed when the nodes carry no NVIDIA GPU Feature Discovery
    /// labels; otherwise gpufit reads `nvidia.com/gpu.product` from the nodes
    /// that match the template's node selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// `spec.backoffLimit` of the created Job (default 0: gpufit itself
    /// decides about retries, with new settings).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_limit: Option<i32>,
    /// Pod template of the training Job. Every container gets the same
    /// `GPUFIT_*` environment variables, and `{micro_batch_size}`-style
    /// placeholders in `command`/`args` are replaced by the chosen values.
    #[schemars(schema_with = "pod_template_schema")]
    pub template: PodTemplateSpec,
}

/// The embedded pod template is kept as an open object: the full
/// PodTemplateSpec schema would make the CRD larger than the 256 KiB that
/// `kubectl apply`'s last-applied annotation allows, and the API server
/// validates the pod when the Job is created anyway.
fn pod_template_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": "Pod template of the training Job (core/v1 PodTemplateSpec). Every container gets the same GPUFIT_* environment variables, and {micro_batch_size}-style placeholders in command/args are replaced by the chosen values.",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// What is trained (docs/design.md, "Domain"). Either `model` (a catalog id) or
/// `architecture` (numbers) must be given.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSpec {
    /// Catalog model id: Hugging Face id (`meta-llama/Llama-3.1-8B`), short id
    /// (`llama-3.1-8b`) or torchtune config name. Run `gpufit models` for the list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The model described by numbers, for a model not in the catalog.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<ArchitectureSpec>,
    /// Training method: `full`, `lora` or `qlora` (default `full`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<Method>,
    /// LoRA rank for `lora` and `qlora` (default 8; scientific: never changed).
    /// Refused with `full`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_rank: Option<u32>,
    /// Linear layers that get LoRA adapters (`q`, `k`, `v`, `o`, `gate`,
    /// `up`, `down`, `lm_head`); default the framework's (torchtune: q, v,
    /// o, gate, up, down; the others: q and v). Refused with `full`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_targets: Option<Vec<crate::core::workload::LoraTarget>>,
    /// Training sequence length in tokens.
    pub seq_len: u32,
    /// Optimizer: `adamw` (default), `adamw8bit`, `sgd`, `adafactor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<Optimizer>,
    /// Global batch size in samples (scientific). When given, gpufit keeps it
    /// exactly: micro batch × gradient accumulation × GPUs = global batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<u32>,
    /// Data-parallel GPUs of the job, all ranks together (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
    /// Sharding of model state: `none` (default), `zero1`, `zero2`, `zero3`, `fsdp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding: Option<Sharding>,
    /// Training framework whose defaults decide memory: `generic` (default),
    /// `hf`, `torchtune`, `litgpt`, `lightning`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framework: Option<Framework>,
    /// Attention kernel: `sdpa` (flash, default) or `eager`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<Attention>,
}

/// A model given by its architecture numbers (as in its Hugging Face config.json).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArchitectureSpec {
    /// Name recorded in the history for this model (similar runs share it).
    pub name: String,
    /// Total parameters, e.g. 8030261248.
    pub params: u64,
    /// Hidden size.
    pub hidden_size: u32,
    /// Transformer layers.
    pub layers: u32,
    /// Attention heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention); default `heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u32>,
    /// MLP intermediate size; default 4 × hidden size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate_size: Option<u32>,
    /// Vocabulary size.
    pub vocab_size: u32,
    /// Input and output embeddings share weights.
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Longest sequence the model supports (0 or unset: not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_len: Option<u32>,
}

/// Engineering settings the user fixes. Unset fields are gpufit's to choose.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PinsSpec {
    /// Micro batch size per GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<u32>,
    /// Gradient accumulation steps (must agree with the global batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<u32>,
    /// Precision: `fp32`, `bf16`, `fp16`, `bf16-mixed`, `fp16-mixed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// Activation checkpointing on or off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    /// Activation offloading to CPU on or off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_offloading: Option<bool>,
    /// `torch.compile` on or off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile: Option<bool>,
    /// Data-loader worker processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_workers: Option<u32>,
}

impl From<&PinsSpec> for Pins {
    fn from(p: &PinsSpec) -> Pins {
        Pins {
            micro_batch_size: p.micro_batch_size,
            gradient_accumulation_steps: p.gradient_accumulation_steps,
            dtype: p.dtype,
            activation_checkpointing: p.activation_checkpointing,
            activation_offloading: p.activation_offloading,
            compile: p.compile,
            num_workers: p.num_workers,
            pure_bf16: None,
        }
    }
}

/// Whether gpufit changes the job or only recommends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Mode {
    // Settings are written into the Job (environment, args, annotation).
    #[default]
    Inject,
    // Nothing is changed: the suggestion goes to status and an annotation.
    Recommend,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "inject" => Ok(Mode::Inject),
            "recommend" => Ok(Mode::Recommend),
            o => Err(format!("unknown mode `{o}`: use Inject or Recommend")),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Inject => "Inject",
            Mode::Recommend => "Recommend",
        })
    }
}

// === TrainingJob status ===

/// What gpufit decided and what happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrainingJobStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed` or `Invalid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// GPU model the job runs on, as NVML prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// Mode in effect (`Inject` or `Recommend`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// The suggestion of the current attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggestion: Option<SuggestionStatus>,
    /// Every attempt (one Job each), oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<Attempt>,
    /// Name of the Job of the current attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    /// Measured peak GPU memory of the last finished attempt, in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "peakGiB")]
    pub peak_gib: Option<f64>,
    /// Standard conditions: `Ready` (spec valid and Job created), `Invalid`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Life cycle of a TrainingJob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    // Accepted; the Job is being created or waits to be scheduled.
    Pending,
    // The Job's pods are running.
    Running,
    // The Job completed.
    Succeeded,
    // The Job failed (not out of memory, or out-of-memory retries exhausted).
    Failed,
    // The spec is wrong; see the `Invalid` condition. Fixed by editing the spec.
    Invalid,
}

impl Phase {
    /// Whether nothing more will happen without a spec change.
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed | Phase::Invalid)
    }
}

/// Engineering settings as they appear in status and annotations.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SettingsStatus {
    /// Micro batch size per GPU.
    pub micro_batch_size: u32,
    /// Gradient accumulation steps.
    pub gradient_accumulation_steps: u32,
    /// Precision.
    pub dtype: String,
    /// Activation checkpointing.
    pub activation_checkpointing: bool,
    /// Activation offloading to CPU.
    pub activation_offloading: bool,
    /// `torch.compile`.
    pub compile: bool,
    /// Data-loader worker processes.
    pub num_workers: u32,
    /// Data-loader pinned host memory.
    pub pin_memory: bool,
    /// Data-loader persistent workers.
    pub persistent_workers: bool,
    /// Data-loader prefetch factor.
    pub prefetch_factor: u32,
}

impl From<&EngineeringSettings> for SettingsStatus {
    fn from(s: &EngineeringSettings) -> Self {
        SettingsStatus {
            micro_batch_size: s.micro_batch_size,
            gradient_accumulation_steps: s.gradient_accumulation_steps,
            dtype: s.dtype.as_str().to_string(),
            activation_checkpointing: s.activation_checkpointing,
            activation_offloading: s.activation_offloading,
            compile: s.compile,
            num_workers: s.dataloader.num_workers,
            pin_memory: s.dataloader.pin_memory,
            persistent_workers: s.dataloader.persistent_workers,
            prefetch_factor: s.dataloader.prefetch_factor,
        }
    }
}

impl SettingsStatus {
    /// Back to the core type; `None` when the dtype string is not one gpufit knows.
    pub fn to_settings(&self) -> Option<EngineeringSettings> {
        Some(EngineeringSettings {
            micro_batch_size: self.micro_batch_size,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            dtype: self.dtype.parse().ok()?,
            activation_checkpointing: self.activation_checkpointing,
            activation_offloading: self.activation_offloading,
            compile: self.compile,
            dataloader: DataLoaderSettings {
                num_workers: self.num_workers,
                pin_memory: self.pin_memory,
                persistent_workers: self.persistent_workers,
                prefetch_factor: self.prefetch_factor,
            },
        })
    }
}

/// The advisor's suggestion, as recorded in status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SuggestionStatus {
    /// The engineering settings.
    pub settings: SettingsStatus,
    /// Predicted peak GPU memory in bytes.
    pub predicted_peak_bytes: u64,
    /// Predicted peak as a fraction of the GPU's memory.
    pub memory_fraction: f64,
    /// How sure the advisor is (0-1, capped at 0.95).
    pub confidence: f64,
    /// Where the suggestion comes from: `heuristic`, `historical_data`,
    /// `historical_data_with_memory`, `learned_from_failures`.
    pub source: SuggestionSource,
    /// Strategy used.
    pub strategy: Strategy,
    /// Why, in one or two sentences with the numbers.
    pub reasoning: String,
    /// Warnings (e.g. a pinned value predicted to run out of memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl From<&crate::core::advisor::Suggestion> for SuggestionStatus {
    fn from(s: &crate::core::advisor::Suggestion) -> Self {
        SuggestionStatus {
            settings: SettingsStatus::from(&s.settings),
            predicted_peak_bytes: s.predicted_peak_bytes,
            memory_fraction: s.memory_fraction,
            confidence: s.confidence,
            source: s.source,
            strategy: s.strategy,
            reasoning: s.reasoning.clone(),
            warnings: s.warnings.clone(),
        }
    }
}

/// One Job gpufit created for this TrainingJob.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Attempt {
    /// 1 for the first Job, 2 for the first retry, …
    pub index: u32,
    /// Name of the Job.
    pub job_name: String,
    /// Settings the Job ran with.
    pub settings: SettingsStatus,
    /// `Running`, `Succeeded`, `OOM`, `Failed` or `Deleted`.
    pub outcome: AttemptOutcome,
    /// Predicted peak GPU memory in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_peak_bytes: Option<u64>,
    /// Measured peak GPU memory in bytes (unset until known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_peak_bytes: Option<u64>,
    /// Where the measured peak came from (`prometheus`, `sidecar`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_source: Option<String>,
    /// (predicted − measured) / measured, when both are known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction_error: Option<f64>,
    /// UID of the Job, once it finished: part of the run's identity in the
    /// history (a TrainingJob deleted and created again reuses Job names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_uid: Option<String>,
    /// When the peak was last looked up without success (RFC 3339): later
    /// lookups are paced by time, not by reconciles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_peak_lookup: Option<String>,
    /// Training tokens/s per GPU the job reported in its termination
    /// message (torchtune, HF Trainer, Lightning or plain metric lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    /// Id of the run in the history store, once recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<i64>,
    /// Why the attempt ended as it did (termination message excerpt, exit code).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// A container was killed for host memory (`OOMKilled`): the next
    /// attempt's data loader gets fewer workers and no pinned memory.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub host_oom: bool,
    /// `metadata.generation` of the spec this attempt ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// Node the (first) pod ran on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// When the Job started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// When the Job finished (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// Mode the Job was created in. A `Recommend` Job ran with its own
    /// settings, which gpufit does not know, so it is not recorded as a run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// How many times the peak was looked up without an answer.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub peak_lookups: u32,
    /// Whether the Job confirmed it ran `settings` (`confirmed`), stated
    /// other settings (`ran_other`: they are in `ranSettings`) or said
    /// nothing (`unconfirmed`: its peak is only a floor). Set when it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<crate::core::confirm::Confirmation>,
    /// The settings the Job stated it ran, when they differ from `settings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ran_settings: Option<SettingsStatus>,
}

impl Attempt {
    /// A Job just created: running, nothing measured or recorded yet.
    pub fn started(
        index: u32,
        job_name: String,
        settings: SettingsStatus,
        generation: Option<i64>,
        mode: Mode,
    ) -> Self {
        Attempt {
            index,
            job_name,
            settings,
            outcome: AttemptOutcome::Running,
            predicted_peak_bytes: None,
            measured_peak_bytes: None,
            peak_source: None,
            prediction_error: None,
            tokens_per_sec: None,
            run_id: None,
            message: None,
            host_oom: false,
            confirmation: None,
            ran_settings: None,
            last_peak_lookup: None,
            job_uid: None,
            generation,
            mode: Some(mode),
            node: None,
            started_at: None,
            finished_at: None,
            peak_lookups: 0,
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum AttemptOutcome {
    // Still running.
    Running,
    // Completed.
    Succeeded,
    // CUDA out of memory.
    #[serde(rename = "OOM")]
    Oom,
    // Failed for another reason.
    Failed,
    // The Job was deleted before it finished.
    Deleted,
}

/// The CRD as YAML, as `gpufit crd` prints it and `crds/trainingjob.yaml` holds it.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    use kube::CustomResourceExt;
    serde_yaml::to_string(&TrainingJob::crd())
}
