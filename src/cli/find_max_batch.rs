//! `gpufit find-max-batch`: the expensive path that really runs training
//! steps. Runs a command template per trial, detects CUDA out-of-memory from
//! exit status and output, binary-searches the largest micro batch starting
//! from the advisor's prediction, and records every trial in the history.

use crate::core::run::RunOutcome;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::suggest::AdviceArgs;
use super::{print_json, Global, OutputFormat};
use crate::core::advisor::{AdvisorError, Alternative, Strategy};
use crate::core::run::{RunKey, RunOrigin, RunRecord, RunResult, RunSource};
use crate::core::settings::{
    Dtype, EngineeringSettings, SettingVar, ACTIVATION_CHECKPOINTING, COMPILE, DTYPE,
    MICRO_BATCH_SIZE,
};
use crate::core::units::fmt_gib;

#[derive(Debug, clap::Args)]
pub struct FindMaxBatchArgs {
    #[command(flatten)]
    pub advice: AdviceArgs,
    /// Command run per trial through `sh -c`. Placeholders: `{micro_batch_size}`
    /// (alias `{batch}`), `{steps}`, `{dtype}`, `{activation_checkpointing}`,
    /// `{compile}` (`true`/`false`). The same values are in the environment as
    /// GPUFIT_MICRO_BATCH_SIZE, GPUFIT_STEPS, GPUFIT_DTYPE,
    /// GPUFIT_ACTIVATION_CHECKPOINTING, GPUFIT_COMPILE, GPUFIT_TRIAL.
    /// Checkpointing and compile are recorded as set only when the command
    /// names them (placeholder or variable) or with --settings-from-env;
    /// otherwise as off, the setting the trial really ran with.
    #[arg(long)]
    pub cmd: String,
    /// The command's script reads GPUFIT_ACTIVATION_CHECKPOINTING and
    /// GPUFIT_COMPILE from its environment (so trials are recorded with them).
    #[arg(long)]
    pub settings_from_env: bool,
    /// Training steps each trial must complete.
    #[arg(long, default_value_t = 10)]
    pub steps: u32,
    /// Time limit per trial (e.g. `90s`, `10m`); a trial over it is killed.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// First micro batch to try (default: the advisor's aggressive prediction).
    #[arg(long)]
    pub start: Option<u32>,
    /// Largest micro batch to consider (default: the per-GPU batch when
    /// --global-batch is given, else 1024).
    #[arg(long)]
    pub max_batch: Option<u32>,
    /// Most trials to run.
    #[arg(long, default_value_t = 12)]
    pub max_trials: u32,
    /// Do not record the trials in the history.
    #[arg(long)]
    pub no_record: bool,
}

/// How one trial ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TrialOutcome {
    Success,
    Oom,
    Failed,
    TimedOut,
}

/// One trial.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    pub micro_batch_size: u32,
    pub outcome: TrialOutcome,
    pub exit_code: Option<i32>,
    pub duration_sec: f64,
    pub peak_memory_bytes: Option<u64>,
    /// Training throughput the output reports (tokens/s; samples/s and
    /// Lightning's iterations/s converted with the trial's micro batch and
    /// sequence length), so the advisor learns speed from the search too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    /// Last lines of output (kept for failures).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub output_tail: String,
}

/// The command's result.
#[derive(Debug, Clone, Serialize)]
pub struct SearchResult {
    /// Largest micro batch that completed the steps.
    pub max_micro_batch: u32,
    /// Smallest micro batch that ran out of memory, if one was seen.
    pub smallest_oom: Option<u32>,
    /// The advisor's prediction the search started from.
    pub predicted: u32,
    /// Largest micro batch ≤ max that divides the per-GPU batch (when
    /// --global-batch was given) and the accumulation it needs.
    pub for_global_batch: Option<(u32, u32)>,
    pub settings: EngineeringSettings,
    pub trials: Vec<Trial>,
    pub recorded: usize,
}

/// Search state: everything below `lo` + 1 works, `hi` and above ran out of memory.
#[derive(Debug, Clone, Copy)]
struct Bracket {
    /// Largest success (0: none yet).
    lo: u32,
    /// Smallest OOM (cap + 1: none yet).
    hi: u32,
    cap: u32,
}

