//! Mutating admission webhook (HTTPS, `POST /mutate`) for teams that do not
//! want a new resource: a `batch/v1` Job or a Kubeflow `PyTorchJob` that opts
//! in with the `gpufit.io/model` annotation gets the same injection as a
//! TrainingJob's Job ([`super::inject`]), in every pod template (every rank).
//!
//! - Objects without `gpufit.io/…` input annotations are allowed untouched.
//! - A bad annotation (unknown key, unparsable value, contradictory fields)
//!   is denied with a message that names it — never silently ignored.
//! - When gpufit cannot help (GPU unknown, history store down, nothing fits),
//!   the object is allowed untouched with a warning: gpufit never blocks a
//!   submission for its own problems (and the chart's `failurePolicy: Ignore`
//!   covers gpufit being down).
//!
//! Annotations (on the Job / PyTorchJob itself):
//!
//! | annotation                 | meaning                                         |
//! |----------------------------|-------------------------------------------------|
//! | `gpufit.io/model`          | catalog model id (opts in; required)            |
//! | `gpufit.io/seq-len`        | sequence length (required)                      |
//! | `gpufit.io/method`         | full, lora, qlora                               |
//! | `gpufit.io/lora-rank`      | LoRA rank                                       |
//! | `gpufit.io/lora-targets`   | comma list: q,k,v,o,gate,up,down,lm_head        |
//! | `gpufit.io/optimizer`      | adamw, adamw8bit, sgd, adafactor                |
//! | `gpufit.io/global-batch`   | global batch (kept exactly)                     |
//! | `gpufit.io/gpus`           | data-parallel GPUs (default: from the object)   |
//! | `gpufit.io/sharding`       | none, zero1, zero2, zero3, fsdp                 |
//! | `gpufit.io/framework`      | generic, hf, torchtune, litgpt, lightning       |
//! | `gpufit.io/attention`      | sdpa, eager                                     |
//! | `gpufit.io/strategy`       | conservative, balanced, aggressive              |
//! | `gpufit.io/gpu`            | GPU model (when nodes carry no GFD labels)      |
//! | `gpufit.io/mode`           | Inject (default) or Recommend                   |
//! | `gpufit.io/pins`           | `micro_batch_size=4,dtype=bf16,…`               |

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method as HttpMethod, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Namespace, Node, PodSpec};
use kube::api::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::Value;

use crate::core::advisor::{self, AdviceRequest, Strategy, StrategyTargets};
use crate::core::run::RunRecord;
use crate::core::settings::Pins;
use crate::core::similarity::HistoryQuery;
use crate::history::HistoryStore;

use super::crd::{Mode, WorkloadSpec};
use super::gpu;
use super::inject::{self, ANN_APPLIED, ANN_REASON, ANN_RECOMMENDATION};
use super::metrics::Metrics;
use super::reconcile::MODE_KEY;
use super::validate::{check_pins, workload_from_spec};
use super::ControllerError;

/// The path the webhook answers on.
pub const PATH: &str = "/mutate";
/// Largest AdmissionReview accepted (the API server's own request limit is 3 MiB).
const MAX_BODY: usize = 8 << 20;

const INPUT_KEYS: [&str; 15] = [
    "model",
    "seq-len",
    "method",
    "lora-rank",
    "lora-targets",
    "optimizer",
    "global-batch",
    "gpus",
    "sharding",
    "framework",
    "attention",
    "strategy",
    "gpu",
    "mode",
    "pins",
];

/// What the webhook needs to decide.
pub struct WebhookState {
    pub history: Arc<dyn HistoryStore>,
    /// Nodes (GPU Feature Discovery labels).
    pub nodes: Store<Node>,
    /// Namespaces (the `gpufit.io/mode` label).
    pub namespaces: Store<Namespace>,
    pub metrics: Metrics,
    pub targets: StrategyTargets,
    /// Mode when neither the annotation nor the namespace's label says.
    pub default_mode: Mode,
    /// Recent history answers, so a burst of submissions of one workload
    /// does not run the same history query for each.
    pub cache: HistoryCache,
}

