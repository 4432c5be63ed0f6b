//! The plan: every term of the memory model that does not depend on the
//! micro batch, built step by step from the workload and settings
//! (storage → gradients → optimizer → per-sample terms).

use crate::core::settings::{Dtype, EngineeringSettings};
use crate::core::workload::{Framework, Method, Sharding, Workload};

use super::activations::per_sample;
use super::allocator::{AllocatorShares, CACHING_ALLOCATOR, EXPANDABLE_SEGMENTS};
use super::storage::{
    compute_bytes, grad_blocks, gradients, lora_params, optimizer, param_bytes, params_of, weights,
    Params,
};
use super::{ModelOptions, CUBLAS_WORKSPACES_BYTES, CUDA_CONTEXT_BYTES};

/// Everything about a workload + settings that does not depend on the micro batch.
#[derive(Debug, Clone, Default)]
pub(super) struct Plan {
    // persistent (both phases)
    pub(super) weights_stored: f64,
    pub(super) master: f64,
    pub(super) opt_state: f64,
    pub(super) grads: f64,
    /// Gradients alive during phase A (accumulation keeps them).
    pub(super) grads_in_a: f64,
    /// Autocast / all-gather / dequantization copies alive in phase A only.
    pub(super) weights_transient_a: f64,
    /// Optimizer temporaries in phase B.
    pub(super) step_transient: f64,
    /// Bytes the optimizer step reads and writes on this GPU (for the
    /// throughput model; `storage::optimizer`).
    pub(super) optimizer_step_bytes: f64,
    /// The largest single gradient tensor (the embedding's or the output
    /// head's in a full fine-tune, in the gradients' dtype): phase B caches
    /// blocks of this size (the gradient and the optimizer's temporary of
    /// that parameter), which phase A's loss buffers can take only when
    /// each buffer fits in one (see `allocator::eval`). 0 where gradients
    /// are sharded or flattened.
    pub(super) largest_grad_block: f64,
    /// All the bytes phase B caches in blocks of that size (see
    /// `storage::grad_blocks`): as much of the loss buffers as they hold.
    pub(super) grad_blocks: f64,
    /// Of those, the tied embedding's second-use gradient (0 if untied),
    /// which is free at phase B's peak (see `allocator::eval`).
    pub(super) second_use_block: f64,
    /// Activation checkpointing on (changes how phase B reuses the cache).
    pub(super) checkpointing: bool,
    /// The allocator's reserved-over-allocated shares.
    pub(super) shares: AllocatorShares,
    /// The step leaves nothing long-lived in the cached blocks of phase A's
    /// transients, so under pressure the allocator can return them whole
    /// (see `allocator::eval`): checkpointed, the default allocator, a
    /// frozen base (adapters only: no parameter-sized gradients or optimizer
    /// states cut from freed loss buffers), and parameters already in the
    /// compute dtype (no autocast or dequantized weight copies, which
    /// autograd keeps for backward).
    pub(super) cache_released_under_pressure: bool,
    /// Checkpointed: the smaller of one recomputed block and the loss
    /// buffers, per sample (they take turns in the same cache).
    pub(super) recompute_overlap_per_sample: f64,
    // per sample (one sequence of the micro batch)
    pub(super) act_per_sample: f64,
    /// One loss buffer per sample that a full fine-tune's checkpointed
    /// autocast step strands (see `activations::per_sample`), else 0.
    pub(super) stranded_loss_buffer_per_sample: f64,
    /// The output head's logits in the compute dtype per sample (seq ×
    /// vocab × element): the smallest segment of the loss path, which the
    /// first optimizer step's new states fill first (see
    /// `allocator::first_step_states`). 0 where the loss path is not the
    /// upcast loss of transformers (and Lightning's or a plain loop's).
    pub(super) head_output_per_sample: f64,
    /// Optimizer states the first optimizer step makes in the cached loss
    /// segments (see `allocator::first_step_states`): a checkpointed full
    /// fine-tune's. 0 otherwise.
    pub(super) first_step_states: f64,
    /// The hidden-width part of `act_per_sample` …
    pub(super) act_hidden_per_sample: f64,
    /// … and the bytes of one such tensor per sample (its size at micro
    /// batch m is m times this), for the allocator's segment packing.
    pub(super) hidden_tensor_per_sample: f64,
    /// The MLP-intermediate part of `act_per_sample` (without
    /// checkpointing, else 0) …
    pub(super) act_wide_per_sample: f64,
    /// … and one such tensor per sample.
    pub(super) wide_tensor_per_sample: f64,
    /// One MLP weight's gradient block (`hidden × intermediate` in the
    /// gradients' dtype) where gradients are per-parameter tensors, else 0.
    pub(super) mlp_grad_block: f64,
    pub(super) logits_per_sample: f64,
    /// The loss path's largest single tensor per sample (HF's fp32 upcast
    /// of the logits: seq × vocab × 4 B), whose freed block expandable
    /// segments leave as a hole (see `allocator::AllocatorShares`).
    pub(super) loss_buffer_per_sample: f64,
    /// The same tensor's size for the allocator's size test
    /// (`allocator::loss_fits_grad_blocks`), kept under `torch.compile`,
    /// whose fused loss leaves no hole but whose largest loss tensor is at
    /// most this large.
    pub(super) largest_loss_tensor_per_sample: f64,
    /// The logits a training loop still holds through the optimizer step
    /// (phase B), per sample: litgpt's `fit` keeps its `logits` until the
    /// next forward returns. 0 where the loop drops them with the loss.
    pub(super) logits_held_per_sample: f64,
    /// The loss buffers at the forward's end (≤ `logits_per_sample`, which
    /// is the larger of the forward and backward peaks).
    pub(super) logits_fwd_per_sample: f64,
    /// Autocast weight casts freed before the loss's backward: the cached
    /// casts of checkpointed blocks, which saved nothing (allocated bytes
    /// only: their blocks stay cached, see `allocator::eval`).
    pub(super) casts_freed_before_backward: f64,
    pub(super) cuda_context: f64,
    /// cuBLAS's workspaces (see [`CUBLAS_WORKSPACES_BYTES`]): allocated
    /// at the first matmul of each thread and kept for the process.
    pub(super) workspaces: f64,
}

