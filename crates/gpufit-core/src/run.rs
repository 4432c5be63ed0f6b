//! A run record: one finished (or failed) training run, with the prediction
//! that was made for it so prediction error can be tracked (docs/design.md, "Run records and history").

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::confirm::Confirmation;
use crate::settings::EngineeringSettings;
use crate::workload::{Method, Workload};

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

/// Why a run failed. Stored and sent as `OOM` / `other_error`; read from
/// any spelling [`FailureReason::from_str`] accepts (JSON included), and
/// from free text by [`crate::logs::oom::failure_reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, JsonSchema)]
pub enum FailureReason {
    #[serde(rename = "OOM")]
    Oom,
    #[serde(rename = "other_error")]
    OtherError,
}

impl FailureReason {
    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Oom => "OOM",
            FailureReason::OtherError => "other_error",
        }
    }
}

impl std::str::FromStr for FailureReason {
    type Err = String;
    /// The spellings of the reason itself (any case): `OOM`,
    /// `out_of_memory`, `cuda_oom`, `OutOfMemoryError`; `other_error`,
    /// `other`, `error`. Free text is [`crate::logs::oom::failure_reason`]'s.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "oom" | "out_of_memory" | "cuda_oom" | "outofmemoryerror" => Ok(FailureReason::Oom),
            "other_error" | "other" | "error" => Ok(FailureReason::OtherError),
            _ => Err(format!(
                "unknown failure reason `{}`: use OOM or other_error",
                s.trim()
            )),
        }
    }
}

impl<'de> Deserialize<'de> for FailureReason {
    /// Through [`FailureReason::from_str`]: one list of spellings.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What became of a run: the one type of its outcome, so a record cannot
/// say an impossible one (a success with a failure reason, a host-memory
/// kill on a success or a GPU OOM). [`RunOutcome::of`] decides it, once.
/// On the wire and in the stores it keeps its fields: `success`,
/// `failure_reason` (`OOM` / `other_error`) and `host_oom` (left out when
/// false); reading a combination no outcome has is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "OutcomeFields", into = "OutcomeFields")]
pub enum RunOutcome {
    Succeeded,
    /// Ran out of GPU memory: its micro batch was too large.
    GpuOom,
    /// Failed otherwise; `host_oom` when killed for host memory (its data
    /// loader, not its micro batch, is what to lower).
    Failed {
        host_oom: bool,
    },
}

/// [`RunOutcome`] as stored and sent.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
struct OutcomeFields {
    success: bool,
    failure_reason: Option<FailureReason>,
    /// The run was killed for host memory (Kubernetes' `OOMKilled`, Slurm's
    /// `OUT_OF_MEMORY` / a cgroup oom-kill): its micro batch says nothing
    /// (`failure_reason` stays `other_error`), but its data loader used too
    /// much host memory, which the next suggestion of the workload heeds
    /// ([`crate::learner::host_memory_lesson`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    host_oom: bool,
}

impl From<RunOutcome> for OutcomeFields {
    fn from(o: RunOutcome) -> Self {
        OutcomeFields {
            success: o.success(),
            failure_reason: o.failure_reason(),
            host_oom: o.host_oom(),
        }
    }
}

impl TryFrom<OutcomeFields> for RunOutcome {
    type Error = String;
    fn try_from(f: OutcomeFields) -> Result<Self, String> {
        RunOutcome::from_fields(f.success, f.failure_reason, f.host_oom)
    }
}

impl JsonSchema for RunOutcome {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "RunOutcome".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        OutcomeFields::json_schema(generator)
    }
}

impl RunOutcome {
    /// The rule, said once: a GPU OOM is a GPU OOM whatever the exit status
    /// said; else a success; else a failure, a host-memory one when the
    /// host killed it for memory.
    pub fn of(success: bool, gpu_oom: bool, host_oom: bool) -> RunOutcome {
        if gpu_oom {
            RunOutcome::GpuOom
        } else if success {
            RunOutcome::Succeeded
        } else {
            RunOutcome::Failed { host_oom }
        }
    }

    /// The outcome the stored fields say, or why they say none: a success
    /// with a failure reason, a failure without one, a host-memory kill on
    /// a success or a GPU OOM.
    pub fn from_fields(
        success: bool,
        failure_reason: Option<FailureReason>,
        host_oom: bool,
    ) -> Result<RunOutcome, String> {
        match (success, failure_reason, host_oom) {
            (true, None, false) => Ok(RunOutcome::Succeeded),
            (false, Some(FailureReason::Oom), false) => Ok(RunOutcome::GpuOom),
            (false, Some(FailureReason::OtherError), h) => Ok(RunOutcome::Failed { host_oom: h }),
            (true, Some(_), _) => Err("a successful run cannot have a failure_reason".into()),
            (false, None, _) => {
                Err("a failed run needs its failure_reason (OOM or other_error)".into())
            }
            (_, _, true) => Err(
                "host_oom marks a run killed for host memory: a run that succeeded or ran out of GPU memory (failure_reason OOM) cannot have it"
                    .into(),
            ),
        }
    }

    pub fn success(self) -> bool {
        self == RunOutcome::Succeeded
    }

    pub fn failure_reason(self) -> Option<FailureReason> {
        match self {
            RunOutcome::Succeeded => None,
            RunOutcome::GpuOom => Some(FailureReason::Oom),
            RunOutcome::Failed { .. } => Some(FailureReason::OtherError),
        }
    }

    pub fn host_oom(self) -> bool {
        matches!(self, RunOutcome::Failed { host_oom: true })
    }

    /// The outcome of a job from two of its nodes' parts: a GPU OOM on any
    /// node makes it an OOM run, it succeeded only if both did, and one
    /// node's data loader killed for host memory teaches the job's.
    pub fn and(self, other: RunOutcome) -> RunOutcome {
        RunOutcome::of(
            self.success() && other.success(),
            self == RunOutcome::GpuOom || other == RunOutcome::GpuOom,
            self.host_oom() || other.host_oom(),
        )
    }
}

