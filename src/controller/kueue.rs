//! Kueue (pure): what a `Workload` says about the job Kueue admitted — the
//! flavors and counts of its pod sets — and what gpufit's AdmissionCheck
//! answers. The I/O is in [`super::reconcile::kueue`].
//!
//! API read: `kueue.x-k8s.io/v1beta1` (Kueue v0.9 – v0.19; from v0.15 it is
//! also served as `v1beta2`, with the same shape for every field used here,
//! and v1beta1 stays served — deprecated — in v0.20). Fields, from Kueue's
//! `apis/kueue/v1beta1/workload_types.go`:
//!
//! - `spec.podSets[]`: `name` (default `main`; a batch Job's one pod set is
//!   `main`, a PyTorchJob's are its replica types lower-cased, `master` and
//!   `worker`), `count`, `minCount` (partial admission), `template`.
//! - `status.admission.podSetAssignments[]`: `name`, `flavors` (resource →
//!   ResourceFlavor name), `count` (the pods admitted: lower than the pod
//!   set's `count` under partial admission).
//! - `status.admissionChecks[]` (a map keyed by `name`): `state`
//!   (`Pending`, `Ready`, `Retry`, `Rejected`), `message`,
//!   `lastTransitionTime`, `podSetUpdates[]` (`name`, `labels`,
//!   `annotations`, `nodeSelector`, `tolerations`).
//! - `status.conditions`: `QuotaReserved`, `Admitted`, `Evicted`, `Finished`.
//!
//! Kueue adds the check as `Pending`; once quota is reserved it waits for
//! every check to be `Ready`, then merges each check's `podSetUpdates` into
//! the job's pod templates and unsuspends it. On eviction it suspends the
//! job, restores the templates, and resets every check to `Pending`
//! (clearing `podSetUpdates`); a new quota reservation clears `Evicted`.
//! So the check is answered when quota is reserved, the check is
//! `Pending`, and the workload is neither evicted nor finished — once per
//! admission.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt};
use serde::Deserialize;
use serde_json::{json, Value};

use super::gpu::{self, GpuError, Sharing};
use crate::core::catalog::GpuSpec;

pub use super::keys::CONTROLLER_NAME;
/// The label naming a job's LocalQueue.
pub const QUEUE_NAME: &str = "kueue.x-k8s.io/queue-name";
/// Kueue's API group.
pub const GROUP: &str = "kueue.x-k8s.io";
/// The API versions gpufit speaks, newest first: `v1beta2` (Kueue v0.15+,
/// the storage version from v0.16, the only one from v0.20) wherever it is
/// served, `v1beta1` only on a Kueue that serves nothing newer (≤ v0.14).
/// Every field gpufit reads or writes has the same shape in both
/// (`apis/kueue/v1beta{1,2}/workload_types.go`).
pub const VERSIONS: [&str; 2] = ["v1beta2", "v1beta1"];
/// The version assumed before discovery (tests, docs).
pub const VERSION: &str = "v1beta2";

/// The version to speak, given the versions of [`GROUP`] the API server
/// serves (its discovery): the newest gpufit knows; None when Kueue is not
/// installed or serves none of them.
pub fn pick_version<S: AsRef<str>>(served: &[S]) -> Option<&'static str> {
    VERSIONS
        .into_iter()
        .find(|v| served.iter().any(|s| s.as_ref() == *v))
}
/// The AdmissionCheck condition a ClusterQueue needs to be active.
pub const CONDITION_ACTIVE: &str = "Active";

/// The LocalQueue an object is queued in (its `metadata`), when it is:
/// the `kueue.x-k8s.io/queue-name` **label** only. The annotation of the
/// same name was removed in Kueue v0.15 (#7271) and no longer queues a
/// job (`jobframework.QueueNameForObject`).
pub fn queue_name(metadata: Option<&Value>) -> Option<&str> {
    metadata?
        .get("labels")?
        .get(QUEUE_NAME)?
        .as_str()
        .filter(|q| !q.trim().is_empty())
}

/// The LocalQueue Kueue's LocalQueueDefaulting gives a job without a
/// queue label (beta and on since v0.12, GA in v0.17): a LocalQueue of
/// this name in the job's namespace.
pub const DEFAULT_LOCAL_QUEUE: &str = "default";

/// Kueue's default `integrations.frameworks` (its
/// `config/components/manager/controller_manager_config.yaml`, main
/// `ff69552`), the training kinds among them: the PyTorchJob integration
/// is off by default (and deprecated), so a labelled PyTorchJob is not
/// suspended by Kueue and must be configured at creation.
pub const DEFAULT_FRAMEWORKS: [&str; 3] = [
    "batch/job",
    "jobset.x-k8s.io/jobset",
    "trainer.kubeflow.org/trainjob",
];

/// What gpufit knows of the cluster's Kueue configuration (the admin
/// copies it into the controller's flags), and the LocalQueues it sees.
#[derive(Clone, Default)]
pub struct KueueConfig {
    /// gpufit answers Kueue's checks (`--kueue`). Without it no job is
    /// treated as queued: a deferred setting would never be answered, so
    /// a job Kueue queues anyway is configured at creation instead.
    pub enabled: bool,
    /// `manageJobsWithoutQueueName` and `managedJobsNamespaceSelector`.
    pub unlabelled: Unlabelled,
    /// `integrations.frameworks` (None: Kueue's default, [`DEFAULT_FRAMEWORKS`]).
    pub frameworks: Option<BTreeSet<String>>,
    /// The LocalQueues (a reflector), for LocalQueueDefaulting; None when
    /// not watched (Kueue support off).
    pub local_queues: Option<kube::runtime::reflector::Store<kube::api::DynamicObject>>,
}