impl Bracket {
    /// The next micro batch to try, or None when the answer is known.
    /// Grows ×2 until the first OOM, halves until the first success, then bisects.
    fn next(&self) -> Option<u32> {
        if self.hi <= self.lo + 1 {
            return None;
        }
        let n = if self.lo == 0 {
            (self.hi / 2).max(1)
        } else if self.hi > self.cap {
            (self.lo.saturating_mul(2)).min(self.cap)
        } else {
            self.lo + (self.hi - self.lo) / 2
        };
        (n > self.lo && n < self.hi).then_some(n)
    }
}

pub fn run(g: &Global, args: FindMaxBatchArgs) -> crate::Result<ExitCode> {
    check_args(&args)?;
    let r = args.advice.resolve()?;
    let start = SearchStart::new(&args, &r)?;
    let store = history_store(&args)?;
    let searched = search(&args, &r, &start, store.as_deref())?;
    let b = searched.bracket;
    if b.lo == 0 {
        return Err(nothing_fits(&r, &start, b.hi).into());
    }
    let per_gpu = start.per_gpu;
    let for_global_batch = per_gpu.and_then(|per| {
        (1..=b.lo.min(per))
            .rev()
            .find(|d| per.is_multiple_of(*d))
            .map(|d| (d, per / d))
    });
    let result = SearchResult {
        max_micro_batch: b.lo,
        smallest_oom: (b.hi <= start.cap).then_some(b.hi),
        predicted: start.predicted,
        for_global_batch,
        settings: EngineeringSettings {
            micro_batch_size: b.lo,
            ..start.settings
        },
        trials: searched.trials,
        recorded: searched.recorded,
    };
    print_result(g, &args, &r.workload, &result)?;
    Ok(ExitCode::SUCCESS)
}

/// Refuses arguments that cannot make a search.
fn check_args(args: &FindMaxBatchArgs) -> crate::Result<()> {
    if args.cmd.trim().is_empty() {
        return Err(crate::Error::Usage(
            "--cmd is empty: give the training command, e.g. --cmd 'python train.py --batch-size {micro_batch_size}'".into(),
        ));
    }
    if args.steps == 0 || args.max_trials == 0 {
        return Err(crate::Error::Usage(
            "--steps and --max-trials must be at least 1".into(),
        ));
    }
    Ok(())
}

/// Where the search starts and what bounds it.
struct SearchStart {
    /// The advisor's aggressive suggestion (None: it says nothing fits).
    suggestion: Option<crate::core::advisor::Suggestion>,
    /// The settings every trial runs with (the micro batch aside).
    settings: EngineeringSettings,
    /// The per-GPU batch `--global-batch` asks for.
    per_gpu: Option<u32>,
    /// Largest micro batch tried.
    cap: u32,
    /// The advisor's micro batch (1 without a suggestion).
    predicted: u32,
    /// The first micro batch tried.
    first: u32,
}

impl SearchStart {
    fn new(args: &FindMaxBatchArgs, r: &super::suggest::Resolved) -> crate::Result<Self> {
        let w = &r.workload;
        // Start from the aggressive prediction: the search is for the maximum.
        let suggestion = match r.suggest(Strategy::Aggressive) {
            Ok(s) => Some(s),
            Err(crate::Error::Advisor(AdvisorError::DoesNotFit { .. })) => None,
            Err(e) => return Err(e),
        };
        let settings = suggestion
            .as_ref()
            .map(|s| s.settings.clone())
            .unwrap_or_else(|| EngineeringSettings {
                dtype: r.pins.dtype.unwrap_or(Dtype::Bf16),
                activation_checkpointing: r.pins.activation_checkpointing.unwrap_or(true),
                ..EngineeringSettings::default()
            });
        let settings = told_settings(&args.cmd, args.settings_from_env, settings);
        let per_gpu = w.global_batch.map(|gb| gb / w.gpus.max(1));
        let cap = args
            .max_batch
            .or(per_gpu)
            .unwrap_or(crate::core::advisor::MAX_MICRO_BATCH)
            .clamp(1, 1 << 20);
        let predicted = suggestion
            .as_ref()
            .map(|s| s.settings.micro_batch_size)
            .unwrap_or(1);
        let first = args.start.unwrap_or(predicted).clamp(1, cap);
        Ok(SearchStart {
            suggestion,
            settings,
            per_gpu,
            cap,
            predicted,
            first,
        })
    }
}

