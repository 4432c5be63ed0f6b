//! The thin executor of the Slurm hooks: reads the environment, the site
//! config, the job comment (`scontrol`), the sidecar and the controller (or a
//! local history), and performs what [`super::plan`] decides.
//!
//! Every hook fails open: a Slurm hook that exits non-zero fails the job
//! (TaskProlog) or drains the node (Prolog/Epilog), so these functions never
//! return an error to the caller; they log why to stderr (which slurmd
//! keeps in its log) and do nothing.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chrono::Utc;

use super::plan::{
    self, Backend, Env, HookSettings, JobRequest, SavedDecision, SiteConfig, TaskPlan,
};
use super::SlurmError;
use crate::core::advisor::{StrategyTargets, Suggestion};
use crate::core::catalog::{lookup_gpu, GpuSpec};
use crate::core::run::{NodeReports, RunRecord};
use crate::wire::api::{ErrorBody, GpuRef, SuggestRequest};
use crate::wire::sidecar::GpusResponse;

/// How long the Epilog waits for each service (it runs after the job, so it
/// may take a little longer than the TaskProlog, but never long enough to
/// hold the node).
const EPILOG_HTTP_TIMEOUT: Duration = Duration::from_secs(3);
/// Only the end of a job's output is searched for a CUDA OOM: that is where
/// the traceback is, and output files can be huge.
const OUTPUT_TAIL_BYTES: u64 = 4 * 1024 * 1024;

/// The process environment, with `SLURMD_NODENAME` filled in from the
/// host name when slurmd did not set it (a hook run by hand): the node's
/// name keys its state file, its report of a multi-node job and `{node}`
/// in the sidecar URL.
pub fn read_env() -> Env {
    let mut env: Env = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    if env
        .get(plan::NODE_NAME_VAR)
        .is_none_or(|n| n.trim().is_empty())
    {
        if let Some(host) = host_name() {
            env.insert(plan::NODE_NAME_VAR.to_string(), host);
        }
    }
    env
}

/// The kernel's host name (what `hostname` prints), if readable.
fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

/// Reads the site config (`GPUFIT_SLURM_CONFIG`, else `/etc/gpufit/slurm.toml`
/// when it exists) and merges it with the environment.
pub fn load_settings(env: &Env) -> Result<HookSettings, SlurmError> {
    let (path, explicit) = match env.get("GPUFIT_SLURM_CONFIG").filter(|p| !p.is_empty()) {
        Some(p) => (PathBuf::from(p), true),
        None => (PathBuf::from(plan::DEFAULT_CONFIG_PATH), false),
    };
    let file = match std::fs::read_to_string(&path) {
        Ok(text) => SiteConfig::parse(&text, &path)?,
        Err(e) if !explicit && e.kind() == std::io::ErrorKind::NotFound => SiteConfig::default(),
        Err(e) => {
            return Err(SlurmError::Config {
                path,
                message: format!("cannot read it: {e}"),
            })
        }
    };
    HookSettings::resolve(env, &file, &crate::history::default_url())
}

/// Logs why a hook did nothing: to stderr (kept by slurmd for Prolog and
/// Epilog) and to syslog (slurmd discards a TaskProlog's stderr).
fn log_skip(hook: &str, job: Option<&String>, why: &dyn std::fmt::Display) {
    let job = job.map(String::as_str).unwrap_or("?");
    let msg = format!("gpufit {hook}: job {job}: {why}");
    tracing::warn!("{msg}");
    syslog(&msg);
}

/// Best effort, never blocking: one datagram to the local syslog socket
/// (RFC 3164 framing, facility user, severity warning).
fn syslog(msg: &str) {
    use std::os::unix::net::UnixDatagram;
    if let Ok(sock) = UnixDatagram::unbound() {
        let _ = sock.set_nonblocking(true);
        let line = format!("<12>gpufit[{}]: {}", std::process::id(), msg);
        let _ = sock.send_to(line.as_bytes(), "/dev/log");
    }
}

// === TaskProlog ===

