//! `batch/v1` Job: one pod template, Kueue's pod set `main`
//! (`pkg/controller/jobs/job`), W = min(parallelism, completions) × GPUs
//! per pod; ends with `Complete` or `Failed`; its pods are the ones it owns.

use serde_json::Value;

use super::{job_pods, template_gpus, Shape, Template, TrainingKind};

pub struct Job;

impl TrainingKind for Job {
    fn group(&self) -> &'static str {
        "batch"
    }
    fn version(&self) -> &'static str {
        "v1"
    }
    fn kind(&self) -> &'static str {
        "Job"
    }
    fn plural(&self) -> &'static str {
        "jobs"
    }
    fn kueue_framework(&self) -> &'static str {
        "batch/job"
    }
    fn shape(&self, obj: &Value) -> Result<Shape, String> {
        let pointer = "/spec/template";
        let Some(t) = obj.pointer(pointer) else {
            return Err("gpufit did not change this Job: it has no spec.template".into());
        };
        let per_pod = template_gpus(Some(t))
            .map_err(|e| format!("gpufit did not change this Job: spec.template: {e}"))?;
        let gpus = job_pods(obj.get("spec")).saturating_mul(per_pod.max(1));
        Ok(Shape {
            templates: vec![Template {
                pointer: pointer.into(),
                pod_set: "main".into(),
            }],
            trainer: None,
            gpus: Some(gpus.max(1)),
        })
    }
    fn end(&self, condition: &str) -> Option<bool> {
        match condition {
            "Complete" => Some(true),
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
    fn a_job_runs_min_parallelism_completions_pods_in_pod_set_main() {
        let pod = json!({"spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}});
        let job = json!({"spec": {"parallelism": 8, "completions": 3, "template": pod}});
        let s = Job.shape(&job).unwrap();
        assert_eq!(s.gpus, Some(3 * 2));
        assert_eq!(s.templates[0].pod_set, "main");
        assert_eq!(Job.end("Complete"), Some(true));
        assert_eq!(Job.end("Suspended"), None);
        let bad = json!({"spec": {"template": {"spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "two"}}}]}}}});
        let e = Job.shape(&bad).unwrap_err();
        assert!(e.contains("`two`") && e.contains("nvidia.com/gpu"), "{e}");
    }
}
