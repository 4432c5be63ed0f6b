//! The pure part of the Slurm hooks: environment + job information → what
//! to do. No I/O here; [`super::exec`] reads the inputs and performs the
//! actions, so every decision is tested with tables.
//!
//! How a job asks for gpufit (either or both; the environment wins field by
//! field because it is the more specific of the two):
//! - `GPUFIT_MODEL`, `GPUFIT_SEQ_LEN`, `GPUFIT_GLOBAL_BATCH`, `GPUFIT_METHOD`,
//!   `GPUFIT_LORA_RANK`, `GPUFIT_LORA_TARGETS`, `GPUFIT_GPUS`,
//!   `GPUFIT_OPTIMIZER`, `GPUFIT_FRAMEWORK`, `GPUFIT_ZERO`,
//!   `GPUFIT_ATTENTION`, `GPUFIT_STRATEGY` in the job's environment
//!   (submitter's environment or `--export`);
//! - a `gpufit:` section in `--comment`, e.g.
//!   `--comment "gpufit: model=meta-llama/Llama-3.1-8B seq_len=2048 global_batch=32"`
//!   (pairs separated by spaces or commas, ending at `;` or the end).
//!
//! Engineering fields the user sets (`GPUFIT_MICRO_BATCH_SIZE`, `GPUFIT_DTYPE`,
//! `micro_batch_size=` in the comment, …) are pins: kept as they are.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::SlurmError;
use crate::core::advisor::{Strategy, Suggestion};
use crate::core::run::{RunKey, RunOrigin, RunOutcome, RunRecord, RunResult, RunSource};
use crate::core::settings::Pins;
use crate::core::workload::{
    Attention, FieldNames, Framework, LoraTarget, Method, Optimizer, Sharding, WorkloadField,
};
use crate::history::sqlite::{SqliteOptions, BUSY_TIMEOUT_ENV, DEFAULT_BUSY_TIMEOUT_MS};
use crate::wire::api::{GpuRef, SuggestRequest, WorkloadSpec};
use crate::wire::sidecar::GpuInfo;

/// A hook's environment (name → value).
pub type Env = BTreeMap<String, String>;

/// Default site config file (override with `GPUFIT_SLURM_CONFIG`).
pub const DEFAULT_CONFIG_PATH: &str = "/etc/gpufit/slurm.toml";
/// Default spool directory for per-job state (world-writable, sticky).
pub const DEFAULT_STATE_DIR: &str = "/var/spool/gpufit";
/// Default total time budget of the TaskProlog: below Slurm's patience and
/// the 2 s promise, with room for process start-up.
pub const DEFAULT_TIMEOUT_MS: u64 = 1500;
/// Hard ceiling of the TaskProlog budget (fail open within 2 s).
pub const MAX_TIMEOUT_MS: u64 = 1900;

// === site settings ===

/// The site config file (`/etc/gpufit/slurm.toml`). Every field can be
/// overridden by the environment variable named in its doc.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteConfig {
    /// `GPUFIT_CONTROLLER_URL`: the controller's HTTP API, e.g. `http://gpufit:8080`.
    pub controller_url: Option<String>,
    /// `GPUFIT_HISTORY`: local history used when no controller is configured.
    pub history: Option<String>,
    /// `GPUFIT_SIDECAR_URL`: the node sidecar, e.g. `http://127.0.0.1:9445`
    /// (each node's own). `{node}` in it is replaced by the node's name
    /// (`SLURMD_NODENAME`, else the host name), e.g. `http://{node}:9445`
    /// for sidecars reached by node name.
    pub sidecar_url: Option<String>,
    /// `GPUFIT_GPU`: GPU model name when neither the sidecar nor NVML answer.
    pub gpu: Option<String>,
    /// `GPUFIT_TOKEN_FILE`: bearer token for `POST /v1/runs` (root-readable only).
    pub token_file: Option<PathBuf>,
    /// `GPUFIT_STATE_DIR`: per-job state written by TaskProlog, read by Epilog.
    pub state_dir: Option<PathBuf>,
    /// `GPUFIT_MAPPING_DIR`: GPU index → job id files for the sidecar
    /// (dcgm-exporter HPC convention); unset: Prolog writes none.
    pub mapping_dir: Option<PathBuf>,
    /// `GPUFIT_CLUSTER`: cluster name recorded with runs (default `SLURM_CLUSTER_NAME`).
    pub cluster: Option<String>,
    /// `GPUFIT_STRATEGY`: site default strategy (a job's own wins).
    pub strategy: Option<String>,
    /// `GPUFIT_TIMEOUT_MS`: TaskProlog time budget (capped at 1900 ms).
    pub timeout_ms: Option<u64>,
}

impl SiteConfig {
    /// Parses the TOML text of a site config.
    pub fn parse(text: &str, path: &Path) -> Result<Self, SlurmError> {
        toml::from_str(text).map_err(|e| SlurmError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }
}

/// Where suggestions come from and runs go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// The controller's HTTP API.
    Controller(String),
    /// A history store opened by the hook itself.
    Local(String),
}

/// Site config merged with the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct HookSettings {
    pub backend: Backend,
    pub sidecar_url: Option<String>,
    pub gpu: Option<String>,
    pub token_file: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub mapping_dir: Option<PathBuf>,
    pub cluster: Option<String>,
    pub strategy: Strategy,
    /// Total TaskProlog budget.
    pub timeout: Duration,
    /// SQLite options of a local history (`GPUFIT_HISTORY_BUSY_TIMEOUT_MS`).
    pub history_sqlite: SqliteOptions,
}

