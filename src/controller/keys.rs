//! Every `gpufit.io/*` key gpufit reads or writes on Kubernetes objects, in
//! one place (the modules that once defined them re-export them).
//!
//! | key | on | written by | meaning |
//! |---|---|---|---|
//! | [`ANN_APPLIED`] | job, pod template | webhook, Kueue answer, reconciler | the settings gpufit set (JSON) |
//! | [`ANN_RECOMMENDATION`] | job, pod template | webhook, Kueue answer | the settings gpufit recommends (Recommend mode) |
//! | [`ANN_REASON`] | job, pod template | webhook, Kueue answer | the advisor's reasoning, or why nothing was set |
//! | [`ANN_WORKLOAD`] | job | webhook, Kueue answer | the resolved workload (JSON), for the run recorder |
//! | [`ANN_RECORDED`] | job | run recorder | the history's run id |
//! | [`ANN_PEAK_PENDING`] | job | run recorder | peak lookups so far and the time of the last |
//! | [`LABEL_CONFIGURED`] | job, pod template | webhook | gpufit configured it: its run is recorded |
//! | [`LABEL_DEFERRED`] | pod template | webhook | its settings arrive at Kueue admission (downward API) |
//! | [`ANN_FALLBACK`] | pod template | webhook | the settings a deferred pod falls back to |
//! | [`SETTING_ANNOTATION_PREFIX`]`<placeholder>` | pod | Kueue answer, pod webhook | one setting, read by the downward API |
//! | [`MODE_KEY`] | job annotation, namespace label | user | `Inject` or `Recommend` |
//! | [`NAMESPACE_KUEUE`] | namespace label | admin | `managed`/`unmanaged`: Kueue manages unlabelled jobs here |
//! | [`CONTROLLER_NAME`] | AdmissionCheck `spec.controllerName` | admin | gpufit answers this check |
//! | [`INPUT_PREFIX`]`…` ([`INPUT_KEYS`]) | job annotation | user | what to plan for (docs/controller.md) |
//!
//! The GPU-sharing key (`gpufit.io/gpu-sharing`) is the GPU module's
//! ([`super::gpu::SHARING_KEY`]) and one of the [`INPUT_KEYS`].

/// Prefix of every gpufit key.
pub const INPUT_PREFIX: &str = "gpufit.io/";

/// The input annotations a user writes, without [`INPUT_PREFIX`].
pub const INPUT_KEYS: [&str; 17] = [
    "model",
    "architecture",
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
    "gpu-sharing",
];

/// Annotation with the settings gpufit wrote (Inject mode), as JSON.
pub const ANN_APPLIED: &str = "gpufit.io/applied-settings";
/// Annotation with the settings gpufit recommends (Recommend mode), as JSON.
pub const ANN_RECOMMENDATION: &str = "gpufit.io/recommendation";
/// Annotation with the advisor's reasoning (why).
pub const ANN_REASON: &str = "gpufit.io/reason";
/// The resolved workload (JSON), written at admission.
pub const ANN_WORKLOAD: &str = "gpufit.io/workload";
/// The history's run id, written once the run is recorded.
pub const ANN_RECORDED: &str = "gpufit.io/recorded";
/// `<lookups> <RFC 3339 time of the last>` while the peak is still unknown.
pub const ANN_PEAK_PENDING: &str = "gpufit.io/peak-pending";
/// Label on every object (and its pod templates) the webhook configured.
pub const LABEL_CONFIGURED: &str = "gpufit.io/configured";
/// Label on a pod template whose containers read their settings from pod
/// annotations set at Kueue admission (the pod webhook fills any missing).
pub const LABEL_DEFERRED: &str = "gpufit.io/deferred";
/// Prefix of the pod annotation that carries one setting at admission:
/// `gpufit.io/setting.micro_batch_size` (the placeholder's name).
pub const SETTING_ANNOTATION_PREFIX: &str = "gpufit.io/setting.";
/// Pod-template annotation: the settings (as [`SETTING_ANNOTATION_PREFIX`]
/// annotations, JSON) a deferred pod falls back to when it starts without
/// gpufit's admission answer. gpufit's answer never carries this key.
pub const ANN_FALLBACK: &str = "gpufit.io/fallback-settings";
/// Container variable with the same fallback, where no pod template can
/// carry it (a TrainJob's trainer: Trainer copies `spec.trainer.env` into
/// the runtime's trainer container).
pub const ENV_FALLBACK: &str = "GPUFIT_FALLBACK_SETTINGS";
/// Annotation (job) or label (namespace) that sets the mode.
pub const MODE_KEY: &str = "gpufit.io/mode";
/// Namespace label: `managed` (jobs without a queue label here are
/// Kueue's) or `unmanaged` (they are not), whatever the controller's flags say.
pub const NAMESPACE_KUEUE: &str = "gpufit.io/kueue";
/// The `spec.controllerName` of gpufit's AdmissionCheck.
pub const CONTROLLER_NAME: &str = "gpufit.io/advisor";

/// The key without [`INPUT_PREFIX`] (for the input map).
pub fn short(key: &str) -> &str {
    key.strip_prefix(INPUT_PREFIX).unwrap_or(key)
}