/// The history the trials are recorded in (None with `--no-record`).
fn history_store(
    args: &FindMaxBatchArgs,
) -> crate::Result<Option<Box<dyn crate::history::HistoryStore>>> {
    if args.no_record {
        return Ok(None);
    }
    Ok(Some(args.advice.store.open()?))
}

/// What the trials found.
struct Searched {
    bracket: Bracket,
    trials: Vec<Trial>,
    recorded: usize,
}

/// Runs trials until the bracket closes or `--max-trials`; a trial that
/// times out or fails for another reason than memory ends the search.
fn search(
    args: &FindMaxBatchArgs,
    r: &super::suggest::Resolved,
    start: &SearchStart,
    store: Option<&dyn crate::history::HistoryStore>,
) -> crate::Result<Searched> {
    let pb = progress_bar(args.max_trials);
    let mut b = Bracket {
        lo: 0,
        hi: start.cap + 1,
        cap: start.cap,
    };
    let mut trials = Vec::new();
    let mut recorded = 0usize;
    let mut next = Some(start.first);
    interrupt::watch();
    while let Some(m) = next {
        if let Err(e) = interrupt::check() {
            pb.finish_and_clear();
            return Err(e);
        }
        if trials.len() as u32 >= args.max_trials {
            say(
                &pb,
                format!("stopping after {} trials (--max-trials)", trials.len()),
            );
            break;
        }
        pb.set_message(format!("micro batch {m} running…"));
        let t = match run_trial(args, &start.settings, m, trials.len() as u32 + 1) {
            Ok(t) => t,
            Err(e) => {
                // Leave the terminal clean (the bar hides the cursor).
                pb.finish_and_clear();
                return Err(e);
            }
        };
        pb.inc(1);
        say(&pb, trial_line(trials.len() + 1, m, &t));
        if let Some(store) = store {
            let rec = record_for(&r.workload, &r.gpu.name, &start.settings, &t, r, m);
            store.record(&rec)?;
            recorded += 1;
        }
        let judged = narrow(&mut b, args, m, &t);
        trials.push(t);
        if let Err(e) = judged {
            pb.finish_and_clear();
            return Err(e);
        }
        next = b.next();
    }
    pb.finish_and_clear();
    Ok(Searched {
        bracket: b,
        trials,
        recorded,
    })
}

/// Narrows the bracket with trial `t` at micro batch `m`; Err when the
/// trial cannot be judged (timed out, or failed without an OOM).
fn narrow(b: &mut Bracket, args: &FindMaxBatchArgs, m: u32, t: &Trial) -> crate::Result<()> {
    match t.outcome {
        TrialOutcome::Success => b.lo = b.lo.max(m),
        TrialOutcome::Oom => b.hi = b.hi.min(m),
        TrialOutcome::TimedOut => {
            return Err(crate::Error::Usage(format!(
                "the trial at micro batch {m} did not finish {} steps within {}: raise --timeout or lower --steps",
                args.steps,
                humantime::format_duration(args.timeout)
            )));
        }
        TrialOutcome::Failed => {
            return Err(crate::Error::Usage(format!(
                "the trial at micro batch {m} failed (exit {}) without a CUDA out-of-memory error, so the search cannot judge it: fix the command and rerun{}",
                t.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "by signal".into()),
                t_tail(t)
            )));
        }
    }
    Ok(())
}

