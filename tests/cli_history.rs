//! The `gpufit` binary: `parse-log`, `record`, `history import|export|list`,
//! each run as a user would, against a SQLite history in a temp directory.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/logs")
        .join(name)
}

/// A gpufit command with a private history and no inherited gpufit settings.
fn gpufit(db: &Path) -> Command {
    let mut c = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.starts_with("GPUFIT_") {
            c.env_remove(k);
        }
    }
    c.env("GPUFIT_HISTORY", format!("sqlite:{}", db.display()));
    c
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn json(out: Output) -> serde_json::Value {
    serde_json::from_str(&ok(out)).expect("JSON output")
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

#[test]
fn parse_log_recognises_every_fixture_format() {
    let d = tmp();
    let db = d.path().join("h.db");
    let cases = [
        ("torchtune_lora_single_device.log", "torchtune", "completed"),
        ("torchtune_full_oom.log", "cuda_oom", "out_of_memory"),
        ("hf_trainer.log", "hf_trainer", "completed"),
        ("lightning_tqdm.log", "lightning", "completed"),
        ("cuda_oom_old.log", "cuda_oom", "out_of_memory"),
        ("plain_script.log", "plain", "completed"),
    ];
    for (file, format, outcome) in cases {
        let v = json(
            gpufit(&db)
                .args(["-o", "json", "parse-log"])
                .arg(fixture(file))
                .output()
                .unwrap(),
        );
        let formats: Vec<&str> = v["formats"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|f| f.as_str())
            .collect();
        assert!(formats.contains(&format), "{file}: {formats:?}");
        assert_eq!(v["outcome"], outcome, "{file}");
        // The run_logs.jsonl `result` shape rides along.
        for key in [
            "success",
            "failure_reason",
            "peak_memory_bytes",
            "samples_per_sec",
            "duration_sec",
        ] {
            assert!(v.get(key).is_some(), "{file}: no `{key}` in {v}");
        }
        let expected_failure = match outcome {
            "out_of_memory" => serde_json::json!("OOM"),
            _ => serde_json::Value::Null,
        };
        assert_eq!(v["failure_reason"], expected_failure, "{file}");
        if outcome == "completed" {
            assert_eq!(v["success"], true, "{file}");
        }
    }
}

#[test]
fn parse_log_table_shows_the_oom_capacity_in_gib() {
    let d = tmp();
    let out = ok(gpufit(&d.path().join("h.db"))
        .arg("parse-log")
        .arg(fixture("torchtune_full_oom.log"))
        .output()
        .unwrap());
    assert!(out.contains("CUDA out of memory"), "{out}");
    assert!(out.contains("79.10 GiB"), "{out}");
}

#[test]
fn parse_log_of_a_binary_file_fails_with_exit_2_and_says_why() {
    let d = tmp();
    let f = d.path().join("model.bin");
    let bytes: Vec<u8> = (0..65_536u32).map(|i| (i * 131 % 256) as u8).collect();
    std::fs::write(&f, bytes).unwrap();
    let out = gpufit(&d.path().join("h.db"))
        .arg("parse-log")
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no training result") && err.contains("not text"),
        "{err}"
    );
}

#[test]
fn parse_log_streams_a_huge_single_line_in_bounded_memory() {
    let d = tmp();
    let f = d.path().join("huge.log");
    {
        let mut w = std::io::BufWriter::new(std::fs::File::create(&f).unwrap());
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..96 {
            w.write_all(&chunk).unwrap();
        }
        w.write_all(b"\nThroughput: 7.5 samples/sec\n").unwrap();
    }
    // 64 MB of address space: the 96 MiB line cannot be held whole.
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -v 65536 && exec {BIN} -o json parse-log {}",
            f.display()
        ))
        .env("GPUFIT_HISTORY", "sqlite:/nonexistent/unused.db")
        .output()
        .unwrap();
    let v = json(out);
    assert_eq!(v["samples_per_sec"], 7.5);
    assert_eq!(v["long_lines"], 1);
}

