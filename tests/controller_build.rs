//! An attempt's Job built from a TrainingJob and a suggestion: the settings
//! in every container, placeholders, annotations, Recommend mode, names.

use std::collections::BTreeMap;

use gpufit::controller::build::{build_job, job_name, LABEL_TRAINING_JOB};
use gpufit::controller::crd::{Mode, TrainingJob};
use gpufit::controller::inject::{ANN_APPLIED, ANN_REASON, ANN_RECOMMENDATION};
use gpufit::core::advisor::{Strategy, Suggestion, SuggestionSource};
use gpufit::core::settings::{DataLoaderSettings, Dtype, EngineeringSettings};
use k8s_openapi::api::batch::v1::Job;
use serde_json::{json, Value};

#[path = "common/controller.rs"]
mod fixtures;
use fixtures::*;

fn suggestion(micro: u32, accum: u32) -> Suggestion {
    Suggestion {
        settings: EngineeringSettings {
            micro_batch_size: micro,
            gradient_accumulation_steps: accum,
            dtype: Dtype::Bf16,
            activation_checkpointing: true,
            activation_offloading: false,
            compile: false,
            dataloader: DataLoaderSettings::default(),
        },
        predicted_peak_bytes: 40 << 30,
        memory_fraction: 0.5,
        confidence: 0.4,
        source: SuggestionSource::Heuristic,
        strategy: Strategy::Balanced,
        gpu: "NVIDIA A100-SXM4-80GB".into(),
        reasoning: "the memory model predicts 40 GiB at micro batch 8".into(),
        warnings: vec![],
        predicted_tokens_per_sec: 0.0,
        measured_tokens_per_sec: None,
    }
}

fn two_container_tj() -> TrainingJob {
    served(minimal_with(|v| {
        v["spec"]["template"]["spec"]["containers"] = json!([
            {"name": "rank0", "image": "train:1",
             "args": ["--micro-batch={micro_batch_size}", "--accum", "{gradient_accumulation_steps}", "--lr=3e-4", "--dtype={dtype}"],
             "env": [{"name": "GPUFIT_MICRO_BATCH_SIZE", "value": "999"}, {"name": "SEED", "value": "42"}]},
            {"name": "rank1", "image": "train:1", "command": ["python", "train.py", "--checkpointing={activation_checkpointing}"]}
        ]);
    }))
}

fn env_of(job: &Job, container: usize) -> BTreeMap<String, String> {
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    pod.containers[container]
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

#[test]
fn built_job_gives_every_container_the_same_settings_and_an_owner_reference() {
    let tj = two_container_tj();
    let job = build_job(&tj, 1, &suggestion(8, 8), Mode::Inject).expect("builds");
    assert_eq!(job.metadata.name.as_deref(), Some("t-1"));
    let owner = &job.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(owner.kind, "TrainingJob");
    assert_eq!(owner.api_version, "gpufit.io/v1alpha1");
    assert_eq!(owner.uid, "0b5c1f7e-uid");
    assert_eq!(owner.controller, Some(true));
    for c in 0..2 {
        let env = env_of(&job, c);
        assert_eq!(env["GPUFIT_MICRO_BATCH_SIZE"], "8", "container {c}");
        assert_eq!(env["GPUFIT_GRAD_ACCUM_STEPS"], "8");
        assert_eq!(env["GPUFIT_DTYPE"], "bf16");
        assert_eq!(env["GPUFIT_ACTIVATION_CHECKPOINTING"], "true");
        assert_eq!(env["GPUFIT_ACTIVATION_OFFLOADING"], "false");
        assert_eq!(env["GPUFIT_COMPILE"], "false");
        assert_eq!(env["GPUFIT_DATALOADER_NUM_WORKERS"], "4");
    }
    // The user's own variable is kept; the stale gpufit one is replaced, not duplicated.
    assert_eq!(env_of(&job, 0)["SEED"], "42");
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let n = pod.containers[0]
        .env
        .iter()
        .flatten()
        .filter(|e| e.name == "GPUFIT_MICRO_BATCH_SIZE")
        .count();
    assert_eq!(n, 1);
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    assert_eq!(job.spec.as_ref().unwrap().backoff_limit, Some(0));
    assert_eq!(
        pod.containers[1].termination_message_policy.as_deref(),
        Some("FallbackToLogsOnError")
    );
}

#[test]
fn placeholders_are_substituted_and_scientific_args_are_left_alone() {
    let job = build_job(&two_container_tj(), 1, &suggestion(4, 16), Mode::Inject).expect("builds");
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(
        pod.containers[0].args.as_deref().unwrap(),
        [
            "--micro-batch=4",
            "--accum",
            "16",
            "--lr=3e-4",
            "--dtype=bf16"
        ]
    );
    assert_eq!(
        pod.containers[1].command.as_deref().unwrap(),
        ["python", "train.py", "--checkpointing=true"]
    );
}

#[test]
fn built_job_says_what_was_set_and_why_in_annotations() {
    let job = build_job(&two_container_tj(), 2, &suggestion(4, 16), Mode::Inject).expect("builds");
    let anns = job.metadata.annotations.as_ref().unwrap();
    let applied: Value = serde_json::from_str(&anns[ANN_APPLIED]).expect("JSON annotation");
    assert_eq!(applied["settings"]["microBatchSize"], 4);
    assert_eq!(applied["source"], "heuristic");
    assert!(anns[ANN_REASON].contains("40 GiB"));
    assert_eq!(
        job.metadata.labels.as_ref().unwrap()[LABEL_TRAINING_JOB],
        "t"
    );
    assert_eq!(job.metadata.name.as_deref(), Some("t-2"));
}

#[test]
fn recommend_mode_builds_the_template_as_written_with_only_annotations_added() {
    let tj = served(tj_from_yaml(EXAMPLE_RECOMMEND));
    let job = build_job(&tj, 1, &suggestion(4, 1), Mode::Recommend).expect("builds");
    let anns = job.metadata.annotations.as_ref().unwrap();
    assert!(anns.contains_key(ANN_RECOMMENDATION));
    assert!(!anns.contains_key(ANN_APPLIED));
    let built = &job
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    let written = &tj.spec.template.spec.as_ref().unwrap().containers[0];
    assert_eq!(built.args, written.args);
    assert_eq!(built.env, written.env);
    assert!(built
        .env
        .iter()
        .flatten()
        .all(|e| !e.name.starts_with("GPUFIT_")));
}

#[test]
fn job_names_stay_within_63_characters() {
    let long = "a".repeat(80);
    let name = job_name(&long, 12);
    assert!(name.len() <= 63, "{name}");
    assert!(name.ends_with("-12"));
}