impl Plan {
    /// What stays allocated through the whole step: the stored weights,
    /// the fp32 master copy, the optimizer state and cuBLAS's workspaces.
    pub(super) fn persistent(&self) -> f64 {
        self.weights_stored + self.master + self.opt_state + self.workspaces
    }
}

/// Numbers every term needs: parameter groups, element sizes, sharding,
/// and how the trainable parameters are stored.
pub(super) struct Layout {
    pub(super) p: Params,
    pub(super) pb: f64,
    pub(super) e: f64,
    pub(super) mixed: bool,
    pub(super) deepspeed: bool,
    pub(super) shard_opt: f64,
    pub(super) shard_grad: f64,
    pub(super) shard_param: f64,
    pub(super) trainable: f64,
    pub(super) train_store: f64,
    pub(super) master_bytes: f64,
    /// Bytes of one gradient element: like the stored trainable params,
    /// except DeepSpeed's 16-bit gradients beside its fp32 master copy and
    /// autocast's fp32 gradients of fp32 params.
    pub(super) grad_bytes: f64,
}

fn layout(w: &Workload, s: &EngineeringSettings) -> Layout {
    let a = &w.model;
    let mut p = params_of(a);
    let mut total = a.params as f64;
    // litgpt never ties the output head to the embedding: its `GPT` builds
    // `lm_head` and `transformer.wte` as separate modules and the checkpoint
    // converter copies a tied embedding into both (litgpt/model.py,
    // `GPT.__init__`), so tied models (Gemma, Llama 3.2) carry it twice.
    if w.framework == Framework::Litgpt && a.tied_embeddings {
        p.rest += p.head;
        total += p.head;
    }
    let pb = param_bytes(s.dtype);
    let e = compute_bytes(s.dtype);
    let mixed = s.dtype.is_mixed();
    let gpus = w.gpus.max(1) as f64;
    let deepspeed = matches!(
        w.sharding,
        Sharding::Zero1 | Sharding::Zero2 | Sharding::Zero3
    );
    let shard_opt = if w.sharding != Sharding::None {
        gpus
    } else {
        1.0
    };
    let shard_grad = if matches!(
        w.sharding,
        Sharding::Zero2 | Sharding::Zero3 | Sharding::Fsdp
    ) {
        gpus
    } else {
        1.0
    };
    let shard_param = if matches!(w.sharding, Sharding::Zero3 | Sharding::Fsdp) {
        gpus
    } else {
        1.0
    };

    let trainable = match w.method {
        Method::Full => total,
        Method::Lora | Method::Qlora => w
            .lora
            .as_ref()
            .map(|l| lora_params(a, l.rank, &l.targets) as f64)
            .unwrap_or(0.0),
    };
    // Trainable parameters' storage: DeepSpeed ZeRO keeps 16-bit module
    // params plus a separate fp32 master copy in the optimizer (Rajbhandari
    // et al. 2020, "ZeRO", §3: 2Ψ + 2Ψ + KΨ with K = 12). PEFT keeps LoRA
    // adapters in fp32 even on a 16-bit base (`autocast_adapter_dtype=True`).
    let (train_store, master_bytes) = if deepspeed && s.dtype != Dtype::Fp32 {
        (2.0, 4.0)
    } else if w.method != Method::Full && w.framework == Framework::Hf {
        (4.0, 0.0)
    } else {
        (pb, 0.0)
    };
    let grad_bytes = if deepspeed && s.dtype != Dtype::Fp32 {
        2.0
    } else if mixed {
        4.0
    } else {
        train_store
    };
    Layout {
        p,
        pb,
        e,
        mixed,
        deepspeed,
        shard_opt,
        shard_grad,
        shard_param,
        trainable,
        train_store,
        master_bytes,
        grad_bytes,
    }
}