#[test]
fn record_from_a_log_then_list_shows_the_run_with_its_measured_peak() {
    let d = tmp();
    let db = d.path().join("h.db");
    let rec = json(
        gpufit(&db)
            .args([
                "-o",
                "json",
                "record",
                "--model",
                "my-org/private-8b",
                "--method",
                "lora",
                "--lora-rank",
                "16",
                "--seq-len",
                "2048",
                "--gpu",
                "NVIDIA A100-SXM4-80GB",
                "--micro-batch",
                "4",
                "--global-batch",
                "32",
                "--checkpointing",
                "on",
                "--log-file",
            ])
            .arg(fixture("torchtune_lora_single_device.log"))
            .output()
            .unwrap(),
    );
    assert_eq!(rec["result"]["success"], true);
    assert_eq!(rec["result"]["peak_memory_bytes"], 24_861_736_960u64);
    assert_eq!(
        rec["settings"]["gradient_accumulation_steps"], 8,
        "32 / (4 × 1)"
    );
    assert_eq!(rec["method"], "lora");

    let list = json(
        gpufit(&db)
            .args(["-o", "json", "history", "list"])
            .output()
            .unwrap(),
    );
    let runs = list.as_array().unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0]["model"], "my-org/private-8b");
    assert_eq!(runs[0]["settings"]["activation_checkpointing"], true);
    assert_eq!(runs[0]["result"]["tokens_per_sec"], 2843.9833984375);
}

#[test]
fn record_of_an_oom_log_is_a_failed_oom_run() {
    let d = tmp();
    let db = d.path().join("h.db");
    let rec = json(
        gpufit(&db)
            .args([
                "-o",
                "json",
                "record",
                "--model",
                "m",
                "--seq-len",
                "4096",
                "--gpu",
                "NVIDIA A100-SXM4-80GB",
                "--micro-batch",
                "16",
                "--log-file",
            ])
            .arg(fixture("torchtune_full_oom.log"))
            .output()
            .unwrap(),
    );
    assert_eq!(rec["result"]["success"], false);
    assert_eq!(rec["result"]["failure_reason"], "OOM");
    let table = ok(gpufit(&db).args(["history", "list"]).output().unwrap());
    assert!(table.contains("OOM"), "{table}");
}

#[test]
fn record_flags_for_peak_use_their_own_units() {
    let d = tmp();
    let db = d.path().join("h.db");
    let base = [
        "-o",
        "json",
        "record",
        "--model",
        "m",
        "--seq-len",
        "1024",
        "--gpu",
        "NVIDIA A100-SXM4-80GB",
        "--micro-batch",
        "2",
    ];
    let gb = json(
        gpufit(&db)
            .args(base)
            .args(["--peak-gb", "45.2"])
            .output()
            .unwrap(),
    );
    assert_eq!(gb["result"]["peak_memory_bytes"], 45_200_000_000u64);
    let gib = json(
        gpufit(&db)
            .args(base)
            .args(["--peak-gib", "2"])
            .output()
            .unwrap(),
    );
    assert_eq!(gib["result"]["peak_memory_bytes"], 2u64 << 30);
}

#[test]
fn record_rejects_contradicting_or_absurd_flags_with_exit_2() {
    let d = tmp();
    let db = d.path().join("h.db");
    let base = [
        "record",
        "--model",
        "m",
        "--seq-len",
        "1024",
        "--gpu",
        "NVIDIA A100-SXM4-80GB",
    ];
    let cases: [&[&str]; 4] = [
        &[
            "--micro-batch",
            "2",
            "--success",
            "true",
            "--failure",
            "oom",
        ],
        &["--micro-batch", "0"],
        &["--micro-batch", "2", "--peak-gb", "-3"],
        &["--micro-batch", "2", "--dtype", "int3"],
    ];
    for extra in cases {
        let out = gpufit(&db).args(base).args(extra).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
        assert!(!out.stderr.is_empty());
    }
    assert!(
        !db.exists() || {
            let v = json(
                gpufit(&db)
                    .args(["-o", "json", "history", "list"])
                    .output()
                    .unwrap(),
            );
            v.as_array().unwrap().is_empty()
        }
    );
}

