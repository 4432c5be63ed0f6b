//! JSON Lines import/export in the common `run_logs.jsonl` layout (docs/design.md, "Run records and history"):
//!
//! ```json
//! {"timestamp": "2024-11-22T10:00:00.123456",
//!  "config": {"model": "torchtune.models.llama3_1.lora_llama3_1_8b", "max_seq_length": 2048,
//!             "batch_size": 4, "dtype": "bf16", "enable_activation_checkpointing": true,
//!             "enable_activation_offloading": false, "compile": false,
//!             "gradient_accumulation_steps": 8},
//!  "result": {"success": true, "peak_memory_gb": 23.1, "samples_per_sec": 5.2,
//!             "failure_reason": null, "duration_sec": 120.5},
//!  "gpu_type": "NVIDIA A100-SXM4-80GB"}
//! ```
//!
//! - `peak_memory_gb` is read as decimal gigabytes (10^9 bytes), as its name
//!   says and as scripts that compute `torch.cuda.max_memory_reserved() / 1e9`
//!   write it. Files written with `/ 2**30` can be imported with
//!   [`PeakUnit::Gib`] (`gpufit history import --peak-unit gib`). Export writes
//!   bytes / 10^9, plus the exact bytes under `gpufit.peak_memory_bytes`,
//!   which import prefers when present — a round trip loses nothing.
//! - Models go through the catalog (`lookup_model`): the canonical id is the
//!   architecture's name, the method comes from the name (torchtune's
//!   `lora_…`/`qlora_…` component paths). A model the catalog does not know is
//!   kept as written, with the method read from its name (`lora`/`qlora` in
//!   it) or full. GPU names go through `lookup_gpu`; unknown ones are kept.
//! - Malformed lines and absurd values (negative memory, batch 0, sequence 0)
//!   are skipped and counted with their reason, never fatal.
//! - `timestamp`: ISO 8601 with or without offset (naive = UTC), or Unix
//!   seconds; missing means the import time.

use crate::core::run::RunOutcome;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};

use chrono::{DateTime, NaiveDateTime, SecondsFormat, TimeZone, Utc};
use serde::{Deserialize, Serialize};

use super::schema;
use super::HistoryError;
use crate::core::run::{
    FailureReason, KeyedRun, NodeReports, RunKey, RunOrigin, RunRecord, RunResult, RunSource,
};
use crate::core::settings::{DataLoaderSettings, Dtype, EngineeringSettings};
use crate::core::units::{GB, GIB};
use crate::core::workload::Method;

/// Largest peak memory accepted (10 000 GB): far above any GPU or node, so
/// only garbage is refused. `gpufit record` applies the same bound.
pub const MAX_PEAK_BYTES: u64 = 10_000 * GB;

/// Lines longer than this are skipped (a run record is well under 4 KiB).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Unit of `peak_memory_gb` in the file being imported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PeakUnit {
    /// 10^9 bytes (the field's name; `bytes / 1e9`).
    #[default]
    Gb,
    /// 2^30 bytes (`bytes / 2**30`).
    Gib,
}

/// Import options.
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    pub peak_unit: PeakUnit,
    /// Stamped on every imported record (where the file does not say).
    pub cluster: Option<String>,
}

/// What an import did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ImportStats {
    /// Non-blank lines read.
    pub lines: u64,
    /// Records produced (stored, once the store's batch committed).
    pub imported: u64,
    /// Lines skipped.
    pub skipped: u64,
    /// Skipped lines by reason.
    pub skipped_by_reason: BTreeMap<String, u64>,
    /// The first few skipped lines: (line number, reason).
    pub examples: Vec<(u64, String)>,
}

const MAX_EXAMPLES: usize = 10;

// === the file layout ===

#[derive(Debug, Default, Deserialize)]
struct Line {
    #[serde(default)]
    timestamp: Option<serde_json::Value>,
    #[serde(default)]
    config: Option<Config>,
    #[serde(default)]
    result: Option<ResultIn>,
    #[serde(default)]
    gpu_type: Option<String>,
    #[serde(default)]
    gpufit: Option<Extra>,
}

#[derive(Debug, Default, Deserialize)]
struct Config {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_seq_length: Option<f64>,
    #[serde(default)]
    batch_size: Option<f64>,
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    enable_activation_checkpointing: Option<bool>,
    #[serde(default)]
    enable_activation_offloading: Option<bool>,
    #[serde(default)]
    compile: Option<bool>,
    #[serde(default)]
    gradient_accumulation_steps: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
struct ResultIn {
    #[serde(default)]
    success: Option<bool>,
    #[serde(default)]
    peak_memory_gb: Option<f64>,
    #[serde(default)]
    samples_per_sec: Option<f64>,
    #[serde(default)]
    failure_reason: Option<String>,
    #[serde(default)]
    duration_sec: Option<f64>,
}

/// gpufit's own fields, written on export and read back on import.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Extra {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    method: Option<Method>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    peak_memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokens_per_sec: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    predicted_peak_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lora_rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    global_batch: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<RunSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cluster: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    job_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dataloader: Option<DataLoaderSettings>,
    /// A multi-node job's node counts (a partial record stays partial
    /// through an export and re-import).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nodes: Option<NodeReports>,
    /// [`RunResult::host_oom`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    host_oom: bool,
    /// Whether the run's settings are confirmed ([`RunRecord::confirmation`]):
    /// an unconfirmed run must not come back from an export confirmed.
    #[serde(
        default,
        skip_serializing_if = "crate::core::confirm::Confirmation::is_default"
    )]
    confirmation: crate::core::confirm::Confirmation,
}

