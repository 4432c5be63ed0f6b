//! The loss path's buffers per sample: the logits, the loss's
//! intermediates and their gradients, per framework (docs/memory-model.md).

use crate::settings::{Dtype, EngineeringSettings};
use crate::workload::{Framework, Method, Workload};

use super::constants::{LITGPT_LM_HEAD_CHUNK, TORCHTUNE_CE_CHUNKS};
use super::precision::{activation_dtype, compute_bytes};
use super::types::{Head, LossBuffers, ModelOptions};

/// The loss buffers of one sequence, before `torch.compile`.
pub(super) fn buffers(w: &Workload, s: &EngineeringSettings, opts: &ModelOptions) -> LossBuffers {
    let a = &w.model;
    let dtype = activation_dtype(w, s, opts);
    let e = compute_bytes(dtype);
    let seq = w.seq_len as f64;
    let mut loss = LossBuffers::default();
    (loss.at_forward_end, loss.peak) = match opts.head {
        Head::LanguageModel => {
            // Gemma 2's `final_logit_softcapping`: `tanh(logits / cap) * cap`
            // in the logits' dtype; tanh keeps its output for backward.
            let softcap = if a.quirks.final_softcapping { e } else { 0.0 };
            let tv = seq * a.vocab_size as f64;
            let plain = torchtune_plain(w, opts);
            let (fwd, peak) = if plain {
                PLAIN_TORCHTUNE_LOSS
            } else {
                logits_bytes_per_token_vocab(w.framework, dtype, seq, w.method == Method::Full)
            };
            loss.eager_buffer = tv
                * if plain {
                    4.0
                } else {
                    largest_bytes_per_token_vocab(w.framework, dtype)
                };
            loss.largest_tensor = loss.eager_buffer;
            if upcast_loss_path(w.framework) {
                loss.head_output = tv * e;
            }
            (tv * (fwd + softcap), tv * (peak + softcap))
        }
        // classification: the pooled token and a few logits per sequence
        Head::Classifier => {
            let c = 4.0 * a.hidden_size as f64 * 4.0;
            (c, c)
        }
    };
    // litgpt's `fit` holds the step's 16-bit logits in its `logits`
    // variable until the next forward returns, through the optimizer step
    // too (the lists of chunks for LoRA, the whole tensor for full; the
    // test `litgpt_holds_its_logits_through_the_optimizer_step`).
    if w.framework == Framework::Litgpt && opts.head == Head::LanguageModel {
        loss.held_through_step = seq * a.vocab_size as f64 * e;
    }
    if strands_a_buffer(w, s, opts) {
        loss.stranded_buffer = seq * a.vocab_size as f64 * 4.0;
    }
    loss
}

/// Whether a torchtune run computes its loss with `torch.nn.CrossEntropyLoss`
/// on the whole logits ([`ModelOptions::torchtune_plain_loss`]).
pub(super) fn torchtune_plain(w: &Workload, opts: &ModelOptions) -> bool {
    w.framework == Framework::Torchtune && opts.torchtune_plain_loss
}

/// torchtune with `torch.nn.CrossEntropyLoss` (no output chunks), bytes per
/// token × vocabulary entry, forward and peak: the model returns
/// `self.output(h).float()` (torchtune/modules/transformer.py at 1814feb1;
/// the 16-bit logits die with the cast, which saves nothing), so the fp32
/// logits and cross_entropy's saved fp32 log-probs are alive at the
/// forward's end (8; the recipe's `del logits` drops its name only after
/// the loss is made); in backward the saved log-probs, nll's fp32 gradient
/// and log_softmax's fp32 gradient (12), as transformers' upcast loss.
const PLAIN_TORCHTUNE_LOSS: (f64, f64) = (8.0, 12.0);

/// transformers' loss, and a plain loop's (Lightning's, gpufit's generic
/// one): the whole logits, upcast to fp32 where the loss runs in fp32.
fn upcast_loss_path(f: Framework) -> bool {
    matches!(f, Framework::Hf | Framework::Lightning | Framework::Generic)
}