/// Records that would poison the history (issue 9) are refused, exit 2,
/// with the reason; nothing is stored.
#[test]
fn record_refuses_poison_naming_the_field() {
    let d = tmp();
    let db = d.path().join("h.db");
    let cases: &[(&str, &str, &[&str], &str)] = &[
        ("auto", "auto", &["--success", "true"], "not a GPU"),
        (
            "H100",
            "H100",
            &["--success", "true"],
            "NVIDIA H100 80GB HBM3",
        ),
        (
            "500 GB peak on an 80 GB card",
            "NVIDIA A100-SXM4-80GB",
            &["--success", "true", "--peak-gb", "500"],
            "more than",
        ),
        (
            "micro batch 2^32-1",
            "NVIDIA A100-SXM4-80GB",
            &["--success", "true", "--micro-batch", "4294967295"],
            "micro_batch_size",
        ),
        // the message quotes the figure as typed, not a saturated byte count
        (
            "a 1e30 GB peak",
            "NVIDIA A100-SXM4-80GB",
            &["--success", "true", "--peak-gb", "1e30"],
            "(1e30 GB) is above 10000 GB",
        ),
        (
            "1e300 tokens/s",
            "NVIDIA A100-SXM4-80GB",
            &["--success", "true", "--tokens-per-sec", "1e300"],
            "tokens_per_sec = 1e300 is out of range",
        ),
    ];
    for (what, gpu, extra, says) in cases {
        let out = gpufit(&db)
            .args([
                "record",
                "--model",
                "meta-llama/Llama-3.1-8B",
                "--seq-len",
                "2048",
            ])
            .args(["--gpu", gpu])
            .args(*extra)
            .args(if extra.contains(&"--micro-batch") {
                &[][..]
            } else {
                &["--micro-batch", "4"][..]
            })
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(err.contains(says), "{what}: {err}");
    }
    assert!(
        !db.exists() || {
            let v = json(
                gpufit(&db)
                    .args(["-o", "json", "history", "list"])
                    .output()
                    .unwrap(),
            );
            v.as_array().unwrap().is_empty()
        }
    );
}

#[test]
fn history_import_counts_skipped_lines_and_export_round_trips() {
    let d = tmp();
    let db = d.path().join("h.db");
    let src = d.path().join("run_logs.jsonl");
    let good = r#"{"timestamp": "2026-01-01T10:00:00", "config": {"model": "torchtune.models.llama3_1.lora_llama3_1_8b", "max_seq_length": 2048, "batch_size": 4, "dtype": "bf16", "enable_activation_checkpointing": true, "enable_activation_offloading": false, "compile": false, "gradient_accumulation_steps": 8}, "result": {"success": true, "peak_memory_gb": 23.1, "samples_per_sec": 5.2, "failure_reason": null, "duration_sec": 120.5}, "gpu_type": "NVIDIA A100-SXM4-80GB"}"#;
    let mut text = String::new();
    for k in 1..=5 {
        text.push_str(&good.replace("\"batch_size\": 4", &format!("\"batch_size\": {k}")));
        text.push('\n');
    }
    text.push_str("not json at all\n");
    text.push_str(&good.replace("\"batch_size\": 4", "\"batch_size\": 0"));
    text.push('\n');
    text.push_str(&good.replace("23.1", "-1"));
    text.push('\n');
    text.push_str(&good[..80]);
    std::fs::write(&src, text).unwrap();

    let v = json(
        gpufit(&db)
            .args(["-o", "json", "history", "import"])
            .arg(&src)
            .output()
            .unwrap(),
    );
    assert_eq!(v["imported"], 5);
    assert_eq!(v["skipped"], 4);
    assert_eq!(v["lines"], 9);
    assert_eq!(v["total_in_store"], 5);

    let table = ok(gpufit(&db)
        .args(["history", "import"])
        .arg(&src)
        .output()
        .unwrap());
    assert!(
        table.contains("imported 5 run(s)") && table.contains("skipped 4 of 9"),
        "{table}"
    );
    // From standard input (`-`): the same counts, and the same identities.
    let mut child = gpufit(&db)
        .args(["-o", "json", "history", "import", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&std::fs::read(&src).unwrap()).unwrap();
    }
    let piped = json(child.wait_with_output().unwrap());
    assert_eq!(piped["imported"], 5, "{piped}");
    assert_eq!(piped["skipped"], 4, "{piped}");
    assert_eq!(piped["file"], "-", "{piped}");
    assert_eq!(piped["total_in_store"], 5, "{piped}");
    // The same file again: every run has the identity it had, so the store
    // still holds each run once.
    let again = json(
        gpufit(&db)
            .args(["-o", "json", "history", "import"])
            .arg(&src)
            .output()
            .unwrap(),
    );
    assert_eq!(again["total_in_store"], 5, "{again}");

    let out = d.path().join("export.jsonl");
    ok(gpufit(&db)
        .args(["history", "export", "--output-file"])
        .arg(&out)
        .output()
        .unwrap());
    let exported = std::fs::read_to_string(&out).unwrap();
    assert_eq!(
        exported.lines().count(),
        5,
        "imported three times, stored once"
    );
    for line in exported.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["result"]["peak_memory_gb"], 23.1, "GB written as read");
        assert!(v["config"]["batch_size"].as_u64().unwrap() >= 1);
    }
    let db2 = d.path().join("h2.db");
    let back = json(
        gpufit(&db2)
            .args(["-o", "json", "history", "import"])
            .arg(&out)
            .output()
            .unwrap(),
    );
    assert_eq!(back["imported"], 5);
    assert_eq!(back["skipped"], 0);
    let a = json(
        gpufit(&db)
            .args(["-o", "json", "history", "list", "--limit", "100"])
            .output()
            .unwrap(),
    );
    let b = json(
        gpufit(&db2)
            .args(["-o", "json", "history", "list", "--limit", "100"])
            .output()
            .unwrap(),
    );
    let strip = |v: &serde_json::Value| {
        let mut v = v.clone();
        for r in v.as_array_mut().unwrap() {
            r.as_object_mut().unwrap().remove("id");
        }
        v
    };
    assert_eq!(strip(&a), strip(&b));
}

