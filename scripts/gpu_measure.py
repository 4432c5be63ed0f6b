#!/usr/bin/env python3
"""Measure real peak GPU memory of training steps, for gpufit's accuracy benchmark.

Builds models from their architecture numbers (written inline below, the same
numbers as each model's published config.json; nothing is downloaded, weights
are random and created directly on the GPU), runs a few real training steps
for every point of a grid, and writes one CSV line per point with the three
quantities people measure:

    allocated_bytes  torch.cuda.max_memory_allocated()
    reserved_bytes   torch.cuda.max_memory_reserved()
    device_bytes     reserved + this process's CUDA context (what nvidia-smi shows)

plus, for the hand-written loop, the peak of each phase of the last step
(`fwd_peak`, `bwd_peak`, `step_peak`: max allocated during the forward, the
backward and the optimizer step) and the allocated bytes after the forward
and after the backward — which phase sets the peak, and by how much.

Two loops:
  loop=manual   `model(input_ids, labels=...)` (transformers' loss), backward,
                torch.optim.AdamW (default foreach implementation; or
                transformers' Adafactor, or bitsandbytes AdamW8bit),
                zero_grad(set_to_none=True). dtype "bf16" keeps parameters in
                bf16; "bf16-mixed"/"fp16-mixed" keep fp32 parameters under
                torch.autocast (fp16 with a GradScaler); "fp32" is plain fp32.
  loop=trainer  transformers' `Trainer` itself on an fp32-loaded model with
                `bf16=True` (its default optimizer, recorded in optimizer_impl).
Both time steps 2..N for tokens_per_sec (the Trainer's with a callback at
each step's end), and write which steps they timed in `timed`.

Points run one after another in one process. After each point returns (its
frame, and with it every tensor it made, is gone), `gc.collect()` and
`torch.cuda.empty_cache()` return the cached segments, so each point starts
from an empty allocator; `reserved_at_start` records what the allocator held
when the point began (0 when that worked). Files measured before this
column existed released the cache while the point's model was still
referenced (`fwd_model`, `params`), so their points began with the previous
point's weights cached: see bench/data/h100/README.md. A point that runs out of memory is
recorded with status "oom". The config.json of every model used is written
to bench/data/configs/<owner>__<name>.json so the benchmark can read
models that are not in gpufit's catalog.

Usage (on a GPU machine with torch, transformers, peft):
    python scripts/gpu_measure.py --grid families --out bench/data/h100/families.csv
    python scripts/gpu_measure.py --grid quick
    python scripts/gpu_measure.py --grid families --budget-s 480   # stop starting points after 480 s
    python scripts/gpu_measure.py --grid allocator --trace /tmp/traces --out allocator.csv
    python scripts/gpu_measure.py --grid qlora --out qlora.csv   # needs bitsandbytes
    python scripts/gpu_measure.py --points bench/data/synthetic/grid.csv --out measured.csv

Beside the peaks, each manual-loop row records the allocator's own
statistics (torch.cuda.memory_stats): alloc_retries (cudaMalloc failures
answered by releasing the cache and retrying, during this point),
inactive_split_peak (the most cached bytes held inside segments that
still carry a live block, which no release returns) and segments_peak.
`--trace DIR` also writes each point's allocator history as a snapshot
(torch.cuda.memory._dump_snapshot) for pytorch.org/memory_viz.
"""

import argparse
import csv
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