/// Runs the TaskProlog and returns the `export` lines to print (empty when
/// the job does not ask for gpufit or anything fails). Returns within the
/// configured budget (≤ 1.9 s) even when a service hangs.
pub fn task_prolog(env: Env) -> Vec<String> {
    let start = Instant::now();
    let job = env.get("SLURM_JOB_ID").cloned();
    let settings = match load_settings(&env) {
        Ok(s) => s,
        Err(e) => {
            log_skip("task-prolog", job.as_ref(), &e);
            return Vec::new();
        }
    };
    let budget = settings.timeout;
    let (tx, rx) = mpsc::channel();
    // The work runs on its own thread so a stuck call (DNS, a half-open
    // socket, a locked database) cannot hold the job: past the budget the
    // hook prints nothing and the process exits, abandoning the thread.
    let spawned = std::thread::Builder::new()
        .name("task-prolog".into())
        .spawn(move || {
            let deadline = start + budget;
            let _ = tx.send(task_prolog_inner(&env, &settings, deadline));
        });
    if let Err(e) = spawned {
        log_skip(
            "task-prolog",
            job.as_ref(),
            &format!("cannot start a thread: {e}"),
        );
        return Vec::new();
    }
    match rx.recv_timeout(budget.saturating_sub(start.elapsed())) {
        Ok(Ok(lines)) => lines,
        Ok(Err(e)) => {
            log_skip(
                "task-prolog",
                job.as_ref(),
                &format!("{e}; the job runs without gpufit settings"),
            );
            Vec::new()
        }
        Err(_) => {
            log_skip(
                "task-prolog",
                job.as_ref(),
                &format!(
                    "no suggestion within {} ms; the job runs without gpufit settings",
                    budget.as_millis()
                ),
            );
            Vec::new()
        }
    }
}

fn remaining(deadline: Instant) -> Result<Duration, SlurmError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left < Duration::from_millis(10) {
        Err(SlurmError::Service("out of time".into()))
    } else {
        Ok(left)
    }
}

fn task_prolog_inner(
    env: &Env,
    settings: &HookSettings,
    deadline: Instant,
) -> Result<Vec<String>, SlurmError> {
    // The comment costs a slurmctld call per task: read it only for jobs
    // that did not ask through the environment and that have GPUs at all.
    let has_gpus = !plan::gpu_indices(env)?.is_empty() || !plan::visible_devices(env).is_empty();
    let comment = if !plan::env_asks(env) && has_gpus {
        match env.get("SLURM_JOB_ID") {
            Some(id) => {
                plan::check_job_id(id)?;
                job_comment(id, remaining(deadline)?)?
            }
            None => None,
        }
    } else {
        None
    };
    // Whether this node already saved the job's state (its batch step's
    // TaskProlog, or an earlier task here): one stat, no service call.
    let state_here = match env
        .get("SLURM_JOB_ID")
        .filter(|id| plan::check_job_id(id).is_ok())
    {
        Some(id) => plan::state_path(
            &settings.state_dir,
            id,
            env.get(plan::NODE_NAME_VAR).map(String::as_str),
        )
        .exists(),
        None => false,
    };
    let job = match plan::plan_task_prolog_here(
        env,
        settings.strategy,
        comment.as_deref(),
        state_here,
    )? {
        TaskPlan::Skip { reason } => {
            tracing::debug!("gpufit task-prolog: {reason}");
            return Ok(Vec::new());
        }
        TaskPlan::Ask(job) => job,
    };
    let (gpu, device_note) = find_gpu(settings, &job, deadline)?;
    let request = job.suggest_request(gpu);
    let mut suggestion = ask_suggestion(settings, &request, deadline)?;
    if let Some(note) = device_note {
        // Which MIG slice the settings are for, where the job's user reads why.
        suggestion.reasoning = format!("{} {note}", suggestion.reasoning.trim_end());
    }
    let state = SavedDecision {
        job_id: job.job_id.clone(),
        workload: job.workload.clone(),
        suggestion: suggestion.clone(),
        started_at: Utc::now(),
        node: env.get("SLURMD_NODENAME").cloned(),
        job_name: env.get("SLURM_JOB_NAME").cloned(),
    };
    if let Err(e) = write_state(&settings.state_dir, &state) {
        // The job still gets its settings; only the Epilog's record is lost.
        tracing::warn!(
            "gpufit task-prolog: job {}: {e}; the run will not be recorded",
            job.job_id
        );
    }
    if job.inherited {
        // The task keeps the settings its job's batch step exported.
        return Ok(Vec::new());
    }
    Ok(plan::exports(&job.job_id, &suggestion))
}

/// The job's comment through `scontrol show job` (the TaskProlog does not
/// see `SLURM_JOB_COMMENT`).
pub fn job_comment(job_id: &str, timeout: Duration) -> Result<Option<String>, SlurmError> {
    let out = run_with_timeout(
        Command::new("scontrol").args(["show", "job", job_id]),
        timeout,
    )?;
    Ok(parse_scontrol_comment(&out))
}

