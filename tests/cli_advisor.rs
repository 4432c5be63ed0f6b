//! The advisor commands through the real binary: `suggest` and `plan`
//! (find-max-batch: tests/find_max_batch.rs; apply: tests/cli_apply.rs).

#[path = "common/cli.rs"]
mod cli;
use cli::{args, text, Env, A100, MODEL};

#[test]
fn suggest_prints_the_contract_fields_as_json() {
    let env = Env::new();
    let v = env.json(
        &args(&["suggest"], &args(MODEL, &["--gpu", A100, "-o", "json"])),
        &[],
    );
    for k in [
        "micro_batch_size",
        "gradient_accumulation_steps",
        "dtype",
        "activation_checkpointing",
        "compile",
        "predicted_peak_bytes",
        "confidence",
        "source",
        "reasoning",
        "warnings",
    ] {
        assert!(v.get(k).is_some(), "JSON lacks {k}: {v}");
    }
    assert_eq!(v["source"], "heuristic");
    assert!(v["confidence"].as_f64().unwrap() < 0.5);
    assert!(v["micro_batch_size"].as_u64().unwrap() >= 1);
    let peak = v["predicted_peak_bytes"].as_u64().unwrap();
    assert!(
        peak > 0 && (peak as f64) <= 0.85 * 81920.0 * 1048576.0,
        "{peak}"
    );
}

#[test]
fn suggest_keeps_the_global_batch_through_accumulation() {
    let env = Env::new();
    let v = env.json(
        &args(
            &["suggest"],
            &args(
                MODEL,
                &[
                    "--gpu",
                    A100,
                    "--global-batch",
                    "96",
                    "--gpus",
                    "2",
                    "-o",
                    "json",
                ],
            ),
        ),
        &[],
    );
    let m = v["micro_batch_size"].as_u64().unwrap();
    let a = v["gradient_accumulation_steps"].as_u64().unwrap();
    assert_eq!(m * a * 2, 96, "{v}");
}

#[test]
fn a_global_batch_the_pins_cannot_meet_exits_2_naming_valid_choices() {
    let env = Env::new();
    let out = env.run(
        &args(
            &["suggest", "--global-batch", "7", "--micro-batch", "2"],
            &args(MODEL, &["--gpu", A100]),
        ),
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("global batch 7"), "{t}");
    assert!(t.contains("1 or 7"), "{t}");
}

#[test]
fn suggest_prints_a_table_for_a_person() {
    let env = Env::new();
    let out = env.run(&args(&["suggest"], &args(MODEL, &["--gpu", A100])), &[]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("micro_batch_size") && t.contains("confidence"),
        "{t}"
    );
    assert!(t.contains("effective batch changed"), "{t}");
}

#[test]
fn pins_are_kept_and_a_pin_predicted_to_oom_is_a_warning() {
    let env = Env::new();
    let v = env.json(
        &args(
            &["suggest"],
            &args(
                MODEL,
                &[
                    "--gpu",
                    A100,
                    "--micro-batch",
                    "512",
                    "--checkpointing",
                    "off",
                    "--dtype",
                    "bf16",
                    "-o",
                    "json",
                ],
            ),
        ),
        &[],
    );
    assert_eq!(v["micro_batch_size"], 512);
    assert_eq!(v["activation_checkpointing"], false);
    let warnings = v["warnings"].to_string();
    assert!(warnings.contains("run out of memory"), "{v}");
}

#[test]
fn plan_shows_three_monotone_strategies() {
    let env = Env::new();
    let v = env.json(
        &args(&["plan"], &args(MODEL, &["--gpu", A100, "-o", "json"])),
        &[],
    );
    let plan = v.as_array().expect("an array of suggestions");
    assert_eq!(plan.len(), 3);
    let m: Vec<u64> = plan
        .iter()
        .map(|s| s["micro_batch_size"].as_u64().unwrap())
        .collect();
    assert!(m[0] <= m[1] && m[1] <= m[2], "{m:?}");
    assert_eq!(plan[0]["activation_checkpointing"], true);
    assert_eq!(plan[0]["compile"], false);
    assert_eq!(plan[2]["compile"], true);
    let table = env.run(&args(&["plan"], &args(MODEL, &["--gpu", A100])), &[]);
    let t = text(&table);
    assert!(
        t.contains("conservative") && t.contains("aggressive"),
        "{t}"
    );
    assert!(t.contains("Data loader"), "{t}");
}