# Architecture numbers from each model's published config.json.
MODELS = {
    "Qwen/Qwen2.5-0.5B": dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=32768),
    "Qwen/Qwen2.5-1.5B": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=131072),
    "Qwen/Qwen2.5-3B": dict(
        model_type="qwen2", hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=32768),
    "Qwen/Qwen2.5-7B": dict(
        model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
        tie_word_embeddings=True, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-3B": dict(
        model_type="llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, intermediate_size=8192, vocab_size=128256,
        tie_word_embeddings=True, max_position_embeddings=131072),
    "meta-llama/Llama-3.1-8B": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072),
    "mistralai/Mistral-7B-v0.1": dict(
        model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
        tie_word_embeddings=False, max_position_embeddings=32768),
    "google/gemma-2-2b": dict(
        model_type="gemma2", hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000,
        tie_word_embeddings=True, max_position_embeddings=8192, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=256, sliding_window=4096),
    "microsoft/Phi-3-mini-4k-instruct": dict(
        model_type="phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, intermediate_size=8192, vocab_size=32064,
        tie_word_embeddings=False, max_position_embeddings=4096),
    "microsoft/phi-2": dict(
        model_type="phi", hidden_size=2560, num_hidden_layers=32, num_attention_heads=32,
        intermediate_size=10240, vocab_size=51200, partial_rotary_factor=0.4, hidden_act="gelu_new",
        tie_word_embeddings=False, max_position_embeddings=2048),
    "EleutherAI/pythia-1.4b": dict(
        model_type="gpt_neox", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
        intermediate_size=8192, vocab_size=50304, rotary_pct=0.25, use_parallel_residual=True,
        hidden_act="gelu",
        tie_word_embeddings=False, max_position_embeddings=2048),
    "tiiuae/falcon-7b": dict(
        model_type="falcon", hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
        multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
        vocab_size=65024, alibi=False, max_position_embeddings=2048, activation="gelu"),
    "openai-community/gpt2-medium": dict(
        model_type="gpt2", n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
        vocab_size=50257, activation_function="gelu_new"),
    "google-bert/bert-large-uncased": dict(
        model_type="bert", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
        intermediate_size=4096, vocab_size=30522, max_position_embeddings=512,
        type_vocab_size=2),
}

# model_type -> peft target_modules for gpufit's q;v, and for all linear layers
LORA_TARGETS = {
    "qwen2": ["q_proj", "v_proj"], "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"], "phi": ["q_proj", "v_proj"],
    "gpt_neox": ["query_key_value"], "falcon": ["query_key_value"], "gpt2": ["c_attn"],
    "bert": ["query", "value"],
}
LORA_NAMES = {"phi3": "q;k;v", "gpt_neox": "q;k;v", "falcon": "q;k;v", "gpt2": "q;k;v"}

FIELDS = [
    "status", "model", "framework", "method", "lora_rank", "lora_targets", "base_quant",
    "dtype", "optimizer", "optimizer_impl", "micro_batch", "seq_len", "checkpointing",
    "grad_accum", "gpus", "attention", "head", "grads_kept", "cuda_context_mib",
    "allocated_bytes", "reserved_bytes", "device_bytes", "loop", "compile",
    "fwd_peak", "bwd_peak", "step_peak", "after_fwd", "after_bwd", "tokens_per_sec",
    "varlen", "reserved_by_step", "alloc_retries", "inactive_split_peak", "segments_peak",
    "reserved_at_start", "timed",
    "gpu", "torch", "transformers", "bitsandbytes", "seconds", "error",
]


def P(model, method="full", dtype="bf16", mb=1, seq=512, ckpt="off", **kw):
    d = dict(model=model, method=method, dtype=dtype, micro_batch=mb, seq_len=seq,
             checkpointing=ckpt, attention="sdpa", optimizer="adamw", head="lm",
             loop="manual", compile=False, lora_rank=16, lora_targets="q;v", varlen=False)
    d.update(kw)
    return d