/// Similar-run lists by query, kept for [`HistoryCache::TTL`]. The history
/// changes when jobs finish (minutes), so a suggestion made from a view a few
/// seconds old is as good; the size is bounded (cleared when full).
#[derive(Debug, Default)]
pub struct HistoryCache {
    entries: std::sync::Mutex<std::collections::HashMap<HistoryQuery, CachedRuns>>,
}

/// When a similar-run list was read, and the list.
type CachedRuns = (Instant, Arc<Vec<RunRecord>>);

impl HistoryCache {
    /// How long an answer is reused.
    pub const TTL: std::time::Duration = std::time::Duration::from_secs(10);
    /// Most queries held.
    const MAX: usize = 4096;

    /// The cached answer, or the store's (then cached).
    pub fn similar(
        &self,
        store: &dyn HistoryStore,
        q: &HistoryQuery,
    ) -> Result<Arc<Vec<RunRecord>>, crate::history::HistoryError> {
        if let Ok(m) = self.entries.lock() {
            if let Some((at, runs)) = m.get(q) {
                if at.elapsed() < Self::TTL {
                    return Ok(runs.clone());
                }
            }
        }
        let runs = Arc::new(store.similar(q)?);
        if let Ok(mut m) = self.entries.lock() {
            if m.len() >= Self::MAX {
                m.clear();
            }
            m.insert(q.clone(), (Instant::now(), runs.clone()));
        }
        Ok(runs)
    }
}

/// Where and with which certificate the webhook listens.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
}

// === Admission ===

/// A bad annotation: denied with this message.
#[derive(Debug, Clone, PartialEq)]
struct Denied(String);

fn denied(key: &str, msg: impl std::fmt::Display) -> Denied {
    Denied(format!("gpufit: annotation {key}: {msg}"))
}

/// Answers one AdmissionReview (JSON bytes as the API server sends them).
pub fn review(body: &[u8], state: &WebhookState) -> AdmissionReview<DynamicObject> {
    let start = Instant::now();
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return AdmissionResponse::invalid(format!("not an AdmissionReview: {e}")).into_review()
        }
    };
    let req: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(_) => {
            return AdmissionResponse::invalid("AdmissionReview without a request").into_review()
        }
    };
    let kind = match req.kind.kind.as_str() {
        "Job" => "Job",
        "PyTorchJob" => "PyTorchJob",
        _ => "other",
    };
    let (resp, result) = admit(&req, state);
    state
        .metrics
        .webhook_requests
        .with_label_values(&[kind, result])
        .inc();
    state
        .metrics
        .webhook_duration
        .with_label_values(&[kind])
        .observe(start.elapsed().as_secs_f64());
    resp.into_review()
}

/// Decides one request; the label says what happened (for metrics).
fn admit(
    req: &AdmissionRequest<DynamicObject>,
    state: &WebhookState,
) -> (AdmissionResponse, &'static str) {
    let resp = AdmissionResponse::from(req);
    if req.operation != Operation::Create {
        return (resp, "untouched");
    }
    let Some(obj) = &req.object else {
        return (resp, "untouched");
    };
    let original = match serde_json::to_value(obj) {
        Ok(v) => v,
        Err(e) => {
            return (
                resp.deny(format!("gpufit: cannot read the object: {e}")),
                "error",
            )
        }
    };
    let anns: BTreeMap<String, String> = obj.metadata.annotations.clone().unwrap_or_default();
    match plan(req, &original, &anns, state) {
        Ok(Plan::Untouched) => (resp, "untouched"),
        Ok(Plan::Warn(w)) => {
            let mut resp = resp;
            resp.warnings = Some(vec![w]);
            (resp, "untouched")
        }
        Ok(Plan::Mutate(mutated, warnings)) => {
            let patch = json_patch::diff(&original, &mutated);
            match resp.with_patch(patch) {
                Ok(mut r) => {
                    if !warnings.is_empty() {
                        r.warnings = Some(warnings);
                    }
                    (r, "mutated")
                }
                Err(e) => (
                    AdmissionResponse::from(req)
                        .deny(format!("gpufit: cannot encode the patch: {e}")),
                    "error",
                ),
            }
        }
        Err(Denied(msg)) => (resp.deny(msg), "denied"),
    }
}

