//! `gpufit record`: one run's settings and result into the history.

use crate::core::run::RunOutcome;
use std::path::PathBuf;
use std::process::ExitCode;

use chrono::Utc;
use serde::Serialize;

use super::common::{OnOff, WorkloadArgs};
use super::history::{canonical_gpu, StoreArgs};
use super::{Global, OutputFormat};
use crate::core::logs::ParsedLog;
use crate::core::run::{FailureReason, RunKey, RunOrigin, RunRecord, RunResult, RunSource};
use crate::core::settings::{Dtype, EngineeringSettings};
use crate::core::units::{fmt_gib, fmt_given, gb, gib};
use crate::core::workload::Method;
use crate::history::jsonl::{Resolver, MAX_PEAK_BYTES};

/// `oom` / `host-oom` / `other` for `--failure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FailureArg {
    /// CUDA out of memory.
    Oom,
    /// Killed for host memory (the kernel's OOM killer, Kubernetes'
    /// `OOMKilled`, Slurm's `OUT_OF_MEMORY`): recorded as another error,
    /// never a GPU OOM, and it teaches the data loader (fewer workers, no
    /// pinned memory), as the controller and the Slurm Epilog record it.
    HostOom,
    /// Any other error.
    Other,
}

#[derive(Debug, clap::Args)]
pub struct RecordArgs {
    #[command(flatten)]
    pub workload: Box<WorkloadArgs>,
    #[command(flatten)]
    pub run: Box<RunArgs>,
}

/// The run's GPU, settings and result (boxed: clap's enum of commands stays small).
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// GPU model the run used, as nvidia-smi prints it (catalog names are
    /// canonicalised, e.g. `a100-80gb` → `NVIDIA A100-SXM4-80GB`).
    #[arg(long, env = "GPUFIT_GPU")]
    pub gpu: String,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Micro batch size per GPU the run used.
    #[arg(long)]
    pub micro_batch: u32,
    /// Gradient accumulation steps (default: global batch / (micro batch × GPUs), else 1).
    #[arg(long)]
    pub grad_accum: Option<u32>,
    /// Precision: fp32, bf16, fp16, bf16-mixed, fp16-mixed.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Activation checkpointing.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub checkpointing: OnOff,
    /// Activation offloading.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub offloading: OnOff,
    /// torch.compile.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub compile: OnOff,
    /// Whether the run succeeded (default: from --failure or --log, else true).
    #[arg(long, action = clap::ArgAction::Set)]
    pub success: Option<bool>,
    /// Why it failed: oom (GPU), host-oom (host memory) or other (implies --success false).
    #[arg(long, value_enum)]
    pub failure: Option<FailureArg>,
    /// Measured peak GPU memory in GB (10^9 bytes).
    #[arg(long, conflicts_with_all = ["peak_gib", "peak_bytes"])]
    pub peak_gb: Option<f64>,
    /// Measured peak GPU memory in GiB (2^30 bytes).
    #[arg(long, conflicts_with = "peak_bytes")]
    pub peak_gib: Option<f64>,
    /// Measured peak GPU memory in bytes.
    #[arg(long)]
    pub peak_bytes: Option<u64>,
    /// Throughput in samples per second.
    #[arg(long)]
    pub samples_per_sec: Option<f64>,
    /// Throughput in tokens per second.
    #[arg(long)]
    pub tokens_per_sec: Option<f64>,
    /// Wall time in seconds.
    #[arg(long)]
    pub duration_sec: Option<f64>,
    /// Training log to read the result from (flags given explicitly win).
    #[arg(long = "log", alias = "log-file", value_name = "FILE")]
    pub log_file: Option<PathBuf>,
    /// The peak gpufit predicted for these settings, in bytes (tracks prediction error).
    #[arg(long)]
    pub predicted_peak_bytes: Option<u64>,
    /// Cluster name.
    #[arg(long, env = "GPUFIT_CLUSTER")]
    pub cluster: Option<String>,
    /// Node name.
    #[arg(long)]
    pub node: Option<String>,
    /// Job id in its system (Slurm job id, namespace/name).
    #[arg(long)]
    pub job_id: Option<String>,
}

fn usage(msg: impl Into<String>) -> crate::Error {
    crate::Error::Usage(msg.into())
}

fn finite_non_negative(flag: &str, v: Option<f64>) -> crate::Result<Option<f64>> {
    match v {
        Some(x) if !x.is_finite() || x < 0.0 => Err(usage(format!(
            "{flag} must be a non-negative number (got {x})"
        ))),
        v => Ok(v),
    }
}

/// The similarity-key part of the record: canonical model id, method, and
/// the scientific fields, from the workload flags.
struct Key {
    model: String,
    method: Method,
    seq_len: u32,
    lora_rank: Option<u32>,
    gpus: u32,
    global_batch: Option<u32>,
}