def grid(name):
    q05, l1, q15 = "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-1.5B"
    g2, phi2, py = "google/gemma-2-2b", "microsoft/phi-2", "EleutherAI/pythia-1.4b"
    phi3, bert = "microsoft/Phi-3-mini-4k-instruct", "google-bert/bert-large-uncased"
    if name == "quick":
        return [P(q05, mb=1, seq=512), P(q05, "lora", mb=4, seq=1024)]
    if name == "holdout":
        # measured after the model's allocator shares were fitted to the
        # grids above: configurations none of those rows has
        l3, q3, q7 = "meta-llama/Llama-3.2-3B", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-7B"
        fal, mis = "tiiuae/falcon-7b", "mistralai/Mistral-7B-v0.1"
        return [
            P(q3, mb=1, seq=1024, ckpt="on"), P(q3, mb=4, seq=1024, ckpt="on"),
            P(l3, mb=2, seq=2048, ckpt="on"), P(l3, mb=1, seq=1024),
            P(q15, dtype="bf16-mixed", mb=4, seq=1024, ckpt="on"), P(q15, mb=2, seq=4096, ckpt="on"),
            P(q7, "lora", mb=4, seq=2048, ckpt="on"), P(q7, "lora", mb=2, seq=1024),
            P(mis, "lora", mb=4, seq=4096, ckpt="on"), P(mis, "lora", mb=1, seq=2048),
            P(g2, "lora", mb=2, seq=4096, ckpt="on", attention="eager"),
            P(g2, mb=2, seq=2048, ckpt="on", attention="eager"),
            P(phi2, "lora", mb=2, seq=2048, ckpt="on"), P(py, mb=8, seq=2048, ckpt="on"),
            P(fal, "lora", mb=2, seq=2048, ckpt="on", attention="eager"),
            P(fal, "lora", mb=1, seq=2048), P(fal, "lora", mb=4, seq=1024, ckpt="on"),
            P(phi3, "lora", mb=2, seq=4096, ckpt="on"),
            P(l1, "lora", mb=8, seq=4096, ckpt="on", lora_targets="all-linear"),
            P(l3, "lora", dtype="bf16-mixed", mb=4, seq=2048, ckpt="on", loop="trainer"),
            P(q05, mb=16, seq=1024, ckpt="on"), P(l1, mb=1, seq=16384, ckpt="on"),
            P(bert, dtype="fp16-mixed", mb=32, seq=512, head="classifier"),
            P(bert, dtype="fp32", mb=8, seq=512, head="classifier", ckpt="on"),
        ]
    if name == "steps":
        # does the reserved peak keep growing after the first steps? 30
        # steps each, fixed-length batches and batches whose length varies
        # between half and all of seq_len (as real, unpacked data does)
        l3 = "meta-llama/Llama-3.2-3B"
        pts = [
            P(l3, "lora", mb=1, seq=8192, ckpt="on"), P(q05, mb=1, seq=8192, ckpt="on"),
            P(l1, mb=4, seq=2048, ckpt="on"), P(l1, mb=1, seq=512),
            P("Qwen/Qwen2.5-7B", "lora", mb=4, seq=2048, ckpt="on"), P(l1, "lora", mb=8, seq=2048),
        ]
        return pts + [dict(p, varlen=True) for p in pts]
    if name == "allocator":
        # the rows whose reserved bytes the memory model misses although
        # their allocated bytes are right (BENCHMARKS.md, "Issue 11, third
        # session"): run with --trace DIR to keep each point's allocator
        # history, and read alloc_retries (the cache released under
        # pressure) and inactive_split_peak (cached bytes no request fits)
        l3, q7, l8 = "meta-llama/Llama-3.2-3B", "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B"
        return [
            # same tensor sizes, 23.2 vs 17.9 GiB reserved
            P(q05, mb=1, seq=8192, ckpt="on"), P(q05, mb=4, seq=2048, ckpt="on"),
            # the gap that is not monotonic in the micro batch
            P(l1, mb=1, seq=2048, ckpt="on"), P(l1, mb=2, seq=2048, ckpt="on"),
            P(l1, mb=4, seq=2048, ckpt="on"), P(l1, mb=8, seq=2048, ckpt="on"),
            # measured 22.05 and 28.61 GiB in two runs
            P(l3, "lora", mb=1, seq=8192, ckpt="on"),
            P(phi3, "lora", mb=2, seq=4096, ckpt="on"),
            # near the card: released cache (fits) against an OOM
            P(q7, "lora", mb=8, seq=4096, ckpt="on"), P(l8, "lora", mb=16, seq=2048, ckpt="on"),
            P(g2, "lora", dtype="bf16-mixed", mb=8, seq=2048, ckpt="on", attention="eager"),
            P(l1, dtype="bf16-mixed", mb=16, seq=2048, ckpt="on"),
        ]
    if name == "qlora":
        # PEFT's QLoRA recipe (bitsandbytes NF4 base, prepare_model_for_kbit_training),
        # which the memory model runs as an fp32 block: counted on the CPU
        # (bench/data/saved_tensors.jsonl) but never measured on a GPU. bf16
        # keeps the adapters' fp32 and no autocast; bf16-mixed is the
        # Trainer's bf16=True. LoRA twins at the same settings beside them.
        # Smallest first (each QLoRA point writes its model to disk and
        # reloads it quantized), so a time budget keeps the most points; the
        # bitsandbytes 8-bit AdamW point of `families` (which could not run
        # there) leads.
        l8, q7 = "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"
        return [
            P(bert, dtype="fp32", mb=4, seq=512, head="classifier", optimizer="adamw8bit"),
            P(l1, "qlora", mb=4, seq=2048), P(l1, "lora", mb=4, seq=2048),
            P(l1, "qlora", dtype="bf16-mixed", mb=4, seq=2048),
            P(l1, "qlora", mb=8, seq=2048, ckpt="on"),
            P(py, "qlora", mb=4, seq=1024), P(phi3, "qlora", mb=4, seq=2048),
            P(l8, "qlora", mb=2, seq=2048), P(l8, "lora", mb=2, seq=2048),
            P(l8, "qlora", mb=4, seq=4096, ckpt="on"),
            P(l8, "qlora", dtype="bf16-mixed", mb=4, seq=2048, ckpt="on"),
            P(q7, "qlora", mb=2, seq=2048, lora_targets="all-linear"),
        ]
    if name != "families":
        raise SystemExit(f"unknown grid {name}")
    return [
        # where the model under-predicted: which phase sets the peak
        P(q05, mb=1, seq=512), P(q05, mb=4, seq=2048, ckpt="on"),
        P(q05, mb=8, seq=2048, ckpt="on"), P(l1, mb=4, seq=2048, ckpt="on"),
        P(l1, mb=8, seq=2048, ckpt="on"), P(l1, dtype="bf16-mixed", mb=8, seq=1024, ckpt="on"),
        P(q05, dtype="bf16-mixed", mb=2, seq=1024), P(l1, mb=1, seq=512),
        # other families
        P(py, mb=4, seq=1024), P(py, mb=4, seq=1024, ckpt="on"),
        P(py, dtype="bf16-mixed", mb=4, seq=1024), P(py, "lora", mb=8, seq=2048),
        P(phi2, mb=2, seq=1024), P(phi2, mb=4, seq=2048, ckpt="on"), P(phi2, "lora", mb=4, seq=2048),
        P(g2, mb=1, seq=1024, attention="eager"), P(g2, mb=4, seq=1024, ckpt="on", attention="eager"),
        P(g2, mb=4, seq=1024, attention="sdpa"), P(g2, "lora", mb=4, seq=2048, attention="eager"),
        P(g2, "lora", mb=4, seq=2048, ckpt="on", attention="eager"),
        P(phi3, "lora", mb=4, seq=2048), P(phi3, "lora", mb=8, seq=2048, ckpt="on"),
        P(phi3, mb=1, seq=1024, ckpt="on"),
        P("tiiuae/falcon-7b", "lora", mb=2, seq=2048, ckpt="on"),
        P("mistralai/Mistral-7B-v0.1", "lora", mb=2, seq=2048, ckpt="on",
          lora_targets="all-linear", lora_rank=16),
        # long sequences
        P("meta-llama/Llama-3.2-3B", "lora", mb=1, seq=8192, ckpt="on"),
        P("meta-llama/Llama-3.2-3B", "lora", mb=1, seq=8192),
        P(q05, mb=1, seq=8192, ckpt="on"), P(q15, "lora", mb=2, seq=8192, ckpt="on"),
        # encoder: BERT-large with a classification head (the HF single-GPU page setup)
        P(bert, dtype="fp32", mb=4, seq=512, head="classifier"),
        P(bert, dtype="fp16-mixed", mb=4, seq=512, head="classifier"),
        P(bert, dtype="fp32", mb=4, seq=512, head="classifier", ckpt="on"),
        P(bert, dtype="fp32", mb=4, seq=512, head="classifier", optimizer="adafactor"),
        P(bert, dtype="fp32", mb=4, seq=512, head="classifier", optimizer="adamw8bit"),
        P(bert, dtype="fp32", mb=16, seq=512, head="classifier"),
        # transformers' Trainer itself (fp32 model, bf16=True)
        P(q05, dtype="bf16-mixed", mb=4, seq=1024, loop="trainer"),
        P(q05, dtype="bf16-mixed", mb=8, seq=1024, ckpt="on", loop="trainer"),
        P(l1, dtype="bf16-mixed", mb=2, seq=2048, ckpt="on", loop="trainer"),
        P(q15, "lora", dtype="bf16-mixed", mb=4, seq=2048, loop="trainer"),
        # torch.compile
        P(q05, mb=4, seq=1024, compile=True), P(q05, mb=4, seq=1024),
    ]


