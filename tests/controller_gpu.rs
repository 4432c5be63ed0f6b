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

/// Labels exactly as GPU Feature Discovery writes them on an A100-40GB node
/// with two cards in MIG mode. Key names, values and which labels appear per
/// strategy follow NVIDIA/k8s-device-plugin `internal/lm/mig-strategy.go`
/// (`newGPULabelers`: MIG-mode cards keep a card label set with replicas 0;
/// `newMigStrategySingleLabeler` / `newMigStrategyMixedLabeler`),
/// `internal/lm/resource.go` (`productLabel`: `<card>-MIG-<profile>`, spaces
/// as dashes; `replicasLabel`; `newMigAttributeLabels`) and
/// `internal/resource/nvml-mig-device.go` (`GetAttributes`: memory in MiB,
/// multiprocessors, slices.gi/ci, engines.*; `GetName`: the profile with
/// `+` as `.`); the expected sets of `internal/lm/mig-strategy_test.go`.
fn gfd_card_labels(strategy: &str) -> Vec<(&'static str, String)> {
    vec![
        ("nvidia.com/gpu.compute.major", "8".into()),
        ("nvidia.com/gpu.compute.minor", "0".into()),
        ("nvidia.com/gpu.family", "ampere".into()),
        ("nvidia.com/mig.capable", "true".into()),
        ("nvidia.com/mig.strategy", strategy.into()),
    ]
}