fn progress_bar(max_trials: u32) -> ProgressBar {
    let pb = ProgressBar::new(max_trials as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} trial {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// A line above the bar (on stderr when the bar is hidden, e.g. no terminal).
fn say(pb: &ProgressBar, line: String) {
    if pb.is_hidden() {
        eprintln!("{line}");
    } else {
        pb.println(line);
    }
}

/// `trial 3: micro batch 16: ok, peak 71.2 GiB in 42.0s`.
fn trial_line(n: usize, m: u32, t: &Trial) -> String {
    format!(
        "trial {n}: micro batch {m}: {}{} in {:.1}s",
        match t.outcome {
            TrialOutcome::Success => "ok",
            TrialOutcome::Oom => "out of memory",
            TrialOutcome::Failed => "failed",
            TrialOutcome::TimedOut => "timed out",
        },
        t.peak_memory_bytes
            .map(|p| format!(", peak {}", fmt_gib(p)))
            .unwrap_or_default(),
        t.duration_sec
    )
}

/// Even the smallest micro batch tried ran out of memory.
fn nothing_fits(
    r: &super::suggest::Resolved,
    start: &SearchStart,
    smallest_oom: u32,
) -> AdvisorError {
    AdvisorError::DoesNotFit {
        model: r.workload.model.name.clone(),
        gpu: r.gpu.name.clone(),
        needed_gib: start
            .suggestion
            .as_ref()
            .map(|s| crate::core::units::to_gib(s.predicted_peak_bytes))
            .unwrap_or(0.0),
        capacity_gib: crate::core::units::to_gib(r.gpu.memory_bytes),
        alternatives: vec![Alternative::Note(format!(
            "even micro batch {} ran out of memory with {}: `gpufit suggest` lists what would fit (checkpointing, offloading, an 8-bit optimizer, QLoRA, ZeRO-3 over more GPUs)",
            smallest_oom, start.settings.dtype
        ))],
    }
}

fn print_result(
    g: &Global,
    args: &FindMaxBatchArgs,
    w: &crate::core::workload::Workload,
    result: &SearchResult,
) -> crate::Result<()> {
    match g.output {
        OutputFormat::Json => print_json(result)?,
        OutputFormat::Table => {
            println!(
                "Largest micro batch that completed {} steps: {} ({} trials, started from the advisor's {}{}).",
                args.steps,
                result.max_micro_batch,
                result.trials.len(),
                result.predicted,
                result
                    .smallest_oom
                    .map(|o| format!("; {o} ran out of memory"))
                    .unwrap_or_default()
            );
            if let Some((m, a)) = result.for_global_batch {
                println!(
                    "For the global batch {}: micro batch {m} × gradient accumulation {a} × {} GPU(s).",
                    w.global_batch.unwrap_or(0),
                    w.gpus
                );
            }
            println!("Recorded {} trial(s) in the history.", result.recorded);
        }
    }
    Ok(())
}

/// The settings a trial is really run with: checkpointing and compile as
/// the strategy wants them only when the command is told (a placeholder or
/// the variable in `cmd`, or `--settings-from-env`); otherwise the
/// training script's own default, off, which is what gets recorded.
fn told_settings(cmd: &str, from_env: bool, wish: EngineeringSettings) -> EngineeringSettings {
    let told =
        |v: &SettingVar| from_env || cmd.contains(&v.placeholder_text()) || cmd.contains(v.env);
    let default = EngineeringSettings::default();
    let mut s = wish;
    if !told(&ACTIVATION_CHECKPOINTING) {
        if s.activation_checkpointing {
            tracing::warn!("--cmd has no {{activation_checkpointing}} placeholder (nor --settings-from-env): trials run, and are recorded, with checkpointing off");
        }
        s.activation_checkpointing = default.activation_checkpointing;
    }
    if !told(&COMPILE) {
        if s.compile {
            tracing::warn!("--cmd has no {{compile}} placeholder (nor --settings-from-env): trials run, and are recorded, with compile off");
        }
        s.compile = default.compile;
    }
    s
}

/// SIGINT / SIGTERM during the search: the running trial's process group
/// (its own, so the terminal's Ctrl-C does not reach it) is killed before
/// gpufit exits, so no training process is left holding GPU memory.
mod interrupt {
    use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
    use std::sync::Once;
    use std::time::Duration;

    /// The signal received (0: none).
    static SIGNAL: AtomicI32 = AtomicI32::new(0);
    /// Process group of the running trial (0: none).
    static TRIAL_GROUP: AtomicU32 = AtomicU32::new(0);

    /// Starts the signal watcher once (a thread with its own small runtime).
    pub fn watch() {
        static START: Once = Once::new();
        START.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("signals".into())
                .spawn(|| {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot watch for signals");
                            return;
                        }
                    };
                    let signo = rt.block_on(async {
                        use tokio::signal::unix::{signal, SignalKind};
                        let (Ok(mut int), Ok(mut term)) = (
                            signal(SignalKind::interrupt()),
                            signal(SignalKind::terminate()),
                        ) else {
                            tracing::warn!("cannot watch for SIGINT/SIGTERM");
                            return None;
                        };
                        tokio::select! {
                            _ = int.recv() => Some(2),
                            _ = term.recv() => Some(15),
                        }
                    });
                    let Some(signo) = signo else { return };
                    SIGNAL.store(signo, Ordering::SeqCst);
                    kill_trial();
                    // The main thread notices within its 20 ms poll; should
                    // it be stuck elsewhere, exit anyway.
                    std::thread::sleep(Duration::from_secs(5));
                    kill_trial();
                    std::process::exit(128 + signo);
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot watch for signals");
            }
        });
    }

    fn kill_trial() {
        let g = TRIAL_GROUP.load(Ordering::SeqCst);
        if g > 0 {
            super::kill_group(g);
        }
    }

    /// Records the running trial's process group (0 when it ended). A trial
    /// started after the signal is killed at once.
    pub fn set_trial(group: u32) {
        TRIAL_GROUP.store(group, Ordering::SeqCst);
        if group > 0 && SIGNAL.load(Ordering::SeqCst) != 0 {
            super::kill_group(group);
        }
    }

    /// Err once a signal was received.
    pub fn check() -> crate::Result<()> {
        match SIGNAL.load(Ordering::SeqCst) {
            0 => Ok(()),
            signo => {
                kill_trial();
                Err(crate::Error::Interrupted(signo))
            }
        }
    }
}