/// The outcome of a run and what was measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunResult {
    /// `success`, `failure_reason`, `host_oom` on the wire.
    #[serde(flatten)]
    pub outcome: RunOutcome,
    /// Measured peak GPU memory in bytes; None when unknown (filled in later).
    pub peak_memory_bytes: Option<u64>,
    pub samples_per_sec: Option<f64>,
    pub tokens_per_sec: Option<f64>,
    pub duration_sec: Option<f64>,
}

impl RunResult {
    /// An outcome with nothing measured yet.
    pub fn of(outcome: RunOutcome) -> RunResult {
        RunResult {
            outcome,
            peak_memory_bytes: None,
            samples_per_sec: None,
            tokens_per_sec: None,
            duration_sec: None,
        }
    }

    pub fn success(&self) -> bool {
        self.outcome.success()
    }

    pub fn failure_reason(&self) -> Option<FailureReason> {
        self.outcome.failure_reason()
    }

    pub fn host_oom(&self) -> bool {
        self.outcome.host_oom()
    }
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
    /// For a job over several nodes, how many of its nodes reported (each
    /// node's Slurm Epilog sends its own peak); None for a one-node run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeReports>,
    /// Whether the recorded settings are the ones the job ran
    /// ([`crate::confirm`]); an unconfirmed run's peak is only a floor.
    #[serde(default, skip_serializing_if = "Confirmation::is_default")]
    pub confirmation: Confirmation,
}

/// How many nodes of a multi-node job have reported into its one record,
/// and how many of their peaks its peak is the largest of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeReports {
    /// Nodes whose report is in the record.
    pub reported: u32,
    /// Nodes the job ran on.
    pub expected: u32,
    /// Nodes that reported without a peak (their Epilog could not read
    /// their sidecar): their outcome is in the record, their memory is
    /// not. Sorted, each also in the record's `node` list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub without_peak: Vec<String>,
}

impl NodeReports {
    /// How many nodes' peaks the record's peak is the largest of.
    pub fn peaks(&self) -> u32 {
        let without = u32::try_from(self.without_peak.len()).unwrap_or(u32::MAX);
        self.reported.saturating_sub(without)
    }

    /// Whether the record's peak is not every node's (a node has not
    /// reported, yet or ever, or reported without a peak): it is then only
    /// a lower bound of the job's peak.
    pub fn partial(&self) -> bool {
        self.peaks() < self.expected
    }

    /// Whether some node has not reported at all: the job's outcome is
    /// then that of the nodes that did (a missing node may have failed).
    pub fn reports_missing(&self) -> bool {
        self.reported < self.expected
    }
}

/// How long after a multi-node job's end a node's report still merges into
/// its record: 1 h. Every node's Epilog runs within seconds of the job's
/// end (slurmd starts it when the job's processes are gone), so a report
/// whose own job end is further than this from the job's end already
/// recorded (the earliest node's) is not part of this run: a Slurm job id
/// reused after slurmctld lost its state (ids restart at 1), or a node
/// whose clock is off by over an hour. It is refused
/// ([`RecordError::LateNodeReport`]) and the record stays as it was, so a
/// record one hour past its job's end is final, partial or not.
pub const NODE_REPORT_WINDOW_SECS: i64 = 3600;

/// Folds one node's report of a multi-node job into the job's record so far
/// (None for the first report, which makes the record at once: nothing
/// waits for the other nodes). The peak is the largest node's, the run
/// succeeded only if every node's part did, an OOM on any node makes it an
/// OOM run, the duration and throughput figures are the largest reported,
/// the timestamp is the job's end (the earliest node's), and `node` lists
/// the nodes that reported (comma-separated, sorted) so a repeated report
/// of a node is recognised: `Ok(None)`, nothing to write (exactly once by
/// cluster, job id and node). A report without a peak is listed in
/// [`NodeReports::without_peak`] (the record's peak is then partial); the
/// same node reporting again with a peak upgrades it (its peak joins the
/// record's, its outcome is folded again: every fold is idempotent), again
/// without one changes nothing. A report without its node's name, or whose
/// job end is over [`NODE_REPORT_WINDOW_SECS`] from the record's, is
/// refused. Pure: the caller stores the result, in one transaction with
/// the read of `so_far` (the stores' `record_node_report`).
pub fn merge_node_report(
    so_far: Option<&RunRecord>,
    report: &RunRecord,
) -> Result<Option<RunRecord>, RecordError> {
    let me = report
        .node
        .as_deref()
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .ok_or(RecordError::NodeReportWithoutNode)?;
    if me.contains(',') {
        return Err(RecordError::OutOfRange {
            field: "node",
            value: me.to_string(),
            expected: "one node's name (no comma): the record lists its nodes comma-separated",
        });
    }
    let job = report
        .job_id
        .as_deref()
        .map(str::trim)
        .filter(|j| !j.is_empty())
        .ok_or(RecordError::NodeReportWithoutJob)?
        .to_string();
    check_report_shape(report, me)?;
    let expected = |r: &RunRecord| r.nodes.as_ref().map_or(1, |n| n.expected);
    // Whether this report carries its node's peak (not the client's word
    // for it: the peak itself).
    let has_peak = report.result.peak_memory_bytes.is_some();
    let Some(prev) = so_far else {
        let mut first = report.clone();
        first.node = Some(me.to_string());
        first.nodes = Some(NodeReports {
            reported: 1,
            expected: expected(report).max(1),
            without_peak: if has_peak {
                Vec::new()
            } else {
                vec![me.to_string()]
            },
        });
        return crate::run_check::check_run(first, None).map(Some);
    };
    let Some(prev_nodes) = prev.nodes.as_ref() else {
        // A one-node record under this job id (a reused id, or a one-node
        // report first): a node's report does not turn it into a job of
        // several nodes.
        return Err(RecordError::WouldReplace {
            job,
            what: "a one-node record".into(),
        });
    };
    let mut seen: Vec<String> = prev
        .node
        .as_deref()
        .unwrap_or("")
        .split(',')
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect();
    let mut without_peak: Vec<String> = prev_nodes.without_peak.clone();
    let again = seen.iter().any(|n| n == me);
    let upgrade = again && has_peak && without_peak.iter().any(|n| n == me);
    if again && !upgrade {
        // A retried Epilog, or a replayed request: already counted.
        return Ok(None);
    }
    let apart = (report.timestamp - prev.timestamp).num_seconds();
    if apart.abs() > NODE_REPORT_WINDOW_SECS {
        return Err(RecordError::LateNodeReport {
            node: me.to_string(),
            job: prev.job_id.clone().unwrap_or_default(),
            apart_secs: apart,
            window_secs: NODE_REPORT_WINDOW_SECS,
        });
    }
    same_run(prev, report, me)?;
    if !again {
        seen.push(me.to_string());
        seen.sort();
    }
    if has_peak {
        without_peak.retain(|n| n != me);
    } else {
        without_peak.push(me.to_string());
        without_peak.sort();
    }
    let max_f = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    };
    let mut out = prev.clone();
    let (a, b) = (&prev.result, &report.result);
    out.result = RunResult {
        outcome: a.outcome.and(b.outcome),
        peak_memory_bytes: a.peak_memory_bytes.max(b.peak_memory_bytes),
        samples_per_sec: max_f(a.samples_per_sec, b.samples_per_sec),
        tokens_per_sec: max_f(a.tokens_per_sec, b.tokens_per_sec),
        duration_sec: max_f(a.duration_sec, b.duration_sec),
    };
    // The job's end, not the last report's: the window is measured from
    // it, and it does not move as reports arrive.
    out.timestamp = prev.timestamp.min(report.timestamp);
    out.node = Some(seen.join(","));
    out.nodes = Some(NodeReports {
        reported: u32::try_from(seen.len()).unwrap_or(u32::MAX),
        // Fixed by the first report ([`same_run`] refuses another count).
        expected: prev_nodes.expected,
        without_peak,
    });
    crate::run_check::check_run(out, None).map(Some)
}

