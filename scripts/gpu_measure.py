#!/usr/bin/env python3
"""Measure real peak GPU memory of training steps, for gpufit's accuracy benchmark.

Builds models from their architecture numbers (the same numbers as gpufit's
catalog, written inline below: nothing is downloaded, weights are random),
runs a few real training steps for every point of a grid

    model x method (full, LoRA via peft when installed) x dtype (bf16, bf16-mixed)
          x micro batch x sequence length x activation checkpointing (off, on)

and writes one CSV line per point to bench/data/gpu_measured.csv with the
three quantities people measure:

    allocated_bytes  torch.cuda.max_memory_allocated()
    reserved_bytes   torch.cuda.max_memory_reserved()
    device_bytes     what nvidia-smi shows for this process (reserved + CUDA context)

`cargo bench --bench accuracy` reads that file and scores every point.

Each point runs in its own child process so that its peak, its allocator
cache and its CUDA context are its own. A point that runs out of memory is
recorded with status "oom" (the benchmark skips it).

The training loop is the Hugging Face path (`model(input_ids, labels=...)`,
transformers' ForCausalLMLoss, torch.optim.AdamW with its default foreach
implementation, zero_grad(set_to_none=True)), so rows are tagged
framework=hf. "bf16" keeps the parameters in bf16 (as torchtune/litgpt do);
"bf16-mixed" keeps fp32 parameters and runs under torch.autocast(bfloat16)
(as the HF Trainer with bf16=True does).

Requirements: an NVIDIA GPU, PyTorch with CUDA, transformers; peft for the
LoRA points (skipped with a note when missing).

Usage:
    python scripts/gpu_measure.py                 # full grid (~100 points)
    python scripts/gpu_measure.py --quick         # a dozen points
    python scripts/gpu_measure.py --out other.csv --steps 4
"""

import argparse
import csv
import itertools
import json
import os
import subprocess
import sys
import time

# Architecture numbers from each model's published config.json (the same
# rows as src/core/catalog/models.rs). Keys are transformers config kwargs.
MODELS = {
    "Qwen/Qwen2.5-0.5B": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "openai-community/gpt2-medium": dict(
        model_type="gpt2",
        n_embd=1024,
        n_layer=24,
        n_head=16,
        n_positions=1024,
        vocab_size=50257,
    ),
}

LORA_TARGETS = {
    # model family -> (peft target_modules, the same targets in gpufit's names)
    "qwen2": (["q_proj", "v_proj"], "q;v"),
    "llama": (["q_proj", "v_proj"], "q;v"),
    # GPT-2 fuses q, k and v into one `c_attn` projection
    "gpt2": (["c_attn"], "q;k;v"),
}
LORA_RANK = 16

FIELDS = [
    "status", "model", "framework", "method", "lora_rank", "lora_targets", "base_quant",
    "dtype", "optimizer", "optimizer_impl", "micro_batch", "seq_len", "checkpointing",
    "grad_accum", "gpus", "attention", "head", "grads_kept", "cuda_context_mib",
    "allocated_bytes", "reserved_bytes", "device_bytes", "gpu", "torch", "transformers",
    "seconds", "error",
]


def grid(quick):
    models = list(MODELS)
    methods = ["full", "lora"]
    dtypes = ["bf16", "bf16-mixed"]
    batches = [1, 4]
    seqs = [512, 2048]
    ckpts = ["off", "on"]
    if quick:
        models = ["Qwen/Qwen2.5-0.5B", "openai-community/gpt2-medium"]
        dtypes = ["bf16"]
        seqs = [512]
    for model, method, dtype, mb, seq, ckpt in itertools.product(
        models, methods, dtypes, batches, seqs, ckpts
    ):
        cfg = MODELS[model]
        ctx = cfg.get("max_position_embeddings") or cfg.get("n_positions")
        if seq > ctx:
            continue
        yield dict(model=model, method=method, dtype=dtype, micro_batch=mb, seq_len=seq,
                   checkpointing=ckpt)