def points_from_csv(path):
    """Points read from a grid file such as bench/data/synthetic/grid.csv
    (columns model, method, lora_rank, lora_targets, dtype, optimizer,
    micro_batch, seq_len, checkpointing, attention, head; the defaults of
    `P` for any the file lacks): configurations replayed on the CPU, to be
    measured as they were replayed."""
    pts = []
    with open(path, newline="") as f:
        for n, r in enumerate(csv.DictReader(f), 2):
            if r.get("model") not in MODELS:
                raise SystemExit(f"{path}:{n}: model {r.get('model')!r} is not in MODELS")
            kw = {k: r[k] for k in ("optimizer", "attention", "head", "lora_targets")
                  if r.get(k)}
            if r.get("lora_rank"):
                kw["lora_rank"] = int(r["lora_rank"])
            if kw.get("lora_targets") not in (None, "all-linear"):
                # run_point names the family's default targets itself
                kw["lora_targets"] = "q;v"
            try:
                pts.append(P(r["model"], r.get("method") or "full", r.get("dtype") or "bf16",
                             int(r["micro_batch"]), int(r["seq_len"]),
                             r.get("checkpointing") or "off", **kw))
            except (KeyError, ValueError) as e:
                raise SystemExit(f"{path}:{n}: bad row ({e})")
    return pts