fn gfd_mig_attributes(prefix: &str, memory: &str, sm: &str, gi: &str) -> Vec<(String, String)> {
    [
        ("memory", memory),
        ("multiprocessors", sm),
        ("slices.gi", gi),
        ("slices.ci", gi),
        ("engines.copy", gi),
        ("engines.decoder", "0"),
        ("engines.encoder", "0"),
        ("engines.jpeg", "0"),
        ("engines.ofa", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (format!("{prefix}.{k}"), v.to_string()))
    .collect()
}

fn gfd_node(name: &str, labels: Vec<(String, String)>) -> k8s_openapi::api::core::v1::Node {
    let refs: Vec<(&str, &str)> = labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    node(name, &refs)
}

#[test]
fn gfd_single_strategy_labels_resolve_to_the_slice_the_node_is_cut_into() {
    let mut labels: Vec<(String, String)> = gfd_card_labels("single")
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    labels.extend([
        (
            "nvidia.com/gpu.product".into(),
            "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb".into(),
        ),
        ("nvidia.com/gpu.count".into(), "14".into()),
        ("nvidia.com/gpu.replicas".into(), "1".into()),
    ]);
    labels.extend(gfd_mig_attributes("nvidia.com/gpu", "4864", "14", "1"));
    let nodes = [gfd_node("single", labels)];
    let pod = pod_spec(json!({"containers": [
        {"name": "t", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    ]}));
    let gpu = resolve_from_nodes(nodes.iter(), Some(&pod)).expect("the 1g.5gb slice");
    assert_eq!(gpu.name, "NVIDIA A100-SXM4-40GB MIG 1g.5gb");
    assert_eq!(gpu.memory_bytes, 4864 << 20);
    assert!(gpu.bf16, "the A100's bf16");
}

#[test]
fn gfd_mixed_strategy_labels_resolve_each_profile_a_pod_asks_for() {
    let mut labels: Vec<(String, String)> = gfd_card_labels("mixed")
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    // The MIG-mode cards' own set: the card's product, replicas 0.
    labels.extend([
        (
            "nvidia.com/gpu.product".into(),
            "NVIDIA-A100-SXM4-40GB".into(),
        ),
        ("nvidia.com/gpu.count".into(), "2".into()),
        ("nvidia.com/gpu.replicas".into(), "0".into()),
        ("nvidia.com/gpu.memory".into(), "40960".into()),
    ]);
    for (profile, count, memory, sm, gi) in [
        ("1g.5gb", "7", "4864", "14", "1"),
        ("3g.20gb", "2", "20096", "42", "3"),
    ] {
        let prefix = format!("nvidia.com/mig-{profile}");
        labels.extend([
            (
                format!("{prefix}.product"),
                format!("NVIDIA-A100-SXM4-40GB-MIG-{profile}"),
            ),
            (format!("{prefix}.count"), count.into()),
            (format!("{prefix}.replicas"), "1".into()),
        ]);
        labels.extend(gfd_mig_attributes(&prefix, memory, sm, gi));
    }
    let nodes = [gfd_node("mixed", labels.clone())];
    let asks = |resource: &str| {
        pod_spec(json!({"containers": [
            {"name": "t", "resources": {"limits": {resource: "1"}}}
        ]}))
    };
    let small = resolve_from_nodes(nodes.iter(), Some(&asks("nvidia.com/mig-1g.5gb")))
        .expect("the 1g.5gb slice");
    assert_eq!(small.name, "NVIDIA A100-SXM4-40GB MIG 1g.5gb");
    assert_eq!(small.memory_bytes, 4864 << 20);
    assert!(small.bf16);
    let large = resolve_from_nodes(nodes.iter(), Some(&asks("nvidia.com/mig-3g.20gb")))
        .expect("the 3g.20gb slice");
    assert_eq!(large.name, "NVIDIA A100-SXM4-40GB MIG 3g.20gb");
    // min(catalog 19968, GFD .memory 20096): the smaller.
    assert_eq!(large.memory_bytes, 19968 << 20);
    // A pod asking for a whole GPU on this node sees the card (replicas 0: not shared).
    let card = resolve_from_nodes(nodes.iter(), Some(&asks("nvidia.com/gpu"))).expect("the card");
    assert_eq!(card.name, "NVIDIA A100-SXM4-40GB");

    // Time-sliced MIG (sharing.timeSlicing on nvidia.com/mig-1g.5gb,
    // replicas 2): GFD appends -SHARED to that profile's product and sets
    // its replicas; the slice is planned for half its memory.
    let shared: Vec<(String, String)> = labels
        .into_iter()
        .map(|(k, v)| match k.as_str() {
            "nvidia.com/mig-1g.5gb.product" => (k, format!("{v}-SHARED")),
            "nvidia.com/mig-1g.5gb.replicas" => (k, "2".into()),
            _ => (k, v),
        })
        .collect();
    let nodes = [gfd_node("mixed-shared", shared)];
    let half = resolve_from_nodes(nodes.iter(), Some(&asks("nvidia.com/mig-1g.5gb")))
        .expect("half the slice");
    assert_eq!(half.memory_bytes, (4864 << 20) / 2);
    assert!(half.name.contains("time-shared by 2"), "{}", half.name);
    let whole = resolve_from_nodes_with(
        nodes.iter(),
        Some(&asks("nvidia.com/mig-1g.5gb")),
        Sharing::Whole,
    )
    .expect("the slice");
    assert_eq!(whole.memory_bytes, 4864 << 20);
}

/// A `+me` profile as GFD writes it: resource and labels with `.me`.
#[test]
fn gfd_media_extension_profiles_resolve_to_their_slice() {
    let nodes = [node(
        "me",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/mig.strategy", "mixed"),
            (
                "nvidia.com/mig-1g.10gb.me.product",
                "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb.me",
            ),
            ("nvidia.com/mig-1g.10gb.me.count", "1"),
            ("nvidia.com/mig-1g.10gb.me.memory", "9984"),
        ],
    )];
    let pod = pod_spec(json!({"containers": [
        {"name": "t", "resources": {"limits": {"nvidia.com/mig-1g.10gb.me": "1"}}}
    ]}));
    let gpu = resolve_from_nodes(nodes.iter(), Some(&pod)).expect("the 1g.10gb slice");
    assert_eq!(gpu.name, "NVIDIA H100 80GB HBM3 MIG 1g.10gb");
    assert_eq!(gpu.memory_bytes, 9984 << 20);
}
