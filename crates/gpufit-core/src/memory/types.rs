//! The memory model's types: the options a caller passes, and the named
//! parts of a plan. A leaf: it imports nothing else of `core::memory`, so
//! every other module can depend on it without a cycle.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How the frozen base of a LoRA model is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum BaseQuant {
    /// The base in the training dtype.
    None,
    /// bitsandbytes LLM.int8 (`load_in_8bit`): 1 byte per weight.
    Int8,
    /// bitsandbytes NF4 with double quantization (QLoRA's default).
    Nf4,
    /// NF4 without double quantization (`bnb_4bit_use_double_quant=False`,
    /// litgpt `bnb.nf4`): fp32 absmax per 64 weights.
    Nf4NoDoubleQuant,
}

/// What sits on top of the transformer blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Head {
    /// A language-model head over the vocabulary (causal LM, MLM): the
    /// logits buffer is batch × seq × vocab.
    #[default]
    LanguageModel,
    /// A sequence-classification head (`AutoModelForSequenceClassification`):
    /// a handful of logits per sequence.
    Classifier,
}

/// How the optimizer step is executed, which decides its temporaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerImpl {
    /// torch `foreach=True` (the default on CUDA): whole-model temporaries.
    Foreach,
    /// torch `fused=True` / bitsandbytes kernels: no model-sized temporaries.
    Fused,
    /// A Python loop over parameters (transformers' legacy `AdamW`,
    /// `optim="adamw_hf"`): one parameter's temporary at a time.
    PerParameter,
}

/// Knobs beyond the workload and settings that change memory. The
/// defaults are what current framework releases do; the others describe
/// older releases or non-default code paths, so published measurements can
/// be compared like with like.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ModelOptions {
    /// Frozen-base storage; `None` means what the method implies (NF4 for
    /// QLoRA, the training dtype otherwise).
    pub base_quant: Option<BaseQuant>,
    pub head: Head,
    /// `None`: the framework's default (torchtune fused, others foreach).
    pub optimizer_impl: Option<OptimizerImpl>,
    /// Whether the optimizer steps inside backward, one parameter as soon
    /// as its gradient is complete (torchtune `optimizer_in_bwd`, the
    /// PyTorch tutorial's `register_post_accumulate_grad_hook`). `None`:
    /// the framework's default (on for torchtune's single-GPU full
    /// fine-tunes, its shipped configs; off elsewhere). It can run only
    /// where a step follows every backward of one GPU's unsharded full
    /// fine-tune (see `storage::optimizer_in_backward`).
    #[serde(default)]
    pub optimizer_in_backward: Option<bool>,
    /// torchtune's recipe runs `loss=torch.nn.CrossEntropyLoss` instead of
    /// its configs' `CEWithChunkedOutputLoss`: the model then returns the
    /// whole logits upcast to fp32 (`self.output(h).float()`,
    /// torchtune/modules/transformer.py) and the loss keeps fp32 buffers of
    /// their size (see `loss::buffers`). Only torchtune has the choice.
    #[serde(default)]
    pub torchtune_plain_loss: bool,
    /// Gradients stay allocated between steps: PyTorch < 2.0
    /// `zero_grad(set_to_none=False)`, which HF Trainer used until 2023.
    pub grads_kept_between_steps: bool,
    /// bitsandbytes before 0.43.2 (#1270, July 2024): its 4-bit matmul
    /// keeps every quantized linear's input for a backward that never reads
    /// it (litgpt pinned 0.41–0.42 through 2024; see `activations.rs`).
    #[serde(default)]
    pub bnb_keeps_matmul_inputs: bool,
    /// The run's first step holds its longest sample and no later step is
    /// as long: lit-gpt's fine-tuning scripts from #184 (June 2023, "force
    /// the longest sample at the beginning so potential OOMs happen right
    /// away") until the data refactor #950 (February 2024), on data whose
    /// longest sample is unique (Alpaca's). The step at the full length
    /// then follows no step, so nothing a loop keeps of the previous
    /// step's graph (see `activations::previous_step_inputs`) is alive at
    /// the peak.
    #[serde(default)]
    pub longest_sample_first: bool,
    /// PyTorch before 1.11 (March 2022): `softmax` saved its input for
    /// backward as well as its output (derivatives.yaml passed `self` to
    /// `_softmax_backward_data`, which never reads it; pytorch#64000, fixed
    /// by #65242 for 1.11), so eager attention keeps one more score-sized
    /// tensor per layer.
    #[serde(default)]
    pub softmax_saves_input: bool,
    /// CUDA context + kernel images of the machine, when measured; `None`
    /// uses [`CUDA_CONTEXT_BYTES`](super::CUDA_CONTEXT_BYTES). CUDA < 11.7 loads every kernel eagerly
    /// and takes 1–1.4 GiB (the HF "model memory anatomy" page measures
    /// 1343 MiB on a V100 with CUDA 11.2).
    pub cuda_context_bytes: Option<u64>,
    /// The job runs with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`:
    /// the allocator grows segments in place instead of caching
    /// differently-sized ones, which removes most of the reserved-over-
    /// allocated gap (see `EXPANDABLE_SEGMENTS`).
    #[serde(default)]
    pub expandable_segments: bool,
}

