//! Kubeflow `kubeflow.org/v1` PyTorchJob: every
//! `spec.pytorchReplicaSpecs.<type>.template`, Kueue's pod set per replica
//! type lower-cased (`pkg/controller/jobs/kubeflow`), W = Σ replicas × GPUs
//! per pod; ends with `Succeeded` or `Failed`; its pods are the ones it owns.

use serde_json::Value;

use super::{count, escape_pointer, template_gpus, Shape, Template, TrainingKind};

pub struct PyTorchJob;

impl TrainingKind for PyTorchJob {
    fn group(&self) -> &'static str {
        "kubeflow.org"
    }
    fn version(&self) -> &'static str {
        "v1"
    }
    fn kind(&self) -> &'static str {
        "PyTorchJob"
    }
    fn plural(&self) -> &'static str {
        "pytorchjobs"
    }
    fn kueue_framework(&self) -> &'static str {
        "kubeflow.org/pytorchjob"
    }
    fn shape(&self, obj: &Value) -> Result<Shape, String> {
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
            let per_pod = template_gpus(Some(t)).map_err(|e| {
                format!("gpufit did not change this PyTorchJob: replica {rank}: {e}")
            })?;
            templates.push(Template {
                pointer: format!(
                    "/spec/pytorchReplicaSpecs/{}/template",
                    escape_pointer(rank)
                ),
                pod_set: rank.to_lowercase(),
            });
            gpus = gpus.saturating_add(count(spec.get("replicas")).saturating_mul(per_pod.max(1)));
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
    fn end(&self, condition: &str) -> Option<bool> {
        match condition {
            "Succeeded" => Some(true),
            "Failed" => Some(false),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn master_and_workers_are_pod_sets_master_and_worker() {
        let t = json!({"spec": {"containers": [{"name": "p", "resources": {"limits": {"nvidia.com/gpu": 2}}}]}});
        let obj = json!({"spec": {"pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "template": t.clone()},
            "Worker": {"replicas": 3, "template": t}}}});
        let s = PyTorchJob.shape(&obj).unwrap();
        assert_eq!(s.gpus, Some(8));
        let sets: Vec<_> = s.templates.iter().map(|t| t.pod_set.as_str()).collect();
        assert_eq!(sets, ["master", "worker"]);
        assert!(PyTorchJob.shape(&json!({"spec": {}})).is_err());
    }
}