impl HookSettings {
    /// Environment over file over defaults. `default_history` is the store
    /// used when neither a controller nor a history is configured.
    pub fn resolve(
        env: &Env,
        file: &SiteConfig,
        default_history: &str,
    ) -> Result<Self, SlurmError> {
        let pick = |var: &str, f: &Option<String>| -> Option<String> {
            non_empty(env.get(var)).or_else(|| f.clone().filter(|s| !s.trim().is_empty()))
        };
        let pick_path = |var: &str, f: &Option<PathBuf>| -> Option<PathBuf> {
            non_empty(env.get(var))
                .map(PathBuf::from)
                .or_else(|| f.clone())
        };
        let backend = match pick("GPUFIT_CONTROLLER_URL", &file.controller_url) {
            Some(url) => Backend::Controller(url.trim_end_matches('/').to_string()),
            None => Backend::Local(
                pick("GPUFIT_HISTORY", &file.history).unwrap_or_else(|| default_history.into()),
            ),
        };
        let strategy = match pick("GPUFIT_STRATEGY", &file.strategy) {
            Some(s) => s
                .parse()
                .map_err(|e: String| SlurmError::Job(format!("GPUFIT_STRATEGY: {e}")))?,
            None => Strategy::Balanced,
        };
        let timeout_ms = millis(env, "GPUFIT_TIMEOUT_MS")?
            .unwrap_or_else(|| file.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS));
        let busy_ms = millis(env, BUSY_TIMEOUT_ENV)?.unwrap_or(DEFAULT_BUSY_TIMEOUT_MS);
        let sidecar_url = match pick("GPUFIT_SIDECAR_URL", &file.sidecar_url) {
            Some(u) => Some(expand_node(
                &u,
                non_empty(env.get(NODE_NAME_VAR)).as_deref(),
            )?),
            None => None,
        };
        Ok(HookSettings {
            backend,
            sidecar_url: sidecar_url.map(|u| u.trim_end_matches('/').to_string()),
            gpu: pick("GPUFIT_GPU", &file.gpu),
            token_file: pick_path("GPUFIT_TOKEN_FILE", &file.token_file),
            state_dir: pick_path("GPUFIT_STATE_DIR", &file.state_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR)),
            mapping_dir: pick_path("GPUFIT_MAPPING_DIR", &file.mapping_dir),
            cluster: pick("GPUFIT_CLUSTER", &file.cluster)
                .or_else(|| non_empty(env.get("SLURM_CLUSTER_NAME"))),
            strategy,
            timeout: Duration::from_millis(timeout_ms.clamp(100, MAX_TIMEOUT_MS)),
            history_sqlite: SqliteOptions {
                busy_timeout: Duration::from_millis(busy_ms),
            },
        })
    }
}

/// The variable slurmd gives every hook and task with the node's name
/// (the executor fills it from the host name when a hook runs by hand).
pub const NODE_NAME_VAR: &str = "SLURMD_NODENAME";

/// Whether `name` can stand in a URL's host and a file name: a Slurm node
/// name is a host name (letters, digits, `-`, `.`, `_`).
pub fn is_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

/// Replaces `{node}` in a sidecar URL by this node's name, so one site
/// config names every node's own sidecar (`http://{node}:9445`). A URL
/// without it is returned as it is; any other `{…}` is refused, as is
/// `{node}` when the node's name is unknown or not a host name.
pub fn expand_node(template: &str, node: Option<&str>) -> Result<String, SlurmError> {
    let bad = |why: String| SlurmError::Job(format!("sidecar_url `{template}`: {why}"));
    let url = if template.contains("{node}") {
        let node = node.ok_or_else(|| {
            bad("{node} needs the node's name, and SLURMD_NODENAME is not set and the host name unknown".into())
        })?;
        if !is_node_name(node) {
            return Err(bad(format!(
                "node name `{node}` cannot stand in a URL (letters, digits, `-`, `.`, `_`)"
            )));
        }
        template.replace("{node}", node)
    } else {
        template.to_string()
    };
    if url.contains('{') || url.contains('}') {
        return Err(bad("the only placeholder is {node}".into()));
    }
    Ok(url)
}

/// The Slurm hooks' names for the workload's fields: the job's
/// `GPUFIT_*` variables (`GPUFIT_LORA_RANK`, `GPUFIT_ZERO`). A job names
/// catalog models only, so the architecture numbers are its `GPUFIT_MODEL`.
pub struct SlurmEnvNames;

impl FieldNames for SlurmEnvNames {
    fn name(&self, field: WorkloadField) -> String {
        match field {
            WorkloadField::Sharding => "GPUFIT_ZERO".into(),
            f if f.domain_name().starts_with("architecture.") => "GPUFIT_MODEL".into(),
            f => format!("GPUFIT_{}", f.domain_name().to_ascii_uppercase()),
        }
    }
}

/// A number of milliseconds from the environment, if set.
fn millis(env: &Env, var: &str) -> Result<Option<u64>, SlurmError> {
    non_empty(env.get(var))
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                SlurmError::Job(format!("{var}=`{v}` is not a number of milliseconds"))
            })
        })
        .transpose()
}

fn non_empty(v: Option<&String>) -> Option<String> {
    v.map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

// === what the job asks for ===

/// The `gpufit:` section of a job comment, if any (text after `gpufit:`
/// up to `;` or the end).
pub fn comment_section(comment: &str) -> Option<&str> {
    let lower = comment.to_ascii_lowercase();
    let start = lower.find("gpufit:")? + "gpufit:".len();
    let rest = &comment[start..];
    let section = rest.split(';').next().unwrap_or("").trim();
    Some(section)
}

/// `key=value` pairs of a comment section; keys normalized.
fn comment_pairs(section: &str) -> Result<BTreeMap<String, String>, SlurmError> {
    let mut out = BTreeMap::new();
    for token in section
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
    {
        let (k, v) = token.split_once('=').ok_or_else(|| {
            SlurmError::Job(format!(
                "job comment: `{token}` is not key=value (e.g. `gpufit: model=llama-3.1-8b seq_len=2048`)"
            ))
        })?;
        out.insert(normalize_key(k), v.trim().to_string());
    }
    Ok(out)
}

/// `GPUFIT_SEQ_LEN`, `seq-len`, `SEQ_LEN` → `seq_len`; a pin by any of its
/// names → its one name ([`crate::core::settings::pin_var`]).
fn normalize_key(k: &str) -> String {
    if let Some(var) = crate::core::settings::pin_var(k) {
        return var.placeholder.to_string();
    }
    let k = k.trim().to_ascii_lowercase().replace('-', "_");
    k.strip_prefix("gpufit_").map(str::to_string).unwrap_or(k)
}

/// Keys a job may give (without the `GPUFIT_` prefix).
const WORKLOAD_KEYS: &[&str] = &[
    "model",
    "method",
    "lora_rank",
    "lora_targets",
    "seq_len",
    "global_batch",
    "gpus",
    "optimizer",
    "framework",
    "zero",
    "attention",
    "strategy",
];
/// Engineering keys a job may pin: the core's one vocabulary (the
/// variables the TaskProlog exports, their names and aliases, are read as
/// these).
fn pin_keys() -> Vec<&'static str> {
    crate::core::settings::PINNABLE
        .iter()
        .map(|v| v.placeholder)
        .collect()
}

