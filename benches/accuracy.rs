//! Accuracy of the memory model against measured peaks.
//!
//! Reads `bench/data/published_peaks.csv` (published measurements, each
//! row saying which quantity it is: allocated, reserved or device memory,
//! and in which unit) and, when present, `bench/data/gpu_measured.csv`
//! (written by `scripts/gpu_measure.py` on a real GPU, three quantities per
//! point). Prints predicted vs measured per row, then the median and worst
//! relative error over the rows marked `include=yes`; excluded rows are
//! shown with their reason and not counted.
//!
//! Run: `cargo bench --bench accuracy`

use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;

use gpufit::cli::common::{parse_framework, parse_lora_targets, parse_optimizer};
use gpufit::core::catalog::lookup_model;
use gpufit::core::memory::{estimate_with, BaseQuant, Estimate, Head, ModelOptions, OptimizerImpl};
use gpufit::core::settings::{Dtype, EngineeringSettings};
use gpufit::core::units::{GB, GIB, MIB};
use gpufit::core::workload::{Attention, LoraConfig, Method, Sharding, Workload};

/// Targets from issue 2.
const MEDIAN_TARGET: f64 = 0.10;
const WORST_TARGET: f64 = 0.30;

struct Row {
    id: String,
    quantity: String,
    measured_bytes: f64,
    predicted_bytes: f64,
    include: bool,
    note: String,
}

fn main() -> ExitCode {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut rows = Vec::new();
    match read_published(&root.join("bench/data/published_peaks.csv")) {
        Ok(mut r) => rows.append(&mut r),
        Err(e) => {
            eprintln!("accuracy: {e}");
            return ExitCode::FAILURE;
        }
    }
    let measured = root.join("bench/data/gpu_measured.csv");
    if measured.exists() {
        match read_gpu_measured(&measured) {
            Ok(mut r) => rows.append(&mut r),
            Err(e) => {
                eprintln!("accuracy: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        println!("(no bench/data/gpu_measured.csv: run scripts/gpu_measure.py on a GPU machine to add real-GPU points)\n");
    }

    println!(
        "{:<36} {:>9} {:>11} {:>11} {:>8}  note",
        "row", "quantity", "measured", "predicted", "error"
    );
    let mut errors = Vec::new();
    for r in &rows {
        let err = (r.predicted_bytes - r.measured_bytes) / r.measured_bytes;
        println!(
            "{:<36} {:>9} {:>7.2} GiB {:>7.2} GiB {:>+7.1}%  {}",
            r.id,
            r.quantity,
            r.measured_bytes / GIB as f64,
            r.predicted_bytes / GIB as f64,
            100.0 * err,
            if r.include { "" } else { &r.note }
        );
        if r.include {
            errors.push(err.abs());
        }
    }
    if errors.is_empty() {
        eprintln!("accuracy: no rows to score");
        return ExitCode::FAILURE;
    }
    errors.sort_by(|a, b| a.total_cmp(b));
    let n = errors.len();
    let median = if n % 2 == 1 {
        errors[n / 2]
    } else {
        (errors[n / 2 - 1] + errors[n / 2]) / 2.0
    };
    let worst = errors[n - 1];
    let excluded = rows.len() - n;
    println!(
        "\nscored rows: {n} (excluded: {excluded})\nmedian relative error: {:.1}% (target ≤ {:.0}%)\nworst relative error:  {:.1}% (target ≤ {:.0}%)",
        100.0 * median,
        100.0 * MEDIAN_TARGET,
        100.0 * worst,
        100.0 * WORST_TARGET
    );
    if median <= MEDIAN_TARGET && worst <= WORST_TARGET {
        println!("targets met");
        ExitCode::SUCCESS
    } else {
        println!("targets NOT met");
        ExitCode::FAILURE
    }
}

/// A tiny CSV reader for our own files: a header, comma-separated fields,
/// no quoting (lists inside a field use `;`).
fn read_csv(path: &Path) -> Result<Vec<HashMap<String, String>>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<String> = lines
        .next()
        .ok_or_else(|| format!("{} is empty", path.display()))?
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let mut out = Vec::new();
    for (n, line) in lines.enumerate() {
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != header.len() {
            return Err(format!(
                "{} line {}: {} fields, header has {}",
                path.display(),
                n + 2,
                fields.len(),
                header.len()
            ));
        }
        out.push(
            header
                .iter()
                .cloned()
                .zip(fields.iter().map(|f| f.trim().to_string()))
                .collect(),
        );
    }
    Ok(out)
}

fn field<'a>(r: &'a HashMap<String, String>, k: &str) -> Result<&'a str, String> {
    r.get(k)
        .map(String::as_str)
        .ok_or_else(|| format!("missing column `{k}`"))
}

fn num<T: std::str::FromStr>(r: &HashMap<String, String>, k: &str) -> Result<T, String> {
    let v = field(r, k)?;
    v.parse()
        .map_err(|_| format!("column `{k}`: cannot parse `{v}`"))
}

