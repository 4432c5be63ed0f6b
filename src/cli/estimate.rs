//! `gpufit estimate`: the memory model on one workload, as a breakdown.

use std::process::ExitCode;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use serde::Serialize;

use super::common::{OnOff, WorkloadArgs};
use super::{Global, OutputFormat};
use crate::core::advisor::{first_run_plan, under_prediction_margin};
use crate::core::catalog::{lookup_gpu, GpuSpec};
use crate::core::memory::{self, BaseQuant, Estimate, Head, ModelOptions, OptimizerImpl};
use crate::core::settings::{Dtype, EngineeringSettings};
use crate::core::units::{fmt_gib, to_gib, MIB};
use crate::core::workload::{Framework, Workload};

#[derive(Debug, clap::Args)]
pub struct EstimateArgs {
    /// Boxed: keeps the `Command` enum small (clippy::large_enum_variant).
    #[command(flatten)]
    pub workload: Box<WorkloadArgs>,
    /// Micro batch size (sequences per GPU per forward pass).
    #[arg(long, default_value_t = 1, env = "GPUFIT_MICRO_BATCH_SIZE")]
    pub micro_batch: u32,
    /// Precision: fp32, bf16, fp16 (parameters held in that type, as
    /// torchtune and litgpt do), bf16-mixed, fp16-mixed (fp32 parameters with
    /// autocast, as HF Trainer and Lightning do).
    #[arg(long, default_value = "bf16", env = "GPUFIT_DTYPE")]
    pub dtype: String,
    /// Activation checkpointing.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub checkpointing: OnOff,
    /// Activation offloading to CPU (with checkpointing, as torchtune does).
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub offloading: OnOff,
    /// torch.compile (Inductor fuses elementwise ops: less saved per sample).
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub compile: OnOff,
    /// Gradient accumulation steps (> 1 keeps gradients alive during forward).
    #[arg(long, default_value_t = 1)]
    pub grad_accum: u32,
    /// What the model cannot read from the workload: the frozen base's
    /// storage, the head, library versions, the machine's CUDA context.
    #[command(flatten)]
    pub options: ModelOptionArgs,
    /// GPU to compare with (NVML name such as `NVIDIA A100-SXM4-80GB`, see
    /// `gpufit gpus`): prints the fraction used and the largest micro batch that fits.
    #[arg(long, env = "GPUFIT_GPU")]
    pub gpu: Option<String>,
}

/// The memory model's options ([`ModelOptions`]) as flags: what the model
/// cannot read from the workload itself. The accuracy benchmark states its
/// published rows with these same flags (benches/accuracy.rs).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ModelOptionArgs {
    /// Storage of a LoRA model's frozen base: none (training dtype), int8,
    /// nf4 (default: nf4 for qlora, none otherwise).
    #[arg(long)]
    pub base_quant: Option<String>,
    /// What sits on the transformer: lm (a head over the vocabulary: causal
    /// or masked LM) or classifier (`AutoModelForSequenceClassification`:
    /// a few logits per sequence). Default: read from a config.json's
    /// `architectures` (`…ForSequenceClassification` is a classifier),
    /// else lm.
    #[arg(long)]
    pub head: Option<String>,
    /// How the optimizer step runs: foreach (torch's default on CUDA),
    /// fused, or per-parameter (a Python loop over the parameters:
    /// transformers' legacy `AdamW`, the Trainer's `optim="adamw_hf"`, its
    /// default until transformers #25109, July 2023). The Trainer's names
    /// are accepted: adamw_hf, adamw_torch, adamw_torch_fused. Default: the
    /// framework's.
    #[arg(long)]
    pub optimizer_impl: Option<String>,
    /// Whether the optimizer steps inside backward, one parameter as soon
    /// as its gradient is complete (torchtune's `optimizer_in_bwd`): on or
    /// off. Default: the framework's — on for a torchtune single-GPU full
    /// fine-tune without gradient accumulation (its shipped configs), off
    /// otherwise. Only a single-GPU full fine-tune without accumulation can
    /// run it.
    #[arg(long, value_enum)]
    pub optimizer_in_backward: Option<OnOff>,
    /// torchtune's loss: on runs `CEWithChunkedOutputLoss` (its configs'
    /// loss, the default), off runs `torch.nn.CrossEntropyLoss` on the
    /// whole logits, which the model then returns in fp32 (a recipe given
    /// `loss=torch.nn.CrossEntropyLoss`). torchtune only.
    #[arg(long, value_enum)]
    pub chunked_loss: Option<OnOff>,
    /// Gradients stay allocated through the next forward:
    /// `zero_grad(set_to_none=False)` (PyTorch's default before 2.0, implied
    /// by --old-torch) or `zero_grad()` called after the forward.
    #[arg(long)]
    pub grads_kept: bool,
    /// The job's bitsandbytes is older than 0.43.2 (July 2024), whose 4-bit
    /// matmul keeps every quantized linear's input until the backward.
    #[arg(long)]
    pub old_bitsandbytes: bool,
    /// The run's first step holds its longest sample and no later step is
    /// as long (lit-gpt's fine-tuning scripts, June 2023 – February 2024,
    /// on Alpaca): with --old-bitsandbytes, litgpt then keeps no
    /// full-length earlier step's 4-bit inputs at the peak.
    #[arg(long)]
    pub longest_first: bool,
    /// The job's PyTorch is older than 1.11 (March 2022): softmax keeps its
    /// input for backward as well as its output (eager attention),
    /// `zero_grad()` keeps the gradients (as --grads-kept), and its CUDA
    /// (≤ 11.3) loads every kernel when the context is made (as
    /// --cuda-context-mib 1343, unless given).
    #[arg(long)]
    pub old_torch: bool,
    /// The machine's CUDA context and kernel images in MiB, as nvidia-smi
    /// shows a process that has only initialised CUDA (default: 610, lazy
    /// module loading on a current driver).
    #[arg(long)]
    pub cuda_context_mib: Option<u64>,
    /// The job runs with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
    /// (less allocator cache beside the tensors; see docs/memory-model.md).
    #[arg(long)]
    pub expandable_segments: bool,
}

