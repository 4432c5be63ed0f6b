//! The result record a training process writes about itself (the Python
//! package's Hugging Face / Lightning callbacks and `gpufit.track`): the
//! settings the job really ran, the exact per-rank peak and the measured
//! throughput. It is what confirms a run (learn only from runs whose
//! settings are confirmed); docs/python.md, "The result record" documents
//! it.
//!
//! Where it is written — read by the recorders:
//! - Kubernetes: the container's termination-message file (default
//!   `/dev/termination-log`), at most [`MAX_RECORD_BYTES`] bytes, the limit
//!   the kubelet keeps;
//! - Slurm: the file the TaskProlog names in `GPUFIT_RESULT_FILE`
//!   ([`slurm_result_path`]), read by the Epilog;
//! - optionally the controller's API, with its token.
//!
//! Parsing is strict: unknown fields, a missing or newer
//! [`SCHEMA_VERSION`], impossible values (batch 0, rank ≥ world size,
//! negative or non-finite throughput, reserved below allocated) are errors,
//! so a recorder never learns from a half-understood record.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::settings::{Dtype, EngineeringSettings};

/// The version this crate writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// The kubelet keeps at most 4096 bytes of a termination message; a longer
/// record would be cut and unreadable, so none is written or read.
pub const MAX_RECORD_BYTES: usize = 4096;

/// Environment variable naming the file a Slurm task writes its record to
/// (exported by the TaskProlog, read back by the Epilog).
pub const RESULT_FILE_ENV: &str = "GPUFIT_RESULT_FILE";

/// The file a Slurm job's record goes to: the TaskProlog exports it as
/// [`RESULT_FILE_ENV`], the Epilog reads it. In `/tmp`, which every job can
/// write and the Epilog (root) can read; the job id keeps jobs apart.
pub fn slurm_result_path(job_id: &str) -> PathBuf {
    // Only the characters of a Slurm job id (digits, `_` of array jobs, `+`
    // of heterogeneous ones); anything else cannot name another file.
    let safe: String = job_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '+' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    PathBuf::from(format!("/tmp/gpufit-result-{safe}.json"))
}

/// Which integration wrote the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordSource {
    /// `gpufit.integrations.hf.GpufitCallback` (Hugging Face Trainer).
    Hf,
    /// `gpufit.integrations.lightning.GpufitCallback`.
    Lightning,
    /// `gpufit.track(...)`: what the script said it runs.
    Track,
}

/// How the training ended, as the process saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordOutcome {
    Completed,
    /// `torch.cuda.OutOfMemoryError` (CUDA out of memory).
    Oom,
    /// Any other exception.
    Failed,
}

/// Engineering settings as a job states them: every field optional, since a
/// framework does not expose all of them (Lightning has no compile flag).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatedSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_offloading: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_workers: Option<u32>,
}

impl From<&EngineeringSettings> for StatedSettings {
    /// Every field stated: the settings as a job would state them.
    fn from(s: &EngineeringSettings) -> Self {
        StatedSettings {
            micro_batch_size: Some(s.micro_batch_size),
            gradient_accumulation_steps: Some(s.gradient_accumulation_steps),
            dtype: Some(s.dtype),
            activation_checkpointing: Some(s.activation_checkpointing),
            activation_offloading: Some(s.activation_offloading),
            compile: Some(s.compile),
            num_workers: Some(s.dataloader.num_workers),
        }
    }
}

