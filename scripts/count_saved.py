"""Counts the bytes autograd saves for backward per token and per
transformer block, on the CPU, for the model code of Hugging Face
transformers (+ PEFT, + bitsandbytes for QLoRA), litgpt and torchtune.

Why: the activation part of gpufit's memory model is a list of the tensors
each block saves (crates/gpufit-core/src/memory/activations.rs). Which tensors a block
saves is decided by the framework's Python code and PyTorch's autograd
formulas, not by the GPU, so it can be counted without a GPU:
`torch.autograd.graph.saved_tensors_hooks` sees every tensor saved during
the forward pass. Each distinct storage that is not a parameter or buffer
is counted once (views of one storage are one allocation). A model is
built with one and with two blocks; the difference, divided by the tokens,
is one block's bytes per token.

What differs on a GPU: the attention kernel's own saved tensors (CUDA
flash/efficient attention keep q, k, v, the output and a log-sum-exp, like
the CPU flash kernel; the math fallback keeps the scores) and autocast's
op lists (CPU and CUDA autocast differ). Plain-dtype rows run on the CPU;
autocast (bf16-mixed) rows run on fake CUDA tensors under CUDA's autocast
state (see `autocast_block`), with eager attention. Random weights, built
from config numbers; nothing is downloaded.

Usage (a Python with torch, transformers, peft, bitsandbytes, litgpt,
torchtune and torchao):

    python scripts/count_saved.py --out bench/data/saved_tensors.jsonl
"""

import argparse
import gc
import json
import os
import sys

import torch

SEQ = 256
# BERT's position embeddings stop at 512; its published runs use 512.
ENCODER_SEQ = 512

# Config numbers as the models' published config.json give them (the same
# as scripts/gpu_measure.py), with the vocabulary cut: it does not change a
# block.
HF = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                       num_attention_heads=32, num_key_value_heads=8),
    "phi-3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                       num_attention_heads=32, num_key_value_heads=32),
    "pythia-1.4b": dict(model_type="gpt_neox", hidden_size=2048, intermediate_size=8192,
                        num_attention_heads=16, rotary_pct=0.25, use_parallel_residual=True,
                        hidden_act="gelu"),
    "phi-2": dict(model_type="phi", hidden_size=2560, intermediate_size=10240,
                  num_attention_heads=32, partial_rotary_factor=0.4, hidden_act="gelu_new"),
    "gpt2-medium": dict(model_type="gpt2", n_embd=1024, n_layer=1, n_head=16,
                        activation_function="gelu_new"),
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       query_pre_attn_scalar=256, sliding_window=4096),
    # Falcon-7B: one shared K/V head, parallel attention and MLP from one
    # norm; its SDPA call passes a mask, so CUDA and the CPU both run the
    # math kernel there
    "falcon-7b": dict(model_type="falcon", hidden_size=4544, num_attention_heads=71,
                      multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                      bias=False, alibi=False, activation="gelu"),
    # Gemma 1 in transformers (GeGLU, (1 + w) norms)
    "gemma-2b": dict(model_type="gemma", hidden_size=2048, intermediate_size=16384,
                     num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                     hidden_act="gelu_pytorch_tanh"),
    # a mixture of experts: 8 experts, top-2 routing (transformers 5 keeps
    # the experts as 3D tensors and runs them grouped by expert)
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2),
}
PEFT_QV = {"llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"],
           "mistral": ["q_proj", "v_proj"], "phi3": ["qkv_proj"],
           "gpt_neox": ["query_key_value"], "phi": ["q_proj", "v_proj"],
           "gpt2": ["c_attn"], "gemma2": ["q_proj", "v_proj"], "mixtral": ["q_proj", "v_proj"],
           "falcon": ["query_key_value"], "gemma": ["q_proj", "v_proj"],
           "t5": ["q", "v"]}
