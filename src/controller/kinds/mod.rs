//! One description per training kind gpufit configures — API version, pod
//! templates and their Kueue pod-set names, GPUs per replica (W), end
//! conditions, how its pods are found, its Kueue integration name — used
//! by the admission webhook, the run recorder and the Kueue answer.
//!
//! Adding a kind is one new file implementing [`TrainingKind`] and one
//! line in the [`kinds!`] list below.
//!
//! | kind | file | pod templates | W |
//! |---|---|---|---|
//! | `batch/v1` Job | [`job`] | `spec.template` (pod set `main`) | min(parallelism, completions) × GPUs per pod |
//! | `kubeflow.org/v1` PyTorchJob | [`pytorchjob`] | every `pytorchReplicaSpecs.*.template` (pod set: the replica type, lower-cased) | Σ replicas × GPUs per pod |
//! | `jobset.x-k8s.io/v1alpha2` JobSet | [`jobset`] | every training `replicatedJobs[].template.spec.template` (pod set: the replicated Job's name) | Σ replicas × min(parallelism, completions) × GPUs per pod |
//! | `trainer.kubeflow.org/v1alpha1` TrainJob | [`trainjob`] | `spec.trainer` (env, command, args; pod sets: its runtime's) | numNodes × GPUs in resourcesPerNode |

use kube::api::{ApiResource, GroupVersionKind};
use serde_json::{json, Value};

use super::keys::{ANN_WORKLOAD, LABEL_CONFIGURED};
use crate::core::workload::Workload;

/// Declares the kinds' modules and the registry in one list: adding a
/// kind is one line here.
macro_rules! kinds {
    ($($module:ident :: $kind:ident),+ $(,)?) => {
        $(pub mod $module;)+
        /// Every kind gpufit configures, in the order they are tried.
        pub static KINDS: &[&dyn TrainingKind] = &[$(&$module::$kind),+];
    };
}

kinds!(
    job::Job,
    pytorchjob::PyTorchJob,
    jobset::JobSet,
    trainjob::TrainJob,
);

/// What gpufit knows about one training kind.
pub trait TrainingKind: Sync + Send {
    /// API group (`""` for the core group).
    fn group(&self) -> &'static str;
    /// API version gpufit reads and writes.
    fn version(&self) -> &'static str;
    /// `kind`.
    fn kind(&self) -> &'static str;
    /// Resource plural.
    fn plural(&self) -> &'static str;
    /// Kueue's name for this integration in its configuration's
    /// `integrations.frameworks` (`pkg/controller/jobs/*`).
    fn kueue_framework(&self) -> &'static str;
    /// Where the settings go and W, or why gpufit cannot configure this
    /// object (it is then allowed unchanged with that warning).
    fn shape(&self, obj: &Value) -> Result<Shape, String>;
    /// Whether a True condition of this `type` ends the workload, and
    /// with success.
    fn end(&self, condition: &str) -> Option<bool>;
    /// Whether its pods are found by [`LABEL_JOBSET_NAME`] (they are owned
    /// by child Jobs) rather than owner references.
    fn pods_by_jobset_label(&self) -> bool {
        false
    }
    /// Whether its pods carry the JobSet uid label of *this* object
    /// (a JobSet's do; a TrainJob's carry its runtime JobSet's).
    fn jobset_uid_is_own(&self) -> bool {
        false
    }

    /// The resource, for dynamic API calls.
    fn resource(&self) -> ApiResource {
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(self.group(), self.version(), self.kind()),
            self.plural(),
        )
    }
    /// `group/version` (or `v1` for the core group).
    fn api_version(&self) -> String {
        if self.group().is_empty() {
            self.version().to_string()
        } else {
            format!("{}/{}", self.group(), self.version())
        }
    }
    /// The label selector that lists its candidate pods in a namespace.
    fn pod_selector(&self, name: &str) -> String {
        if self.pods_by_jobset_label() {
            format!("{LABEL_JOBSET_NAME}={name}")
        } else {
            LABEL_CONFIGURED.to_string()
        }
    }
    /// Whether a listed pod is one of this object's (`name`, `uid`).
    fn owns_pod(&self, pod: &k8s_openapi::api::core::v1::Pod, name: &str, uid: &str) -> bool {
        use kube::ResourceExt;
        if self.pods_by_jobset_label() {
            let l = pod.labels();
            l.get(LABEL_JOBSET_NAME).map(String::as_str) == Some(name)
                && (!self.jobset_uid_is_own() || l.get(LABEL_JOBSET_UID).is_none_or(|u| u == uid))
        } else {
            pod.owner_references().iter().any(|o| o.uid == uid)
        }
    }
}