impl std::fmt::Debug for KueueConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KueueConfig")
            .field("enabled", &self.enabled)
            .field("unlabelled", &self.unlabelled)
            .field("frameworks", &self.frameworks)
            .field("local_queues", &self.local_queues.is_some())
            .finish()
    }
}

impl KueueConfig {
    /// Whether Kueue's integration `framework` is enabled.
    pub fn framework_enabled(&self, framework: &str) -> bool {
        match &self.frameworks {
            Some(f) => f.contains(framework),
            None => DEFAULT_FRAMEWORKS.contains(&framework),
        }
    }

    /// Whether namespace `ns` has a LocalQueue named [`DEFAULT_LOCAL_QUEUE`].
    pub fn has_default_local_queue(&self, ns: &str) -> bool {
        self.local_queues.as_ref().is_some_and(|s| {
            s.state().iter().any(|q| {
                q.metadata.namespace.as_deref() == Some(ns)
                    && q.metadata.name.as_deref() == Some(DEFAULT_LOCAL_QUEUE)
            })
        })
    }

    /// The LocalQueue Kueue will queue this object in, decided as Kueue
    /// decides (`jobframework`: `WorkloadShouldBeSuspended`,
    /// `ApplyDefaultLocalQueue`), or None when Kueue will not manage it:
    ///
    /// 1. its kind's integration is not enabled: not Kueue's;
    /// 2. a child of a kind Kueue admits as a whole: admitted with its owner;
    /// 3. the queue-name label: that queue;
    /// 4. LocalQueueDefaulting: a LocalQueue `default` in its namespace,
    ///    and the namespace in `managedJobsNamespaceSelector`: `default`
    ///    (Kueue's webhook adds the label, possibly after gpufit's has run);
    /// 5. `manageJobsWithoutQueueName` and the namespace selector (the
    ///    namespace's `gpufit.io/kueue` label overrides both).
    pub fn queue_for(
        &self,
        framework: &str,
        metadata: Option<&Value>,
        ns: &str,
        ns_labels: Option<&BTreeMap<String, String>>,
    ) -> Result<Option<String>, KueueError> {
        if !self.enabled || !self.framework_enabled(framework) {
            return Ok(None);
        }
        if owned_by_integration(metadata) {
            return Ok(None);
        }
        if let Some(q) = queue_name(metadata) {
            return Ok(Some(q.to_string()));
        }
        if self.has_default_local_queue(ns) && self.unlabelled.in_namespaces(ns, ns_labels) {
            return Ok(Some(DEFAULT_LOCAL_QUEUE.to_string()));
        }
        if self.unlabelled.managed(ns, ns_labels)? {
            return Ok(Some(format!("(namespace {ns}'s default LocalQueue)")));
        }
        Ok(None)
    }
}

// === Jobs Kueue manages without a queue label ===
//
// Kueue's `Configuration` (`apis/config/v1beta1/configuration_types.go`):
// with `manageJobsWithoutQueueName: true`, a job without the queue label in
// a namespace that `managedJobsNamespaceSelector` matches is suspended and
// admitted through a LocalQueue anyway (the namespace's `default` one, which
// Kueue's webhook writes as the job's queue label — possibly after gpufit's
// webhook has seen the job). The selector defaults to every namespace but
// `kube-system` and Kueue's own. gpufit cannot read Kueue's configuration,
// so the admin states the same here: the controller flags mirror the two
// fields, and a namespace label overrides them for one namespace.

/// Namespace label: `managed` (jobs without a queue label here are Kueue's)
/// or `unmanaged` (they are not), whatever the controller's flags say.
pub use super::keys::NAMESPACE_KUEUE as NAMESPACE_LABEL;
/// The label the API server sets on every namespace to its name (what
/// Kueue's default selector matches on).
pub const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";
/// Kueue's default `managedJobsNamespaceSelector` (`apis/config/v1beta1/
/// defaults.go`, with Kueue installed in its default namespace `kueue-system`).
pub const DEFAULT_NAMESPACE_SELECTOR: &str = r#"{"matchExpressions":[{"key":"kubernetes.io/metadata.name","operator":"NotIn","values":["kube-system","kueue-system"]}]}"#;

/// Kinds Kueue admits as one job (its job integrations,
/// `pkg/controller/jobs`): an object one of them controls (a JobSet's Jobs,
/// a TrainJob's JobSet) is admitted with its owner, never on its own
/// (`jobframework.FindAncestorJobManagedByKueue`).
pub const INTEGRATION_KINDS: [&str; 14] = [
    "Job",
    "JobSet",
    "TrainJob",
    "PyTorchJob",
    "TFJob",
    "XGBoostJob",
    "PaddleJob",
    "JAXJob",
    "MPIJob",
    "RayJob",
    "RayCluster",
    "AppWrapper",
    "LeaderWorkerSet",
    "SparkApplication",
];