/// Whether the step strands one fp32 loss buffer: a checkpointed full
/// fine-tune under autocast makes the output head's 16-bit copy (kept for
/// backward) after the previous step freed its loss buffers and while
/// little else is alive, so the copy is cut from a cached fp32 loss
/// segment and the next loss backward maps one more (replayed with
/// scripts/alloc_sim.py; the test
/// `a_checkpointed_autocast_full_fine_tune_strands_one_loss_buffer`).
/// Adapter runs under autocast do not show it (docs/memory-model.md, "The
/// caching allocator").
fn strands_a_buffer(w: &Workload, s: &EngineeringSettings, opts: &ModelOptions) -> bool {
    s.activation_checkpointing
        && s.dtype.is_mixed()
        && w.method == Method::Full
        && opts.head == Head::LanguageModel
        && upcast_loss_path(w.framework)
}

/// Loss-path bytes per (token × vocabulary entry), per framework. Each is
/// the forward peak (logits + loss intermediates) and the larger of it and
/// the backward peak of the loss (saved log-probs + their gradient + the
/// gradient of the logits). `seq` sets litgpt's chunk count; `full`
/// picks litgpt's full fine-tuning loop, which does not chunk its head.
fn logits_bytes_per_token_vocab(f: Framework, d: Dtype, seq: f64, full: bool) -> (f64, f64) {
    let pd = compute_bytes(d);
    let (fwd, bwd) = match f {
        // transformers ≥ 4.46 `ForCausalLMLoss`: `logits.float()` then
        // cross_entropy; log_softmax saves its fp32 output. Forward: 16-bit
        // logits + fp32 copy + fp32 log-probs; backward: saved log-probs +
        // nll gradient + log_softmax gradient, all fp32 (the 16-bit logits
        // are released with the model output before backward).
        Framework::Hf => {
            let upcast = if pd < 4.0 { 4.0 } else { 0.0 };
            (pd + upcast + 4.0, 12.0)
        }
        // torchtune `CEWithChunkedOutputLoss`: 16-bit logit chunks, each
        // upcast to fp32 only inside its own cross_entropy; all chunks'
        // fp32 log-probs are saved; the recipe `del logits` before backward.
        Framework::Torchtune => {
            let fwd = pd + 4.0 + 4.0 / TORCHTUNE_CE_CHUNKS;
            let bwd = 4.0 + (8.0 + pd) / TORCHTUNE_CE_CHUNKS;
            (fwd, bwd)
        }
        // litgpt's full fine-tuning loop (finetune/full.py) runs the whole
        // head and the chunked loss on its shifted view, which `reshape`
        // copies: logits, copy and log-probs at the loss's end; in backward
        // the logits, the chunks' gradients and their concatenation.
        Framework::Litgpt if full => (3.0 * pd, 3.0 * pd),
        // litgpt's LoRA loop (finetune/lora.py) runs the head in chunks of
        // `LITGPT_LM_HEAD_CHUNK` tokens and `chunked_cross_entropy` on them
        // without upcast: all chunks' logits and their 16-bit log-probs,
        // plus one chunk's two transients (replayed with
        // scripts/alloc_sim.py --framework litgpt; the test
        // `litgpt_loss_path_follows_its_chunks_and_its_loop`).
        Framework::Litgpt => {
            let chunks = (seq / LITGPT_LM_HEAD_CHUNK).ceil().max(1.0);
            let both = 2.0 * pd + 2.0 * pd / chunks;
            (both, both)
        }
        // A plain `F.cross_entropy(logits, y)`: under autocast (the -mixed
        // dtypes, Lightning's `bf16-mixed`) cross_entropy is an fp32 op, so
        // it behaves like the HF path; with plain 16-bit or fp32 weights it
        // runs in the logits' dtype: saved log-probs + two gradients.
        Framework::Lightning | Framework::Generic => {
            if d.is_mixed() {
                (pd + 4.0 + 4.0, 12.0)
            } else {
                (2.0 * pd, 3.0 * pd)
            }
        }
    };
    (fwd, fwd.max(bwd))
}

/// The loss path's largest single tensor, bytes per token × vocabulary
/// entry: the fp32 upcast of the logits where the loss runs in fp32 (HF's
/// `ForCausalLMLoss`, cross_entropy under autocast), else the logits in
/// their own dtype (torchtune's and litgpt's chunked losses keep the
/// 16-bit logits whole; plain 16-bit cross_entropy does not upcast). See
/// `logits_bytes_per_token_vocab` for the paths.
fn largest_bytes_per_token_vocab(f: Framework, d: Dtype) -> f64 {
    match f {
        Framework::Hf => 4.0,
        Framework::Lightning | Framework::Generic if d.is_mixed() => 4.0,
        _ => compute_bytes(d),
    }
}
