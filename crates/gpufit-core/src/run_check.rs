//! The one door into the run history: [`check_run`] (also reached as
//! [`RunRecord::validated`]) decides whether a run may be stored.
//!
//! Every path that writes a run reaches it: the history stores call it in
//! their write methods (`record`, the batch insert of `history import`,
//! `record_node_report`, `set_peak`), and [`crate::run::merge_node_report`]
//! calls it on the record it makes. So `POST /v1/runs`, the Slurm Epilog,
//! `gpufit record`, `history import` and the controller's recorders all
//! pass the same checks, and whatever one of them stored is accepted again
//! by `history export | history import`. The checks are the strictest that
//! any path applied before (docs/design.md, "Run records and history"):
//!
//! - a GPU gpufit knows (its catalog name, alias or MIG slice, stored as the
//!   NVML name), or a name nothing in the catalog resembles (a custom GPU)
//!   whose peak is within the capacity the caller states, else within
//!   [`CUSTOM_GPU_CAP_FACTOR`] × the largest catalog card; never a
//!   placeholder (`auto`, `cpu`);
//! - a measured peak within the capacity of the GPU or slice the run used
//!   (+[`PEAK_TOLERANCE`]), a predicted peak within
//!   [`PREDICTION_CAP_FACTOR`] × that capacity, neither zero;
//! - names and ids of bounded length without control characters;
//! - a timestamp from [`MIN_TIMESTAMP_SECS`] to now + [`FUTURE_TOLERANCE_SECS`];
//! - settings and sizes within what the learner and the webhook accept;
//! - an outcome that can happen ([`crate::run::RunOutcome`]): no failure
//!   reason on a success, no host-memory kill on a success or a GPU OOM;
//! - node counts a job can have: 1 ≤ reported ≤ expected ≤ its GPUs (and
//!   [`MAX_NODES`]), the node list naming each reported node once.

use std::sync::OnceLock;

use chrono::{DateTime, Utc};

use crate::run::RunRecord;

/// Why a record cannot enter the history. Each names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecordError {
    #[error("gpu_model `{0}` is not a GPU: give the NVML name (e.g. `NVIDIA H100 80GB HBM3`), `gpufit gpus` lists them")]
    NotAGpu(String),
    #[error("gpu_model `{name}` is ambiguous or misspelt: did you mean {}?", .candidates.join(", "))]
    AmbiguousGpu {
        name: String,
        candidates: Vec<String>,
    },
    #[error("{field} = {value} is out of range: {expected}")]
    OutOfRange {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("peak_memory_bytes {peak} is more than the {capacity} bytes of {gpu} (+{tolerance_pct} %): not a measurement of this GPU")]
    PeakAboveCard {
        peak: u64,
        capacity: u64,
        gpu: String,
        tolerance_pct: u32,
    },
    #[error("timestamp {0} is in the future")]
    FromTheFuture(DateTime<Utc>),
    /// A multi-node job's report must say which node it is from.
    #[error("node: a multi-node job's report must name its node (SLURMD_NODENAME): without it a repeated report cannot be told from another node's")]
    NodeReportWithoutNode,
    /// A node's report without its job's id cannot join a record.
    #[error("job_id: a node's report (nodes.expected > 1) must carry its job's id (SLURM_JOB_ID): without it each node would make a record of its own")]
    NodeReportWithoutJob,
    /// A node's report too far from the job's end already recorded.
    #[error("node {node}'s report of job {job} is {apart_secs} s from the job's end already recorded, more than the {window_secs} s a node's report may be: not this run (a reused job id?) or a node's clock is off; the record is left as it was")]
    LateNodeReport {
        node: String,
        job: String,
        apart_secs: i64,
        window_secs: i64,
    },
    /// A node's report that describes another run than the job's record.
    #[error("{0}")]
    NotTheSameRun(Box<RunMismatch>),
    /// A one-node report whose job id already holds a multi-node record or
    /// an older run (a reused job id).
    #[error("job {job} already has {what}: a one-node report does not replace it; the record is left as it was (send each node's report with nodes.expected, or use a new job id)")]
    WouldReplace { job: String, what: String },
}