/// The CUDA context of PyTorch builds before 1.11: their CUDA (10.2–11.3)
/// predates lazy module loading (CUDA 11.7, `CUDA_MODULE_LOADING=LAZY`),
/// so every kernel image is loaded when the context is made. Transformers'
/// "Model training anatomy" page (v4.20, `perf_train_gpu_one`) measures
/// 1343 MiB for `torch.ones((1, 1)).to("cuda")` on its V100 with such a
/// build.
const EAGER_LOADING_CONTEXT_MIB: u64 = 1343;

impl ModelOptionArgs {
    /// The options these flags state; `config_head` is the head a
    /// config.json's `architectures` names, used when --head is not given.
    pub fn options(&self, config_head: Option<Head>) -> crate::Result<ModelOptions> {
        let base_quant = match self
            .base_quant
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None => None,
            Some("none" | "bf16" | "fp16" | "fp32") => Some(BaseQuant::None),
            Some("int8" | "8bit" | "llm.int8") => Some(BaseQuant::Int8),
            Some("nf4" | "4bit" | "nf4-dq") => Some(BaseQuant::Nf4),
            Some("nf4-no-dq" | "nf4-nodq") => Some(BaseQuant::Nf4NoDoubleQuant),
            Some(other) => {
                return Err(crate::Error::Usage(format!(
                    "--base-quant: unknown `{other}`: use none, int8, nf4 or nf4-no-dq"
                )))
            }
        };
        let head = match self.head.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None => config_head.unwrap_or_default(),
            Some("lm" | "language-model" | "causal-lm" | "masked-lm") => Head::LanguageModel,
            Some("classifier" | "sequence-classification") => Head::Classifier,
            Some(other) => {
                return Err(crate::Error::Usage(format!(
                    "--head: unknown `{other}`: use lm or classifier"
                )))
            }
        };
        let optimizer_impl = match self
            .optimizer_impl
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None => None,
            Some("foreach" | "adamw_torch") => Some(OptimizerImpl::Foreach),
            Some("fused" | "adamw_torch_fused") => Some(OptimizerImpl::Fused),
            Some("per-parameter" | "adamw_hf") => Some(OptimizerImpl::PerParameter),
            Some(other) => {
                return Err(crate::Error::Usage(format!(
                    "--optimizer-impl: unknown `{other}`: use foreach, fused or per-parameter \
                     (or the Trainer's adamw_torch, adamw_torch_fused, adamw_hf)"
                )))
            }
        };
        let context_mib = self
            .cuda_context_mib
            .or(self.old_torch.then_some(EAGER_LOADING_CONTEXT_MIB));
        if context_mib == Some(0) {
            return Err(crate::Error::Usage(
                "--cuda-context-mib must be positive: a process that uses the GPU has a context"
                    .into(),
            ));
        }
        Ok(ModelOptions {
            base_quant,
            head,
            optimizer_impl,
            optimizer_in_backward: self.optimizer_in_backward.map(OnOff::as_bool),
            torchtune_plain_loss: self.chunked_loss == Some(OnOff::Off),
            grads_kept_between_steps: self.grads_kept || self.old_torch,
            bnb_keeps_matmul_inputs: self.old_bitsandbytes,
            longest_sample_first: self.longest_first,
            softmax_saves_input: self.old_torch,
            expandable_segments: self.expandable_segments,
            cuda_context_bytes: context_mib.map(|m| m * MIB),
        })
    }
}