/// `Comment=` of `scontrol show job` output (its own line; the value runs
/// to the end of the line). `(null)` is no comment.
pub fn parse_scontrol_comment(out: &str) -> Option<String> {
    out.lines()
        .filter_map(|l| l.trim_start().strip_prefix("Comment="))
        .map(|c| c.trim_end().to_string())
        .find(|c| !c.is_empty() && c != "(null)")
}

fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Result<String, SlurmError> {
    let name = format!("{:?}", cmd.get_program());
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| SlurmError::Service(format!("cannot run {name}: {e}")))?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                if let Some(mut o) = child.stdout.take() {
                    let _ = o.read_to_string(&mut out);
                }
                if !status.success() {
                    let mut err = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    return Err(SlurmError::Service(format!(
                        "{name} failed ({status}): {}",
                        err.trim()
                    )));
                }
                return Ok(out);
            }
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SlurmError::Service(format!(
                    "{name} did not answer within {} ms",
                    timeout.as_millis()
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(SlurmError::Service(format!("waiting for {name}: {e}"))),
        }
    }
}

fn agent(connect: Duration, total: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(connect.min(total))
        .timeout(total)
        .build()
}

/// GPU of the job: the sidecar (`GET /v1/gpus`), else NVML, else the
/// configured `GPUFIT_GPU`; with what to say about the device chosen (a
/// MIG slice: which one, [`plan::pick_job_device`]).
fn find_gpu(
    settings: &HookSettings,
    job: &JobRequest,
    deadline: Instant,
) -> Result<(GpuRef, Option<String>), SlurmError> {
    if let Some(url) = &settings.sidecar_url {
        let left = remaining(deadline)?;
        // Leave the controller at least half of what is left.
        match sidecar_gpu(url, &job.visible, &job.gpu_indices, left / 2) {
            Ok(Some(g)) => return Ok(g),
            Ok(None) => {
                tracing::warn!("gpufit: sidecar {url} lists no GPU of this job; trying NVML")
            }
            Err(e) => tracing::warn!("gpufit: {e}; trying NVML"),
        }
    }
    match crate::sidecar::local_gpu_noted() {
        Ok((g, note)) => return Ok((GpuRef::Spec(g), note)),
        Err(e) => tracing::debug!("gpufit: NVML: {e}"),
    }
    match &settings.gpu {
        Some(name) => Ok((GpuRef::Name(name.clone()), None)),
        None => Err(SlurmError::Service(
            "cannot tell the GPU model: no sidecar answered (GPUFIT_SIDECAR_URL), NVML is not available, and GPUFIT_GPU is not set".into(),
        )),
    }
}

/// The job's GPU from the sidecar's `GET /v1/gpus` ([`gpu_from_sidecar`]).
pub fn sidecar_gpu(
    url: &str,
    visible: &[plan::VisibleDevice],
    indices: &[u32],
    timeout: Duration,
) -> Result<Option<(GpuRef, Option<String>)>, SlurmError> {
    let v: GpusResponse = agent(Duration::from_millis(300), timeout)
        .get(&format!("{url}/v1/gpus"))
        .call()
        .map_err(|e| SlurmError::Service(format!("sidecar {url}/v1/gpus: {e}")))?
        .into_json()
        .map_err(|e| SlurmError::Service(format!("sidecar {url}/v1/gpus: bad JSON: {e}")))?;
    Ok(gpu_from_sidecar(&v, visible, indices))
}

/// Picks the job's device out of the sidecar's GPU list
/// ([`plan::pick_job_device`]: on a MIG node the slices
/// `CUDA_VISIBLE_DEVICES` names, the smallest of them; else the first of
/// the job's indices, else the first GPU) and turns it into a spec: the
/// catalog entry with the live memory, or the live values alone
/// ([`GpuSpec::from_live`]); a GPU without memory is named only. With the
/// pick's note for the reasoning.
pub fn gpu_from_sidecar(
    v: &GpusResponse,
    visible: &[plan::VisibleDevice],
    indices: &[u32],
) -> Option<(GpuRef, Option<String>)> {
    let pick = plan::pick_job_device(&v.gpus, visible, indices)?;
    let gpu = pick.device;
    let name = gpu.name.clone();
    let m = gpu.memory_total_bytes;
    let spec = match lookup_gpu(&name) {
        Ok(mut spec) if m > 0 => {
            spec.memory_bytes = m;
            GpuRef::Spec(spec)
        }
        Ok(spec) => GpuRef::Spec(spec),
        // bf16/fp8 from the reported compute capability, as everywhere.
        Err(_) if m > 0 => GpuRef::Spec(GpuSpec::from_live(
            &name,
            m,
            gpu.compute_capability.as_deref(),
        )),
        Err(_) => GpuRef::Name(name),
    };
    Some((spec, pick.note))
}