/// Builds the workload, settings and options a row describes.
fn scenario(
    r: &HashMap<String, String>,
) -> Result<(Workload, EngineeringSettings, ModelOptions), String> {
    let m = lookup_model(field(r, "model")?).map_err(|e| e.to_string())?;
    let method: Method = field(r, "method")?.parse()?;
    let framework = parse_framework(field(r, "framework")?).map_err(|e| e.to_string())?;
    let lora = if method == Method::Full {
        None
    } else {
        Some(LoraConfig {
            rank: num(r, "lora_rank")?,
            targets: parse_lora_targets(&field(r, "lora_targets")?.replace(';', ","))
                .map_err(|e| e.to_string())?,
        })
    };
    let w = Workload {
        model: m.arch,
        method,
        lora,
        seq_len: num(r, "seq_len")?,
        optimizer: parse_optimizer(field(r, "optimizer")?).map_err(|e| e.to_string())?,
        global_batch: None,
        gpus: num(r, "gpus")?,
        sharding: Sharding::None,
        framework,
        attention: if field(r, "attention")? == "eager" {
            Attention::Eager
        } else {
            Attention::Sdpa
        },
    };
    let dtype: Dtype = field(r, "dtype")?.parse()?;
    let s = EngineeringSettings {
        micro_batch_size: num(r, "micro_batch")?,
        gradient_accumulation_steps: num(r, "grad_accum")?,
        dtype,
        activation_checkpointing: field(r, "checkpointing")? == "on",
        ..Default::default()
    };
    let base_quant = match field(r, "base_quant")? {
        "" | "none" => None,
        "nf4" => Some(BaseQuant::Nf4),
        "nf4-no-dq" => Some(BaseQuant::Nf4NoDoubleQuant),
        "int8" => Some(BaseQuant::Int8),
        other => return Err(format!("unknown base_quant `{other}`")),
    };
    let optimizer_impl = match field(r, "optimizer_impl")? {
        "" => None,
        "foreach" => Some(OptimizerImpl::Foreach),
        "fused" => Some(OptimizerImpl::Fused),
        "per-parameter" => Some(OptimizerImpl::PerParameter),
        other => return Err(format!("unknown optimizer_impl `{other}`")),
    };
    let ctx = field(r, "cuda_context_mib")?;
    let o = ModelOptions {
        base_quant,
        head: if field(r, "head")? == "classifier" {
            Head::Classifier
        } else {
            Head::LanguageModel
        },
        optimizer_impl,
        grads_kept_between_steps: field(r, "grads_kept")? == "true",
        cuda_context_bytes: if ctx.is_empty() {
            None
        } else {
            Some(
                ctx.parse::<u64>()
                    .map_err(|_| format!("bad cuda_context_mib `{ctx}`"))?
                    * MIB,
            )
        },
    };
    Ok((w, s, o))
}

fn quantity_of(e: &Estimate, q: &str) -> Result<f64, String> {
    Ok(match q {
        "allocated" => e.peak_allocated_bytes,
        "reserved" => e.peak_reserved_bytes,
        "device" => e.device_bytes,
        other => return Err(format!("unknown quantity `{other}`")),
    } as f64)
}

fn unit_bytes(u: &str) -> Result<f64, String> {
    Ok(match u {
        "GB" => GB as f64,
        "GiB" => GIB as f64,
        "MiB" => MIB as f64,
        "MB" => 1e6,
        "B" => 1.0,
        other => return Err(format!("unknown unit `{other}`")),
    })
}

fn read_published(path: &Path) -> Result<Vec<Row>, String> {
    let mut out = Vec::new();
    for r in read_csv(path)? {
        let id = field(&r, "id")?.to_string();
        let (w, s, o) = scenario(&r).map_err(|e| format!("row {id}: {e}"))?;
        let est = estimate_with(&w, &s, &o).map_err(|e| format!("row {id}: {e}"))?;
        let q = field(&r, "quantity")?.to_string();
        out.push(Row {
            predicted_bytes: quantity_of(&est, &q)?,
            measured_bytes: num::<f64>(&r, "peak")? * unit_bytes(field(&r, "unit")?)?,
            quantity: q,
            include: field(&r, "include")? == "yes",
            note: field(&r, "note")?.to_string(),
            id,
        });
    }
    Ok(out)
}

/// `scripts/gpu_measure.py` output: one line per grid point with all three
/// quantities in bytes; each becomes three scored rows.
fn read_gpu_measured(path: &Path) -> Result<Vec<Row>, String> {
    let mut out = Vec::new();
    for r in read_csv(path)? {
        if field(&r, "status")? != "ok" {
            continue;
        }
        let id = format!(
            "gpu:{}:{}:{}:m{}:s{}:{}",
            field(&r, "model")?.rsplit('/').next().unwrap_or(""),
            field(&r, "method")?,
            field(&r, "dtype")?,
            field(&r, "micro_batch")?,
            field(&r, "seq_len")?,
            if field(&r, "checkpointing")? == "on" {
                "ckpt"
            } else {
                "nockpt"
            }
        );
        let (w, s, o) = scenario(&r).map_err(|e| format!("row {id}: {e}"))?;
        let est = estimate_with(&w, &s, &o).map_err(|e| format!("row {id}: {e}"))?;
        for (q, col) in [
            ("allocated", "allocated_bytes"),
            ("reserved", "reserved_bytes"),
            ("device", "device_bytes"),
        ] {
            out.push(Row {
                id: id.clone(),
                quantity: q.to_string(),
                measured_bytes: num(&r, col)?,
                predicted_bytes: quantity_of(&est, q)?,
                include: true,
                note: String::new(),
            });
        }
    }
    Ok(out)
}