// === name resolution (cached: a million lines share a few names) ===

/// Resolves model and GPU names through the catalog, caching answers.
#[derive(Debug, Default)]
pub struct Resolver {
    models: HashMap<String, (String, Method)>,
    gpus: HashMap<String, String>,
}

/// The method a model name implies: torchtune component paths and config
/// names carry it (`lora_llama3_1_8b`, `8B_qlora_single_device`).
pub fn method_from_name(name: &str) -> Method {
    let n = name.to_ascii_lowercase();
    if n.contains("qlora") {
        Method::Qlora
    } else if n.contains("lora") {
        Method::Lora
    } else {
        Method::Full
    }
}

impl Resolver {
    /// Canonical model id and method for a name.
    pub fn model(&mut self, name: &str) -> (String, Method) {
        if let Some(v) = self.models.get(name) {
            return v.clone();
        }
        let v = match crate::core::catalog::lookup_model(name) {
            Ok(m) => (
                m.arch.name.clone(),
                m.method.unwrap_or_else(|| method_from_name(name)),
            ),
            Err(_) => (name.to_string(), method_from_name(name)),
        };
        self.models.insert(name.to_string(), v.clone());
        v
    }

    /// Canonical GPU name (as NVML prints it) when the catalog knows it.
    pub fn gpu(&mut self, name: &str) -> String {
        if let Some(v) = self.gpus.get(name) {
            return v.clone();
        }
        let v = crate::core::catalog::lookup_gpu(name)
            .map(|g| g.name)
            .unwrap_or_else(|_| name.trim().to_string());
        self.gpus.insert(name.to_string(), v.clone());
        v
    }
}

// === parsing one line ===

fn parse_timestamp(v: &serde_json::Value) -> Option<DateTime<Utc>> {
    match v {
        serde_json::Value::String(s) => {
            let s = s.trim();
            if let Ok(t) = DateTime::parse_from_rfc3339(s) {
                return Some(t.with_timezone(&Utc));
            }
            for fmt in [
                "%Y-%m-%dT%H:%M:%S%.f",
                "%Y-%m-%d %H:%M:%S%.f",
                "%Y-%m-%dT%H:%M:%S%.f%z",
                "%Y-%m-%d %H:%M:%S%.f%:z",
            ] {
                if let Ok(t) = DateTime::parse_from_str(s, fmt) {
                    return Some(t.with_timezone(&Utc));
                }
                if let Ok(n) = NaiveDateTime::parse_from_str(s, fmt) {
                    return Some(Utc.from_utc_datetime(&n));
                }
            }
            None
        }
        serde_json::Value::Number(n) => {
            let secs = n.as_f64()?;
            if !secs.is_finite() || !(0.0..4.0e9).contains(&secs) {
                return None;
            }
            Utc.timestamp_micros((secs * 1e6) as i64).single()
        }
        _ => None,
    }
}

/// A positive whole number no larger than `max`.
fn whole(v: Option<f64>, max: f64) -> Result<Option<u32>, ()> {
    match v {
        None => Ok(None),
        Some(x) if x.is_finite() && x >= 1.0 && x <= max && x.fract() == 0.0 => Ok(Some(x as u32)),
        Some(_) => Err(()),
    }
}

/// A finite, non-negative value no larger than `max`.
fn sane(v: Option<f64>, max: f64) -> Result<Option<f64>, ()> {
    match v {
        None => Ok(None),
        Some(x) if x.is_finite() && (0.0..=max).contains(&x) => Ok(Some(x)),
        Some(_) => Err(()),
    }
}