enum Plan {
    Untouched,
    /// Allowed untouched, with a warning for the submitter.
    Warn(String),
    /// The mutated object and warnings.
    Mutate(Value, Vec<String>),
}

fn plan(
    req: &AdmissionRequest<DynamicObject>,
    original: &Value,
    anns: &BTreeMap<String, String>,
    state: &WebhookState,
) -> Result<Plan, Denied> {
    let ours: BTreeMap<&str, &str> = anns
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("gpufit.io/").map(|k| (k, v.as_str())))
        .collect();
    // Already handled (reinvocation, or a Job the reconciler created).
    if ours.contains_key(ANN_APPLIED.trim_start_matches("gpufit.io/"))
        || ours.contains_key(ANN_RECOMMENDATION.trim_start_matches("gpufit.io/"))
    {
        return Ok(Plan::Untouched);
    }
    let inputs: BTreeMap<&str, &str> = ours
        .iter()
        .filter(|(k, _)| **k != ANN_REASON.trim_start_matches("gpufit.io/"))
        .map(|(k, v)| (*k, *v))
        .collect();
    if inputs.is_empty() {
        return Ok(Plan::Untouched);
    }
    for k in inputs.keys() {
        if !INPUT_KEYS.contains(k) {
            return Err(denied(
                &format!("gpufit.io/{k}"),
                format!(
                    "unknown; known annotations are {}",
                    INPUT_KEYS.map(|k| format!("gpufit.io/{k}")).join(", ")
                ),
            ));
        }
    }
    if !inputs.contains_key("model") {
        return Err(denied(
            "gpufit.io/model",
            "missing: other gpufit.io annotations are set, so name the model (e.g. meta-llama/Llama-3.1-8B) to opt in, or remove them",
        ));
    }

    let templates = template_pointers(&req.kind.kind, original);
    if templates.is_empty() {
        return Err(Denied(format!(
            "gpufit: a {} with gpufit.io annotations must have a pod template",
            req.kind.kind
        )));
    }
    let first_pod: Option<PodSpec> = original
        .pointer(&format!("{}/spec", templates[0]))
        .and_then(|v| serde_json::from_value(v.clone()).ok());

    let (workload_spec, strategy, mode, pins, gpu_name) =
        parse_annotations(&inputs, original, &templates)?;
    let workload = workload_from_spec(&workload_spec, "annotations").map_err(|e| {
        Denied(format!(
            "gpufit: {}",
            e.to_string()
                .replace("annotations.seqLen", "gpufit.io/seq-len")
                .replace("annotations.loraRank", "gpufit.io/lora-rank")
                .replace("annotations.loraTargets", "gpufit.io/lora-targets")
                .replace("annotations.model", "gpufit.io/model")
                .replace("annotations.method", "gpufit.io/method")
        ))
    })?;
    check_pins(&pins, &workload, "gpufit.io/pins").map_err(|e| Denied(format!("gpufit: {e}")))?;
    let mode = match mode {
        Some(m) => m,
        None => namespace_mode(req.namespace.as_deref(), &state.namespaces)?
            .unwrap_or(state.default_mode),
    };

    let gpu = match &gpu_name {
        Some(name) => gpu::resolve_named(name).map_err(|e| denied("gpufit.io/gpu", e))?,
        None => {
            let nodes = state.nodes.state();
            match gpu::resolve_from_nodes(nodes.iter().map(|n| n.as_ref()), first_pod.as_ref()) {
                Ok(g) => g,
                Err(e) => {
                    return Ok(Plan::Warn(format!(
                        "gpufit did not change this object: {e} (or annotate gpufit.io/gpu)"
                    )))
                }
            }
        }
    };
    let query = HistoryQuery::new(
        &workload.model.name,
        workload.method,
        &gpu.name,
        workload.seq_len,
    );
    let history = match state.cache.similar(state.history.as_ref(), &query) {
        Ok(h) => h,
        Err(e) => {
            return Ok(Plan::Warn(format!(
                "gpufit did not change this object: history store unavailable: {e}"
            )))
        }
    };
    let suggestion = match advisor::suggest(&AdviceRequest {
        workload: &workload,
        gpu: &gpu,
        strategy,
        targets: state.targets,
        pins: &pins,
        history: &history,
    }) {
        Ok(s) => {
            state
                .metrics
                .suggestions
                .with_label_values(&[s.source.as_str(), s.strategy.as_str(), "webhook"])
                .inc();
            state.metrics.suggestion_confidence.observe(s.confidence);
            s
        }
        // The global batch is scientific: settings that cannot keep it
        // exactly are refused with the reason, not silently let through.
        Err(e @ advisor::AdvisorError::GlobalBatch { .. }) => {
            return Err(Denied(format!("gpufit: {e}")));
        }
        Err(e) => {
            return Ok(Plan::Warn(format!(
                "gpufit did not change this object: {e}"
            )))
        }
    };

    let mut mutated = original.clone();
    if let Some(meta) = mutated.get_mut("metadata") {
        inject::add_annotations(meta, &inject::annotations(&suggestion, mode));
    }
    for ptr in &templates {
        if let Some(t) = mutated.pointer_mut(ptr) {
            inject::inject_pod_template(t, &suggestion, mode, mode == Mode::Inject);
        }
    }
    Ok(Plan::Mutate(mutated, suggestion.warnings.clone()))
}