/// A single node's report: it counts itself (reported 1) of a job of 1 to
/// its GPUs' nodes, and lists itself as peakless exactly when it has no
/// peak (not another node, nor itself next to a peak).
fn check_report_shape(report: &RunRecord, me: &str) -> Result<(), RecordError> {
    let Some(n) = &report.nodes else {
        return Ok(());
    };
    if n.reported != 1 {
        return Err(RecordError::OutOfRange {
            field: "nodes.reported",
            value: n.reported.to_string(),
            expected: "1: a node's report counts itself",
        });
    }
    let listed_ok = n.without_peak.is_empty()
        || (n.without_peak.len() == 1
            && n.without_peak[0] == me
            && report.result.peak_memory_bytes.is_none());
    if !listed_ok {
        return Err(RecordError::OutOfRange {
            field: "nodes.without_peak",
            value: format!("{:?}", n.without_peak),
            expected:
                "at most the reporting node itself, and only when it has no peak_memory_bytes",
        });
    }
    Ok(())
}

/// Whether a node's report describes the run its job's record holds: the
/// same GPU, workload and settings, and the node count the first report
/// fixed. Otherwise joining it would pin one node's peak on another
/// run's GPU or settings.
fn same_run(prev: &RunRecord, report: &RunRecord, me: &str) -> Result<(), RecordError> {
    let differs = |field: &'static str, recorded: String, reported: String| {
        if recorded == reported {
            Ok(())
        } else {
            Err(RecordError::NotTheSameRun(Box::new(
                crate::run_check::RunMismatch {
                    node: me.to_string(),
                    job: prev.job_id.clone().unwrap_or_default(),
                    field,
                    recorded,
                    reported,
                },
            )))
        }
    };
    differs(
        "gpu_model",
        prev.gpu_model.clone(),
        report.gpu_model.clone(),
    )?;
    differs("model", prev.model.clone(), report.model.clone())?;
    differs(
        "method",
        format!("{:?}", prev.method),
        format!("{:?}", report.method),
    )?;
    differs(
        "seq_len",
        prev.seq_len.to_string(),
        report.seq_len.to_string(),
    )?;
    differs(
        "lora_rank",
        format!("{:?}", prev.lora_rank),
        format!("{:?}", report.lora_rank),
    )?;
    differs("gpus", prev.gpus.to_string(), report.gpus.to_string())?;
    differs(
        "global_batch",
        format!("{:?}", prev.global_batch),
        format!("{:?}", report.global_batch),
    )?;
    let json = |s: &EngineeringSettings| serde_json::to_string(s).unwrap_or_default();
    differs("settings", json(&prev.settings), json(&report.settings))?;
    let expected = |r: &RunRecord| r.nodes.as_ref().map_or(1, |n| n.expected);
    differs(
        "nodes.expected",
        expected(prev).to_string(),
        expected(report).to_string(),
    )
}

/// What one node's report did to its job's record ([`merge_node_report`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeReportEffect {
    /// The job's first report: it made the record.
    Created,
    /// A node not in the record yet joined it.
    Joined,
    /// A node that had reported without its peak reported again with it.
    PeakAdded,
    /// The node had already reported (a retried Epilog, a replayed
    /// request): nothing was written.
    Repeated,
}

/// What a store did with one node's report: the record's id, the report's
/// effect and the record as it now stands (None when nothing was written).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeReportOutcome {
    pub id: i64,
    pub effect: NodeReportEffect,
    pub record: Option<RunRecord>,
    /// This report made the record whole: the last node the job expected
    /// reported now, so the record's outcome is the job's final one. True
    /// for exactly one report of a job (a record made whole stays whole).
    pub completed: bool,
}

impl NodeReportOutcome {
    /// Classifies a merge: `so_far` the record before the report, `merged`
    /// what [`merge_node_report`] returned for it. Pure, so every store
    /// says the same thing about the same merge.
    pub fn of(so_far: Option<&RunRecord>, merged: Option<RunRecord>, id: i64) -> Self {
        let nodes = |r: &RunRecord| -> Vec<String> {
            r.node
                .as_deref()
                .unwrap_or("")
                .split(',')
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect()
        };
        let effect = match (so_far, &merged) {
            (_, None) => NodeReportEffect::Repeated,
            (None, Some(_)) => NodeReportEffect::Created,
            // The same nodes as before: a known node's peak came in.
            (Some(prev), Some(now)) if nodes(prev) == nodes(now) => NodeReportEffect::PeakAdded,
            (Some(_), Some(_)) => NodeReportEffect::Joined,
        };
        let completed = merged.as_ref().is_some_and(RunRecord::outcome_is_whole)
            && !so_far.is_some_and(RunRecord::outcome_is_whole);
        NodeReportOutcome {
            id,
            effect,
            record: merged,
            completed,
        }
    }