/// Whether an object (its `metadata`) is controlled by a kind Kueue admits
/// as a whole ([`INTEGRATION_KINDS`]).
pub fn owned_by_integration(metadata: Option<&Value>) -> bool {
    metadata
        .and_then(|m| m.get("ownerReferences"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|o| o.get("controller").and_then(Value::as_bool) == Some(true))
        .filter_map(|o| o.get("kind").and_then(Value::as_str))
        .any(|k| INTEGRATION_KINDS.contains(&k))
}

/// Which jobs without a queue label Kueue manages, as gpufit was told.
#[derive(Debug, Clone, Default)]
pub struct Unlabelled {
    /// Kueue's `manageJobsWithoutQueueName`.
    pub manage: bool,
    /// Kueue's `managedJobsNamespaceSelector` (every namespace when None).
    pub namespaces: Option<Selector>,
}

impl Unlabelled {
    /// `manageJobsWithoutQueueName: true` with this
    /// `managedJobsNamespaceSelector` (a `LabelSelector` in JSON or YAML,
    /// as in Kueue's configuration).
    pub fn managing(selector: &str) -> Result<Self, KueueError> {
        let bad = |e: String| KueueError::Selector(format!("{selector:?}: {e}"));
        let ls: LabelSelector = serde_yaml::from_str(selector).map_err(|e| bad(e.to_string()))?;
        let sel = Selector::try_from(ls).map_err(|e| bad(e.to_string()))?;
        Ok(Unlabelled {
            manage: true,
            namespaces: Some(sel),
        })
    }

    /// Whether a job without a queue label in namespace `ns` (with these
    /// labels; None when the namespace is not known yet) is Kueue's. The
    /// namespace's [`NAMESPACE_LABEL`] decides first; a value other than
    /// `managed`/`unmanaged` is an error naming it.
    pub fn managed(
        &self,
        ns: &str,
        labels: Option<&BTreeMap<String, String>>,
    ) -> Result<bool, KueueError> {
        match labels
            .and_then(|l| l.get(NAMESPACE_LABEL))
            .map(String::as_str)
        {
            Some("managed") => return Ok(true),
            Some("unmanaged") => return Ok(false),
            Some(other) => {
                return Err(KueueError::NamespaceLabel {
                    namespace: ns.to_string(),
                    value: other.to_string(),
                })
            }
            None => {}
        }
        Ok(self.manage && self.in_namespaces(ns, labels))
    }

    /// Whether namespace `ns` matches `managedJobsNamespaceSelector`
    /// (every namespace without one).
    pub fn in_namespaces(&self, ns: &str, labels: Option<&BTreeMap<String, String>>) -> bool {
        let Some(sel) = &self.namespaces else {
            return true;
        };
        // The API server sets the name label on every namespace; a
        // namespace not in the cache yet is matched by its name alone.
        let mut l = labels.cloned().unwrap_or_default();
        l.entry(LABEL_NAMESPACE_NAME.to_string())
            .or_insert_with(|| ns.to_string());
        sel.matches(&l)
    }
}

/// A Workload as far as gpufit reads it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    #[serde(default)]
    pub spec: WorkloadSpec,
    #[serde(default)]
    pub status: WorkloadStatus,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSpec {
    #[serde(default)]
    pub pod_sets: Vec<PodSet>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodSet {
    #[serde(default = "main")]
    pub name: String,
    #[serde(default)]
    pub count: i64,
    #[serde(default)]
    pub min_count: Option<i64>,
    #[serde(default)]
    pub template: Value,
}

fn main() -> String {
    "main".into()
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub admission: Option<Admission>,
    #[serde(default)]
    pub admission_checks: Vec<CheckState>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default)]
    pub last_transition_time: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Admission {
    #[serde(default)]
    pub cluster_queue: String,
    #[serde(default)]
    pub pod_set_assignments: Vec<Assignment>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Assignment {
    #[serde(default = "main")]
    pub name: String,
    #[serde(default)]
    pub flavors: BTreeMap<String, String>,
    #[serde(default)]
    pub count: Option<i64>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CheckState {
    pub name: String,
    pub state: String,
    #[serde(default)]
    pub message: String,
}

impl Workload {
    /// Reads a Workload from its JSON.
    pub fn from_json(v: &Value) -> Result<Self, KueueError> {
        Workload::deserialize(v).map_err(|e| KueueError::Unreadable(e.to_string()))
    }

    /// When quota was reserved (the `QuotaReserved` condition's
    /// `lastTransitionTime`), when it is.
    pub fn reserved_at(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        self.status
            .conditions
            .iter()
            .find(|c| c.type_ == "QuotaReserved" && c.status == "True")
            .and_then(|c| c.last_transition_time.as_deref())
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&chrono::Utc))
    }

    fn condition(&self, t: &str) -> bool {
        self.status
            .conditions
            .iter()
            .any(|c| c.type_ == t && c.status == "True")
    }
}

/// Why a Workload cannot be configured.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KueueError {
    #[error("the Workload cannot be read: {0}")]
    Unreadable(String),
    #[error("pod set {0} has no assignment in status.admission")]
    NotAssigned(String),
    #[error("the Workload has no pod sets")]
    NoPodSets,
    #[error("not a LabelSelector: {0}")]
    Selector(String),
    #[error(
        "namespace {namespace} label gpufit.io/kueue: {value:?} is neither managed nor unmanaged"
    )]
    NamespaceLabel { namespace: String, value: String },
}

/// What to do with a Workload.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Nothing now; why (for the logs).
    Wait(&'static str),
    /// Answer these checks (every gpufit check Pending on the Workload)
    /// for the current admission.
    Configure { checks: Vec<String> },
}