/// What the TaskProlog should do for a task.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskPlan {
    /// Print nothing. `reason` is logged at debug level.
    Skip { reason: String },
    /// Ask for a suggestion and print its exports.
    Ask(Box<JobRequest>),
}

/// A job that asks for gpufit.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRequest {
    pub job_id: String,
    pub workload: WorkloadSpec,
    pub strategy: Strategy,
    pub pins: Pins,
    /// Physical GPU indices on this node (`SLURM_JOB_GPUS`, else `CUDA_VISIBLE_DEVICES`).
    pub gpu_indices: Vec<u32>,
    /// The devices `CUDA_VISIBLE_DEVICES` names ([`visible_devices`]): on a
    /// MIG node, the job's slices by their UUIDs.
    pub visible: Vec<VisibleDevice>,
    /// CPU cores the job has per GPU ([`cpus_per_gpu`]), for the data loader.
    pub cpus_per_gpu: Option<u32>,
    /// The task inherited its settings from the job's batch step (another
    /// node's TaskProlog decided them), and this node has no state for the
    /// job yet: ask with the inherited settings as pins only to save this
    /// node's state for its Epilog (every node of a multi-node job reports
    /// its own peak), and print nothing, so every rank keeps the same values.
    pub inherited: bool,
}

impl JobRequest {
    /// The API request for this job on a GPU.
    pub fn suggest_request(&self, gpu: GpuRef) -> SuggestRequest {
        SuggestRequest {
            workload: self.workload.clone(),
            gpu,
            strategy: Some(self.strategy),
            pins: self.pins.clone(),
            cpus_per_gpu: self.cpus_per_gpu,
        }
    }
}

/// Whether the job's environment alone asks for gpufit (then the comment
/// need not be read, which saves a `scontrol` call per task).
pub fn env_asks(env: &Env) -> bool {
    non_empty(env.get("GPUFIT_MODEL")).is_some()
}

/// Decides the TaskProlog on a node that already has the job's state (or
/// needs none): [`plan_task_prolog_here`] with `state_here`.
pub fn plan_task_prolog(
    env: &Env,
    site_strategy: Strategy,
    comment: Option<&str>,
) -> Result<TaskPlan, SlurmError> {
    plan_task_prolog_here(env, site_strategy, comment, true)
}

/// Decides the TaskProlog. `comment` is the job's comment when it was read
/// (None when the environment already asks, or it could not be read);
/// `state_here`: this node already has the job's state file.
pub fn plan_task_prolog_here(
    env: &Env,
    site_strategy: Strategy,
    comment: Option<&str>,
    state_here: bool,
) -> Result<TaskPlan, SlurmError> {
    let Some(job_id) = non_empty(env.get("SLURM_JOB_ID")) else {
        return Ok(TaskPlan::Skip {
            reason: "SLURM_JOB_ID is not set: not running under Slurm".into(),
        });
    };
    check_job_id(&job_id)?;
    // A previous TaskProlog of this job (the batch step) already decided and
    // its exports were inherited by this step: every rank keeps those.
    let decided_for = non_empty(env.get("GPUFIT_JOB_ID"));
    let inherited = decided_for.as_deref() == Some(job_id.as_str())
        && env.contains_key("GPUFIT_SUGGESTION_SOURCE");
    if inherited && state_here {
        return Ok(TaskPlan::Skip {
            reason: format!(
                "job {job_id} already has its gpufit settings (inherited from its batch step)"
            ),
        });
    }
    // Exports inherited from another job (sbatch from inside a job) are stale,
    // not pins the user chose; this job's own (another node's batch step
    // decided them) are the settings in use: pins.
    let stale_exports = decided_for.is_some() && !inherited;

    let fields = requested_fields(env, comment, stale_exports)?;
    let Some(model) = fields.get("model").cloned() else {
        return Ok(TaskPlan::Skip {
            reason: format!(
                "job {job_id} does not ask for gpufit (no GPUFIT_MODEL, no `gpufit:` comment)"
            ),
        });
    };
    let gpu_indices = gpu_indices(env)?;
    let visible = visible_devices(env);
    // A MIG job's devices may be named only by UUID (no indices to count).
    let gpus_here = gpu_indices.len().max(visible.len());
    let workload = workload_spec(env, &fields, model, gpus_here)?;
    let strategy =
        parse_with(&fields, "strategy", |s| s.parse::<Strategy>())?.unwrap_or(site_strategy);
    let pins = pinned_settings(&fields)?;
    let cpus_per_gpu = cpus_per_gpu(env, gpus_here);
    Ok(TaskPlan::Ask(Box::new(JobRequest {
        job_id,
        workload,
        strategy,
        pins,
        gpu_indices,
        visible,
        cpus_per_gpu,
        inherited,
    })))
}

/// CPU cores the job has per GPU, as Slurm allocated them (never the
/// node's): `SLURM_CPUS_PER_GPU` (`--cpus-per-gpu`), else
/// `SLURM_CPUS_PER_TASK` (`--cpus-per-task`) over the GPUs of a task — with
/// one task per GPU, as torchrun-less `srun` launches run, that is the
/// task's cores; a task driving several GPUs splits its cores among them.
/// None when the job says neither.
pub fn cpus_per_gpu(env: &Env, gpus_here: usize) -> Option<u32> {
    let num = |k: &str| {
        non_empty(env.get(k))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|n| *n > 0)
    };
    if let Some(c) = num("SLURM_CPUS_PER_GPU") {
        return Some(c);
    }
    let per_task = num("SLURM_CPUS_PER_TASK")?;
    let tasks_here = num("SLURM_NTASKS_PER_NODE")
        .or_else(|| num("SLURM_TASKS_PER_NODE"))
        .unwrap_or(1) as usize;
    let gpus_per_task = (gpus_here / tasks_here.max(1)).max(1) as u32;
    Some((per_task / gpus_per_task).max(1))
}