/// The JSON document `--output json` prints.
#[derive(Debug, Serialize)]
struct Output<'a> {
    model: &'a str,
    method: String,
    dtype: &'static str,
    seq_len: u32,
    activation_checkpointing: bool,
    /// The head the estimate counted (--head, or the config.json's
    /// `architectures`).
    head: Head,
    #[serde(flatten)]
    estimate: &'a Estimate,
    /// The raise that covers the model's measured under-prediction for
    /// this framework (99th percentile, advisor::under_prediction_margin)
    /// and what `suggest` plans these exact settings with when there is no
    /// history: stated beside the estimate, never inside it.
    under_prediction_margin: f64,
    first_run_plan_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<GpuFit>,
}

#[derive(Debug, Serialize)]
struct GpuFit {
    name: String,
    memory_bytes: u64,
    /// peak_bytes / memory_bytes.
    fraction: f64,
    fits: bool,
    /// The peak does not fit, but the step can run on the card by PyTorch
    /// releasing its unused cache and retrying (`min_device_bytes` fits):
    /// slower, not certain (a live tensor cut from a cached segment keeps
    /// it), and gpufit does not plan on it.
    fits_by_releasing_cache: bool,
    /// The peak raised by the model's measured under-prediction for the
    /// framework (`under_prediction_margin`) fits too: a `fits` without
    /// this is inside the model's error of the card and may run out of
    /// memory (1 in 100 of the measured rows the model under-predicts
    /// needed the estimate raised by more than the margin).
    fits_within_measured_error: bool,
    /// Largest micro batch whose predicted peak fits the whole GPU; null when
    /// even 1 does not.
    max_micro_batch: Option<u32>,
    /// The same with the peak raised by the measured error.
    max_micro_batch_within_measured_error: Option<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    warnings: Vec<String>,
}

/// Builds the engineering settings from the flags.
pub fn settings_from(args: &EstimateArgs) -> crate::Result<EngineeringSettings> {
    let dtype: Dtype = args
        .dtype
        .parse()
        .map_err(|e: String| crate::Error::Usage(format!("--dtype: {e}")))?;
    if args.micro_batch == 0 {
        return Err(crate::Error::Usage(
            "--micro-batch must be a positive number (got 0): use --micro-batch 1 or more".into(),
        ));
    }
    if args.grad_accum == 0 {
        return Err(crate::Error::Usage(
            "--grad-accum must be a positive number (got 0): use --grad-accum 1 for none".into(),
        ));
    }
    Ok(EngineeringSettings {
        micro_batch_size: args.micro_batch,
        gradient_accumulation_steps: args.grad_accum,
        dtype,
        activation_checkpointing: args.checkpointing.as_bool(),
        activation_offloading: args.offloading.as_bool(),
        compile: args.compile.as_bool(),
        ..Default::default()
    })
}

