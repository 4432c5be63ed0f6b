//! GPU sharing as the NVIDIA device plugin, GFD and mig-parted really do it:
//! the label sets of k8s-device-plugin v0.20.0's own tests (MPS,
//! time-slicing, renamed resources, MIG strategies, `-MIG-INVALID`), the
//! MIG profile list of mig-parted v0.15.0 and the MIG guide's card list,
//! all copied under tests/fixtures/gpu_sharing (README: repository, path,
//! commit).

use std::collections::BTreeMap;

use gpufit::controller::gpu::{
    plan_from_nodes, pod_gpus_json, resolve_from_nodes_with, GpuError, Sharing,
};
use gpufit::core::catalog::{lookup_gpu, lookup_mig, mig_base_profile, mig_cards, mig_catalog};
use k8s_openapi::api::core::v1::{Node, PodSpec};
use serde_json::{json, Value};

#[path = "common/cli.rs"]
mod cli;

const MIB: u64 = 1 << 20;
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpu_sharing");

fn fixture(path: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{path}"))
        .unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}

fn node(labels: &BTreeMap<String, String>) -> Node {
    serde_json::from_value(json!({"metadata": {"name": "n", "labels": labels}})).expect("node")
}

fn asking(resource: &str) -> PodSpec {
    serde_json::from_value(json!({"containers": [
        {"name": "t", "resources": {"limits": {resource: "1"}}}
    ]}))
    .expect("pod spec")
}

/// One `expectedLabels: Labels{…}` case of a Go test file of the device
/// plugin, with its description.
#[derive(Debug)]
struct Case {
    description: String,
    labels: BTreeMap<String, String>,
}

/// Reads the table-driven cases of a Go test file: each `description:`
/// and the `"key": "value",` lines of its `expectedLabels: Labels{…}`.
fn go_cases(text: &str) -> Vec<Case> {
    let quoted = |s: &str| -> Vec<String> {
        s.split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    let mut out = Vec::new();
    let mut description = String::new();
    let mut labels: Option<BTreeMap<String, String>> = None;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("description:") {
            description = quoted(rest).into_iter().next().unwrap_or_default();
        } else if line.starts_with("expectedLabels: Labels{") {
            labels = Some(BTreeMap::new());
        } else if let Some(l) = labels.as_mut() {
            if line.starts_with('}') {
                out.push(Case {
                    description: description.clone(),
                    labels: labels.take().unwrap_or_default(),
                });
            } else if let [k, v] = quoted(line).as_slice() {
                l.insert(k.clone(), v.clone());
            }
        }
    }
    out
}