#[test]
fn the_history_flag_wins_over_the_environment() {
    let d = tmp();
    let env_db = d.path().join("env.db");
    let flag_db = d.path().join("flag.db");
    ok(gpufit(&env_db)
        .args([
            "record",
            "--model",
            "m",
            "--seq-len",
            "512",
            "--gpu",
            "NVIDIA A100-SXM4-80GB",
            "--micro-batch",
            "1",
            "--history",
        ])
        .arg(format!("sqlite:{}", flag_db.display()))
        .output()
        .unwrap());
    let in_flag = json(
        gpufit(&env_db)
            .args(["-o", "json", "history", "list", "--history"])
            .arg(format!("sqlite:{}", flag_db.display()))
            .output()
            .unwrap(),
    );
    assert_eq!(in_flag.as_array().unwrap().len(), 1);
    let in_env = json(
        gpufit(&env_db)
            .args(["-o", "json", "history", "list"])
            .output()
            .unwrap(),
    );
    assert!(in_env.as_array().unwrap().is_empty());
}

#[test]
fn a_corrupt_history_file_exits_4_and_is_left_untouched() {
    let d = tmp();
    let db = d.path().join("h.db");
    std::fs::write(&db, b"this is a text file, not a database\n".repeat(200)).unwrap();
    let before = std::fs::read(&db).unwrap();
    let out = gpufit(&db).args(["history", "list"]).output().unwrap();
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("left untouched"), "{err}");
    assert_eq!(std::fs::read(&db).unwrap(), before);
}

#[test]
fn a_locked_history_exits_4_and_keeps_earlier_runs() {
    let d = tmp();
    let db = d.path().join("h.db");
    let args = [
        "record",
        "--model",
        "m",
        "--seq-len",
        "512",
        "--gpu",
        "NVIDIA A100-SXM4-80GB",
        "--micro-batch",
        "1",
    ];
    ok(gpufit(&db).args(args).output().unwrap());
    let holder = rusqlite::Connection::open(&db).unwrap();
    holder.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let out = gpufit(&db)
        .env("GPUFIT_HISTORY_BUSY_TIMEOUT_MS", "300")
        .args(args)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("locked"));
    holder.execute_batch("ROLLBACK").unwrap();
    drop(holder);
    let v = json(
        gpufit(&db)
            .args(["-o", "json", "history", "list"])
            .output()
            .unwrap(),
    );
    assert_eq!(v.as_array().unwrap().len(), 1);
}