# (litgpt's falcon-7b is left out: its fp32 rows need more than the 24 GB
# of RAM this was run with.)
LITGPT = {"phi-1_5": "microsoft/phi-1_5", "stablelm-base-alpha-3b": "stabilityai/stablelm-base-alpha-3b",
          "Llama-3.2-1B": "meta-llama/Llama-3.2-1B", "Llama-2-7b-hf": "meta-llama/Llama-2-7b-hf",
          "gemma-2b": "google/gemma-2b"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
QLORA = ["llama-3.2-1b", "qwen2.5-0.5b", "phi-3-mini", "pythia-1.4b", "phi-2"]
# Encoders (AutoModelForSequenceClassification), by their hub id: the
# config numbers are bench/data/configs/<owner>__<name>.json's.
# Encoder-decoders (T5ForConditionalGeneration): one more layer adds an
# encoder and a decoder block; the row is their mean, as gpufit counts T5's
# layers (encoder + decoder blocks).
SEQ2SEQ = {"t5-base": ("google-t5/t5-base", dict(model_type="t5", d_model=768, d_ff=3072,
                                                  num_heads=12, d_kv=64))}
ENCODERS = {
    "bert-large": ("google-bert/bert-large-uncased",
                   dict(model_type="bert", hidden_size=1024, intermediate_size=4096,
                        num_attention_heads=16)),
    "distilbert-base": ("distilbert/distilbert-base-uncased",
                        dict(model_type="distilbert", dim=768, hidden_dim=3072, n_heads=12)),
}
# Per family: its config's names for the width, the heads, the layers and
# the attention dropout, and how many hidden-wide dropouts a block runs
# (BERT: attention output and output; DistilBERT: the FFN's).
ENCODER_KEYS = {"bert": ("hidden_size", "num_attention_heads", "num_hidden_layers",
                         "attention_probs_dropout_prob", 2),
                "distilbert": ("dim", "n_heads", "n_layers", "attention_dropout", 1)}
TORCHTUNE = {"llama3_2-1b": ("meta-llama/Llama-3.2-1B",
                             dict(num_heads=32, num_kv_heads=8, embed_dim=2048, intermediate_dim=8192))}


def saved_bytes(run, params):
    seen = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            p = st.data_ptr()
        except RuntimeError:
            # a tensor subclass without one storage (torchao's NF4Tensor
            # weight): a frozen parameter, not an activation
            return t
        if p not in params and p not in seen:
            seen[p] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    # Custom autograd Functions may keep tensors on their ctx instead of
    # `save_for_backward` (bitsandbytes' MatMul4Bit before 0.43.2 kept its
    # input in `ctx.tensors`): the hooks do not see those, so walk the graph.

    def keep(v):
        if isinstance(v, torch.Tensor):
            pack(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                keep(x)

    roots = [o.grad_fn for o in (out if isinstance(out, list) else [out.logits])]
    stack, nodes = roots, set()
    while stack:
        n = stack.pop()
        if n is None or n in nodes:
            continue
        nodes.add(n)
        for v in getattr(n, "__dict__", {}).values():
            keep(v)
        stack.extend(f for f, _ in n.next_functions)
    return sum(seen.values())


# Rows whose CPU kernel saves what CUDA's does not (the bench lists them
# unscored, with the reason).
NOT_SCORED = {("gpt2-medium", "sdpa"): "on the CPU, SDPA keeps copies of k and v, the views of GPT-2's "
              "fused c_attn output (q's view keeps the whole output); whether CUDA's memory-efficient "
              "kernel copies them too is not known without a GPU, so the model keeps the no-copy term "
              "of the other families' SDPA path (the eager rows, where matmul's reshape copies k and v "
              "on any device, are scored)"}

# transformers' Falcon hands SDPA an explicit mask with its single K/V head:
# CUDA runs PyTorch's math kernel there (measured on the H100: Falcon-7B LoRA
# at 2,048 tokens holds the size of eager scores, bench/data/h100/
# holdout.csv), while the CPU's flash kernel would take the mask; its SDPA
# rows are counted with the math backend forced, the composite CUDA runs.
MATH_SDPA = {"falcon-7b"}


def cuda_runs_math(name, method, dtype, attention):
    """Whether CUDA runs PyTorch's math SDPA for this HF row: Falcon's mask
    (above), or fp32 q, k and v (fp32 training, or the QLoRA recipe without
    autocast, whose bitsandbytes projections hand back fp32) with grouped
    K/V heads: the flash and cuDNN kernels take only 16-bit inputs, and the
    memory-efficient one not the `enable_gqa=True` transformers passes
    (measured on an H200, bench/data/h200/qlora.csv: QLoRA on Llama-3.2-1B
    without autocast keeps a score matrix per layer). The CPU's flash
    kernel takes all of these, so such rows are counted with the math
    backend forced, the composite CUDA runs."""
    if attention != "sdpa":
        return False
    if name in MATH_SDPA:
        return True
    cfg = HF.get(name, {})
    heads = cfg.get("num_attention_heads", cfg.get("n_head", 0))
    grouped = cfg.get("num_key_value_heads", heads) < heads
    return grouped and (dtype == "fp32" or method == "qlora")

# CUDA's fp32 SDPA is the memory-efficient kernel, whose output does not
# follow q's layout as the CPU's flash kernel's does.
for _n in ("phi-3-mini", "pythia-1.4b", "phi-2"):
    NOT_SCORED[(_n, "sdpa", "full", "fp32")] = (
        "on the CPU the flash kernel allocates its output like q, which these families lay out "
        "head-major (partial rotary's torch.cat, or RoPE on a slice of the fused qkv), so the output "
        "projection keeps a contiguous copy; in fp32 CUDA runs the memory-efficient kernel instead, "
        "whose output is (batch, seq, heads, dim) whatever q's layout (the copy is a view there), so "
        "the model leaves it out for fp32 (the bf16 rows, where CUDA's flash kernel also follows q, "
        "are scored)")

ALL_LINEAR = "q,k,v,o,gate,up,down"
PEFT_ALL = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def hf_block(name, method, dtype, attention, targets=None):
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(HF[name])
    mt = kw.pop("model_type")
    # GPT-2 keeps dropout (0.1) on the attention probabilities and both
    # residual branches. The CPU's SDPA with dropout runs the math kernel,
    # which keeps the scores, while CUDA's memory-efficient kernel keeps
    # only its RNG state: SDPA rows are counted without attention dropout.
    # The masks (the input's dtype on the CPU, one byte on CUDA) per token
    # and block are returned for the bench to convert.
    extra, mask = {}, 0
    if mt == "gpt2":
        if attention == "sdpa":
            extra["attn_pdrop"] = 0.0
        mask = 2 * kw["n_embd"] + (kw["n_head"] * SEQ if attention == "eager" else 0)
    out = []
    for layers in (1, 2):
        key = "n_layer" if mt == "gpt2" else "num_hidden_layers"
        cfg = AutoConfig.for_model(mt, **dict(kw, vocab_size=1024, pad_token_id=0, **extra,
                                              **{key: layers}))
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype], attn_implementation=attention)
        if method == "qlora":
            # The HF QLoRA recipe: load the base in 4 bits (bitsandbytes NF4,
            # bf16 compute), then `prepare_model_for_kbit_training`.
            import tempfile
            from peft import prepare_model_for_kbit_training
            from transformers import BitsAndBytesConfig
            with tempfile.TemporaryDirectory() as d:
                m.save_pretrained(d)
                del m
                q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                       bnb_4bit_compute_dtype=torch.bfloat16,
                                       bnb_4bit_use_double_quant=True)
                m = AutoModelForCausalLM.from_pretrained(d, quantization_config=q, device_map="cpu",
                                                         dtype=DTYPES[dtype],
                                                         attn_implementation=attention)
            m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=False)
        if method in ("lora", "qlora"):
            from peft import LoraConfig, get_peft_model
            m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=PEFT_ALL[mt] if targets else PEFT_QV[mt]))
        m.train()
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        params |= {b.untyped_storage().data_ptr() for b in m.buffers()}
        x = torch.randint(0, 1024, (1, SEQ))
        if cuda_runs_math(name, method, dtype, attention):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.MATH):
                out.append(saved_bytes(lambda: m(input_ids=x), params))
        else:
            out.append(saved_bytes(lambda: m(input_ids=x), params))
        del m
        gc.collect()
    config = dict(HF[name], num_hidden_layers=2, vocab_size=1024)
    return (out[1] - out[0]) / SEQ, config, mask