/// The job's `key → value` request: the comment's `gpufit:` section, then
/// the `GPUFIT_*` environment over it (pins only when not `stale_exports`).
fn requested_fields(
    env: &Env,
    comment: Option<&str>,
    stale_exports: bool,
) -> Result<BTreeMap<String, String>, SlurmError> {
    let mut fields: BTreeMap<String, String> = BTreeMap::new();
    if let Some(section) = comment.and_then(comment_section) {
        for (k, v) in comment_pairs(section)? {
            if !WORKLOAD_KEYS.contains(&k.as_str()) && !pin_keys().contains(&k.as_str()) {
                return Err(SlurmError::Job(format!(
                    "job comment: unknown key `{k}`: use {}, or pin {}",
                    WORKLOAD_KEYS.join(", "),
                    pin_keys().join(", ")
                )));
            }
            fields.insert(k, v);
        }
    }
    for key in WORKLOAD_KEYS {
        if let Some(v) = non_empty(env.get(&format!("GPUFIT_{}", key.to_ascii_uppercase()))) {
            fields.insert(key.to_string(), v);
        }
    }
    if !stale_exports {
        // The variables gpufit itself exports (`GPUFIT_GRAD_ACCUM_STEPS` …).
        for var in crate::core::settings::PINNABLE {
            if let Some(v) = non_empty(env.get(var.env)) {
                fields.insert(var.placeholder.to_string(), v);
            }
        }
    }
    Ok(fields)
}

/// The workload asked for. Every value goes through its type's FromStr:
/// the aliases the command line, the CRD and the webhook accept
/// (docs/design.md, "Workload resolution").
fn workload_spec(
    env: &Env,
    fields: &BTreeMap<String, String>,
    model: String,
    local_gpus: usize,
) -> Result<WorkloadSpec, SlurmError> {
    let seq_len = parse_num::<u32>(fields, "seq_len")?.ok_or_else(|| {
        SlurmError::Job("GPUFIT_SEQ_LEN (or seq_len= in the comment) is required: the training sequence length in tokens".into())
    })?;
    let gpus = match parse_num::<u32>(fields, "gpus")? {
        Some(g) => Some(g),
        None => {
            // Data-parallel GPUs: those on this node times the job's nodes.
            let nodes = non_empty(env.get("SLURM_JOB_NUM_NODES"))
                .or_else(|| non_empty(env.get("SLURM_NNODES")))
                .and_then(|n| n.parse::<u32>().ok())
                .unwrap_or(1)
                .max(1);
            Some((local_gpus as u32).max(1) * nodes)
        }
    };
    let sharding = parse_with(fields, "zero", |s| s.parse::<Sharding>())?;
    Ok(WorkloadSpec {
        model,
        architecture: None,
        method: parse_with(fields, "method", |s| s.parse::<Method>())?,
        lora_rank: parse_num(fields, "lora_rank")?,
        lora_targets: parse_with(fields, "lora_targets", LoraTarget::parse_list)?,
        seq_len,
        global_batch: parse_num(fields, "global_batch")?,
        gpus,
        optimizer: parse_with(fields, "optimizer", |s| s.parse::<Optimizer>())?,
        sharding,
        framework: parse_with(fields, "framework", |s| s.parse::<Framework>())?,
        attention: parse_with(fields, "attention", |s| s.parse::<Attention>())?,
    })
}

/// The settings the job pins: the core's one pin parser.
fn pinned_settings(fields: &BTreeMap<String, String>) -> Result<Pins, SlurmError> {
    let pins = fields
        .iter()
        .filter_map(|(k, v)| crate::core::settings::pin_var(k).map(|_| (k.as_str(), v.as_str())));
    crate::core::settings::parse_pins(pins).map_err(|e| {
        let var = match &e {
            crate::core::settings::PinError::BadValue { key, .. }
            | crate::core::settings::PinError::Twice(key) => {
                crate::core::settings::pin_var(key).map_or("", |v| v.env)
            }
            crate::core::settings::PinError::Unknown(_) => "",
        };
        SlurmError::Job(format!("{var}: {e}"))
    })
}

/// Slurm job ids are decimal numbers; anything else is refused before it
/// becomes part of a file name.
pub fn check_job_id(id: &str) -> Result<(), SlurmError> {
    if !id.is_empty() && id.len() <= 20 && id.bytes().all(|b| b.is_ascii_digit()) {
        Ok(())
    } else {
        Err(SlurmError::Job(format!(
            "SLURM_JOB_ID=`{id}` is not a job number"
        )))
    }
}

/// Physical GPU indices of the job on this node: `SLURM_JOB_GPUS` (set by
/// Slurm for GPU gres), else `CUDA_VISIBLE_DEVICES` when it holds indices.
pub fn gpu_indices(env: &Env) -> Result<Vec<u32>, SlurmError> {
    for var in ["SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"] {
        let Some(v) = non_empty(env.get(var)) else {
            continue;
        };
        let parsed: Result<Vec<u32>, _> = v.split(',').map(|s| s.trim().parse::<u32>()).collect();
        match parsed {
            Ok(list) => return Ok(list),
            // CUDA_VISIBLE_DEVICES may hold UUIDs or MIG ids: no indices then.
            Err(_) if var == "CUDA_VISIBLE_DEVICES" => return Ok(Vec::new()),
            Err(_) => {
                return Err(SlurmError::Job(format!(
                    "{var}=`{v}` is not a list of GPU indices"
                )))
            }
        }
    }
    Ok(Vec::new())
}

// === the job's device on a MIG node ===
//
// With `AutoDetect=nvml` Slurm makes every MIG slice a gres/gpu of its own
// (gres.html, "MIG Management"; slurm's gpu_nvml.c `_handle_mig`) and gives
// the job (Prolog, Epilog, TaskProlog, tasks) the slice in
// `CUDA_VISIBLE_DEVICES` by its "unique id": `MIG-<uuid>`, the MIG
// device's own UUID, with drivers from 470.42.01 on, else
// `MIG-GPU-<card uuid>/<GPU instance id>/<compute instance id>` (the form
// CUDA 11.0-11.3 took). `SLURM_JOB_GPUS` / `SLURM_STEP_GPUS` then hold the
// slice's gres index (its place among the node's gres/gpu devices), not an
// NVML card index, so only the UUID says which slice the job has.