fn ask_suggestion(
    settings: &HookSettings,
    req: &SuggestRequest,
    deadline: Instant,
) -> Result<Suggestion, SlurmError> {
    match &settings.backend {
        Backend::Controller(url) => {
            let left = remaining(deadline)?;
            let resp = agent(Duration::from_millis(500), left)
                .post(&format!("{url}/v1/suggest"))
                .send_json(req);
            match resp {
                Ok(r) => r.into_json::<Suggestion>().map_err(|e| {
                    SlurmError::Service(format!("controller {url}: bad suggestion JSON: {e}"))
                }),
                Err(ureq::Error::Status(code, r)) => {
                    let body = r.into_string().unwrap_or_default();
                    let msg = serde_json::from_str::<ErrorBody>(&body)
                        .map(|b| b.error)
                        .unwrap_or(body);
                    Err(SlurmError::Service(format!(
                        "controller {url} answered {code}: {msg}"
                    )))
                }
                Err(e) => Err(SlurmError::Service(format!(
                    "controller {url} unreachable: {e}"
                ))),
            }
        }
        Backend::Local(history) => {
            let store = crate::history::open_with(history, settings.history_sqlite)
                .map_err(|e| SlurmError::Service(format!("local history: {e}")))?;
            crate::service::suggest_blocking(store.as_ref(), StrategyTargets::default(), req)
                .map_err(|e| match e {
                    // Name the field as the job set it: GPUFIT_LORA_RANK.
                    crate::service::SuggestError::Workload(r) => {
                        SlurmError::Job(r.render(&crate::slurm::plan::SlurmEnvNames))
                    }
                    other => SlurmError::Service(format!("local suggestion: {other}")),
                })
        }
    }
}

/// Writes the job's state atomically (temp file + rename), readable by the
/// Epilog. The state dir is world-writable and sticky, like /tmp.
pub fn write_state(dir: &Path, state: &SavedDecision) -> Result<(), SlurmError> {
    let path = plan::state_path(dir, &state.job_id, state.node.as_deref());
    let tmp = dir.join(format!(".job-{}.{}.tmp", state.job_id, std::process::id()));
    let io = |context: String| move |source| SlurmError::Io { context, source };
    let text = serde_json::to_vec(state)
        .map_err(|e| SlurmError::Other(format!("cannot serialize the job state: {e}")))?;
    let mut f = std::fs::File::create(&tmp)
        .map_err(io(format!("cannot write state file {}", tmp.display())))?;
    f.write_all(&text)
        .map_err(io(format!("cannot write state file {}", tmp.display())))?;
    drop(f);
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        SlurmError::Io {
            context: format!("cannot move the state file to {}", path.display()),
            source: e,
        }
    })
}

// === Prolog ===

/// The Prolog (root): makes sure the state dir exists (mode 1777) and
/// writes the GPU → job mapping files. Never fails the job.
pub fn prolog(env: Env) {
    let job = env.get("SLURM_JOB_ID").cloned();
    if let Err(e) = prolog_inner(&env) {
        log_skip("prolog", job.as_ref(), &e);
    }
}

fn prolog_inner(env: &Env) -> Result<(), SlurmError> {
    let settings = load_settings(env)?;
    let Some(job_id) = env.get("SLURM_JOB_ID") else {
        return Err(SlurmError::Job(
            "SLURM_JOB_ID is not set: not running under Slurm".into(),
        ));
    };
    plan::check_job_id(job_id)?;
    ensure_state_dir(&settings.state_dir)?;
    let Some(dir) = &settings.mapping_dir else {
        return Ok(());
    };
    let names = plan::mapping_names(env)?;
    if names.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| SlurmError::Io {
        context: format!("cannot create the mapping dir {}", dir.display()),
        source: e,
    })?;
    for (path, content) in plan::mapping_files_named(dir, job_id, &names) {
        std::fs::write(&path, content).map_err(|e| SlurmError::Io {
            context: format!("cannot write mapping file {}", path.display()),
            source: e,
        })?;
    }
    Ok(())
}