pub fn run(g: &Global, args: EstimateArgs) -> crate::Result<ExitCode> {
    let w = args.workload.resolve()?;
    let s = settings_from(&args)?;
    let config_head = args
        .workload
        .config_names_small_head()?
        .then_some(Head::Classifier);
    let opts = args.options.options(config_head)?;
    if args.options.chunked_loss.is_some() && w.framework != Framework::Torchtune {
        return Err(crate::Error::Usage(format!(
            "--chunked-loss: only torchtune lets its loss be chosen (--framework torchtune); \
             {} runs its own",
            w.framework
        )));
    }
    if opts.optimizer_in_backward == Some(true) {
        if let Some(why) = memory::optimizer_in_backward_unavailable(&w, &s) {
            return Err(crate::Error::Usage(format!(
                "--optimizer-in-backward on: not for this run: {why}"
            )));
        }
    }
    let gpu = args.gpu.as_deref().map(lookup_gpu).transpose()?;
    let est = memory::estimate_with(&w, &s, &opts)?;
    let fit = gpu
        .as_ref()
        .map(|gpu| gpu_fit(&w, &s, &opts, &est, gpu))
        .transpose()?;
    match g.output {
        OutputFormat::Json => super::print_json(&Output {
            model: &w.model.name,
            method: w.method.to_string(),
            dtype: s.dtype.as_str(),
            seq_len: w.seq_len,
            activation_checkpointing: s.activation_checkpointing,
            head: opts.head,
            estimate: &est,
            under_prediction_margin: under_prediction_margin(w.framework),
            first_run_plan_bytes: first_run_plan(&est, w.framework).round() as u64,
            gpu: fit,
        })?,
        OutputFormat::Table => print_table(&w, &s, &est, fit.as_ref()),
    }
    Ok(ExitCode::SUCCESS)
}

fn gpu_fit(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    est: &Estimate,
    gpu: &GpuSpec,
) -> crate::Result<GpuFit> {
    let max = memory::max_micro_batch_with(w, s, opts, gpu.memory_bytes)?;
    let margin = under_prediction_margin(w.framework);
    let within_error_budget = (gpu.memory_bytes as f64 / (1.0 + margin)).floor() as u64;
    let max_within_error = memory::max_micro_batch_with(w, s, opts, within_error_budget)?;
    let mut warnings = Vec::new();
    if s.dtype.needs_bf16() && !gpu.bf16 {
        warnings.push(format!(
            "{} (compute capability {}) has no bf16: use --dtype fp16-mixed or fp32",
            gpu.name, gpu.compute_capability
        ));
    }
    Ok(GpuFit {
        name: gpu.name.clone(),
        memory_bytes: gpu.memory_bytes,
        fraction: est.peak_bytes as f64 / gpu.memory_bytes as f64,
        fits: est.peak_bytes <= gpu.memory_bytes,
        fits_by_releasing_cache: est.peak_bytes > gpu.memory_bytes
            && est.min_device_bytes <= gpu.memory_bytes,
        fits_within_measured_error: est.peak_bytes <= within_error_budget,
        max_micro_batch: max,
        max_micro_batch_within_measured_error: max_within_error,
        warnings,
    })
}

/// Memory levers the workload does not use yet, for the does-not-fit hint.
fn what_would_help(w: &Workload, s: &EngineeringSettings) -> Vec<&'static str> {
    use crate::core::workload::{Method, Optimizer, Sharding};
    let mut v = Vec::new();
    if !s.activation_checkpointing {
        v.push("--checkpointing on");
    } else if !s.activation_offloading {
        v.push("--offloading on");
    }
    if w.optimizer == Optimizer::Adamw {
        v.push("--optimizer adamw8bit");
    }
    match w.method {
        Method::Full => v.push("--method lora or qlora"),
        Method::Lora => v.push("--method qlora"),
        Method::Qlora => {}
    }
    if w.sharding != Sharding::Zero3 && w.sharding != Sharding::Fsdp {
        v.push("--zero 3 over more --gpus");
    } else {
        v.push("more --gpus");
    }
    v
}