/// One device `CUDA_VISIBLE_DEVICES` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VisibleDevice {
    /// A number: a whole GPU.
    Index(u32),
    /// `GPU-…`: a whole GPU by its UUID (CUDA accepts a unique prefix).
    GpuUuid(String),
    /// `MIG-…`: a MIG device by its own UUID (driver R470+).
    MigUuid(String),
    /// `MIG-GPU-<card uuid>/<gi>/<ci>`: a MIG device by its card and its
    /// GPU and compute instance ids (drivers before R470).
    MigInstance {
        parent_uuid: String,
        gpu_instance: u32,
        compute_instance: u32,
    },
}

impl VisibleDevice {
    /// Its mapping file name when it is a MIG device ([`mig_mapping_name`]).
    pub fn mapping_name(&self) -> Option<String> {
        match self {
            VisibleDevice::MigUuid(u) => mig_mapping_name(Some(u), None),
            VisibleDevice::MigInstance {
                parent_uuid,
                gpu_instance,
                compute_instance,
            } => mig_mapping_name(None, Some((parent_uuid, *gpu_instance, *compute_instance))),
            _ => None,
        }
    }

    fn is_mig(&self) -> bool {
        matches!(
            self,
            VisibleDevice::MigUuid(_) | VisibleDevice::MigInstance { .. }
        )
    }

    /// Reads one entry; None for one CUDA would not take (CUDA stops at it).
    fn parse(token: &str) -> Option<VisibleDevice> {
        let t = token.trim();
        if let Some(rest) = t.strip_prefix("MIG-GPU-") {
            let mut parts = rest.split('/');
            let card = parts.next().filter(|u| !u.is_empty())?;
            let gi = parts.next()?.parse().ok()?;
            let ci = parts.next()?.parse().ok()?;
            if parts.next().is_some() {
                return None;
            }
            return Some(VisibleDevice::MigInstance {
                parent_uuid: format!("GPU-{card}"),
                gpu_instance: gi,
                compute_instance: ci,
            });
        }
        if t.len() > "MIG-".len() && t.starts_with("MIG-") {
            return Some(VisibleDevice::MigUuid(t.to_string()));
        }
        if t.len() > "GPU-".len() && t.starts_with("GPU-") {
            return Some(VisibleDevice::GpuUuid(t.to_string()));
        }
        t.parse().ok().map(VisibleDevice::Index)
    }

    /// Whether `g` (an entry of the sidecar's `/v1/gpus`) is this device.
    fn names(&self, g: &GpuInfo) -> bool {
        match (self, &g.mig) {
            (VisibleDevice::Index(i), None) => g.index == *i,
            (VisibleDevice::GpuUuid(u), None) => g.uuid.starts_with(u.as_str()),
            (VisibleDevice::MigUuid(u), Some(_)) => g.uuid.starts_with(u.as_str()),
            (
                VisibleDevice::MigInstance {
                    parent_uuid,
                    gpu_instance,
                    compute_instance,
                },
                Some(m),
            ) => {
                m.parent_uuid == *parent_uuid
                    // A sidecar that does not know the instance ids: any
                    // slice of that card may be the one.
                    && m.gpu_instance_id.is_none_or(|gi| gi == *gpu_instance)
                    && m.compute_instance_id.is_none_or(|ci| ci == *compute_instance)
            }
            _ => false,
        }
    }
}

/// The devices `CUDA_VISIBLE_DEVICES` names, in order, up to the first
/// entry CUDA would not take (CUDA hides it and every later one; Slurm's
/// `NoDevFiles` is such an entry). Empty when unset.
pub fn visible_devices(env: &Env) -> Vec<VisibleDevice> {
    non_empty(env.get("CUDA_VISIBLE_DEVICES"))
        .map(|v| {
            v.split(',')
                .map_while(VisibleDevice::parse)
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
}

/// The sidecar device a job is planned for, and what to say about it.
#[derive(Debug, Clone, PartialEq)]
pub struct DevicePick<'a> {
    pub device: &'a GpuInfo,
    /// A sentence for the suggestion's reasoning (which MIG slice, and why
    /// that one); None for a whole GPU.
    pub note: Option<String>,
}

/// The device of the sidecar's list (`/v1/gpus`, a card in MIG mode listed
/// then each of its slices) the job is planned for:
/// - the MIG slices `CUDA_VISIBLE_DEVICES` names, matched by UUID (or card
///   and instance ids): the smallest of them, so one set of settings fits
///   every rank whatever slice it got;
/// - else the whole GPU of the first of `indices` (`SLURM_JOB_GPUS`) or of
///   `CUDA_VISIBLE_DEVICES`' numbers;
/// - else, on a node with MIG slices, the smallest usable device (the job's
///   slice cannot be told: planning for a larger one could run it out of
///   memory); else the first GPU.
///
/// None when the list has no device a job can run on.
pub fn pick_job_device<'a>(
    gpus: &'a [GpuInfo],
    visible: &[VisibleDevice],
    indices: &[u32],
) -> Option<DevicePick<'a>> {
    let usable: Vec<&GpuInfo> = crate::sidecar::usable_devices(gpus).collect();
    let smallest = |list: &[&'a GpuInfo]| -> Option<&'a GpuInfo> {
        // The first of the smallest: the sidecar's order breaks ties.
        list.iter().copied().reduce(|a, b| {
            if b.memory_total_bytes < a.memory_total_bytes {
                b
            } else {
                a
            }
        })
    };
    let slice = |g: &GpuInfo| -> String {
        match &g.mig {
            Some(m) => format!("MIG slice {} ({}) of GPU {}", m.profile, g.uuid, g.index),
            None => format!("GPU {} ({})", g.index, g.uuid),
        }
    };
    let on_mig_node = usable.iter().any(|g| g.mig.is_some());
    if visible.iter().any(VisibleDevice::is_mig) {
        let mut mine: Vec<&GpuInfo> = Vec::new();
        for want in visible {
            for g in usable.iter().copied().filter(|g| want.names(g)) {
                if !mine.iter().any(|m| std::ptr::eq(*m, g)) {
                    mine.push(g);
                }
            }
        }
        if let Some(g) = smallest(&mine) {
            let note = if mine.len() == 1 {
                format!("Planned for the job's {} (CUDA_VISIBLE_DEVICES).", slice(g))
            } else {
                let all: Vec<String> = mine
                    .iter()
                    .map(|m| {
                        m.mig
                            .as_ref()
                            .map_or_else(|| m.name.clone(), |s| s.profile.clone())
                    })
                    .collect();
                format!(
                    "Planned for {}, the smallest of the job's {} devices ({}), so one set of settings fits every rank.",
                    slice(g),
                    mine.len(),
                    all.join(", ")
                )
            };
            return Some(DevicePick {
                device: g,
                note: Some(note),
            });
        }
        let g = smallest(&usable)?;
        return Some(DevicePick {
            device: g,
            note: Some(format!(
                "The sidecar lists none of the MIG devices in CUDA_VISIBLE_DEVICES: planned for the smallest device on the node, {}.",
                slice(g)
            )),
        });
    }
    let by_index = indices
        .iter()
        .copied()
        .chain(visible.iter().filter_map(|v| match v {
            VisibleDevice::Index(i) => Some(*i),
            _ => None,
        }))
        .next()
        .and_then(|want| {
            usable
                .iter()
                .copied()
                .find(|g| g.mig.is_none() && g.index == want)
        });
    let by_uuid = || {
        visible
            .iter()
            .filter(|v| matches!(v, VisibleDevice::GpuUuid(_)))
            .find_map(|v| usable.iter().copied().find(|g| v.names(g)))
    };
    if let Some(g) = by_index.or_else(by_uuid) {
        return Some(DevicePick {
            device: g,
            note: None,
        });
    }
    if on_mig_node {
        let g = smallest(&usable)?;
        return Some(DevicePick {
            device: g,
            note: Some(format!(
                "CUDA_VISIBLE_DEVICES names no MIG device of this node: planned for the smallest device on it, {}.",
                slice(g)
            )),
        });
    }
    usable.first().map(|g| DevicePick {
        device: g,
        note: None,
    })
}

