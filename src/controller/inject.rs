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

pub use super::keys::{
    ANN_APPLIED, ANN_FALLBACK, ANN_REASON, ANN_RECOMMENDATION, ENV_FALLBACK, LABEL_DEFERRED,
    SETTING_ANNOTATION_PREFIX,
};

/// Downward-API variables every injected container gets: the pod's
/// namespace and name, which the node sidecar reads from the process
/// environment to attribute GPU memory to the pod.
pub const POD_IDENTITY_ENV: [(&str, &str); 2] = [
    ("GPUFIT_POD_NAMESPACE", "metadata.namespace"),
    ("GPUFIT_POD_NAME", "metadata.name"),
];

use crate::core::confirm::MICRO_BATCH_IN_COMMAND_ENV;

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
    for_each_container(template, |c| {
        inject_container(c, suggestion, set_termination_policy)
    });
}

/// Calls `f` on every container object of a pod template (JSON).
fn for_each_container(
    template: &mut Value,
    mut f: impl FnMut(&mut serde_json::Map<String, Value>),
) {
    if let Some(containers) = template
        .pointer_mut("/spec/containers")
        .and_then(Value::as_array_mut)
    {
        containers
            .iter_mut()
            .filter_map(Value::as_object_mut)
            .for_each(&mut f);
    }
}

/// Injects the settings into one container given as JSON (or an object
/// shaped like one, such as a Kubeflow TrainJob's `spec.trainer`, whose
/// `env`, `command` and `args` its controller merges into the trainer
/// containers): the `GPUFIT_*` variables (replacing same-named ones), the
/// pod identity variables, the `command`/`args` placeholders filled.
pub fn inject_container(
    c: &mut serde_json::Map<String, Value>,
    suggestion: &Suggestion,
    set_termination_policy: bool,
) {
    let entries = env_vars(&suggestion.settings)
        .into_iter()
        .map(|(k, v)| json!({"name": k, "value": v}))
        .collect();
    fill_container(c, entries, set_termination_policy, |w| {
        substitute(w, &suggestion.settings)
    });
}