/// Parses one line into a record, or the reason it is skipped.
pub fn parse_line(
    line: &str,
    opts: &ImportOptions,
    resolver: &mut Resolver,
    now: DateTime<Utc>,
) -> Result<RunRecord, &'static str> {
    let l = decode(line)?;
    let cfg = l.config.ok_or("missing `config`")?;
    let res = l.result.ok_or("missing `result`")?;
    let model_raw = cfg
        .model
        .as_deref()
        .filter(|m| !m.trim().is_empty())
        .ok_or("missing `config.model`")?;
    if model_raw.len() > 512 {
        return Err("`config.model` longer than 512 characters");
    }
    let gpu_raw = l
        .gpu_type
        .filter(|g| !g.trim().is_empty())
        .ok_or("missing `gpu_type`")?;
    if gpu_raw.len() > 256 {
        return Err("`gpu_type` longer than 256 characters");
    }
    let seq_len = whole(cfg.max_seq_length, 16_777_216.0)
        .map_err(|_| "absurd `config.max_seq_length` (must be a whole number ≥ 1)")?
        .ok_or("missing `config.max_seq_length`")?;
    let timestamp = match &l.timestamp {
        None | Some(serde_json::Value::Null) => now,
        Some(v) => parse_timestamp(v).ok_or("unreadable `timestamp`")?,
    };
    let extra = l.gpufit.unwrap_or_default();
    let settings = settings_of(&cfg, &extra)?;
    let result = result_of(&res, &extra, opts)?;
    let (model, name_method) = resolver.model(model_raw);
    let gpu_model = resolver.gpu(&gpu_raw);
    // Counts that cannot be a job's (0 nodes, more reported than it ran
    // on, a peakless node that is not among the reported ones or is named
    // twice) are dropped, not trusted.
    let listed: Vec<&str> = extra.node.as_deref().unwrap_or("").split(',').collect();
    let nodes = extra.nodes.filter(|n| {
        let mut peakless = n.without_peak.clone();
        peakless.sort();
        peakless.dedup();
        n.expected >= 1
            && n.reported >= 1
            && n.reported <= n.expected
            && peakless.len() == n.without_peak.len()
            && n.without_peak.iter().all(|p| listed.contains(&p.as_str()))
    });
    let origin = RunOrigin::new(extra.source.unwrap_or(RunSource::Import), timestamp)
        .cluster(extra.cluster.or_else(|| opts.cluster.clone()))
        .node(extra.node)
        .job_id(extra.job_id);
    let key = RunKey {
        model,
        method: extra.method.unwrap_or(name_method),
        gpu_model,
        seq_len,
        lora_rank: extra.lora_rank,
        gpus: extra.gpus.filter(|g| *g >= 1).unwrap_or(1),
        global_batch: extra.global_batch,
    };
    let mut run = RunRecord::new(origin, key, settings, result)
        .with_prediction(extra.predicted_peak_bytes)
        .with_confirmation(extra.confirmation);
    run.nodes = nodes;
    Ok(run)
}

/// The line as JSON in the run_logs layout, or why not.
fn decode(line: &str) -> Result<Line, &'static str> {
    serde_json::from_str(line).map_err(|_| {
        // Only on the failure path: tell a wrong field type from non-JSON.
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(serde_json::Value::Object(_)) => {
                "a field has the wrong JSON type (e.g. a number written as text)"
            }
            _ => "not a JSON object in the run_logs layout",
        }
    })
}

/// The engineering settings the run used.
fn settings_of(cfg: &Config, extra: &Extra) -> Result<EngineeringSettings, &'static str> {
    let batch = whole(cfg.batch_size, 1_000_000.0)
        .map_err(|_| "absurd `config.batch_size` (must be a whole number ≥ 1)")?
        .ok_or("missing `config.batch_size`")?;
    let accum = whole(cfg.gradient_accumulation_steps, 1_000_000.0)
        .map_err(|_| "absurd `config.gradient_accumulation_steps` (must be a whole number ≥ 1)")?
        .unwrap_or(1);
    let dtype = match cfg.dtype.as_deref() {
        None => Dtype::Bf16,
        Some(d) => d.parse::<Dtype>().map_err(|_| "unknown `config.dtype`")?,
    };
    Ok(EngineeringSettings {
        micro_batch_size: batch,
        gradient_accumulation_steps: accum,
        dtype,
        activation_checkpointing: cfg.enable_activation_checkpointing.unwrap_or(false),
        activation_offloading: cfg.enable_activation_offloading.unwrap_or(false),
        compile: cfg.compile.unwrap_or(false),
        dataloader: extra.dataloader.clone().unwrap_or_default(),
    })
}

/// What happened: success or the failure's reason, peak, throughput.
fn result_of(
    res: &ResultIn,
    extra: &Extra,
    opts: &ImportOptions,
) -> Result<RunResult, &'static str> {
    // Absurd-value bounds: 10 000 GB is above any GPU made; throughput and
    // duration bounds only catch garbage (a year of training, 10^9 samples/s).
    let peak_gb = sane(res.peak_memory_gb, 10_000.0)
        .map_err(|_| "absurd `result.peak_memory_gb` (negative, not a number, or above 10000)")?;
    let samples = sane(res.samples_per_sec, 1e9).map_err(|_| "absurd `result.samples_per_sec`")?;
    let duration = sane(res.duration_sec, 3.2e7).map_err(|_| "absurd `result.duration_sec`")?;
    let (success, failure_reason) = outcome(res)?;
    if extra.peak_memory_bytes.is_some_and(|b| b > MAX_PEAK_BYTES) {
        return Err("absurd `gpufit.peak_memory_bytes` (above 10000 GB)");
    }
    let peak_memory_bytes = extra.peak_memory_bytes.or_else(|| {
        peak_gb.map(|g| {
            let unit = match opts.peak_unit {
                PeakUnit::Gb => GB,
                PeakUnit::Gib => GIB,
            };
            (g * unit as f64).round() as u64
        })
    });
    Ok(RunResult {
        outcome: RunOutcome::of(
            success,
            failure_reason == Some(FailureReason::Oom),
            extra.host_oom,
        ),
        peak_memory_bytes,
        samples_per_sec: samples,
        tokens_per_sec: extra.tokens_per_sec.filter(|t| t.is_finite() && *t >= 0.0),
        duration_sec: duration,
    })
}