/// What differs between a node's report and its job's record.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("node {node}'s report of job {job} describes another run than the one recorded ({field}: recorded {recorded}, reported {reported}); the record is left as it was")]
pub struct RunMismatch {
    pub node: String,
    pub job: String,
    pub field: &'static str,
    pub recorded: String,
    pub reported: String,
}

/// GPU names that are placeholders, never a GPU model.
const NOT_GPU_NAMES: &[&str] = &[
    "auto", "unknown", "none", "null", "gpu", "cuda", "n/a", "-", "cpu", "host", "any", "default",
];

/// A measured peak may exceed the card's NVML total by this much (the
/// total is rounded in catalogs, and nvidia-smi sums processes).
pub const PEAK_TOLERANCE: f64 = 0.02;
/// Largest micro batch / accumulation a record may carry.
pub const MAX_BATCH: u32 = 65_536;
/// Largest global batch a record may carry.
pub const MAX_GLOBAL_BATCH: u32 = 16_777_216;
/// Largest plausible tokens/s of one job (a thousand H100s at 1 M tokens/s
/// each is 10^9).
pub const MAX_TOKENS_PER_SEC: f64 = 1e9;
/// Longest run: about a year, in seconds.
pub const MAX_DURATION_SEC: f64 = 3.2e7;
/// Clock skew allowed between a node and the history.
pub const FUTURE_TOLERANCE_SECS: i64 = 300;
/// Earliest timestamp a run may have: 2000-01-01T00:00:00Z (no GPU training
/// run gpufit learns from is older; year 1 is a zeroed clock).
pub const MIN_TIMESTAMP_SECS: i64 = 946_684_800;
/// Most nodes one job's record may count.
pub const MAX_NODES: u32 = 16_384;
/// Longest model name (bytes).
pub const MAX_MODEL_LEN: usize = 512;
/// Longest GPU name, cluster, job id or node name (bytes).
pub const MAX_NAME_LEN: usize = 256;
/// Largest data-loader worker count / prefetch factor.
pub const MAX_LOADER: u32 = 1024;
/// A GPU the catalog does not know, with no capacity stated: its peak may
/// be at most this many times the largest catalog card's memory.
pub const CUSTOM_GPU_CAP_FACTOR: u64 = 2;
/// A predicted peak may be at most this many times the GPU's capacity.
/// gpufit predicts for settings that fit, but a pinned micro batch may be
/// predicted well above the card (and is recorded: the run's lesson), so
/// the bound only refuses garbage (2^64 − 1, a prediction in the wrong
/// unit) that would swamp the prediction-error figures.
pub const PREDICTION_CAP_FACTOR: u64 = 64;

/// The largest whole card of the catalog, in bytes.
fn largest_card() -> u64 {
    static LARGEST: OnceLock<u64> = OnceLock::new();
    *LARGEST.get_or_init(|| {
        crate::catalog::all_gpus()
            .iter()
            .map(|g| g.memory_bytes)
            .max()
            .unwrap_or(0)
    })
}

/// A field's value as an error shows it: at most 64 characters, control
/// characters escaped.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(64).flat_map(char::escape_debug).collect();
    if s.chars().count() > 64 {
        out.push('…');
    }
    format!("\"{out}\"")
}

/// A bounded name without control characters.
fn check_text(field: &'static str, v: &str, max: usize) -> Result<(), RecordError> {
    if v.len() > max {
        return Err(RecordError::OutOfRange {
            field,
            value: format!("{} ({} bytes)", shown(v), v.len()),
            expected: "a name of at most 256 bytes (512 for model)",
        });
    }
    if v.chars().any(char::is_control) {
        return Err(RecordError::OutOfRange {
            field,
            value: shown(v),
            expected: "text without control characters",
        });
    }
    Ok(())
}

