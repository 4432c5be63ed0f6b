//! `gpufit apply` on real files: links, modes, backups, framework checks.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

#[path = "common/cli.rs"]
mod cli;
use cli::{args, text, Env, A100, MODEL};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

const TORCHTUNE: &str = "\
model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_rank: 8
batch_size: 1
gradient_accumulation_steps: 32
dtype: bf16
enable_activation_checkpointing: False
compile: False
";

const HF: &str = "\
output_dir: out
per_device_train_batch_size: 1
gradient_accumulation_steps: 32
learning_rate: 2.0e-5
";

/// A suggestion file (micro batch `m`) for `--suggestion`, from the advisor.
fn suggestion(dir: &Path, m: u32) -> String {
    let o = Command::new(BIN)
        .args([
            "suggest",
            "--model",
            "meta-llama/Llama-3.1-8B",
            "--method",
            "lora",
            "--lora-rank",
            "8",
            "--seq-len",
            "2048",
            "--gpu",
            "NVIDIA A100-SXM4-80GB",
            "--history",
        ])
        .arg(format!("sqlite:{}/h.db", dir.display()))
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["micro_batch_size"] = m.into();
    v["gradient_accumulation_steps"] = 1.into();
    let p = dir.join(format!("s{m}.json"));
    std::fs::write(&p, v.to_string()).unwrap();
    p.display().to_string()
}

fn apply(config: &Path, suggestion: &str, extra: &[&str]) -> Output {
    Command::new(BIN)
        .arg("apply")
        .arg("--config")
        .arg(config)
        .args(["--suggestion", suggestion])
        .args(extra)
        .env_remove("GPUFIT_FRAMEWORK")
        .output()
        .unwrap()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_symlinked_config_is_written_through_the_link() {
    let dir = tempfile::tempdir().unwrap();
    let s = suggestion(dir.path(), 4);
    let target = dir.path().join("real.yaml");
    std::fs::write(&target, TORCHTUNE).unwrap();
    let link = dir.path().join("config.yaml");
    std::os::unix::fs::symlink("real.yaml", &link).unwrap();
    ok(&apply(&link, &s, &[]));
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the link is kept"
    );
    let text = std::fs::read_to_string(&target).unwrap();
    assert!(
        text.contains("batch_size: 4\n"),
        "the target is updated: {text}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("config.yaml.bak")).unwrap(),
        TORCHTUNE
    );
}

#[test]
fn the_file_mode_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let s = suggestion(dir.path(), 4);
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, TORCHTUNE).unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
    ok(&apply(&config, &s, &[]));
    let mode = std::fs::metadata(&config).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "mode {mode:o}");
    assert!(std::fs::read_to_string(&config)
        .unwrap()
        .contains("batch_size: 4\n"));
}

#[test]
fn every_earlier_backup_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, TORCHTUNE).unwrap();
    for m in [2, 3, 5] {
        ok(&apply(&config, &suggestion(dir.path(), m), &[]));
    }
    let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap();
    assert_eq!(read("config.yaml.bak"), TORCHTUNE, "the original");
    assert!(read("config.yaml.bak.1").contains("batch_size: 2\n"));
    assert!(read("config.yaml.bak.2").contains("batch_size: 3\n"));
    assert!(read("config.yaml").contains("batch_size: 5\n"));
    assert!(!dir.path().join("config.yaml.bak.3").exists());
}

#[test]
fn crlf_line_endings_are_kept_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let s = suggestion(dir.path(), 4);
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, TORCHTUNE.replace('\n', "\r\n")).unwrap();
    ok(&apply(&config, &s, &[]));
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("batch_size: 4\r\n"), "{text:?}");
    assert_eq!(
        text.matches('\n').count(),
        text.matches("\r\n").count(),
        "{text:?}"
    );
}

#[test]
fn the_framework_is_read_from_the_file_and_a_mismatch_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = suggestion(dir.path(), 4);
    // No --framework: told from the keys.
    let hf = dir.path().join("hf.yaml");
    std::fs::write(&hf, HF).unwrap();
    ok(&apply(&hf, &s, &[]));
    let text = std::fs::read_to_string(&hf).unwrap();
    assert!(text.contains("per_device_train_batch_size: 4\n"), "{text}");
    assert!(!text.contains("enable_activation_checkpointing"), "{text}");

    // A torchtune --framework on the HF file: exit 2, file untouched.
    let hf2 = dir.path().join("hf2.yaml");
    std::fs::write(&hf2, HF).unwrap();
    let o = apply(&hf2, &s, &["--framework", "torchtune"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("hf config"), "{err}");
    assert_eq!(std::fs::read_to_string(&hf2).unwrap(), HF);
    assert!(!dir.path().join("hf2.yaml.bak").exists());
}

#[test]
fn apply_writes_the_settings_and_keeps_a_backup() {
    let env = Env::new();
    let cfg = env.path("lora.yaml");
    let original = "\
# torchtune LoRA config
model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_rank: 16
optimizer:
  lr: 3e-4
batch_size: 2
gradient_accumulation_steps: 1
dtype: bf16
enable_activation_checkpointing: True
seed: 1234
";
    std::fs::write(&cfg, original).unwrap();
    let s = env.json(
        &args(
            &["suggest"],
            &args(
                MODEL,
                &["--gpu", A100, "--global-batch", "64", "-o", "json"],
            ),
        ),
        &[],
    );
    let sug = env.path("s.json");
    std::fs::write(&sug, s.to_string()).unwrap();
    let out = env.run(
        &[
            "apply",
            "--config",
            cfg.to_str().unwrap(),
            "--framework",
            "torchtune",
            "--suggestion",
            sug.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let bak = std::fs::read_to_string(env.path("lora.yaml.bak")).unwrap();
    assert_eq!(bak, original);
    let new: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    assert_eq!(new["batch_size"].as_u64(), s["micro_batch_size"].as_u64());
    assert_eq!(
        new["gradient_accumulation_steps"].as_u64(),
        s["gradient_accumulation_steps"].as_u64()
    );
    assert_eq!(new["model"]["lora_rank"].as_u64(), Some(16));
    assert_eq!(new["seed"].as_u64(), Some(1234));
    assert!(std::fs::read_to_string(&cfg)
        .unwrap()
        .starts_with("# torchtune LoRA config"));
}