/// Success, and the failure's reason when it failed (free text is read as
/// OOM when it says so, by the core's one reading of a failure reason).
fn outcome(res: &ResultIn) -> Result<(bool, Option<FailureReason>), &'static str> {
    let failure = match res.failure_reason.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(f) => Some(crate::core::logs::oom::failure_reason(f)),
    };
    let success = match (res.success, failure) {
        (Some(s), _) => s,
        (None, Some(_)) => false,
        (None, None) => return Err("missing `result.success`"),
    };
    Ok((
        success,
        (!success).then(|| failure.unwrap_or(FailureReason::OtherError)),
    ))
}

// === streaming reader ===

/// Reads `run_logs.jsonl` records one line at a time (bounded memory),
/// skipping and counting bad lines. Yields `Err` only for I/O errors.
pub struct JsonlReader<R> {
    r: R,
    path: String,
    opts: ImportOptions,
    resolver: Resolver,
    stats: ImportStats,
    buf: Vec<u8>,
    line_no: u64,
    now: DateTime<Utc>,
    done: bool,
}

impl<R: BufRead> JsonlReader<R> {
    /// Reads from `r`; `path` names the source in error messages.
    pub fn new(r: R, path: &str, opts: ImportOptions) -> Self {
        JsonlReader {
            r,
            path: path.to_string(),
            opts,
            resolver: Resolver::default(),
            stats: ImportStats::default(),
            buf: Vec::with_capacity(1024),
            line_no: 0,
            now: Utc::now(),
            done: false,
        }
    }

    /// Counts so far (final once the iterator is exhausted).
    pub fn stats(&self) -> &ImportStats {
        &self.stats
    }

    fn skip(&mut self, reason: &str) {
        self.stats.skipped += 1;
        *self
            .stats
            .skipped_by_reason
            .entry(reason.to_string())
            .or_default() += 1;
        if self.stats.examples.len() < MAX_EXAMPLES {
            self.stats.examples.push((self.line_no, reason.to_string()));
        }
    }

    /// Reads the next line into `buf`; Ok(None) at end, Ok(Some(too_long)).
    fn next_line(&mut self) -> std::io::Result<Option<bool>> {
        self.buf.clear();
        let mut too_long = false;
        let mut any = false;
        loop {
            let chunk = match self.r.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if chunk.is_empty() {
                return Ok(if any { Some(too_long) } else { None });
            }
            any = true;
            let (take, ended) = match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (i, true),
                None => (chunk.len(), false),
            };
            let room = MAX_LINE_BYTES.saturating_sub(self.buf.len());
            if take > room {
                too_long = true;
            }
            self.buf.extend_from_slice(&chunk[..take.min(room)]);
            self.r.consume(if ended { take + 1 } else { take });
            if ended {
                return Ok(Some(too_long));
            }
        }
    }
}

impl<R: BufRead> Iterator for JsonlReader<R> {
    type Item = Result<RunRecord, HistoryError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.done {
                return None;
            }
            let too_long = match self.next_line() {
                Ok(Some(t)) => t,
                Ok(None) => {
                    self.done = true;
                    return None;
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(HistoryError::Io {
                        path: self.path.clone(),
                        message: format!("read failed after line {}: {e}", self.line_no),
                    }));
                }
            };
            self.line_no += 1;
            if self.buf.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            self.stats.lines += 1;
            if too_long {
                self.skip("line longer than 1 MiB");
                continue;
            }
            let Ok(text) = std::str::from_utf8(&self.buf) else {
                self.skip("not UTF-8 text");
                continue;
            };
            // Borrow juggling: parse from a copy-free view, then count.
            let parsed = parse_line(text, &self.opts, &mut self.resolver, self.now);
            match parsed.map(|r| r.validated(None)) {
                Ok(Ok(r)) => {
                    self.stats.imported += 1;
                    return Some(Ok(r));
                }
                // The history's one validation: the same rule as every
                // other write path, counted with the field it names.
                Ok(Err(e)) => self.skip(&e.to_string()),
                Err(reason) => self.skip(reason),
            }
        }
    }
}

/// Lines in flight between a [`ThreadedReader`]'s thread and its consumer
/// (bounded: a slow store holds the reader back, memory stays flat).
const THREADED_QUEUE: usize = 4096;
/// Records per hand-over.
const THREADED_BATCH: usize = 256;