fn range(
    field: &'static str,
    v: u64,
    lo: u64,
    hi: u64,
    expected: &'static str,
) -> Result<(), RecordError> {
    if v < lo || v > hi {
        Err(RecordError::OutOfRange {
            field,
            value: v.to_string(),
            expected,
        })
    } else {
        Ok(())
    }
}

fn rate(
    field: &'static str,
    v: Option<f64>,
    max: f64,
    expected: &'static str,
) -> Result<(), RecordError> {
    match v {
        Some(x) if !(x.is_finite() && (0.0..=max).contains(&x)) => Err(RecordError::OutOfRange {
            field,
            value: crate::units::fmt_given(x),
            expected,
        }),
        _ => Ok(()),
    }
}

/// The history's one validation. Returns the record as stored (its GPU
/// resolved to the catalog's NVML name) or the first field at fault;
/// nothing is changed on error. `capacity` is the memory of the GPU the
/// caller measured on, when it knows it (NVML, `--gpu-memory`); a catalog
/// GPU's own capacity is used otherwise.
pub fn check_run(mut run: RunRecord, capacity: Option<u64>) -> Result<RunRecord, RecordError> {
    // --- the GPU and its capacity ---
    let name = run.gpu_model.trim().to_string();
    if name.is_empty() || NOT_GPU_NAMES.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(RecordError::NotAGpu(run.gpu_model.clone()));
    }
    check_text("gpu_model", &name, MAX_NAME_LEN)?;
    let (capacity, known) = match crate::catalog::lookup_gpu(&name) {
        Ok(spec) => {
            run.gpu_model = spec.name.clone();
            (capacity.unwrap_or(spec.memory_bytes), true)
        }
        Err(crate::catalog::CatalogError::UnknownGpu { suggestions, .. })
            if !suggestions.is_empty() =>
        {
            return Err(RecordError::AmbiguousGpu {
                name,
                candidates: suggestions,
            })
        }
        Err(_) => {
            run.gpu_model = name;
            (
                capacity.unwrap_or(largest_card().saturating_mul(CUSTOM_GPU_CAP_FACTOR)),
                false,
            )
        }
    };
    // --- names and ids ---
    if run.model.trim().is_empty() {
        return Err(RecordError::OutOfRange {
            field: "model",
            value: "\"\"".into(),
            expected: "a model name",
        });
    }
    check_text("model", &run.model, MAX_MODEL_LEN)?;
    for (field, v) in [("cluster", &run.cluster), ("job_id", &run.job_id)] {
        if let Some(v) = v {
            check_text(field, v, MAX_NAME_LEN)?;
        }
    }
    // --- sizes and settings ---
    let s = &run.settings;
    range(
        "micro_batch_size",
        s.micro_batch_size.into(),
        1,
        MAX_BATCH.into(),
        "1 to 65,536",
    )?;
    range(
        "gradient_accumulation_steps",
        s.gradient_accumulation_steps.into(),
        1,
        MAX_BATCH.into(),
        "1 to 65,536",
    )?;
    range(
        "settings.dataloader.num_workers",
        s.dataloader.num_workers.into(),
        0,
        MAX_LOADER.into(),
        "0 to 1,024",
    )?;
    range(
        "settings.dataloader.prefetch_factor",
        s.dataloader.prefetch_factor.into(),
        0,
        MAX_LOADER.into(),
        "0 to 1,024",
    )?;
    range("gpus", run.gpus.into(), 1, 1_000_000, "1 to 1,000,000")?;
    range(
        "seq_len",
        run.seq_len.into(),
        1,
        16_777_216,
        "1 to 16 M tokens",
    )?;
    if let Some(r) = run.lora_rank {
        range("lora_rank", r.into(), 1, 65_536, "1 to 65,536")?;
    }
    if let Some(g) = run.global_batch {
        range(
            "global_batch",
            g.into(),
            1,
            MAX_GLOBAL_BATCH.into(),
            "1 to 16,777,216",
        )?;
    }
    // --- memory ---
    if let Some(peak) = run.result.peak_memory_bytes {
        if peak == 0 {
            return Err(RecordError::OutOfRange {
                field: "peak_memory_bytes",
                value: "0".into(),
                expected: "a positive number of bytes (leave it out when unknown)",
            });
        }
        if peak as f64 > capacity as f64 * (1.0 + PEAK_TOLERANCE) {
            return Err(RecordError::PeakAboveCard {
                peak,
                capacity,
                gpu: if known {
                    run.gpu_model.clone()
                } else {
                    format!(
                        "{} (a GPU gpufit does not know; state its memory)",
                        run.gpu_model
                    )
                },
                tolerance_pct: (PEAK_TOLERANCE * 100.0) as u32,
            });
        }
    }
    if let Some(p) = run.predicted_peak_bytes {
        range(
            "predicted_peak_bytes",
            p,
            1,
            capacity.saturating_mul(PREDICTION_CAP_FACTOR),
            "a positive number of bytes, at most 64 times the GPU's memory (leave it out when no prediction was made)",
        )?;
    }
    // --- rates and times ---
    let r = &run.result;
    rate(
        "tokens_per_sec",
        r.tokens_per_sec,
        MAX_TOKENS_PER_SEC,
        "finite, 0 to 10^9",
    )?;
    rate(
        "samples_per_sec",
        r.samples_per_sec,
        MAX_TOKENS_PER_SEC,
        "finite, 0 to 10^9",
    )?;
    rate(
        "duration_sec",
        r.duration_sec,
        MAX_DURATION_SEC,
        "finite, 0 to 3.2 × 10^7 seconds (a year)",
    )?;
    if run.timestamp > Utc::now() + chrono::Duration::seconds(FUTURE_TOLERANCE_SECS) {
        return Err(RecordError::FromTheFuture(run.timestamp));
    }
    if run.timestamp.timestamp() < MIN_TIMESTAMP_SECS {
        return Err(RecordError::OutOfRange {
            field: "timestamp",
            value: run.timestamp.to_rfc3339(),
            expected: "2000-01-01 or later",
        });
    }
    // The stores keep microseconds: the record as stored, so that its
    // content identity and an export of it read back the same.
    if let Some(t) = DateTime::<Utc>::from_timestamp_micros(run.timestamp.timestamp_micros()) {
        run.timestamp = t;
    }
    // The outcome is one of the possible ones by its type (RunOutcome).
    // --- node counts ---
    check_nodes(&run)?;
    Ok(run)
}

