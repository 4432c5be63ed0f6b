//! The `runs` table shared by the SQLite and PostgreSQL stores, and the
//! text spellings of enums stored in it.
//!
//! One row per run; integers are 64-bit (`INTEGER` in SQLite, `BIGINT` in
//! PostgreSQL), booleans `INTEGER 0/1` / `BOOLEAN`, the timestamp is
//! microseconds since the Unix epoch (UTC). Migrations are numbered from 1;
//! a store records the last one applied (SQLite `PRAGMA user_version`,
//! PostgreSQL table `gpufit_schema`).

use chrono::{DateTime, TimeZone, Utc};

use crate::core::run::{FailureReason, NodeReports, RunOutcome, RunSource};
use crate::core::settings::Dtype;
use crate::core::workload::Method;

/// Columns in insert/select order (without `id`, which comes first on select).
pub const COLUMNS: [&str; 34] = [
    "timestamp_us",
    "cluster",
    "node",
    "source",
    "job_id",
    "model",
    "method",
    "gpu_model",
    "seq_len",
    "lora_rank",
    "gpus",
    "global_batch",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "dtype",
    "activation_checkpointing",
    "activation_offloading",
    "compile",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "success",
    "failure_reason",
    "peak_memory_bytes",
    "samples_per_sec",
    "tokens_per_sec",
    "duration_sec",
    "predicted_peak_bytes",
    "nodes_reported",
    "nodes_expected",
    "host_oom",
    "nodes_without_peak",
    "settings_confirmation",
];

/// `CREATE TABLE` body for one dialect: integer, boolean and float type names.
pub fn create_runs(int: &str, boolean: &str, float: &str, id: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS runs (
            id {id},
            timestamp_us {int} NOT NULL,
            cluster TEXT,
            node TEXT,
            source TEXT NOT NULL,
            job_id TEXT,
            model TEXT NOT NULL,
            method TEXT NOT NULL,
            gpu_model TEXT NOT NULL,
            seq_len {int} NOT NULL,
            lora_rank {int},
            gpus {int} NOT NULL,
            global_batch {int},
            micro_batch_size {int} NOT NULL,
            gradient_accumulation_steps {int} NOT NULL,
            dtype TEXT NOT NULL,
            activation_checkpointing {boolean} NOT NULL,
            activation_offloading {boolean} NOT NULL,
            compile {boolean} NOT NULL,
            num_workers {int} NOT NULL,
            pin_memory {boolean} NOT NULL,
            persistent_workers {boolean} NOT NULL,
            prefetch_factor {int} NOT NULL,
            success {boolean} NOT NULL,
            failure_reason TEXT,
            peak_memory_bytes {int},
            samples_per_sec {float},
            tokens_per_sec {float},
            duration_sec {float},
            predicted_peak_bytes {int}
        );
        CREATE INDEX IF NOT EXISTS runs_similarity_key ON runs (model, method, gpu_model, seq_len);
        CREATE INDEX IF NOT EXISTS runs_timestamp ON runs (timestamp_us);"
    )
}

/// Migration 2: every run's stable identity ([`RunRecord::identity`]),
/// unique, so a replayed or re-imported run updates its row instead of
/// adding one. Rows written before it keep a NULL key (NULLs never collide).
///
/// [`RunRecord::identity`]: crate::core::run::RunRecord::identity
pub const ADD_RUN_KEY: &str = "ALTER TABLE runs ADD COLUMN run_key TEXT;
        CREATE UNIQUE INDEX IF NOT EXISTS runs_run_key ON runs (run_key);";

/// Migration 3: a multi-node job's one record says how many of its nodes
/// reported ([`NodeReports`]); NULL for one-node runs and older rows.
///
/// [`NodeReports`]: crate::core::run::NodeReports
pub fn add_node_counts(int: &str) -> String {
    format!(
        "ALTER TABLE runs ADD COLUMN nodes_reported {int};
        ALTER TABLE runs ADD COLUMN nodes_expected {int};"
    )
}