fn key(w: &WorkloadArgs) -> crate::Result<Key> {
    match w.resolve() {
        Ok(wl) => Ok(Key {
            model: wl.model.name.clone(),
            method: wl.method,
            seq_len: wl.seq_len,
            lora_rank: wl.lora.as_ref().map(|l| l.rank),
            gpus: wl.gpus,
            global_batch: wl.global_batch,
        }),
        // A run on a model the catalog does not know is still worth keeping:
        // record it under the name as given (as JSONL import does). Other
        // errors (sequence beyond context, bad LoRA rank) are the user's to fix.
        Err(
            e @ (crate::Error::Catalog(crate::core::catalog::CatalogError::UnknownModel { .. })
            | crate::Error::Usage(_)),
        ) => {
            let Some(name) = w.model.as_deref().filter(|m| !m.trim().is_empty()) else {
                return Err(e);
            };
            let seq_len = w.seq_len.filter(|s| *s > 0).ok_or_else(|| {
                usage("--seq-len is required: give the training sequence length in tokens, e.g. --seq-len 2048")
            })?;
            if w.gpus == 0 {
                return Err(usage("--gpus must be at least 1"));
            }
            let (model, name_method) = Resolver::default().model(name);
            let method = match &w.method {
                Some(m) => m.parse::<Method>().map_err(usage)?,
                None => name_method,
            };
            tracing::warn!("recording under the model name as given ({e})");
            Ok(Key {
                model,
                method,
                seq_len,
                lora_rank: w.lora_rank,
                gpus: w.gpus,
                global_batch: w.global_batch,
            })
        }
        Err(e) => Err(e),
    }
}

#[derive(Serialize)]
struct Output<'a> {
    store: String,
    #[serde(flatten)]
    run: &'a RunRecord,
    notes: Vec<String>,
}

/// Runs `gpufit record`.
pub fn run(g: &Global, args: RecordArgs) -> crate::Result<ExitCode> {
    let k = key(&args.workload)?;
    let a = *args.run;
    let settings = settings_of(&a, &k)?;
    let parsed: Option<ParsedLog> = match &a.log_file {
        Some(p) => Some(super::parse_log::parse_file(p)?),
        None => None,
    };
    // What the flags and the log tell, and notes on how it was read.
    let mut notes = Vec::new();
    let result = result_of(&a, parsed.as_ref(), &mut notes)?;

    let gpu_model = canonical_gpu(&a.gpu);
    if gpu_model.is_empty() {
        return Err(usage(
            "--gpu must name the GPU model, e.g. --gpu 'NVIDIA A100-SXM4-80GB'",
        ));
    }
    if let Some(total) = parsed.as_ref().and_then(|p| p.gpu_total_bytes) {
        notes.push(format!(
            "the log states the GPU's total memory: {}",
            fmt_gib(total)
        ));
    }
    // The flags are what the person says ran; a log that states other
    // settings is worth a note, not a silent override.
    if let Some(stated) = parsed.as_ref().and_then(|p| p.stated.as_ref()) {
        // Only what the log states is compared (its num_workers never is).
        let told = crate::core::result_record::StatedSettings::from(&settings);
        for (name, flag, log) in told.differences(stated) {
            notes.push(format!(
                "the log states {name} {log}, the flags {flag}: recorded as the flags say"
            ));
        }
    }
    let origin = RunOrigin::new(RunSource::Cli, Utc::now())
        .cluster(a.cluster)
        .node(a.node)
        .job_id(a.job_id);
    let key = RunKey {
        model: k.model,
        method: k.method,
        gpu_model,
        seq_len: k.seq_len,
        lora_rank: k.lora_rank,
        gpus: k.gpus,
        global_batch: k.global_batch,
    };
    let run = RunRecord::new(origin, key, settings, result).with_prediction(a.predicted_peak_bytes);
    let store = a.store.open()?;
    let id = store.record(&run)?;
    // The stored id, for the report below.
    let run = RunRecord {
        id: Some(id),
        ..run
    };
    print_recorded(g, &store.url(), id, &run, notes)?;
    Ok(ExitCode::SUCCESS)
}

/// The settings the run used; the accumulation, when not given, is what
/// the global batch needs (1 when it does not divide).
fn settings_of(a: &RunArgs, k: &Key) -> crate::Result<EngineeringSettings> {
    if a.micro_batch == 0 {
        return Err(usage("--micro-batch must be at least 1"));
    }
    let dtype: Dtype = a.dtype.parse().map_err(usage)?;
    let grad_accum = match a.grad_accum {
        Some(0) => return Err(usage("--grad-accum must be at least 1")),
        Some(n) => n,
        None => match k.global_batch {
            Some(gb) if gb % (a.micro_batch * k.gpus) == 0 => gb / (a.micro_batch * k.gpus),
            _ => 1,
        },
    };
    Ok(EngineeringSettings {
        micro_batch_size: a.micro_batch,
        gradient_accumulation_steps: grad_accum,
        dtype,
        activation_checkpointing: a.checkpointing.as_bool(),
        activation_offloading: a.offloading.as_bool(),
        compile: a.compile.as_bool(),
        ..EngineeringSettings::default()
    })
}