/// The kind named `kind` (in `group`, when given).
pub fn of(group: Option<&str>, kind: &str) -> Option<&'static dyn TrainingKind> {
    KINDS
        .iter()
        .copied()
        .find(|k| k.kind() == kind && group.is_none_or(|g| g == k.group()))
}

/// The kind of an `apiVersion` + `kind` pair (an owner reference).
pub fn of_api_version(api_version: &str, kind: &str) -> Option<&'static dyn TrainingKind> {
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    of(Some(group), kind)
}

/// The label JobSet puts on its child Jobs and their pods (a TrainJob's
/// runtime JobSet is named after the TrainJob, so its pods carry it too).
pub const LABEL_JOBSET_NAME: &str = "jobset.sigs.k8s.io/jobset-name";
/// The JobSet's uid, on its child Jobs and pods.
pub const LABEL_JOBSET_UID: &str = "jobset.sigs.k8s.io/jobset-uid";

/// One pod template that trains.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    /// JSON pointer in the object.
    pub pointer: String,
    /// The name of Kueue's pod set for it.
    pub pod_set: String,
}

/// Where the settings go in one object, and its W when the object says.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// The pod templates that train.
    pub templates: Vec<Template>,
    /// JSON pointer of a container-like object (a TrainJob's `spec.trainer`)
    /// that gets the settings as a container would.
    pub trainer: Option<String>,
    /// Data-parallel GPUs of the whole job; None when the object does not
    /// say (a TrainJob whose runtime decides).
    pub gpus: Option<u32>,
}

impl Shape {
    /// The templates' JSON pointers.
    pub fn pointers(&self) -> Vec<String> {
        self.templates.iter().map(|t| t.pointer.clone()).collect()
    }
}

// === Counting, as the API server and Kueue count ===

/// A count field (replicas, parallelism), 1 when absent (the API default).
pub(crate) fn count(v: Option<&Value>) -> u32 {
    v.and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        .unwrap_or(1)
}

/// Pods a Job runs at once: its parallelism, at most its completions (as
/// Kueue counts a Job's, and a JobSet replicated Job's, pod set).
pub(crate) fn job_pods(spec: Option<&Value>) -> u32 {
    let parallelism = count(spec.and_then(|s| s.get("parallelism")));
    match spec
        .and_then(|s| s.get("completions"))
        .and_then(Value::as_u64)
    {
        Some(c) => parallelism.min(u32::try_from(c).unwrap_or(u32::MAX)),
        None => parallelism,
    }
}

/// Whether a resource name is a GPU gpufit counts: `nvidia.com/gpu`, a
/// MIG slice (`nvidia.com/mig-…`) or a renamed shared GPU
/// (`nvidia.com/gpu.shared`, …).
fn is_gpu_resource(name: &str) -> bool {
    name.starts_with(super::gpu::GPU_RESOURCE) || name.starts_with(super::gpu::MIG_RESOURCE_PREFIX)
}

/// A Kubernetes quantity (`resource.Quantity`: `"8"`, `"2k"`, `"1.5"`,
/// `"500m"`, `"1Ki"`, `"1e3"`) as a whole count of devices. Extended
/// resources such as GPUs must be whole and not negative (the API server
/// refuses others); so does this, naming what it saw.
pub fn device_quantity(v: &Value) -> Result<u64, String> {
    let s = match v {
        Value::String(s) => s.trim().to_string(),
        Value::Number(n) => n.to_string(),
        other => return Err(format!("{other} is not a quantity")),
    };
    let bad = |why: &str| format!("`{s}` {why}");
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    if num.starts_with('-') {
        return Err(bad("is negative"));
    }
    let num = num.strip_prefix('+').unwrap_or(num);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty())
        || !int.chars().all(|c| c.is_ascii_digit())
        || !frac.chars().all(|c| c.is_ascii_digit())
    {
        return Err(bad("is not a quantity"));
    }
    // (base, power) of the suffix: binary, decimal SI, or a decimal exponent.
    let (base, power): (u128, i32) = match suffix {
        "" => (10, 0),
        "Ki" => (2, 10),
        "Mi" => (2, 20),
        "Gi" => (2, 30),
        "Ti" => (2, 40),
        "Pi" => (2, 50),
        "Ei" => (2, 60),
        "n" => (10, -9),
        "u" => (10, -6),
        "m" => (10, -3),
        "k" => (10, 3),
        "M" => (10, 6),
        "G" => (10, 9),
        "T" => (10, 12),
        "P" => (10, 15),
        "E" => (10, 18),
        e if e.starts_with(['e', 'E']) => (
            10,
            e[1..]
                .parse::<i32>()
                .map_err(|_| bad("is not a quantity"))?,
        ),
        _ => return Err(bad("is not a quantity")),
    };
    // Exact arithmetic: value = digits / 10^len(frac) × base^power.
    let digits: u128 = match format!("{int}{frac}").trim_start_matches('0') {
        "" => 0,
        d => d.parse().map_err(|_| bad("is too large"))?,
    };
    let frac_scale = 10u128
        .checked_pow(frac.len() as u32)
        .ok_or_else(|| bad("has too many decimals"))?;
    let scale = base
        .checked_pow(power.unsigned_abs())
        .ok_or_else(|| bad("is too large"))?;
    let (num, den) = if power >= 0 {
        (digits.checked_mul(scale), Some(frac_scale))
    } else {
        (Some(digits), frac_scale.checked_mul(scale))
    };
    let (num, den) = num.zip(den).ok_or_else(|| bad("is too large"))?;
    if num % den != 0 {
        return Err(bad("is not a whole number of devices"));
    }
    u64::try_from(num / den).map_err(|_| bad("is too large"))
}

