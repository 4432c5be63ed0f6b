//! The memory model's per-block activation terms against what autograd
//! really saves.
//!
//! `bench/data/saved_tensors.jsonl` holds, per framework (Hugging Face
//! transformers + PEFT, with bitsandbytes for QLoRA; litgpt; torchtune),
//! family, method, dtype and attention kernel, the bytes one transformer
//! block saves for backward per token, counted on the CPU with
//! `torch.autograd.graph.saved_tensors_hooks` (and the tensors custom
//! Functions keep on their ctx) by
//! `scripts/count_saved.py` (see bench/data/README.md). This bench prints
//! `memory::block_saved_bytes_per_token` beside each count, the error, and
//! the median and worst per framework. Rows marked `"scored": false` say
//! why (a CPU kernel that saves differently from CUDA's); a row's
//! `cpu_mask_elems_per_token_layer` turns the CPU's dropout masks (kept in
//! the input's dtype) into CUDA's 1-byte ones before comparing;
//! every other row must agree within 1 %, or the bench fails — the test
//! suite runs it (`scripts/test.sh`).
//!
//! Run: `cargo bench --bench saved_tensors` (or `cargo test --bench
//! saved_tensors` for a debug build).

#[path = "common/model_config.rs"]
mod model_config;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use gpufit::cli::common::parse_lora_targets;
use gpufit::core::catalog::arch_from_hf_config;
use gpufit::core::memory::block_saved_bytes_per_token;
use gpufit::core::settings::{Dtype, EngineeringSettings};
use gpufit::core::workload::{
    Attention, Framework, LoraConfig, LoraTarget, Method, ModelArch, Optimizer, Sharding, Workload,
};
use serde_json::Value;

fn arch(row: &Value) -> Result<ModelArch, String> {
    if let Some(cfg) = row.get("config") {
        let name = row["model"].as_str().unwrap_or("model");
        return arch_from_hf_config(name, &cfg.to_string()).map_err(|e| e.to_string());
    }
    let id = row["hf_model"]
        .as_str()
        .ok_or("a row needs `config` or `hf_model`")?;
    model_config::model(id)
}

fn scenario(row: &Value) -> Result<(Workload, EngineeringSettings), String> {
    let s = |k: &str| {
        row[k]
            .as_str()
            .ok_or_else(|| format!("`{k}` missing in {row}"))
    };
    let framework: Framework = s("framework")?.parse()?;
    let method: Method = s("method")?.parse()?;
    let dtype: Dtype = s("dtype")?.parse()?;
    let w = Workload {
        model: arch(row)?,
        method,
        // the script adapts q and v (the fused qkv projection where the
        // family has one), rank 8, unless the row names its targets
        lora: if method == Method::Full {
            None
        } else {
            Some(LoraConfig {
                rank: 8,
                targets: match row["lora_targets"].as_str() {
                    Some(t) => parse_lora_targets(t).map_err(|e| e.to_string())?,
                    None => vec![LoraTarget::Q, LoraTarget::V],
                },
            })
        },
        seq_len: row["seq_len"].as_u64().ok_or("`seq_len` missing")? as u32,
        optimizer: Optimizer::Adamw,
        global_batch: None,
        gpus: 1,
        sharding: Sharding::None,
        framework,
        attention: if s("attention")? == "eager" {
            Attention::Eager
        } else {
            Attention::Sdpa
        },
    };
    let settings = EngineeringSettings {
        micro_batch_size: 1,
        dtype,
        ..EngineeringSettings::default()
    };
    Ok((w, settings))
}

fn main() -> ExitCode {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/data");
    let path = root.join("saved_tensors.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("saved_tensors: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    println!(
        "{:<8} {:<24} {:<5} {:<5} {:<6} {:>12} {:>12} {:>8}",
        "fw", "model", "meth", "dtype", "attn", "counted B", "model B", "error"
    );
    let mut by_fw: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut off = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let row: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("saved_tensors: line {}: {e}", n + 1);
                return ExitCode::FAILURE;
            }
        };
        let (w, s) = match scenario(&row) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("saved_tensors: line {}: {e}", n + 1);
                return ExitCode::FAILURE;
            }
        };
        // The CPU's dropout keeps its mask in the input's dtype, CUDA's in
        // one byte: rows that say how many mask elements a block keeps per
        // token are compared as CUDA would keep them.
        let mask = row["cpu_mask_elems_per_token_layer"]
            .as_f64()
            .unwrap_or(0.0);
        let mask_bytes = match row["dtype"].as_str() {
            Some("fp32") => 4.0,
            _ => 2.0,
        };
        let counted =
            row["bytes_per_token_layer"].as_f64().unwrap_or(f64::NAN) - mask * (mask_bytes - 1.0);
        let model = block_saved_bytes_per_token(&w, &s);
        let err = (model - counted) / counted;
        let scored = row["scored"].as_bool().unwrap_or(true);
        // rows that adapt more than q and v say so after the model
        let name = match row["lora_targets"].as_str() {
            Some(t) => format!("{} [{t}]", row["model"].as_str().unwrap_or("")),
            None => row["model"].as_str().unwrap_or("").to_string(),
        };
        println!(
            "{:<8} {:<24} {:<5} {:<5} {:<6} {:>12.0} {:>12.0} {:>+7.1}%{}",
            w.framework,
            name,
            w.method,
            s.dtype,
            if w.attention == Attention::Eager {
                "eager"
            } else {
                "sdpa"
            },
            counted,
            model,
            100.0 * err,
            if scored {
                ""
            } else {
                "  (not scored: see `why`)"
            }
        );
        let key = if scored {
            format!("{} scored", w.framework)
        } else {
            format!("{} not scored", w.framework)
        };
        by_fw.entry(key).or_default().push(err);
        if scored && err.abs() > MAX_ERROR {
            off.push(format!(
                "{} {} {} {} {}: {:+.1}%",
                w.framework,
                name,
                w.method,
                s.dtype,
                row["attention"].as_str().unwrap_or(""),
                100.0 * err
            ));
        }
    }
    println!();
    for (fw, errs) in &by_fw {
        let mut a: Vec<f64> = errs.iter().map(|e| e.abs()).collect();
        a.sort_by(|x, y| x.total_cmp(y));
        let under = errs.iter().copied().fold(0.0f64, f64::min);
        println!(
            "{fw:<18} n={:>3}  median {:>5.1}%  worst {:>5.1}%  deepest under {:>+6.1}%",
            a.len(),
            100.0 * a[a.len() / 2],
            100.0 * a[a.len() - 1],
            100.0 * under
        );
    }
    if off.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "saved_tensors: the model's block terms are more than {:.0} % off the count for: {}",
            100.0 * MAX_ERROR,
            off.join("; ")
        );
        ExitCode::FAILURE
    }
}

/// A scored row's largest allowed error: the counts are exact byte sums,
/// so anything beyond rounding is a term the model gets wrong.
const MAX_ERROR: f64 = 0.01;
