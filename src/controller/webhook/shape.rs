//! Where an opted-in object trains, per kind: the pod templates (or the
//! TrainJob trainer) that get the settings, and W, the data-parallel GPUs of
//! the whole job, so that m × a × W = G holds for all of it.
//!
//! | kind | what gets the settings | W |
//! |---|---|---|
//! | `batch/v1` Job (and any kind with `spec.template`) | `spec.template` | min(parallelism, completions) × GPUs per pod |
//! | `kubeflow.org/v1` PyTorchJob | every `pytorchReplicaSpecs.*.template` | Σ replicas × GPUs per pod |
//! | `jobset.x-k8s.io/v1alpha2` JobSet | every training `replicatedJobs[].template.spec.template` | Σ replicas × min(parallelism, completions) × GPUs per pod |
//! | `trainer.kubeflow.org/v1alpha1` TrainJob | `spec.trainer` (env, command, args) | numNodes × GPUs in resourcesPerNode |
//!
//! A JobSet's training templates are those that ask for GPUs (a driver or a
//! parameter-server job without GPUs is left alone); when none asks, every
//! template is counted with one GPU per pod, as a Job without a GPU limit is.
//!
//! A TrainJob's pods come from its runtime (a ClusterTrainingRuntime gpufit
//! does not read), so the settings go where Kubeflow Trainer (v2.0 – v2.3,
//! API `trainer.kubeflow.org/v1alpha1`) merges them into the trainer
//! containers: `spec.trainer.env`, plus the placeholders of
//! `spec.trainer.command`/`args`. W is known only when the TrainJob sets
//! both `numNodes` and GPUs in `resourcesPerNode`, or `gpufit.io/gpus` says.

use serde_json::Value;

/// Where the settings go in one object, and its W when the object says.
#[derive(Debug)]
pub(super) struct Shape {
    /// JSON pointers of the pod templates that train.
    pub templates: Vec<String>,
    /// JSON pointer of a container-like object (a TrainJob's `spec.trainer`)
    /// that gets the settings as a container would.
    pub trainer: Option<String>,
    /// Data-parallel GPUs of the whole job; None when the object does not
    /// say (a TrainJob whose runtime decides).
    pub gpus: Option<u32>,
}

/// The shape of an object of this kind, or why gpufit cannot configure it
/// (the object is then allowed unchanged with that warning).
pub(super) fn shape(kind: &str, obj: &Value) -> Result<Shape, String> {
    match kind {
        "PyTorchJob" => pytorchjob(obj),
        "JobSet" => jobset(obj),
        "TrainJob" => Ok(trainjob(obj)),
        _ if obj.pointer("/spec/template").is_some() => {
            let t = "/spec/template".to_string();
            let pods = job_pods(obj.get("spec"));
            let gpus = pods.saturating_mul(gpu_limit(obj.pointer(&t)).max(1));
            Ok(Shape {
                templates: vec![t],
                trainer: None,
                gpus: Some(gpus.max(1)),
            })
        }
        _ => Err(format!(
            "gpufit did not change this {kind}: it has no pod template gpufit knows how to configure \
             (gpufit configures Jobs, PyTorchJobs, JobSets and TrainJobs)"
        )),
    }
}

fn pytorchjob(obj: &Value) -> Result<Shape, String> {
    let mut templates = Vec::new();
    let mut gpus = 0u32;
    for (rank, spec) in obj
        .pointer("/spec/pytorchReplicaSpecs")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let Some(t) = spec.get("template") else {
            continue;
        };
        templates.push(format!(
            "/spec/pytorchReplicaSpecs/{}/template",
            escape_pointer(rank)
        ));
        let per_pod = gpu_limit(Some(t)).max(1);
        gpus = gpus.saturating_add(count(spec.get("replicas")).saturating_mul(per_pod));
    }
    if templates.is_empty() {
        return Err(
            "gpufit did not change this PyTorchJob: spec.pytorchReplicaSpecs has no pod template"
                .into(),
        );
    }
    Ok(Shape {
        templates,
        trainer: None,
        gpus: Some(gpus.max(1)),
    })
}

fn jobset(obj: &Value) -> Result<Shape, String> {
    // (pointer, pods = replicas × parallelism, GPUs per pod)
    let mut found: Vec<(String, u32, u32)> = Vec::new();
    for (i, rj) in obj
        .pointer("/spec/replicatedJobs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let Some(t) = rj.pointer("/template/spec/template") else {
            continue;
        };
        let pods = count(rj.get("replicas")).saturating_mul(job_pods(rj.pointer("/template/spec")));
        found.push((
            format!("/spec/replicatedJobs/{i}/template/spec/template"),
            pods,
            gpu_limit(Some(t)),
        ));
    }
    if found.is_empty() {
        return Err(
            "gpufit did not change this JobSet: spec.replicatedJobs has no pod template".into(),
        );
    }
    let any_gpu = found.iter().any(|(_, _, g)| *g > 0);
    let training: Vec<_> = found
        .into_iter()
        .filter(|(_, _, g)| !any_gpu || *g > 0)
        .collect();
    let gpus = training.iter().fold(0u32, |w, (_, pods, g)| {
        w.saturating_add(pods.saturating_mul((*g).max(1)))
    });
    Ok(Shape {
        templates: training.into_iter().map(|(p, ..)| p).collect(),
        trainer: None,
        gpus: Some(gpus.max(1)),
    })
}