fn t_tail(t: &Trial) -> String {
    if t.output_tail.is_empty() {
        String::new()
    } else {
        format!("; last output:\n{}", t.output_tail)
    }
}

fn record_for(
    w: &crate::core::workload::Workload,
    gpu: &str,
    settings: &EngineeringSettings,
    t: &Trial,
    r: &super::suggest::Resolved,
    m: u32,
) -> RunRecord {
    let s = EngineeringSettings {
        micro_batch_size: m,
        ..settings.clone()
    };
    let predicted = crate::core::memory::estimate(&r.workload, &s)
        .ok()
        .map(|e| e.peak_bytes)
        .filter(|&p| p > 0);
    RunRecord::new(
        RunOrigin::new(RunSource::FindMaxBatch, Utc::now()).node(hostname()),
        RunKey::of(w, gpu),
        s,
        RunResult {
            outcome: RunOutcome::of(
                t.outcome == TrialOutcome::Success,
                t.outcome == TrialOutcome::Oom,
                false,
            ),
            peak_memory_bytes: t.peak_memory_bytes,
            samples_per_sec: t.tokens_per_sec.map(|x| x / w.seq_len.max(1) as f64),
            tokens_per_sec: t.tokens_per_sec,
            duration_sec: Some(t.duration_sec),
        },
    )
    .with_prediction(predicted)
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Output kept per trial for parsing (the tail; OOM is detected while streaming).
const TAIL_BYTES: usize = 256 * 1024;

#[derive(Default)]
struct Captured {
    tail: Vec<u8>,
    oom: bool,
}

fn pump(src: impl Read, into: Arc<Mutex<Captured>>) {
    let mut r = BufReader::new(src);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                let oom = crate::core::logs::oom::is_oom_line(&text);
                if let Ok(mut c) = into.lock() {
                    c.oom |= oom;
                    c.tail.extend_from_slice(&line);
                    if c.tail.len() > TAIL_BYTES {
                        let cut = c.tail.len() - TAIL_BYTES;
                        c.tail.drain(..cut);
                    }
                }
            }
        }
    }
}

/// The peak memory the training output reports (the shared log parsers:
/// torchtune, HF, Lightning and plain `Peak memory: 45.2 GB` lines).
fn peak_bytes(text: &str) -> Option<u64> {
    crate::core::logs::parse_str(text)
        .ok()
        .and_then(|p| p.peak_memory_bytes())
}