def config_for(model):
    from transformers import AutoConfig
    kw = dict(MODELS[model])
    mt = kw.pop("model_type")
    return mt, AutoConfig.for_model(mt, **kw)


def dump_trace(trace_dir, p):
    """Write the allocator snapshot of point `p` (open it at
    pytorch.org/memory_viz, or read its "segments" with pickle) and stop
    recording."""
    import torch
    os.makedirs(trace_dir, exist_ok=True)
    name = "_".join([p["model"].split("/")[-1], p["method"], p["dtype"], f"m{p['micro_batch']}",
                     f"s{p['seq_len']}", "ckpt" if p["checkpointing"] == "on" else "nockpt",
                     p["attention"]])
    try:
        torch.cuda.memory._dump_snapshot(os.path.join(trace_dir, name + ".pickle"))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def run_point(p, steps, ctx_bytes, trace_dir=None):
    import torch
    import transformers
    row = dict(p)
    row.update(framework="hf", base_quant="none", optimizer_impl="foreach", grad_accum=1,
               gpus=1, grads_kept="false", torch=torch.__version__,
               transformers=transformers.__version__, gpu=torch.cuda.get_device_name(0),
               cuda_context_mib=ctx_bytes // (1024 * 1024), error="",
               reserved_at_start=torch.cuda.memory_reserved())
    mt, config = config_for(p["model"])
    if p["method"] == "full":
        row["lora_rank"], row["lora_targets"] = "", ""
    elif p["lora_targets"] != "all-linear":
        row["lora_targets"] = LORA_NAMES.get(mt, "q;v")
    mixed = p["dtype"] in ("bf16-mixed", "fp16-mixed")
    pdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(p["dtype"], torch.float32)
    adt = torch.float16 if p["dtype"] == "fp16-mixed" else torch.bfloat16
    if p["loop"] == "trainer":
        pdtype = torch.float32
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    cls = AutoModelForSequenceClassification if p["head"] == "classifier" else AutoModelForCausalLM
    model = opt = scaler = None
    try:
        with torch.device("cuda"):
            model = cls.from_config(config, torch_dtype=pdtype, attn_implementation=p["attention"])
        if p["method"] == "qlora":
            # PEFT's QLoRA recipe: the base reloaded in 4 bits (bitsandbytes
            # NF4 with double quantization, bf16 compute), then
            # prepare_model_for_kbit_training (fp32 non-quantized parameters;
            # reentrant checkpointing when asked, as the recipe enables it)
            import bitsandbytes  # noqa: F401  (fails here, recorded as the row's error, when absent)
            from importlib.metadata import version
            from peft import prepare_model_for_kbit_training
            from transformers import BitsAndBytesConfig
            with tempfile.TemporaryDirectory() as d:
                model.save_pretrained(d)
                del model
                gc.collect()
                torch.cuda.empty_cache()
                q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                       bnb_4bit_compute_dtype=adt, bnb_4bit_use_double_quant=True)
                model = cls.from_pretrained(d, quantization_config=q, device_map={"": 0},
                                            torch_dtype=pdtype, attn_implementation=p["attention"])
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=p["checkpointing"] == "on",
                gradient_checkpointing_kwargs={"use_reentrant": True})
            row.update(base_quant="nf4", bitsandbytes=version("bitsandbytes"))
        elif p["checkpointing"] == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if p["method"] in ("lora", "qlora"):
            from peft import LoraConfig, get_peft_model
            tm = "all-linear" if p["lora_targets"] == "all-linear" else LORA_TARGETS[mt]
            model = get_peft_model(model, LoraConfig(
                r=p["lora_rank"], lora_alpha=2 * p["lora_rank"], lora_dropout=0.0,
                target_modules=tm, task_type="SEQ_CLS" if p["head"] == "classifier" else None))
        model.train()
        vocab = config.vocab_size
        b, s = p["micro_batch"], p["seq_len"]
        x = torch.randint(0, vocab, (b, s), device="cuda")
        labels = torch.randint(0, 2, (b,), device="cuda") if p["head"] == "classifier" else x
        if p["loop"] == "trainer":
            return run_trainer(p, row, model, vocab, steps, ctx_bytes)
        params = [q for q in model.parameters() if q.requires_grad]
        if p["optimizer"] == "adafactor":
            from transformers.optimization import Adafactor
            opt = Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False,
                            warmup_init=False)
            row["optimizer_impl"] = ""
        elif p["optimizer"] == "adamw8bit":
            import bitsandbytes as bnb
            opt = bnb.optim.AdamW8bit(params, lr=1e-5)
            row["optimizer_impl"] = ""
        else:
            opt = torch.optim.AdamW(params, lr=1e-5)
        scaler = torch.amp.GradScaler("cuda", enabled=p["dtype"] == "fp16-mixed")
        fwd_model = torch.compile(model) if p["compile"] else model
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        alloc = reserved = 0
        t_start = None
        by_step = []
        # allocator statistics (torch.cuda.memory_stats): failed cudaMalloc
        # calls answered by releasing the cache and retrying (counted from
        # this point's start), and the peak of cached bytes inside segments
        # that still hold a live block (which no release can return)
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        split_peak = seg_peak = 0

        def phase_stats():
            nonlocal split_peak, seg_peak
            st = torch.cuda.memory_stats()
            split_peak = max(split_peak, st.get("inactive_split_bytes.all.peak", 0))
            seg_peak = max(seg_peak, st.get("segment.all.peak", 0))
        gen = torch.Generator().manual_seed(0)
        for i in range(steps):
            if trace_dir and i == 0:
                # the allocator's history (a ring of the latest events: the
                # last steps, or the steps up to an OOM)
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            if p["varlen"]:
                n = int(torch.randint(s // 16, s // 8 + 1, (1,), generator=gen)) * 8
                x = torch.randint(0, vocab, (b, n), device="cuda")
                labels = x if p["head"] != "classifier" else labels
            if i == 1:
                torch.cuda.synchronize()
                t_start = time.time()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=adt, enabled=mixed):
                loss = fwd_model(input_ids=x, labels=labels).loss
            torch.cuda.synchronize()
            fwd = torch.cuda.max_memory_allocated()
            after_fwd = torch.cuda.memory_allocated()
            r1 = torch.cuda.max_memory_reserved()
            phase_stats()
            torch.cuda.reset_peak_memory_stats()
            scaler.scale(loss).backward()
            torch.cuda.synchronize()
            bwd = torch.cuda.max_memory_allocated()
            after_bwd = torch.cuda.memory_allocated()
            r2 = torch.cuda.max_memory_reserved()
            phase_stats()
            torch.cuda.reset_peak_memory_stats()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            del loss
            torch.cuda.synchronize()
            stp = torch.cuda.max_memory_allocated()
            r3 = torch.cuda.max_memory_reserved()
            phase_stats()
            alloc = max(alloc, fwd, bwd, stp)
            reserved = max(reserved, r1, r2, r3)
            by_step.append(round(max(r1, r2, r3) / 2**30, 2))
        dt = (time.time() - t_start) / max(steps - 1, 1)
        if trace_dir:
            dump_trace(trace_dir, p)
        row.update(alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0,
                   inactive_split_peak=split_peak, segments_peak=seg_peak)
        row.update(timed=f"steps 2-{steps}" if steps > 1 else "step 1")
        row.update(status="ok", allocated_bytes=alloc, reserved_bytes=reserved,
                   device_bytes=reserved + ctx_bytes, fwd_peak=fwd, bwd_peak=bwd,
                   step_peak=stp, after_fwd=after_fwd, after_bwd=after_bwd,
                   tokens_per_sec=round(b * s / dt, 1),
                   reserved_by_step=";".join(map(str, by_step)))
        return row
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:160])
        if trace_dir:
            dump_trace(trace_dir, p)
        return row
    except Exception as e:  # a point that cannot run is recorded, the grid goes on
        row.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0][:160])
        return row
    finally:
        if trace_dir:
            torch.cuda.memory._record_memory_history(enabled=None)
        # The cache is released by release_point() once this frame is gone:
        # here `fwd_model`, `params` and the batch still hold the weights.