/// A [`JsonlReader`] on a thread of its own, so that parsing, validating
/// and keying ([`RunRecord::keyed`]) the next lines overlaps the store's
/// inserts: what `gpufit history import` runs (`cargo bench --bench
/// history_speed`: parsing is 3.5 s of a 1 M-line import; keying here
/// rather than on the store's thread took it from 16.0 to 11.5 s, with the
/// SQLite rows bound without copies). Yields what the reader yields, keyed, in
/// order. A consumer that stops early (a failed insert) drops it; the
/// thread then stops at its next line.
pub struct ThreadedReader {
    rx: std::sync::mpsc::Receiver<Vec<Result<KeyedRun, HistoryError>>>,
    /// The batch being handed out, reversed (popped from the end).
    batch: Vec<Result<KeyedRun, HistoryError>>,
    worker: Option<std::thread::JoinHandle<ImportStats>>,
}

impl ThreadedReader {
    /// Starts reading `r` (`path` names it in messages) on a new thread.
    pub fn spawn<R: BufRead + Send + 'static>(
        r: R,
        path: &str,
        opts: ImportOptions,
    ) -> Result<Self, HistoryError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(THREADED_QUEUE / THREADED_BATCH);
        let mut rd = JsonlReader::new(r, path, opts);
        let worker = std::thread::Builder::new()
            .name("jsonl-reader".into())
            .spawn(move || {
                // Records go in batches: one wake-up per record cost the
                // consumer more than the parsing it saved.
                let mut batch = Vec::with_capacity(THREADED_BATCH);
                for item in rd.by_ref() {
                    batch.push(item.and_then(|r| Ok(r.keyed()?)));
                    if batch.len() == THREADED_BATCH {
                        let full =
                            std::mem::replace(&mut batch, Vec::with_capacity(THREADED_BATCH));
                        if tx.send(full).is_err() {
                            return rd.stats; // the consumer is gone
                        }
                    }
                }
                if !batch.is_empty() {
                    let _ = tx.send(batch);
                }
                rd.stats
            })
            .map_err(|e| HistoryError::Io {
                path: path.to_string(),
                message: format!("cannot start a reader thread: {e}"),
            })?;
        Ok(ThreadedReader {
            rx,
            batch: Vec::new(),
            worker: Some(worker),
        })
    }

    /// The reader's counts, once the consumer has taken every record.
    pub fn finish(mut self) -> ImportStats {
        match self.worker.take().map(std::thread::JoinHandle::join) {
            Some(Ok(stats)) => stats,
            // a panic in the reader is a bug; its records so far were
            // yielded and stored, the counts are lost
            _ => {
                tracing::error!("the JSONL reader thread panicked; import counts unavailable");
                ImportStats::default()
            }
        }
    }
}

impl Iterator for ThreadedReader {
    type Item = Result<KeyedRun, HistoryError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.batch.is_empty() {
            self.batch = self.rx.recv().ok()?;
            self.batch.reverse();
        }
        self.batch.pop()
    }
}

// === export ===

#[derive(Serialize)]
struct ConfigOut<'a> {
    model: &'a str,
    max_seq_length: u32,
    batch_size: u32,
    dtype: &'a str,
    enable_activation_checkpointing: bool,
    enable_activation_offloading: bool,
    compile: bool,
    gradient_accumulation_steps: u32,
}

#[derive(Serialize)]
struct ResultOut {
    success: bool,
    peak_memory_gb: Option<f64>,
    samples_per_sec: Option<f64>,
    failure_reason: Option<&'static str>,
    duration_sec: Option<f64>,
}

#[derive(Serialize)]
struct LineOut<'a> {
    timestamp: String,
    config: ConfigOut<'a>,
    result: ResultOut,
    gpu_type: &'a str,
    gpufit: Extra,
}

