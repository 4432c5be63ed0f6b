//! `gpufit._native`: the Rust side of the Python package.
//!
//! Every function takes the same flags the `gpufit` command line takes (the
//! Python layer builds them from keyword arguments) and parses them with the
//! CLI's own clap types, so a call resolves workload, GPU, pins and history
//! exactly as `gpufit suggest` / `estimate` / `record` do, and fails with
//! the CLI's messages. Results cross as JSON text; `gpufit/__init__.py`
//! turns them into the helper's dicts.

use std::collections::HashMap;
use std::io::BufReader;
use std::path::Path;
use std::sync::{Arc, Mutex};

use clap::Parser;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use serde::Serialize;

use gpufit::cli::common::WorkloadArgs;
use gpufit::cli::estimate::{settings_from, EstimateArgs};
use gpufit::cli::history::StoreArgs;
use gpufit::cli::suggest::{Resolved, SuggestArgs};
use gpufit::core::advisor::{first_run_plan, under_prediction_margin};
use gpufit::core::catalog::lookup_gpu;
use gpufit::core::logs::{self, LogOutcome};
use gpufit::core::memory::{self, Head};
use gpufit::core::result_record::{ResultRecord, StatedSettings};
use gpufit::core::run::{FailureReason, RunRecord};
use gpufit::core::settings::SETTING_VARS;
use gpufit::core::similarity::HistoryQuery;
use gpufit::history::jsonl::{ImportOptions, JsonlReader};
use gpufit::history::HistoryStore;
use gpufit::service::Pipeline;

create_exception!(
    gpufit,
    GpufitError,
    PyException,
    "An error gpufit reports, with the command line's message; `exit_code` is the code `gpufit` would exit with."
);

/// The CLI's message for an error: the error, then each cause.
fn message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut m = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        m.push_str("\n  caused by: ");
        m.push_str(&s.to_string());
        src = s.source();
    }
    m
}

fn py_err(e: gpufit::Error) -> PyErr {
    let err = GpufitError::new_err(message(&e));
    Python::attach(|py| {
        // Best effort: the code is informative; the message is the error.
        let _ = err.value(py).setattr("exit_code", e.exit_code());
    });
    err
}

fn clap_err(e: clap::Error) -> PyErr {
    let text = e.render().to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"))
        .collect();
    let err = GpufitError::new_err(lines.join("\n").trim_start_matches("error: ").to_string());
    Python::attach(|py| {
        let _ = err.value(py).setattr("exit_code", 2u8);
    });
    err
}

fn usage(m: impl Into<String>) -> PyErr {
    py_err(gpufit::Error::Usage(m.into()))
}

fn to_json<T: Serialize>(v: &T) -> PyResult<String> {
    serde_json::to_string(v).map_err(|e| usage(format!("cannot serialize the result: {e}")))
}

#[derive(Parser)]
#[command(name = "gpufit suggest")]
struct SuggestCmd {
    #[command(flatten)]
    args: SuggestArgs,
}

#[derive(Parser)]
#[command(name = "gpufit estimate")]
struct EstimateCmd {
    #[command(flatten)]
    args: EstimateArgs,
}

#[derive(Parser)]
#[command(name = "gpufit record")]
struct StoreCmd {
    #[command(flatten)]
    store: StoreArgs,
}

#[derive(Parser)]
#[command(name = "gpufit workload")]
struct WorkloadCmd {
    #[command(flatten)]
    workload: WorkloadArgs,
}

fn parse<P: Parser>(name: &str, argv: Vec<String>) -> PyResult<P> {
    P::try_parse_from(std::iter::once(name.to_string()).chain(argv)).map_err(clap_err)
}

/// Runs of `run_logs.jsonl` in `dir` (the helper's layout) under `q`;
/// malformed lines are skipped, as `gpufit history import` skips them.
fn jsonl_runs(dir: &str, q: &HistoryQuery) -> PyResult<Vec<RunRecord>> {
    let path = Path::new(dir).join("run_logs.jsonl");
    let f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(py_err(gpufit::Error::Io {
                context: format!("cannot open {}", path.display()),
                source: e,
            }))
        }
    };
    let reader = JsonlReader::new(
        BufReader::new(f),
        &path.display().to_string(),
        ImportOptions::default(),
    );
    let mut out = Vec::new();
    for r in reader {
        let r = r.map_err(|e| py_err(e.into()))?;
        if q.matches(&r) {
            out.push(r);
        }
    }
    Ok(out)
}

/// History stores opened by earlier calls, by URL and busy timeout: a
/// training script that asks many times opens its store once (`gpufit
/// suggest` opens it per process, which is per call).
type StoreCache = HashMap<(String, u64), Arc<dyn HistoryStore>>;
static STORES: Mutex<Option<StoreCache>> = Mutex::new(None);

