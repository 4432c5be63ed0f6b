#!/usr/bin/env python3
"""gpufit's own loop on a real GPU: suggest -> train -> record, a few rounds.

For each workload below, round after round:
  1. `gpufit suggest ... --history sqlite:DB -o json` picks the settings;
  2. a real training run (transformers model built from its config with
     random weights on the GPU, the Hugging Face loss, torch AdamW, the
     suggested micro batch / accumulation / dtype / checkpointing / compile)
     runs a few optimizer steps and measures its peak (max_memory_reserved +
     the CUDA context, what NVML shows) and tokens/s — or runs out of memory;
  3. `gpufit record` stores the result, and the next round starts.

Prints one line per round and writes them to --out (CSV). Needs a GPU, torch,
transformers, peft, and a gpufit binary (--gpufit).

Usage:
    python scripts/gpu_loop.py --gpufit target/release/gpufit --rounds 3 --out loop.csv
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

GPU = "NVIDIA H100 80GB HBM3"

WORKLOADS = [
    dict(model="Qwen/Qwen2.5-1.5B", method="full", seq_len=2048),
    dict(model="meta-llama/Llama-3.2-3B", method="lora", seq_len=4096),
    dict(model="Qwen/Qwen2.5-7B", method="lora", seq_len=2048),
]


def workload_args(w):
    a = ["--model", w["model"], "--method", w["method"], "--framework", "hf",
         "--seq-len", str(w["seq_len"]), "--gpu", GPU]
    if w["method"] != "full":
        a += ["--lora-rank", "16", "--lora-targets", "q,v"]
    return a


def train(w, s, steps):
    """One real run with settings `s` in a child process: the result dict."""
    code = f"""
import json, sys, time, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from gpu_measure import MODELS, LORA_TARGETS, context_bytes
from transformers import AutoConfig, AutoModelForCausalLM
w, s, steps = json.loads({json.dumps(json.dumps([w, s, steps]))})
ctx = context_bytes()
kw = dict(MODELS[w["model"]]); mt = kw.pop("model_type")
cfg = AutoConfig.for_model(mt, **kw)
mixed = s["dtype"].endswith("-mixed")
pdt = torch.float32 if mixed or s["dtype"] == "fp32" else torch.bfloat16
out = dict(status="ok")
try:
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=pdt, attn_implementation="sdpa")
    if s["activation_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
    if w["method"] != "full":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS[mt]))
    model.train()
    fwd = torch.compile(model) if s["compile"] else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    m, acc = s["micro_batch_size"], max(1, s["gradient_accumulation_steps"])
    x = torch.randint(0, cfg.vocab_size, (m, w["seq_len"]), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    t0 = None
    for i in range(steps):
        if i == 1:
            torch.cuda.synchronize(); t0 = time.time()
        for _ in range(acc):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
                loss = fwd(input_ids=x, labels=x).loss / acc
            loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.time() - t0) / (steps - 1)
    out.update(peak=torch.cuda.max_memory_reserved() + ctx,
               tokens_per_sec=m * acc * w["seq_len"] / dt, duration=dt * steps)
except torch.cuda.OutOfMemoryError as e:
    out = dict(status="oom", error=str(e).splitlines()[0][:160])
print("RESULT " + json.dumps(out))
"""
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
    except subprocess.TimeoutExpired:
        return dict(status="error", error="timeout after 300 s")
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return dict(status="error", error=(p.stderr.strip().splitlines() or ["?"])[-1][:200])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpufit", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="loop.csv")
    args = ap.parse_args()
    db = os.path.join(tempfile.mkdtemp(), "history.db")
    f = open(args.out, "w", newline="")
    wr = None
    for w in WORKLOADS:
        for k in range(1, args.rounds + 1):
            sug = json.loads(subprocess.run(
                [args.gpufit, "suggest", *workload_args(w), "--history", f"sqlite:{db}",
                 "-o", "json"], capture_output=True, text=True, check=True).stdout)
            t = time.time()
            res = train(w, sug, args.steps)
            rec = [args.gpufit, "record", *workload_args(w), "--history", f"sqlite:{db}",
                   "--micro-batch", str(sug["micro_batch_size"]),
                   "--grad-accum", str(sug["gradient_accumulation_steps"]),
                   "--dtype", sug["dtype"],
                   "--checkpointing", "on" if sug["activation_checkpointing"] else "off",
                   "--compile", "on" if sug["compile"] else "off",
                   "--predicted-peak-bytes", str(sug["predicted_peak_bytes"]),
                   "--job-id", f"{w['model']}-{w['method']}-{k}", "--cluster", "h100-loop"]
            if res["status"] == "ok":
                rec += ["--success", "true", "--peak-bytes", str(int(res["peak"])),
                        "--tokens-per-sec", f"{res['tokens_per_sec']:.1f}",
                        "--duration-sec", f"{res['duration']:.1f}"]
            else:
                rec += ["--success", "false", "--failure",
                        "oom" if res["status"] == "oom" else "other"]
            r = subprocess.run(rec, capture_output=True, text=True)
            row = dict(model=w["model"], method=w["method"], seq_len=w["seq_len"], round=k,
                       micro_batch=sug["micro_batch_size"],
                       grad_accum=sug["gradient_accumulation_steps"], dtype=sug["dtype"],
                       checkpointing=sug["activation_checkpointing"], compile=sug["compile"],
                       source=sug["source"], confidence=sug["confidence"],
                       predicted_gib=round(sug["predicted_peak_bytes"] / 2**30, 2),
                       measured_gib=round(res["peak"] / 2**30, 2) if "peak" in res else "",
                       predicted_tokens_per_sec=round(sug.get("predicted_tokens_per_sec") or 0),
                       measured_tokens_per_sec=round(res.get("tokens_per_sec", 0)),
                       status=res["status"], recorded=r.returncode == 0,
                       seconds=round(time.time() - t, 1))
            # written as it goes: a run cut short keeps what it measured
            if wr is None:
                wr = csv.DictWriter(f, fieldnames=list(row))
                wr.writeheader()
            wr.writerow(row)
            f.flush()
            print(json.dumps(row), flush=True)
            if r.returncode != 0:
                print("record failed: " + r.stderr.strip()[-300:], flush=True)
    f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