/// Every label set the device plugin's own tests expect GFD to write is
/// planned for as that sharing mode means: MPS and time-slicing at the
/// card's memory ÷ replicas (`whole` refused under MPS, with a warning),
/// renamed resources (`….shared`, product without `-SHARED`) as shared, a
/// replica count of 0 or 1 as the whole GPU, `-MIG-INVALID` as a MIG
/// misconfiguration. MOCKMODEL is in no catalog: its memory label and
/// compute-capability labels make the GPU.
#[test]
fn every_label_set_of_the_device_plugins_tests_is_planned_as_its_sharing_mode() {
    let mut cases = go_cases(&fixture("k8s-device-plugin/resource_test.go"));
    cases.extend(go_cases(&fixture("k8s-device-plugin/mig-strategy_test.go")));
    assert!(cases.len() >= 20, "{} cases", cases.len());
    let mut seen = BTreeMap::<&str, usize>::new();
    for case in &cases {
        let what = &case.description;
        // The labels are under the resource's own name.
        let (prefix, product) = case
            .labels
            .iter()
            .find_map(|(k, v)| {
                k.strip_suffix(".product")
                    .map(|p| (p.to_string(), v.clone()))
            })
            .unwrap_or_else(|| panic!("{what}: no product label"));
        let get = |suffix: &str| case.labels.get(&format!("{prefix}.{suffix}")).cloned();
        let memory: u64 = get("memory").and_then(|m| m.parse().ok()).unwrap_or(0);
        let replicas: u64 = get("replicas").and_then(|m| m.parse().ok()).unwrap_or(0);
        let strategy = get("sharing-strategy").unwrap_or_default();
        let renamed = what.contains("rename");
        let mut labels = case.labels.clone();
        labels.insert(
            "nvidia.com/gpu.product".into(),
            labels
                .get("nvidia.com/gpu.product")
                .cloned()
                .unwrap_or_else(|| "MOCKMODEL".into()),
        );
        let resource = format!("{prefix}{}", if renamed { ".shared" } else { "" });
        let nodes = [node(&labels)];
        let plan = |sharing| plan_from_nodes(nodes.iter(), Some(&asking(&resource)), sharing);
        if product.ends_with("-MIG-INVALID") {
            let err = plan(Sharing::Share).expect_err("invalid MIG");
            assert!(matches!(err, GpuError::MigInvalid(_)), "{what}: {err}");
            assert!(err.to_string().contains("MIG misconfiguration"), "{err}");
            *seen.entry("mig-invalid").or_default() += 1;
            continue;
        }
        let share = plan(Sharing::Share).unwrap_or_else(|e| panic!("{what}: {e}"));
        let whole = plan(Sharing::Whole).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(share.warnings.is_empty(), "{what}: {:?}", share.warnings);
        // bf16 only where GFD labels a compute capability of 8.0 or more.
        let cc = case.labels.contains_key("nvidia.com/gpu.compute.major");
        assert_eq!(share.gpu.bf16, cc, "{what}");
        if replicas > 1 {
            let kind = if strategy == "mps" {
                "MPS-shared"
            } else {
                "time-shared"
            };
            assert_eq!(share.gpu.memory_bytes, memory / replicas * MIB, "{what}");
            assert!(share.gpu.name.contains(kind), "{what}: {}", share.gpu.name);
            assert_eq!(
                product.ends_with("-SHARED"),
                !renamed,
                "{what}: the suffix only when not renamed"
            );
            if strategy == "mps" {
                assert_eq!(whole.gpu, share.gpu, "{what}: MPS caps every client");
                assert!(whole.warnings.iter().any(|w| w.contains("MPS")), "{what}");
                *seen.entry("mps").or_default() += 1;
            } else {
                assert_eq!(whole.gpu.memory_bytes, memory * MIB, "{what}");
                assert!(whole.warnings.is_empty(), "{what}");
                *seen.entry("time-slicing").or_default() += 1;
            }
            if renamed {
                *seen.entry("renamed").or_default() += 1;
            }
        } else {
            assert_eq!(share.gpu.memory_bytes, memory * MIB, "{what}");
            assert_eq!(whole.gpu, share.gpu, "{what}");
            *seen.entry("whole").or_default() += 1;
        }
    }
    // Every mode the upstream tests cover was met.
    for mode in ["mps", "time-slicing", "renamed", "whole", "mig-invalid"] {
        assert!(seen.get(mode).is_some_and(|n| *n > 0), "{mode}: {seen:?}");
    }
}