def nvidia_smi_used_mib(pid):
    """This process's GPU memory as nvidia-smi shows it (MiB), or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def run_point(point, steps):
    """Runs one grid point in this process; returns the CSV row (dict)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    row = dict(point)
    row.update(framework="hf", lora_rank="", lora_targets="", base_quant="none",
               optimizer="adamw", optimizer_impl="foreach", grad_accum=1, gpus=1,
               attention="sdpa", head="lm", grads_kept="false",
               torch=torch.__version__, transformers=transformers.__version__,
               gpu=torch.cuda.get_device_name(0), error="")
    pid = os.getpid()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    ctx_mib = nvidia_smi_used_mib(pid)
    row["cuda_context_mib"] = "" if ctx_mib is None else ctx_mib

    cfg_kwargs = dict(MODELS[point["model"]])
    model_type = cfg_kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_kwargs)
    mixed = point["dtype"] == "bf16-mixed"
    param_dtype = torch.float32 if mixed else torch.bfloat16
    attn = "sdpa"
    model = AutoModelForCausalLM.from_config(
        config, torch_dtype=param_dtype, attn_implementation=attn
    ).to("cuda")
    if point["checkpointing"] == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if point["method"] == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            row.update(status="skipped", error="peft not installed")
            return row
        modules, names = LORA_TARGETS[model_type]
        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                 lora_dropout=0.0, target_modules=modules))
        row["lora_rank"] = LORA_RANK
        row["lora_targets"] = names
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    vocab = config.vocab_size
    x = torch.randint(0, vocab, (point["micro_batch"], point["seq_len"]), device="cuda")

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    try:
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:200])
        return row
    row["seconds"] = round(time.time() - t0, 3)
    row["allocated_bytes"] = torch.cuda.max_memory_allocated()
    row["reserved_bytes"] = torch.cuda.max_memory_reserved()
    # The caching allocator keeps the peak's segments, so nvidia-smi now
    # shows reserved-at-peak plus the context.
    used = nvidia_smi_used_mib(pid)
    row["device_bytes"] = "" if used is None else used * 1024 * 1024
    row["status"] = "ok" if used is not None else "no-nvidia-smi"
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench",
                                                  "data", "gpu_measured.csv"))
    ap.add_argument("--steps", type=int, default=3,
                    help="training steps per point (>= 2 so optimizer state exists)")
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--point", help=argparse.SUPPRESS)  # child mode: one JSON point
    args = ap.parse_args()

    if args.point:
        row = run_point(json.loads(args.point), max(args.steps, 2))
        print("ROW " + json.dumps(row))
        return 0

    try:
        import torch  # noqa: F401
        if not torch.cuda.is_available():
            print("no CUDA GPU visible: nothing to measure", file=sys.stderr)
            return 2
    except ImportError:
        print("PyTorch is not installed", file=sys.stderr)
        return 2

    points = list(grid(args.quick))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for i, p in enumerate(points, 1):
            t = time.time()
            try:
                proc = subprocess.run(
                    [sys.executable, __file__, "--point", json.dumps(p), "--steps",
                     str(args.steps)],
                    capture_output=True, text=True, timeout=900,
                )
                rows = [l[4:] for l in proc.stdout.splitlines() if l.startswith("ROW ")]
                if rows:
                    row = json.loads(rows[-1])
                else:
                    tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
                    row = dict(p, status="error", error=tail[0][:200])
            except subprocess.TimeoutExpired:
                row = dict(p, status="error", error="timeout")
            # commas would break the benchmark's simple CSV reader
            row = {k: (str(v).replace(",", ";") if v is not None else "") for k, v in row.items()}
            w.writerow(row)
            f.flush()
            print(f"[{i}/{len(points)}] {p} -> {row.get('status')} "
                  f"alloc={row.get('allocated_bytes')} reserved={row.get('reserved_bytes')} "
                  f"device={row.get('device_bytes')} ({time.time() - t:.0f}s)", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