/// Pure decision: configure when any of `ours` is `Pending` on a workload
/// whose quota is reserved (an admission exists) and that is neither
/// evicted nor finished — every such check, so two gpufit checks on one
/// Workload are both answered. A check already answered (`Ready`, or set
/// by Kueue to `Retry`/`Rejected`) is left alone, so duplicate and stale
/// events change nothing.
pub fn step(wl: &Workload, ours: &BTreeSet<String>) -> Step {
    let mine: Vec<&CheckState> = wl
        .status
        .admission_checks
        .iter()
        .filter(|c| ours.contains(&c.name))
        .collect();
    if mine.is_empty() {
        return Step::Wait("no gpufit admission check on this workload");
    }
    let pending: Vec<String> = mine
        .iter()
        .filter(|c| c.state == "Pending")
        .map(|c| c.name.clone())
        .collect();
    if pending.is_empty() {
        return Step::Wait("the check is already answered");
    }
    if wl.condition("Finished") {
        return Step::Wait("finished");
    }
    // Between eviction and the release of the quota the old admission is
    // still there: configuring now would answer for the old flavor.
    if wl.condition("Evicted") {
        return Step::Wait("evicted; waiting for a new admission");
    }
    if !wl.condition("QuotaReserved") || wl.status.admission.is_none() {
        return Step::Wait("no quota reserved yet");
    }
    Step::Configure { checks: pending }
}

/// One pod set as admitted.
#[derive(Debug, Clone, PartialEq)]
pub struct Admitted {
    pub name: String,
    /// Pods admitted (partial admission: fewer than asked).
    pub count: u32,
    /// GPUs (or MIG slices) one pod asks for.
    pub gpus_per_pod: u32,
    /// The flavor of its GPUs (of its first resource when it asks for none).
    pub flavor: Option<String>,
    /// The pod spec of its template (JSON).
    pub pod_spec: Value,
}

/// The pod sets with their admitted counts and flavors.
pub fn admitted(wl: &Workload) -> Result<Vec<Admitted>, KueueError> {
    if wl.spec.pod_sets.is_empty() {
        return Err(KueueError::NoPodSets);
    }
    let assignments = wl
        .status
        .admission
        .as_ref()
        .map(|a| a.pod_set_assignments.as_slice())
        .unwrap_or(&[]);
    wl.spec
        .pod_sets
        .iter()
        .map(|ps| {
            let a = assignments
                .iter()
                .find(|a| a.name == ps.name)
                .ok_or_else(|| KueueError::NotAssigned(ps.name.clone()))?;
            let pod_spec = ps.template.get("spec").cloned().unwrap_or(json!({}));
            let gpus = gpu::pod_gpus_json(&pod_spec);
            let resource = match &gpus.mig_profile {
                Some(p) => format!("{}{p}", gpu::MIG_RESOURCE_PREFIX),
                None => gpu::GPU_RESOURCE.to_string(),
            };
            let flavor = a
                .flavors
                .get(&resource)
                .or_else(|| a.flavors.values().next())
                .cloned();
            let count = a.count.unwrap_or(ps.count).clamp(0, i64::from(u32::MAX)) as u32;
            Ok(Admitted {
                name: ps.name.clone(),
                count,
                gpus_per_pod: gpus.count,
                flavor,
                pod_spec,
            })
        })
        .collect()
}

/// The pod sets that train: those asking for GPUs (all of them when none
/// does, each pod then counted as one GPU, as the webhook counts a Job).
pub fn training(pod_sets: &[Admitted]) -> Vec<&Admitted> {
    let any = pod_sets.iter().any(|p| p.gpus_per_pod > 0);
    pod_sets
        .iter()
        .filter(|p| !any || p.gpus_per_pod > 0)
        .collect()
}

/// W: the data-parallel GPUs of the admitted job, Σ admitted pods × GPUs
/// per pod over the training pod sets.
pub fn admitted_gpus(training: &[&Admitted]) -> u32 {
    training
        .iter()
        .fold(0u32, |w, p| {
            w.saturating_add(p.count.saturating_mul(p.gpus_per_pod.max(1)))
        })
        .max(1)
}

/// The GPU one pod set gets on its flavor: the pod's template with the
/// flavor's `nodeLabels` added to its node selector (what Kueue does at
/// unsuspend), resolved against the nodes' GPU Feature Discovery labels;
/// when no node matches (nodes that autoscaling has not created yet) and
/// the flavor itself names the product (`nvidia.com/gpu.product`), from
/// the flavor's labels.
pub fn flavor_gpu<'a>(
    ps: &Admitted,
    flavor_labels: &BTreeMap<String, String>,
    nodes: impl IntoIterator<Item = &'a Node>,
    sharing: Sharing,
) -> Result<GpuSpec, GpuError> {
    let mut spec = ps.pod_spec.clone();
    if let Some(o) = spec.as_object_mut() {
        let sel = o.entry("nodeSelector").or_insert_with(|| json!({}));
        if !sel.is_object() {
            *sel = json!({});
        }
        if let Some(sel) = sel.as_object_mut() {
            for (k, v) in flavor_labels {
                sel.insert(k.clone(), Value::String(v.clone()));
            }
        }
    }
    let pod: Option<PodSpec> = serde_json::from_value(spec.clone()).ok();
    match gpu::resolve_from_nodes_with(nodes, pod.as_ref(), sharing) {
        Err(GpuError::NoGpuNodes | GpuError::NoMigNodes(_))
            if flavor_labels.contains_key(gpu::LABEL_PRODUCT) =>
        {
            // The flavor as a node: its labels, the pod's selector only.
            let node: Node = serde_json::from_value(json!({
                "metadata": {"name": "flavor", "labels": spec.get("nodeSelector")}
            }))
            .map_err(|e| GpuError::Catalog(e.to_string()))?;
            let only_selector = pod.map(|p| PodSpec {
                affinity: None,
                ..p
            });
            gpu::resolve_from_nodes_with([&node], only_selector.as_ref(), sharing)
        }
        r => r,
    }
}