def release_point():
    """Return every cached segment after a point, so the next one starts
    from an empty allocator (its weights' segments would otherwise be
    reused, or stranded, by a model of other shapes)."""
    import torch
    gc.collect()
    # cuBLAS's workspaces too (one per handle: the main thread's and the
    # autograd engine's, 32 MiB each on Hopper). PyTorch makes them through
    # the caching allocator at a handle's first matmul and keeps them for
    # the process; left alive they pin the segment they were cut from
    # (1.42 GiB after the first point of bench/data/h200/grid.csv), and
    # every later point starts with them made, which a fresh job does not:
    # it makes them in its first step, between its activations, and that
    # moves its reserved peak (Llama-3.2-1B full bf16 4 x 2,048
    # checkpointed: 24.89 GiB with them made before, 21.08-21.40 GiB on
    # the H100 rows that made them in the step; scripts/alloc_sim.py
    # --workspaces-mib 32 replays the second).
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


class StepClock:
    """Times a Trainer's steps 2..N, as the manual loop times its own: the
    first step (kernel loading, cuBLAS's handles and workspaces, autotuning)
    and the Trainer's setup (accelerate's prepare, the optimizer, the data
    loader) are not training throughput. Rows measured before this clock
    timed the whole `train()` call over its steps (bench/data/h100/
    families.csv and holdout.csv, loop=trainer, no `timed` column): the
    accuracy bench does not score their tokens/s."""

    def __init__(self, sync, clock):
        self.sync, self.clock = sync, clock
        self.start = self.end = None
        self.first = self.last = None

    def step_ended(self, global_step):
        # `on_step_end` comes after the optimizer step, `global_step` already
        # counted: the clock starts when the first step is done
        self.sync()
        now = self.clock()
        if self.start is None:
            self.start, self.first = now, global_step
        else:
            self.end, self.last = now, global_step

    def seconds_per_step(self):
        if self.end is None or self.last <= self.first:
            raise ValueError("fewer than two Trainer steps timed")
        return (self.end - self.start) / (self.last - self.first)