# Autocast rows: CUDA's autocast op lists (which ops run in 16 bits, which
# in fp32) differ from the CPU's, so they are counted on fake CUDA tensors
# (`FakeTensorMode`: shapes and dtypes, no memory, no GPU) with CUDA's
# autocast state switched on by hand (`torch.autocast` refuses without a
# GPU). Eager attention only: without a GPU PyTorch cannot pick a fused SDPA
# kernel. Autocast's 16-bit weight casts are what gpufit counts as weights
# (`weights_transient_a`), so a 16-bit tensor shaped like a weight (or its
# transpose) is left out; 192 tokens keep activations off weight shapes.
AUTOCAST_SEQ = 192
AUTOCAST = ["llama-3.2-1b", "qwen2.5-0.5b", "mistral-7b", "phi-3-mini", "pythia-1.4b", "phi-2",
            "gpt2-medium", "gemma-2-2b", "falcon-7b", "gemma-2b"]


def autocast_block(name, method, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM,
                              AutoModelForSequenceClassification)
    adtype = torch.float16 if dtype == "fp16-mixed" else torch.bfloat16
    pairs = 1
    if name in HF:
        kw = dict(HF[name])
        mt = kw.pop("model_type")
        key = "n_layer" if mt == "gpt2" else "num_hidden_layers"
        build, extra, where = AutoModelForCausalLM, dict(pad_token_id=0), None
    elif name in ENCODERS:
        hub, kw = ENCODERS[name]
        kw = dict(kw)
        mt = kw.pop("model_type")
        key = ENCODER_KEYS[mt][2]
        build, extra, where = AutoModelForSequenceClassification, {}, hub
    else:
        hub, kw = SEQ2SEQ[name]
        kw = dict(kw)
        mt = kw.pop("model_type")
        key, pairs = "num_layers", 2
        build, extra, where = AutoModelForSeq2SeqLM, dict(decoder_start_token_id=0, pad_token_id=0), hub
    out = []
    for layers in (1, 2):
        cfg = AutoConfig.for_model(mt, **dict(kw, vocab_size=1024, **extra, **{key: layers}))
        with FakeTensorMode(), torch.device("cuda"):
            m = build.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
            if method == "lora":
                from peft import LoraConfig, get_peft_model
                # everything is already on the (fake) GPU; PEFT's moves
                # would swap fake parameters, which torch refuses
                to = torch.nn.Module.to
                torch.nn.Module.to = lambda self, *a, **k: self
                try:
                    m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules=PEFT_QV[mt]))
                finally:
                    torch.nn.Module.to = to
            m.train()
            params = {p.untyped_storage()._cdata for p in m.parameters()}
            params |= {b.untyped_storage()._cdata for b in m.buffers()}
            weights = {tuple(p.shape) for p in m.parameters() if p.dim() == 2}
            weights |= {s[::-1] for s in weights}
            seen = {}

            def pack(t):
                c = t.untyped_storage()._cdata
                if c not in params and c not in seen:
                    cast = t.dim() == 2 and tuple(t.shape) in weights and t.dtype == adtype
                    seen[c] = 0 if cast else t.untyped_storage().nbytes()
                return t

            x = torch.randint(0, 1024, (1, AUTOCAST_SEQ))
            args = dict(input_ids=x, labels=x) if pairs == 2 else dict(input_ids=x)
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", adtype)
            torch.autocast_increment_nesting()
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    m(**args)
            finally:
                torch.autocast_decrement_nesting()
                torch.set_autocast_enabled("cuda", False)
                torch.clear_autocast_cache()
            out.append(sum(seen.values()))
        del m
        gc.collect()
    if where is None:
        where = dict(HF[name], num_hidden_layers=2, vocab_size=1024)
    # a T5 layer is half of an encoder block plus a decoder block
    return (out[1] - out[0]) / AUTOCAST_SEQ / pairs, where