/// Migration 4: the run was killed for host memory
/// ([`RunResult::host_oom`]); false for older rows.
///
/// [`RunResult::host_oom`]: crate::core::run::RunResult::host_oom
pub fn add_host_oom(boolean: &str, no: &str) -> String {
    format!("ALTER TABLE runs ADD COLUMN host_oom {boolean} NOT NULL DEFAULT {no};")
}

/// Migration 5: the nodes of a multi-node job that reported without a
/// peak ([`NodeReports::without_peak`], comma-separated, sorted); NULL
/// when every reported node's peak is in the record, and for older rows
/// (whose counts then read as before: every reported node's peak in).
///
/// [`NodeReports::without_peak`]: crate::core::run::NodeReports::without_peak
pub const ADD_NODES_WITHOUT_PEAK: &str = "ALTER TABLE runs ADD COLUMN nodes_without_peak TEXT;";

/// Migration 6: whether the recorded settings are the ones the job ran
/// ([`Confirmation`]: `confirmed`, `ran_other` or `unconfirmed`); older rows
/// read `confirmed`, as they did before confirmation was tracked.
///
/// [`Confirmation`]: crate::core::confirm::Confirmation
pub const ADD_SETTINGS_CONFIRMATION: &str =
    "ALTER TABLE runs ADD COLUMN settings_confirmation TEXT NOT NULL DEFAULT 'confirmed';";

/// The stored spelling of [`NodeReports::without_peak`]: NULL when empty.
///
/// [`NodeReports::without_peak`]: crate::core::run::NodeReports::without_peak
pub fn without_peak_str(nodes: Option<&NodeReports>) -> Option<String> {
    nodes
        .filter(|n| !n.without_peak.is_empty())
        .map(|n| n.without_peak.join(","))
}

/// Node counts read back: both counts, or none; the peakless list split.
pub fn node_reports(
    reported: Option<i64>,
    expected: Option<i64>,
    without_peak: Option<&str>,
) -> Option<NodeReports> {
    Some(NodeReports {
        reported: u32_of(reported?),
        expected: u32_of(expected?),
        without_peak: without_peak
            .unwrap_or("")
            .split(',')
            .filter(|n| !n.is_empty())
            .map(str::to_string)
            .collect(),
    })
}

/// The condition under which a stored run may be replaced by a new record
/// of the same identity, in SQL ([`crate::core::run_check::check_replace`]
/// says it in Rust, with the reason): a one-node record never replaces a
/// job's multi-node record, nor a run more than an hour apart (a reused job
/// id; a Kubernetes job's id carries its object's UID, never reused, so a
/// replayed reconcile may come any time). A write it holds back changes nothing (an upsert with `RETURNING`
/// returns no row: the store then says why).
pub const REPLACE_GUARD: &str =
    "NOT (COALESCE(runs.nodes_expected, 1) > 1 AND COALESCE(excluded.nodes_expected, 1) <= 1) \
     AND (excluded.source = 'kubernetes' \
          OR runs.timestamp_us - excluded.timestamp_us BETWEEN -3600000000 AND 3600000000)";

/// `INSERT INTO runs (<columns>, run_key) VALUES (…) ON CONFLICT (run_key)
/// DO UPDATE SET <columns> = excluded.<columns> WHERE <REPLACE_GUARD>`: the
/// run keyed by its identity (the last placeholder), a replay updating it
/// in place.
pub fn upsert(p: impl Fn(usize) -> String) -> String {
    let ph: Vec<String> = (1..=COLUMNS.len() + 1).map(p).collect();
    format!(
        "INSERT INTO runs ({}, run_key) VALUES ({}) ON CONFLICT (run_key) DO UPDATE SET {} WHERE {REPLACE_GUARD}",
        COLUMNS.join(", "),
        ph.join(", "),
        update_set()
    )
}