/// Tokens/s the training output reports: tokens/s as printed, else
/// samples/s × sequence length, else (Lightning) iterations/s × micro
/// batch × sequence length.
fn tokens_per_sec(text: &str, m: u32, seq_len: u32) -> Option<f64> {
    let p = crate::core::logs::parse_str(text).ok()?;
    let seq = seq_len as f64;
    p.tokens_per_sec
        .or(p.samples_per_sec.map(|s| s * seq))
        .or(p.steps_per_sec.map(|s| s * m as f64 * seq))
        .filter(|t| t.is_finite() && *t > 0.0)
}

/// Runs trial number `trial` at micro batch `m` and judges it.
fn run_trial(
    args: &FindMaxBatchArgs,
    settings: &EngineeringSettings,
    m: u32,
    trial: u32,
) -> crate::Result<Trial> {
    let (cmd, mut c) = trial_command(args, settings, m, trial);
    let started = Instant::now();
    let mut child = c.spawn().map_err(|e| crate::Error::Io {
        context: format!("cannot start `sh -c {cmd}`"),
        source: e,
    })?;
    interrupt::set_trial(child.id());
    let cap = Arc::new(Mutex::new(Captured::default()));
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        let c2 = cap.clone();
        pumps.push(std::thread::spawn(move || pump(out, c2)));
    }
    if let Some(err) = child.stderr.take() {
        let c2 = cap.clone();
        pumps.push(std::thread::spawn(move || pump(err, c2)));
    }
    let (status, timed_out) = wait_for_trial(&mut child, started, args.timeout, trial)?;
    interrupt::set_trial(0);
    // A trial ended by the signal's kill is no result.
    interrupt::check()?;
    for p in pumps {
        let _ = p.join();
    }
    let duration_sec = started.elapsed().as_secs_f64();
    let captured = cap
        .lock()
        .map(|c| (c.oom, c.tail.clone()))
        .unwrap_or_default();
    let (oom, tail) = captured;
    let text = String::from_utf8_lossy(&tail);
    let exit_code = status.and_then(|s| s.code());
    let ok = status.is_some_and(|s| s.success());
    let outcome = if timed_out {
        TrialOutcome::TimedOut
    } else if oom {
        // PyTorch's message decides, whatever the exit status (scripts that
        // catch the exception often still exit 0).
        TrialOutcome::Oom
    } else if ok {
        TrialOutcome::Success
    } else {
        TrialOutcome::Failed
    };
    Ok(trial_result(
        args,
        m,
        outcome,
        exit_code,
        duration_sec,
        &text,
    ))
}

/// The settings a trial passes to its command (the core's table): what the
/// search varies and records. Accumulation and the data loader stay the
/// script's own: a trial measures one micro batch's memory.
const TRIAL_VARS: [SettingVar; 4] = [MICRO_BATCH_SIZE, DTYPE, ACTIVATION_CHECKPOINTING, COMPILE];

/// The trial's `sh -c` command (the placeholders filled, the settings also
/// in `GPUFIT_*` variables), in its own process group; answers its text too.
fn trial_command(
    args: &FindMaxBatchArgs,
    settings: &EngineeringSettings,
    m: u32,
    trial: u32,
) -> (String, Command) {
    let trial_settings = EngineeringSettings {
        micro_batch_size: m,
        ..settings.clone()
    };
    let mut cmd = args
        .cmd
        .replace("{batch}", &m.to_string())
        .replace("{steps}", &args.steps.to_string());
    for v in &TRIAL_VARS {
        cmd = cmd.replace(&v.placeholder_text(), &(v.render)(&trial_settings));
    }
    let mut c = Command::new("sh");
    c.arg("-c").arg(&cmd);
    for v in &TRIAL_VARS {
        c.env(v.env, (v.render)(&trial_settings));
    }
    c.env("GPUFIT_STEPS", args.steps.to_string())
        .env("GPUFIT_TRIAL", trial.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // Own process group, so a timeout kills the whole training tree.
        c.process_group(0);
    }
    (cmd, c)
}