    /// Whether this report brought its node's peak into the record for the
    /// first time (its one prediction-error sample): a first report with a
    /// peak, or a peakless node's peak arriving later; never a repeat.
    pub fn adds_a_node_peak(&self, report: &RunRecord) -> bool {
        match self.effect {
            NodeReportEffect::Created | NodeReportEffect::Joined => {
                report.result.peak_memory_bytes.is_some()
            }
            NodeReportEffect::PeakAdded => true,
            NodeReportEffect::Repeated => false,
        }
    }
}

/// The workload fields a run is keyed by (the similarity key, see
/// `core::similarity`) and described with.
#[derive(Debug, Clone, PartialEq)]
pub struct RunKey {
    /// Canonical model id.
    pub model: String,
    pub method: Method,
    /// GPU model name as NVML prints it.
    pub gpu_model: String,
    pub seq_len: u32,
    pub lora_rank: Option<u32>,
    /// Data-parallel GPUs (at least 1).
    pub gpus: u32,
    pub global_batch: Option<u32>,
}

impl RunKey {
    /// The key of a resolved workload on a GPU model.
    pub fn of(w: &Workload, gpu_model: &str) -> RunKey {
        RunKey {
            model: w.model.name.clone(),
            method: w.method,
            gpu_model: gpu_model.to_string(),
            seq_len: w.seq_len,
            lora_rank: w.lora.as_ref().map(|l| l.rank),
            gpus: w.gpus,
            global_batch: w.global_batch,
        }
    }
}

/// When and where a run was recorded. Only the source and time are always
/// known; the rest is set by the adapters that know it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOrigin {
    pub source: RunSource,
    pub timestamp: DateTime<Utc>,
    pub cluster: Option<String>,
    pub node: Option<String>,
    /// The job's id in its system; makes recording the run idempotent
    /// ([`RunRecord::identity`]).
    pub job_id: Option<String>,
}

impl RunOrigin {
    pub fn new(source: RunSource, timestamp: DateTime<Utc>) -> Self {
        RunOrigin {
            source,
            timestamp,
            cluster: None,
            node: None,
            job_id: None,
        }
    }

    pub fn cluster(mut self, cluster: Option<String>) -> Self {
        self.cluster = cluster;
        self
    }

    pub fn node(mut self, node: Option<String>) -> Self {
        self.node = node;
        self
    }

    pub fn job_id(mut self, job_id: Option<String>) -> Self {
        self.job_id = job_id;
        self
    }
}

impl FailureReason {
    /// The failure reason of a run that succeeded or not and ran out of GPU
    /// memory or not ([`RunOutcome::of`]): none for a success, OOM before
    /// any other error.
    pub fn of(success: bool, oom: bool) -> Option<FailureReason> {
        RunOutcome::of(success, oom, false).failure_reason()
    }
}

impl RunRecord {
    /// The one way a run record is made (every path that finishes a job):
    /// not stored yet (`id` None), no prediction until
    /// [`RunRecord::with_prediction`] says which was made for it.
    pub fn new(
        origin: RunOrigin,
        key: RunKey,
        settings: EngineeringSettings,
        result: RunResult,
    ) -> RunRecord {
        RunRecord {
            confirmation: Default::default(),
            nodes: None,
            id: None,
            timestamp: origin.timestamp,
            cluster: origin.cluster,
            node: origin.node,
            source: origin.source,
            job_id: origin.job_id,
            model: key.model,
            method: key.method,
            gpu_model: key.gpu_model,
            seq_len: key.seq_len,
            lora_rank: key.lora_rank,
            gpus: key.gpus,
            global_batch: key.global_batch,
            settings,
            result,
            predicted_peak_bytes: None,
        }
    }

    /// The peak gpufit predicted for these settings.
    pub fn with_prediction(mut self, predicted_peak_bytes: Option<u64>) -> Self {
        self.predicted_peak_bytes = predicted_peak_bytes;
        self
    }

    /// How the recorded settings are known ([`crate::confirm`]).
    pub fn with_confirmation(mut self, confirmation: Confirmation) -> Self {
        self.confirmation = confirmation;
        self
    }

    pub fn is_oom(&self) -> bool {
        self.result.outcome == RunOutcome::GpuOom
    }

    /// Whether the record's peak is only a lower bound of the run's: a
    /// multi-node job whose peak holds fewer nodes' peaks than it ran on
    /// ([`NodeReports::partial`]). The learner may raise a floor with it,
    /// never extrapolate from it.
    pub fn peak_is_lower_bound(&self) -> bool {
        self.nodes.as_ref().is_some_and(NodeReports::partial) || self.settings_unconfirmed()
    }

    /// Whether nothing confirms that the job ran the recorded settings
    /// ([`Confirmation::Unconfirmed`]): its peak may be another micro
    /// batch's, so it is only a floor (like a partial peak), and its
    /// success is no proof that the recorded micro batch fits.
    pub fn settings_unconfirmed(&self) -> bool {
        self.confirmation == Confirmation::Unconfirmed
    }

    /// The measured peak when it is the whole run's: None when unknown or
    /// only a lower bound ([`RunRecord::peak_is_lower_bound`]).
    pub fn full_peak(&self) -> Option<u64> {
        self.result
            .peak_memory_bytes
            .filter(|_| !self.peak_is_lower_bound())
    }

    /// Whether the recorded outcome is the whole run's: false for a
    /// multi-node job some node of which never reported (it may have
    /// failed there).
    pub fn outcome_is_whole(&self) -> bool {
        !self
            .nodes
            .as_ref()
            .is_some_and(NodeReports::reports_missing)
    }