/// JSON pointers of every pod template in the object (every rank).
fn template_pointers(kind: &str, obj: &Value) -> Vec<String> {
    match kind {
        "PyTorchJob" => obj
            .pointer("/spec/pytorchReplicaSpecs")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter(|(_, v)| v.get("template").is_some())
                    .map(|(k, _)| {
                        format!("/spec/pytorchReplicaSpecs/{}/template", escape_pointer(k))
                    })
                    .collect()
            })
            .unwrap_or_default(),
        _ => {
            if obj.pointer("/spec/template").is_some() {
                vec!["/spec/template".to_string()]
            } else {
                vec![]
            }
        }
    }
}

fn escape_pointer(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

fn gpu_limit(template: &Value) -> u32 {
    template
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c.pointer("/resources/limits/nvidia.com~1gpu"))
                .filter_map(|v| match v {
                    Value::String(s) => s.parse::<u32>().ok(),
                    Value::Number(n) => n.as_u64().map(|n| n as u32),
                    _ => None,
                })
                .sum::<u32>()
        })
        .unwrap_or(0)
        .max(1)
}

/// Data-parallel GPUs of the object when `gpufit.io/gpus` is not given:
/// a Job's parallelism × GPUs per pod; a PyTorchJob's replicas × GPUs per pod.
fn default_gpus(obj: &Value, templates: &[String]) -> u32 {
    let mut total = 0u32;
    for ptr in templates {
        let Some(t) = obj.pointer(ptr) else { continue };
        let replicas = if ptr.starts_with("/spec/pytorchReplicaSpecs") {
            let parent = ptr.trim_end_matches("/template");
            obj.pointer(&format!("{parent}/replicas"))
                .and_then(Value::as_u64)
                .unwrap_or(1)
        } else {
            obj.pointer("/spec/parallelism")
                .and_then(Value::as_u64)
                .unwrap_or(1)
        };
        total = total.saturating_add((replicas as u32).saturating_mul(gpu_limit(t)));
    }
    total.max(1)
}

type Parsed = (WorkloadSpec, Strategy, Option<Mode>, Pins, Option<String>);