pub(super) fn plan(w: &Workload, s: &EngineeringSettings, opts: &ModelOptions) -> Plan {
    let l = layout(w, s);
    let mut pl = Plan {
        cuda_context: opts.cuda_context_bytes.unwrap_or(CUDA_CONTEXT_BYTES) as f64,
        workspaces: CUBLAS_WORKSPACES_BYTES as f64,
        checkpointing: s.activation_checkpointing,
        shares: if opts.expandable_segments {
            EXPANDABLE_SEGMENTS
        } else {
            CACHING_ALLOCATOR
        },
        ..Plan::default()
    };

    weights(w, s, opts, &l, &mut pl);
    gradients(w, s, opts, &l, &mut pl);
    optimizer(w, opts, &l, &mut pl);
    (pl.grad_blocks, pl.second_use_block) = grad_blocks(w, &l, &pl);
    per_sample(w, s, opts, &mut pl);
    // AdamW and the others make their states in the first `step()`, and a
    // full fine-tune's are weight-shaped (large-pool blocks); an adapter's
    // are small tensors of the small pool.
    if pl.checkpointing && w.method == Method::Full && pl.head_output_per_sample > 0.0 {
        pl.first_step_states = pl.opt_state;
    }
    pl.cache_released_under_pressure = pl.checkpointing
        && pl.shares.fixed_segments
        && w.method != Method::Full
        && !l.mixed
        && pl.weights_transient_a == 0.0;
    pl
}

/// The optimizer step's bytes alone (see `storage::optimizer`), without
/// the rest of the plan: the throughput model asks for them once per
/// candidate.
pub(super) fn optimizer_step_bytes(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
) -> f64 {
    let l = layout(w, s);
    let mut pl = Plan::default();
    optimizer(w, opts, &l, &mut pl);
    pl.optimizer_step_bytes
}