    /// Relative prediction error (predicted − measured) / measured, when
    /// both are known and the measured peak is the whole run's.
    pub fn prediction_error(&self) -> Option<f64> {
        let measured = self.full_peak()? as f64;
        let predicted = self.predicted_peak_bytes? as f64;
        if measured <= 0.0 {
            return None;
        }
        Some((predicted - measured) / measured)
    }

    /// How the run reached the history (the fleet view's `path`):
    /// `trainingjob` (the reconciler), `webhook` (a Job, PyTorchJob … the
    /// admission webhook configured: its job id reads `Kind:ns/name/uid`),
    /// `slurm`, `cli` (`gpufit record`, `find-max-batch`) or `import`.
    pub fn path(&self) -> &'static str {
        self.run_path().as_str()
    }

    /// [`RunRecord::path`], typed.
    pub fn run_path(&self) -> RunPath {
        RunPath::of(self.source, self.job_id.as_deref())
    }
}

/// How a run reached the history: the one `path` vocabulary of the fleet
/// view — `gpufit report` (text, JSON, HTML), the controller's metrics'
/// `path` label and the Grafana dashboards all use these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RunPath {
    /// The TrainingJob reconciler.
    TrainingJob,
    /// A workload the admission webhook configured.
    Webhook,
    /// The Slurm Prolog/Epilog (through the controller's HTTP API).
    Slurm,
    /// `gpufit record`, `gpufit find-max-batch`.
    Cli,
    /// `gpufit history import`.
    Import,
}

impl RunPath {
    /// Every path, in report order.
    pub const ALL: [RunPath; 5] = [
        RunPath::TrainingJob,
        RunPath::Webhook,
        RunPath::Slurm,
        RunPath::Cli,
        RunPath::Import,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            RunPath::TrainingJob => "trainingjob",
            RunPath::Webhook => "webhook",
            RunPath::Slurm => "slurm",
            RunPath::Cli => "cli",
            RunPath::Import => "import",
        }
    }

    /// The path of a stored run, from the two columns it reads (the report
    /// streams them without building a record): a Kubernetes run whose job
    /// id reads `Kind:ns/name/uid` came through the webhook.
    pub fn of(source: RunSource, job_id: Option<&str>) -> RunPath {
        match source {
            RunSource::Kubernetes => {
                let webhook = job_id
                    .and_then(|j| j.split('/').next())
                    .is_some_and(|first| first.contains(':'));
                if webhook {
                    RunPath::Webhook
                } else {
                    RunPath::TrainingJob
                }
            }
            RunSource::Slurm => RunPath::Slurm,
            RunSource::Cli | RunSource::FindMaxBatch => RunPath::Cli,
            RunSource::Import => RunPath::Import,
        }
    }
}

/// [`RunPath::of`] as its name.
pub fn run_path(source: RunSource, job_id: Option<&str>) -> &'static str {
    RunPath::of(source, job_id).as_str()
}

/// Every value of [`RunRecord::path`], in report order.
pub const RUN_PATHS: [&str; 5] = [
    RunPath::ALL[0].as_str(),
    RunPath::ALL[1].as_str(),
    RunPath::ALL[2].as_str(),
    RunPath::ALL[3].as_str(),
    RunPath::ALL[4].as_str(),
];

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
                // The hashes of the record's JSON without its id, fed as
                // serde writes it (no copy of the record or of the text).
                let mut h = Fnv2(FNV_A, FNV_B);
                let written = if self.id.is_none() {
                    serde_json::to_writer(&mut h, self)
                } else {
                    let mut canon = self.clone();
                    canon.id = None;
                    serde_json::to_writer(&mut h, &canon)
                };
                if written.is_err() {
                    // as the text of a record that does not serialize: ""
                    h = Fnv2(FNV_A, FNV_B);
                }
                format!("h:{:016x}{:016x}", h.0, h.1)
            }
        }
    }
}

/// A validated run with its identity computed: what a store writes in a
/// batch. Only [`RunRecord::keyed`] makes one, so the key is always the
/// record's own. Built where the records are parsed (the import's reader
/// thread), it takes the identity's hashing off the store's thread.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyedRun {
    run: RunRecord,
    key: String,
}

impl KeyedRun {
    /// The validated record.
    pub fn run(&self) -> &RunRecord {
        &self.run
    }