/// The similar runs of the store at `url`, as `gpufit suggest` reads them.
fn similar_cached(
    args: &StoreArgs,
    url: &str,
    r: &Resolved,
) -> gpufit::Result<Arc<Vec<RunRecord>>> {
    let key = (url.to_string(), args.history_busy_timeout_ms);
    let cached = STORES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
        .cloned();
    if let Some(store) = cached {
        // A connection that broke (a restarted server) is opened anew below.
        if let Ok(h) = Pipeline::similar_runs(store.as_ref(), &r.workload, &r.gpu) {
            return Ok(h);
        }
    }
    let store: Arc<dyn HistoryStore> = Arc::from(args.open_url(url)?);
    let h = Pipeline::similar_runs(store.as_ref(), &r.workload, &r.gpu)?;
    STORES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, store);
    Ok(h)
}

#[derive(Serialize)]
struct SuggestOut<'a> {
    suggestion: &'a gpufit::core::advisor::Suggestion,
    model: &'a str,
    method: String,
    seq_len: u32,
    gpus: u32,
    lora_rank: Option<u32>,
    global_batch: Option<u32>,
    gpu_memory_bytes: u64,
    history_runs: usize,
}

/// suggest(argv, run_log_dir=None) -> str
///
/// `gpufit suggest ARGV -o json`, plus the similar runs of
/// `run_log_dir/run_logs.jsonl` (those the store also holds, by job id,
/// counted once). Returns JSON: the suggestion and the resolved workload.
#[pyfunction]
#[pyo3(signature = (argv, run_log_dir=None))]
fn suggest(py: Python<'_>, argv: Vec<String>, run_log_dir: Option<String>) -> PyResult<String> {
    let mut cmd: SuggestCmd = parse("gpufit suggest", argv)?;
    py.detach(move || {
        // The history is read below, through stores kept open across calls.
        let use_history = !cmd.args.advice.no_history;
        cmd.args.advice.no_history = true;
        let mut r = cmd.args.advice.resolve().map_err(py_err)?;
        if use_history {
            let store = &cmd.args.advice.store;
            match store.given() {
                // An explicitly named store must work (as `gpufit suggest`).
                Some(url) => r.history = similar_cached(store, url, &r).map_err(py_err)?,
                // The default store is a convenience: the CLI's note, not an error.
                None => {
                    let url = gpufit::history::default_url();
                    match similar_cached(store, &url, &r) {
                        Ok(h) => r.history = h,
                        Err(e) => r.notes.push(format!(
                            "history store {url} unavailable ({e}): advice from the memory model only"
                        )),
                    }
                }
            }
        }
        if let Some(dir) = run_log_dir.as_deref() {
            let q = HistoryQuery::new(
                &r.workload.model.name,
                r.workload.method,
                &r.gpu.name,
                r.workload.seq_len,
            );
            let extra = jsonl_runs(dir, &q)?;
            if !extra.is_empty() {
                let mut all: Vec<RunRecord> = r.history.as_ref().clone();
                for run in extra {
                    let dup = run.job_id.is_some()
                        && all
                            .iter()
                            .any(|s| s.job_id == run.job_id && s.model == run.model);
                    if !dup {
                        all.push(run);
                    }
                }
                r.history = Arc::new(all);
            }
        }
        let s = r.suggest(cmd.args.strategy).map_err(py_err)?;
        to_json(&SuggestOut {
            suggestion: &s,
            model: &r.workload.model.name,
            method: r.workload.method.to_string(),
            seq_len: r.workload.seq_len,
            gpus: r.workload.gpus,
            lora_rank: r.workload.lora.as_ref().map(|l| l.rank),
            global_batch: r.workload.global_batch,
            gpu_memory_bytes: r.gpu.memory_bytes,
            history_runs: r.history.len(),
        })
    })
}