/// A shared history the job's user may read but not write (what
/// docs/slurm.md recommends): reads work, a write is refused clearly and
/// nothing changes. Runs gpufit as `nobody` (the tests run as root, which
/// file permissions do not stop).
#[test]
fn a_read_only_shared_history_is_read_by_other_users_and_never_written() {
    use std::os::unix::fs::PermissionsExt;
    let d = tmp();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = d.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    let db = shared.join("history.db");
    let rec = [
        "record",
        "--model",
        "meta-llama/Llama-3.1-8B",
        "--method",
        "lora",
        "--lora-rank",
        "16",
        "--seq-len",
        "2048",
        "--gpu",
        "NVIDIA A100-SXM4-80GB",
        "--micro-batch",
        "4",
        "--success",
        "true",
        "--peak-gb",
        "40",
    ];
    ok(gpufit(&db).args(rec).output().unwrap());
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    let before = std::fs::read(&db).unwrap();
    let as_nobody = |args: &[&str]| {
        let mut c = Command::new("runuser");
        c.args(["-u", "nobody", "--", env!("CARGO_BIN_EXE_gpufit")])
            .args(args)
            .env("GPUFIT_HISTORY", format!("sqlite:{}", db.display()))
            .env("HOME", d.path());
        c.output().expect("runuser")
    };
    let list = as_nobody(&["-o", "json", "history", "list"]);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    let runs: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(runs.as_array().map(Vec::len), Some(1));
    let sug = as_nobody(&[
        "-o",
        "json",
        "suggest",
        "--model",
        "meta-llama/Llama-3.1-8B",
        "--method",
        "lora",
        "--lora-rank",
        "16",
        "--seq-len",
        "2048",
        "--gpu",
        "NVIDIA A100-SXM4-80GB",
    ]);
    assert!(
        sug.status.success(),
        "{}",
        String::from_utf8_lossy(&sug.stderr)
    );
    let s: serde_json::Value = serde_json::from_slice(&sug.stdout).unwrap();
    assert_ne!(s["source"], "heuristic", "the shared history was read: {s}");
    let write = as_nobody(&rec);
    assert!(!write.status.success());
    let err = String::from_utf8_lossy(&write.stderr);
    assert!(err.contains("read-only"), "{err}");
    assert_eq!(std::fs::read(&db).unwrap(), before, "nothing written");
}

/// A multi-node job's record says how many nodes it covers; a partial one
/// (a node never reported, or reported without a peak) says so in
/// `history list` (and which node lacks its peak), and `report` leaves
/// its peak (a lower bound) out of the unused memory and the prediction
/// error.
#[test]
fn partial_multi_node_records_are_shown_as_partial_by_list_and_report() {
    use gpufit::core::run::{NodeReports, RunRecord};
    use gpufit::history::HistoryStore;
    let d = tmp();
    let db = d.path().join("h.db");
    let store = gpufit::history::sqlite::SqliteStore::open(&db).unwrap();
    let report = |job: &str, node: &str, peak_gib: u64| -> RunRecord {
        let mut r: RunRecord = serde_json::from_value(serde_json::json!({
            "id": null, "timestamp": chrono::Utc::now(), "cluster": "c1", "node": node,
            "source": "slurm", "job_id": job, "model": "meta-llama/Llama-3.1-8B",
            "method": "lora", "gpu_model": "NVIDIA A100-SXM4-80GB", "seq_len": 2048,
            "lora_rank": 16, "gpus": 2, "global_batch": 64,
            "settings": gpufit::core::settings::EngineeringSettings::default(),
            "result": {"success": true, "failure_reason": null,
                       "peak_memory_bytes": peak_gib << 30, "samples_per_sec": null,
                       "tokens_per_sec": null, "duration_sec": 3600.0},
            "predicted_peak_bytes": 40u64 << 30
        }))
        .unwrap();
        r.nodes = Some(NodeReports {
            reported: 1,
            expected: 2,
            without_peak: Vec::new(),
        });
        r
    };
    store.record_node_report(&report("1", "n1", 30)).unwrap();
    store.record_node_report(&report("1", "n2", 50)).unwrap();
    store.record_node_report(&report("2", "n1", 20)).unwrap();
    // Job 3: both nodes reported, n2 without a peak (its sidecar was not
    // readable): 2/2 nodes, but the peak is n1's only.
    store.record_node_report(&report("3", "n1", 25)).unwrap();
    let mut peakless = report("3", "n2", 0);
    peakless.result.peak_memory_bytes = None;
    store.record_node_report(&peakless).unwrap();
    drop(store);

    let table = ok(gpufit(&db).args(["history", "list"]).output().unwrap());
    assert!(table.contains("50.00 GiB (2/2 nodes)"), "{table}");
    assert!(table.contains("20.00 GiB (1/2 nodes, partial)"), "{table}");
    assert!(
        table.contains("25.00 GiB (2/2 nodes, peak of 1: n2 without peak, partial)"),
        "{table}"
    );
    assert!(
        !table.contains("25.00 GiB (2/2 nodes)"),
        "never a whole 2/2 for a peak of one node: {table}"
    );
    let runs = json(
        gpufit(&db)
            .args(["-o", "json", "history", "list"])
            .output()
            .unwrap(),
    );
    let partial = runs
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["job_id"] == "2")
        .unwrap();
    assert_eq!(
        partial["nodes"],
        serde_json::json!({"reported": 1, "expected": 2})
    );
    let lacking = runs
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["job_id"] == "3")
        .unwrap();
    assert_eq!(
        lacking["nodes"],
        serde_json::json!({"reported": 2, "expected": 2, "without_peak": ["n2"]})
    );

    let rep = json(
        gpufit(&db)
            .args(["-o", "json", "report", "--since", "all"])
            .output()
            .unwrap(),
    );
    let total = &rep["total"];
    assert_eq!(total["runs"], 3, "{total}");
    // Only job 1's peak is a job's: 2 and 3 hold one node's of two.
    assert_eq!(total["unused_runs_measured"], 1, "{total}");
    assert_eq!(total["unused_runs_unmeasured"], 2, "{total}");
    assert_eq!(total["prediction_error"]["runs"], 1, "{total}");
    let text = ok(gpufit(&db)
        .args(["report", "--since", "all"])
        .output()
        .unwrap());
    assert!(text.contains("partial multi-node"), "{text}");
}