/// What both injections do to one container: `entries` (the settings'
/// variables) replace same-named ones, the pod identity variables follow,
/// `rewrite` turns each `command`/`args` word, and the termination message
/// policy is set when asked and not already set.
fn fill_container(
    c: &mut serde_json::Map<String, Value>,
    entries: Vec<Value>,
    set_termination_policy: bool,
    rewrite: impl Fn(&str) -> String,
) {
    // gpufit writes the micro batch into the command line itself: the job
    // runs it, which confirms the run's settings when it is recorded
    // (`crate::core::confirm`); the marker travels to the pods in the env.
    let micro_batch = crate::core::settings::SETTING_VARS
        .iter()
        .find(|v| v.placeholder == "micro_batch_size")
        .map(|v| v.placeholder_text())
        .unwrap_or_default();
    // Also when a pass before this one (a reinvoked webhook) already wrote
    // it: the placeholder is then a `$(VAR)` reference or the value, and
    // the marker is kept in the same place, so every pass gives one object.
    let env_ref = "$(GPUFIT_MICRO_BATCH_SIZE)";
    let in_command = ["command", "args"].iter().any(|f| {
        c.get(*f).and_then(Value::as_array).is_some_and(|words| {
            words.iter().filter_map(Value::as_str).any(|w| {
                (!micro_batch.is_empty() && w.contains(&micro_batch)) || w.contains(env_ref)
            })
        })
    }) || c.get("env").and_then(Value::as_array).is_some_and(|env| {
        env.iter()
            .any(|e| e.get("name").and_then(Value::as_str) == Some(MICRO_BATCH_IN_COMMAND_ENV))
    });
    let mut entries = entries;
    if in_command {
        entries.push(json!({"name": MICRO_BATCH_IN_COMMAND_ENV, "value": "true"}));
    }
    let list = c.entry("env").or_insert_with(|| json!([]));
    if !list.is_array() {
        *list = json!([]);
    }
    if let Some(list) = list.as_array_mut() {
        let name = |e: &Value| e.get("name").and_then(Value::as_str).map(str::to_owned);
        let ours: Vec<String> = entries.iter().filter_map(name).collect();
        list.retain(|e| {
            let n = name(e).unwrap_or_default();
            !ours.contains(&n) && !POD_IDENTITY_ENV.iter().any(|(k, _)| *k == n)
        });
        list.extend(entries);
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
                    *w = Value::String(rewrite(s));
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

// === Settings decided later (Kueue) ===
//
// A Job queued in Kueue is created suspended and gets its GPU type (the
// ResourceFlavor) and its parallelism only when Kueue admits it; its
// containers cannot take new environment variables then (only the pod
// template's labels, annotations, node selector and tolerations change at
// unsuspend). So at creation every container gets each setting as a
// downward-API reference to a pod annotation, and the annotations arrive at
// admission through the AdmissionCheck's `podSetUpdates`
// (`super::reconcile::kueue`).

/// The pod annotation one setting travels in.
pub fn setting_annotation(v: &crate::core::settings::SettingVar) -> String {
    format!("{SETTING_ANNOTATION_PREFIX}{}", v.placeholder)
}

/// The pod annotations carrying every setting (one per row of
/// [`SETTING_VARS`], the values as the environment variables have them).
pub fn setting_annotations(
    s: &crate::core::settings::EngineeringSettings,
) -> BTreeMap<String, String> {
    SETTING_VARS
        .iter()
        .map(|v| (setting_annotation(v), (v.render)(s)))
        .collect()
}

/// `{micro_batch_size}` → `$(GPUFIT_MICRO_BATCH_SIZE)`: the kubelet expands
/// `$(VAR)` in `command`/`args` from the container's environment, so a
/// placeholder still becomes the value decided at admission.
pub fn placeholders_to_env_refs(word: &str) -> String {
    if !word.contains('{') {
        return word.to_string();
    }
    SETTING_VARS.iter().fold(word.to_string(), |out, v| {
        out.replace(&v.placeholder_text(), &format!("$({})", v.env))
    })
}

/// Injects into one container (or container-like object) the settings as
/// downward-API references ([`setting_annotation`]) instead of values, the
/// pod identity variables, and `$(VAR)` for the command's placeholders.
pub fn inject_container_deferred(
    c: &mut serde_json::Map<String, Value>,
    set_termination_policy: bool,
) {
    let entries = SETTING_VARS
        .iter()
        .map(|v| {
            let path = format!("metadata.annotations['{}']", setting_annotation(v));
            json!({"name": v.env, "valueFrom": {"fieldRef": {"fieldPath": path}}})
        })
        .collect();
    fill_container(c, entries, set_termination_policy, placeholders_to_env_refs);
}

/// [`inject_container_deferred`] for every container of a pod template
/// (JSON), the template labelled [`LABEL_DEFERRED`] (so gpufit's pod
/// webhook can fill a setting the pod lacks). The template's setting
/// annotations are left alone: Kueue refuses a `podSetUpdates` annotation
/// that the template already has with another value.
pub fn inject_pod_template_deferred(template: &mut Value) {
    for_each_container(template, |c| inject_container_deferred(c, true));
    if let Some(t) = template.as_object_mut() {
        let meta = t.entry("metadata").or_insert_with(|| json!({}));
        super::kinds::set_label(meta, LABEL_DEFERRED, "true");
    }
}

/// Writes the fallback settings (setting annotation → value) on a pod
/// template, under [`ANN_FALLBACK`] (a key gpufit's answer never carries).
pub fn add_fallback(template: &mut Value, fallback: &BTreeMap<String, String>) {
    if let (Some(t), Ok(json)) = (template.as_object_mut(), serde_json::to_string(fallback)) {
        let meta = t.entry("metadata").or_insert_with(|| json!({}));
        add_annotations(
            meta,
            &[(ANN_FALLBACK.to_string(), json)].into_iter().collect(),
        );
    }
}

/// Writes the fallback settings on a container-like object (a TrainJob's
/// `spec.trainer`) as the [`ENV_FALLBACK`] variable.
pub fn add_fallback_env(
    c: &mut serde_json::Map<String, Value>,
    fallback: &BTreeMap<String, String>,
) {
    let Ok(json) = serde_json::to_string(fallback) else {
        return;
    };
    let list = c.entry("env").or_insert_with(|| json!([]));
    if let Some(list) = list.as_array_mut() {
        list.retain(|e| e.get("name").and_then(Value::as_str) != Some(ENV_FALLBACK));
        list.push(json!({"name": ENV_FALLBACK, "value": json}));
    }
}

/// Whether a pod (JSON) has containers that read a setting from a pod
/// annotation (gpufit's deferred injection, through a job's template or a
/// TrainJob's trainer).
pub fn reads_deferred_settings(pod: &Value) -> bool {
    let prefix = format!("metadata.annotations['{SETTING_ANNOTATION_PREFIX}");
    pod.pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("env").and_then(Value::as_array))
        .flatten()
        .filter_map(|e| {
            e.pointer("/valueFrom/fieldRef/fieldPath")
                .and_then(Value::as_str)
        })
        .any(|p| p.starts_with(&prefix))
}

/// Fills, on a pod (JSON), every setting annotation that is missing or
/// empty: from its [`ANN_FALLBACK`] annotation, else its containers'
/// [`ENV_FALLBACK`], else the default settings. Returns the annotations
/// filled.
pub fn fill_missing_settings(pod: &mut Value) -> Vec<String> {
    let from_env: Option<String> = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("env").and_then(Value::as_array))
        .flatten()
        .find(|e| e.get("name").and_then(Value::as_str) == Some(ENV_FALLBACK))
        .and_then(|e| e.get("value").and_then(Value::as_str))
        .map(str::to_string);
    let Some(meta) = pod.get_mut("metadata") else {
        return Vec::new();
    };
    let anns = meta.get("annotations").cloned().unwrap_or(json!({}));
    let fallback: BTreeMap<String, String> = anns
        .get(ANN_FALLBACK)
        .and_then(Value::as_str)
        .map(str::to_string)
        .or(from_env)
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    let defaults = setting_annotations(&crate::core::settings::EngineeringSettings::default());
    let mut add = BTreeMap::new();
    for (key, default) in defaults {
        let have = anns.get(&key).and_then(Value::as_str).map(str::trim);
        if have.is_some_and(|v| !v.is_empty()) {
            continue;
        }
        let v = fallback
            .get(&key)
            .filter(|v| !v.trim().is_empty())
            .cloned()
            .unwrap_or(default);
        add.insert(key, v);
    }
    let filled = add.keys().cloned().collect();
    add_annotations(meta, &add);
    filled
}