fn parse_annotations(
    a: &BTreeMap<&str, &str>,
    obj: &Value,
    templates: &[String],
) -> Result<Parsed, Denied> {
    fn num(a: &BTreeMap<&str, &str>, key: &str) -> Result<Option<u32>, Denied> {
        a.get(key)
            .map(|v| {
                v.trim().parse::<u32>().map_err(|_| {
                    denied(
                        &format!("gpufit.io/{key}"),
                        format!("`{v}` is not a whole number"),
                    )
                })
            })
            .transpose()
    }
    fn parsed<T: std::str::FromStr>(
        a: &BTreeMap<&str, &str>,
        key: &str,
        what: &str,
    ) -> Result<Option<T>, Denied> {
        a.get(key)
            .map(|v| {
                v.trim().parse::<T>().map_err(|_| {
                    denied(&format!("gpufit.io/{key}"), format!("`{v}` is not {what}"))
                })
            })
            .transpose()
    }
    fn serde_enum<T: serde::de::DeserializeOwned>(
        a: &BTreeMap<&str, &str>,
        key: &str,
        what: &str,
    ) -> Result<Option<T>, Denied> {
        a.get(key)
            .map(|v| {
                serde_json::from_value(Value::String(v.trim().to_ascii_lowercase())).map_err(|_| {
                    denied(
                        &format!("gpufit.io/{key}"),
                        format!("`{v}` is not one of {what}"),
                    )
                })
            })
            .transpose()
    }
    let seq_len = num(a, "seq-len")?.ok_or_else(|| {
        denied(
            "gpufit.io/seq-len",
            "missing: give the training sequence length in tokens, e.g. \"2048\"",
        )
    })?;
    let lora_targets = match a.get("lora-targets") {
        None => None,
        Some(v) => Some(
            v.split(',')
                .map(|t| t.trim())
                .filter(|t| !t.is_empty())
                .map(|t| {
                    serde_json::from_value(Value::String(t.to_ascii_lowercase())).map_err(|_| {
                        denied(
                            "gpufit.io/lora-targets",
                            format!("`{t}` is not one of q, k, v, o, gate, up, down, lm_head"),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let gpus = match num(a, "gpus")? {
        Some(g) => Some(g),
        None => Some(default_gpus(obj, templates)),
    };
    let w = WorkloadSpec {
        model: a.get("model").map(|s| s.trim().to_string()),
        architecture: None,
        method: parsed(a, "method", "full, lora or qlora")?,
        lora_rank: num(a, "lora-rank")?,
        lora_targets,
        seq_len,
        optimizer: serde_enum(a, "optimizer", "adamw, adamw8bit, sgd, adafactor")?,
        global_batch: num(a, "global-batch")?,
        gpus,
        sharding: serde_enum(a, "sharding", "none, zero1, zero2, zero3, fsdp")?,
        framework: serde_enum(a, "framework", "generic, hf, torchtune, litgpt, lightning")?,
        attention: serde_enum(a, "attention", "sdpa, eager")?,
    };
    let strategy = parsed::<Strategy>(a, "strategy", "conservative, balanced or aggressive")?
        .unwrap_or(Strategy::Balanced);
    let mode = parsed::<Mode>(a, "mode", "Inject or Recommend")?;
    let pins = match a.get("pins") {
        Some(v) => parse_pins(v)?,
        None => Pins::default(),
    };
    let gpu = a.get("gpu").map(|s| s.trim().to_string());
    if gpu.as_deref() == Some("") {
        return Err(denied("gpufit.io/gpu", "is empty"));
    }
    Ok((w, strategy, mode, pins, gpu))
}

/// `micro_batch_size=4,dtype=bf16,activation_checkpointing=true,…`
fn parse_pins(s: &str) -> Result<Pins, Denied> {
    let key = "gpufit.io/pins";
    let mut p = Pins::default();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((k, v)) = item.split_once('=') else {
            return Err(denied(key, format!("`{item}` is not name=value")));
        };
        let (k, v) = (k.trim(), v.trim());
        let int = |v: &str| {
            v.parse::<u32>()
                .map_err(|_| denied(key, format!("{k}: `{v}` is not a whole number")))
        };
        let boolean = |v: &str| match v.to_ascii_lowercase().as_str() {
            "true" | "on" | "1" | "yes" => Ok(true),
            "false" | "off" | "0" | "no" => Ok(false),
            _ => Err(denied(key, format!("{k}: `{v}` is not true or false"))),
        };
        match k {
            "micro_batch_size" => p.micro_batch_size = Some(int(v)?),
            "gradient_accumulation_steps" => p.gradient_accumulation_steps = Some(int(v)?),
            "dtype" => p.dtype = Some(v.parse().map_err(|e: String| denied(key, e))?),
            "activation_checkpointing" => p.activation_checkpointing = Some(boolean(v)?),
            "activation_offloading" => p.activation_offloading = Some(boolean(v)?),
            "compile" => p.compile = Some(boolean(v)?),
            "num_workers" => p.num_workers = Some(int(v)?),
            other => {
                return Err(denied(
                    key,
                    format!("`{other}` is not an engineering setting: use micro_batch_size, gradient_accumulation_steps, dtype, activation_checkpointing, activation_offloading, compile or num_workers"),
                ))
            }
        }
    }
    Ok(p)
}

fn namespace_mode(ns: Option<&str>, namespaces: &Store<Namespace>) -> Result<Option<Mode>, Denied> {
    let Some(ns) = ns else { return Ok(None) };
    let Some(obj) = namespaces.get(&ObjectRef::new(ns)) else {
        return Ok(None);
    };
    match obj.metadata.labels.as_ref().and_then(|l| l.get(MODE_KEY)) {
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|e: String| Denied(format!("gpufit: namespace {ns} label {MODE_KEY}: {e}"))),
        None => Ok(None),
    }
}

// === HTTPS server ===

/// Reads a PEM certificate chain and private key into a rustls key.
fn load_certified_key(
    cert: &Path,
    key: &Path,
) -> Result<rustls::sign::CertifiedKey, ControllerError> {
    let read = |p: &Path| {
        std::fs::read(p)
            .map_err(|e| ControllerError::Tls(format!("cannot read {}: {e}", p.display())))
    };
    let cert_pem = read(cert)?;
    let key_pem = read(key)?;
    let certs = rustls_pemfile::certs(&mut cert_pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            ControllerError::Tls(format!("{}: not a PEM certificate: {e}", cert.display()))
        })?;
    if certs.is_empty() {
        return Err(ControllerError::Tls(format!(
            "{} holds no certificate: pass the webhook's PEM certificate with --tls-cert",
            cert.display()
        )));
    }
    let key_der = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(|e| ControllerError::Tls(format!("{}: not a PEM key: {e}", key.display())))?
        .ok_or_else(|| {
            ControllerError::Tls(format!(
                "{} holds no private key: pass the webhook's PEM key with --tls-key",
                key.display()
            ))
        })?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key_der)
        .map_err(|e| ControllerError::Tls(format!("{}: unsupported key: {e}", key.display())))?;
    let ck = rustls::sign::CertifiedKey::new(certs, signing);
    ck.keys_match()
        .map_err(|e| ControllerError::Tls(format!("certificate and key do not match: {e}")))?;
    Ok(ck)
}

/// Serves the certificate files' current content: cert-manager (or the
/// chart's own rotation) replaces them in place, and new handshakes pick the
/// new pair up within [`RELOAD_CHECK`] without a restart. A pair that fails
/// to load keeps the previous one (and says so in the log).
#[derive(Debug)]
struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    state: std::sync::RwLock<CertState>,
}

#[derive(Debug)]
struct CertState {
    key: Arc<rustls::sign::CertifiedKey>,
    stamp: Option<(std::time::SystemTime, std::time::SystemTime)>,
    checked: Instant,
}

/// How often the certificate files are looked at.
const RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(30);

fn stamp(cert: &Path, key: &Path) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
    let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    Some((m(cert)?, m(key)?))
}

impl rustls::server::ResolvesServerCert for ReloadingCert {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let (current, due) = {
            let st = self.state.read().ok()?;
            (st.key.clone(), st.checked.elapsed() >= RELOAD_CHECK)
        };
        if !due {
            return Some(current);
        }
        let mut st = self.state.write().ok()?;
        st.checked = Instant::now();
        let now = stamp(&self.cert, &self.key);
        if now.is_some() && now != st.stamp {
            match load_certified_key(&self.cert, &self.key) {
                Ok(k) => {
                    tracing::info!(cert = %self.cert.display(), "webhook certificate reloaded");
                    st.key = Arc::new(k);
                    st.stamp = now;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "new webhook certificate not usable; keeping the previous one")
                }
            }
        }
        Some(st.key.clone())
    }
}