/// How the run went: each flag given wins over what the log states.
fn result_of(
    a: &RunArgs,
    parsed: Option<&ParsedLog>,
    notes: &mut Vec<String>,
) -> crate::Result<RunResult> {
    // (bytes, the figure as given): the message quotes what was typed, not
    // a conversion that saturated
    let peak_flag = match (a.peak_gb, a.peak_gib, a.peak_bytes) {
        (Some(x), _, _) => finite_non_negative("--peak-gb", Some(x))?
            .map(|x| (gb(x), format!("{} GB", fmt_given(x)))),
        (_, Some(x), _) => finite_non_negative("--peak-gib", Some(x))?
            .map(|x| (gib(x), format!("{} GiB", fmt_given(x)))),
        (_, _, b) => b.map(|b| (b, format!("{b} bytes"))),
    };
    if let Some((_, given)) = peak_flag.as_ref().filter(|(b, _)| *b > MAX_PEAK_BYTES) {
        return Err(usage(format!(
            "the peak memory given ({given}) is above 10000 GB: check the unit (--peak-gb, --peak-gib or --peak-bytes)"
        )));
    }
    let peak_flag = peak_flag.map(|(b, _)| b);
    let samples = finite_non_negative("--samples-per-sec", a.samples_per_sec)?;
    let tokens = finite_non_negative("--tokens-per-sec", a.tokens_per_sec)?;
    let duration = finite_non_negative("--duration-sec", a.duration_sec)?;

    let log_result = parsed.map(|p| p.to_run_result(true));
    if let Some(p) = parsed {
        if p.success().is_none() && a.success.is_none() && a.failure.is_none() {
            notes.push("the log has no end-of-training line; recorded as a success because its steps ran (pass --success false to override)".into());
        }
    }
    let (success, failure_reason) = success_of(a, log_result.as_ref())?;
    let host_oom = a.failure == Some(FailureArg::HostOom);
    // Lightning reports iterations (micro batches) per second, not samples.
    let samples_from_steps = parsed
        .and_then(|p| p.steps_per_sec)
        .filter(|_| parsed.is_some_and(|p| p.samples_per_sec.is_none()))
        .map(|s| s * a.micro_batch as f64);
    if samples.is_none() && samples_from_steps.is_some() {
        notes.push("samples/s = the log's iterations/s × micro batch".into());
    }
    Ok(RunResult {
        outcome: RunOutcome::of(
            success,
            failure_reason == Some(FailureReason::Oom),
            host_oom,
        ),
        peak_memory_bytes: peak_flag.or(log_result.as_ref().and_then(|r| r.peak_memory_bytes)),
        samples_per_sec: samples
            .or(log_result.as_ref().and_then(|r| r.samples_per_sec))
            .or(samples_from_steps),
        tokens_per_sec: tokens.or(log_result.as_ref().and_then(|r| r.tokens_per_sec)),
        duration_sec: duration.or(log_result.as_ref().and_then(|r| r.duration_sec)),
    })
}

/// Whether the run succeeded and, if not, why: `--success`/`--failure`,
/// else the log, else a success.
fn success_of(
    a: &RunArgs,
    log_result: Option<&RunResult>,
) -> crate::Result<(bool, Option<FailureReason>)> {
    let failure = match a.failure {
        Some(FailureArg::Oom) => Some(FailureReason::Oom),
        Some(FailureArg::HostOom | FailureArg::Other) => Some(FailureReason::OtherError),
        None => None,
    };
    let success = match (a.success, failure, log_result) {
        (Some(true), Some(_), _) => {
            return Err(usage("--success true contradicts --failure: leave one out"))
        }
        (Some(s), _, _) => s,
        (None, Some(_), _) => false,
        (None, None, Some(r)) => r.success(),
        (None, None, None) => true,
    };
    let failure_reason = if success {
        None
    } else {
        failure
            .or(log_result.and_then(|r| r.failure_reason()))
            .or(Some(FailureReason::OtherError))
    };
    Ok((success, failure_reason))
}

/// The recorded run, as JSON or a line (and the notes).
fn print_recorded(
    g: &Global,
    store_url: &str,
    id: i64,
    run: &RunRecord,
    notes: Vec<String>,
) -> crate::Result<()> {
    match g.output {
        OutputFormat::Json => super::print_json(&Output {
            store: store_url.to_string(),
            run,
            notes,
        })?,
        OutputFormat::Table => {
            let r = &run.result;
            let outcome = if r.success() {
                "success".to_string()
            } else if run.is_oom() {
                "CUDA out of memory".to_string()
            } else {
                "failed".to_string()
            };
            println!(
                "recorded run #{id} in {store_url}: {} ({}) on {}, seq {}, micro batch {} × accum {}, {}, checkpointing {}, compile {} → {outcome}{}",
                run.model,
                run.method,
                run.gpu_model,
                run.seq_len,
                run.settings.micro_batch_size,
                run.settings.gradient_accumulation_steps,
                run.settings.dtype,
                if run.settings.activation_checkpointing { "on" } else { "off" },
                if run.settings.compile { "on" } else { "off" },
                r.peak_memory_bytes
                    .map(|b| format!(", peak {}", fmt_gib(b)))
                    .unwrap_or_default(),
            );
            for n in notes {
                println!("  note: {n}");
            }
        }
    }
    Ok(())
}