#[cfg(test)]
mod deferred_tests {
    use super::*;

    #[test]
    fn a_deferred_container_reads_every_setting_from_its_pod_annotation() {
        let mut c = json!({"name": "t", "args": ["--mb", "{micro_batch_size}", "--ga={gradient_accumulation_steps}"],
                           "env": [{"name": "GPUFIT_DTYPE", "value": "fp32"}, {"name": "KEEP", "value": "1"}]});
        inject_container_deferred(c.as_object_mut().unwrap(), true);
        let env = c["env"].as_array().unwrap();
        // Every setting once, as a reference; the user's own variable kept.
        for v in SETTING_VARS {
            let refs: Vec<_> = env.iter().filter(|e| e["name"] == v.env).collect();
            assert_eq!(refs.len(), 1, "{}", v.env);
            assert_eq!(
                refs[0]["valueFrom"]["fieldRef"]["fieldPath"],
                format!(
                    "metadata.annotations['gpufit.io/setting.{}']",
                    v.placeholder
                )
            );
            assert!(refs[0].get("value").is_none());
        }
        assert!(env.iter().any(|e| e["name"] == "KEEP"));
        assert_eq!(
            c["args"],
            json!([
                "--mb",
                "$(GPUFIT_MICRO_BATCH_SIZE)",
                "--ga=$(GPUFIT_GRAD_ACCUM_STEPS)"
            ])
        );
        assert_eq!(c["terminationMessagePolicy"], "FallbackToLogsOnError");
    }
}
