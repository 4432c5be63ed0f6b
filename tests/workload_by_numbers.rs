//! A model given by its architecture numbers gets the same verdict on
//! every path: the command line (`gpufit estimate` and `gpufit suggest`),
//! the TrainingJob's validation, the webhook's annotations and the JSON
//! request of `POST /v1/suggest` (what the Slurm hooks send). Valid numbers
//! are accepted everywhere; invalid ones are refused everywhere, naming the
//! same field in each path's own spelling (docs/design.md, "Workload
//! resolution"). The numbers are checked once, by the core's resolver.

use std::collections::BTreeMap;
use std::process::Command;

use gpufit::controller::crd::TrainingJobSpec;
use gpufit::controller::validate::validate;
use gpufit::controller::webhook::workload_from_annotations;
use gpufit::core::workload::Workload;
use gpufit::wire::api::SuggestRequest;
use serde_json::{json, Value};

const SEQ_LEN: u32 = 512;
const GPU: &str = "NVIDIA A100-SXM4-80GB";

/// A model by its numbers, in the JSON request's spelling (snake_case);
/// each path below writes it its own way.
struct Numbers(&'static [(&'static str, u64)]);

/// An architecture number: its flag, CRD key, and annotation/JSON key.
struct Field {
    flag: &'static str,
    camel: &'static str,
    snake: &'static str,
}

const FIELDS: [Field; 7] = [
    Field {
        flag: "--params",
        camel: "params",
        snake: "params",
    },
    Field {
        flag: "--hidden-size",
        camel: "hiddenSize",
        snake: "hidden_size",
    },
    Field {
        flag: "--layers",
        camel: "layers",
        snake: "layers",
    },
    Field {
        flag: "--heads",
        camel: "heads",
        snake: "heads",
    },
    Field {
        flag: "--kv-heads",
        camel: "kvHeads",
        snake: "kv_heads",
    },
    Field {
        flag: "--intermediate-size",
        camel: "intermediateSize",
        snake: "intermediate_size",
    },
    Field {
        flag: "--vocab-size",
        camel: "vocabSize",
        snake: "vocab_size",
    },
];

fn field(snake: &str) -> &'static Field {
    FIELDS
        .iter()
        .find(|f| f.snake == snake)
        .unwrap_or_else(|| panic!("no field {snake}"))
}

/// What a path said: accepted, or refused with its message.
type Verdict = Result<(), String>;

impl Numbers {
    fn cli(&self, command: &str) -> Verdict {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut args: Vec<String> = vec![command.into()];
        for (k, v) in self.0 {
            args.push(field(k).flag.into());
            args.push(v.to_string());
        }
        args.extend(["--seq-len".into(), SEQ_LEN.to_string()]);
        args.extend(["--gpu".into(), GPU.into()]);
        if command == "suggest" {
            args.extend([
                "--history".into(),
                format!("sqlite:{}", dir.path().join("h.db").display()),
            ]);
        }
        let out = Command::new(env!("CARGO_BIN_EXE_gpufit"))
            .args(&args)
            .env_remove("GPUFIT_HISTORY")
            .output()
            .expect("run gpufit");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        match out.status.code() {
            Some(0) => Ok(()),
            Some(2) => Err(stderr
                .trim()
                .strip_prefix("error: ")
                .unwrap_or(&stderr)
                .to_string()),
            other => panic!("gpufit {command} {args:?}: exit {other:?}: {stderr}"),
        }
    }

    fn crd_spec(&self) -> TrainingJobSpec {
        let mut arch = serde_json::Map::new();
        arch.insert("name".into(), json!("my-model"));
        for (k, v) in self.0 {
            arch.insert(field(k).camel.into(), json!(v));
        }
        serde_json::from_value(json!({
            "workload": {"architecture": Value::Object(arch), "seqLen": SEQ_LEN},
            "template": {"spec": {"containers": [{"name": "train", "image": "train:1"}]}},
        }))
        .expect("a TrainingJob spec")
    }

    /// The TrainingJob's verdict: its field (a spec path) and message.
    fn crd(&self) -> Result<Workload, (String, String)> {
        validate(&self.crd_spec(), None)
            .map(|v| v.workload)
            .map_err(|e| (e.field, e.message))
    }