/// The node counts of a record: those a job can have.
fn check_nodes(run: &RunRecord) -> Result<(), RecordError> {
    let node_list: Vec<&str> = run
        .node
        .as_deref()
        .unwrap_or("")
        .split(',')
        .filter(|n| !n.is_empty())
        .collect();
    for n in &node_list {
        check_text("node", n, MAX_NAME_LEN)?;
    }
    let Some(n) = &run.nodes else {
        return Ok(());
    };
    let bad = |value: String, expected: &'static str| RecordError::OutOfRange {
        field: "nodes",
        value,
        expected,
    };
    let most = run.gpus.min(MAX_NODES);
    if n.expected < 1 || n.expected > most {
        return Err(bad(
            format!("expected {} (job of {} GPUs)", n.expected, run.gpus),
            "1 to the job's GPUs (a node runs at least one), at most 16,384",
        ));
    }
    if n.reported < 1 || n.reported > n.expected {
        return Err(bad(
            format!("reported {} of {}", n.reported, n.expected),
            "1 to nodes.expected",
        ));
    }
    let mut sorted = node_list.clone();
    sorted.sort_unstable();
    sorted.dedup();
    // A lone report may leave its node unnamed here (a node's report
    // without one is refused where it is merged, as a report).
    let unnamed_one = node_list.is_empty() && n.reported == 1;
    if !unnamed_one
        && (sorted.len() != node_list.len()
            || u32::try_from(node_list.len()).ok() != Some(n.reported))
    {
        return Err(bad(
            format!(
                "reported {} with node list {}",
                n.reported,
                shown(run.node.as_deref().unwrap_or(""))
            ),
            "the node list names each reported node once",
        ));
    }
    let mut peakless = n.without_peak.clone();
    peakless.sort_unstable();
    peakless.dedup();
    if peakless.len() != n.without_peak.len()
        || !n
            .without_peak
            .iter()
            .all(|p| node_list.contains(&p.as_str()))
    {
        return Err(bad(
            format!("without_peak {:?}", n.without_peak),
            "reported nodes, each once",
        ));
    }
    // Every reported node without a peak: the record has none either.
    if u32::try_from(n.without_peak.len()).ok() == Some(n.reported)
        && run.result.peak_memory_bytes.is_some()
    {
        return Err(bad(
            format!("without_peak {:?} beside a peak", n.without_peak),
            "only the reported nodes without a peak; a record whose every node has none has no peak_memory_bytes",
        ));
    }
    Ok(())
}

