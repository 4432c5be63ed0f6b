#!/usr/bin/env python3
"""gpufit's own loop on a real GPU: suggest -> train -> record, a few rounds.

Round after round, for each workload below:
  1. `gpufit suggest ... --history sqlite:DB -o json` picks the settings;
  2. a real training run (transformers model built from its config with
     random weights on the GPU, the Hugging Face loss, torch AdamW, the
     suggested micro batch / accumulation / dtype / checkpointing / compile)
     runs a few optimizer steps and measures its peak (max_memory_reserved +
     the CUDA context, what NVML shows) and tokens/s — or runs out of memory;
  3. `gpufit record` stores the result, and the next round starts.

Rounds go breadth first (round 1 of every workload, then round 2 ...), so a
run cut short by --deadline-s still has the first suggestion of each. The
workloads are those of bench/data/h100/throughput.csv, whose micro-batch
sweeps to the first OOM say what the fastest setting that fits was on an
H100. Prints one line per run and writes them to --out (CSV). Needs a GPU,
torch, transformers, peft, and a gpufit binary (--gpufit).

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

# (model, method, sequence, attention) as in bench/data/h100/throughput.csv
WORKLOADS = [
    dict(model="meta-llama/Llama-3.2-1B", method="full", seq_len=2048, attention="sdpa"),
    dict(model="Qwen/Qwen2.5-7B", method="lora", seq_len=4096, attention="sdpa"),
    dict(model="meta-llama/Llama-3.1-8B", method="lora", seq_len=2048, attention="sdpa"),
    dict(model="google/gemma-2-2b", method="lora", seq_len=2048, attention="eager"),
]

# what each dtype gpufit can suggest means to the training step:
# (parameter dtype, autocast dtype or None)
DTYPES = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "fp16": ("float16", None),
    "bf16-mixed": ("float32", "bfloat16"),
    "fp16-mixed": ("float32", "float16"),
}


def detect_gpu():
    """The GPU's name as NVML gives it (what gpufit's catalog is keyed by)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"no --gpu given and nvidia-smi failed: {e}")
    names = [n.strip() for n in out.splitlines() if n.strip()]
    if not names:
        raise SystemExit("no --gpu given and nvidia-smi lists no GPU")
    return names[0]


def workload_args(w, gpu):
    a = ["--model", w["model"], "--method", w["method"], "--framework", "hf",
         "--seq-len", str(w["seq_len"]), "--gpu", gpu, "--attention", w["attention"]]
    if w["method"] != "full":
        a += ["--lora-rank", "16", "--lora-targets", "q,v"]
    return a


