//! A run record: one finished (or failed) training run, with the prediction
//! that was made for it so prediction error can be tracked (SPEC §4).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::core::settings::EngineeringSettings;
use crate::core::workload::Method;

/// Where a run was recorded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunSource {
    Kubernetes,
    Slurm,
    Cli,
    FindMaxBatch,
    Import,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum FailureReason {
    #[serde(rename = "OOM", alias = "oom")]
    Oom,
    #[serde(rename = "other_error", alias = "other")]
    OtherError,
}

/// The outcome of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunResult {
    pub success: bool,
    pub failure_reason: Option<FailureReason>,
    /// Measured peak GPU memory in bytes; None when unknown (filled in later).
    pub peak_memory_bytes: Option<u64>,
    pub samples_per_sec: Option<f64>,
    pub tokens_per_sec: Option<f64>,
    pub duration_sec: Option<f64>,
}

/// One run of a workload with given settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunRecord {
    /// Store-assigned id (None before it is stored).
    pub id: Option<i64>,
    pub timestamp: DateTime<Utc>,
    pub cluster: Option<String>,
    pub node: Option<String>,
    pub source: RunSource,
    /// Job id in its system (Kubernetes namespace/name, Slurm job id), if any.
    pub job_id: Option<String>,
    // --- the similarity key (see `core::similarity`) ---
    /// Canonical model id.
    pub model: String,
    pub method: Method,
    /// GPU model name as NVML prints it.
    pub gpu_model: String,
    pub seq_len: u32,
    // --- other workload fields, kept for context ---
    pub lora_rank: Option<u32>,
    pub gpus: u32,
    pub global_batch: Option<u32>,
    // --- what was used and what happened ---
    pub settings: EngineeringSettings,
    pub result: RunResult,
    /// The peak gpufit predicted for these settings, if a prediction was made.
    pub predicted_peak_bytes: Option<u64>,
}

impl RunRecord {
    pub fn is_oom(&self) -> bool {
        !self.result.success && self.result.failure_reason == Some(FailureReason::Oom)
    }

    /// Relative prediction error (predicted − measured) / measured, when both are known.
    pub fn prediction_error(&self) -> Option<f64> {
        let measured = self.result.peak_memory_bytes? as f64;
        let predicted = self.predicted_peak_bytes? as f64;
        if measured <= 0.0 {
            return None;
        }
        Some((predicted - measured) / measured)
    }
}