/// Whether `new`, written as a whole record (not a node's report), may
/// replace `stored`, the record of the same identity
/// ([`RunRecord::identity`]): a replay of the same run may (a peak filled
/// in later, a re-import), but a one-node record never replaces a job's
/// multi-node record (its other nodes' reports would be lost), nor a run
/// more than [`crate::run::NODE_REPORT_WINDOW_SECS`] apart (a reused job
/// id: another run). The stores' upserts apply the same rule in SQL
/// (`history::schema::REPLACE_GUARD`).
pub fn check_replace(stored: &RunRecord, new: &RunRecord) -> Result<(), RecordError> {
    let multi = |r: &RunRecord| r.nodes.as_ref().is_some_and(|n| n.expected > 1);
    let job = || new.job_id.clone().unwrap_or_default();
    if multi(stored) && !multi(new) {
        let n = stored.nodes.as_ref().map_or(0, |n| n.reported);
        return Err(RecordError::WouldReplace {
            job: job(),
            what: format!(
                "a record of {n} of its {} nodes' reports",
                stored.nodes.as_ref().map_or(0, |n| n.expected)
            ),
        });
    }
    let apart = (new.timestamp - stored.timestamp).num_seconds();
    // A Kubernetes job's id carries its object's UID: never reused, and a
    // replayed reconcile (recorded at its own time) may come any time.
    let reusable = new.source != crate::run::RunSource::Kubernetes;
    if reusable && apart.abs() > crate::run::NODE_REPORT_WINDOW_SECS {
        return Err(RecordError::WouldReplace {
            job: job(),
            what: format!(
                "a run that ended at {}, {apart} s from this one (a reused job id)",
                stored.timestamp.to_rfc3339()
            ),
        });
    }
    Ok(())
}

impl RunRecord {
    /// [`check_run`]: the history's one validation.
    pub fn validated(self, capacity: Option<u64>) -> Result<RunRecord, RecordError> {
        check_run(self, capacity)
    }
}

#[cfg(test)]
mod validation_tests {
    use super::*;
    use crate::run::{FailureReason, RunOutcome, RunResult, RunSource};
    use crate::settings::EngineeringSettings;
    use crate::workload::Method;

    fn rec() -> RunRecord {
        RunRecord {
            confirmation: Default::default(),
            nodes: None,
            id: None,
            timestamp: Utc::now(),
            cluster: None,
            node: None,
            source: RunSource::Cli,
            job_id: None,
            model: "meta-llama/Llama-3.1-8B".into(),
            method: Method::Lora,
            gpu_model: "NVIDIA H100 80GB HBM3".into(),
            seq_len: 2048,
            lora_rank: Some(16),
            gpus: 1,
            global_batch: None,
            settings: EngineeringSettings {
                micro_batch_size: 4,
                ..EngineeringSettings::default()
            },
            result: RunResult {
                outcome: RunOutcome::Succeeded,
                peak_memory_bytes: Some(50_000_000_000),
                samples_per_sec: Some(5.0),
                tokens_per_sec: Some(10_000.0),
                duration_sec: Some(600.0),
            },
            predicted_peak_bytes: None,
        }
    }