    /// Its [`RunRecord::identity`].
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl RunRecord {
    /// Validates the record (see [`RunRecord::validated`]) and computes its
    /// identity: the pair every store's batch writes.
    pub fn keyed(self) -> Result<KeyedRun, RecordError> {
        let run = self.validated(None)?;
        let key = run.identity();
        Ok(KeyedRun { run, key })
    }
}

/// FNV-1a offset bases of two independent 64-bit hashes (128 bits together:
/// a collision among 10^9 records has odds of about 10^-21).
const FNV_A: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_B: u64 = 0x6c62_272e_07bb_0142;

/// FNV-1a's 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

#[cfg(test)]
fn fnv1a(s: &str, basis: u64) -> u64 {
    s.bytes()
        .fold(basis, |h, b| (h ^ b as u64).wrapping_mul(FNV_PRIME))
}

/// Both FNV-1a hashes of everything written to it.
struct Fnv2(u64, u64);

impl std::io::Write for Fnv2 {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &b in buf {
            self.0 = (self.0 ^ b as u64).wrapping_mul(FNV_PRIME);
            self.1 = (self.1 ^ b as u64).wrapping_mul(FNV_PRIME);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    fn rec(job: Option<&str>) -> RunRecord {
        RunRecord {
            confirmation: Default::default(),
            nodes: None,
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
                outcome: RunOutcome::Succeeded,
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

    #[test]
    fn the_content_key_is_the_one_existing_histories_store() {
        // Histories hold keys made as the two FNV-1a hashes of the
        // record's JSON text without its id; the streaming hash must give
        // the same key, with or without an id on the record.
        let stored_key = |r: &RunRecord| {
            let mut canon = r.clone();
            canon.id = None;
            let text = serde_json::to_string(&canon).unwrap();
            format!("h:{:016x}{:016x}", fnv1a(&text, FNV_A), fnv1a(&text, FNV_B))
        };
        let mut a = rec(None);
        a.model = "Qwen/Qwen2.5-7B \"quoted\" ü".into();
        assert_eq!(a.identity(), stored_key(&a));
        a.id = Some(12);
        assert_eq!(a.identity(), stored_key(&a));
        a.id = None;
        a.result.tokens_per_sec = Some(1234.5);
        assert_eq!(a.identity(), stored_key(&a));
    }
}

// === validation: crates/gpufit-core/src/run_check.rs ===

pub use crate::run_check::{
    RecordError, FUTURE_TOLERANCE_SECS, MAX_BATCH, MAX_TOKENS_PER_SEC, PEAK_TOLERANCE,
};

#[cfg(test)]
mod new_tests {
    use super::*;
    use crate::catalog::lookup_model;
    use crate::workload::{Attention, Framework, LoraConfig, Optimizer, Sharding};

    #[test]
    fn new_fills_every_field_from_its_parts_and_nothing_else() {
        let t = DateTime::<Utc>::UNIX_EPOCH;
        let w = Workload {
            model: lookup_model("llama-3.1-8b").expect("catalog model").arch,
            method: Method::Lora,
            lora: Some(LoraConfig {
                rank: 16,
                targets: vec![],
            }),
            seq_len: 2048,
            optimizer: Optimizer::Adamw,
            global_batch: Some(32),
            gpus: 2,
            sharding: Sharding::None,
            framework: Framework::Generic,
            attention: Attention::Sdpa,
        };
        let result = RunResult {
            outcome: RunOutcome::of(false, true, false),
            peak_memory_bytes: Some(7),
            samples_per_sec: None,
            tokens_per_sec: None,
            duration_sec: Some(1.0),
        };
        let r = RunRecord::new(
            RunOrigin::new(RunSource::Slurm, t)
                .cluster(Some("c".into()))
                .node(Some("n".into()))
                .job_id(Some("42".into())),
            RunKey::of(&w, "NVIDIA H100 80GB HBM3"),
            EngineeringSettings::default(),
            result.clone(),
        )
        .with_prediction(Some(9));
        assert_eq!(
            r,
            RunRecord {
                confirmation: Default::default(),
                nodes: None,
                id: None,
                timestamp: t,
                cluster: Some("c".into()),
                node: Some("n".into()),
                source: RunSource::Slurm,
                job_id: Some("42".into()),
                model: w.model.name.clone(),
                method: Method::Lora,
                gpu_model: "NVIDIA H100 80GB HBM3".into(),
                seq_len: 2048,
                lora_rank: Some(16),
                gpus: 2,
                global_batch: Some(32),
                settings: EngineeringSettings::default(),
                result,
                predicted_peak_bytes: Some(9),
            }
        );
        assert!(r.is_oom());
    }

    #[test]
    fn failure_reason_of_a_run() {
        assert_eq!(FailureReason::of(true, false), None);
        assert_eq!(
            FailureReason::of(false, false),
            Some(FailureReason::OtherError)
        );
        // An OOM is an OOM whatever the exit status said.
        assert_eq!(FailureReason::of(false, true), Some(FailureReason::Oom));
        assert_eq!(FailureReason::of(true, true), Some(FailureReason::Oom));
    }
}

#[cfg(test)]
mod node_report_tests {
    use super::*;

    fn report(node: &str, peak: u64, success: bool, oom: bool) -> RunRecord {
        let mut r = identity_tests_rec();
        r.node = Some(node.into());
        r.nodes = Some(NodeReports {
            reported: 1,
            expected: 2,
            without_peak: Vec::new(),
        });
        r.result.outcome = RunOutcome::of(success, oom, false);
        r.result.peak_memory_bytes = Some(peak);
        r
    }

    fn identity_tests_rec() -> RunRecord {
        serde_json::from_value(serde_json::json!({
            "id": null, "timestamp": "2026-01-01T00:00:00Z", "cluster": "c1", "node": null,
            "source": "slurm", "job_id": "42", "model": "m", "method": "lora",
            "gpu_model": "NVIDIA H100 80GB HBM3", "seq_len": 2048, "lora_rank": 16, "gpus": 16,
            "global_batch": 64, "settings": crate::settings::EngineeringSettings::default(),
            "result": {"success": true, "failure_reason": null, "peak_memory_bytes": null,
                       "samples_per_sec": null, "tokens_per_sec": null, "duration_sec": null},
            "predicted_peak_bytes": null
        }))
        .expect("a run record")
    }

    fn merged(so_far: Option<&RunRecord>, r: &RunRecord) -> RunRecord {
        merge_node_report(so_far, r)
            .expect("merges")
            .expect("changes the record")
    }

    #[test]
    fn a_node_that_never_reports_leaves_the_record_partial_with_one_of_two() {
        let first = merged(None, &report("n2", 70, true, false));
        assert_eq!(
            first.nodes,
            Some(NodeReports {
                reported: 1,
                expected: 2,
                without_peak: Vec::new(),
            })
        );
        assert!(first.nodes.as_ref().is_some_and(NodeReports::partial));
        assert!(first.peak_is_lower_bound() && !first.outcome_is_whole());
        assert_eq!(first.full_peak(), None, "one node's peak is not the job's");
        assert_eq!(first.result.peak_memory_bytes, Some(70));
    }

    #[test]
    fn the_job_record_has_the_largest_peak_every_node_once_and_any_oom() {
        let one = merged(None, &report("n2", 70, true, false));
        let two = merged(Some(&one), &report("n1", 75, false, true));
        assert_eq!(two.result.peak_memory_bytes, Some(75));
        assert!(two.is_oom(), "one node's OOM makes the job an OOM run");
        assert_eq!(two.node.as_deref(), Some("n1,n2"));
        let n = two.nodes.clone().expect("node counts");
        assert_eq!((n.reported, n.expected, n.partial()), (2, 2, false));
        assert_eq!(two.full_peak(), Some(75));
        // The same node again (a retried Epilog) changes nothing.
        assert_eq!(
            merge_node_report(Some(&two), &report("n1", 99, true, false)),
            Ok(None)
        );
    }

    #[test]
    fn a_smaller_peak_after_a_larger_one_keeps_the_larger_and_the_earliest_end() {
        let mut big = report("n1", 80, true, false);
        big.timestamp += chrono::Duration::seconds(30);
        let one = merged(None, &big);
        let small = report("n2", 60, true, false);
        let two = merged(Some(&one), &small);
        assert_eq!(two.result.peak_memory_bytes, Some(80));
        assert_eq!(
            two.timestamp, small.timestamp,
            "the job's end: the earliest"
        );
        assert!(two.result.success() && two.result.failure_reason().is_none());
    }

    #[test]
    fn a_report_past_the_window_is_refused_and_one_inside_it_merges() {
        let one = merged(None, &report("n1", 70, true, false));
        let mut late = report("n2", 90, true, false);
        late.timestamp += chrono::Duration::seconds(NODE_REPORT_WINDOW_SECS + 1);
        match merge_node_report(Some(&one), &late) {
            Err(RecordError::LateNodeReport { apart_secs, .. }) => {
                assert_eq!(apart_secs, NODE_REPORT_WINDOW_SECS + 1)
            }
            other => panic!("{other:?}"),
        }
        // As far before the recorded end: refused too (a clock far off).
        late.timestamp -= chrono::Duration::seconds(2 * NODE_REPORT_WINDOW_SECS + 2);
        assert!(merge_node_report(Some(&one), &late).is_err());
        let mut in_time = report("n2", 90, true, false);
        in_time.timestamp += chrono::Duration::seconds(NODE_REPORT_WINDOW_SECS);
        assert_eq!(
            merged(Some(&one), &in_time).result.peak_memory_bytes,
            Some(90)
        );
    }

    #[test]
    fn a_report_of_another_run_is_refused_and_the_record_kept() {
        let one = merged(None, &report("n1", 30_000_000_000, true, false));
        type Change = Box<dyn Fn(&mut RunRecord)>;
        let cases: Vec<(&str, Change)> = vec![
            (
                "gpu_model",
                Box::new(|r| r.gpu_model = "NVIDIA A100-SXM4-40GB".into()),
            ),
            ("model", Box::new(|r| r.model = "other".into())),
            ("settings", Box::new(|r| r.settings.micro_batch_size = 9)),
            ("seq_len", Box::new(|r| r.seq_len = 4096)),
            (
                "nodes.expected",
                Box::new(|r| {
                    r.nodes = Some(NodeReports {
                        reported: 1,
                        expected: 3,
                        without_peak: Vec::new(),
                    })
                }),
            ),
        ];
        for (field, change) in cases {
            let mut other = report("n2", 75_000_000_000, true, false);
            change(&mut other);
            match merge_node_report(Some(&one), &other) {
                Err(RecordError::NotTheSameRun(m)) => assert_eq!(m.field, field),
                x => panic!("{field}: {x:?}"),
            }
        }
        // A peak above the record's GPU, from a node on a bigger one.
        let mut big = report("n2", 39_000_000_000, true, false);
        big.gpu_model = "NVIDIA A100-SXM4-40GB".into();
        let small = merged(None, &big.clone());
        assert!(merge_node_report(None, &{
            let mut r = big.clone();
            r.gpu_model = "NVIDIA A100-SXM4-40GB MIG 1g.5gb".into();
            r.result.peak_memory_bytes = Some(39_000_000_000);
            r
        })
        .is_err());
        assert_eq!(small.gpu_model, "NVIDIA A100-SXM4-40GB");
    }

    #[test]
    fn a_node_report_needs_a_job_id_and_a_bounded_node_count() {
        let mut r = report("n1", 70, true, false);
        r.job_id = None;
        assert_eq!(
            merge_node_report(None, &r),
            Err(RecordError::NodeReportWithoutJob)
        );
        let mut r = report("n1", 70, true, false);
        r.nodes = Some(NodeReports {
            reported: 1,
            expected: 1_000_000,
            without_peak: Vec::new(),
        });
        assert!(matches!(
            merge_node_report(None, &r),
            Err(RecordError::OutOfRange { field: "nodes", .. })
        ));
        // A node's report does not join a one-node record of its job id.
        let mut solo = report("n1", 70, true, false);
        solo.nodes = None;
        assert!(matches!(
            merge_node_report(Some(&solo), &report("n2", 70, true, false)),
            Err(RecordError::WouldReplace { .. })
        ));
    }

    #[test]
    fn a_report_must_name_one_node() {
        let mut none = report("n1", 70, true, false);
        none.node = None;
        assert_eq!(
            merge_node_report(None, &none),
            Err(RecordError::NodeReportWithoutNode)
        );
        none.node = Some("  ".into());
        assert!(merge_node_report(None, &none).is_err());
        let one = merged(None, &report("n1", 70, true, false));
        let comma = report("n2,n3", 90, true, false);
        assert!(matches!(
            merge_node_report(Some(&one), &comma),
            Err(RecordError::OutOfRange { field: "node", .. })
        ));
    }
    fn peakless(node: &str) -> RunRecord {
        let mut r = report(node, 0, true, false);
        r.result.peak_memory_bytes = None;
        r
    }

    #[test]
    fn a_node_without_a_peak_counts_as_reported_but_not_in_the_peak() {
        let one = merged(None, &report("n1", 70, true, false));
        let two = merged(Some(&one), &peakless("n2"));
        let n = two.nodes.clone().expect("node counts");
        assert_eq!((n.reported, n.expected, n.peaks()), (2, 2, 1));
        assert_eq!(n.without_peak, vec!["n2".to_string()]);
        assert!(n.partial() && !n.reports_missing());
        assert!(two.peak_is_lower_bound() && two.outcome_is_whole());
        assert_eq!(two.result.peak_memory_bytes, Some(70), "n1's peak is kept");
        assert_eq!(two.full_peak(), None, "n1's peak is not the job's");
        assert_eq!(two.prediction_error(), None);
        assert_eq!(two.node.as_deref(), Some("n1,n2"));
    }

    #[test]
    fn a_peakless_node_reporting_again_with_a_peak_upgrades_and_without_changes_nothing() {
        let one = merged(None, &peakless("n2"));
        assert_eq!(one.nodes.as_ref().map(NodeReports::peaks), Some(0));
        assert_eq!(one.result.peak_memory_bytes, None);
        let two = merged(Some(&one), &report("n1", 70, true, false));
        // Again without a peak: nothing to write.
        assert_eq!(merge_node_report(Some(&two), &peakless("n2")), Ok(None));
        // Again with one: the peak joins, the node is counted once.
        let three = merged(Some(&two), &report("n2", 90, true, false));
        let n = three.nodes.clone().expect("node counts");
        assert_eq!((n.reported, n.peaks(), n.partial()), (2, 2, false));
        assert!(n.without_peak.is_empty());
        assert_eq!(three.full_peak(), Some(90));
        assert_eq!(three.node.as_deref(), Some("n1,n2"));
        // And once more with a peak: already in, nothing changes.
        assert_eq!(
            merge_node_report(Some(&three), &report("n2", 95, true, false)),
            Ok(None)
        );
        // An upgrade carries the node's outcome again: folding is idempotent.
        let oom_now = merged(Some(&two), &report("n2", 90, false, true));
        assert!(oom_now.is_oom());
    }

    #[test]
    fn each_report_is_classified_and_exactly_one_completes_the_record() {
        // Through every order of n1 (70), n2 (no peak, then 90), n3 (80),
        // with repeats: one Created, a Joined per other node, one PeakAdded
        // (n2's peak arriving after its peakless report, when that came
        // first), every other report Repeated, one completing report, and a
        // node-peak sample per node that has a peak (3).
        let reports = [
            report("n1", 70, true, false),
            peakless("n2"),
            report("n2", 90, true, false),
            report("n3", 80, true, false),
        ];
        for order in [
            [0, 1, 2, 3, 1, 0, 3],
            [3, 2, 1, 0, 2, 1, 0],
            [1, 1, 3, 0, 2, 3, 2],
            [2, 0, 3, 1, 1, 2, 0],
        ] {
            let mut rec: Option<RunRecord> = None;
            let mut effects = Vec::new();
            let (mut completed, mut samples) = (0, 0);
            for &i in &order {
                let mut r = reports[i].clone();
                r.nodes = Some(NodeReports {
                    reported: 1,
                    expected: 3,
                    without_peak: Vec::new(),
                });
                let m = merge_node_report(rec.as_ref(), &r).expect("merges");
                let out = NodeReportOutcome::of(rec.as_ref(), m, 1);
                effects.push(out.effect);
                completed += usize::from(out.completed);
                samples += usize::from(out.adds_a_node_peak(&r));
                if let Some(now) = out.record {
                    rec = Some(now);
                }
            }
            let count = |e: NodeReportEffect| effects.iter().filter(|x| **x == e).count();
            assert_eq!(
                count(NodeReportEffect::Created),
                1,
                "{order:?}: {effects:?}"
            );
            assert_eq!(count(NodeReportEffect::Joined), 2, "{order:?}: {effects:?}");
            // n2's peakless report before its full one makes a PeakAdded;
            // after it, the peakless one is a repeat.
            let peakless_first =
                order.iter().position(|&i| i == 1) < order.iter().position(|&i| i == 2);
            assert_eq!(
                count(NodeReportEffect::PeakAdded),
                usize::from(peakless_first),
                "{order:?}: {effects:?}"
            );
            assert_eq!(completed, 1, "{order:?}: {effects:?}");
            assert_eq!(samples, 3, "{order:?}: one per node with a peak");
        }
    }

    #[test]
    fn a_one_node_record_or_a_repeat_after_completion_does_not_complete_again() {
        let one = merged(None, &report("n1", 70, true, false));
        let two = merged(Some(&one), &report("n2", 80, true, false));
        let again = merge_node_report(Some(&two), &report("n2", 80, true, false)).expect("merges");
        let out = NodeReportOutcome::of(Some(&two), again, 9);
        assert_eq!(
            (out.effect, out.completed, out.id),
            (NodeReportEffect::Repeated, false, 9)
        );
        assert_eq!(out.record, None);
        assert!(!out.adds_a_node_peak(&report("n2", 80, true, false)));
        // A report that says the job had one node makes a whole record at once.
        let mut solo = report("n1", 70, true, false);
        solo.nodes = Some(NodeReports {
            reported: 1,
            expected: 1,
            without_peak: Vec::new(),
        });
        let made = merge_node_report(None, &solo).expect("merges");
        let out = NodeReportOutcome::of(None, made, 1);
        assert_eq!(
            (out.effect, out.completed),
            (NodeReportEffect::Created, true)
        );
    }

    #[test]
    fn merging_in_any_order_and_with_repeats_gives_one_record() {
        // Every order of n1 (70), n2 (no peak, then 90), n3 (80): the same
        // record, whatever repeats in between.
        let reports = [
            report("n1", 70, true, false),
            peakless("n2"),
            report("n2", 90, true, false),
            report("n3", 80, true, false),
        ];
        let orders: [[usize; 6]; 4] = [
            [0, 1, 2, 3, 1, 0],
            [3, 2, 1, 0, 2, 1],
            [1, 1, 3, 0, 2, 3],
            [2, 0, 3, 1, 1, 2],
        ];
        for order in orders {
            let mut rec: Option<RunRecord> = None;
            for &i in &order {
                let mut r = reports[i].clone();
                r.nodes = Some(NodeReports {
                    reported: 1,
                    expected: 3,
                    without_peak: Vec::new(),
                });
                if let Some(m) = merge_node_report(rec.as_ref(), &r).expect("merges") {
                    rec = Some(m);
                }
            }
            let rec = rec.expect("a record");
            let n = rec.nodes.clone().expect("node counts");
            assert_eq!(
                (n.reported, n.peaks(), n.partial()),
                (3, 3, false),
                "{order:?}"
            );
            assert_eq!(rec.full_peak(), Some(90), "{order:?}");
        }
    }
}