/// The GPU to plan for when the training pod sets got different GPUs: the
/// one with the least memory, so every rank fits (one set of settings for
/// all ranks keeps m × a × W = G).
pub fn smallest(gpus: Vec<GpuSpec>) -> Option<GpuSpec> {
    gpus.into_iter().min_by_key(|g| g.memory_bytes)
}

/// gpufit's answer for one check: `Ready`, with each pod set's
/// annotations (pod sets without any get no update) and a message. It
/// never answers `Rejected` (Kueue would deactivate the workload) nor
/// `Retry` (it would give up the quota): a job gpufit cannot configure
/// still runs.
pub fn ready_check(
    check: &str,
    updates: &[(String, BTreeMap<String, String>)],
    message: &str,
    now: &str,
) -> Value {
    let mut c = json!({
        "name": check,
        "state": "Ready",
        // The API allows 32768 characters.
        "message": truncate(message, 32_000),
        "lastTransitionTime": now,
    });
    let sets: Vec<Value> = updates
        .iter()
        .filter(|(_, a)| !a.is_empty())
        .map(|(n, a)| json!({"name": n, "annotations": a}))
        .collect();
    if !sets.is_empty() {
        c["podSetUpdates"] = Value::Array(sets);
    }
    c
}

/// The annotations of an update that Kueue can merge into a pod set's
/// template: a key the template already has with another value is
/// dropped (Kueue's `podset.Merge` treats it as a conflict and finishes
/// the Workload `FailedToStart`); the dropped keys are returned.
pub fn conflict_free(
    template: &Value,
    annotations: &BTreeMap<String, String>,
) -> (BTreeMap<String, String>, Vec<String>) {
    let have = template.pointer("/metadata/annotations");
    let mut keep = BTreeMap::new();
    let mut dropped = Vec::new();
    for (k, v) in annotations {
        match have.and_then(|h| h.get(k)).and_then(Value::as_str) {
            Some(old) if old != v => dropped.push(k.clone()),
            _ => {
                keep.insert(k.clone(), v.clone());
            }
        }
    }
    (keep, dropped)
}

/// Whether a pod set's containers read their settings from annotations
/// set at admission (the webhook's deferred injection), and the fallback
/// settings its template carries.
pub fn deferred(template: &Value) -> Option<BTreeMap<String, String>> {
    let label = template
        .pointer("/metadata/labels")
        .and_then(|l| l.get(super::keys::LABEL_DEFERRED))
        .and_then(Value::as_str);
    (label == Some("true")).then(|| {
        template
            .pointer("/metadata/annotations")
            .and_then(|a| a.get(super::keys::ANN_FALLBACK))
            .and_then(Value::as_str)
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default()
    })
}