impl StatedSettings {
    /// The fields both state with different values: `(field, injected, ran)`.
    pub fn differences(&self, ran: &StatedSettings) -> Vec<(&'static str, String, String)> {
        fn cmp<T: PartialEq + std::fmt::Display>(
            out: &mut Vec<(&'static str, String, String)>,
            name: &'static str,
            a: Option<T>,
            b: Option<T>,
        ) {
            if let (Some(a), Some(b)) = (a, b) {
                if a != b {
                    out.push((name, a.to_string(), b.to_string()));
                }
            }
        }
        let mut out = Vec::new();
        cmp(
            &mut out,
            "micro_batch_size",
            self.micro_batch_size,
            ran.micro_batch_size,
        );
        cmp(
            &mut out,
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            ran.gradient_accumulation_steps,
        );
        cmp(&mut out, "dtype", self.dtype, ran.dtype);
        cmp(
            &mut out,
            "activation_checkpointing",
            self.activation_checkpointing,
            ran.activation_checkpointing,
        );
        cmp(
            &mut out,
            "activation_offloading",
            self.activation_offloading,
            ran.activation_offloading,
        );
        cmp(&mut out, "compile", self.compile, ran.compile);
        cmp(&mut out, "num_workers", self.num_workers, ran.num_workers);
        out
    }

    fn validate(&self, what: &str) -> Result<(), ResultRecordError> {
        for (name, v) in [
            ("micro_batch_size", self.micro_batch_size),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
        ] {
            if v == Some(0) {
                return Err(ResultRecordError::Invalid(format!(
                    "{what}.{name} is 0: a step needs at least 1"
                )));
            }
        }
        Ok(())
    }
}

/// One rank's exact peak, from PyTorch's caching allocator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankPeak {
    pub rank: u32,
    /// `torch.cuda.max_memory_allocated()`.
    pub allocated_bytes: u64,
    /// `torch.cuda.max_memory_reserved()`: what the GPU had to hold.
    pub reserved_bytes: u64,
}

/// The record (schema version 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResultRecord {
    /// Always [`SCHEMA_VERSION`] when written by this version.
    pub schema_version: u32,
    pub source: RecordSource,
    /// Data-parallel world size (`WORLD_SIZE`, 1 for a single process).
    pub world_size: u32,
    /// What gpufit injected (`GPUFIT_*` variables), absent when nothing was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub injected: Option<StatedSettings>,
    /// What the job really ran.
    pub ran: StatedSettings,
    /// Per-rank peaks; empty without CUDA.
    #[serde(default)]
    pub peaks: Vec<RankPeak>,
    /// Training tokens per second over all ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_sec: Option<f64>,
    /// Optimizer steps measured.
    pub steps: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_sec: Option<f64>,
    pub outcome: RecordOutcome,
    /// `torch.cuda.get_device_name()` when CUDA is present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// `GPUFIT_JOB_ID` when gpufit decided the settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
}

#[derive(Debug, Error, PartialEq)]
pub enum ResultRecordError {
    #[error(
        "result record is {0} bytes, more than the {MAX_RECORD_BYTES} a termination message keeps"
    )]
    TooLarge(usize),
    #[error("result record is not valid JSON of schema version {SCHEMA_VERSION}: {0}")]
    Malformed(String),
    #[error("result record has schema version {found}; this gpufit reads version {SCHEMA_VERSION}: upgrade gpufit")]
    UnsupportedVersion { found: u32 },
    #[error("result record refused: {0}")]
    Invalid(String),
}

impl ResultRecord {
    /// Reads a record: the whole text must be one JSON object of this schema.
    pub fn parse(text: &str) -> Result<Self, ResultRecordError> {
        if text.len() > MAX_RECORD_BYTES {
            return Err(ResultRecordError::TooLarge(text.len()));
        }
        // The version first, so a newer record says "upgrade" rather than
        // failing on a field this version does not know.
        #[derive(Deserialize)]
        struct Version {
            schema_version: Option<u32>,
        }
        let v: Version = serde_json::from_str(text.trim())
            .map_err(|e| ResultRecordError::Malformed(e.to_string()))?;
        match v.schema_version {
            None => {
                return Err(ResultRecordError::Malformed(
                    "missing field `schema_version`".into(),
                ))
            }
            Some(found) if found != SCHEMA_VERSION => {
                return Err(ResultRecordError::UnsupportedVersion { found })
            }
            Some(_) => {}
        }
        let r: ResultRecord = serde_json::from_str(text.trim())
            .map_err(|e| ResultRecordError::Malformed(e.to_string()))?;
        r.validate()?;
        Ok(r)
    }

    /// The compact JSON written, checked and within [`MAX_RECORD_BYTES`].
    pub fn to_json(&self) -> Result<String, ResultRecordError> {
        self.validate()?;
        let s =
            serde_json::to_string(self).map_err(|e| ResultRecordError::Malformed(e.to_string()))?;
        if s.len() > MAX_RECORD_BYTES {
            return Err(ResultRecordError::TooLarge(s.len()));
        }
        Ok(s)
    }