def encoder_block(name, dtype, attention):
    """A BERT (or DistilBERT) block in training mode, its dropouts (0.1)
    on. The CPU's SDPA with dropout falls back to the math kernel, which
    keeps the scores;
    CUDA's memory-efficient kernel keeps only its RNG state, so SDPA rows are
    counted without the attention dropout (the CUDA block does not depend on
    it). The dropout masks the row reports are kept in the input's dtype on
    the CPU and in one byte on CUDA: per token and block, the attention
    probabilities' (heads x seq, eager only) and the hidden-wide ones
    (`ENCODER_KEYS`)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    hub, kw = ENCODERS[name]
    kw = dict(kw)
    mt = kw.pop("model_type")
    width, heads, layers_key, attn_drop, hidden_masks = ENCODER_KEYS[mt]
    if attention == "sdpa":
        kw[attn_drop] = 0.0
    out = []
    for layers in (1, 2):
        cfg = AutoConfig.for_model(mt, **dict(kw, vocab_size=1024, **{layers_key: layers}))
        torch.manual_seed(0)
        m = AutoModelForSequenceClassification.from_config(cfg, dtype=DTYPES[dtype],
                                                           attn_implementation=attention)
        m.train()
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        params |= {b.untyped_storage().data_ptr() for b in m.buffers()}
        x = torch.randint(0, 1024, (1, ENCODER_SEQ))
        out.append(saved_bytes(lambda: m(input_ids=x), params))
        del m
        gc.collect()
    mask = hidden_masks * kw[width] + (kw[heads] * ENCODER_SEQ if attention == "eager" else 0)
    return (out[1] - out[0]) / ENCODER_SEQ, hub, mask


def seq2seq_block(name, method, dtype):
    """A T5 encoder block and a decoder block (dropout 0.1 on), eager
    attention: the CPU's SDPA with T5's relative-position bias as a float
    mask runs the math kernel. Labels are the inputs, so the decoder runs
    as many tokens as the encoder. The dropout masks, in the input's dtype
    on the CPU and one byte on CUDA, per token and pair of blocks: the
    three attentions' probabilities (heads x seq each), five residual
    branches (d_model each) and the two feed-forward activations (d_ff)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM
    hub, kw = SEQ2SEQ[name]
    kw = dict(kw)
    mt = kw.pop("model_type")
    out = []
    for layers in (1, 2):
        cfg = AutoConfig.for_model(mt, **dict(kw, vocab_size=1024, num_layers=layers,
                                              decoder_start_token_id=0, pad_token_id=0))
        torch.manual_seed(0)
        m = AutoModelForSeq2SeqLM.from_config(cfg, dtype=DTYPES[dtype], attn_implementation="eager")
        if method == "lora":
            from peft import LoraConfig, get_peft_model
            m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=PEFT_QV[mt]))
        m.train()
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        params |= {b.untyped_storage().data_ptr() for b in m.buffers()}
        x = torch.randint(0, 1024, (1, SEQ))
        out.append(saved_bytes(lambda: m(input_ids=x, labels=x), params))
        del m
        gc.collect()
    mask = 3 * kw["num_heads"] * SEQ + 5 * kw["d_model"] + 2 * kw["d_ff"]
    return (out[1] - out[0]) / SEQ / 2, hub, mask / 2