fn parse_num<T: std::str::FromStr>(
    f: &BTreeMap<String, String>,
    key: &str,
) -> Result<Option<T>, SlurmError> {
    parse_with(f, key, |s| {
        s.parse::<T>()
            .map_err(|_| format!("`{s}` is not a whole number"))
    })
}

fn parse_with<T, E: std::fmt::Display>(
    f: &BTreeMap<String, String>,
    key: &str,
    p: impl Fn(&str) -> Result<T, E>,
) -> Result<Option<T>, SlurmError> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => p(v.trim())
            .map(Some)
            .map_err(|e| SlurmError::Job(format!("GPUFIT_{}: {e}", key.to_ascii_uppercase()))),
    }
}

// === what the TaskProlog prints ===

/// The `export NAME=value` lines for a suggestion. Slurm takes the value
/// literally up to the end of the line, so values are single-line.
pub fn exports(job_id: &str, s: &Suggestion) -> Vec<String> {
    let source = serde_json::to_value(s.source)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{:?}", s.source));
    // The same names and spellings the Kubernetes controller injects.
    let mut pairs = crate::core::settings::env_vars(&s.settings);
    pairs.extend([
        ("GPUFIT_SUGGESTION_SOURCE", source),
        ("GPUFIT_CONFIDENCE", format!("{:.2}", s.confidence)),
        (
            "GPUFIT_PREDICTED_PEAK_BYTES",
            s.predicted_peak_bytes.to_string(),
        ),
        ("GPUFIT_GPU_MODEL", s.gpu.clone()),
        ("GPUFIT_REASONING", s.reasoning.clone()),
        ("GPUFIT_JOB_ID", job_id.to_string()),
        // Where the job's own result record goes (Python package), for the Epilog.
        (
            crate::core::result_record::RESULT_FILE_ENV,
            crate::core::result_record::slurm_result_path(job_id)
                .display()
                .to_string(),
        ),
    ]);
    pairs
        .into_iter()
        .map(|(k, v)| format!("export {k}={}", single_line(&v)))
        .collect()
}

fn single_line(v: &str) -> String {
    v.chars()
        .map(|c| {
            if c == '\n' || c == '\r' || c == '\0' {
                ' '
            } else {
                c
            }
        })
        .collect::<String>()
        .trim()
        .to_string()
}

// === per-job state: TaskProlog → Epilog ===

/// What the TaskProlog decided, saved for the Epilog (which does not see
/// the job's `--export` variables nor the TaskProlog's exports).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedDecision {
    pub job_id: String,
    pub workload: WorkloadSpec,
    pub suggestion: Suggestion,
    /// When the TaskProlog ran (the run's start, for its duration).
    pub started_at: DateTime<Utc>,
    pub node: Option<String>,
    /// `SLURM_JOB_NAME` as the TaskProlog saw it: the Epilog has no such
    /// variable, and `--output=%x-%j.out` needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
}

/// The state file of a job.
/// One per job and node, `job-<id>.<node>.json`: every node of a
/// multi-node job runs its own TaskProlog and Epilog, and a state dir on
/// a shared file system (or two slurmd on one host) must not let one
/// node's Epilog take another's file. Without a usable node name (a hook
/// run by hand), `job-<id>.json`, which is also what earlier gpufit
/// versions wrote for every job: the Epilog falls back to it.
pub fn state_path(state_dir: &Path, job_id: &str, node: Option<&str>) -> PathBuf {
    match node.filter(|n| is_node_name(n)) {
        Some(n) => state_dir.join(format!("job-{job_id}.{n}.json")),
        None => state_dir.join(format!("job-{job_id}.json")),
    }
}

// === Prolog: GPU → job mapping ===

/// What the Prolog writes: one file per GPU index holding the job id
/// (dcgm-exporter's HPC job-mapping convention), read by the sidecar.
pub fn mapping_files(mapping_dir: &Path, job_id: &str, gpus: &[u32]) -> Vec<(PathBuf, String)> {
    let names: Vec<String> = gpus.iter().map(u32::to_string).collect();
    mapping_files_named(mapping_dir, job_id, &names)
}

