//! T5's blocks (transformers' `modeling_t5.py`), the one encoder–decoder
//! family in the catalog. gpufit counts an encoder–decoder's layers as
//! encoder plus decoder blocks, so a "layer" here is the mean of one
//! encoder block and one decoder block: two self-attentions and one
//! cross-attention over the pair, five norms, five residual dropouts and
//! two feed-forward blocks. Counted with autograd's saved-tensor hooks on
//! T5-base (bench/data/saved_tensors.jsonl, `cargo bench --bench
//! saved_tensors`; full and LoRA, bf16 and fp32 on the CPU and bf16-mixed
//! on fake CUDA tensors under CUDA's autocast, eager attention).

use crate::settings::EngineeringSettings;
use crate::workload::{Attention, LoraTarget, Method, Workload};

use super::precision::{activation_dtype, compute_bytes, param_bytes};
use super::types::{LayerActs, ModelOptions};

/// One encoder block and one decoder block make the pair the terms below
/// add up; a layer is half of it. Every released T5 config has
/// `dropout_rate` 0.1, on the attention probabilities, after the ReLU and
/// on each residual branch: its masks are counted throughout.
const BLOCKS_PER_PAIR: f64 = 2.0;

/// Two self-attentions and one cross-attention over the pair.
const ATTENTIONS_PER_PAIR: f64 = 3.0;

/// A T5 layer's [`LayerActs`]: the terms of an encoder block and a
/// decoder block, halved.
pub(super) fn t5_layer(w: &Workload, s: &EngineeringSettings, opts: &ModelOptions) -> LayerActs {
    let a = &w.model;
    let dtype = activation_dtype(w, s, opts);
    let e = compute_bytes(dtype);
    let mixed = dtype.is_mixed();
    // the residual stream: fp32 under autocast (fp32 parameters)
    let r = param_bytes(dtype);
    let h = a.hidden_size as f64;
    let qd = a.num_attention_heads as f64 * a.head_dim as f64;
    let heads = a.num_attention_heads as f64;
    let i = a.intermediate_size as f64;
    let full = w.method == Method::Full;
    let targets: &[LoraTarget] = w.lora.as_ref().map(|l| l.targets.as_slice()).unwrap_or(&[]);
    let trains = |t: LoraTarget| full || targets.contains(&t);
    let rank = w.lora.as_ref().map(|l| l.rank as f64).unwrap_or(0.0);
    // PEFT keeps adapters in fp32 and each casts its own input on a 16-bit
    // base; in fp32 they save the input they share.
    let peft_cast = !full && e < 4.0;
    let adapter_input = if mixed { e } else { 4.0 };

    let mut pair = 0.0;
    let mut pair_per_seq = 0.0;

    // --- five T5LayerNorms (RMS, no mean): `x.to(float32).pow(2)` saves
    // the fp32 input (a copy when x is 16-bit, which `x * rsqrt` also
    // saves), rsqrt one fp32 per token; `weight * x_normed` saves the
    // normalised value (cast to 16 bits in pure 16-bit training) only when
    // the weight trains.
    let upcast = if r < 4.0 { 4.0 + r } else { 4.0 };
    let scaled = if !full {
        0.0
    } else if r < 4.0 {
        e
    } else {
        4.0
    };
    pair += 5.0 * ((upcast + scaled) * h + 4.0);
    // Each norm's output feeds linears (self-attention: q, k, v; cross:
    // q; feed-forward: wi, or wi_0 and wi_1): saved once when they train in
    // a pure dtype, once per linear under autocast (each casts it).
    let ff_in = if a.gated_mlp { 2.0 } else { 1.0 };
    if full {
        let consumers = if mixed {
            2.0 * 3.0 + 1.0 + 2.0 * ff_in
        } else {
            5.0
        };
        pair += consumers * e * h;
        if mixed {
            // the cross-attention's k and v cast the (fp32) encoder output
            pair += 2.0 * e * h;
        }
    }

    // --- three attentions (two self, one cross), each over `seq` keys ---
    let attn = ATTENTIONS_PER_PAIR;
    if w.attention == Attention::Eager {
        // q·kᵀ saves q and k, PV saves v …
        pair += attn * 3.0 * e * qd;
        // … softmax keeps its output (in the scores' dtype: T5's eager
        // code does not upcast; fp32 under autocast), dropout its mask, and
        // PV the dropped probabilities (autocast's 16-bit cast of them).
        let probs = if mixed { 4.0 + 1.0 + e } else { 2.0 * e + 1.0 };
        pair_per_seq += attn * probs * heads;
    } else {
        // the memory-efficient kernel (T5's position bias as a float mask):
        // q, k, v, the output and an fp32 log-sum-exp per head
        pair += attn * (4.0 * e * qd + 4.0 * heads);
    }
    if trains(LoraTarget::O) && !peft_cast {
        // o's input: the transposed, contiguous attention output
        pair += attn * e * qd;
    }
    // --- five residual dropouts: a 1-byte mask each ---
    pair += 5.0 * h;

    // --- two feed-forward blocks: ReLU keeps its output (gated-GELU: the
    // gelu input, its output and the linear branch), dropout its mask, and
    // wo the dropped activations when it trains.
    let act = if a.gated_mlp { 3.0 } else { 1.0 };
    pair += BLOCKS_PER_PAIR
        * ((act * e + 1.0) * i + if trains(LoraTarget::Down) { e * i } else { 0.0 });

    if !full {
        adapters(targets, peft_cast, adapter_input, h, rank, &mut pair);
    }

    let (bt, bt_seq) = backward_transients(w, mixed, e, r, h, i, heads);
    LayerActs {
        saved: pair / BLOCKS_PER_PAIR,
        saved_per_seq: pair_per_seq / BLOCKS_PER_PAIR,
        backward_transient: bt,
        backward_transient_per_seq: bt_seq,
        transient_per_seq_one_size: false,
        // T5's blocks are not split by width: no segment packing counted.
        saved_wide: pair / BLOCKS_PER_PAIR,
        // nor tested against the cached gradient blocks (`allocator::eval`)
        wide_tensor: 0.0,
    }
}