/// `record --failure host-oom`: an other_error flagged as a host-memory
/// kill, as the controller and the Slurm Epilog record one; the next
/// suggestion of the workload lowers the data loader, not the micro batch.
#[test]
fn record_a_host_memory_kill_and_the_next_suggestion_lowers_the_data_loader() {
    let d = tmp();
    let db = d.path().join("h.db");
    let workload = [
        "--model",
        "Qwen/Qwen2.5-0.5B",
        "--method",
        "lora",
        "--lora-rank",
        "16",
        "--seq-len",
        "1024",
        "--gpu",
        "NVIDIA A100-SXM4-80GB",
    ];
    let suggest = |db: &Path| {
        json(
            gpufit(db)
                .args(["-o", "json", "suggest"])
                .args(workload)
                .args(["--cpus-per-gpu", "16"])
                .output()
                .unwrap(),
        )
    };
    let before = suggest(&db);
    let workers_before = before["dataloader"]["num_workers"]
        .as_u64()
        .expect("num_workers");
    assert!(workers_before >= 4, "{before}");
    assert_eq!(before["dataloader"]["pin_memory"], true);

    let rec = json(
        gpufit(&db)
            .args(["-o", "json", "record"])
            .args(workload)
            .args(["--micro-batch", "4", "--failure", "host-oom"])
            .output()
            .unwrap(),
    );
    assert_eq!(rec["result"]["success"], false, "{rec}");
    assert_eq!(rec["result"]["failure_reason"], "other_error", "{rec}");
    assert_eq!(rec["result"]["host_oom"], true, "{rec}");

    let after = suggest(&db);
    let workers_after = after["dataloader"]["num_workers"]
        .as_u64()
        .expect("num_workers");
    assert!(workers_after < workers_before, "{after}");
    assert_eq!(after["dataloader"]["pin_memory"], false, "{after}");
    assert!(
        after["reasoning"]
            .as_str()
            .is_some_and(|r| r.contains("killed for host memory")),
        "{after}"
    );
    // Not a GPU OOM: the micro batch is not lowered for it.
    assert!(
        after["micro_batch_size"].as_u64() >= before["micro_batch_size"].as_u64(),
        "{before}\n{after}"
    );
}