/// estimate(argv) -> str
///
/// `gpufit estimate ARGV -o json`: the memory model's breakdown of one
/// training step, and with `--gpu` the fit on that GPU.
#[pyfunction]
fn estimate(argv: Vec<String>) -> PyResult<String> {
    let cmd: EstimateCmd = parse("gpufit estimate", argv)?;
    let a = cmd.args;
    let w = a.workload.resolve().map_err(py_err)?;
    let s = settings_from(&a).map_err(py_err)?;
    let head = a
        .workload
        .config_names_small_head()
        .map_err(py_err)?
        .then_some(Head::Classifier);
    let opts = a.options.options(head).map_err(py_err)?;
    let est = memory::estimate_with(&w, &s, &opts).map_err(|e| py_err(e.into()))?;
    let mut out = serde_json::json!({
        "model": w.model.name,
        "method": w.method.to_string(),
        "dtype": s.dtype.as_str(),
        "seq_len": w.seq_len,
        "micro_batch_size": s.micro_batch_size,
        "activation_checkpointing": s.activation_checkpointing,
        "estimate": est,
        "under_prediction_margin": under_prediction_margin(w.framework),
        "first_run_plan_bytes": first_run_plan(&est, w.framework).round() as u64,
    });
    if let Some(name) = a.gpu.as_deref() {
        let gpu = lookup_gpu(name).map_err(|e| py_err(e.into()))?;
        let max = memory::max_micro_batch_with(&w, &s, &opts, gpu.memory_bytes)
            .map_err(|e| py_err(e.into()))?;
        let margin = under_prediction_margin(w.framework);
        let budget = (gpu.memory_bytes as f64 / (1.0 + margin)).floor() as u64;
        let max_within =
            memory::max_micro_batch_with(&w, &s, &opts, budget).map_err(|e| py_err(e.into()))?;
        out["gpu"] = serde_json::json!({
            "name": gpu.name,
            "memory_bytes": gpu.memory_bytes,
            "fraction": est.peak_bytes as f64 / gpu.memory_bytes as f64,
            "fits": est.peak_bytes <= gpu.memory_bytes,
            "fits_within_measured_error": est.peak_bytes <= budget,
            "max_micro_batch": max,
            "max_micro_batch_within_measured_error": max_within,
        });
    }
    to_json(&out)
}

/// resolve_workload(argv) -> str
///
/// The workload flags resolved as every command resolves them: canonical
/// model id, method, sequence length (for `log_run_result`).
#[pyfunction]
fn resolve_workload(argv: Vec<String>) -> PyResult<String> {
    let cmd: WorkloadCmd = parse("gpufit workload", argv)?;
    let w = cmd.workload.resolve().map_err(py_err)?;
    to_json(&serde_json::json!({
        "model": w.model.name,
        "method": w.method.to_string(),
        "seq_len": w.seq_len,
        "gpus": w.gpus,
        "lora_rank": w.lora.as_ref().map(|l| l.rank),
        "global_batch": w.global_batch,
    }))
}

/// parse_log(path) -> str
///
/// `gpufit parse-log PATH -o json`: what a training log (torchtune, HF
/// Trainer, Lightning, a CUDA OOM traceback, plain `Peak memory:` lines)
/// says about its run.
#[pyfunction]
fn parse_log(py: Python<'_>, path: String) -> PyResult<String> {
    py.detach(move || {
        let f = std::fs::File::open(&path).map_err(|e| {
            py_err(gpufit::Error::Io {
                context: format!("cannot open log {path}"),
                source: e,
            })
        })?;
        let p = logs::parse_reader(BufReader::with_capacity(1 << 16, f))
            .map_err(|e| py_err(e.into()))?;
        let failure_reason = match p.outcome {
            Some(LogOutcome::OutOfMemory) => Some(FailureReason::Oom),
            Some(LogOutcome::Failed) => Some(FailureReason::OtherError),
            _ => None,
        };
        let mut v = serde_json::to_value(&p)
            .map_err(|e| usage(format!("cannot serialize the parsed log: {e}")))?;
        v["peak_memory_bytes"] = serde_json::json!(p.peak_memory_bytes());
        v["success"] = serde_json::json!(p.success());
        v["failure_reason"] = serde_json::json!(failure_reason);
        to_json(&v)
    })
}

/// record_run(line, history=None, use_store=True) -> str
///
/// One `run_logs.jsonl` line (the helper's layout, with gpufit's own
/// fields under `gpufit`) read as `gpufit history import` reads it, then
/// stored in the history the CLI uses (`history`, else `GPUFIT_HISTORY`,
/// else the per-user SQLite file). Returns JSON: the record as stored.
#[pyfunction]
#[pyo3(signature = (line, history=None, use_store=true))]
fn record_run(
    py: Python<'_>,
    line: String,
    history: Option<String>,
    use_store: bool,
) -> PyResult<String> {
    let mut argv = Vec::new();
    if let Some(h) = history {
        argv.extend(["--history".to_string(), h]);
    }
    let cmd: StoreCmd = parse("gpufit record", argv)?;
    py.detach(move || {
        let mut resolver = gpufit::history::jsonl::Resolver::default();
        let run = gpufit::history::jsonl::parse_line(
            &line,
            &ImportOptions::default(),
            &mut resolver,
            chrono::Utc::now(),
        )
        .map_err(|why| usage(format!("run not recorded: {why}")))?;
        let (id, url) = if use_store {
            let store: Box<dyn HistoryStore> = cmd.store.open().map_err(py_err)?;
            let id = store.record(&run).map_err(|e| py_err(e.into()))?;
            (Some(id), Some(store.url()))
        } else {
            (None, None)
        };
        to_json(&serde_json::json!({
            "id": id,
            "store": url,
            "run": RunRecord { id, ..run },
        }))
    })
}