def litgpt_block(name, method, dtype, targets=None):
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    out = []
    for layers in (1, 2):
        kw = dict(n_layer=layers)
        if method == "lora":
            # litgpt/finetune/lora.py defaults: r 8, alpha 16, dropout 0.05, q and v
            kw.update(lora_r=8, lora_alpha=16, lora_dropout=0.05, lora_query=True, lora_value=True)
            if targets:
                kw.update(lora_key=True, lora_projection=True, lora_mlp=True)
        cfg = Config.from_name(name, **kw)
        torch.set_default_dtype(DTYPES[dtype])
        torch.manual_seed(0)
        m = GPT(cfg)
        torch.set_default_dtype(torch.float32)
        if method == "lora":
            mark_only_lora_as_trainable(m)
        m.train()
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        params |= {b.untyped_storage().data_ptr() for b in m.buffers()}
        x = torch.randint(0, cfg.padded_vocab_size, (1, SEQ))
        out.append(saved_bytes(lambda: m(x, lm_head_chunk_size=128), params))
        del m
        gc.collect()
    # The block's numbers are the published model's: bench/data/configs/
    # or gpufit's catalog has them under this id. The LoRA rows' one dropout
    # (the fused qkv adapter's input) keeps an n_embd-wide mask, which the
    # CPU stores in the input's dtype and CUDA in one byte.
    # With every linear adapted each adapter drops its own input: the qkv
    # input (n_embd), the attention projection's (n_head * head_size), the
    # MLP input once per MLP input linear (n_embd each: fc_1 and fc_2, or
    # fc) and the MLP projection's (intermediate_size).
    if method != "lora":
        mask = 0
    elif targets:
        mlp_in = 2 if cfg.mlp_class_name in ("LLaMAMLP", "GemmaMLP") else 1
        mask = cfg.n_embd + cfg.n_head * cfg.head_size + mlp_in * cfg.n_embd + cfg.intermediate_size
    else:
        mask = cfg.n_embd
    return (out[1] - out[0]) / SEQ, LITGPT[name], mask


