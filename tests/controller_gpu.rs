//! The GPU a TrainingJob will run on, from the nodes' GPU Feature Discovery
//! labels, narrowed by the pod's node selector and affinity.

use gpufit::controller::gpu::{resolve_from_nodes, GpuError};
use serde_json::{json, Value};

#[path = "common/controller.rs"]
mod fixtures;
use fixtures::*;

fn pod_spec(v: Value) -> k8s_openapi::api::core::v1::PodSpec {
    serde_json::from_value(v).expect("pod spec")
}

#[test]
fn nodes_matching_the_node_selector_decide_the_gpu() {
    let nodes = [
        node(
            "a100",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
                ("nvidia.com/gpu.memory", "81920"),
                ("pool", "train"),
            ],
        ),
        node(
            "t4",
            &[
                ("nvidia.com/gpu.product", "Tesla-T4"),
                ("nvidia.com/gpu.memory", "15360"),
                ("pool", "infer"),
            ],
        ),
        node("cpu", &[("pool", "train")]),
    ];
    let pod = pod_spec(json!({"containers": [], "nodeSelector": {"pool": "train"}}));
    let gpu = resolve_from_nodes(nodes.iter(), Some(&pod)).expect("one GPU model");
    assert_eq!(gpu.memory_bytes, 81920 << 20);
    assert!(gpu.name.contains("A100"), "{}", gpu.name);
}

#[test]
fn required_node_affinity_narrows_the_nodes() {
    let nodes = [
        node(
            "a100",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
                ("nvidia.com/gpu.memory", "81920"),
            ],
        ),
        node(
            "t4",
            &[
                ("nvidia.com/gpu.product", "Tesla-T4"),
                ("nvidia.com/gpu.memory", "15360"),
            ],
        ),
    ];
    let pod = pod_spec(
        json!({"containers": [], "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["Tesla-T4"]}]}]}}}}),
    );
    let gpu = resolve_from_nodes(nodes.iter(), Some(&pod)).expect("one GPU model");
    assert_eq!(gpu.memory_bytes, 15360 << 20);
}

#[test]
fn nodes_with_different_gpus_are_an_error_that_names_them() {
    let nodes = [
        node("a", &[("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB")]),
        node("b", &[("nvidia.com/gpu.product", "Tesla-T4")]),
    ];
    match resolve_from_nodes(nodes.iter(), None) {
        Err(GpuError::Mixed(list)) => assert!(list.contains("Tesla-T4") && list.contains("A100")),
        other => panic!("expected Mixed, got {other:?}"),
    }
}

#[test]
fn an_unknown_gpu_product_uses_the_memory_label() {
    let nodes = [node(
        "x",
        &[
            ("nvidia.com/gpu.product", "Acme-Tensor-9000"),
            ("nvidia.com/gpu.memory", "49152"),
        ],
    )];
    let gpu = resolve_from_nodes(nodes.iter(), None).expect("memory label suffices");
    assert_eq!(gpu.memory_bytes, 49152 << 20);
    assert!(!gpu.bf16, "no capability is claimed for an unknown GPU");
}

#[test]
fn an_unknown_gpu_product_without_memory_is_an_error() {
    let nodes = [node("x", &[("nvidia.com/gpu.product", "Acme-Tensor-9000")])];
    assert!(matches!(
        resolve_from_nodes(nodes.iter(), None),
        Err(GpuError::Unknown { .. })
    ));
}

#[test]
fn no_labelled_nodes_is_an_error_that_says_to_set_spec_gpu() {
    let e = resolve_from_nodes([node("cpu", &[])].iter(), None).expect_err("no GPU");
    assert!(e.to_string().contains("spec.gpu"), "{e}");
}