/// validate_result_record(text) -> str
///
/// Reads a result record with the recorders' parser (strict, schema
/// version 1, at most 4096 bytes) and returns its canonical JSON.
#[pyfunction]
fn validate_result_record(text: String) -> PyResult<String> {
    let r = ResultRecord::parse(&text).map_err(|e| usage(e.to_string()))?;
    r.to_json().map_err(|e| usage(e.to_string()))
}

/// result_record_mismatches(text) -> str
///
/// JSON list of `[field, injected, ran]` where the job ran other settings
/// than gpufit injected.
#[pyfunction]
fn result_record_mismatches(text: String) -> PyResult<String> {
    let r = ResultRecord::parse(&text).map_err(|e| usage(e.to_string()))?;
    to_json(&r.mismatches())
}

/// injected_settings() -> str | None
///
/// The settings gpufit injected into this process's environment (the
/// `GPUFIT_*` variables of the one table the Kubernetes injection and the
/// Slurm TaskProlog write), as a result record's `injected`; None when
/// gpufit injected nothing. A malformed value is an error naming it.
#[pyfunction]
fn injected_settings() -> PyResult<Option<String>> {
    let get = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let env_of = |placeholder: &str| {
        SETTING_VARS
            .iter()
            .find(|v| v.placeholder == placeholder)
            .map(|v| v.env)
            .unwrap_or_default()
    };
    let int = |p: &str| -> PyResult<Option<u32>> {
        let name = env_of(p);
        get(name)
            .map(|v| {
                v.trim()
                    .parse::<u32>()
                    .map_err(|_| usage(format!("{name}={v}: not a whole number")))
            })
            .transpose()
    };
    let boolean = |p: &str| -> PyResult<Option<bool>> {
        let name = env_of(p);
        get(name)
            .map(|v| match v.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "on" => Ok(true),
                "false" | "0" | "off" => Ok(false),
                _ => Err(usage(format!("{name}={v}: not true or false"))),
            })
            .transpose()
    };
    let dtype_name = env_of("dtype");
    let s = StatedSettings {
        micro_batch_size: int("micro_batch_size")?,
        gradient_accumulation_steps: int("gradient_accumulation_steps")?,
        dtype: get(dtype_name)
            .map(|v| {
                v.parse()
                    .map_err(|e: String| usage(format!("{dtype_name}: {e}")))
            })
            .transpose()?,
        activation_checkpointing: boolean("activation_checkpointing")?,
        activation_offloading: boolean("activation_offloading")?,
        compile: boolean("compile")?,
        num_workers: int("num_workers")?,
    };
    if s == StatedSettings::default() {
        return Ok(None);
    }
    to_json(&s).map(Some)
}

/// setting_vars() -> list[tuple[str, str]]
///
/// `(placeholder, environment variable)` of every setting gpufit injects.
#[pyfunction]
fn setting_vars() -> Vec<(&'static str, &'static str)> {
    SETTING_VARS
        .iter()
        .map(|v| (v.placeholder, v.env))
        .collect()
}

/// dtype_name(text) -> str | None
///
/// gpufit's spelling of a precision (`bfloat16` → `bf16`, Lightning's
/// `16-mixed` → `fp16-mixed`); None for one gpufit does not model.
#[pyfunction]
fn dtype_name(text: &str) -> Option<&'static str> {
    text.parse::<gpufit::core::settings::Dtype>()
        .ok()
        .map(|d| d.as_str())
}

/// default_history_url() -> str: the store the CLI uses when none is named.
#[pyfunction]
fn default_history_url() -> String {
    gpufit::history::default_url()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GpufitError", m.py().get_type::<GpufitError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "RESULT_SCHEMA_VERSION",
        gpufit::core::result_record::SCHEMA_VERSION,
    )?;
    m.add(
        "MAX_RECORD_BYTES",
        gpufit::core::result_record::MAX_RECORD_BYTES,
    )?;
    m.add(
        "RESULT_FILE_ENV",
        gpufit::core::result_record::RESULT_FILE_ENV,
    )?;
    m.add_function(wrap_pyfunction!(suggest, m)?)?;
    m.add_function(wrap_pyfunction!(estimate, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_workload, m)?)?;
    m.add_function(wrap_pyfunction!(parse_log, m)?)?;
    m.add_function(wrap_pyfunction!(record_run, m)?)?;
    m.add_function(wrap_pyfunction!(validate_result_record, m)?)?;
    m.add_function(wrap_pyfunction!(result_record_mismatches, m)?)?;
    m.add_function(wrap_pyfunction!(injected_settings, m)?)?;
    m.add_function(wrap_pyfunction!(setting_vars, m)?)?;
    m.add_function(wrap_pyfunction!(default_history_url, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_name, m)?)?;
    Ok(())
}