/// A rustls server config over the PEM certificate and key, reloaded when
/// the files change.
pub fn tls_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, ControllerError> {
    let first = load_certified_key(cert, key)?;
    let resolver = ReloadingCert {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        state: std::sync::RwLock::new(CertState {
            key: Arc::new(first),
            stamp: stamp(cert, key),
            checked: Instant::now(),
        }),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ControllerError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// A bound webhook listener; [`Self::local_addr`] tells the port (tests bind port 0).
pub struct WebhookServer {
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl WebhookServer {
    /// Binds the listener and loads the certificate.
    pub async fn bind(cfg: &WebhookConfig) -> Result<Self, ControllerError> {
        let tls = tls_config(&cfg.cert, &cfg.key)?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| ControllerError::Io {
                context: format!("cannot listen on {} for the webhook (is the port in use? pass --webhook-listen)", cfg.listen),
                source: e,
            })?;
        Ok(WebhookServer {
            listener,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
        })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `shutdown` resolves.
    pub async fn serve(
        self,
        state: Arc<WebhookState>,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), ControllerError> {
        tokio::pin!(shutdown);
        loop {
            let (tcp, peer) = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                r = self.listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => { tracing::warn!(error = %e, "webhook accept failed"); continue; }
                },
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = self.acceptor.clone();
            let state = state.clone();
            tokio::spawn(async move {
                let tls = match acceptor.accept(tcp).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                };
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(req, state).await) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await
                {
                    tracing::debug!(%peer, error = %e, "webhook connection ended");
                }
            });
        }
    }
}

