//! The TrainingJob spec: the CRD in sync with `gpufit crd`, and
//! validation over YAML fixtures (the examples and a minimal spec).

use std::process::Command;

use gpufit::controller::crd::{Mode, TrainingJob};
use gpufit::controller::validate::validate;
use gpufit::core::advisor::Strategy;
use gpufit::core::settings::Dtype;
use gpufit::core::workload::Method;
use serde_json::json;

#[path = "common/controller.rs"]
mod fixtures;
use fixtures::*;

#[test]
fn checked_in_crd_matches_what_gpufit_crd_prints() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpufit"))
        .arg("crd")
        .output()
        .expect("run gpufit crd");
    assert!(
        out.status.success(),
        "gpufit crd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).expect("utf-8 YAML");
    let checked_in = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crds/trainingjob.yaml"
    ))
    .expect("read crds/trainingjob.yaml");
    assert!(
        printed == checked_in,
        "crds/trainingjob.yaml is out of date: run `cargo run -- crd > crds/trainingjob.yaml`"
    );
    assert!(
        printed.contains("shortNames:\n    - tj"),
        "short name tj missing"
    );
    for col in [
        "Phase",
        "GPU",
        "Micro Batch",
        "Dtype",
        "Confidence",
        "Peak GiB",
        "Age",
    ] {
        assert!(
            printed.contains(&format!("name: {col}\n")),
            "printer column {col} missing"
        );
    }
}

#[test]
fn llama_lora_example_validates_to_a_lora_workload_with_its_global_batch() {
    let tj = tj_from_yaml(EXAMPLE_LORA);
    let v = validate(&tj.spec, None).expect("the example is valid");
    assert_eq!(v.workload.method, Method::Lora);
    assert_eq!(v.workload.lora.as_ref().map(|l| l.rank), Some(16));
    assert_eq!(v.workload.seq_len, 2048);
    assert_eq!(v.workload.global_batch, Some(64));
    assert_eq!(v.mode, Mode::Inject);
    assert_eq!(v.oom_retry_limit, 2);
}

#[test]
fn recommend_example_validates_in_recommend_mode_with_its_pin() {
    let tj = tj_from_yaml(EXAMPLE_RECOMMEND);
    let v = validate(&tj.spec, None).expect("the example is valid");
    assert_eq!(v.mode, Mode::Recommend);
    assert_eq!(v.pins.dtype, Some(Dtype::Bf16Mixed));
    assert_eq!(v.strategy, Strategy::Conservative);
}

fn invalid_field(tj: &TrainingJob, mode: Option<Mode>) -> String {
    let e = validate(&tj.spec, mode).expect_err("must be invalid");
    assert!(!e.message.is_empty());
    e.field
}

#[test]
fn inline_architecture_validates_without_the_catalog() {
    let v = validate(&minimal_with(|_| {}).spec, None).expect("valid");
    assert_eq!(v.workload.model.name, "tiny-gpt");
    assert_eq!(v.workload.model.head_dim, 64);
    assert_eq!(v.workload.method, Method::Full);
}

#[test]
fn missing_model_and_architecture_fails_validation() {
    let tj = minimal_with(|v| {
        v["spec"]["workload"]
            .as_object_mut()
            .unwrap()
            .remove("architecture");
    });
    assert_eq!(invalid_field(&tj, None), "spec.workload.model");
}

#[test]
fn model_and_architecture_together_fail_validation() {
    let tj = minimal_with(|v| v["spec"]["workload"]["model"] = json!("meta-llama/Llama-3.1-8B"));
    assert_eq!(invalid_field(&tj, None), "spec.workload.model");
}

/// One resolver for every path (docs/design.md, "Workload resolution"):
/// the CRD's LoRA rank defaults to 8 as on the command line and the Slurm
/// API, and the targets follow the framework.
#[test]
fn lora_method_without_rank_gets_rank_8_and_the_frameworks_targets() {
    let tj = minimal_with(|v| v["spec"]["workload"]["method"] = json!("lora"));
    let v = validate(&tj.spec, None).expect("valid");
    let lora = v.workload.lora.expect("LoRA config");
    assert_eq!(lora.rank, 8);
    assert_eq!(
        lora.targets,
        gpufit::core::memory::default_lora_targets(v.workload.framework)
    );
}

#[test]
fn lora_rank_with_full_method_fails_validation() {
    let tj = minimal_with(|v| {
        v["spec"]["workload"]["method"] = json!("full");
        v["spec"]["workload"]["loraRank"] = json!(16);
    });
    assert_eq!(invalid_field(&tj, None), "spec.workload.loraRank");
}

#[test]
fn pins_that_contradict_the_global_batch_fail_validation() {
    let tj = minimal_with(|v| {
        v["spec"]["workload"]["globalBatch"] = json!(64);
        v["spec"]["pins"] = json!({"microBatchSize": 4, "gradientAccumulationSteps": 4});
    });
    assert_eq!(
        invalid_field(&tj, None),
        "spec.pins.gradientAccumulationSteps"
    );
}

#[test]
fn a_global_batch_not_divisible_by_the_gpus_fails_validation() {
    let tj = minimal_with(|v| {
        v["spec"]["workload"]["globalBatch"] = json!(10);
        v["spec"]["workload"]["gpus"] = json!(4);
    });
    let e = validate(&tj.spec, None).expect_err("invalid");
    assert!(e.message.contains("not divisible"), "{e}");
}

#[test]
fn recommend_mode_with_placeholders_in_args_fails_validation() {
    let tj = minimal_with(|_| {});
    let field = invalid_field(&tj, Some(Mode::Recommend));
    assert!(field.contains("args"), "{field}");
}

#[test]
fn restart_policy_always_fails_validation() {
    let tj = minimal_with(|v| v["spec"]["template"]["spec"]["restartPolicy"] = json!("Always"));
    assert_eq!(invalid_field(&tj, None), "spec.template.spec.restartPolicy");
}

#[test]
fn a_template_without_containers_fails_validation() {
    let tj = minimal_with(|v| v["spec"]["template"]["spec"]["containers"] = json!([]));
    assert_eq!(invalid_field(&tj, None), "spec.template.spec.containers");
}

#[test]
fn spec_mode_wins_over_the_namespace_default() {
    let tj = minimal_with(|v| {
        v["spec"]["mode"] = json!("Inject");
    });
    let v = validate(&tj.spec, Some(Mode::Recommend)).expect("valid");
    assert_eq!(v.mode, Mode::Inject);
}