fn trainjob(obj: &Value) -> Shape {
    let nodes = obj
        .pointer("/spec/trainer/numNodes")
        .and_then(Value::as_u64);
    let resources = obj.pointer("/spec/trainer/resourcesPerNode");
    let per_node = ["limits", "requests"]
        .iter()
        .filter_map(|k| resources.and_then(|r| r.get(*k)).and_then(|l| l.get(GPU)))
        .find_map(quantity);
    let gpus = match (nodes, per_node) {
        (Some(n), Some(g)) if n > 0 && g > 0 => {
            Some(u32::try_from(n).unwrap_or(u32::MAX).saturating_mul(g))
        }
        _ => None,
    };
    Shape {
        templates: Vec::new(),
        trainer: Some("/spec/trainer".to_string()),
        gpus,
    }
}

/// The extended resource GPUs are asked for by.
const GPU: &str = "nvidia.com/gpu";

/// A count field (replicas, parallelism), 1 when absent (the API default).
fn count(v: Option<&Value>) -> u32 {
    v.and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        .unwrap_or(1)
}

/// Pods a Job runs at once: its parallelism, at most its completions (as
/// Kueue counts a Job's, and a JobSet replicated Job's, pod set).
fn job_pods(spec: Option<&Value>) -> u32 {
    let parallelism = count(spec.and_then(|s| s.get("parallelism")));
    match spec
        .and_then(|s| s.get("completions"))
        .and_then(Value::as_u64)
    {
        Some(c) => parallelism.min(u32::try_from(c).unwrap_or(u32::MAX)),
        None => parallelism,
    }
}

/// A GPU quantity: `"8"` as the API server writes it, or a bare number.
fn quantity(v: &Value) -> Option<u32> {
    match v {
        Value::String(s) => s.parse::<u32>().ok(),
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        _ => None,
    }
}

/// GPUs one pod of this template asks for (0 when none): `nvidia.com/gpu`
/// and MIG slices (`nvidia.com/mig-…`), limits else requests, as the
/// controller counts them.
fn gpu_limit(template: Option<&Value>) -> u32 {
    template
        .and_then(|t| t.get("spec"))
        .map(|s| crate::controller::gpu::pod_gpus_json(s).count)
        .unwrap_or(0)
}

fn escape_pointer(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_jobset_counts_replicas_parallelism_and_gpus_of_its_training_jobs_only() {
        let pod = |gpus: Option<u32>| match gpus {
            Some(g) => {
                json!({"spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": g.to_string()}}}]}})
            }
            None => json!({"spec": {"containers": [{"name": "driver"}]}}),
        };
        let obj = json!({"spec": {"replicatedJobs": [
            {"name": "driver", "replicas": 1, "template": {"spec": {"template": pod(None)}}},
            {"name": "a", "replicas": 2, "template": {"spec": {"parallelism": 2, "template": pod(Some(4))}}},
            {"name": "b", "template": {"spec": {"template": pod(Some(8))}}},
            // Parallelism 4 but 2 completions: 2 pods at a time (Kueue counts 2).
            {"name": "c", "template": {"spec": {"parallelism": 4, "completions": 2, "template": pod(Some(1))}}}
        ]}});
        let s = shape("JobSet", &obj).unwrap();
        assert_eq!(s.gpus, Some(2 * 2 * 4 + 8 + 2));
        assert_eq!(
            s.templates,
            [
                "/spec/replicatedJobs/1/template/spec/template",
                "/spec/replicatedJobs/2/template/spec/template",
                "/spec/replicatedJobs/3/template/spec/template"
            ]
        );
        let job = json!({"spec": {"parallelism": 8, "completions": 3, "template": pod(Some(2))}});
        assert_eq!(shape("Job", &job).unwrap().gpus, Some(3 * 2));
    }

    #[test]
    fn a_trainjob_without_nodes_or_gpus_leaves_w_to_the_annotation() {
        let s = shape("TrainJob", &json!({"spec": {"trainer": {"numNodes": 2}}})).unwrap();
        assert_eq!(s.gpus, None);
        let s = shape(
            "TrainJob",
            &json!({"spec": {"trainer": {"numNodes": 2, "resourcesPerNode": {"requests": {"nvidia.com/gpu": "4"}}}}}),
        )
        .unwrap();
        assert_eq!(s.gpus, Some(8));
    }

    #[test]
    fn a_kind_without_a_pod_template_is_a_warning_not_a_denial() {
        let e = shape("RayJob", &json!({"spec": {"entrypoint": "python t.py"}})).unwrap_err();
        assert!(e.contains("RayJob"), "{e}");
        assert!(shape("JobSet", &json!({"spec": {"replicatedJobs": []}})).is_err());
    }
}