/// GPUs one pod of this template asks for (0 when none): GPU and MIG
/// resources, limits else requests (as the controller counts them); an
/// amount that is not a whole, non-negative quantity is an error naming it.
pub fn template_gpus(template: Option<&Value>) -> Result<u32, String> {
    let Some(spec) = template.and_then(|t| t.get("spec")) else {
        return Ok(0);
    };
    let mut total = 0u32;
    for c in spec
        .get("containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let res = c.get("resources");
        let amounts = res
            .and_then(|r| r.get("limits"))
            .and_then(Value::as_object)
            .filter(|l| l.keys().any(|k| is_gpu_resource(k)))
            .or_else(|| {
                res.and_then(|r| r.get("requests"))
                    .and_then(Value::as_object)
            });
        for (k, v) in amounts.into_iter().flatten() {
            if !is_gpu_resource(k) {
                continue;
            }
            let name = c.get("name").and_then(Value::as_str).unwrap_or("?");
            let n = device_quantity(v).map_err(|e| format!("container {name}: {k}: {e}"))?;
            total = total.saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
        }
    }
    Ok(total)
}

pub(crate) fn escape_pointer(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// Labels the object and its pod templates and writes the resolved
/// workload, so the leader can record the run when it ends.
pub fn mark_for_recording(obj: &mut Value, templates: &[String], workload: &Workload) {
    for ptr in templates {
        if let Some(t) = obj.pointer_mut(ptr).and_then(Value::as_object_mut) {
            set_label(
                t.entry("metadata").or_insert_with(|| json!({})),
                LABEL_CONFIGURED,
                "true",
            );
        }
    }
    if let Some(meta) = obj.get_mut("metadata") {
        set_label(meta, LABEL_CONFIGURED, "true");
    }
    if let (Some(meta), Ok(w)) = (obj.get_mut("metadata"), serde_json::to_string(workload)) {
        super::inject::add_annotations(
            meta,
            &[(ANN_WORKLOAD.to_string(), w)].into_iter().collect(),
        );
    }
}

/// Sets one label on a JSON `metadata` object.
pub fn set_label(meta: &mut Value, key: &str, value: &str) {
    let Some(meta) = meta.as_object_mut() else {
        return;
    };
    let labels = meta.entry("labels").or_insert_with(|| json!({}));
    if !labels.is_object() {
        *labels = json!({});
    }
    if let Some(l) = labels.as_object_mut() {
        l.insert(key.into(), Value::String(value.into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_read_as_kubernetes_reads_them() {
        for (q, n) in [
            ("8", 8),
            ("2k", 2000),
            ("1e3", 1000),
            ("1Ki", 1024),
            ("2000m", 2),
            ("+4", 4),
            ("0", 0),
        ] {
            assert_eq!(device_quantity(&json!(q)), Ok(n), "{q}");
        }
        assert_eq!(device_quantity(&json!(4)), Ok(4));
        for q in [
            "two",
            "-2",
            "1.5",
            "500m",
            "",
            "1Zi",
            "1e",
            "99999999999999999999999999999999999999999",
        ] {
            let e = device_quantity(&json!(q)).unwrap_err();
            assert!(e.contains(&format!("`{q}`")), "{q}: {e}");
        }
    }

    #[test]
    fn each_kind_is_registered_once_and_found_by_group_and_kind() {
        let mut seen = std::collections::BTreeSet::new();
        for k in KINDS {
            assert!(seen.insert((k.group(), k.kind())), "{}", k.kind());
            assert_eq!(
                of(Some(k.group()), k.kind()).map(|f| f.plural()),
                Some(k.plural())
            );
            assert!(of_api_version(&k.api_version(), k.kind()).is_some());
        }
        // A Deployment has a pod template but is not a training kind.
        assert!(of(Some("apps"), "Deployment").is_none());
        assert!(of(Some("other.io"), "Job").is_none());
    }
}
