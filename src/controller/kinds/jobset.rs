//! `jobset.x-k8s.io/v1alpha2` JobSet: every training
//! `spec.replicatedJobs[].template.spec.template` — those asking for GPUs
//! (a driver without GPUs is left alone; when none asks, all, one GPU per
//! pod) — Kueue's pod set per replicated Job by its name
//! (`pkg/controller/jobs/jobset`), W = Σ replicas × min(parallelism,
//! completions) × GPUs per pod; ends with `Completed` or `Failed`; its pods
//! (owned by its child Jobs) carry `jobset.sigs.k8s.io/jobset-name` and
//! its uid.

use serde_json::Value;

use super::{count, job_pods, template_gpus, Shape, Template, TrainingKind};

pub struct JobSet;

impl TrainingKind for JobSet {
    fn group(&self) -> &'static str {
        "jobset.x-k8s.io"
    }
    fn version(&self) -> &'static str {
        "v1alpha2"
    }
    fn kind(&self) -> &'static str {
        "JobSet"
    }
    fn plural(&self) -> &'static str {
        "jobsets"
    }
    fn kueue_framework(&self) -> &'static str {
        "jobset.x-k8s.io/jobset"
    }
    fn shape(&self, obj: &Value) -> Result<Shape, String> {
        // (template, pods = replicas × parallelism, GPUs per pod)
        let mut found: Vec<(Template, u32, u32)> = Vec::new();
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
            let name = rj.get("name").and_then(Value::as_str).unwrap_or_default();
            let per_pod = template_gpus(Some(t)).map_err(|e| {
                format!("gpufit did not change this JobSet: replicated Job {name}: {e}")
            })?;
            let pods =
                count(rj.get("replicas")).saturating_mul(job_pods(rj.pointer("/template/spec")));
            found.push((
                Template {
                    pointer: format!("/spec/replicatedJobs/{i}/template/spec/template"),
                    pod_set: name.to_string(),
                },
                pods,
                per_pod,
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
            templates: training.into_iter().map(|(t, ..)| t).collect(),
            trainer: None,
            gpus: Some(gpus.max(1)),
        })
    }
    fn end(&self, condition: &str) -> Option<bool> {
        match condition {
            "Completed" => Some(true),
            "Failed" => Some(false),
            _ => None,
        }
    }
    fn pods_by_jobset_label(&self) -> bool {
        true
    }
    fn jobset_uid_is_own(&self) -> bool {
        true
    }
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
        let s = JobSet.shape(&obj).unwrap();
        assert_eq!(s.gpus, Some(2 * 2 * 4 + 8 + 2));
        assert_eq!(
            s.pointers(),
            [
                "/spec/replicatedJobs/1/template/spec/template",
                "/spec/replicatedJobs/2/template/spec/template",
                "/spec/replicatedJobs/3/template/spec/template"
            ]
        );
        let sets: Vec<_> = s.templates.iter().map(|t| t.pod_set.as_str()).collect();
        assert_eq!(sets, ["a", "b", "c"]);
        assert!(JobSet.shape(&json!({"spec": {"replicatedJobs": []}})).is_err());
    }
}