    #[test]
    fn a_sane_record_passes_and_its_gpu_gets_the_nvml_name() {
        let mut r = rec();
        r.gpu_model = "h100-sxm".into();
        match r.validated(None) {
            Ok(v) => assert_eq!(v.gpu_model, "NVIDIA H100 80GB HBM3"),
            // The alias may not exist; then it must be refused, not stored raw.
            Err(e) => assert!(matches!(e, RecordError::AmbiguousGpu { .. }), "{e}"),
        }
        assert!(rec().validated(None).is_ok());
    }

    #[test]
    fn poison_is_refused_with_the_field_named() {
        type Poison = Box<dyn Fn(&mut RunRecord)>;
        let cases: Vec<(&str, Poison)> = vec![
            ("auto", Box::new(|r| r.gpu_model = "auto".into())),
            ("H100 ambiguous", Box::new(|r| r.gpu_model = "H100".into())),
            (
                "500 GB peak",
                Box::new(|r| r.result.peak_memory_bytes = Some(500_000_000_000)),
            ),
            (
                "2^64-1 peak",
                Box::new(|r| r.result.peak_memory_bytes = Some(u64::MAX)),
            ),
            (
                "zero peak",
                Box::new(|r| r.result.peak_memory_bytes = Some(0)),
            ),
            (
                "huge batch",
                Box::new(|r| r.settings.micro_batch_size = u32::MAX),
            ),
            ("zero batch", Box::new(|r| r.settings.micro_batch_size = 0)),
            (
                "zero accumulation",
                Box::new(|r| r.settings.gradient_accumulation_steps = 0),
            ),
            (
                "1e308 samples/s",
                Box::new(|r| r.result.samples_per_sec = Some(1e308)),
            ),
            (
                "negative samples/s",
                Box::new(|r| r.result.samples_per_sec = Some(-5.0)),
            ),
            (
                "NaN tokens/s",
                Box::new(|r| r.result.tokens_per_sec = Some(f64::NAN)),
            ),
            (
                "inf duration",
                Box::new(|r| r.result.duration_sec = Some(f64::INFINITY)),
            ),
            (
                "future",
                Box::new(|r| r.timestamp = Utc::now() + chrono::Duration::days(2)),
            ),
            ("cpu", Box::new(|r| r.gpu_model = "cpu".into())),
            (
                "unknown GPU with a 2^63 peak",
                Box::new(|r| {
                    r.gpu_model = "Zzz".into();
                    r.result.peak_memory_bytes = Some(1 << 63)
                }),
            ),
            ("10 kB model", Box::new(|r| r.model = "m".repeat(10_000))),
            ("escape in model", Box::new(|r| r.model = "m\x1b[2J".into())),
            (
                "predicted 2^64-1",
                Box::new(|r| r.predicted_peak_bytes = Some(u64::MAX)),
            ),
            (
                "predicted 0",
                Box::new(|r| r.predicted_peak_bytes = Some(0)),
            ),
            (
                "year 1",
                Box::new(|r| r.timestamp = DateTime::<Utc>::MIN_UTC),
            ),
        ];
        for (what, f) in cases {
            let mut r = rec();
            f(&mut r);
            assert!(r.validated(None).is_err(), "{what} was accepted");
        }
        // Impossible outcomes cannot be built, nor read from JSON.
        for (success, reason, host) in [
            (true, Some(FailureReason::Oom), false),
            (true, None, true),
            (false, Some(FailureReason::Oom), true),
            (false, None, false),
        ] {
            assert!(RunOutcome::from_fields(success, reason, host).is_err());
            let mut v = serde_json::to_value(rec()).unwrap();
            v["result"]["success"] = success.into();
            v["result"]["failure_reason"] = serde_json::to_value(reason).unwrap();
            v["result"]["host_oom"] = host.into();
            assert!(serde_json::from_value::<RunRecord>(v).is_err());
        }
        // A custom GPU the catalog does not know is accepted; its peak is
        // checked against the capacity the caller knows.
        let mut r = rec();
        r.gpu_model = "Test GPU".into();
        assert!(r.clone().validated(None).is_ok());
        assert!(r.validated(Some(10_000_000_000)).is_err());
    }
}
