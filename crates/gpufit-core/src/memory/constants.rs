//! The figures the memory model takes from outside itself — measured on
//! this repository's GPUs, fitted to those measurements, or read from a
//! framework's source — each defined once with its source. A leaf: it
//! imports nothing else of `core::memory`.
//!
//! The allocator's fitted shares live beside the allocator model
//! (`allocator::CACHING_ALLOCATOR`, `allocator::EXPANDABLE_SEGMENTS`), and
//! the storage formats' bytes per parameter beside the storage terms.

use crate::units::MIB;

/// CUDA context + PyTorch's kernel images, which nvidia-smi shows beside
/// `memory_reserved()` (PyTorch docs, "CUDA semantics → Memory
/// management"), for a machine whose own was not measured: the 610 MiB this
/// repository measured on its H100 and H200 (driver 580, PyTorch 2.11,
/// CUDA 13, lazy module loading; bench/data/h100/README.md, `context_bytes`
/// in bench/data/h100/peaks.csv, `cuda_context_mib` in the other files of
/// bench/data/h100 and h200). The accuracy benchmark passes each row's
/// measured context instead (`ModelOptions::cuda_context_bytes`).
pub const CUDA_CONTEXT_BYTES: u64 = 610 * MIB;

/// cuBLAS's workspaces, which PyTorch allocates from the caching allocator
/// (so they are in `max_memory_allocated`) at the first matmul of each
/// thread that runs one, and keeps for the process: the main thread
/// (forward, optimizer step) and autograd's device thread (backward), one
/// each. Each is `CUBLAS_WORKSPACE_CONFIG`'s default: 32 MiB on compute
/// capability 9.0 (`4096 * 8 * 1024`), 8.125 MiB before it
/// (`4096 * 1024 * 2 + 16 * 1024 * 8`; aten/src/ATen/cuda/
/// CublasHandlePool.cpp, `parseChosenWorkspaceSize`). The Hopper size is
/// counted everywhere (48 MiB too many on older cards). The 468 measured
/// allocated peaks (bench/data/h100, h200: H100 and H200) sat a median
/// 66 MiB above the model without them.
pub const CUBLAS_WORKSPACES_BYTES: u64 = 2 * 32 * MIB;

/// `torch.compile` (Inductor fuses the element-wise ops, whose
/// intermediates are then not saved): a transformer block's saved bytes
/// per sample, compiled / eager. Fitted on the two compiled H100 rows of
/// bench/data/h100/compile_accum.csv (×0.711, rounded up); the derivation
/// is in docs/memory-model.md ("torch.compile's factors").
pub const COMPILE_BLOCK_FACTOR: f64 = 0.72;

/// The same for the loss path's bytes per sample (HF's fp32 upcast,
/// log_softmax and nll, traced with the forward): ×0.547 on the same two
/// rows, rounded up.
pub const COMPILE_LOSS_FACTOR: f64 = 0.55;

/// Tokens per output-head chunk in litgpt's fine-tuning loops:
/// `model(input_ids, lm_head_chunk_size=128)` (litgpt/finetune/lora.py and
/// adapter.py).
pub(super) const LITGPT_LM_HEAD_CHUNK: f64 = 128.0;

/// torchtune's `CEWithChunkedOutputLoss` splits the output projection and
/// the loss into 8 chunks (`num_output_chunks = 8` in
/// torchtune/modules/loss/ce_chunked_output_loss.py).
pub(super) const TORCHTUNE_CE_CHUNKS: f64 = 8.0;
