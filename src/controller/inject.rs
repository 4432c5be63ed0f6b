//! The one injection code path, shared by the reconciler (Jobs it creates)
//! and the admission webhook (Jobs and PyTorchJobs users create): every
//! container of every pod template (every rank of a distributed job) gets the
//! same `GPUFIT_*` environment variables and the same `{placeholder}`
//! substitutions, and the object gets annotations saying what was set and why.
//!
//! It works on JSON values rather than typed structs so the webhook never
//! drops a field that k8s-openapi does not know (newer API servers, CRDs).

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::crd::{Mode, SettingsStatus};
use crate::core::advisor::Suggestion;

/// Annotation with the settings gpufit wrote (Inject mode), as JSON.
pub const ANN_APPLIED: &str = "gpufit.io/applied-settings";
/// Annotation with the settings gpufit recommends (Recommend mode), as JSON.
pub const ANN_RECOMMENDATION: &str = "gpufit.io/recommendation";
/// Annotation with the advisor's reasoning (why).
pub const ANN_REASON: &str = "gpufit.io/reason";

/// Downward-API variables every injected container gets: the pod's
/// namespace and name, which the node sidecar reads from the process
/// environment to attribute GPU memory to the pod.
pub const POD_IDENTITY_ENV: [(&str, &str); 2] = [
    ("GPUFIT_POD_NAMESPACE", "metadata.namespace"),
    ("GPUFIT_POD_NAME", "metadata.name"),
];

// The settings table (placeholders, variables, values) is the core's,
// shared with the Slurm TaskProlog and `find-max-batch`.
pub use crate::core::settings::{env_vars, substitute, SETTING_VARS};

/// The annotations an object gets: what was set (or recommended) and why.
pub fn annotations(suggestion: &Suggestion, mode: Mode) -> BTreeMap<String, String> {
    let what = json!({
        "settings": SettingsStatus::from(&suggestion.settings),
        "source": suggestion.source,
        "strategy": suggestion.strategy,
        "confidence": suggestion.confidence,
        "predictedPeakBytes": suggestion.predicted_peak_bytes,
        "gpu": suggestion.gpu,
    });
    let key = match mode {
        Mode::Inject => ANN_APPLIED,
        Mode::Recommend => ANN_RECOMMENDATION,
    };
    let mut m = BTreeMap::new();
    m.insert(key.to_string(), what.to_string());
    m.insert(ANN_REASON.to_string(), suggestion.reasoning.clone());
    m
}

/// Injects the settings into a pod template given as JSON
/// (`{"metadata": …, "spec": {"containers": […]}}`): every container gets
/// the `GPUFIT_*` variables (replacing same-named ones) and its
/// `command`/`args` placeholders filled; the template gets the annotations.
/// With `set_termination_policy`, containers without a
/// `terminationMessagePolicy` get `FallbackToLogsOnError`, so a CUDA
/// out-of-memory message in the log reaches the pod status.
pub fn inject_pod_template(
    template: &mut Value,
    suggestion: &Suggestion,
    mode: Mode,
    set_termination_policy: bool,
) {
    let anns = annotations(suggestion, mode);
    if let Some(t) = template.as_object_mut() {
        let meta = t.entry("metadata").or_insert_with(|| json!({}));
        add_annotations(meta, &anns);
    }
    if mode == Mode::Recommend {
        return;
    }
    let Some(containers) = template
        .pointer_mut("/spec/containers")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    let env = env_vars(&suggestion.settings);
    for c in containers.iter_mut() {
        let Some(c) = c.as_object_mut() else { continue };
        let list = c.entry("env").or_insert_with(|| json!([]));
        if !list.is_array() {
            *list = json!([]);
        }
        if let Some(list) = list.as_array_mut() {
            list.retain(|e| {
                let n = e.get("name").and_then(Value::as_str).unwrap_or("");
                !env.iter().any(|(k, _)| *k == n) && !POD_IDENTITY_ENV.iter().any(|(k, _)| *k == n)
            });
            for (k, v) in &env {
                list.push(json!({"name": k, "value": v}));
            }
            // The node sidecar attributes GPU processes to pods by these
            // (docs/sidecar-api.md), so peaks are found by namespace/pod.
            for (k, path) in POD_IDENTITY_ENV {
                list.push(json!({"name": k, "valueFrom": {"fieldRef": {"fieldPath": path}}}));
            }
        }
        for field in ["command", "args"] {
            if let Some(words) = c.get_mut(field).and_then(Value::as_array_mut) {
                for w in words.iter_mut() {
                    if let Some(s) = w.as_str() {
                        *w = Value::String(substitute(s, &suggestion.settings));
                    }
                }
            }
        }
        if set_termination_policy && !c.contains_key("terminationMessagePolicy") {
            c.insert(
                "terminationMessagePolicy".into(),
                Value::String("FallbackToLogsOnError".into()),
            );
        }
    }
}

/// Adds annotations to a JSON `metadata` object.
pub fn add_annotations(meta: &mut Value, anns: &BTreeMap<String, String>) {
    let Some(meta) = meta.as_object_mut() else {
        return;
    };
    let a = meta.entry("annotations").or_insert_with(|| json!({}));
    if !a.is_object() {
        *a = json!({});
    }
    if let Some(a) = a.as_object_mut() {
        for (k, v) in anns {
            a.insert(k.clone(), Value::String(v.clone()));
        }
    }
}