/// Parameter groups of an architecture, in parameters.
pub(super) struct Params {
    /// Linear weights inside the transformer blocks (all experts).
    pub(super) body_linear: f64,
    /// Everything else: embeddings, untied head, norms, positions.
    pub(super) rest: f64,
    /// The output head (its own matrix, or the tied embedding).
    pub(super) head: f64,
    /// Largest single linear weight (for one-at-a-time dequantization).
    pub(super) largest_linear: f64,
}

impl Params {
    /// The largest single parameter tensor (embedding or one linear).
    pub(super) fn largest_param(&self) -> f64 {
        self.head.max(self.largest_linear)
    }
}

/// Numbers every persistent term needs: parameter groups, element sizes,
/// sharding, and how the trainable parameters are stored.
pub(super) struct Layout {
    pub(super) params: Params,
    /// Bytes of one stored parameter element of the training dtype.
    pub(super) param_elem_bytes: f64,
    /// Bytes of one activation (matmul output) element.
    pub(super) compute_elem_bytes: f64,
    /// Autocast (`-mixed` dtypes): fp32 parameters, 16-bit matmuls.
    pub(super) mixed: bool,
    /// DeepSpeed ZeRO (any stage).
    pub(super) deepspeed: bool,
    /// How many GPUs share the optimizer states, the gradients and the
    /// parameters (1 where each GPU holds them whole).
    pub(super) optimizer_shards: f64,
    pub(super) gradient_shards: f64,
    pub(super) param_shards: f64,
    /// Trainable parameters (all of them, or the adapters').
    pub(super) trainable_params: f64,
    /// Bytes of one stored trainable parameter element.
    pub(super) trainable_elem_bytes: f64,
    /// Bytes of one element of a separate fp32 master copy (0 without one).
    pub(super) master_elem_bytes: f64,
    /// Bytes of one gradient element: like the stored trainable params,
    /// except DeepSpeed's 16-bit gradients beside its fp32 master copy and
    /// autocast's fp32 gradients of fp32 params.
    pub(super) grad_elem_bytes: f64,
}

/// Every term of the memory model that does not depend on the micro batch,
/// in named parts. Terms marked "per sample" are multiplied by the micro
/// batch when the plan is evaluated (`allocator::eval`).
#[derive(Debug, Clone, Default)]
pub(super) struct Plan {
    pub(super) weights: Weights,
    pub(super) gradients: Gradients,
    pub(super) optimizer: OptimizerTerms,
    pub(super) activations: Activations,
    pub(super) loss: LossBuffers,
    pub(super) overheads: Overheads,
    pub(super) allocator: AllocatorSetup,
}

impl Plan {
    /// What stays allocated through the whole step: the stored weights,
    /// the fp32 master copy, the optimizer state and cuBLAS's workspaces.
    pub(super) fn persistent(&self) -> f64 {
        self.weights.stored
            + self.weights.master
            + self.optimizer.states
            + self.overheads.cublas_workspaces
    }
}

/// The weights, in bytes.
#[derive(Debug, Clone, Default)]
pub(super) struct Weights {
    /// Frozen and trainable weights as stored (both phases).
    pub(super) stored: f64,
    /// The fp32 master copy (both phases; under autocast the stored fp32
    /// trainable parameters themselves).
    pub(super) master: f64,
    /// Autocast, all-gather and dequantization copies, alive in phase A only.
    pub(super) phase_a_copies: f64,
    /// Autocast casts freed before the loss's backward: the cached casts of
    /// checkpointed blocks, which saved nothing (allocated bytes only: their
    /// blocks stay cached, see `allocator::eval`).
    pub(super) casts_freed_before_loss_backward: f64,
}