def torchtune_block(name, method, dtype):
    # torchtune's own builders (its recipes' model components), q and v
    # adapters of rank 8; QLoRA keeps the adapted linears in torchao NF4.
    from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    class Out:  # saved_bytes walks `out.logits`
        def __init__(self, t):
            self.logits = t

    out = []
    for layers in (1, 2):
        kw = dict(TORCHTUNE[name][1], vocab_size=1024, num_layers=layers, max_seq_len=4096)
        torch.set_default_dtype(DTYPES[dtype])
        torch.manual_seed(0)
        if method == "full":
            m = llama3_2(**kw)
        else:
            m = lora_llama3_2(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16,
                              quantize_base=method == "qlora", **kw)
            set_trainable_params(m, get_adapter_params(m))
        torch.set_default_dtype(torch.float32)
        m.train()
        params = set()
        for p in list(m.parameters()) + list(m.buffers()):
            try:
                params.add(p.untyped_storage().data_ptr())
            except RuntimeError:
                pass  # NF4Tensor weights
        x = torch.randint(0, 1024, (1, SEQ))
        out.append(saved_bytes(lambda: Out(m(x)), params))
        del m
        gc.collect()
    return (out[1] - out[0]) / SEQ, TORCHTUNE[name][0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--recount-math", action="store_true",
                    help="count again, in place, the rows CUDA runs on the math SDPA kernel "
                         "(cuda_runs_math) and that were counted with the CPU's flash kernel")
    args = ap.parse_args()
    import transformers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import peft
        versions["peft"] = peft.__version__
    except ImportError:
        pass
    from importlib.metadata import version
    for pkg in ("litgpt", "bitsandbytes", "torchtune", "torchao"):
        try:
            versions[pkg] = version(pkg)
        except Exception:
            pass
    # Appends row by row and skips what the file already holds, so a run
    # that stops (memory, time) resumes where it stopped.
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    done.add((r["framework"], r["model"], r["method"], r["dtype"], r["attention"],
                              r.get("lora_targets")))
    # (Mixtral's fp32 blocks need more than the 24 GB of RAM this was run
    # with: bf16 only.)
    grid = [("hf", n, m, d, a, None) for n in HF for m in ("full", "lora") for d in ("bf16", "fp32")
            for a in ("sdpa", "eager") if not (n == "mixtral-8x7b" and d == "fp32")]
    grid += [("litgpt", n, m, d, "sdpa", None) for n in LITGPT for m in ("full", "lora")
             for d in ("bf16", "fp32")]
    # every linear adapted (litgpt's config hub; PEFT's "all-linear")
    grid += [("litgpt", n, "lora", "bf16", "sdpa", ALL_LINEAR) for n in ("Llama-3.2-1B", "gemma-2b")]
    grid += [("hf", "llama-3.2-1b", "lora", "bf16", "sdpa", ALL_LINEAR)]
    # QLoRA through transformers + PEFT + bitsandbytes (the 4-bit base runs
    # on the CPU since bitsandbytes 0.48); bf16 compute, no autocast.
    grid += [("hf", n, "qlora", "bf16", a, None) for n in QLORA for a in ("sdpa", "eager")]
    grid += [("torchtune", n, m, "bf16", "sdpa", None) for n in TORCHTUNE
             for m in ("full", "lora", "qlora")]
    grid += [("hf", n, m, "bf16-mixed", "eager", None) for n in AUTOCAST for m in ("full", "lora")]
    grid += [("hf", n, "full", "fp16-mixed", "eager", None) for n in ENCODERS]
    grid += [("hf", n, m, "bf16-mixed", "eager", None) for n in SEQ2SEQ for m in ("full", "lora")]
    grid += [("hf", n, m, d, "eager", None) for n in SEQ2SEQ for m in ("full", "lora")
             for d in ("bf16", "fp32")]
    # encoders: HF's BERT, eager (the scores) and SDPA
    grid += [("hf", n, "full", d, a, None) for n in ENCODERS for d in ("bf16", "fp32")
             for a in ("sdpa", "eager")]
    recount = set()
    if args.recount_math:
        recount = {k for k in done if k[0] == "hf" and k[1] not in MATH_SDPA
                   and cuda_runs_math(k[1], k[2], k[3], k[4])}
        done -= recount
    replaced = {}
    for fw, name, method, dtype, attention, targets in grid:
        if (fw, name, method, dtype, attention, targets) in done:
            continue
        seq = SEQ
        if fw == "hf" and dtype.endswith("-mixed"):
            b, cfg = autocast_block(name, method, dtype)
            where = dict(config=cfg) if isinstance(cfg, dict) else dict(hf_model=cfg)
            seq = AUTOCAST_SEQ
        elif fw == "hf" and name in SEQ2SEQ:
            b, cfg, mask = seq2seq_block(name, method, dtype)
            where = dict(hf_model=cfg, cpu_mask_elems_per_token_layer=mask)
        elif fw == "hf" and name in ENCODERS:
            b, cfg, mask = encoder_block(name, dtype, attention)
            where = dict(hf_model=cfg, cpu_mask_elems_per_token_layer=mask)
            seq = ENCODER_SEQ
        elif fw == "hf":
            try:
                b, cfg, mask = hf_block(name, method, dtype, attention, targets)
            except ValueError as e:
                # e.g. Gemma 2 has no SDPA path in recent transformers
                print(f"skipped {name} {attention}: {str(e)[:100]}", flush=True)
                continue
            where = dict(config=cfg)
            if mask:
                where["cpu_mask_elems_per_token_layer"] = mask
        elif fw == "torchtune":
            b, cfg = torchtune_block(name, method, dtype)
            where = dict(hf_model=cfg)
        else:
            b, cfg, mask = litgpt_block(name, method, dtype, targets)
            where = dict(hf_model=cfg)
            if mask:
                where["cpu_mask_elems_per_token_layer"] = mask
        if targets:
            where["lora_targets"] = targets
        row = dict(framework=fw, model=name, method=method, dtype=dtype, attention=attention,
                   seq_len=seq, **where, bytes_per_token_layer=round(b, 1), **versions)
        for key in ((name, attention), (name, attention, method, dtype)):
            if key in NOT_SCORED:
                row.update(scored=False, why=NOT_SCORED[key])
        key = (fw, name, method, dtype, attention, targets)
        if key in recount:
            replaced[key] = row
        else:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    if replaced:
        # the recounted rows where the old ones were
        with open(args.out) as f:
            lines = [line for line in f if line.strip()]
        with open(args.out, "w") as f:
            for line in lines:
                r = json.loads(line)
                k = (r["framework"], r["model"], r["method"], r["dtype"], r["attention"],
                     r.get("lora_targets"))
                f.write(json.dumps(replaced[k]) + "\n" if k in replaced else line)


if __name__ == "__main__":
    sys.exit(main())
