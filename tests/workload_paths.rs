//! One workload, four front doors: the command line, the TrainingJob CRD,
//! the webhook annotations and the Slurm hooks (through the controller's
//! JSON API) resolve the same input to the same `Workload` and the same
//! suggestion — aliases, defaults and refusals included (docs/design.md,
//! "Workload resolution").

use std::collections::BTreeMap;

use clap::Parser;
use gpufit::cli::common::WorkloadArgs;
use gpufit::controller::crd::WorkloadSpec as CrdWorkload;
use gpufit::controller::validate::workload_from_spec;
use gpufit::controller::webhook::workload_from_annotations;
use gpufit::core::advisor::{self, AdviceRequest, Strategy, StrategyTargets, Suggestion};
use gpufit::core::catalog::lookup_gpu;
use gpufit::core::memory::default_lora_targets;
use gpufit::core::settings::Pins;
use gpufit::core::workload::{Framework, Method, Optimizer, Sharding, Workload};
use gpufit::slurm::plan::{plan_task_prolog, Env, TaskPlan};
use gpufit::wire::api::{GpuRef, SuggestRequest};
use serde_json::json;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    w: WorkloadArgs,
}

/// The input, as a user of each path writes it: (key, value) in the Slurm
/// spelling; each path below turns it into its own form.
struct Input(&'static [(&'static str, &'static str)]);

impl Input {
    fn cli(&self) -> Result<Workload, String> {
        let mut argv = vec!["t".to_string()];
        for (k, v) in self.0 {
            argv.push(format!("--{}", k.replace('_', "-")));
            argv.push(v.to_string());
        }
        let args = Cli::try_parse_from(argv).map_err(|e| e.to_string())?.w;
        args.resolve().map_err(|e| e.to_string())
    }

    fn crd(&self) -> Result<Workload, String> {
        let mut v = serde_json::Map::new();
        for (k, val) in self.0 {
            let camel = match *k {
                "seq_len" => "seqLen",
                "lora_rank" => "loraRank",
                "lora_targets" => "loraTargets",
                "global_batch" => "globalBatch",
                "zero" => "sharding",
                other => other,
            };
            let value = match *k {
                "seq_len" | "lora_rank" | "global_batch" | "gpus" => {
                    json!(val.parse::<u64>().expect("number"))
                }
                "lora_targets" => json!(val.split(',').collect::<Vec<_>>()),
                _ => json!(val),
            };
            v.insert(camel.to_string(), value);
        }
        let spec: CrdWorkload =
            serde_json::from_value(serde_json::Value::Object(v)).map_err(|e| e.to_string())?;
        workload_from_spec(&spec, "spec.workload").map_err(|e| e.to_string())
    }

    fn webhook(&self) -> Result<Workload, String> {
        let anns: BTreeMap<String, String> = self
            .0
            .iter()
            .map(|(k, v)| {
                let key = match *k {
                    "zero" => "sharding".to_string(),
                    other => other.replace('_', "-"),
                };
                (format!("gpufit.io/{key}"), v.to_string())
            })
            .collect();
        workload_from_annotations(&anns, 1)?.ok_or_else(|| "untouched".to_string())
    }

    /// The TaskProlog's request, as it travels to the controller.
    fn slurm_request(&self) -> Result<SuggestRequest, String> {
        let mut env: Env = self
            .0
            .iter()
            .map(|(k, v)| (format!("GPUFIT_{}", k.to_ascii_uppercase()), v.to_string()))
            .collect();
        env.insert("SLURM_JOB_ID".into(), "7".into());
        let req =
            match plan_task_prolog(&env, Strategy::Balanced, None).map_err(|e| e.to_string())? {
                TaskPlan::Ask(r) => r,
                TaskPlan::Skip { reason } => return Err(reason),
            };
        // Over the wire and back: what the controller's API reads.
        let sent = SuggestRequest {
            workload: req.workload,
            gpu: GpuRef::Name(GPU.into()),
            strategy: Some(req.strategy),
            pins: req.pins,
            cpus_per_gpu: req.cpus_per_gpu,
        };
        serde_json::from_str(&serde_json::to_string(&sent).unwrap()).map_err(|e| e.to_string())
    }

    fn slurm(&self) -> Result<Workload, String> {
        gpufit::service::resolve_workload(&self.slurm_request()?.workload)
            .map_err(|e| e.to_string())
    }
}

const GPU: &str = "NVIDIA A100-SXM4-80GB";

fn suggest(w: &Workload) -> Suggestion {
    let gpu = lookup_gpu(GPU).expect("catalog GPU");
    advisor::suggest(&AdviceRequest {
        workload: w,
        gpu: &gpu,
        strategy: Strategy::Balanced,
        targets: StrategyTargets::default(),
        pins: &Pins::default(),
        history: &[],
    })
    .expect("a suggestion")
}

fn same_everywhere(input: &Input) -> Workload {
    let cli = input.cli().expect("CLI");
    assert_eq!(input.crd().expect("CRD"), cli, "CRD vs CLI");
    assert_eq!(input.webhook().expect("webhook"), cli, "webhook vs CLI");
    assert_eq!(input.slurm().expect("Slurm"), cli, "Slurm vs CLI");
    cli
}

#[test]
fn a_lora_job_with_aliases_and_defaults_resolves_the_same_on_every_path() {
    let input = Input(&[
        ("model", "meta-llama/Llama-3.1-8B"),
        ("method", "lora"),
        ("seq_len", "2048"),
        ("framework", "tune"),
        ("optimizer", "paged_adamw_8bit"),
        ("global_batch", "32"),
        ("gpus", "2"),
        ("zero", "3"),
    ]);
    let w = same_everywhere(&input);
    assert_eq!(w.framework, Framework::Torchtune);
    assert_eq!(w.optimizer, Optimizer::Adamw8bit);
    assert_eq!(w.sharding, Sharding::Zero3);
    let lora = w.lora.clone().expect("LoRA");
    assert_eq!(lora.rank, 8, "one default rank");
    assert_eq!(lora.targets, default_lora_targets(Framework::Torchtune));

    // The same suggestion: from the resolved workload on each path, and
    // through the controller's API code the Slurm hooks use.
    let s = suggest(&w);
    for other in [input.crd(), input.webhook(), input.slurm()] {
        assert_eq!(suggest(&other.unwrap()), s);
    }
    let dir = tempfile::tempdir().unwrap();
    let store = gpufit::history::open(&format!("sqlite:{}/h.db", dir.path().display())).unwrap();
    let via_api = gpufit::service::suggest_blocking(
        store.as_ref(),
        StrategyTargets::default(),
        &input.slurm_request().unwrap(),
    )
    .expect("API suggestion");
    assert_eq!(via_api, s);
}

#[test]
fn lightning_and_explicit_targets_resolve_the_same_on_every_path() {
    let w = same_everywhere(&Input(&[
        ("model", "llama-3.1-8b"),
        ("method", "qlora"),
        ("lora_rank", "32"),
        ("lora_targets", "q_proj,v_proj,output_proj"),
        ("seq_len", "4096"),
        ("framework", "pl"),
        ("attention", "flash_attention_2"),
    ]));
    assert_eq!(w.method, Method::Qlora);
    assert_eq!(w.framework, Framework::Lightning);
    assert_eq!(w.lora.unwrap().rank, 32);
}

#[test]
fn a_full_fine_tune_with_a_lora_rank_is_refused_on_every_path() {
    let input = Input(&[
        ("model", "meta-llama/Llama-3.1-8B"),
        ("method", "full"),
        ("lora_rank", "16"),
        ("seq_len", "2048"),
    ]);
    let cli = input.cli().expect_err("CLI refuses");
    assert!(cli.contains("--lora-rank"), "{cli}");
    let crd = input.crd().expect_err("CRD refuses");
    assert!(crd.contains("spec.workload.loraRank"), "{crd}");
    let hook = input.webhook().expect_err("webhook refuses");
    assert!(hook.contains("gpufit.io/lora-rank"), "{hook}");
    let slurm = input.slurm().expect_err("Slurm API refuses");
    assert!(slurm.contains("workload.lora_rank"), "{slurm}");
}