fn print_table(w: &Workload, s: &EngineeringSettings, est: &Estimate, fit: Option<&GpuFit>) {
    let lora = w
        .lora
        .as_ref()
        .map(|l| format!(" (rank {}, {} targets)", l.rank, l.targets.len()))
        .unwrap_or_default();
    println!(
        "{} · {}{} · {} · seq {} · micro batch {} · checkpointing {} · {} · {} optimizer",
        w.model.name,
        w.method,
        lora,
        s.dtype,
        w.seq_len,
        s.micro_batch_size,
        if s.activation_checkpointing {
            "on"
        } else {
            "off"
        },
        w.framework,
        w.optimizer.as_str(),
    );
    let b = &est.breakdown;
    let total = est.device_bytes.max(1) as f64;
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec!["component", "GiB", "share"]);
    let rows: [(&str, u64); 9] = [
        ("weights", b.weights),
        ("gradients", b.gradients),
        ("optimizer state", b.optimizer_state),
        ("master weights (fp32)", b.master_weights),
        ("activations", b.activations),
        ("logits / loss buffers", b.logits),
        ("CUDA context", b.cuda_context),
        ("cuBLAS workspaces", b.cublas_workspaces),
        ("allocator overhead", b.allocator_overhead),
    ];
    for (name, v) in rows {
        t.add_row(vec![
            Cell::new(name),
            Cell::new(format!("{:.2}", to_gib(v))).set_alignment(CellAlignment::Right),
            Cell::new(format!("{:.1} %", 100.0 * v as f64 / total))
                .set_alignment(CellAlignment::Right),
        ]);
    }
    t.add_row(vec![
        Cell::new("peak (nvidia-smi)"),
        Cell::new(format!("{:.2}", to_gib(est.device_bytes))).set_alignment(CellAlignment::Right),
        Cell::new("100.0 %").set_alignment(CellAlignment::Right),
    ]);
    println!("{t}");
    println!(
        "max_memory_allocated {} · max_memory_reserved {} · device {}",
        fmt_gib(est.peak_allocated_bytes),
        fmt_gib(est.peak_reserved_bytes),
        fmt_gib(est.device_bytes)
    );
    if est.min_device_bytes < est.device_bytes {
        println!(
            "on a smaller card it may run in {}: PyTorch returns its unused cache and retries before failing, unless a live tensor sits in the segment it needs (slower; gpufit plans on the peak)",
            fmt_gib(est.min_device_bytes)
        );
    }
    // The line is the forward/backward's; where the optimizer step or the
    // allocator's cache sets the peak it lies below it, and says so.
    let line = est.fixed_bytes + est.per_sample_bytes * s.micro_batch_size as u64;
    if line as f64 >= 0.99 * est.device_bytes as f64 {
        println!(
            "peak ≈ {} + {} × micro batch",
            fmt_gib(est.fixed_bytes),
            fmt_gib(est.per_sample_bytes)
        );
    } else {
        println!(
            "forward/backward ≈ {} + {} × micro batch; at micro batch {} the optimizer step or the allocator's cache sets the peak ({})",
            fmt_gib(est.fixed_bytes),
            fmt_gib(est.per_sample_bytes),
            s.micro_batch_size,
            fmt_gib(est.device_bytes)
        );
    }
    println!(
        "measured error: of the {} measurements the model under-predicts, 1 in 100 needs the estimate raised by more than {:.1} % (accuracy bench); without history `gpufit suggest` plans these settings with {}",
        w.framework,
        100.0 * under_prediction_margin(w.framework),
        fmt_gib(first_run_plan(est, w.framework).round() as u64)
    );
    if let Some(f) = fit {
        println!(
            "{} ({}): {:.1} % used{}",
            f.name,
            fmt_gib(f.memory_bytes),
            100.0 * f.fraction,
            match (f.fits, f.fits_by_releasing_cache) {
                (true, _) if !f.fits_within_measured_error =>
                    " — fits, but inside the model's measured error of the card: may run out of memory",
                (true, _) => "",
                // The release is not certain: the replay of Llama-3.1-8B LoRA
                // 8 × 4,096 checkpointed (bench/data/synthetic/) fails where
                // a forward tensor was cut from a cached loss segment.
                (false, true) => " — the peak does not fit; it can run only by releasing the allocator's cache every step, and may still run out of memory",
                (false, false) => " — does NOT fit",
            }
        );
        match f.max_micro_batch {
            Some(m) => match f.max_micro_batch_within_measured_error {
                Some(safe) if safe < m => println!(
                    "largest micro batch that fits: {m} ({safe} with the model's measured error)"
                ),
                None => println!(
                    "largest micro batch that fits: {m} (none with the model's measured error)"
                ),
                Some(_) => println!("largest micro batch that fits: {m}"),
            },
            None => println!(
                "even micro batch 1 does not fit: try {}",
                what_would_help(w, s).join(", ")
            ),
        }
        for warn in &f.warnings {
            println!("warning: {warn}");
        }
    }
}