def run_trainer(p, row, model, vocab, steps, ctx_bytes):
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    clock = StepClock(torch.cuda.synchronize, time.time)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_ended(state.global_step)

    class Rand(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            ids = torch.randint(0, vocab, (p["seq_len"],))
            return {"input_ids": ids, "labels": ids}

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=p["micro_batch"], max_steps=steps,
            bf16=True, gradient_checkpointing=p["checkpointing"] == "on",
            gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[],
            logging_steps=10_000, save_strategy="no", dataloader_num_workers=0,
            learning_rate=1e-5)
        torch.cuda.reset_peak_memory_stats()
        Trainer(model=model, args=args, train_dataset=Rand(), callbacks=[Clock()]).train()
        dt = clock.seconds_per_step()
    optim = str(getattr(args.optim, "value", args.optim))
    row.update(status="ok", allocated_bytes=torch.cuda.max_memory_allocated(),
               reserved_bytes=torch.cuda.max_memory_reserved(),
               optimizer_impl="fused" if "fused" in optim else "foreach",
               tokens_per_sec=round(p["micro_batch"] * p["seq_len"] / dt, 1),
               timed=f"steps {clock.first + 1}-{clock.last}",
               error=f"Trainer optim={optim}")
    row["device_bytes"] = row["reserved_bytes"] + ctx_bytes
    return row