/// One mapping file per name (see [`mapping_names`]), holding the job id.
pub fn mapping_files_named(
    mapping_dir: &Path,
    job_id: &str,
    names: &[String],
) -> Vec<(PathBuf, String)> {
    names
        .iter()
        .map(|n| (mapping_dir.join(n), format!("{job_id}\n")))
        .collect()
}

/// The mapping files' names for a job: on a MIG node the MIG devices
/// `CUDA_VISIBLE_DEVICES` names (the Prolog's and Epilog's environment
/// carries them, `gres_common.c`; `SLURM_JOB_GPUS` is then a gres index,
/// no card's), each as [`mig_mapping_name`] spells it; else the job's GPU
/// indices ([`gpu_indices`]).
pub fn mapping_names(env: &Env) -> Result<Vec<String>, SlurmError> {
    let mig: Vec<String> = visible_devices(env)
        .iter()
        .filter_map(VisibleDevice::mapping_name)
        .collect();
    if !mig.is_empty() {
        return Ok(mig);
    }
    Ok(gpu_indices(env)?.iter().map(u32::to_string).collect())
}

/// The mapping file name of a MIG device: its `MIG-<uuid>`, or for the
/// `MIG-GPU-<card uuid>/<gi>/<ci>` form `MIG-GPU-<card uuid>_<gi>_<ci>` (a
/// file name holds no `/`). The sidecar looks a slice up by both. None for
/// an id with anything but letters, digits and `-` (never a path).
pub fn mig_mapping_name(uuid: Option<&str>, instance: Option<(&str, u32, u32)>) -> Option<String> {
    let safe = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    match (uuid, instance) {
        (Some(u), _) if u.starts_with("MIG-") && safe(u) => Some(u.to_string()),
        (_, Some((parent, gi, ci))) if parent.starts_with("GPU-") && safe(parent) => {
            Some(format!("MIG-{parent}_{gi}_{ci}"))
        }
        _ => None,
    }
}

// === Epilog: the run ===

/// How the job ended, as the Epilog reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobEnd {
    /// `SLURM_JOB_EXIT_CODE` (a wait(2) status: 0 = success).
    pub exit_status: Option<i64>,
    /// `SLURM_JOB_DERIVED_EC`: highest exit status of the job's steps.
    pub derived_status: Option<i64>,
    /// A CUDA out-of-memory error was found in the job's output.
    pub oom: bool,
    /// The job was killed for host memory: Slurm's `OUT_OF_MEMORY` state or
    /// a cgroup oom-kill line in its output. Not a GPU OOM.
    pub host_oom: bool,
    /// Peak GPU memory of the job from the sidecar.
    pub peak_memory_bytes: Option<u64>,
    /// What the job's own output says (log parsers), when it says anything.
    pub log: LogFacts,
    /// The settings the job's result record says it ran.
    pub record: Option<crate::core::result_record::StatedSettings>,
    pub ended_at: DateTime<Utc>,
}

/// Figures a job's own log states (torchtune, HF Trainer, Lightning lines).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogFacts {
    /// The peak the log states; preferred over the sidecar's sampled figure
    /// (the job's own statement of its peak wins: it is the allocator's figure,
    /// not a sample; docs/design.md, "Measuring peaks").
    pub peak_memory_bytes: Option<u64>,
    pub tokens_per_sec: Option<f64>,
    pub samples_per_sec: Option<f64>,
    /// The settings the log states (HF Trainer, torchtune, Lightning).
    pub stated: Option<crate::core::result_record::StatedSettings>,
}

/// How many hosts a Slurm node list names (`gpu[01-04,07],cpu1` → 6);
/// None when it cannot be read.
pub fn count_nodes(nodelist: &str) -> Option<u32> {
    let mut total = 0u32;
    let (mut depth, mut start) = (0usize, 0usize);
    let list = nodelist.trim();
    let mut items = Vec::new();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[start..]);
    for item in items.into_iter().filter(|i| !i.is_empty()) {
        // Each bracket group multiplies the hosts (`r[1-2]n[1-4]` → 8).
        let mut hosts = 1u32;
        let mut rest = item;
        while let Some(open) = rest.find('[') {
            let close = rest[open..].find(']')? + open;
            let mut n = 0u32;
            for range in rest[open + 1..close].split(',') {
                n += match range.split_once('-') {
                    Some((lo, hi)) => {
                        let (lo, hi) = (lo.parse::<u32>().ok()?, hi.parse::<u32>().ok()?);
                        hi.checked_sub(lo)? + 1
                    }
                    None => range.parse::<u32>().map(|_| 1).ok()?,
                };
            }
            hosts = hosts.saturating_mul(n);
            rest = &rest[close + 1..];
        }
        total = total.saturating_add(hosts);
    }
    (total > 0).then_some(total)
}

/// The nodes a job runs on (each node's Epilog reports its own peak into
/// the job's one record): `SLURM_JOB_NUM_NODES`, else counted from the node
/// list, else 1.
pub fn job_nodes(env: &Env) -> u32 {
    non_empty(env.get("SLURM_JOB_NUM_NODES"))
        .or_else(|| non_empty(env.get("SLURM_NNODES")))
        .and_then(|n| n.parse::<u32>().ok())
        .or_else(|| {
            non_empty(env.get("SLURM_JOB_NODELIST"))
                .or_else(|| non_empty(env.get("SLURM_NODELIST")))
                .and_then(|l| count_nodes(&l))
        })
        .unwrap_or(1)
        .max(1)
}

/// Reads the exit state from the Epilog's environment.
pub fn exit_state(env: &Env) -> (Option<i64>, Option<i64>) {
    let num = |k: &str| non_empty(env.get(k)).and_then(|v| v.parse::<i64>().ok());
    (num("SLURM_JOB_EXIT_CODE"), num("SLURM_JOB_DERIVED_EC"))
}