/// The gradients, in bytes.
#[derive(Debug, Clone, Default)]
pub(super) struct Gradients {
    /// All gradients (phase B).
    pub(super) total: f64,
    /// Gradients alive during phase A (accumulation keeps them).
    pub(super) kept_in_phase_a: f64,
    /// The largest single gradient tensor (the embedding's or the output
    /// head's in a full fine-tune, in the gradients' dtype): phase B caches
    /// blocks of this size (the gradient and the optimizer's temporary of
    /// that parameter), which phase A's loss buffers can take only when
    /// each buffer fits in one (see `allocator::eval`). 0 where gradients
    /// are sharded or flattened.
    pub(super) largest_block: f64,
    /// All the bytes phase B caches in blocks of that size (see
    /// `storage::largest_size_blocks`): as much of the loss buffers as
    /// they hold.
    pub(super) largest_size_blocks: f64,
    /// Of those, the tied embedding's second-use gradient (0 if untied),
    /// which is free at phase B's peak (see `allocator::eval`).
    pub(super) second_use_block: f64,
    /// One MLP weight's gradient block (`hidden × intermediate` in the
    /// gradients' dtype) where gradients are per-parameter tensors, else 0.
    pub(super) mlp_block: f64,
}

/// The optimizer, in bytes.
#[derive(Debug, Clone, Default)]
pub(super) struct OptimizerTerms {
    /// Its states (both phases).
    pub(super) states: f64,
    /// The step's temporaries (phase B).
    pub(super) step_temporaries: f64,
    /// Bytes the step reads and writes on this GPU (for the throughput
    /// model; `storage::optimizer`).
    pub(super) step_traffic: f64,
    /// States the first optimizer step makes in the cached loss segments
    /// (see `allocator::first_step_states`): a checkpointed full
    /// fine-tune's. 0 otherwise.
    pub(super) first_step_states: f64,
}

/// What the blocks keep for backward, per sample (one sequence of the
/// micro batch), in bytes.
#[derive(Debug, Clone, Default)]
pub(super) struct Activations {
    /// All of it.
    pub(super) total: f64,
    /// The hidden-width part of `total` …
    pub(super) hidden_width: f64,
    /// … and the bytes of one such tensor (its size at micro batch m is m
    /// times this), for the allocator's segment packing.
    pub(super) hidden_tensor: f64,
    /// The MLP-intermediate part of `total` (without checkpointing, else 0) …
    pub(super) mlp_wide: f64,
    /// … and one such tensor.
    pub(super) mlp_wide_tensor: f64,
    /// Checkpointed: the smaller of one recomputed block and the loss
    /// buffers (they take turns in the same cache).
    pub(super) recompute_overlap: f64,
    /// What the training loop keeps of the previous step's graph until this
    /// step's forward returns, through the optimizer step too (see
    /// `activations::previous_step_inputs`); its excess over the loss's and
    /// the backward's transients, when the next forward ends, is in `total`.
    pub(super) previous_step: f64,
}

/// The loss path's buffers (logits, log-probabilities, their gradients),
/// per sample, in bytes.
#[derive(Debug, Clone, Default)]
pub(super) struct LossBuffers {
    /// Their peak: the larger of the loss's forward and backward.
    pub(super) peak: f64,
    /// At the forward's end (≤ `peak`).
    pub(super) at_forward_end: f64,
    /// What a training loop still holds through the optimizer step (phase
    /// B): litgpt's `fit` keeps its `logits` until the next forward
    /// returns. 0 where the loop drops them with the loss.
    pub(super) held_through_step: f64,
    /// The loss path's largest single tensor (HF's fp32 upcast of the
    /// logits: seq × vocab × 4 B), whose freed block expandable segments
    /// leave as a hole (see `AllocatorShares::loss_holes`); 0 under
    /// `torch.compile`, whose fused loss leaves none.
    pub(super) eager_buffer: f64,
    /// The same tensor's size for the allocator's size test
    /// (`allocator::loss_fits_grad_blocks`), kept under `torch.compile`,
    /// whose largest loss tensor is at most this large.
    pub(super) largest_tensor: f64,
    /// The output head's logits in the compute dtype (seq × vocab ×
    /// element): the smallest segment of the loss path, which the first
    /// optimizer step's new states fill first (see
    /// `allocator::first_step_states`). 0 where the loss path is not the
    /// upcast loss of transformers (and Lightning's or a plain loop's).
    pub(super) head_output: f64,
    /// One loss buffer that a full fine-tune's checkpointed autocast step
    /// strands (see `loss::strands_a_buffer`), else 0.
    pub(super) stranded_buffer: f64,
}

/// What the process holds beside the tensors, in bytes.
#[derive(Debug, Clone, Default)]
pub(super) struct Overheads {
    /// The CUDA context and kernel images (outside the allocator).
    pub(super) cuda_context: f64,
    /// cuBLAS's workspaces (see `CUBLAS_WORKSPACES_BYTES`): allocated at
    /// the first matmul of each thread and kept for the process.
    pub(super) cublas_workspaces: f64,
}