def context_bytes():
    """This process's CUDA context as nvidia-smi shows it, before any tensor."""
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True).stdout
        for line in out.splitlines():
            pid, used = [x.strip() for x in line.split(",")]
            if pid == str(os.getpid()):
                return int(used) * 1024 * 1024 - torch.cuda.memory_reserved()
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench",
                                                  "data", "gpu_measured.csv"))
    ap.add_argument("--configs", default=os.path.join(os.path.dirname(__file__), "..", "bench",
                                                      "data", "configs"),
                    help="where the config.json of each model used is written")
    ap.add_argument("--grid", default="families",
                    help="families | holdout | steps | allocator | qlora | quick")
    ap.add_argument("--points", metavar="CSV",
                    help="measure the rows of a grid file (e.g. bench/data/synthetic/grid.csv) "
                         "instead of --grid")
    ap.add_argument("--steps", type=int, default=4, help="training steps per point (>= 3)")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="start no new point after this many seconds")
    ap.add_argument("--only", help="comma-separated indices of grid points to run")
    ap.add_argument("--keep-cache", action="store_true",
                    help="do not return the cached segments between points (the next point "
                         "starts on the previous one's cache, as a micro-batch sweep in one "
                         "process without empty_cache does)")
    ap.add_argument("--trace", metavar="DIR",
                    help="write each point's allocator snapshot (history of the run) to DIR")
    args = ap.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            print("no CUDA GPU visible: nothing to measure", file=sys.stderr)
            return 2
    except ImportError:
        print("PyTorch is not installed", file=sys.stderr)
        return 2
    points = points_from_csv(args.points) if args.points else grid(args.grid)
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        points = [p for i, p in enumerate(points) if i in keep]
    out = os.path.abspath(args.out)
    cfg_dir = os.path.abspath(args.configs)
    os.makedirs(cfg_dir, exist_ok=True)
    for m in {p["model"] for p in points}:
        # the published numbers as given above (what gpufit reads), not
        # transformers' expanded config with its version-specific defaults
        d = dict(MODELS[m], _name_or_path=m)
        with open(os.path.join(cfg_dir, m.replace("/", "__") + ".json"), "w") as f:
            json.dump(d, f, indent=1, sort_keys=True, default=str)
    ctx = context_bytes()
    release_point()
    t0 = time.time()
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for i, p in enumerate(points, 1):
            if time.time() - t0 > args.budget_s:
                print(f"budget reached: {len(points) - i + 1} points not run", flush=True)
                break
            t = time.time()
            row = run_point(p, 30 if args.grid == "steps" else max(args.steps, 3), ctx,
                            trace_dir=args.trace)
            row["seconds"] = round(time.time() - t, 1)
            if args.keep_cache:
                gc.collect()
                left = 0
            else:
                left = release_point()
            if left:
                print(f"warning: {left} bytes still reserved after point {i}: the next "
                      "point's reserved bytes include them", file=sys.stderr, flush=True)
            row = {k: ("" if v is None else str(v).replace(",", ";")) for k, v in row.items()}
            w.writerow(row)
            f.flush()
            print(f"[{i}/{len(points)}] {p['model']} {p['method']} {p['dtype']} m{p['micro_batch']} "
                  f"s{p['seq_len']} ckpt={p['checkpointing']} {p['attention']} {p['optimizer']} "
                  f"{p['loop']} compile={p['compile']} -> {row['status']} "
                  f"alloc={row.get('allocated_bytes')} res={row.get('reserved_bytes')} "
                  f"f/b/s={row.get('fwd_peak')}/{row.get('bwd_peak')}/{row.get('step_peak')} "
                  f"{row.get('error', '')} varlen={p.get('varlen')} by_step={row.get('reserved_by_step')} "
                  f"({row['seconds']}s)", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
