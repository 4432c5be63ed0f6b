//! Build: a TrainingJob plus the advisor's suggestion → the desired
//! `batch/v1` Job. Pure: what the Job looks like is decided here and tested
//! without an API server; `reconcile` only sends it.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};

use crate::core::advisor::Suggestion;

use super::crd::{Mode, TrainingJob};
use super::inject;

/// Label on every Job gpufit creates: the TrainingJob it belongs to.
pub const LABEL_TRAINING_JOB: &str = "gpufit.io/training-job";
/// Label on every Job gpufit creates: the attempt number (1, 2, …).
pub const LABEL_ATTEMPT: &str = "gpufit.io/attempt";

/// Why a Job cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BuildError {
    #[error("the TrainingJob has no {0}: it must come from the API server")]
    MissingMetadata(&'static str),
    #[error("the pod template cannot be converted: {0}")]
    Template(String),
}

/// Name of the Job of attempt `attempt`: `<trainingjob>-<attempt>`, kept
/// within the 63 characters a Job name (and its pods' labels) may have.
pub fn job_name(tj_name: &str, attempt: u32) -> String {
    let suffix = format!("-{attempt}");
    let keep = 63usize.saturating_sub(suffix.len());
    let base: String = tj_name.chars().take(keep).collect();
    format!("{}{suffix}", base.trim_end_matches('-'))
}

/// The Job for one attempt. In Inject mode every container gets the settings;
/// in Recommend mode the template is used as written and only annotated.
pub fn build_job(
    tj: &TrainingJob,
    attempt: u32,
    suggestion: &Suggestion,
    mode: Mode,
) -> Result<Job, BuildError> {
    let name = tj
        .metadata
        .name
        .clone()
        .ok_or(BuildError::MissingMetadata("name"))?;
    let owner = tj
        .controller_owner_ref(&())
        .ok_or(BuildError::MissingMetadata("uid"))?;

    let mut template =
        serde_json::to_value(&tj.spec.template).map_err(|e| BuildError::Template(e.to_string()))?;
    inject::inject_pod_template(&mut template, suggestion, mode, mode == Mode::Inject);
    let mut template: PodTemplateSpec =
        serde_json::from_value(template).map_err(|e| BuildError::Template(e.to_string()))?;
    if let Some(pod) = template.spec.as_mut() {
        // A Job's pods may not restart Always; Never keeps each attempt's
        // failure visible to gpufit instead of restarting in place.
        if pod.restart_policy.is_none() {
            pod.restart_policy = Some("Never".into());
        }
    }
    let labels_on_pods = template.metadata.get_or_insert_with(ObjectMeta::default);
    let pod_labels = labels_on_pods.labels.get_or_insert_with(BTreeMap::new);
    pod_labels.insert(LABEL_TRAINING_JOB.into(), name.clone());
    pod_labels.insert(LABEL_ATTEMPT.into(), attempt.to_string());

    let mut labels = tj.labels().clone();
    labels.insert(LABEL_TRAINING_JOB.into(), name.clone());
    labels.insert(LABEL_ATTEMPT.into(), attempt.to_string());
    labels.insert("app.kubernetes.io/managed-by".into(), "gpufit".into());

    Ok(Job {
        metadata: ObjectMeta {
            name: Some(job_name(&name, attempt)),
            namespace: tj.metadata.namespace.clone(),
            labels: Some(labels),
            annotations: Some(inject::annotations(suggestion, mode)),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(tj.spec.backoff_limit.unwrap_or(0)),
            template,
            ..JobSpec::default()
        }),
        status: None,
    })
}
