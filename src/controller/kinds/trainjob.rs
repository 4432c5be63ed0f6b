//! Kubeflow Trainer `trainer.kubeflow.org/v1alpha1` TrainJob (Trainer
//! v2.0 – v2.3): its pods come from its runtime (a ClusterTrainingRuntime
//! gpufit does not read), so the settings go where Trainer merges them
//! into the trainer containers — `spec.trainer.env` and the placeholders
//! of `spec.trainer.command`/`args`. Kueue's pod sets are its runtime
//! JobSet's (`pkg/controller/jobs/trainjob`), known only from the Workload.
//! W = numNodes × GPUs in `resourcesPerNode`, when both are set (else
//! `gpufit.io/gpus`, or Kueue's admission). Ends with `Complete` or
//! `Failed`; its pods carry its runtime JobSet's name label (the JobSet is
//! named after the TrainJob) and that JobSet's uid.

use serde_json::Value;

use super::{device_quantity, Shape, TrainingKind};

pub struct TrainJob;

impl TrainingKind for TrainJob {
    fn group(&self) -> &'static str {
        "trainer.kubeflow.org"
    }
    fn version(&self) -> &'static str {
        "v1alpha1"
    }
    fn kind(&self) -> &'static str {
        "TrainJob"
    }
    fn plural(&self) -> &'static str {
        "trainjobs"
    }
    fn kueue_framework(&self) -> &'static str {
        "trainer.kubeflow.org/trainjob"
    }
    fn shape(&self, obj: &Value) -> Result<Shape, String> {
        let nodes = obj
            .pointer("/spec/trainer/numNodes")
            .and_then(Value::as_u64);
        let resources = obj.pointer("/spec/trainer/resourcesPerNode");
        let mut per_node = None;
        for k in ["limits", "requests"] {
            if let Some(v) = resources
                .and_then(|r| r.get(k))
                .and_then(|l| l.get(super::super::gpu::GPU_RESOURCE))
            {
                let n = device_quantity(v).map_err(|e| {
                    format!(
                        "gpufit did not change this TrainJob: spec.trainer.resourcesPerNode.{k}: nvidia.com/gpu: {e}"
                    )
                })?;
                per_node.get_or_insert(n);
            }
        }
        let gpus = match (nodes, per_node) {
            (Some(n), Some(g)) if n > 0 && g > 0 => Some(
                u32::try_from(n.saturating_mul(g)).unwrap_or(u32::MAX),
            ),
            _ => None,
        };
        Ok(Shape {
            templates: Vec::new(),
            trainer: Some("/spec/trainer".to_string()),
            gpus,
        })
    }
    fn end(&self, condition: &str) -> Option<bool> {
        match condition {
            "Complete" => Some(true),
            "Failed" => Some(false),
            _ => None,
        }
    }
    fn pods_by_jobset_label(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_trainjob_without_nodes_or_gpus_leaves_w_to_the_annotation() {
        let s = TrainJob
            .shape(&json!({"spec": {"trainer": {"numNodes": 2}}}))
            .unwrap();
        assert_eq!(s.gpus, None);
        let s = TrainJob
            .shape(&json!({"spec": {"trainer": {"numNodes": 2, "resourcesPerNode": {"requests": {"nvidia.com/gpu": "4"}}}}}))
            .unwrap();
        assert_eq!(s.gpus, Some(8));
        assert!(TrainJob
            .shape(&json!({"spec": {"trainer": {"numNodes": 2, "resourcesPerNode": {"limits": {"nvidia.com/gpu": "-2"}}}}}))
            .is_err());
    }
}
