//! Table tests of the hooks' decisions.

use super::*;
use crate::core::advisor::SuggestionSource;
use crate::core::run::FailureReason;
use crate::core::settings::Dtype;
use crate::core::settings::EngineeringSettings;

fn env(pairs: &[(&str, &str)]) -> Env {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn ask(plan: TaskPlan) -> JobRequest {
    match plan {
        TaskPlan::Ask(r) => *r,
        TaskPlan::Skip { reason } => panic!("expected a request, got skip: {reason}"),
    }
}

fn suggestion() -> Suggestion {
    Suggestion {
        settings: EngineeringSettings {
            micro_batch_size: 4,
            gradient_accumulation_steps: 8,
            ..EngineeringSettings::default()
        },
        predicted_peak_bytes: 60_000_000_000,
        memory_fraction: 0.7,
        confidence: 0.42,
        source: SuggestionSource::Heuristic,
        strategy: Strategy::Balanced,
        gpu: "NVIDIA A100-SXM4-80GB".into(),
        reasoning: "line one\nline two".into(),
        warnings: vec![],
        predicted_tokens_per_sec: 0.0,
        measured_tokens_per_sec: None,
    }
}

#[test]
fn jobs_that_do_not_ask_for_gpufit_are_skipped() {
    let cases: &[(&str, Env, Option<&str>)] = &[
        ("no job id", env(&[("GPUFIT_MODEL", "m")]), None),
        ("no model, no comment", env(&[("SLURM_JOB_ID", "7")]), None),
        (
            "empty model",
            env(&[("SLURM_JOB_ID", "7"), ("GPUFIT_MODEL", " ")]),
            None,
        ),
        (
            "comment without section",
            env(&[("SLURM_JOB_ID", "7")]),
            Some("nightly eval run"),
        ),
        (
            "already decided by the batch step",
            env(&[
                ("SLURM_JOB_ID", "7"),
                ("GPUFIT_MODEL", "m"),
                ("GPUFIT_SEQ_LEN", "2048"),
                ("GPUFIT_JOB_ID", "7"),
                ("GPUFIT_SUGGESTION_SOURCE", "heuristic"),
            ]),
            None,
        ),
    ];
    for (name, e, comment) in cases {
        let plan = plan_task_prolog(e, Strategy::Balanced, *comment).unwrap();
        assert!(matches!(plan, TaskPlan::Skip { .. }), "{name}: {plan:?}");
    }
}

#[test]
fn the_environment_describes_the_workload_and_the_gpus() {
    let e = env(&[
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_GPUS", "2,3"),
        ("SLURM_JOB_NUM_NODES", "2"),
        ("GPUFIT_MODEL", "meta-llama/Llama-3.1-8B"),
        ("GPUFIT_SEQ_LEN", "4096"),
        ("GPUFIT_GLOBAL_BATCH", "64"),
        ("GPUFIT_METHOD", "lora"),
        ("GPUFIT_LORA_RANK", "16"),
        ("GPUFIT_LORA_TARGETS", "q_proj,v_proj,o"),
        ("GPUFIT_OPTIMIZER", "adamw8bit"),
        ("GPUFIT_ZERO", "2"),
        ("GPUFIT_STRATEGY", "extreme"),
    ]);
    let r = ask(plan_task_prolog(&e, Strategy::Balanced, None).unwrap());
    assert_eq!(r.job_id, "42");
    assert_eq!(r.gpu_indices, vec![2, 3]);
    assert_eq!(r.workload.model, "meta-llama/Llama-3.1-8B");
    assert_eq!(r.workload.seq_len, 4096);
    assert_eq!(r.workload.global_batch, Some(64));
    assert_eq!(r.workload.method, Some(Method::Lora));
    assert_eq!(r.workload.lora_rank, Some(16));
    assert_eq!(
        r.workload.lora_targets,
        Some(vec![LoraTarget::Q, LoraTarget::V, LoraTarget::O])
    );
    assert_eq!(r.workload.optimizer, Some(Optimizer::Adamw8bit));
    assert_eq!(r.workload.sharding, Some(Sharding::Zero2));
    // 2 GPUs on this node × 2 nodes.
    assert_eq!(r.workload.gpus, Some(4));
    assert_eq!(r.strategy, Strategy::Aggressive);
    assert_eq!(r.pins, Pins::default());
}

#[test]
fn the_comment_section_describes_the_workload_and_the_environment_wins() {
    let comment = "team-a nightly; gpufit: model=llama-3.1-8b, seq-len=2048 global_batch=32 micro_batch_size=2 compile=off; other";
    let e = env(&[
        ("SLURM_JOB_ID", "9"),
        ("CUDA_VISIBLE_DEVICES", "0"),
        ("GPUFIT_GLOBAL_BATCH", "16"),
    ]);
    let r = ask(plan_task_prolog(&e, Strategy::Conservative, Some(comment)).unwrap());
    assert_eq!(r.workload.model, "llama-3.1-8b");
    assert_eq!(r.workload.seq_len, 2048);
    assert_eq!(
        r.workload.global_batch,
        Some(16),
        "environment wins over comment"
    );
    assert_eq!(r.workload.gpus, Some(1));
    assert_eq!(r.strategy, Strategy::Conservative, "site default strategy");
    assert_eq!(r.pins.micro_batch_size, Some(2));
    assert_eq!(r.pins.compile, Some(false));
}

#[test]
fn engineering_variables_the_user_sets_are_pins_unless_inherited_from_another_job() {
    let base = [
        ("SLURM_JOB_ID", "5"),
        ("GPUFIT_MODEL", "m"),
        ("GPUFIT_SEQ_LEN", "1024"),
        ("GPUFIT_MICRO_BATCH_SIZE", "3"),
        ("GPUFIT_DTYPE", "bf16-mixed"),
        ("GPUFIT_ACTIVATION_CHECKPOINTING", "1"),
    ];
    let r = ask(plan_task_prolog(&env(&base), Strategy::Balanced, None).unwrap());
    assert_eq!(r.pins.micro_batch_size, Some(3));
    assert_eq!(r.pins.dtype, Some(Dtype::Bf16Mixed));
    assert_eq!(r.pins.activation_checkpointing, Some(true));

    let mut stale = env(&base);
    stale.insert("GPUFIT_JOB_ID".into(), "4".into());
    stale.insert("GPUFIT_SUGGESTION_SOURCE".into(), "heuristic".into());
    let r = ask(plan_task_prolog(&stale, Strategy::Balanced, None).unwrap());
    assert_eq!(
        r.pins,
        Pins::default(),
        "exports of job 4 are not pins of job 5"
    );
}

#[test]
fn bad_requests_say_what_is_wrong() {
    type Case<'a> = (&'a [(&'a str, &'a str)], Option<&'a str>, &'a str);
    let cases: &[Case] = &[
        (
            &[("SLURM_JOB_ID", "1"), ("GPUFIT_MODEL", "m")],
            None,
            "GPUFIT_SEQ_LEN",
        ),
        (
            &[
                ("SLURM_JOB_ID", "1"),
                ("GPUFIT_MODEL", "m"),
                ("GPUFIT_SEQ_LEN", "long"),
            ],
            None,
            "not a whole number",
        ),
        (
            &[
                ("SLURM_JOB_ID", "1"),
                ("GPUFIT_MODEL", "m"),
                ("GPUFIT_SEQ_LEN", "8"),
                ("GPUFIT_ZERO", "4"),
            ],
            None,
            "ZeRO stage",
        ),
        (
            &[
                ("SLURM_JOB_ID", "1"),
                ("GPUFIT_MODEL", "m"),
                ("GPUFIT_SEQ_LEN", "8"),
                ("GPUFIT_COMPILE", "maybe"),
            ],
            None,
            "use true or false",
        ),
        (
            &[("SLURM_JOB_ID", "1")],
            Some("gpufit: model=m seq_len"),
            "not key=value",
        ),
        (
            &[("SLURM_JOB_ID", "1")],
            Some("gpufit: model=m colour=red"),
            "unknown key `colour`",
        ),
        (
            &[("SLURM_JOB_ID", "../etc"), ("GPUFIT_MODEL", "m")],
            None,
            "not a job number",
        ),
        (
            &[
                ("SLURM_JOB_ID", "1"),
                ("GPUFIT_MODEL", "m"),
                ("GPUFIT_SEQ_LEN", "8"),
                ("SLURM_JOB_GPUS", "a,b"),
            ],
            None,
            "not a list of GPU indices",
        ),
    ];
    for (vars, comment, want) in cases {
        let err = plan_task_prolog(&env(vars), Strategy::Balanced, *comment).unwrap_err();
        assert!(
            err.to_string().contains(want),
            "{vars:?} {comment:?}: got `{err}`, want `{want}`"
        );
    }
}

