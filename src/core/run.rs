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

// === identity ===

impl RunRecord {
    /// The run's stable identity, so recording or importing it twice stores
    /// it once (a replay updates the stored row, e.g. with a peak filled in
    /// later): `source|cluster|job id` where the adapter knows the job (the
    /// reconciler's `namespace/name/uid`, the Slurm job id), else a content
    /// hash of the whole record (imports, CLI records: the same line
    /// imported twice is the same run; `record` run twice at different
    /// times is two runs).
    pub fn identity(&self) -> String {
        match &self.job_id {
            Some(job) if !job.is_empty() => format!(
                "{}|{}|{}",
                serde_json::to_value(self.source)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                self.cluster.as_deref().unwrap_or(""),
                job
            ),
            _ => {
                let mut canon = self.clone();
                canon.id = None;
                let text = serde_json::to_string(&canon).unwrap_or_default();
                format!("h:{:016x}{:016x}", fnv1a(&text, FNV_A), fnv1a(&text, FNV_B))
            }
        }
    }
}

/// FNV-1a offset bases of two independent 64-bit hashes (128 bits together:
/// a collision among 10^9 records has odds of about 10^-21).
const FNV_A: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_B: u64 = 0x6c62_272e_07bb_0142;

fn fnv1a(s: &str, basis: u64) -> u64 {
    s.bytes().fold(basis, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    fn rec(job: Option<&str>) -> RunRecord {
        RunRecord {
            id: None,
            timestamp: DateTime::<Utc>::UNIX_EPOCH,
            cluster: Some("c1".into()),
            node: None,
            source: RunSource::Slurm,
            job_id: job.map(str::to_string),
            model: "m".into(),
            method: Method::Full,
            gpu_model: "NVIDIA A100-SXM4-80GB".into(),
            seq_len: 2048,
            lora_rank: None,
            gpus: 1,
            global_batch: None,
            settings: EngineeringSettings::default(),
            result: RunResult {
                success: true,
                failure_reason: None,
                peak_memory_bytes: Some(1),
                samples_per_sec: None,
                tokens_per_sec: None,
                duration_sec: None,
            },
            predicted_peak_bytes: None,
        }
    }

    #[test]
    fn a_job_is_identified_by_source_cluster_and_job_id_whatever_its_result() {
        let a = rec(Some("42"));
        let mut b = a.clone();
        b.result.peak_memory_bytes = Some(2);
        b.id = Some(7);
        assert_eq!(a.identity(), b.identity());
        assert_eq!(a.identity(), "slurm|c1|42");
        let mut other = a.clone();
        other.cluster = Some("c2".into());
        assert_ne!(a.identity(), other.identity());
    }

    #[test]
    fn without_a_job_id_the_content_identifies_the_run() {
        let a = rec(None);
        assert_eq!(a.identity(), rec(None).identity());
        let mut b = a.clone();
        b.timestamp = DateTime::<Utc>::UNIX_EPOCH + chrono::Duration::seconds(1);
        assert_ne!(a.identity(), b.identity());
        assert!(a.identity().starts_with("h:") && a.identity().len() == 34);
    }
}