    /// Whether the job ran other settings than gpufit injected.
    pub fn mismatches(&self) -> Vec<(&'static str, String, String)> {
        self.injected
            .as_ref()
            .map(|i| i.differences(&self.ran))
            .unwrap_or_default()
    }

    /// The settings the job ran, for the history: `base` (what gpufit
    /// injected or planned) with every field the record states replaced.
    pub fn ran_settings(&self, base: &EngineeringSettings) -> EngineeringSettings {
        let mut s = base.clone();
        crate::confirm::overlay(&mut s, &self.ran);
        s
    }

    /// The largest reserved peak over the ranks (what the GPU had to hold).
    pub fn peak_reserved_bytes(&self) -> Option<u64> {
        self.peaks.iter().map(|p| p.reserved_bytes).max()
    }

    /// Checks the values a recorder relies on.
    pub fn validate(&self) -> Result<(), ResultRecordError> {
        let bad = |m: String| Err(ResultRecordError::Invalid(m));
        if self.schema_version != SCHEMA_VERSION {
            return Err(ResultRecordError::UnsupportedVersion {
                found: self.schema_version,
            });
        }
        if self.world_size == 0 {
            return bad("world_size is 0".into());
        }
        if let Some(i) = &self.injected {
            i.validate("injected")?;
        }
        self.ran.validate("ran")?;
        if self.ran.micro_batch_size.is_none() {
            return bad(
                "ran.micro_batch_size is missing: the record confirms the micro batch the job ran"
                    .into(),
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for p in &self.peaks {
            if p.rank >= self.world_size {
                return bad(format!(
                    "peaks: rank {} is outside world_size {}",
                    p.rank, self.world_size
                ));
            }
            if !seen.insert(p.rank) {
                return bad(format!("peaks: rank {} appears twice", p.rank));
            }
            if p.reserved_bytes < p.allocated_bytes {
                return bad(format!(
                    "peaks: rank {} reserved {} bytes, less than the {} allocated",
                    p.rank, p.reserved_bytes, p.allocated_bytes
                ));
            }
        }
        for (name, v) in [
            ("tokens_per_sec", self.tokens_per_sec),
            ("samples_per_sec", self.samples_per_sec),
            ("duration_sec", self.duration_sec),
        ] {
            if let Some(x) = v {
                if !x.is_finite() || x < 0.0 {
                    return bad(format!("{name} must be a non-negative number (got {x})"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ResultRecord {
        ResultRecord {
            schema_version: SCHEMA_VERSION,
            source: RecordSource::Hf,
            world_size: 2,
            injected: Some(StatedSettings {
                micro_batch_size: Some(4),
                dtype: Some(Dtype::Bf16),
                ..Default::default()
            }),
            ran: StatedSettings {
                micro_batch_size: Some(8),
                gradient_accumulation_steps: Some(2),
                dtype: Some(Dtype::Bf16Mixed),
                activation_checkpointing: Some(false),
                compile: Some(false),
                num_workers: Some(2),
                ..Default::default()
            },
            peaks: vec![
                RankPeak {
                    rank: 0,
                    allocated_bytes: 10,
                    reserved_bytes: 20,
                },
                RankPeak {
                    rank: 1,
                    allocated_bytes: 12,
                    reserved_bytes: 24,
                },
            ],
            tokens_per_sec: Some(1234.5),
            samples_per_sec: Some(2.0),
            steps: 10,
            duration_sec: Some(5.0),
            outcome: RecordOutcome::Completed,
            device: None,
            job_id: Some("7".into()),
        }
    }

    #[test]
    fn a_record_round_trips_and_reports_what_differs_from_the_injection() {
        let r = record();
        let text = r.to_json().unwrap();
        let back = ResultRecord::parse(&text).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.peak_reserved_bytes(), Some(24));
        let m = back.mismatches();
        assert_eq!(
            m,
            vec![
                ("micro_batch_size", "4".into(), "8".into()),
                ("dtype", "bf16".into(), "bf16-mixed".into())
            ]
        );
    }

    #[test]
    fn the_settings_that_ran_replace_the_injected_ones_field_by_field() {
        let injected = EngineeringSettings {
            micro_batch_size: 4,
            gradient_accumulation_steps: 4,
            activation_offloading: true,
            ..Default::default()
        };
        let s = record().ran_settings(&injected);
        assert_eq!(s.micro_batch_size, 8);
        assert_eq!(s.gradient_accumulation_steps, 2);
        assert_eq!(s.dtype, Dtype::Bf16Mixed);
        assert_eq!(s.dataloader.num_workers, 2);
        // Not stated by the record: kept as injected.
        assert!(s.activation_offloading);
        assert_eq!(
            s.dataloader.prefetch_factor,
            injected.dataloader.prefetch_factor
        );
    }

    #[test]
    fn unknown_fields_missing_or_newer_versions_are_refused() {
        let mut v: serde_json::Value = serde_json::from_str(&record().to_json().unwrap()).unwrap();
        v["extra"] = serde_json::json!(1);
        assert!(matches!(
            ResultRecord::parse(&v.to_string()),
            Err(ResultRecordError::Malformed(_))
        ));
        v.as_object_mut().unwrap().remove("extra");
        v["schema_version"] = serde_json::json!(2);
        // A newer record says "upgrade", even with fields this one lacks.
        v["new_field"] = serde_json::json!(true);
        assert_eq!(
            ResultRecord::parse(&v.to_string()),
            Err(ResultRecordError::UnsupportedVersion { found: 2 })
        );
        v.as_object_mut().unwrap().remove("schema_version");
        assert!(ResultRecord::parse(&v.to_string())
            .unwrap_err()
            .to_string()
            .contains("schema_version"));
        assert!(ResultRecord::parse("OOMKilled").is_err());
        assert!(ResultRecord::parse("").is_err());
    }

    #[test]
    fn impossible_values_are_refused() {
        type Edit = Box<dyn Fn(&mut ResultRecord)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("world 0", Box::new(|r| r.world_size = 0)),
            ("batch 0", Box::new(|r| r.ran.micro_batch_size = Some(0))),
            ("no batch", Box::new(|r| r.ran.micro_batch_size = None)),
            (
                "accum 0",
                Box::new(|r| r.ran.gradient_accumulation_steps = Some(0)),
            ),
            ("rank out", Box::new(|r| r.peaks[1].rank = 2)),
            ("rank twice", Box::new(|r| r.peaks[1].rank = 0)),
            (
                "reserved<alloc",
                Box::new(|r| r.peaks[0].reserved_bytes = 1),
            ),
            ("nan", Box::new(|r| r.tokens_per_sec = Some(f64::NAN))),
            ("neg", Box::new(|r| r.duration_sec = Some(-1.0))),
        ];
        for (name, f) in cases {
            let mut r = record();
            f(&mut r);
            assert!(r.to_json().is_err(), "{name}");
        }
        // The same checks on reading what another writer produced.
        let text = r#"{"schema_version":1,"source":"track","world_size":1,"ran":{"micro_batch_size":0},"steps":1,"outcome":"completed"}"#;
        assert!(matches!(
            ResultRecord::parse(text),
            Err(ResultRecordError::Invalid(_))
        ));
    }

    #[test]
    fn records_beyond_the_termination_message_limit_are_refused() {
        let mut r = record();
        r.device = Some("x".repeat(MAX_RECORD_BYTES));
        assert!(matches!(r.to_json(), Err(ResultRecordError::TooLarge(_))));
        let big = format!("{:width$}", "{}", width = MAX_RECORD_BYTES + 1);
        assert!(matches!(
            ResultRecord::parse(&big),
            Err(ResultRecordError::TooLarge(_))
        ));
    }

    #[test]
    fn the_slurm_path_cannot_leave_tmp() {
        assert_eq!(
            slurm_result_path("123_4"),
            PathBuf::from("/tmp/gpufit-result-123_4.json")
        );
        assert_eq!(
            slurm_result_path("../../etc/x"),
            PathBuf::from("/tmp/gpufit-result-______etc_x.json")
        );
    }
}