/// Waits for the trial, polling for a signal; past `timeout` kills its
/// process group. Answers its status and whether it timed out.
fn wait_for_trial(
    child: &mut std::process::Child,
    started: Instant,
    timeout: Duration,
    trial: u32,
) -> crate::Result<(Option<std::process::ExitStatus>, bool)> {
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Ok((Some(st), false)),
            Ok(None) => {}
            Err(e) => {
                return Err(crate::Error::Io {
                    context: format!("waiting for trial {trial}"),
                    source: e,
                })
            }
        }
        if let Err(e) = interrupt::check() {
            let _ = child.kill();
            let _ = child.wait();
            interrupt::set_trial(0);
            return Err(e);
        }
        if started.elapsed() >= timeout {
            kill_group(child.id());
            let _ = child.kill();
            return Ok((child.wait().ok(), true));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The trial as reported: peak and throughput from a success's output,
/// the last lines of anything else's.
fn trial_result(
    args: &FindMaxBatchArgs,
    m: u32,
    outcome: TrialOutcome,
    exit_code: Option<i32>,
    duration_sec: f64,
    text: &str,
) -> Trial {
    Trial {
        micro_batch_size: m,
        outcome,
        exit_code,
        duration_sec,
        peak_memory_bytes: if outcome == TrialOutcome::Success {
            peak_bytes(text)
        } else {
            None
        },
        tokens_per_sec: if outcome == TrialOutcome::Success {
            tokens_per_sec(text, m, args.advice.workload.seq_len.unwrap_or(0))
        } else {
            None
        },
        output_tail: if outcome == TrialOutcome::Success {
            String::new()
        } else {
            let last: Vec<&str> = text.lines().rev().take(8).collect();
            last.into_iter().rev().collect::<Vec<_>>().join("\n")
        },
    }
}

#[cfg(unix)]
fn kill_group(pid: u32) {
    // killpg(2) through nix's safe wrapper. Not `/bin/kill -KILL -PGID`:
    // procps-ng 4.0.2 (Debian 12) misparses some negative ids and signals
    // every process it may (as `kill -1` would) — that took down test runners.
    use nix::sys::signal::{killpg, Signal};
    use nix::unistd::Pid;
    let Ok(raw) = i32::try_from(pid) else { return };
    if raw > 1 {
        let _ = killpg(Pid::from_raw(raw), Signal::SIGKILL);
    }
}

#[cfg(not(unix))]
fn kill_group(_pid: u32) {}

#[cfg(test)]
mod tests {
    use super::*;

    fn search(start: u32, cap: u32, max_ok: u32) -> (u32, Vec<u32>) {
        let mut b = Bracket {
            lo: 0,
            hi: cap + 1,
            cap,
        };
        let mut tried = vec![];
        let mut next = Some(start);
        while let Some(m) = next {
            tried.push(m);
            if m <= max_ok {
                b.lo = m
            } else {
                b.hi = m
            }
            next = b.next();
        }
        (b.lo, tried)
    }

    #[test]
    fn the_search_finds_the_largest_working_batch_from_any_start() {
        for max_ok in [1, 2, 7, 20, 33, 64] {
            for start in [1, 5, 20, 21, 100] {
                let (found, tried) = search(start, 128, max_ok);
                assert_eq!(found, max_ok, "start {start} max_ok {max_ok}: {tried:?}");
                assert_eq!(tried[0], start);
                assert!(tried.len() <= 16, "{tried:?}");
            }
        }
    }

    #[test]
    fn a_good_prediction_needs_few_trials() {
        let (found, tried) = search(20, 1024, 20);
        assert_eq!(found, 20);
        // 20 ok, 40 oom, then bisect 20..40: 5 more.
        assert!(tried.len() <= 7, "{tried:?}");
    }

    #[test]
    fn pytorch_oom_messages_are_recognised() {
        use crate::core::logs::oom::is_oom_line;
        assert!(is_oom_line("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB"));
        assert!(!is_oom_line("step 10 loss 1.23"));
    }

    #[test]
    fn printed_peaks_are_read_in_their_units() {
        assert_eq!(peak_bytes("Peak memory: 45.2 GB"), Some(45_200_000_000));
        assert_eq!(peak_bytes("no numbers here"), None);
    }

    #[test]
    fn the_search_stops_at_the_cap() {
        let (found, tried) = search(8, 16, 1000);
        assert_eq!(found, 16);
        assert_eq!(tried, vec![8, 16]);
    }
}