/// Adds the LoRA adapters' saved inputs and A outputs over the pair to
/// `pair` (PEFT matches q and v in all three attentions); an adapter's
/// input is `input` bytes per element, `h` elements per token.
fn adapters(
    targets: &[LoraTarget],
    peft_cast: bool,
    input: f64,
    h: f64,
    rank: f64,
    pair: &mut f64,
) {
    let attn = ATTENTIONS_PER_PAIR;
    let per_attn = [LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O]
        .iter()
        .filter(|t| targets.contains(t))
        .count() as f64;
    let adapters = attn * per_attn;
    if peft_cast {
        // every adapter's own fp32 cast of its input
        *pair += adapters * input * h;
    } else {
        // the norm outputs the q adapters share (the cross-attention's
        // k and v read the encoder output, kept once for all layers)
        let self_inputs = if targets
            .iter()
            .any(|t| matches!(t, LoraTarget::Q | LoraTarget::K | LoraTarget::V))
        {
            2.0
        } else {
            0.0
        };
        let cross_q = if targets.contains(&LoraTarget::Q) {
            1.0
        } else {
            0.0
        };
        *pair += (self_inputs + cross_q) * input * h;
    }
    // each adapter's A output (rank wide, fp32) is saved by B
    *pair += adapters * 4.0 * rank;
}

/// Backward of one block: the residual gradient (twice while the
/// branches add), the feed-forward gradients, and in eager attention the
/// probabilities' gradients (softmax's and dropout's backward).
fn backward_transients(
    w: &Workload,
    mixed: bool,
    e: f64,
    r: f64,
    h: f64,
    i: f64,
    heads: f64,
) -> (f64, f64) {
    let bt = 2.0 * r * h + 2.0 * e * i;
    let bt_seq = if w.attention == Attention::Eager {
        if mixed {
            (4.0 + 2.0 * e) * heads
        } else {
            2.0 * e * heads
        }
    } else {
        0.0
    };
    (bt, bt_seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Dtype;
    use crate::workload::Framework;

    /// Bytes per token and layer counted with saved-tensor hooks on the
    /// CPU (transformers 5.23 + PEFT 0.21.2 with q and v adapters of rank
    /// 8, T5-base, 256 tokens, eager; the CPU's
    /// dropout masks turned into CUDA's 1-byte ones): an encoder block
    /// plus a decoder block, halved.
    #[test]
    fn t5_base_layer_saves_what_autograd_was_counted_saving() {
        for (method, dtype, counted) in [
            (Method::Full, Dtype::Bf16, 68_746.0),
            (Method::Full, Dtype::Fp32, 112_522.0),
            (Method::Lora, Dtype::Bf16, 61_930.0),
            (Method::Lora, Dtype::Fp32, 84_970.0),
        ] {
            let mut w = super::super::tests::workload("google-t5/t5-base", method);
            if let Some(l) = w.lora.as_mut() {
                l.rank = 8;
            }
            w.seq_len = 256;
            w.framework = Framework::Hf;
            w.attention = Attention::Eager;
            let s = super::super::tests::settings(1, dtype, false);
            let la = t5_layer(&w, &s, &ModelOptions::default());
            let model = la.saved + la.saved_per_seq * w.seq_len as f64;
            assert!(
                (model - counted).abs() / counted < 0.001,
                "{method:?} {dtype:?}: model {model} counted {counted}"
            );
        }
    }
}