#[test]
fn cuda_visible_devices_with_uuids_gives_no_indices() {
    let e = env(&[("CUDA_VISIBLE_DEVICES", "GPU-1234,GPU-5678")]);
    assert_eq!(gpu_indices(&e).unwrap(), Vec::<u32>::new());
    let e = env(&[("SLURM_JOB_GPUS", "1"), ("CUDA_VISIBLE_DEVICES", "0")]);
    assert_eq!(
        gpu_indices(&e).unwrap(),
        vec![1],
        "SLURM_JOB_GPUS are physical indices"
    );
}

#[test]
fn comment_section_is_found_case_insensitively_and_ends_at_a_semicolon() {
    let cases = [
        ("gpufit: model=a", Some("model=a")),
        ("x; GPUFIT: model=a seq_len=2; y", Some("model=a seq_len=2")),
        ("gpufit:", Some("")),
        ("nothing here", None),
    ];
    for (c, want) in cases {
        assert_eq!(comment_section(c), want, "{c}");
    }
}

#[test]
fn exports_are_single_line_export_statements_with_every_setting() {
    let lines = exports("42", &suggestion());
    assert!(lines
        .iter()
        .all(|l| l.starts_with("export GPUFIT_") && !l.contains('\n')));
    let get = |k: &str| {
        lines
            .iter()
            .find_map(|l| l.strip_prefix(&format!("export {k}=")))
            .unwrap_or_else(|| panic!("{k} missing in {lines:?}"))
            .to_string()
    };
    assert_eq!(get("GPUFIT_MICRO_BATCH_SIZE"), "4");
    assert_eq!(get("GPUFIT_GRAD_ACCUM_STEPS"), "8");
    assert_eq!(get("GPUFIT_DTYPE"), "bf16");
    assert_eq!(get("GPUFIT_ACTIVATION_CHECKPOINTING"), "false");
    assert_eq!(get("GPUFIT_COMPILE"), "false");
    assert_eq!(get("GPUFIT_SUGGESTION_SOURCE"), "heuristic");
    assert_eq!(get("GPUFIT_CONFIDENCE"), "0.42");
    assert_eq!(get("GPUFIT_REASONING"), "line one line two");
    assert_eq!(get("GPUFIT_JOB_ID"), "42");
    assert_eq!(get("GPUFIT_RESULT_FILE"), "/tmp/gpufit-result-42.json");
}