fn ensure_state_dir(dir: &Path) -> Result<(), SlurmError> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777)))
        .map_err(|e| SlurmError::Io {
            context: format!("cannot create the state dir {}", dir.display()),
            source: e,
        })
}

// === Epilog ===

/// The Epilog (root): removes the mapping files, and records the run of a
/// job whose TaskProlog gave settings. Never fails.
pub fn epilog(env: Env) {
    let job = env.get("SLURM_JOB_ID").cloned();
    if let Err(e) = epilog_inner(&env) {
        log_skip("epilog", job.as_ref(), &e);
    }
}

fn epilog_inner(env: &Env) -> Result<(), SlurmError> {
    let settings = load_settings(env)?;
    let Some(job_id) = env.get("SLURM_JOB_ID") else {
        return Err(SlurmError::Job(
            "SLURM_JOB_ID is not set: not running under Slurm".into(),
        ));
    };
    plan::check_job_id(job_id)?;
    if let Some(dir) = &settings.mapping_dir {
        for (path, content) in plan::mapping_files_named(dir, job_id, &plan::mapping_names(env)?) {
            // Only our own mapping: a later job may already own the GPU.
            if std::fs::read_to_string(&path).is_ok_and(|c| c == content) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    let node = env.get(plan::NODE_NAME_VAR).cloned();
    let mut path = plan::state_path(&settings.state_dir, job_id, node.as_deref());
    let mut state = read_state(&path, env)?;
    if state.is_none() {
        // Written without a node name (by hand, or an earlier gpufit).
        path = plan::state_path(&settings.state_dir, job_id, None);
        state = read_state(&path, env)?;
    }
    let Some(state) = state else {
        tracing::debug!(
            "gpufit epilog: job {job_id}: no state file on this node, nothing to record"
        );
        return Ok(());
    };
    let _ = std::fs::remove_file(&path);
    let peak = match &settings.sidecar_url {
        Some(url) => match sidecar_peak(url, job_id) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("gpufit epilog: job {job_id}: {e}; recording without peak memory");
                None
            }
        },
        None => None,
    };
    let (exit_status, derived_status) = plan::exit_state(env);
    let (outputs, out_of_memory) = output_files(env, job_id, state.job_name.as_deref());
    let mut host_oom = out_of_memory;
    let mut oom = false;
    let mut log = plan::LogFacts::default();
    let mut read_any = false;
    for path in outputs {
        let Some(tail) = read_output_tail(&path, env.get("SLURM_JOB_UID")) else {
            tracing::debug!(
                "gpufit epilog: job {job_id}: output {} not readable",
                path.display()
            );
            continue;
        };
        read_any = true;
        oom |= is_cuda_oom(&tail);
        // slurmstepd writes its cgroup oom-kill line into the job's output.
        host_oom |= crate::core::logs::oom::first_host_oom_kill_line(&tail).is_some();
        if let Ok(parsed) = crate::core::logs::parse_str(&tail) {
            log.peak_memory_bytes = log.peak_memory_bytes.or(parsed.peak_memory_bytes());
            log.tokens_per_sec = log.tokens_per_sec.or(parsed.tokens_per_sec);
            log.samples_per_sec = log.samples_per_sec.or(parsed.samples_per_sec);
            log.stated = log.stated.or(parsed.stated);
        }
    }
    // The job's own result record (the Python package writes it to the
    // file the TaskProlog named): what it ran, its exact peak, its speed.
    let record_path = crate::core::result_record::slurm_result_path(job_id);
    let record = read_result_record(&record_path, env.get("SLURM_JOB_UID"));
    if let Some(r) = &record {
        log.peak_memory_bytes = log.peak_memory_bytes.or(r.peak_reserved_bytes());
        log.tokens_per_sec = r.tokens_per_sec.or(log.tokens_per_sec);
        log.samples_per_sec = r.samples_per_sec.or(log.samples_per_sec);
    }
    if !read_any {
        // Not a fault (output may go to /dev/null), but an OOM in it cannot
        // be seen: say so where an operator looks.
        tracing::info!(
            "gpufit epilog: job {job_id}: no output file could be read; a CUDA OOM would go unnoticed"
        );
    }
    let nodes = plan::job_nodes(env);
    if nodes > 1 {
        // A node's report carries its own node's peak: the log's peak is
        // rank 0's (one GPU of one node), and every node reading the job's
        // output on a shared file system would claim it. Without its
        // sidecar's figure the node reports no peak (the record says so).
        log.peak_memory_bytes = None;
    }
    let outcome = plan::JobEnd {
        record: record.map(|r| r.ran),
        exit_status,
        derived_status,
        oom,
        host_oom,
        peak_memory_bytes: peak,
        log,
        ended_at: Utc::now(),
    };
    let mut run = plan::build_run(&state, &outcome, settings.cluster.clone(), node);
    if nodes > 1 {
        // Every node reports its own peak; the controller folds them into
        // the job's one record (peak = the largest node's).
        run.nodes = Some(NodeReports {
            reported: 1,
            expected: nodes,
            // The store lists this node as peakless if its report has no
            // peak (its sidecar unreadable): from the peak itself.
            without_peak: Vec::new(),
        });
    }
    record_run(&settings, &run)
}