/// The server-side apply body that sets our checks' states on a
/// Workload's status (`admissionChecks` is a map keyed by name: the other
/// checks keep their owners), in API `version`. `resource_version` makes a
/// copy that changed since it was read a conflict instead of an overwrite.
pub fn status_apply(
    version: &str,
    name: &str,
    namespace: &str,
    resource_version: Option<&str>,
    checks: Vec<Value>,
) -> Value {
    json!({
        "apiVersion": format!("{GROUP}/{version}"),
        "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": resource_version},
        "status": {"admissionChecks": checks},
    })
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(gpus: u32) -> Value {
        json!({"spec": {"containers": [{"name": "t",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}})
    }

    /// A Workload as Kueue writes it for a PyTorchJob (master 1, worker 3).
    fn workload(conditions: Value, checks: Value, worker_count: Option<i64>) -> Workload {
        Workload::from_json(&json!({
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": "pytorchjob-ddp-1a2b3", "namespace": "ml"},
            "spec": {"queueName": "team", "podSets": [
                {"name": "master", "count": 1, "template": pod(1)},
                {"name": "worker", "count": 3, "minCount": 1, "template": pod(1)}]},
            "status": {
                "conditions": conditions,
                "admission": {"clusterQueue": "gpus", "podSetAssignments": [
                    {"name": "master", "count": 1, "flavors": {"nvidia.com/gpu": "a100", "cpu": "default"}},
                    {"name": "worker", "count": worker_count, "flavors": {"nvidia.com/gpu": "a100"}}]},
                "admissionChecks": checks
            }
        }))
        .expect("a workload")
    }

    fn ours() -> BTreeSet<String> {
        ["gpufit".to_string()].into()
    }

    fn pending() -> Value {
        json!([{"name": "gpufit", "state": "Pending", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
               {"name": "prov", "state": "Ready", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}])
    }

    fn reserved() -> Value {
        json!([{"type": "QuotaReserved", "status": "True"}])
    }

    #[test]
    fn a_pending_check_with_quota_reserved_is_configured_once() {
        let wl = workload(reserved(), pending(), Some(3));
        assert_eq!(
            step(&wl, &ours()),
            Step::Configure {
                checks: vec!["gpufit".into()]
            }
        );
        // Two gpufit checks on one Workload: both answered.
        let two = workload(
            reserved(),
            json!([{"name": "gpufit", "state": "Pending", "message": ""},
                   {"name": "gpufit-b", "state": "Pending", "message": ""},
                   {"name": "gpufit-c", "state": "Ready", "message": ""}]),
            Some(3),
        );
        let all: BTreeSet<String> = ["gpufit", "gpufit-b", "gpufit-c"].map(String::from).into();
        assert_eq!(
            step(&two, &all),
            Step::Configure {
                checks: vec!["gpufit".into(), "gpufit-b".into()]
            }
        );
        let answered = workload(
            reserved(),
            json!([{"name": "gpufit", "state": "Ready", "message": "done"}]),
            Some(3),
        );
        assert!(matches!(step(&answered, &ours()), Step::Wait(_)));
        // Not our check: another controller's.
        let other = BTreeSet::from(["prov".to_string()]);
        assert!(matches!(step(&wl, &BTreeSet::new()), Step::Wait(_)));
        assert!(matches!(step(&wl, &other), Step::Wait(_)));
    }

    #[test]
    fn no_answer_before_quota_while_evicted_or_when_finished() {
        let queued = workload(
            json!([{"type": "QuotaReserved", "status": "False"}]),
            pending(),
            Some(3),
        );
        assert!(matches!(step(&queued, &ours()), Step::Wait(_)));
        // Evicted, quota not yet released: the old admission must not be answered.
        let evicted = workload(
            json!([{"type": "QuotaReserved", "status": "True"}, {"type": "Evicted", "status": "True"}]),
            pending(),
            Some(3),
        );
        assert!(matches!(step(&evicted, &ours()), Step::Wait(_)));
        let finished = workload(
            json!([{"type": "QuotaReserved", "status": "True"}, {"type": "Finished", "status": "True"}]),
            pending(),
            Some(3),
        );
        assert!(matches!(step(&finished, &ours()), Step::Wait(_)));
        // Re-admitted: Kueue turned Evicted to False.
        let readmitted = workload(
            json!([{"type": "QuotaReserved", "status": "True"}, {"type": "Evicted", "status": "False"}]),
            pending(),
            Some(3),
        );
        assert!(matches!(step(&readmitted, &ours()), Step::Configure { .. }));
    }

    #[test]
    fn w_is_the_admitted_count_times_gpus_per_pod() {
        let full = admitted(&workload(reserved(), pending(), Some(3))).unwrap();
        assert_eq!(admitted_gpus(&training(&full)), 4);
        assert_eq!(full[1].flavor.as_deref(), Some("a100"));
        // Partial admission: one worker of three.
        let partial = admitted(&workload(reserved(), pending(), Some(1))).unwrap();
        assert_eq!(admitted_gpus(&training(&partial)), 2);
        // No count in the assignment (older Kueue): the pod set's.
        let none = admitted(&workload(reserved(), pending(), None)).unwrap();
        assert_eq!(none[1].count, 3);
    }

    #[test]
    fn a_pod_set_without_assignment_is_an_error_not_a_guess() {
        let mut wl = workload(reserved(), pending(), Some(3));
        if let Some(a) = wl.status.admission.as_mut() {
            a.pod_set_assignments.pop();
        }
        assert_eq!(admitted(&wl), Err(KueueError::NotAssigned("worker".into())));
        assert!(Workload::from_json(&json!({"spec": {"podSets": "x"}})).is_err());
    }

    #[test]
    fn a_cpu_only_pod_set_does_not_count_when_others_train() {
        let mut wl = workload(reserved(), pending(), Some(3));
        wl.spec.pod_sets[0].template = json!({"spec": {"containers": [{"name": "launcher"}]}});
        let ps = admitted(&wl).unwrap();
        let t = training(&ps);
        assert_eq!(t.len(), 1);
        assert_eq!(admitted_gpus(&t), 3);
    }

    fn node(name: &str, product: &str, mem: &str, pool: &str) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {
            "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": mem, "pool": pool}}}))
        .unwrap()
    }

    #[test]
    fn the_flavor_node_labels_pick_the_gpu_among_the_nodes() {
        let nodes = [
            node("a", "NVIDIA-A100-SXM4-80GB", "81920", "a100"),
            node("h", "NVIDIA-H100-80GB-HBM3", "81559", "h100"),
        ];
        let ps = &admitted(&workload(reserved(), pending(), Some(3))).unwrap()[1];
        let a100 = BTreeMap::from([("pool".to_string(), "a100".to_string())]);
        let h100 = BTreeMap::from([("pool".to_string(), "h100".to_string())]);
        let g = flavor_gpu(ps, &a100, &nodes, Sharing::Share).unwrap();
        assert!(g.name.contains("A100"), "{}", g.name);
        let g = flavor_gpu(ps, &h100, &nodes, Sharing::Share).unwrap();
        assert!(g.name.contains("H100"), "{}", g.name);
        // Both pools without a flavor: two GPUs, no answer.
        assert!(matches!(
            flavor_gpu(ps, &BTreeMap::new(), &nodes, Sharing::Share),
            Err(GpuError::Mixed(_))
        ));
    }

    #[test]
    fn a_flavor_naming_the_product_needs_no_node() {
        let ps = &admitted(&workload(reserved(), pending(), Some(3))).unwrap()[0];
        let labels = BTreeMap::from([(
            gpu::LABEL_PRODUCT.to_string(),
            "NVIDIA-H100-80GB-HBM3".to_string(),
        )]);
        let g = flavor_gpu(ps, &labels, std::iter::empty(), Sharing::Share).unwrap();
        assert!(g.name.contains("H100"), "{}", g.name);
        let none = BTreeMap::from([("pool".to_string(), "x".to_string())]);
        assert_eq!(
            flavor_gpu(ps, &none, std::iter::empty(), Sharing::Share),
            Err(GpuError::NoGpuNodes)
        );
    }

    #[test]
    fn the_ready_answer_updates_every_pod_set_or_none() {
        let anns = BTreeMap::from([(
            "gpufit.io/setting.micro_batch_size".to_string(),
            "4".to_string(),
        )]);
        let c = ready_check(
            "gpufit",
            &[("master".into(), anns.clone()), ("worker".into(), anns)],
            "ok",
            "2026-01-01T00:00:00Z",
        );
        assert_eq!(c["state"], "Ready");
        assert_eq!(c["podSetUpdates"][1]["name"], "worker");
        assert_eq!(
            c["podSetUpdates"][1]["annotations"]["gpufit.io/setting.micro_batch_size"],
            "4"
        );
        let c = ready_check(
            "gpufit",
            &[("main".into(), BTreeMap::new())],
            "does not fit",
            "t",
        );
        assert!(c.get("podSetUpdates").is_none());
        assert_eq!(c["state"], "Ready");
        let long = "é".repeat(40_000);
        let c = ready_check("gpufit", &[], &long, "t");
        assert!(c["message"].as_str().unwrap().len() <= 32_000);
    }

    #[test]
    fn an_update_never_carries_a_key_the_template_has_with_another_value() {
        let template = json!({"metadata": {"annotations": {
            "gpufit.io/applied-settings": "{\"old\":1}", "team": "a"}}});
        let anns = BTreeMap::from([
            (
                "gpufit.io/applied-settings".to_string(),
                "{\"new\":2}".to_string(),
            ),
            ("team".to_string(), "a".to_string()),
            (
                "gpufit.io/setting.micro_batch_size".to_string(),
                "4".to_string(),
            ),
        ]);
        let (keep, dropped) = conflict_free(&template, &anns);
        assert_eq!(dropped, ["gpufit.io/applied-settings"]);
        assert_eq!(keep.len(), 2, "the same value is no conflict: {keep:?}");
        let (keep, dropped) = conflict_free(&json!({}), &anns);
        assert!(dropped.is_empty());
        assert_eq!(keep, anns);
    }

    #[test]
    fn the_newest_served_version_is_spoken() {
        assert_eq!(pick_version(&["v1beta1", "v1beta2"]), Some("v1beta2"));
        assert_eq!(pick_version(&["v1beta2"]), Some("v1beta2"));
        assert_eq!(pick_version(&["v1beta1"]), Some("v1beta1"));
        assert_eq!(pick_version(&["v1alpha1"]), None);
        assert_eq!(pick_version::<&str>(&[]), None);
    }

    #[test]
    fn kueue_queues_as_its_webhook_and_reconciler_decide() {
        let mut cfg = KueueConfig {
            enabled: true,
            ..KueueConfig::default()
        };
        // Without --kueue nothing is treated as queued (never answered).
        let off = KueueConfig::default();
        let labelled0 = json!({"labels": {QUEUE_NAME: "team"}});
        assert_eq!(
            off.queue_for("batch/job", Some(&labelled0), "ml", None)
                .unwrap(),
            None
        );
        let labelled = json!({"labels": {QUEUE_NAME: "team"}});
        assert_eq!(
            cfg.queue_for("batch/job", Some(&labelled), "ml", None)
                .unwrap(),
            Some("team".into())
        );
        // The PyTorchJob integration is off in Kueue's default configuration.
        assert_eq!(
            cfg.queue_for("kubeflow.org/pytorchjob", Some(&labelled), "ml", None)
                .unwrap(),
            None
        );
        cfg.frameworks = Some(["kubeflow.org/pytorchjob".to_string()].into());
        assert_eq!(
            cfg.queue_for("kubeflow.org/pytorchjob", Some(&labelled), "ml", None)
                .unwrap(),
            Some("team".into())
        );
        assert_eq!(
            cfg.queue_for("batch/job", Some(&labelled), "ml", None)
                .unwrap(),
            None
        );
        // LocalQueueDefaulting: a LocalQueue `default` in the namespace
        // (and the namespace in Kueue's selector), no label needed.
        let cfg = {
            let mut w =
                kube::runtime::reflector::store::Writer::new(kube::api::ApiResource::from_gvk(
                    &kube::api::GroupVersionKind::gvk(GROUP, VERSION, "LocalQueue"),
                ));
            let store = w.as_reader();
            w.apply_watcher_event(&kube::runtime::watcher::Event::Apply(
                serde_json::from_value(json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                    "metadata": {"name": "default", "namespace": "ml"}, "spec": {"clusterQueue": "cq"}}))
                .unwrap(),
            ));
            KueueConfig {
                enabled: true,
                unlabelled: Unlabelled::managing(DEFAULT_NAMESPACE_SELECTOR)
                    .map(|mut u| {
                        u.manage = false;
                        u
                    })
                    .unwrap(),
                frameworks: None,
                local_queues: Some(store),
            }
        };
        let plain = json!({"labels": {}});
        assert_eq!(
            cfg.queue_for("batch/job", Some(&plain), "ml", None)
                .unwrap(),
            Some("default".into())
        );
        assert_eq!(
            cfg.queue_for("batch/job", Some(&plain), "other", None)
                .unwrap(),
            None
        );
        // Kueue's own namespaces are outside its default selector.
        assert_eq!(
            cfg.queue_for("batch/job", Some(&plain), "kube-system", None)
                .unwrap(),
            None
        );
        // The label wins over the default; an owned child is its owner's.
        assert_eq!(
            cfg.queue_for("batch/job", Some(&labelled), "ml", None)
                .unwrap(),
            Some("team".into())
        );
        let child = json!({"ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "name": "o", "uid": "u", "controller": true}]});
        assert_eq!(
            cfg.queue_for("batch/job", Some(&child), "ml", None)
                .unwrap(),
            None
        );
    }

    #[test]
    fn the_queue_is_read_from_the_label_only() {
        assert_eq!(
            queue_name(Some(&json!({"labels": {QUEUE_NAME: "team"}}))),
            Some("team")
        );
        // Removed in Kueue v0.15 (#7271): the annotation queues nothing.
        assert_eq!(
            queue_name(Some(&json!({"annotations": {QUEUE_NAME: "old"}}))),
            None
        );
        assert_eq!(
            queue_name(Some(&json!({"labels": {QUEUE_NAME: " "}}))),
            None
        );
        assert_eq!(queue_name(Some(&json!({}))), None);
        assert_eq!(queue_name(None), None);
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn unlabelled_jobs_are_kueues_where_the_admin_says_as_kueue_decides() {
        // Off (Kueue's default): only the namespace label says so.
        let off = Unlabelled::default();
        assert!(!off.managed("ml", Some(&labels(&[]))).unwrap());
        assert!(off
            .managed("ml", Some(&labels(&[(NAMESPACE_LABEL, "managed")])))
            .unwrap());
        // On with Kueue's default selector: every namespace but kube-system
        // and kueue-system, matched on the name label the API server sets
        // (and by name alone for a namespace not cached yet).
        let mut on = Unlabelled::managing(DEFAULT_NAMESPACE_SELECTOR).unwrap();
        assert!(on.manage);
        assert!(on.managed("ml", None).unwrap());
        assert!(!on
            .managed(
                "kube-system",
                Some(&labels(&[(LABEL_NAMESPACE_NAME, "kube-system")]))
            )
            .unwrap());
        assert!(!on.managed("kueue-system", None).unwrap());
        // The namespace label overrides the flag both ways.
        assert!(!on
            .managed("ml", Some(&labels(&[(NAMESPACE_LABEL, "unmanaged")])))
            .unwrap());
        assert!(on
            .managed(
                "kube-system",
                Some(&labels(&[(NAMESPACE_LABEL, "managed")]))
            )
            .unwrap());
        // A typo is an error naming the label, not a silent "no".
        let e = on
            .managed("ml", Some(&labels(&[(NAMESPACE_LABEL, "yes")])))
            .unwrap_err();
        assert!(e.to_string().contains("gpufit.io/kueue"), "{e}");
        // The flag without a selector: every namespace.
        on.namespaces = None;
        assert!(on.managed("kube-system", None).unwrap());
    }

    #[test]
    fn a_child_of_a_job_kueue_admits_is_not_a_job_of_its_own() {
        let owned = |kind: &str, controller: bool| {
            json!({"ownerReferences": [{"apiVersion": "x/v1", "kind": kind, "name": "o",
                                        "uid": "u", "controller": controller}]})
        };
        assert!(owned_by_integration(Some(&owned("JobSet", true))));
        assert!(owned_by_integration(Some(&owned("TrainJob", true))));
        // A CronJob's Job is Kueue's to admit; a non-controller owner is no owner.
        assert!(!owned_by_integration(Some(&owned("CronJob", true))));
        assert!(!owned_by_integration(Some(&owned("JobSet", false))));
        assert!(!owned_by_integration(Some(&json!({}))));
        assert!(!owned_by_integration(None));
    }

    #[test]
    fn the_namespace_selector_is_kueues_label_selector_in_yaml_or_json() {
        let yaml = "matchLabels:\n  team: ml\nmatchExpressions:\n- {key: tier, operator: In, values: [gpu]}\n";
        let u = Unlabelled::managing(yaml).unwrap();
        assert!(u
            .managed("a", Some(&labels(&[("team", "ml"), ("tier", "gpu")])))
            .unwrap());
        assert!(!u.managed("b", Some(&labels(&[("team", "ml")]))).unwrap());
        assert!(!u.managed("c", None).unwrap());
        // An empty selector matches everything, as in Kubernetes.
        assert!(Unlabelled::managing("{}")
            .unwrap()
            .managed("x", None)
            .unwrap());
        for bad in [
            "matchLabels: [1",
            r#"{"matchExpressions":[{"key":"a","operator":"Near","values":["b"]}]}"#,
            r#"{"matchLabels": "team"}"#,
        ] {
            let e = Unlabelled::managing(bad).unwrap_err();
            assert!(matches!(e, KueueError::Selector(_)), "{bad}: {e}");
        }
    }
}