def train(w, s, steps):
    """One real run with settings `s` in a child process: the result dict."""
    if s["dtype"] not in DTYPES:
        return dict(status="error", error=f"dtype {s['dtype']!r} not runnable here")
    code = f"""
import json, sys, time, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from gpu_measure import MODELS, LORA_TARGETS, context_bytes
from transformers import AutoConfig, AutoModelForCausalLM
w, s, steps, (pdt, adt) = json.loads({json.dumps(json.dumps([w, s, steps, DTYPES[s["dtype"]]]))})
ctx = context_bytes()
kw = dict(MODELS[w["model"]]); mt = kw.pop("model_type")
cfg = AutoConfig.for_model(mt, **kw)
pdt = getattr(torch, pdt)
out = dict(status="ok")
try:
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=pdt,
                                                 attn_implementation=w["attention"])
    if s["activation_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
    if w["method"] != "full":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS[mt]))
    model.train()
    fwd = torch.compile(model) if s["compile"] else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    scaler = torch.amp.GradScaler("cuda", enabled=adt == "float16")
    m, acc = s["micro_batch_size"], max(1, s["gradient_accumulation_steps"])
    x = torch.randint(0, cfg.vocab_size, (m, w["seq_len"]), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    t0 = None
    t_start = time.time()
    for i in range(steps):
        if i == 1:
            torch.cuda.synchronize(); t0 = time.time()
        for _ in range(acc):
            with torch.autocast("cuda", dtype=getattr(torch, adt or "bfloat16"),
                                enabled=adt is not None):
                loss = fwd(input_ids=x, labels=x).loss / acc
            scaler.scale(loss).backward()
        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.time() - t0) / (steps - 1)
    out.update(peak=torch.cuda.max_memory_reserved() + ctx,
               allocated=torch.cuda.max_memory_allocated(),
               tokens_per_sec=m * acc * w["seq_len"] / dt,
               duration=time.time() - t_start)
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


def suggest(gpufit, w, gpu, db):
    p = subprocess.run([gpufit, "suggest", *workload_args(w, gpu), "--history", f"sqlite:{db}",
                        "-o", "json"], capture_output=True, text=True)
    if p.returncode != 0:
        return None, f"exit {p.returncode}: {p.stderr.strip()[-300:]}"
    try:
        return json.loads(p.stdout), None
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e}): {p.stdout[:200]!r}"


def record_args(gpufit, w, gpu, db, sug, res, job_id):
    rec = [gpufit, "record", *workload_args(w, gpu), "--history", f"sqlite:{db}",
           "--micro-batch", str(sug["micro_batch_size"]),
           "--grad-accum", str(sug["gradient_accumulation_steps"]),
           "--dtype", sug["dtype"],
           "--checkpointing", "on" if sug["activation_checkpointing"] else "off",
           "--compile", "on" if sug["compile"] else "off",
           "--predicted-peak-bytes", str(sug["predicted_peak_bytes"]),
           "--job-id", job_id, "--cluster", "gpu-loop"]
    if res["status"] == "ok":
        rec += ["--success", "true", "--peak-bytes", str(int(res["peak"])),
                "--tokens-per-sec", f"{res['tokens_per_sec']:.1f}",
                "--duration-sec", f"{res['duration']:.1f}"]
    else:
        rec += ["--success", "false", "--failure",
                "oom" if res["status"] == "oom" else "other"]
    return rec


def main(argv=None, train_fn=train):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpufit", required=True)
    ap.add_argument("--gpu", help="gpufit catalog name of the GPU (default: nvidia-smi's)")
    ap.add_argument("--rounds", type=int, default=3, help="last round to run")
    ap.add_argument("--start-round", type=int, default=1,
                    help="first round to run (with --history from a run cut short)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--deadline-s", type=float, default=1e9,
                    help="start no new run after this many seconds")
    ap.add_argument("--workloads", help="comma-separated indices into WORKLOADS")
    ap.add_argument("--history", help="SQLite file of the history (default: a fresh one)")
    ap.add_argument("--out", default="loop.csv")
    args = ap.parse_args(argv)
    gpu = args.gpu or detect_gpu()
    works = WORKLOADS
    if args.workloads:
        works = [WORKLOADS[int(i)] for i in args.workloads.split(",")]
    db = args.history or os.path.join(tempfile.mkdtemp(), "history.db")
    t0 = time.time()
    wr = None
    with open(args.out, "w", newline="") as f:
        for k in range(args.start_round, args.rounds + 1):
            for w in works:
                if time.time() - t0 > args.deadline_s:
                    print(f"deadline reached before round {k} of {w['model']}", flush=True)
                    return 0
                sug, err = suggest(args.gpufit, w, gpu, db)
                if sug is None:
                    print(f"suggest failed for {w['model']}: {err}", flush=True)
                    continue
                t = time.time()
                res = train_fn(w, sug, args.steps)
                job = f"{w['model']}-{w['method']}-{k}"
                r = subprocess.run(record_args(args.gpufit, w, gpu, db, sug, res, job),
                                   capture_output=True, text=True)
                row = dict(model=w["model"], method=w["method"], seq_len=w["seq_len"],
                           attention=w["attention"], round=k,
                           micro_batch=sug["micro_batch_size"],
                           grad_accum=sug["gradient_accumulation_steps"], dtype=sug["dtype"],
                           checkpointing=sug["activation_checkpointing"],
                           compile=sug["compile"], source=sug["source"],
                           confidence=sug["confidence"],
                           predicted_peak_bytes=sug["predicted_peak_bytes"],
                           measured_peak_bytes=int(res["peak"]) if "peak" in res else "",
                           measured_allocated_bytes=res.get("allocated", ""),
                           predicted_tokens_per_sec=round(
                               sug.get("predicted_tokens_per_sec") or 0),
                           measured_tokens_per_sec=round(res.get("tokens_per_sec", 0)),
                           status=res["status"], error=res.get("error", ""),
                           recorded=r.returncode == 0, seconds=round(time.time() - t, 1))
                # written as it goes: a run cut short keeps what it measured
                if wr is None:
                    wr = csv.DictWriter(f, fieldnames=list(row))
                    wr.writeheader()
                wr.writerow(row)
                f.flush()
                print(json.dumps(row), flush=True)
                if r.returncode != 0:
                    print("record failed: " + r.stderr.strip()[-300:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