    fn webhook(&self) -> Result<Workload, String> {
        let mut numbers = vec!["name=my-model".to_string()];
        numbers.extend(self.0.iter().map(|(k, v)| format!("{k}={v}")));
        let anns: BTreeMap<String, String> = [
            ("gpufit.io/architecture", numbers.join(",")),
            ("gpufit.io/seq-len", SEQ_LEN.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        workload_from_annotations(&anns, 1)?.ok_or_else(|| "not opted in".to_string())
    }

    /// The body of `POST /v1/suggest`, through JSON as the controller reads it.
    fn wire(&self) -> Result<Workload, String> {
        let mut arch = serde_json::Map::new();
        arch.insert("name".into(), json!("my-model"));
        for (k, v) in self.0 {
            arch.insert((*k).into(), json!(v));
        }
        let body = json!({
            "workload": {"architecture": Value::Object(arch), "seq_len": SEQ_LEN},
            "gpu": GPU,
        });
        let req: SuggestRequest =
            serde_json::from_str(&body.to_string()).map_err(|e| e.to_string())?;
        gpufit::service::resolve_workload(&req.workload).map_err(|e| e.to_string())
    }
}

/// `message` names `name` first (the field at fault leads what is wrong).
fn assert_leads(path: &str, message: &str, name: &str) {
    let rest = message
        .strip_prefix(name)
        .unwrap_or_else(|| panic!("{path}: `{message}` does not start with `{name}`"));
    assert!(
        !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_' || c == '-'),
        "{path}: `{message}` names a longer field than `{name}`"
    );
}

fn accepted_everywhere(n: &Numbers) {
    for command in ["estimate", "suggest"] {
        assert_eq!(n.cli(command), Ok(()), "CLI {command}");
    }
    let crd = n.crd().expect("TrainingJob accepts");
    assert_eq!(n.webhook().expect("webhook accepts"), crd, "webhook vs CRD");
    assert_eq!(n.wire().expect("JSON request accepted"), crd, "JSON vs CRD");
}

/// Refused on every path, each naming `snake` (the field at fault) its own way.
fn refused_everywhere(n: &Numbers, snake: &str) {
    let f = field(snake);
    for command in ["estimate", "suggest"] {
        let e = n.cli(command).expect_err("the CLI refuses");
        assert_leads(&format!("CLI {command}"), &e, f.flag);
    }
    let (crd_field, message) = n.crd().expect_err("the TrainingJob is refused");
    assert_eq!(
        crd_field,
        format!("spec.workload.architecture.{}", f.camel),
        "{message}"
    );
    let hook = n.webhook().expect_err("the webhook denies");
    let hook = hook.strip_prefix("gpufit: ").unwrap_or(&hook);
    assert_leads("webhook", hook, &format!("gpufit.io/architecture: {snake}"));
    let wire = n.wire().expect_err("the JSON request is refused");
    assert_leads("JSON", &wire, &format!("workload.architecture.{snake}"));
}

const GPT_SMALL: &[(&str, u64)] = &[
    ("params", 124_000_000),
    ("hidden_size", 768),
    ("layers", 12),
    ("heads", 12),
    ("vocab_size", 50257),
];

#[test]
fn a_plain_model_by_numbers_is_accepted_on_every_path() {
    accepted_everywhere(&Numbers(GPT_SMALL));
}

#[test]
fn grouped_query_attention_with_a_dividing_kv_head_count_is_accepted_everywhere() {
    accepted_everywhere(&Numbers(&[
        ("params", 1_235_814_400),
        ("hidden_size", 2048),
        ("layers", 16),
        ("heads", 32),
        ("kv_heads", 8),
        ("intermediate_size", 8192),
        ("vocab_size", 128_256),
    ]));
}

/// The command line used to accept 5 key/value heads for 32 attention
/// heads (it only checked kv ≤ heads) while the TrainingJob refused them.
#[test]
fn kv_heads_that_do_not_divide_the_heads_are_refused_everywhere() {
    let n = Numbers(&[
        ("params", 124_000_000),
        ("hidden_size", 768),
        ("layers", 12),
        ("heads", 32),
        ("kv_heads", 5),
        ("vocab_size", 50257),
    ]);
    refused_everywhere(&n, "kv_heads");
}

#[test]
fn more_kv_heads_than_heads_are_refused_everywhere() {
    let n = Numbers(&[
        ("params", 124_000_000),
        ("hidden_size", 768),
        ("layers", 12),
        ("heads", 12),
        ("kv_heads", 24),
        ("vocab_size", 50257),
    ]);
    refused_everywhere(&n, "kv_heads");
}

#[test]
fn a_hidden_size_the_heads_do_not_divide_is_refused_everywhere() {
    let n = Numbers(&[
        ("params", 124_000_000),
        ("hidden_size", 1000),
        ("layers", 12),
        ("heads", 12),
        ("vocab_size", 50257),
    ]);
    refused_everywhere(&n, "heads");
}

#[test]
fn zero_sizes_are_refused_everywhere_naming_the_number() {
    for zero in ["layers", "heads", "vocab_size", "hidden_size"] {
        let numbers: Vec<(&'static str, u64)> = GPT_SMALL
            .iter()
            .map(|&(k, v)| (k, if k == zero { 0 } else { v }))
            .collect();
        refused_everywhere(&Numbers(numbers.leak()), zero);
    }
    refused_everywhere(
        &Numbers(&[
            ("params", 124_000_000),
            ("hidden_size", 768),
            ("layers", 12),
            ("heads", 12),
            ("kv_heads", 0),
            ("vocab_size", 50257),
        ]),
        "kv_heads",
    );
}