/// Writes one record as a `run_logs.jsonl` line (with gpufit's extra fields
/// under `gpufit`).
pub fn write_record<W: Write>(w: &mut W, r: &RunRecord) -> std::io::Result<()> {
    let s = &r.settings;
    let line = LineOut {
        timestamp: r.timestamp.to_rfc3339_opts(SecondsFormat::Micros, true),
        config: ConfigOut {
            model: &r.model,
            max_seq_length: r.seq_len,
            batch_size: s.micro_batch_size,
            dtype: s.dtype.as_str(),
            enable_activation_checkpointing: s.activation_checkpointing,
            enable_activation_offloading: s.activation_offloading,
            compile: s.compile,
            gradient_accumulation_steps: s.gradient_accumulation_steps,
        },
        result: ResultOut {
            success: r.result.success(),
            peak_memory_gb: r.result.peak_memory_bytes.map(|b| b as f64 / GB as f64),
            samples_per_sec: r.result.samples_per_sec,
            failure_reason: r.result.failure_reason().map(schema::failure_str),
            duration_sec: r.result.duration_sec,
        },
        gpu_type: &r.gpu_model,
        gpufit: Extra {
            method: Some(r.method),
            peak_memory_bytes: r.result.peak_memory_bytes,
            tokens_per_sec: r.result.tokens_per_sec,
            predicted_peak_bytes: r.predicted_peak_bytes,
            lora_rank: r.lora_rank,
            gpus: Some(r.gpus),
            global_batch: r.global_batch,
            source: Some(r.source),
            cluster: r.cluster.clone(),
            node: r.node.clone(),
            job_id: r.job_id.clone(),
            dataloader: Some(s.dataloader.clone()),
            nodes: r.nodes.clone(),
            host_oom: r.result.host_oom(),
            confirmation: r.confirmation,
        },
    };
    serde_json::to_writer(&mut *w, &line).map_err(std::io::Error::other)?;
    w.write_all(b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(line: &str) -> Result<RunRecord, &'static str> {
        parse_line(
            line,
            &ImportOptions::default(),
            &mut Resolver::default(),
            Utc::now(),
        )
    }

    const GOOD: &str = r#"{"timestamp": "2024-11-22T10:00:00.123456", "config": {"model": "torchtune.models.llama3_1.lora_llama3_1_8b", "max_seq_length": 2048, "batch_size": 4, "dtype": "bf16", "enable_activation_checkpointing": true, "enable_activation_offloading": false, "compile": false, "gradient_accumulation_steps": 8}, "result": {"success": true, "peak_memory_gb": 23.1, "samples_per_sec": 5.2, "failure_reason": null, "duration_sec": 120.5}, "gpu_type": "NVIDIA A100-SXM4-80GB"}"#;

    /// `n` lines: GOOD with its batch size varied, every seventh line bad.
    fn lines(n: usize) -> String {
        (0..n)
            .map(|i| {
                if i % 7 == 3 {
                    "{not json\n".to_string()
                } else {
                    GOOD.replace(
                        "\"batch_size\": 4",
                        &format!("\"batch_size\": {}", 1 + i % 64),
                    ) + "\n"
                }
            })
            .collect()
    }

    #[test]
    fn the_threaded_reader_yields_what_the_reader_yields_in_order_with_its_counts() {
        // more lines than one hand-over (THREADED_BATCH) and not a multiple of it
        let text = lines(THREADED_BATCH * 3 + 17);
        let mut plain = JsonlReader::new(text.as_bytes(), "t", ImportOptions::default());
        let want: Vec<RunRecord> = plain.by_ref().map(|r| r.unwrap()).collect();
        let mut threaded = ThreadedReader::spawn(
            std::io::Cursor::new(text.clone().into_bytes()),
            "t",
            ImportOptions::default(),
        )
        .unwrap();
        let got: Vec<KeyedRun> = threaded.by_ref().map(|r| r.unwrap()).collect();
        // the same records, each with its own identity as its key
        assert!(got.iter().map(KeyedRun::run).eq(want.iter()));
        for k in &got {
            assert_eq!(k.key(), k.run().identity());
        }
        let keys: std::collections::HashSet<&str> = got.iter().map(KeyedRun::key).collect();
        let contents: std::collections::HashSet<u32> = got
            .iter()
            .map(|k| k.run().settings.micro_batch_size)
            .collect();
        // the lines differ only in their batch size: one key per content
        assert_eq!(keys.len(), contents.len());
        assert!(got.len() > THREADED_BATCH * 2);
        assert_eq!(&threaded.finish(), plain.stats());
        // an empty input ends at once
        let mut empty = ThreadedReader::spawn(
            std::io::Cursor::new(Vec::new()),
            "e",
            ImportOptions::default(),
        )
        .unwrap();
        assert!(empty.next().is_none());
        assert_eq!(empty.finish(), ImportStats::default());
    }

    #[test]
    fn a_consumer_that_stops_early_stops_the_reader_thread() {
        // A failed insert drops the reader after a few records: its
        // thread, blocked on a full queue, must end rather than read on.
        let text = lines(THREADED_QUEUE * 4);
        let mut rd = ThreadedReader::spawn(
            std::io::Cursor::new(text.into_bytes()),
            "t",
            ImportOptions::default(),
        )
        .unwrap();
        assert!(rd.by_ref().take(3).all(|r| r.is_ok()));
        let worker = rd.worker.take().unwrap();
        drop(rd);
        let stats = worker.join().unwrap();
        // at most a full queue, the batch being filled and the one taken
        assert!(
            (stats.imported as usize) <= THREADED_QUEUE + 2 * THREADED_BATCH,
            "the thread read on: {} records",
            stats.imported
        );
    }

    #[test]
    fn a_run_logs_line_becomes_a_record_with_decimal_gb() {
        let r = parse(GOOD).unwrap();
        assert_eq!(r.settings.micro_batch_size, 4);
        assert_eq!(r.settings.gradient_accumulation_steps, 8);
        assert!(r.settings.activation_checkpointing);
        assert_eq!(r.seq_len, 2048);
        assert_eq!(r.result.peak_memory_bytes, Some(23_100_000_000));
        assert_eq!(r.method, Method::Lora, "the component path says lora");
        assert_eq!(r.source, RunSource::Import);
        assert_eq!(
            r.timestamp.to_rfc3339_opts(SecondsFormat::Micros, true),
            "2024-11-22T10:00:00.123456Z"
        );
    }

    #[test]
    fn a_torchtune_component_path_resolves_to_the_catalog_id_and_its_method() {
        let mut res = Resolver::default();
        let (id, method) = res.model("torchtune.models.llama3_1.lora_llama3_1_8b");
        let want = crate::core::catalog::lookup_model("llama-3.1-8b")
            .unwrap()
            .arch
            .name;
        assert_eq!(id, want);
        assert_eq!(method, Method::Lora);
        let (id, method) = res.model("torchtune.models.llama3_1.qlora_llama3_1_8b");
        assert_eq!((id.as_str(), method), (want.as_str(), Method::Qlora));
        let (id, method) = res.model("my-org/unlisted-model");
        assert_eq!(
            (id.as_str(), method),
            ("my-org/unlisted-model", Method::Full)
        );
        assert_eq!(
            res.gpu("NVIDIA A100-SXM4-80GB"),
            crate::core::catalog::lookup_gpu("NVIDIA A100-SXM4-80GB")
                .unwrap()
                .name
        );
    }

    #[test]
    fn gib_option_reads_peak_as_binary_gigabytes() {
        let opts = ImportOptions {
            peak_unit: PeakUnit::Gib,
            ..ImportOptions::default()
        };
        let r = parse_line(GOOD, &opts, &mut Resolver::default(), Utc::now()).unwrap();
        assert_eq!(
            r.result.peak_memory_bytes,
            Some((23.1 * GIB as f64).round() as u64)
        );
    }

    #[test]
    fn absurd_and_missing_fields_are_skipped_with_a_reason() {
        let neg = GOOD.replace("23.1", "-5");
        assert!(parse(&neg).unwrap_err().contains("peak_memory_gb"));
        let zero = GOOD.replace("\"batch_size\": 4", "\"batch_size\": 0");
        assert!(parse(&zero).unwrap_err().contains("batch_size"));
        let frac = GOOD.replace("\"batch_size\": 4", "\"batch_size\": 2.5");
        assert!(parse(&frac).unwrap_err().contains("batch_size"));
        let nogpu = GOOD.replace("\"gpu_type\": \"NVIDIA A100-SXM4-80GB\"", "\"x\": 1");
        assert!(parse(&nogpu).unwrap_err().contains("gpu_type"));
        assert!(parse("[1,2]").unwrap_err().contains("not a JSON object"));
        let texty = GOOD.replace("\"batch_size\": 4", "\"batch_size\": \"4\"");
        assert!(parse(&texty).unwrap_err().contains("wrong JSON type"));
        assert!(parse("{\"config\": {}}").unwrap_err().contains("result"));
        let baddtype = GOOD.replace("\"bf16\"", "\"int3\"");
        assert!(parse(&baddtype).unwrap_err().contains("dtype"));
    }

    #[test]
    fn an_oom_failure_reason_in_prose_is_an_oom() {
        let l = GOOD
            .replace("\"success\": true", "\"success\": false")
            .replace(
                "\"failure_reason\": null",
                "\"failure_reason\": \"CUDA out of memory. Tried to allocate 2.00 GiB\"",
            );
        let r = parse(&l).unwrap();
        assert_eq!(r.result.failure_reason(), Some(FailureReason::Oom));
        assert!(r.is_oom());
    }

    #[test]
    fn a_model_name_with_oom_in_it_is_not_an_oom() {
        let failed = |reason: &str| {
            let l = GOOD
                .replace("\"success\": true", "\"success\": false")
                .replace(
                    "\"failure_reason\": null",
                    &format!("\"failure_reason\": \"{reason}\""),
                );
            parse(&l).unwrap().result.failure_reason()
        };
        assert_eq!(failed("bloom-7b crashed"), Some(FailureReason::OtherError));
        assert_eq!(failed("OOMKilled"), Some(FailureReason::OtherError));
        assert_eq!(failed("OOM at step 12"), Some(FailureReason::Oom));
    }

    #[test]
    fn unix_and_offset_timestamps_are_read() {
        let unix = GOOD.replace("\"2024-11-22T10:00:00.123456\"", "1732269600");
        assert_eq!(parse(&unix).unwrap().timestamp.timestamp(), 1_732_269_600);
        let off = GOOD.replace("2024-11-22T10:00:00.123456", "2024-11-22T12:00:00+02:00");
        assert_eq!(parse(&off).unwrap().timestamp.timestamp(), 1_732_269_600);
        let bad = GOOD.replace("2024-11-22T10:00:00.123456", "yesterday");
        assert!(parse(&bad).unwrap_err().contains("timestamp"));
    }

    #[test]
    fn the_reader_counts_skipped_lines_and_keeps_going() {
        let text = format!("{GOOD}\nnot json\n\n{}\n{GOOD}", GOOD.replace("23.1", "-1"));
        let mut rd = JsonlReader::new(text.as_bytes(), "t.jsonl", ImportOptions::default());
        let got: Vec<_> = rd.by_ref().collect::<Result<_, _>>().unwrap();
        assert_eq!(got.len(), 2);
        let s = rd.stats();
        assert_eq!((s.lines, s.imported, s.skipped), (4, 2, 2));
        assert_eq!(s.examples[0].0, 2);
        assert_eq!(s.examples[1].0, 4);
    }

    #[test]
    fn export_then_import_gives_the_same_record() {
        let mut r = parse(GOOD).unwrap();
        r.result.peak_memory_bytes = Some(24_803_346_432);
        r.result.tokens_per_sec = Some(2843.98);
        r.predicted_peak_bytes = Some(25_000_000_000);
        r.lora_rank = Some(8);
        r.source = RunSource::Slurm;
        let mut out = Vec::new();
        write_record(&mut out, &r).unwrap();
        let text = String::from_utf8(out).unwrap();
        let back = parse(text.trim_end()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn catalog_aliases_come_back_canonical() {
        // What the round-trip property once met by chance: "l4" is the
        // catalog's NVIDIA L4 and "gpt2" its openai-community/gpt2.
        let mut r = parse(GOOD).unwrap();
        r.model = "gpt2".into();
        r.gpu_model = "l4".into();
        let mut out = Vec::new();
        write_record(&mut out, &r).unwrap();
        let back = parse(String::from_utf8(out).unwrap().trim_end()).unwrap();
        assert_eq!(back.gpu_model, "NVIDIA L4");
        assert_eq!(back.model, "openai-community/gpt2");
    }

    proptest! {
        #[test]
        fn arbitrary_lines_never_panic(s in ".{0,300}") {
            let _ = parse(&s);
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_reader(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let rd = JsonlReader::new(&bytes[..], "x", ImportOptions::default());
            for r in rd { prop_assert!(r.is_ok()); }
        }

        #[test]
        fn export_then_import_round_trips_any_record(
            micros in 0i64..4_000_000_000_000_000,
            seq in 1u32..200_000,
            batch in 1u32..4096,
            accum in 1u32..512,
            dtype_i in 0usize..5,
            flags in proptest::array::uniform4(any::<bool>()),
            peak in proptest::option::of(0u64..=MAX_PEAK_BYTES),
            samples in proptest::option::of(0.0f64..1e6),
            oom_fail in any::<bool>(),
            host_oom in any::<bool>(),
            model in "[a-zA-Z0-9_./-]{1,40}",
            gpu in "[a-zA-Z0-9 -]{1,30}",
        ) {
            let mut r = parse(GOOD).unwrap();
            r.timestamp = Utc.timestamp_micros(micros).single().unwrap();
            // Names go through the catalog on import: a random name that is
            // a catalog alias ("l4", "gpt2") comes back canonical, so the
            // record written is the one the importer would make.
            let mut names = Resolver::default();
            (r.model, r.method) = names.model(&model);
            prop_assume!(!gpu.trim().is_empty());
            r.gpu_model = names.gpu(&gpu);
            r.seq_len = seq;
            r.settings.micro_batch_size = batch;
            r.settings.gradient_accumulation_steps = accum;
            r.settings.dtype = Dtype::ALL[dtype_i];
            r.settings.activation_checkpointing = flags[0];
            r.settings.activation_offloading = flags[1];
            r.settings.compile = flags[2];
            r.result.outcome = RunOutcome::of(flags[3], !flags[3] && oom_fail, host_oom);
            r.result.peak_memory_bytes = peak;
            r.result.samples_per_sec = samples;
            let mut out = Vec::new();
            write_record(&mut out, &r).unwrap();
            let text = String::from_utf8(out).unwrap();
            let mut back = parse(text.trim_end()).unwrap();
            // serde_json's default float parser may be 1 ulp off on
            // round trip; a throughput differing in the 16th digit is equal.
            if let (Some(a), Some(b)) = (back.result.samples_per_sec, r.result.samples_per_sec) {
                prop_assert!((a - b).abs() <= b.abs() * 1e-15);
                back.result.samples_per_sec = r.result.samples_per_sec;
            }
            prop_assert_eq!(back, r);
        }

        #[test]
        fn any_numeric_field_value_is_imported_or_skipped_never_fatal(
            batch in proptest::num::f64::ANY,
            peak in proptest::num::f64::ANY,
            seq in -10i64..100_000,
        ) {
            let l = format!(
                r#"{{"config": {{"model": "m", "max_seq_length": {seq}, "batch_size": {}, "dtype": "bf16"}}, "result": {{"success": true, "peak_memory_gb": {}}}, "gpu_type": "g"}}"#,
                serde_json::to_string(&batch).unwrap_or_else(|_| "null".into()),
                serde_json::to_string(&peak).unwrap_or_else(|_| "null".into()),
            );
            if let Ok(r) = parse(&l) {
                prop_assert!(r.settings.micro_batch_size >= 1);
                prop_assert!(r.seq_len >= 1);
            }
        }
    }
}
