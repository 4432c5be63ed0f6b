//! The GPU a TrainingJob will run on, from the nodes' GPU Feature Discovery
//! labels, narrowed by the pod's node selector and affinity.

use std::collections::BTreeMap;

use gpufit::controller::gpu::{
    cpus_per_gpu_json, pod_gpus_json, resolve_from_nodes, resolve_from_nodes_with, sharing_of,
    GpuError, Sharing,
};
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

/// GFD's `single` MIG strategy names the slice in the product label: the
/// slice's memory, the card's bf16 — not the memory-label fallback.
#[test]
fn a_mig_product_label_resolves_to_the_slice() {
    let nodes = [node(
        "mig",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
            ("nvidia.com/gpu.memory", "4864"),
        ],
    )];
    let gpu = resolve_from_nodes(nodes.iter(), None).expect("a MIG slice");
    assert_eq!(gpu.name, "NVIDIA A100-SXM4-40GB MIG 1g.5gb");
    assert_eq!(gpu.memory_bytes, 4864 << 20);
    assert!(gpu.bf16);
}

/// The `mixed` strategy: the pod asks for `nvidia.com/mig-<profile>`, the
/// node keeps the card's product and labels the profiles it offers; only
/// nodes offering that profile count.
#[test]
fn a_mig_resource_resolves_to_that_slice_of_the_nodes_card() {
    let nodes = [
        node(
            "mixed",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
                ("nvidia.com/mig-3g.40gb.count", "2"),
                ("nvidia.com/mig-3g.40gb.memory", "40448"),
            ],
        ),
        node(
            "whole",
            &[("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB")],
        ),
    ];
    let pod = pod_spec(json!({"containers": [
        {"name": "t", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}}
    ]}));
    assert_eq!(
        pod_gpus_json(&json!({"containers": [
            {"name": "t", "resources": {"limits": {"nvidia.com/mig-3g.40gb": 2, "cpu": "4"}}},
            {"name": "u", "resources": {"requests": {"nvidia.com/gpu": "1"}}}
        ]}))
        .count,
        3
    );
    let gpu = resolve_from_nodes(nodes.iter(), Some(&pod)).expect("the H100's slice");
    assert_eq!(gpu.name, "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
    assert_eq!(gpu.memory_bytes, 40448 << 20);
    assert!(gpu.fp8);
    let other = pod_spec(json!({"containers": [
        {"name": "t", "resources": {"limits": {"nvidia.com/mig-1g.5gb": "1"}}}
    ]}));
    let e = resolve_from_nodes(nodes.iter(), Some(&other)).expect_err("nobody offers 1g.5gb");
    assert_eq!(e, GpuError::NoMigNodes("1g.5gb".into()));
    assert!(e.to_string().contains("nvidia.com/mig-1g.5gb"), "{e}");
}

/// Time-slicing: a `-SHARED` product or `gpu.replicas` > 1 is planned for
/// the card's memory ÷ replicas, and the name (which the reasoning quotes)
/// says so; `whole` plans for the card.
#[test]
fn a_time_shared_gpu_is_planned_for_its_share_unless_told_otherwise() {
    let renamed = [node(
        "ts",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB-SHARED"),
            ("nvidia.com/gpu.replicas", "4"),
        ],
    )];
    let g = resolve_from_nodes(renamed.iter(), None).expect("a share");
    assert_eq!(g.memory_bytes, (81920 << 20) / 4);
    assert!(
        g.name.contains("time-shared by 4") && g.name.contains("1/4"),
        "{}",
        g.name
    );
    assert!(g.bf16);
    let whole = resolve_from_nodes_with(renamed.iter(), None, Sharing::Whole).unwrap();
    assert_eq!(whole.name, "NVIDIA A100-SXM4-80GB");
    assert_eq!(whole.memory_bytes, 81920 << 20);

    let not_renamed = [node(
        "ts",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/gpu.replicas", "2"),
        ],
    )];
    let g = resolve_from_nodes(not_renamed.iter(), None).unwrap();
    assert_eq!(g.memory_bytes, (81559 / 2) << 20, "whole MiB, rounded down");
    let one = [node(
        "one",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/gpu.replicas", "1"),
        ],
    )];
    assert_eq!(
        resolve_from_nodes(one.iter(), None).unwrap().name,
        "NVIDIA H100 80GB HBM3"
    );
    let unknown = [node(
        "ts",
        &[("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB-SHARED")],
    )];
    assert!(matches!(
        resolve_from_nodes(unknown.iter(), None),
        Err(GpuError::SharedWithoutReplicas(_))
    ));
}

#[test]
fn the_workloads_annotation_beats_its_namespaces_label_and_bad_values_are_errors() {
    let map = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let ns = map(&[("gpufit.io/gpu-sharing", "whole")]);
    let ann = map(&[("gpufit.io/gpu-sharing", "share")]);
    assert_eq!(sharing_of(None, None), Ok(Sharing::Share));
    assert_eq!(sharing_of(None, Some(("team", &ns))), Ok(Sharing::Whole));
    assert_eq!(
        sharing_of(Some(&ann), Some(("team", &ns))),
        Ok(Sharing::Share)
    );
    let bad = map(&[("gpufit.io/gpu-sharing", "half")]);
    let e = sharing_of(None, Some(("team", &bad))).expect_err("bad label");
    assert!(e.contains("namespace team") && e.contains("half"), "{e}");
    assert!(sharing_of(Some(&bad), None)
        .unwrap_err()
        .contains("annotation"));
}

/// The CPUs a pod has per GPU: its containers' CPU limits, else requests,
/// over its GPUs (MIG slices count); nothing stated is unknown.
#[test]
fn cpus_per_gpu_come_from_the_pods_own_resources() {
    let pod = |resources: Value| json!({"containers": [{"name": "t", "resources": resources}]});
    let two = pod(json!({"limits": {"cpu": "4", "nvidia.com/gpu": "2"}}));
    assert_eq!(cpus_per_gpu_json(&two), Some(2));
    let milli = pod(json!({"requests": {"cpu": "3500m"}, "limits": {"nvidia.com/gpu": 1}}));
    assert_eq!(
        cpus_per_gpu_json(&milli),
        Some(3),
        "requests without a limit, rounded down"
    );
    let both = pod(
        json!({"requests": {"cpu": "2"}, "limits": {"cpu": "16", "nvidia.com/mig-1g.10gb": "2"}}),
    );
    assert_eq!(
        cpus_per_gpu_json(&both),
        Some(8),
        "the limit is what it can use"
    );
    assert_eq!(
        cpus_per_gpu_json(&pod(json!({"limits": {"nvidia.com/gpu": "1"}}))),
        None
    );
    assert_eq!(
        cpus_per_gpu_json(&pod(json!({"limits": {"cpu": "8"}}))),
        None,
        "no GPU"
    );
    assert_eq!(
        cpus_per_gpu_json(&pod(
            json!({"limits": {"cpu": "lots", "nvidia.com/gpu": "1"}})
        )),
        None
    );
}