/// What the allocator model needs beside the byte terms.
#[derive(Debug, Clone, Default)]
pub(super) struct AllocatorSetup {
    /// The reserved-over-allocated shares of the allocator mode.
    pub(super) shares: AllocatorShares,
    /// Activation checkpointing on (changes how phase B reuses the cache).
    pub(super) checkpointing: bool,
    /// The step leaves nothing long-lived in the cached blocks of phase A's
    /// transients, so under pressure the allocator can return them whole
    /// (see `allocator::eval`): checkpointed, the default allocator, a
    /// frozen base (adapters only: no parameter-sized gradients or optimizer
    /// states cut from freed loss buffers), and parameters already in the
    /// compute dtype (no autocast or dequantized weight copies, which
    /// autograd keeps for backward).
    pub(super) released_under_pressure: bool,
}

/// How much of each transient the caching allocator keeps reserved beside
/// the allocation; one set per allocator mode (`allocator::CACHING_ALLOCATOR`,
/// `allocator::EXPANDABLE_SEGMENTS`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct AllocatorShares {
    /// Phase A: share of its hidden-width transients (activations,
    /// autocast/dequantization copies: many tensors of a few sizes) that
    /// stays reserved but unusable.
    pub(super) transient: f64,
    /// Phase A: the same for the loss buffers (a few vocabulary-wide
    /// tensors, each its own segment, whose sizes the other tensors do not
    /// share).
    pub(super) transient_loss: f64,
    /// Phase A: share of one loss buffer (`LossBuffers::eager_buffer`)
    /// left as a hole.
    pub(super) loss_holes: f64,
    /// Checkpointed phase A: share of the optimizer states left as holes
    /// (see `allocator::EXPANDABLE_SEGMENTS`).
    pub(super) state_holes: f64,
    /// Checkpointed phase A: the loss buffers (vocabulary-wide) and the
    /// recomputed block's tensors (hidden/intermediate-wide) take turns but
    /// do not fit into each other's freed blocks: this share of the smaller
    /// of the two stays reserved beside the larger.
    pub(super) recompute: f64,
    /// Phase B without checkpointing: gradients replace activations as the
    /// backward frees them (similar sizes), so only the optimizer
    /// temporaries miss the cache: this share of the smaller of phase A's
    /// transients and the temporaries stays reserved.
    pub(super) cross_phase: f64,
    /// Phase B with checkpointing: gradients are made one recomputed block
    /// at a time, in between that block's activations, and split the cached
    /// loss blocks; the optimizer's temporaries then find no block large
    /// enough among them: this share of phase A's loss buffers stays
    /// reserved. The activations' blocks (hidden-width inputs, one block's
    /// tensors) do take the temporaries: only what exceeds the temporaries
    /// stays (the replay of BERT-large fp32 at 8 × 512, checkpointed:
    /// reserved = allocated in phase B).
    pub(super) cross_phase_checkpointed: f64,
    /// Fixed-size segments (the default allocator): requests of 1–10 MiB
    /// share 20 MiB segments (see `allocator::segment_waste_share`), and a
    /// freed block serves only requests that fit in it, so the last step's
    /// parameter-shaped blocks wait beside a forward that cannot use them.
    /// Expandable segments have neither.
    pub(super) fixed_segments: bool,
}

/// What one transformer layer keeps, per token: bytes saved for backward
/// and the transient of its backward.
pub(super) struct LayerActs {
    pub(super) saved: f64,
    /// Bytes per token scaling with sequence length (eager scores): × seq.
    pub(super) saved_per_seq: f64,
    pub(super) backward_transient: f64,
    pub(super) backward_transient_per_seq: f64,
    /// Whether the per-seq backward transients are the size of the saved
    /// per-seq tensor (PyTorch's math SDPA: fp32 probabilities, their
    /// gradient and the scores' gradient, one shape and dtype), so that in
    /// a checkpointed backward they take the blocks the recomputed blocks'
    /// probabilities free and do not add to the turn-taking with the loss
    /// buffers (see `activations::recompute_overlap`).
    pub(super) transient_per_seq_one_size: bool,
    /// The part of `saved` that is MLP-intermediate wide (the rest is
    /// hidden-width tensors and smaller), for the allocator's segment
    /// packing (`allocator::segment_waste_share`).
    pub(super) saved_wide: f64,
    /// Bytes per token of one MLP-intermediate tensor (`intermediate_size`
    /// elements), for the allocator's size test against the cached
    /// parameter-shaped blocks (`allocator::eval`).
    pub(super) wide_tensor: f64,
}