/// `<column> = excluded.<column>, …` for every column.
pub fn update_set() -> String {
    COLUMNS
        .iter()
        .map(|c| format!("{c} = excluded.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `INSERT … ON CONFLICT (run_key) DO NOTHING`: the run only if no run of
/// its identity is stored yet (the first node's report of a multi-node
/// job; losing a race to another node's first report inserts nothing).
pub fn insert_new(p: impl Fn(usize) -> String) -> String {
    let ph: Vec<String> = (1..=COLUMNS.len() + 1).map(p).collect();
    format!(
        "INSERT INTO runs ({}, run_key) VALUES ({}) ON CONFLICT (run_key) DO NOTHING",
        COLUMNS.join(", "),
        ph.join(", ")
    )
}

/// `SELECT id, <columns> FROM runs WHERE run_key = <key>`: one run by its
/// identity, through the unique index `runs_run_key`.
pub fn select_by_key(key_placeholder: &str) -> String {
    format!("{} WHERE run_key = {key_placeholder}", select_all())
}

/// `SELECT id, <columns> FROM runs`.
pub fn select_all() -> String {
    format!("SELECT id, {} FROM runs", COLUMNS.join(", "))
}

/// `INSERT INTO runs (<columns>) VALUES (<placeholders>)` with `p(i)` for
/// the i-th (1-based) placeholder.
pub fn insert(p: impl Fn(usize) -> String) -> String {
    let ph: Vec<String> = (1..=COLUMNS.len()).map(p).collect();
    format!(
        "INSERT INTO runs ({}) VALUES ({})",
        COLUMNS.join(", "),
        ph.join(", ")
    )
}

/// Stored spelling of a run source (its serde name).
pub fn source_str(s: RunSource) -> &'static str {
    match s {
        RunSource::Kubernetes => "kubernetes",
        RunSource::Slurm => "slurm",
        RunSource::Cli => "cli",
        RunSource::FindMaxBatch => "find_max_batch",
        RunSource::Import => "import",
    }
}

/// Reads a stored run source.
pub fn parse_source(s: &str) -> Option<RunSource> {
    Some(match s {
        "kubernetes" => RunSource::Kubernetes,
        "slurm" => RunSource::Slurm,
        "cli" => RunSource::Cli,
        "find_max_batch" => RunSource::FindMaxBatch,
        "import" => RunSource::Import,
        _ => return None,
    })
}

/// Stored spelling of a failure reason (`OOM`, `other_error`).
pub fn failure_str(f: FailureReason) -> &'static str {
    f.as_str()
}

/// A stored failure reason: the core's spellings (`OOM`, `out_of_memory`,
/// `other_error`…), strictly — a store holds no free text.
pub fn parse_failure(s: &str) -> Option<FailureReason> {
    s.parse().ok()
}

/// A stored outcome's columns (`success`, `failure_reason`, `host_oom`) as
/// one [`RunOutcome`]. Rows the door wrote always say one; a row written
/// before it that says two at once reads as [`RunOutcome::of`] decides (a
/// GPU OOM first, a host kill only on another failure), so an old history
/// still opens.
pub fn outcome(success: bool, failure: Option<FailureReason>, host_oom: bool) -> RunOutcome {
    RunOutcome::from_fields(success, failure, host_oom).unwrap_or_else(|_| {
        RunOutcome::of(
            success && failure.is_none(),
            failure == Some(FailureReason::Oom),
            host_oom,
        )
    })
}

/// Reads a method (`full`, `lora`, `qlora`).
pub fn parse_method(s: &str) -> Option<Method> {
    s.parse().ok()
}

/// Reads a dtype in any spelling `Dtype::from_str` accepts.
pub fn parse_dtype(s: &str) -> Option<Dtype> {
    s.parse().ok()
}

/// Timestamp → microseconds since the Unix epoch.
pub fn ts_to_us(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

/// Microseconds since the Unix epoch → timestamp (out of range: the epoch).
pub fn us_to_ts(us: i64) -> DateTime<Utc> {
    Utc.timestamp_micros(us)
        .single()
        .unwrap_or(DateTime::<Utc>::UNIX_EPOCH)
}

/// u64 → i64 for storage, saturating (sizes here are far below 2^63).
pub fn i(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// i64 → u64 from storage; negative values (never written) read as 0.
pub fn u(x: i64) -> u64 {
    u64::try_from(x).unwrap_or(0)
}

/// i64 → u32 from storage, saturating.
pub fn u32_of(x: i64) -> u32 {
    u32::try_from(x.max(0)).unwrap_or(u32::MAX)
}