#[test]
fn a_model_that_cannot_fit_exits_3_and_says_what_would() {
    let env = Env::new();
    let out = env.run(
        &[
            "suggest",
            "--model",
            "meta-llama/Llama-3.1-70B",
            "--method",
            "full",
            "--seq-len",
            "2048",
            "--gpu",
            "Tesla T4",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("What would"), "{}", text(&out));
    // The command line says how with its own flags (the core says it in
    // the domain's words, for the TrainingJob's conditions).
    let out = env.run(
        &[
            "suggest",
            "--model",
            "meta-llama/Llama-3.1-8B",
            "--seq-len",
            "4096",
            "--gpu",
            "Tesla T4",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    for how in ["(--method qlora --lora-rank 16)", "(--zero 3 --gpus "] {
        assert!(text(&out).contains(how), "{how}: {}", text(&out));
    }
}

#[test]
fn gpu_auto_without_a_gpu_is_a_clear_error_or_reads_the_gpu() {
    let env = Env::new();
    let out = env.run(&args(&["suggest"], &args(MODEL, &["--gpu", "auto"])), &[]);
    if !out.status.success() {
        let t = text(&out);
        assert!(t.contains("--gpu"), "the error says what to do: {t}");
        assert_ne!(out.status.code(), Some(101), "no panic: {t}");
    }
}

/// A MIG slice is a GPU of its own to `suggest`, in NVML's spelling, GPU
/// Feature Discovery's label and a card alias: the same suggestion, planned
/// for the slice's memory (4.75 GiB), with the card's bf16.
#[test]
fn suggest_plans_for_a_mig_slice_in_every_spelling() {
    let env = Env::new();
    let small = [
        "--model",
        "Qwen/Qwen2.5-0.5B",
        "--method",
        "lora",
        "--seq-len",
        "512",
    ];
    let mut seen = Vec::new();
    for gpu in [
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
        "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
        "a100-40gb mig-1g.5gb",
    ] {
        let v = env.json(
            &args(&["suggest"], &args(&small, &["--gpu", gpu, "-o", "json"])),
            &[],
        );
        let peak = v["predicted_peak_bytes"].as_u64().unwrap();
        assert!(
            peak > 0 && (peak as f64) <= 0.85 * 4864.0 * 1048576.0,
            "{gpu}: {peak} bytes on a 4.75 GiB slice"
        );
        assert!(v["dtype"].as_str().unwrap().contains("bf16"), "{v}");
        seen.push((v["micro_batch_size"].clone(), peak));
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
}

/// `--cpus-per-gpu` sizes the data loader for the job's own CPUs (one core
/// stays with the training process, at most 8 workers); without it the
/// host's CPUs ÷ GPUs are used, and the reasoning says which.
#[test]
fn cpus_per_gpu_stated_or_from_this_host_size_the_data_loader_and_the_reasoning_says_which() {
    let env = Env::new();
    let ask = |more: &[&str]| {
        env.json(
            &args(
                &["suggest"],
                &args(
                    MODEL,
                    &args(&["--gpu", A100, "--no-history", "-o", "json"], more),
                ),
            ),
            &[],
        )
    };
    let workers = |v: &serde_json::Value| v["dataloader"]["num_workers"].as_u64();
    let reasoning = |v: &serde_json::Value| v["reasoning"].as_str().unwrap_or("").to_string();
    for (cpus, want) in [("16", 8), ("5", 4), ("2", 1), ("1", 0)] {
        let v = ask(&["--cpus-per-gpu", cpus]);
        assert_eq!(workers(&v), Some(want), "{cpus} cores per GPU: {v}");
        assert!(
            reasoning(&v).contains(&format!("{cpus} CPU core"))
                && reasoning(&v).contains("stated with --cpus-per-gpu"),
            "{}",
            reasoning(&v)
        );
    }
    // The environment, like every flag.
    let v = env.json(
        &args(
            &["suggest"],
            &args(MODEL, &["--gpu", A100, "--no-history", "-o", "json"]),
        ),
        &[("GPUFIT_CPUS_PER_GPU", "16".to_string())],
    );
    assert_eq!(workers(&v), Some(8));
    // Without it: this host's cores over the GPUs.
    let host = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let v = ask(&["--gpus", "2"]);
    assert!(
        reasoning(&v).contains(&format!("this host's {host} CPU cores over 2 GPUs")),
        "{}",
        reasoning(&v)
    );
    assert_eq!(
        workers(&v),
        Some((host / 2).max(1).saturating_sub(1).min(8))
    );
    // A pinned worker count is kept and no CPU sentence is added.
    let v = ask(&["--cpus-per-gpu", "16", "--num-workers", "3"]);
    assert_eq!(workers(&v), Some(3));
    assert!(!reasoning(&v).contains("Data loader:"), "{}", reasoning(&v));
    // `plan` takes it too.
    let out = env.run(
        &args(
            &["plan"],
            &args(
                MODEL,
                &["--gpu", A100, "--no-history", "--cpus-per-gpu", "3"],
            ),
        ),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("num_workers=2"), "{}", text(&out));
    // Zero cores is a usage error, not a panic.
    let out = env.run(
        &args(
            &["suggest"],
            &args(MODEL, &["--gpu", A100, "--cpus-per-gpu", "0"]),
        ),
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--cpus-per-gpu 0"), "{}", text(&out));
}