/// Binds and serves in one call.
pub async fn serve(
    cfg: WebhookConfig,
    state: Arc<WebhookState>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ControllerError> {
    let server = WebhookServer::bind(&cfg).await?;
    tracing::info!(listen = %cfg.listen, path = PATH, "serving the admission webhook");
    server.serve(state, shutdown).await
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    state: Arc<WebhookState>,
) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: Vec<u8>, json: bool| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if json {
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
        }
        r
    };
    match (req.method(), req.uri().path()) {
        (&HttpMethod::GET, "/healthz") => reply(StatusCode::OK, b"ok\n".to_vec(), false),
        (&HttpMethod::POST, PATH) => {
            let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return reply(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("cannot read the request: {e}\n").into_bytes(),
                        false,
                    )
                }
            };
            // The history lookup is blocking (SQLite/PostgreSQL).
            let out = tokio::task::spawn_blocking(move || {
                let review = review(&body, &state);
                review_json(&review)
            })
            .await;
            match out {
                Ok(Ok(bytes)) => reply(StatusCode::OK, bytes, true),
                Ok(Err(e)) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("{e}\n").into_bytes(),
                    false,
                ),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("{e}\n").into_bytes(),
                    false,
                ),
            }
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            format!("not found: POST {PATH}\n").into_bytes(),
            false,
        ),
    }
}

/// The review as the API server expects it: like Go's `[]byte`, the JSON
/// patch travels as a base64 string (kube serializes it as an array of
/// numbers, which only some API server versions accept).
pub fn review_json(review: &AdmissionReview<DynamicObject>) -> Result<Vec<u8>, serde_json::Error> {
    let mut v = serde_json::to_value(review)?;
    if let Some(p) = v.pointer_mut("/response/patch") {
        if let Some(arr) = p.as_array() {
            let bytes: Vec<u8> = arr
                .iter()
                .filter_map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect();
            *p = Value::String(base64(&bytes));
        }
    }
    serde_json::to_vec(&v)
}

/// Standard base64 with padding (RFC 4648 §4).
fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(A[(n >> 18) as usize & 63] as char);
        out.push(A[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            A[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            A[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_test_vectors() {
        for (plain, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), enc);
        }
    }

    #[test]
    fn pins_annotation_parses_every_engineering_field_and_rejects_others() {
        let p = parse_pins("micro_batch_size=2, dtype=bf16, activation_checkpointing=on, compile=false, num_workers=8")
            .expect("valid pins");
        assert_eq!(p.micro_batch_size, Some(2));
        assert_eq!(p.activation_checkpointing, Some(true));
        assert_eq!(p.compile, Some(false));
        assert_eq!(p.num_workers, Some(8));
        let e = parse_pins("learning_rate=3e-4").expect_err("scientific field");
        assert!(e.0.contains("not an engineering setting"), "{}", e.0);
        assert!(parse_pins("micro_batch_size").is_err());
    }
}