/// The run record of a finished job.
pub fn build_run(
    state: &SavedDecision,
    outcome: &JobEnd,
    cluster: Option<String>,
    node: Option<String>,
) -> RunRecord {
    let failed_exit = outcome.exit_status.is_some_and(|s| s != 0)
        || outcome.derived_status.is_some_and(|s| s != 0);
    // A GPU OOM is the micro batch's lesson; a host kill the data loader's
    // (the one rule: RunOutcome::of).
    let ended = RunOutcome::of(
        !failed_exit && outcome.exit_status.is_some(),
        outcome.oom,
        outcome.host_oom,
    );
    let duration = (outcome.ended_at - state.started_at).num_milliseconds() as f64 / 1000.0;
    let s = &state.suggestion;
    // The catalog's canonical name and the method the name implies, so the
    // run lands on the key the advisor queries.
    let resolved = crate::service::resolve_workload(&state.workload).ok();
    let (model, method) = match &resolved {
        Some(w) => (w.model.name.clone(), w.method),
        None => (
            state.workload.model.clone(),
            state.workload.method.unwrap_or(Method::Full),
        ),
    };
    let origin = RunOrigin::new(RunSource::Slurm, outcome.ended_at)
        .cluster(cluster)
        .node(node.or_else(|| state.node.clone()))
        .job_id(Some(state.job_id.clone()));
    let key = RunKey {
        model,
        method,
        gpu_model: s.gpu.clone(),
        seq_len: state.workload.seq_len,
        lora_rank: state.workload.lora_rank,
        gpus: state.workload.gpus.unwrap_or(1),
        global_batch: state.workload.global_batch,
    };
    // What the job ran: its record, else what its log states; a Slurm job
    // gets settings only as variables, so nothing else confirms them.
    let confirmed = crate::core::confirm::confirm(
        &s.settings,
        &crate::core::confirm::Evidence {
            record: outcome.record.as_ref(),
            stated: outcome.log.stated.as_ref(),
            placeholders_filled: false,
        },
    );
    let ran_other = confirmed.confirmation == crate::core::confirm::Confirmation::RanOther;
    RunRecord::new(
        origin,
        key,
        confirmed.settings,
        RunResult {
            outcome: ended,
            peak_memory_bytes: outcome.log.peak_memory_bytes.or(outcome.peak_memory_bytes),
            samples_per_sec: outcome.log.samples_per_sec,
            tokens_per_sec: outcome.log.tokens_per_sec,
            duration_sec: (duration >= 0.0).then_some(duration),
        },
    )
    // The prediction was for the injected settings: none for others.
    .with_prediction((!ran_other).then_some(s.predicted_peak_bytes))
    .with_confirmation(confirmed.confirmation)
}

/// The job's output file: `SLURM_JOB_STDOUT` is the `--output` pattern as
/// given (`out/%j.out`), so its `%` fields are filled in here and a relative
/// path is taken from the job's working directory.
pub fn output_path(pattern: &str, env: &Env) -> Option<PathBuf> {
    if pattern.is_empty() || pattern == "/dev/null" {
        return None;
    }
    let get = |k: &str| env.get(k).cloned().unwrap_or_default();
    let job = get("SLURM_JOB_ID");
    let mut out = String::new();
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut width = String::new();
        while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            width.push(*d);
            chars.next();
        }
        let value = match chars.next() {
            Some('%') => "%".to_string(),
            Some('j') | Some('J') => job.clone(),
            Some('A') => env
                .get("SLURM_ARRAY_JOB_ID")
                .cloned()
                .unwrap_or_else(|| job.clone()),
            Some('a') => get("SLURM_ARRAY_TASK_ID"),
            Some('u') => get("SLURM_JOB_USER"),
            Some('x') => get("SLURM_JOB_NAME"),
            Some('N') => get("SLURMD_NODENAME"),
            // Node, step and task numbers of the batch script's output.
            Some('n') | Some('s') | Some('t') => "0".to_string(),
            Some(other) => format!("%{width}{other}"),
            None => "%".to_string(),
        };
        let w: usize = width.parse().unwrap_or(0);
        if value.len() < w && value.bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&"0".repeat(w - value.len()));
        }
        out.push_str(&value);
    }
    let path = PathBuf::from(out);
    if path.is_absolute() {
        Some(path)
    } else {
        env.get("SLURM_JOB_WORK_DIR")
            .map(|d| Path::new(d).join(path))
    }
}

/// Whether `scontrol show job` says the job ended out of host memory
/// (`JobState=OUT_OF_MEMORY`: its cgroup's OOM killer ended it).
pub fn scontrol_out_of_memory(out: &str) -> bool {
    out.split_whitespace()
        .any(|f| f == "JobState=OUT_OF_MEMORY")
}

/// `StdOut=` and `StdErr=` of `scontrol show job` output: slurmctld's
/// expanded paths (`%x`, `%j`, the default `slurm-%j.out` filled in).
/// Unset values (`(null)`, empty) are left out.
pub fn parse_scontrol_outputs(out: &str) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for field in out.split_whitespace() {
        let value = field
            .strip_prefix("StdOut=")
            .or_else(|| field.strip_prefix("StdErr="));
        if let Some(v) = value.filter(|v| !v.is_empty() && *v != "(null)" && *v != "/dev/null") {
            let p = PathBuf::from(v);
            if p.is_absolute() && !paths.contains(&p) {
                paths.push(p);
            }
        }
    }
    paths
}

/// Where the job's output may be, best first, without asking slurmctld:
/// `SLURM_JOB_STDOUT`/`SLURM_JOB_STDERR` when Slurm gives them (expanded
/// with the job name the TaskProlog kept, since the Epilog has no
/// `SLURM_JOB_NAME`), else Slurm's default `slurm-%j.out` (`slurm-%A_%a.out`
/// for an array task) in the job's working directory.
pub fn output_candidates(env: &Env, job_name: Option<&str>) -> Vec<PathBuf> {
    let mut env = env.clone();
    if let Some(name) = job_name.filter(|_| !env.contains_key("SLURM_JOB_NAME")) {
        env.insert("SLURM_JOB_NAME".into(), name.to_string());
    }
    let mut paths: Vec<PathBuf> = Vec::new();
    let given: Vec<&String> = ["SLURM_JOB_STDOUT", "SLURM_JOB_STDERR"]
        .iter()
        .filter_map(|k| env.get(*k))
        .filter(|p| !p.is_empty())
        .collect();
    for p in &given {
        if let Some(path) = output_path(p, &env) {
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
    }
    if given.is_empty() {
        let default = if env.contains_key("SLURM_ARRAY_TASK_ID") {
            "slurm-%A_%a.out"
        } else {
            "slurm-%j.out"
        };
        paths.extend(output_path(default, &env));
    }
    paths
}

#[cfg(test)]
mod tests;