/// The job's output files, best first: slurmctld's expanded `StdOut=` /
/// `StdErr=` (`scontrol show job`, the only source that knows `%x` and the
/// default name for sure), then what the environment and the TaskProlog's
/// saved job name allow (Slurm 22.05 gives the Epilog no
/// `SLURM_JOB_STDOUT` when `--output` was not given). Also whether
/// slurmctld says the job ran out of host memory (`JobState=OUT_OF_MEMORY`).
fn output_files(env: &Env, job_id: &str, job_name: Option<&str>) -> (Vec<PathBuf>, bool) {
    let (mut paths, out_of_memory) = match run_with_timeout(
        Command::new("scontrol").args(["show", "job", job_id]),
        EPILOG_HTTP_TIMEOUT,
    ) {
        Ok(out) => (
            plan::parse_scontrol_outputs(&out),
            plan::scontrol_out_of_memory(&out),
        ),
        Err(e) => {
            tracing::debug!("gpufit epilog: job {job_id}: {e}");
            (Vec::new(), false)
        }
    };
    for p in plan::output_candidates(env, job_name) {
        if !paths.contains(&p) {
            paths.push(p);
        }
    }
    (paths, out_of_memory)
}

/// Reads the TaskProlog's state, trusting it only when the job's own user
/// (or root) wrote it: the state dir is world-writable.
fn read_state(path: &Path, env: &Env) -> Result<Option<SavedDecision>, SlurmError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(SlurmError::Io {
                context: format!("cannot read state file {}", path.display()),
                source: e,
            })
        }
    };
    if !owned_by_job_user(&meta, env.get("SLURM_JOB_UID")) {
        return Err(SlurmError::Job(format!(
            "state file {} is not a regular file of the job's user: ignored",
            path.display()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| SlurmError::Io {
        context: format!("cannot read state file {}", path.display()),
        source: e,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| SlurmError::Job(format!("state file {} is not valid: {e}", path.display())))
}

fn owned_by_job_user(meta: &std::fs::Metadata, uid: Option<&String>) -> bool {
    let uid_ok = match uid.and_then(|u| u.parse::<u32>().ok()) {
        Some(u) => meta.uid() == u || meta.uid() == 0,
        None => true,
    };
    meta.file_type().is_file() && uid_ok
}

/// Peak GPU memory of the job from the sidecar's `GET /v1/jobs/{id}`.
pub fn sidecar_peak(url: &str, job_id: &str) -> Result<Option<u64>, SlurmError> {
    let resp = agent(Duration::from_millis(500), EPILOG_HTTP_TIMEOUT)
        .get(&format!("{url}/v1/jobs/{job_id}"))
        .call();
    match resp {
        Ok(r) => {
            // The sidecar's own type: one definition for its server and clients.
            let job: crate::wire::sidecar::JobView = r.into_json().map_err(|e| {
                SlurmError::Service(format!("sidecar {url}: not a sidecar job: {e}"))
            })?;
            // 0: the sidecar saw the job but no figure of it (e.g. NVML gave
            // none): unknown, not a 0-byte peak.
            Ok(Some(job.peak_bytes).filter(|p| *p > 0))
        }
        Err(ureq::Error::Status(404, _)) => Ok(None),
        Err(e) => Err(SlurmError::Service(format!(
            "sidecar {url}/v1/jobs/{job_id}: {e}"
        ))),
    }
}

/// The end of a job's output file (where a traceback is). Reads only a
/// regular file of the job's user: the Epilog runs as root.
fn read_output_tail(path: &Path, uid: Option<&String>) -> Option<String> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !owned_by_job_user(&meta, uid) {
        return None;
    }
    let mut f = std::fs::File::open(path).ok()?;
    let start = meta.len().saturating_sub(OUTPUT_TAIL_BYTES);
    f.seek(SeekFrom::Start(start)).ok()?;
    let mut buf = Vec::new();
    f.take(OUTPUT_TAIL_BYTES).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// The job's result record at `path` (then removed): a regular file of the
/// job's user (never a link: the Epilog runs as root), at most
/// [`MAX_RECORD_BYTES`](crate::core::result_record::MAX_RECORD_BYTES), the
/// same file when opened as when checked, and a valid record. Anything
/// else is ignored with a log line: the run is then recorded as its log
/// and placeholders say.
fn read_result_record(
    path: &Path,
    uid: Option<&String>,
) -> Option<crate::core::result_record::ResultRecord> {
    use crate::core::result_record::{ResultRecord, MAX_RECORD_BYTES};
    let meta = std::fs::symlink_metadata(path).ok()?;
    let read = || -> Result<ResultRecord, String> {
        if !owned_by_job_user(&meta, uid) {
            return Err("not a regular file of the job's user".into());
        }
        if meta.len() > MAX_RECORD_BYTES as u64 {
            return Err(format!(
                "{} bytes, more than {MAX_RECORD_BYTES}",
                meta.len()
            ));
        }
        let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
        let now = f.metadata().map_err(|e| e.to_string())?;
        if (now.dev(), now.ino()) != (meta.dev(), meta.ino()) {
            return Err("replaced while being read".into());
        }
        let mut text = String::new();
        f.take(MAX_RECORD_BYTES as u64 + 1)
            .read_to_string(&mut text)
            .map_err(|e| e.to_string())?;
        ResultRecord::parse(&text).map_err(|e| e.to_string())
    };
    let out = read();
    if meta.file_type().is_file() {
        let _ = std::fs::remove_file(path);
    }
    match out {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(
                "gpufit epilog: result record {} ignored: {e}",
                path.display()
            );
            None
        }
    }
}

/// Whether a job's output shows a GPU out-of-memory error: the markers of
/// [`crate::core::logs::oom::MARKERS`], the ones the Kubernetes reconciler
/// uses, so both paths agree.
pub fn is_cuda_oom(text: &str) -> bool {
    crate::core::logs::oom::first_oom_line(text).is_some()
}

fn record_run(settings: &HookSettings, run: &RunRecord) -> Result<(), SlurmError> {
    match &settings.backend {
        Backend::Controller(url) => {
            let token = match &settings.token_file {
                Some(p) => crate::service::read_token_file(p).map_err(|e| SlurmError::Service(e.to_string()))?,
                None => {
                    return Err(SlurmError::Service(
                        "no token file (GPUFIT_TOKEN_FILE / token_file in the site config): the controller refuses runs without its token".into(),
                    ))
                }
            };
            let resp = agent(Duration::from_millis(500), EPILOG_HTTP_TIMEOUT)
                .post(&format!("{url}/v1/runs"))
                .set("Authorization", &format!("Bearer {token}"))
                .send_json(run);
            match resp {
                Ok(_) => Ok(()),
                Err(ureq::Error::Status(code, r)) => {
                    let body = r.into_string().unwrap_or_default();
                    Err(SlurmError::Service(format!(
                        "controller {url} refused the run ({code}): {body}"
                    )))
                }
                Err(e) => Err(SlurmError::Service(format!(
                    "controller {url} unreachable: {e}"
                ))),
            }
        }
        Backend::Local(history) => {
            let store = crate::history::open_with(history, settings.history_sqlite)
                .map_err(|e| SlurmError::Service(format!("local history: {e}")))?;
            let mut run = run.clone();
            run.model = crate::service::canonical_model(&run.model);
            let recorded = if run.nodes.is_some() {
                store.record_node_report(&run)
            } else {
                store.record(&run)
            };
            recorded
                .map(|_| ())
                .map_err(|e| SlurmError::Service(format!("local history: {e}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scontrol_comment_is_read_from_its_own_line() {
        let out = "JobId=7 JobName=x\n   UserId=root(0) GroupId=root(0)\n   Comment=gpufit: model=m seq_len=2048 \n   StdOut=/tmp/o\n";
        assert_eq!(
            parse_scontrol_comment(out).as_deref(),
            Some("gpufit: model=m seq_len=2048")
        );
        assert_eq!(parse_scontrol_comment("JobId=7\n   Comment=(null)\n"), None);
        assert_eq!(parse_scontrol_comment("JobId=7\n"), None);
    }

    #[test]
    fn the_sidecar_gpu_matching_the_job_index_is_chosen_and_live_memory_wins() {
        let gpu = |index: u32, name: &str, mem: u64, cc: &str| {
            serde_json::json!({"index": index, "uuid": format!("GPU-{index}"), "name": name,
                "memory_total_bytes": mem, "memory_used_bytes": 0, "memory_free_bytes": mem,
                "compute_capability": cc, "healthy": true})
        };
        let list = |gpus: Vec<serde_json::Value>| -> GpusResponse {
            serde_json::from_value(serde_json::json!({"node": "n1", "backend": "simulate",
                "sampled_at": null, "gpus": gpus}))
            .expect("the sidecar's /v1/gpus shape")
        };
        let v = list(vec![
            gpu(0, "Some Unknown GPU", 1000, "9.0"),
            gpu(1, "Other Unknown GPU", 2000, "7.5"),
        ]);
        match gpu_from_sidecar(&v, &[], &[1]) {
            Some((GpuRef::Spec(s), None)) => {
                assert_eq!(s.name, "Other Unknown GPU");
                assert_eq!(s.memory_bytes, 2000);
                assert!(!s.bf16, "compute capability 7.5 has no bf16");
            }
            other => panic!("{other:?}"),
        }
        match gpu_from_sidecar(&v, &[], &[]) {
            Some((GpuRef::Spec(s), None)) => assert!(s.bf16 && s.fp8 && s.memory_bytes == 1000),
            other => panic!("{other:?}"),
        }
        assert_eq!(gpu_from_sidecar(&list(vec![]), &[], &[0]), None);
        assert_eq!(
            gpu_from_sidecar(&list(vec![gpu(0, "X", 0, "")]), &[], &[0]),
            Some((GpuRef::Name("X".into()), None))
        );
    }

    #[test]
    fn a_card_in_mig_mode_is_planned_for_as_its_slice_with_the_cards_capabilities() {
        let card = serde_json::json!({"index": 0, "uuid": "GPU-0", "name": "NVIDIA A100-SXM4-40GB",
            "memory_total_bytes": 42_949_672_960u64, "memory_used_bytes": 0,
            "memory_free_bytes": 42_949_672_960u64, "compute_capability": "8.0",
            "mig_enabled": true, "healthy": true});
        let slice = serde_json::json!({"index": 0, "uuid": "MIG-1",
            "name": "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "memory_total_bytes": 5_100_273_664u64,
            "memory_used_bytes": 0, "memory_free_bytes": 5_100_273_664u64,
            "compute_capability": "8.0", "healthy": true,
            "mig": {"device": 0, "profile": "1g.5gb", "parent_uuid": "GPU-0"}});
        let v: GpusResponse = serde_json::from_value(serde_json::json!({"node": "n1",
            "backend": "nvml", "sampled_at": null, "gpus": [card, slice]}))
        .expect("the sidecar's /v1/gpus shape");
        let by_uuid = [plan::VisibleDevice::MigUuid("MIG-1".into())];
        for (visible, indices) in [(&[][..], &[0u32][..]), (&[][..], &[]), (&by_uuid[..], &[0])] {
            match gpu_from_sidecar(&v, visible, indices) {
                Some((GpuRef::Spec(s), Some(note))) => {
                    assert!(note.contains("1g.5gb"), "{note}");
                    assert_eq!(s.name, "NVIDIA A100-SXM4-40GB MIG 1g.5gb");
                    assert_eq!(s.memory_bytes, 5_100_273_664, "the slice's live memory");
                    assert!(s.bf16, "bf16 from the A100");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn cuda_oom_messages_are_recognised_and_others_are_not() {
        assert!(is_cuda_oom(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
        ));
        assert!(is_cuda_oom("RuntimeError: CUDA error: out of memory"));
        assert!(!is_cuda_oom(
            "RuntimeError: NCCL error: unhandled system error"
        ));
    }

    #[test]
    fn a_hanging_command_is_killed_at_its_timeout() {
        let t = Instant::now();
        let err = run_with_timeout(Command::new("sleep").arg("5"), Duration::from_millis(100))
            .unwrap_err();
        assert!(err.to_string().contains("did not answer"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