#[test]
fn settings_take_the_environment_over_the_file_over_defaults() {
    let file = SiteConfig {
        controller_url: Some("http://ctl:8080/".into()),
        sidecar_url: Some("http://127.0.0.1:9445".into()),
        state_dir: Some("/srv/gpufit".into()),
        timeout_ms: Some(99_999),
        strategy: Some("conservative".into()),
        ..SiteConfig::default()
    };
    let s = HookSettings::resolve(&env(&[]), &file, "sqlite:/d.db").unwrap();
    assert_eq!(s.backend, Backend::Controller("http://ctl:8080".into()));
    assert_eq!(s.state_dir, PathBuf::from("/srv/gpufit"));
    assert_eq!(
        s.timeout,
        Duration::from_millis(MAX_TIMEOUT_MS),
        "capped below 2 s"
    );
    assert_eq!(s.strategy, Strategy::Conservative);

    let e = env(&[
        ("GPUFIT_CONTROLLER_URL", "http://other:1"),
        ("GPUFIT_MAPPING_DIR", "/run/map"),
        ("SLURM_CLUSTER_NAME", "c1"),
    ]);
    let s = HookSettings::resolve(&e, &file, "sqlite:/d.db").unwrap();
    assert_eq!(s.backend, Backend::Controller("http://other:1".into()));
    assert_eq!(s.mapping_dir, Some(PathBuf::from("/run/map")));
    assert_eq!(s.cluster.as_deref(), Some("c1"));

    let s = HookSettings::resolve(&env(&[]), &SiteConfig::default(), "sqlite:/d.db").unwrap();
    assert_eq!(s.backend, Backend::Local("sqlite:/d.db".into()));
    assert_eq!(s.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
    assert_eq!(s.timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
}

#[test]
fn a_site_config_with_an_unknown_key_is_refused_with_its_path() {
    let err = SiteConfig::parse("controler_url = \"x\"", Path::new("/etc/gpufit/slurm.toml"))
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("/etc/gpufit/slurm.toml") && msg.contains("controler_url"),
        "{msg}"
    );
}

#[test]
fn mapping_files_name_each_gpu_index_and_hold_the_job_id() {
    let files = mapping_files(Path::new("/run/map"), "77", &[0, 3]);
    assert_eq!(
        files,
        vec![
            (PathBuf::from("/run/map/0"), "77\n".to_string()),
            (PathBuf::from("/run/map/3"), "77\n".to_string()),
        ]
    );
}

fn state() -> SavedDecision {
    SavedDecision {
        job_id: "42".into(),
        workload: WorkloadSpec {
            model: "my-custom-model".into(),
            architecture: None,
            method: Some(Method::Lora),
            lora_rank: Some(8),
            lora_targets: None,
            seq_len: 2048,
            global_batch: Some(32),
            gpus: Some(1),
            optimizer: None,
            sharding: None,
            framework: None,
            attention: None,
        },
        suggestion: suggestion(),
        started_at: DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .into(),
        node: Some("n1".into()),
        job_name: None,
    }
}

#[test]
fn the_run_says_success_oom_or_other_error_from_the_exit_state() {
    let end: DateTime<Utc> = DateTime::parse_from_rfc3339("2026-01-01T00:01:30Z")
        .unwrap()
        .into();
    // (exit, derived, oom) → (success, reason)
    type Case = (Option<i64>, Option<i64>, bool, bool, Option<FailureReason>);
    let cases: &[Case] = &[
        (Some(0), Some(0), false, true, None),
        (Some(0), None, false, true, None),
        (
            Some(256),
            Some(0),
            false,
            false,
            Some(FailureReason::OtherError),
        ),
        (
            Some(0),
            Some(256),
            false,
            false,
            Some(FailureReason::OtherError),
        ),
        (Some(256), Some(0), true, false, Some(FailureReason::Oom)),
        (Some(0), Some(0), true, false, Some(FailureReason::Oom)),
        (None, None, false, false, Some(FailureReason::OtherError)),
    ];
    for (exit, derived, oom, success, reason) in cases {
        let out = JobEnd {
            record: None,
            exit_status: *exit,
            derived_status: *derived,
            oom: *oom,
            host_oom: false,
            peak_memory_bytes: Some(123),
            log: LogFacts::default(),
            ended_at: end,
        };
        let run = build_run(&state(), &out, Some("c".into()), None);
        assert_eq!(run.result.success(), *success, "{exit:?} {derived:?} {oom}");
        assert_eq!(
            run.result.failure_reason(),
            *reason,
            "{exit:?} {derived:?} {oom}"
        );
        assert_eq!(run.result.duration_sec, Some(90.0));
        assert_eq!(run.result.peak_memory_bytes, Some(123));
        assert_eq!(run.settings.micro_batch_size, 4);
        assert_eq!(run.gpu_model, "NVIDIA A100-SXM4-80GB");
        assert_eq!(run.source, RunSource::Slurm);
        assert_eq!(run.job_id.as_deref(), Some("42"));
        assert_eq!(run.node.as_deref(), Some("n1"));
        assert_eq!(run.predicted_peak_bytes, Some(60_000_000_000));
        // Scientific fields are carried over unchanged.
        assert_eq!(
            (run.seq_len, run.global_batch, run.lora_rank),
            (2048, Some(32), Some(8))
        );
    }
}

#[test]
fn the_exit_state_is_read_from_the_epilog_environment() {
    let e = env(&[
        ("SLURM_JOB_EXIT_CODE", "256"),
        ("SLURM_JOB_DERIVED_EC", "0"),
    ]);
    assert_eq!(exit_state(&e), (Some(256), Some(0)));
    assert_eq!(exit_state(&env(&[])), (None, None));
}

#[test]
fn the_peak_is_read_from_the_sidecar_job_type() {
    // The Epilog reads `GET /v1/jobs/{id}` as the sidecar's own type.
    let job: crate::wire::sidecar::JobView = serde_json::from_value(serde_json::json!({
        "id": "42", "kind": "slurm", "namespace": null, "pod": null, "pod_uid": null,
        "slurm_job_id": "42", "node": "n1", "running": false, "current_bytes": 0,
        "current_total_bytes": 0, "peak_bytes": 6, "method": "log",
        "measured_peak_bytes": 5, "measured_method": "sampled", "gpus": [],
        "processes": 0, "first_seen": "2026-01-01T00:00:00Z",
        "last_seen": "2026-01-01T00:01:00Z", "ended_at": null
    }))
    .expect("the sidecar's job shape");
    assert_eq!(job.peak_bytes, 6, "the log-stated peak wins");
}

#[test]
fn the_output_pattern_is_filled_in_like_slurm_does() {
    let e = env(&[
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_USER", "ada"),
        ("SLURMD_NODENAME", "gpu01"),
        ("SLURM_JOB_WORK_DIR", "/home/ada/run"),
    ]);
    let cases = [
        ("/tmp/out/%j.out", Some("/tmp/out/42.out")),
        ("slurm-%j.out", Some("/home/ada/run/slurm-42.out")),
        ("/o/%u-%N-%6j-%%.log", Some("/o/ada-gpu01-000042-%.log")),
        ("/o/%A_%a.out", Some("/o/42_.out")),
        ("/dev/null", None),
        ("", None),
    ];
    for (pattern, want) in cases {
        assert_eq!(
            output_path(pattern, &e),
            want.map(PathBuf::from),
            "{pattern}"
        );
    }
}

/// Slurm's `OUT_OF_MEMORY` (or a cgroup oom-kill line) is a host-memory
/// kill: `other_error` for the micro batch, flagged for the data loader; a
/// CUDA OOM in the same job stays the GPU's.
#[test]
fn a_host_memory_kill_is_an_other_error_flagged_for_the_data_loader() {
    let end: DateTime<Utc> = DateTime::parse_from_rfc3339("2026-01-01T00:01:00Z")
        .unwrap()
        .into();
    let mut out = JobEnd {
        record: None,
        // 9 << 8 would be SIGKILL's wait status; Slurm reports the OOM kill as 0:125 too.
        exit_status: Some(9),
        derived_status: Some(0),
        oom: false,
        host_oom: true,
        peak_memory_bytes: None,
        log: LogFacts::default(),
        ended_at: end,
    };
    let run = build_run(&state(), &out, None, None);
    assert!(!run.result.success());
    assert_eq!(run.result.failure_reason(), Some(FailureReason::OtherError));
    assert!(run.result.host_oom());
    out.oom = true;
    let run = build_run(&state(), &out, None, None);
    assert_eq!(run.result.failure_reason(), Some(FailureReason::Oom));
    assert!(
        !run.result.host_oom(),
        "a GPU OOM is the micro batch's lesson"
    );
    out.oom = false;
    out.exit_status = Some(0);
    let run = build_run(&state(), &out, None, None);
    assert!(
        run.result.success() && !run.result.host_oom(),
        "a job that succeeded was not killed"
    );
    assert!(scontrol_out_of_memory(
        "JobId=7 JobName=x\n   JobState=OUT_OF_MEMORY Reason=OutOfMemory Dependency=(null)\n"
    ));
    assert!(!scontrol_out_of_memory(
        "JobId=7\n   JobState=FAILED Reason=NonZeroExitCode\n"
    ));
}

#[test]
fn a_peak_the_log_states_wins_over_the_sidecars() {
    let end: DateTime<Utc> = DateTime::parse_from_rfc3339("2026-01-01T00:01:00Z")
        .unwrap()
        .into();
    let mut out = JobEnd {
        record: None,
        exit_status: Some(0),
        derived_status: Some(0),
        oom: false,
        host_oom: false,
        peak_memory_bytes: Some(100),
        log: LogFacts {
            stated: None,
            peak_memory_bytes: Some(90),
            tokens_per_sec: Some(1234.0),
            samples_per_sec: None,
        },
        ended_at: end,
    };
    let run = build_run(&state(), &out, None, None);
    assert_eq!(run.result.peak_memory_bytes, Some(90));
    assert_eq!(run.result.tokens_per_sec, Some(1234.0));
    out.log = LogFacts::default();
    let run = build_run(&state(), &out, None, None);
    assert_eq!(run.result.peak_memory_bytes, Some(100));
}

#[test]
fn a_jobs_nodes_are_counted_from_its_node_list() {
    let cases = [
        ("gpu[01-04,07],cpu1", Some(6)),
        ("node7", Some(1)),
        ("a,b", Some(2)),
        ("r[1-2]n[1-4]", Some(8)),
        ("n[x]", None),
        ("n[4-1]", None),
    ];
    for (list, want) in cases {
        assert_eq!(count_nodes(list), want, "{list}");
    }
    assert_eq!(job_nodes(&env(&[("SLURM_NODELIST", "gpu[01-02]")])), 2);
    assert_eq!(job_nodes(&env(&[("SLURM_JOB_NUM_NODES", "3")])), 3);
    assert_eq!(job_nodes(&env(&[])), 1, "no list: one node");
}

#[test]
fn scontrol_gives_the_expanded_output_paths() {
    let out = "JobId=7 JobName=train\n   WorkDir=/home/u\n   StdErr=/home/u/train-7.out\n   StdIn=/dev/null\n   StdOut=/home/u/train-7.out\n   Power=\n";
    assert_eq!(
        parse_scontrol_outputs(out),
        vec![PathBuf::from("/home/u/train-7.out")]
    );
    let out = "JobId=8\n   StdErr=/o/err-8 StdOut=/o/out-8\n";
    assert_eq!(
        parse_scontrol_outputs(out),
        vec![PathBuf::from("/o/err-8"), PathBuf::from("/o/out-8")]
    );
    assert!(parse_scontrol_outputs("JobId=9\n   StdOut=(null)\n   StdErr=/dev/null\n").is_empty());
    assert!(parse_scontrol_outputs("JobId=9\n   StdOut=relative.out\n").is_empty());
}

#[test]
fn without_an_output_variable_the_default_file_in_the_work_dir_is_read() {
    let e = env(&[
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_WORK_DIR", "/home/u/run"),
    ]);
    assert_eq!(
        output_candidates(&e, None),
        vec![PathBuf::from("/home/u/run/slurm-42.out")]
    );
    let e = env(&[
        ("SLURM_JOB_ID", "43"),
        ("SLURM_ARRAY_JOB_ID", "40"),
        ("SLURM_ARRAY_TASK_ID", "3"),
        ("SLURM_JOB_WORK_DIR", "/w"),
    ]);
    assert_eq!(
        output_candidates(&e, None),
        vec![PathBuf::from("/w/slurm-40_3.out")]
    );
    // No working directory: nothing to guess.
    assert!(output_candidates(&env(&[("SLURM_JOB_ID", "42")]), None).is_empty());
}

#[test]
fn the_job_name_kept_by_the_task_prolog_fills_in_x() {
    let e = env(&[
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_STDOUT", "%x-%j.out"),
        ("SLURM_JOB_WORK_DIR", "/w"),
    ]);
    assert_eq!(
        output_candidates(&e, Some("train")),
        vec![PathBuf::from("/w/train-42.out")]
    );
    // Without it `%x` is empty, as it was before the name was kept.
    assert_eq!(
        output_candidates(&e, None),
        vec![PathBuf::from("/w/-42.out")]
    );
}

/// The data loader is sized by the CPUs Slurm gave the job per GPU, never
/// the node's: `--cpus-per-gpu 16` may get more than 4 workers, and the
/// request carries it to the controller's API.
#[test]
fn the_cpus_slurm_gave_the_job_size_its_data_loader() {
    let base = [
        ("SLURM_JOB_ID", "9"),
        ("SLURM_JOB_GPUS", "0,1"),
        ("GPUFIT_MODEL", "Qwen/Qwen2.5-0.5B"),
        ("GPUFIT_SEQ_LEN", "512"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut pairs = base.to_vec();
        pairs.extend_from_slice(extra);
        ask(plan_task_prolog(&env(&pairs), Strategy::Balanced, None).unwrap())
    };
    assert_eq!(with(&[]).cpus_per_gpu, None, "unknown: not this node's");
    let per_gpu = with(&[("SLURM_CPUS_PER_GPU", "16"), ("SLURM_CPUS_PER_TASK", "2")]);
    assert_eq!(per_gpu.cpus_per_gpu, Some(16), "--cpus-per-gpu wins");
    // One task driving both GPUs splits its 12 cores; one task per GPU keeps them.
    assert_eq!(with(&[("SLURM_CPUS_PER_TASK", "12")]).cpus_per_gpu, Some(6));
    let two_tasks = with(&[
        ("SLURM_CPUS_PER_TASK", "12"),
        ("SLURM_NTASKS_PER_NODE", "2"),
    ]);
    assert_eq!(two_tasks.cpus_per_gpu, Some(12));

    let req = per_gpu.suggest_request(GpuRef::Name("NVIDIA A100-SXM4-80GB".into()));
    assert_eq!(req.cpus_per_gpu, Some(16));
    let dir = tempfile::tempdir().unwrap();
    let store = crate::history::open(&format!("sqlite:{}/h.db", dir.path().display())).unwrap();
    let targets = crate::core::advisor::StrategyTargets::default();
    let many = crate::service::suggest_blocking(store.as_ref(), targets, &req).unwrap();
    assert!(
        many.settings.dataloader.num_workers > 4,
        "{:?}",
        many.settings.dataloader
    );
    let few = with(&[("SLURM_CPUS_PER_GPU", "2")])
        .suggest_request(GpuRef::Name("NVIDIA A100-SXM4-80GB".into()));
    let few = crate::service::suggest_blocking(store.as_ref(), targets, &few).unwrap();
    assert!(
        few.settings.dataloader.num_workers <= 2,
        "{:?}",
        few.settings.dataloader
    );
}

#[test]
fn node_in_the_sidecar_url_is_each_nodes_name() {
    let file = SiteConfig {
        sidecar_url: Some("http://{node}:9445/".into()),
        ..SiteConfig::default()
    };
    let s = HookSettings::resolve(&env(&[("SLURMD_NODENAME", "gpu07")]), &file, "sqlite:/d.db")
        .unwrap();
    assert_eq!(s.sidecar_url.as_deref(), Some("http://gpu07:9445"));
    // The environment's URL wins and is expanded the same way.
    let e = env(&[
        ("SLURMD_NODENAME", "10.0.0.7"),
        ("GPUFIT_SIDECAR_URL", "http://{node}:1/"),
    ]);
    let s = HookSettings::resolve(&e, &file, "sqlite:/d.db").unwrap();
    assert_eq!(s.sidecar_url.as_deref(), Some("http://10.0.0.7:1"));
    // Without the placeholder the URL is kept: each node's 127.0.0.1.
    let local = SiteConfig {
        sidecar_url: Some("http://127.0.0.1:9445".into()),
        ..SiteConfig::default()
    };
    let s = HookSettings::resolve(&env(&[]), &local, "sqlite:/d.db").unwrap();
    assert_eq!(s.sidecar_url.as_deref(), Some("http://127.0.0.1:9445"));
}

#[test]
fn a_node_placeholder_that_cannot_be_filled_is_refused() {
    let file = SiteConfig {
        sidecar_url: Some("http://{node}:9445".into()),
        ..SiteConfig::default()
    };
    let err = HookSettings::resolve(&env(&[]), &file, "sqlite:/d.db").unwrap_err();
    assert!(err.to_string().contains("SLURMD_NODENAME"), "{err}");
    for bad in ["a/b", "x@evil", "n 1", ".hidden"] {
        let e = env(&[("SLURMD_NODENAME", bad)]);
        let err = HookSettings::resolve(&e, &file, "sqlite:/d.db").unwrap_err();
        assert!(
            err.to_string().contains("cannot stand in a URL"),
            "{bad}: {err}"
        );
    }
    let other = SiteConfig {
        sidecar_url: Some("http://{host}:9445".into()),
        ..SiteConfig::default()
    };
    let e = env(&[("SLURMD_NODENAME", "n1")]);
    let err = HookSettings::resolve(&e, &other, "sqlite:/d.db").unwrap_err();
    assert!(err.to_string().contains("only placeholder"), "{err}");
}

#[test]
fn each_node_of_a_job_has_its_own_state_file() {
    let d = Path::new("/var/spool/gpufit");
    assert_eq!(
        state_path(d, "42", Some("n1")),
        PathBuf::from("/var/spool/gpufit/job-42.n1.json")
    );
    assert_ne!(
        state_path(d, "42", Some("n1")),
        state_path(d, "42", Some("n2"))
    );
    // No usable name (by hand, or a name that is not a host name): the
    // one-file-per-job name earlier versions wrote.
    for node in [None, Some("../x"), Some("")] {
        assert_eq!(
            state_path(d, "42", node),
            PathBuf::from("/var/spool/gpufit/job-42.json")
        );
    }
}

#[test]
fn a_node_without_state_asks_with_the_inherited_settings_as_pins_and_prints_nothing() {
    let e = env(&[
        ("SLURM_JOB_ID", "7"),
        ("GPUFIT_MODEL", "meta-llama/Llama-3.1-8B"),
        ("GPUFIT_SEQ_LEN", "2048"),
        ("GPUFIT_JOB_ID", "7"),
        ("GPUFIT_SUGGESTION_SOURCE", "heuristic"),
        ("GPUFIT_MICRO_BATCH_SIZE", "4"),
        ("GPUFIT_GRAD_ACCUM_STEPS", "2"),
    ]);
    // The batch step's node has the state: nothing to do.
    assert!(matches!(
        plan_task_prolog_here(&e, Strategy::Balanced, None, true).unwrap(),
        TaskPlan::Skip { .. }
    ));
    // Another node of the job: its Epilog needs the state, so it asks —
    // for the settings in use (pins), never printing other values.
    let r = ask(plan_task_prolog_here(&e, Strategy::Balanced, None, false).unwrap());
    assert!(r.inherited);
    assert_eq!(r.pins.micro_batch_size, Some(4));
    assert_eq!(r.pins.gradient_accumulation_steps, Some(2));
    // Exports of another job are still stale, never pins.
    let mut other = e.clone();
    other.insert("GPUFIT_JOB_ID".into(), "6".into());
    let r = ask(plan_task_prolog_here(&other, Strategy::Balanced, None, false).unwrap());
    assert!(!r.inherited);
    assert_eq!(r.pins, Pins::default());
}

// === the job's device on a MIG node ===

/// A sidecar `/v1/gpus` entry: a whole card (`slice` None) or a MIG slice.
fn device(index: u32, uuid: &str, gib: u64, slice: Option<(u32, &str, u32)>) -> GpuInfo {
    let card = "GPU-5d3a1c2e-0000-4000-8000-000000000000";
    serde_json::from_value(serde_json::json!({
        "index": index, "uuid": uuid,
        "name": match slice {
            Some((_, p, _)) => format!("NVIDIA A100-SXM4-40GB MIG {p}"),
            None => "NVIDIA A100-SXM4-40GB".to_string(),
        },
        "memory_total_bytes": gib << 30, "memory_used_bytes": 0, "memory_free_bytes": gib << 30,
        "compute_capability": "8.0", "utilization_ratio": null,
        "mig_enabled": if slice.is_none() { Some(true) } else { None },
        "accounting_enabled": null, "healthy": true, "error": null,
        "mig": slice.map(|(d, p, gi)| serde_json::json!({
            "device": d, "profile": p, "parent_uuid": card,
            "gpu_instance_id": gi, "compute_instance_id": 0})),
    }))
    .expect("a /v1/gpus entry")
}

/// Card 0 in MIG mode with a 1g.5gb slice (GI 7) and a 3g.20gb one (GI 1).
fn mig_node() -> Vec<GpuInfo> {
    vec![
        device(0, "GPU-5d3a1c2e-0000-4000-8000-000000000000", 40, None),
        device(
            0,
            "MIG-aaaa1111-2222-5333-8444-555555555555",
            5,
            Some((0, "1g.5gb", 7)),
        ),
        device(
            0,
            "MIG-bbbb1111-2222-5333-8444-555555555555",
            20,
            Some((1, "3g.20gb", 1)),
        ),
    ]
}

fn picked(gpus: &[GpuInfo], vars: &[(&str, &str)]) -> (String, Option<String>) {
    let e = env(vars);
    let indices = gpu_indices(&e).expect("indices");
    let p = pick_job_device(gpus, &visible_devices(&e), &indices).expect("a device");
    (p.device.name.clone(), p.note)
}

#[test]
fn cuda_visible_devices_is_read_in_every_spelling_slurm_writes() {
    let e = env(&[(
        "CUDA_VISIBLE_DEVICES",
        "MIG-bbbb1111-2222-5333-8444-555555555555,MIG-GPU-5d3a1c2e-0000-4000-8000-000000000000/7/0, 2 ,GPU-77",
    )]);
    assert_eq!(
        visible_devices(&e),
        vec![
            VisibleDevice::MigUuid("MIG-bbbb1111-2222-5333-8444-555555555555".into()),
            VisibleDevice::MigInstance {
                parent_uuid: "GPU-5d3a1c2e-0000-4000-8000-000000000000".into(),
                gpu_instance: 7,
                compute_instance: 0,
            },
            VisibleDevice::Index(2),
            VisibleDevice::GpuUuid("GPU-77".into()),
        ]
    );
    // CUDA stops at the first entry it cannot take: so does the reading.
    for (v, n) in [
        ("0,-1,1", 1),
        ("NoDevFiles", 0),
        ("MIG-GPU-abc/1", 0),
        ("MIG-GPU-abc/1/x", 0),
        ("MIG-GPU-abc/1/0/9", 0),
        ("MIG-", 0),
        ("", 0),
        ("1,MIG-x,junk,2", 2),
    ] {
        assert_eq!(
            visible_devices(&env(&[("CUDA_VISIBLE_DEVICES", v)])).len(),
            n,
            "{v:?}"
        );
    }
    assert!(visible_devices(&env(&[])).is_empty());
}

#[test]
fn a_mig_job_is_planned_for_the_slice_slurm_gave_it_by_uuid() {
    let gpus = mig_node();
    for (vars, want) in [
        // R470+: the MIG device's own UUID; SLURM_JOB_GPUS is the gres
        // index (1: the second slice), not a card index.
        (
            vec![
                (
                    "CUDA_VISIBLE_DEVICES",
                    "MIG-bbbb1111-2222-5333-8444-555555555555",
                ),
                ("SLURM_JOB_GPUS", "1"),
            ],
            "3g.20gb",
        ),
        (
            vec![
                (
                    "CUDA_VISIBLE_DEVICES",
                    "MIG-aaaa1111-2222-5333-8444-555555555555",
                ),
                ("SLURM_JOB_GPUS", "0"),
            ],
            "1g.5gb",
        ),
        // A step: SLURM_STEP_GPUS, no SLURM_JOB_GPUS.
        (
            vec![
                (
                    "CUDA_VISIBLE_DEVICES",
                    "MIG-bbbb1111-2222-5333-8444-555555555555",
                ),
                ("SLURM_STEP_GPUS", "1"),
            ],
            "3g.20gb",
        ),
        // Before R470: card UUID and the GPU / compute instance ids.
        (
            vec![(
                "CUDA_VISIBLE_DEVICES",
                "MIG-GPU-5d3a1c2e-0000-4000-8000-000000000000/1/0",
            )],
            "3g.20gb",
        ),
        (
            vec![(
                "CUDA_VISIBLE_DEVICES",
                "MIG-GPU-5d3a1c2e-0000-4000-8000-000000000000/7/0",
            )],
            "1g.5gb",
        ),
        // A unique prefix, as CUDA allows.
        (vec![("CUDA_VISIBLE_DEVICES", "MIG-bbbb1111")], "3g.20gb"),
    ] {
        let (name, note) = picked(&gpus, &vars);
        assert_eq!(
            name,
            format!("NVIDIA A100-SXM4-40GB MIG {want}"),
            "{vars:?}"
        );
        let note = note.expect("the reasoning names the slice");
        assert!(
            note.contains(want) && note.contains("of GPU 0"),
            "{vars:?}: {note}"
        );
    }
}

#[test]
fn a_job_with_slices_of_several_profiles_is_planned_for_its_smallest() {
    let gpus = mig_node();
    for order in [
        "MIG-bbbb1111-2222-5333-8444-555555555555,MIG-aaaa1111-2222-5333-8444-555555555555",
        "MIG-aaaa1111-2222-5333-8444-555555555555,MIG-bbbb1111-2222-5333-8444-555555555555",
    ] {
        let (name, note) = picked(
            &gpus,
            &[("CUDA_VISIBLE_DEVICES", order), ("SLURM_JOB_GPUS", "0,1")],
        );
        assert_eq!(name, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "{order}");
        let note = note.expect("a note");
        assert!(
            note.contains("smallest of the job's 2 devices") && note.contains("3g.20gb"),
            "{note}"
        );
    }
    // The same slice named twice (both spellings) is one device.
    let (name, note) = picked(
        &gpus,
        &[(
            "CUDA_VISIBLE_DEVICES",
            "MIG-bbbb1111-2222-5333-8444-555555555555,MIG-GPU-5d3a1c2e-0000-4000-8000-000000000000/1/0",
        )],
    );
    assert_eq!(name, "NVIDIA A100-SXM4-40GB MIG 3g.20gb");
    assert!(note.is_some_and(|n| n.contains("the job's MIG slice 3g.20gb")));
}

#[test]
fn a_mig_slice_the_sidecar_does_not_list_or_no_slice_named_plans_for_the_smallest() {
    let gpus = mig_node();
    // A stale or foreign UUID; a gres index alone; nothing at all: the
    // slice cannot be told, so the smallest on the node, and said so.
    for vars in [
        vec![(
            "CUDA_VISIBLE_DEVICES",
            "MIG-ffffffff-0000-4000-8000-000000000000",
        )],
        vec![("SLURM_JOB_GPUS", "1"), ("CUDA_VISIBLE_DEVICES", "1")],
        vec![],
    ] {
        let (name, note) = picked(&gpus, &vars);
        assert_eq!(name, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "{vars:?}");
        assert!(
            note.is_some_and(|n| n.contains("smallest device")),
            "{vars:?}"
        );
    }
    // Whole GPUs are picked by index as before, with nothing to say.
    let whole = vec![device(0, "GPU-0", 40, None), device(1, "GPU-1", 80, None)];
    assert_eq!(picked(&whole, &[("SLURM_JOB_GPUS", "1")]).1, None);
    assert_eq!(picked(&whole, &[("SLURM_JOB_GPUS", "1")]).0, whole[1].name);
    let by_uuid =
        pick_job_device(&whole, &[VisibleDevice::GpuUuid("GPU-1".into())], &[]).expect("a device");
    assert_eq!(by_uuid.device.uuid, "GPU-1");
    assert_eq!(pick_job_device(&[], &[], &[0]), None);
}

#[test]
fn a_mig_job_named_only_by_uuid_counts_its_slices_and_reads_its_comment() {
    let e = env(&[
        ("SLURM_JOB_ID", "12"),
        ("GPUFIT_MODEL", "meta-llama/Llama-3.1-8B"),
        ("GPUFIT_SEQ_LEN", "2048"),
        (
            "CUDA_VISIBLE_DEVICES",
            "MIG-aaaa1111-2222-5333-8444-555555555555,MIG-bbbb1111-2222-5333-8444-555555555555",
        ),
    ]);
    let r = ask(plan_task_prolog(&e, Strategy::Balanced, None).unwrap());
    assert!(r.gpu_indices.is_empty());
    assert_eq!(r.visible.len(), 2);
    assert_eq!(r.workload.gpus, Some(2), "two slices, two ranks");
}

/// On a MIG node the mapping files are named by the MIG ids of
/// `CUDA_VISIBLE_DEVICES` (Slurm's two forms, gpu_nvml.c), not by
/// `SLURM_JOB_GPUS` (a gres index there); an id that could be a path is
/// never a file name.
#[test]
fn mig_jobs_map_their_slices_by_their_ids_in_both_forms() {
    let env = |cvd: &str, gpus: &str| -> Env {
        [
            ("CUDA_VISIBLE_DEVICES".to_string(), cvd.to_string()),
            ("SLURM_JOB_GPUS".to_string(), gpus.to_string()),
        ]
        .into()
    };
    let uuid = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f";
    let legacy = "MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/7/0";
    assert_eq!(mapping_names(&env(uuid, "3")).unwrap(), [uuid]);
    assert_eq!(
        mapping_names(&env(legacy, "3")).unwrap(),
        ["MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f_7_0"]
    );
    assert_eq!(
        mapping_names(&env(&format!("{uuid},{legacy}"), "3,4"))
            .unwrap()
            .len(),
        2
    );
    // Whole GPUs: the indices, as before.
    assert_eq!(mapping_names(&env("0,1", "2,3")).unwrap(), ["2", "3"]);
    // A hostile id is no file name (and no path).
    for bad in [
        "MIG-../../etc/passwd",
        "MIG-a/b",
        "MIG-GPU-../x/1/0",
        "MIG-a b",
    ] {
        let names = mapping_names(&env(bad, "")).unwrap_or_default();
        assert!(
            names
                .iter()
                .all(|n| !n.contains('/') && !n.contains("..") && !n.contains(' ')),
            "{bad}: {names:?}"
        );
    }
    let files = mapping_files_named(Path::new("/run/gpu-jobs"), "42", &[uuid.to_string()]);
    assert_eq!(files[0].0, Path::new("/run/gpu-jobs").join(uuid));
    assert_eq!(files[0].1, "42\n");
}
