//! Fixtures shared by the controller's test files: the examples as the API
//! server returns them, a minimal spec to edit, GPU nodes, a 404 Status.

// Each consumer uses part of this module.
#![allow(dead_code)]

use gpufit::controller::crd::TrainingJob;
use k8s_openapi::api::core::v1::Node;
use serde_json::{json, Value};

pub const EXAMPLE_LORA: &str = include_str!("../../examples/llama-3.1-8b-lora-a100.yaml");

pub const EXAMPLE_RECOMMEND: &str = include_str!("../../examples/recommend-mode.yaml");

pub fn tj_from_yaml(yaml: &str) -> TrainingJob {
    serde_yaml::from_str(yaml).expect("fixture is a TrainingJob")
}

/// A fixture as the API server returns it: with uid, generation, namespace.
pub fn served(mut tj: TrainingJob) -> TrainingJob {
    tj.metadata.uid = Some("0b5c1f7e-uid".into());
    tj.metadata.generation = Some(1);
    tj.metadata.resource_version = Some("1".into());
    if tj.metadata.namespace.is_none() {
        tj.metadata.namespace = Some("default".into());
    }
    tj
}

pub const MINIMAL: &str = r#"
apiVersion: gpufit.io/v1alpha1
kind: TrainingJob
metadata: {name: t, namespace: default}
spec:
  workload:
    architecture: {name: tiny-gpt, params: 124000000, hiddenSize: 768, layers: 12, heads: 12, vocabSize: 50257}
    seqLen: 1024
  template:
    spec:
      containers: [{name: train, image: train:1, args: ["--batch", "{micro_batch_size}"]}]
"#;

pub fn minimal_with(edit: impl FnOnce(&mut Value)) -> TrainingJob {
    let mut v: Value = serde_yaml::from_str(MINIMAL).expect("fixture");
    edit(&mut v);
    serde_json::from_value(v).expect("still a TrainingJob")
}

pub fn node(name: &str, labels: &[(&str, &str)]) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()}
    }))
    .expect("node")
}

pub fn status_404(what: &str) -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": format!("{what} not found")}),
    )
}