fn a100_80gb(extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut labels: BTreeMap<String, String> = [
        ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
        ("nvidia.com/gpu.memory", "81920"),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.compute.major", "8"),
        ("nvidia.com/gpu.compute.minor", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    labels.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    labels
}

/// Acceptance: an MPS node sharing each 80 GB card 10 ways, `whole`
/// asked for: planned for 8 GiB, with a warning that says why.
#[test]
fn mps_caps_the_job_at_its_share_even_when_whole_is_asked() {
    for (product, resource) in [
        ("NVIDIA-A100-SXM4-80GB-SHARED", "nvidia.com/gpu"),
        ("NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.shared"),
    ] {
        let nodes = [node(&a100_80gb(&[
            ("nvidia.com/gpu.product", product),
            ("nvidia.com/gpu.replicas", "10"),
            ("nvidia.com/gpu.sharing-strategy", "mps"),
        ]))];
        let p = plan_from_nodes(nodes.iter(), Some(&asking(resource)), Sharing::Whole)
            .expect("planned");
        assert_eq!(p.gpu.memory_bytes, 8 << 30, "{product}");
        assert!(p.gpu.name.contains("MPS-shared by 10"), "{}", p.gpu.name);
        let [w] = p.warnings.as_slice() else {
            panic!("one warning: {:?}", p.warnings)
        };
        assert!(
            w.contains("gpufit.io/gpu-sharing=whole ignored")
                && w.contains("MPS")
                && w.contains("÷ 10"),
            "{w}"
        );
        // The compatibility entry point gives the same GPU (and logs the warning).
        let g = resolve_from_nodes_with(nodes.iter(), Some(&asking(resource)), Sharing::Whole)
            .expect("planned");
        assert_eq!(g, p.gpu);
    }
    // Time-slicing keeps `whole` available.
    let nodes = [node(&a100_80gb(&[
        ("nvidia.com/gpu.replicas", "10"),
        ("nvidia.com/gpu.sharing-strategy", "time-slicing"),
    ]))];
    let ts = |s| {
        plan_from_nodes(nodes.iter(), Some(&asking("nvidia.com/gpu.shared")), s).expect("planned")
    };
    assert_eq!(ts(Sharing::Share).gpu.memory_bytes, 8 << 30);
    assert_eq!(ts(Sharing::Whole).gpu.memory_bytes, 81920 * MIB);
    assert!(ts(Sharing::Whole).warnings.is_empty());
}

/// Acceptance: `renameByDefault: true` — `nvidia.com/gpu.shared: 1` on a
/// 10-replica A100-80GB and `nvidia.com/mig-1g.10gb.shared` with 2 replicas
/// (labels under the profile's own name, product without `-SHARED`) are
/// both planned for their share.
#[test]
fn renamed_shared_resources_are_planned_for_their_share() {
    let whole_gpus = [node(&a100_80gb(&[
        ("nvidia.com/gpu.replicas", "10"),
        ("nvidia.com/gpu.sharing-strategy", "time-slicing"),
    ]))];
    let g = plan_from_nodes(
        whole_gpus.iter(),
        Some(&asking("nvidia.com/gpu.shared")),
        Sharing::Share,
    )
    .expect("planned");
    assert_eq!(g.gpu.memory_bytes, 8192 * MIB);
    assert!(
        g.gpu
            .name
            .starts_with("NVIDIA A100-SXM4-80GB (time-shared by 10"),
        "{}",
        g.gpu.name
    );

    let mig = [node(&a100_80gb(&[
        ("nvidia.com/mig.strategy", "mixed"),
        ("nvidia.com/gpu.replicas", "0"),
        (
            "nvidia.com/mig-1g.10gb.product",
            "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
        ),
        ("nvidia.com/mig-1g.10gb.count", "7"),
        ("nvidia.com/mig-1g.10gb.replicas", "2"),
        ("nvidia.com/mig-1g.10gb.sharing-strategy", "time-slicing"),
        ("nvidia.com/mig-1g.10gb.memory", "9728"),
    ]))];
    let pod = asking("nvidia.com/mig-1g.10gb.shared");
    let asks = pod_gpus_json(&serde_json::to_value(&pod).expect("json"));
    assert_eq!(
        (asks.count, asks.mig_profile.as_deref(), asks.shared),
        (1, Some("1g.10gb"), true)
    );
    assert_eq!(
        asks.resource.as_deref(),
        Some("nvidia.com/mig-1g.10gb.shared")
    );
    let s = plan_from_nodes(mig.iter(), Some(&pod), Sharing::Share).expect("planned");
    assert_eq!(s.gpu.memory_bytes, 9728 / 2 * MIB);
    assert!(
        s.gpu
            .name
            .starts_with("NVIDIA A100-SXM4-80GB MIG 1g.10gb (time-shared by 2"),
        "{}",
        s.gpu.name
    );
    // A renamed resource with no replicas label: its share is unknown.
    let bare = [node(&a100_80gb(&[]))];
    assert!(matches!(
        plan_from_nodes(
            bare.iter(),
            Some(&asking("nvidia.com/gpu.shared")),
            Sharing::Share
        ),
        Err(GpuError::SharedWithoutReplicas(_))
    ));
    // `.shared` is no MIG profile of its own, and not a GPU resource of any other name.
    let odd = pod_gpus_json(
        &json!({"containers": [{"name": "t", "resources": {"limits": {
        "nvidia.com/mig-.shared": "1", "nvidia.com/gpushared": "1"}}}]}),
    );
    assert_eq!(odd.count, 0, "{odd:?}");
}

/// The catalog's figure and GFD's `.memory`: the smaller is planned for;
/// a card the catalog lacks takes bf16/fp8 from GFD's compute-capability
/// labels.
#[test]
fn label_memory_lowers_the_catalog_and_compute_labels_set_precision() {
    let lower = [node(&a100_80gb(&[("nvidia.com/gpu.memory", "80000")]))];
    let g = plan_from_nodes(lower.iter(), None, Sharing::Share).expect("planned");
    assert_eq!(g.gpu.memory_bytes, 80000 * MIB);
    let higher = [node(&a100_80gb(&[("nvidia.com/gpu.memory", "99999")]))];
    let g = plan_from_nodes(higher.iter(), None, Sharing::Share).expect("planned");
    assert_eq!(g.gpu.memory_bytes, 81920 * MIB, "the catalog's, lower");
    let labels = |major: &str| -> BTreeMap<String, String> {
        [
            ("nvidia.com/gpu.product", "NVIDIA-Future-GPU-X"),
            ("nvidia.com/gpu.memory", "100000"),
            ("nvidia.com/gpu.compute.major", major),
            ("nvidia.com/gpu.compute.minor", "0"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    };
    let blackwell = [node(&labels("10"))];
    let g = plan_from_nodes(blackwell.iter(), None, Sharing::Share)
        .expect("planned")
        .gpu;
    assert!(g.bf16 && g.fp8 && g.compute_capability == "10.0", "{g:?}");
    let volta = [node(&labels("7"))];
    let g = plan_from_nodes(volta.iter(), None, Sharing::Share)
        .expect("planned")
        .gpu;
    assert!(!g.bf16 && !g.fp8, "{g:?}");
    // A MIG-only card's slice through GFD's single strategy.
    let b200 = [node(
        &[
            ("nvidia.com/gpu.product", "NVIDIA-B200-MIG-1g.23gb"),
            ("nvidia.com/gpu.memory", "22000"),
            ("nvidia.com/mig.strategy", "single"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
    )];
    let g = plan_from_nodes(b200.iter(), None, Sharing::Share)
        .expect("planned")
        .gpu;
    assert_eq!(g.name, "NVIDIA B200 MIG 1g.23gb");
    assert!(g.fp8);
    assert_eq!(
        g.memory_bytes,
        lookup_gpu("NVIDIA B200 MIG 1g.23gb")
            .expect("slice")
            .memory_bytes
            .min(22000 * MIB)
    );
}

/// The cards of the MIG guide's "Supported GPU Products" (r580) as the
/// catalog names them.
const GUIDE_CARDS: &[(&str, &str, &str)] = &[
    (
        "RTX PRO 6000 Blackwell Server Edition",
        "96GB",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    ),
    (
        "RTX PRO 6000 Blackwell Workstation Edition",
        "96GB",
        "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    ),
    (
        "RTX PRO 6000 Blackwell Max-Q Workstation Edition",
        "96GB",
        "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
    ),
    (
        "RTX PRO 5000 Blackwell",
        "48GB",
        "NVIDIA RTX PRO 5000 Blackwell",
    ),
    ("GB200", "186GB", "NVIDIA GB200"),
    ("B200", "180GB", "NVIDIA B200"),
    ("H100-SXM5", "80GB", "NVIDIA H100 80GB HBM3"),
    ("H100-PCIE", "80GB", "NVIDIA H100 PCIe"),
    ("H100-SXM5", "94GB", "NVIDIA H100 SXM5 94GB"),
    ("H100-PCIE", "94GB", "NVIDIA H100 NVL"),
    ("H100 on GH200", "96GB", "NVIDIA GH200 480GB"),
    ("H20", "96GB", "NVIDIA H20"),
    ("H200-SXM5", "141GB", "NVIDIA H200"),
    ("H200 NVL", "141GB", "NVIDIA H200 NVL"),
    ("A100-SXM4", "40GB", "NVIDIA A100-SXM4-40GB"),
    ("A100-SXM4", "80GB", "NVIDIA A100-SXM4-80GB"),
    ("A100-PCIE", "40GB", "NVIDIA A100-PCIE-40GB"),
    ("A100-PCIE", "80GB", "NVIDIA A100 80GB PCIe"),
    ("A30", "24GB", "NVIDIA A30"),
];

/// Acceptance: every card in NVIDIA's MIG list has its slices in the
/// catalog, with the card's compute capability; the largest slice's
/// memory is below the card's size.
#[test]
fn every_card_in_the_mig_guides_list_is_in_the_catalog() {
    let table = fixture("mig-user-guide/supported-gpus.txt");
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.trim_end().ends_with(|c: char| c.is_ascii_digit()) && !l.contains("---"))
        .collect();
    assert_eq!(rows.len(), GUIDE_CARDS.len(), "{rows:?}");
    let cards = mig_cards();
    for (row, (product, memory, card)) in rows.iter().zip(GUIDE_CARDS) {
        assert!(
            row.trim_start().starts_with(product) && row.contains(memory),
            "{row} / {product}"
        );
        assert!(
            cards.iter().any(|c| c == card),
            "{card} in the catalog's MIG cards"
        );
        let cc = row.split_whitespace().rev().nth(2).expect("a cc column");
        let slices: Vec<_> = mig_catalog()
            .into_iter()
            .filter(|e| e.card == *card)
            .collect();
        assert!(!slices.is_empty(), "{card}");
        let gb: u64 = memory.trim_end_matches("GB").parse().expect("GB");
        for e in &slices {
            let s = lookup_gpu(&format!("{card} MIG {}", e.profile)).expect("resolves");
            assert_eq!(s.compute_capability, cc, "{card}");
            assert!(s.memory_bytes < gb << 30, "{card} {}", e.profile);
        }
    }
}

/// Every profile name in mig-parted's default config resolves on some
/// catalog card, except GB300 / B300 ones (not in the MIG guide's list).
#[test]
fn every_profile_of_mig_parteds_default_config_is_known() {
    let config: serde_yaml::Value =
        serde_yaml::from_str(&fixture("mig-parted/config-default.yaml")).expect("yaml");
    let mut profiles = std::collections::BTreeSet::new();
    for (_, entries) in config["mig-configs"].as_mapping().expect("mig-configs") {
        for e in entries.as_sequence().into_iter().flatten() {
            for (p, _) in e["mig-devices"].as_mapping().into_iter().flatten() {
                profiles.insert(p.as_str().expect("a profile").to_string());
            }
        }
    }
    assert!(profiles.len() > 60, "{profiles:?}");
    // GB300 / B300 (device ids 0x31C2, 0x3182) and sizes no card of the guide has.
    let not_in_guide = [
        "1g.34gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb", "1g.67gb", "2g.70gb", "3g.139gb",
        "4g.139gb", "7g.278gb", "1g.70gb", "3g.95gb", "4g.95gb", "7g.189gb",
    ];
    let catalog = mig_catalog();
    for p in &profiles {
        let base = mig_base_profile(p).unwrap_or_else(|| panic!("{p}: a profile"));
        if not_in_guide.contains(&base.as_str()) || (base == "1g.35gb" && p.contains("+me")) {
            continue;
        }
        let e = catalog
            .iter()
            .find(|e| e.profile == base)
            .unwrap_or_else(|| panic!("{p}: no catalog card offers {base}"));
        lookup_mig(&e.card, p).unwrap_or_else(|err| panic!("{p} on {}: {err}", e.card));
    }
}

/// Acceptance: `gpufit suggest --gpu "<card> MIG <profile>"` plans for a
/// slice of every card in NVIDIA's MIG list (the smallest, where a small
/// LoRA job fits), for the slice's memory and with the card's precision.
#[test]
fn suggest_resolves_a_slice_of_every_mig_card() {
    let env = cli::Env::new();
    let small = [
        "--model",
        "Qwen/Qwen2.5-0.5B",
        "--method",
        "lora",
        "--seq-len",
        "512",
        "--no-history",
    ];
    for card in mig_cards() {
        let smallest = mig_catalog()
            .into_iter()
            .filter(|e| e.card == card)
            .min_by_key(|e| e.memory_mib)
            .expect("a slice");
        let gpu = format!("{card} MIG {}", smallest.profile);
        let v: Value = env.json(
            &cli::args(
                &["suggest"],
                &cli::args(&small, &["--gpu", &gpu, "-o", "json"]),
            ),
            &[],
        );
        let peak = v["predicted_peak_bytes"].as_u64().unwrap_or(0);
        assert!(
            peak > 0 && peak <= smallest.memory_mib * MIB,
            "{gpu}: {peak}"
        );
        assert!(
            v["dtype"].as_str().unwrap_or("").contains("bf16"),
            "{gpu}: {v}"
        );
    }
}

/// Acceptance: a Slurm MIG job's Prolog writes its mapping file under its
/// slice's id — for both of Slurm's forms (gpu_nvml.c: the MIG UUID, or
/// `MIG-<card uuid>/<gi>/<ci>`) in `CUDA_VISIBLE_DEVICES` — not under
/// `SLURM_JOB_GPUS` (a gres index on a MIG node), and its Epilog removes it
/// (only its own).
#[test]
fn a_slurm_mig_jobs_prolog_and_epilog_map_its_slice_in_both_id_forms() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("gpu-jobs");
    let hook = |which: &str, job: &str, cvd: &str| {
        let out = std::process::Command::new(cli::BIN)
            .args(["slurm", which])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("GPUFIT_SLURM_CONFIG", "")
            .env("GPUFIT_STATE_DIR", tmp.path().join("state"))
            .env("GPUFIT_MAPPING_DIR", &dir)
            .env(
                "GPUFIT_HISTORY",
                format!("sqlite:{}/h.db", tmp.path().display()),
            )
            .env("SLURM_JOB_ID", job)
            .env("SLURM_JOB_GPUS", "3")
            .env("CUDA_VISIBLE_DEVICES", cvd)
            .output()
            .expect("run the hook");
        assert!(
            out.status.success(),
            "{which}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let files = || -> Vec<(String, String)> {
        let mut v: Vec<_> = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .map(|e| {
                        (
                            e.file_name().to_string_lossy().to_string(),
                            std::fs::read_to_string(e.path()).unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let uuid = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f";
    let legacy = "MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/7/0";
    for (job, cvd, file) in [
        ("5001", uuid, uuid.to_string()),
        (
            "5002",
            legacy,
            "MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f_7_0".to_string(),
        ),
    ] {
        hook("prolog", job, cvd);
        assert_eq!(files(), [(file.clone(), format!("{job}\n"))], "{cvd}");
        // Another job's Epilog on the same slice id leaves it.
        hook("epilog", "6000", cvd);
        assert_eq!(files().len(), 1, "{cvd}");
        hook("epilog", job, cvd);
        assert!(files().is_empty(), "{cvd}: {:?}", files());
    }
}

/// The table of cards × profiles × memory in docs/gpus.md is the catalog's,
/// row for row (a changed figure must change the docs too).
#[test]
fn the_docs_mig_table_is_the_catalogs() {
    let mut want = String::from(
        "| Card (NVML name) | Profile | Memory share | Planned MiB | GiB | Source |\n|---|---|---|---|---|---|\n",
    );
    for e in mig_catalog() {
        want += &format!(
            "| {} | `{}` | {}/8 | {} | {:.2} | {} |\n",
            e.card,
            e.profile,
            e.memory_eighths,
            e.memory_mib,
            e.memory_mib as f64 / 1024.0,
            e.source.as_str()
        );
    }
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/gpus.md"))
        .expect("docs/gpus.md");
    let table = docs
        .split_once("<!-- mig-table -->\n")
        .and_then(|(_, rest)| rest.split_once("<!-- /mig-table -->"))
        .map(|(t, _)| t)
        .unwrap_or("");
    assert!(
        table == want,
        "docs/gpus.md's MIG table should read:\n{want}"
    );
}

/// `gpufit gpus --live` on a MIG node read without privileges: the card is
/// `ok`, with why its own memory is missing; its slices are listed.
#[test]
fn gpus_live_says_why_a_mig_cards_own_memory_is_missing() {
    let out = std::process::Command::new(cli::BIN)
        .args([
            "gpus",
            "--live",
            "--backend",
            "simulate",
            "--simulate-model",
            "NVIDIA H100 80GB HBM3",
            "--simulate-gpus",
            "1",
            "--simulate-mig",
            "0:1g.10gb,3g.40gb",
            "--simulate-mig-parent-refused",
        ])
        .output()
        .expect("gpufit runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("unhealthy"), "{text}");
    assert!(
        text.contains("ok (memory:") && text.contains("CAP_SYS_ADMIN"),
        "{text}"
    );
    assert!(
        text.contains("MIG 1g.10gb") && text.contains("MIG 3g.40gb"),
        "{text}"
    );
}

/// go-nvml's mock GPU instance profiles (`MemorySizeMB`): the catalog never
/// plans a slice for more than they give, and a figure credited to them is
/// theirs.
#[test]
fn catalog_slices_are_at_or_below_go_nvmls_mock_profiles() {
    let cards = [
        ("a100_40gb", "a100.go", "NVIDIA A100-SXM4-40GB"),
        ("a100_80gb", "a100.go", "NVIDIA A100-SXM4-80GB"),
        ("a30_24gb", "a30.go", "NVIDIA A30"),
        ("h100_80gb", "h100.go", "NVIDIA H100 80GB HBM3"),
        ("h200_141gb", "h200.go", "NVIDIA H200"),
        ("b200_180gb", "b200.go", "NVIDIA B200"),
    ];
    let catalog = mig_catalog();
    let mut checked = 0;
    for (map, file, card) in cards {
        let text = fixture(&format!("go-nvml/{file}"));
        let mut in_map = false;
        let mut constant = String::new();
        let slices: Vec<_> = catalog.iter().filter(|e| e.card == card).collect();
        for line in text.lines().map(str::trim) {
            if line.contains("GpuInstanceProfiles = map") {
                in_map = line.starts_with(&format!("{map}_GpuInstanceProfiles"));
            } else if let Some(c) = line.strip_prefix("nvml.GPU_INSTANCE_PROFILE_") {
                constant = c.trim_end_matches(": {").to_string();
            } else if let Some(rest) = line.strip_prefix("MemorySizeMB:").filter(|_| in_map) {
                let mib: u64 = rest
                    .split(',')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .parse()
                    .expect("MiB");
                // 1_SLICE / _REV1 (+me): the smaller 1g profile; _REV2: the larger.
                let (g, larger) = match constant.as_str() {
                    "1_SLICE" | "1_SLICE_REV1" => (1, false),
                    "1_SLICE_REV2" => (1, true),
                    "2_SLICE" | "2_SLICE_REV1" => (2, false),
                    "3_SLICE" => (3, false),
                    "4_SLICE" => (4, false),
                    "7_SLICE" => (7, false),
                    other => panic!("{file}: {other}"),
                };
                let mut of_g: Vec<_> = slices
                    .iter()
                    .filter(|e| e.profile.starts_with(&format!("{g}g.")))
                    .collect();
                of_g.sort_by_key(|e| e.memory_eighths);
                let e = if larger { of_g.last() } else { of_g.first() };
                let e = e.unwrap_or_else(|| panic!("{card}: no {g}g profile"));
                assert!(
                    e.memory_mib <= mib,
                    "{card} {}: {} MiB above go-nvml's {mib}",
                    e.profile,
                    e.memory_mib
                );
                if e.source == gpufit::core::catalog::MigMemorySource::GoNvml {
                    assert_eq!(e.memory_mib, mib, "{card} {}", e.profile);
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 35, "{checked} profiles checked");
}

/// `nvidia-smi mig -lgip` as printed on real cards: the catalog never plans
/// a slice for more than its "Memory GiB", and a figure credited to lgip is
/// that column.
#[test]
fn catalog_slices_are_at_or_below_what_nvidia_smi_lists() {
    let catalog = mig_catalog();
    let mut checked = 0;
    for (file, first_card) in [
        ("mig-user-guide/h200-lgip.txt", "NVIDIA H200"),
        ("mig-user-guide/h100-80gb-lgip.txt", "NVIDIA H100 80GB HBM3"),
        ("mig-user-guide/a100-lgip.txt", "NVIDIA A100-SXM4-40GB"),
    ] {
        let mut card = first_card;
        for line in fixture(file).lines() {
            if line.starts_with("A100 80GB") {
                card = "NVIDIA A100-SXM4-80GB";
            }
            let t: Vec<&str> = line.split_whitespace().collect();
            let Some(at) = t.iter().position(|w| *w == "MIG") else {
                continue;
            };
            let (Some(profile), Some(gib)) = (t.get(at + 1), t.get(at + 4)) else {
                continue;
            };
            let gib: f64 = gib.parse().unwrap_or_else(|_| panic!("{file}: {line}"));
            // nvidia-smi prints GiB to two decimals (19.625 as 19.62): a
            // figure within half a hundredth of a GiB is the same.
            let mib = ((gib + 0.005) * 1024.0).floor() as u64;
            let base = mig_base_profile(profile).expect("a profile");
            let e = catalog
                .iter()
                .find(|e| e.card == card && e.profile == base)
                .unwrap_or_else(|| panic!("{card} {base} in the catalog"));
            assert!(
                e.memory_mib <= mib,
                "{card} {base}: {} MiB above lgip's {mib}",
                e.memory_mib
            );
            if e.source == gpufit::core::catalog::MigMemorySource::Lgip {
                let printed = e.memory_mib as f64 / 1024.0;
                assert!(
                    (printed - gib).abs() <= 0.005 + 1e-9,
                    "{card} {base}: {printed} GiB, lgip {gib}"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked}");
}
