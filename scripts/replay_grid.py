#!/usr/bin/env python3
"""Replay measured H100 rows through scripts/alloc_sim.py (no GPU) and
write what the allocator model says beside them: bench/data/h100/replayed.csv,
which `cargo bench --bench accuracy` compares with the measurements.

For the files scripts/gpu_measure.py wrote before it recorded
`reserved_at_start` (families, holdout), each point is replayed after the
previous point's weights were built and freed into the cache, as it was
measured (`--carry`); the shared harness's files (peaks, throughput) are
replayed from an empty allocator. Rows the replay cannot build are skipped:
the Trainer loop, torch.compile, optimizers other than AdamW and Adafactor,
variable-length batches.

Usage (a Python with torch, transformers, peft; no GPU; about 20-60 s a row):
    python scripts/replay_grid.py bench/data/h100/families.csv bench/data/h100/holdout.csv \\
        --out bench/data/h100/replayed.csv --jobs 2
    python scripts/replay_grid.py bench/data/h100/throughput.csv --edge --out ... --append
    python scripts/replay_grid.py bench/data/h100/families.csv --lines 27,29 --fresh --out ... --append
    python scripts/replay_grid.py bench/data/synthetic/grid.csv --workspaces-mib 32 \
        --out bench/data/synthetic/replayed_workspaces.csv
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = ["file", "line", "model", "method", "dtype", "micro_batch", "seq_len", "checkpointing",
          "attention", "lora_targets", "carry", "allocated_bytes", "reserved_bytes", "least_bytes"]


def stored_dtype(r):
    return "bf16" if r.get("dtype") == "bf16" and r.get("loop", "manual") != "trainer" else "fp32"


def replayable(r):
    # classifier rows (BERT) replay with alloc_sim's stand-in for CUDA's
    # memory-efficient SDPA kernel with dropout
    return (r.get("status") in ("ok", "oom", "unmeasured")
            and r.get("loop", "manual") != "trainer"
            and r.get("compile", "False") not in ("True", "true")
            and r.get("optimizer", "adamw") in ("adamw", "adafactor", "")
            and r.get("varlen", "False") not in ("True", "true")
            and r.get("method") in ("full", "lora"))


def edge_rows(rows):
    """The last point that ran and the first that did not, per series."""
    keep = set()
    series = {}
    for i, r in enumerate(rows):
        series.setdefault((r.get("workload"), r.get("dtype"), r.get("checkpointing")), []).append(i)
    for idx in series.values():
        ok = [i for i in idx if rows[i]["status"] == "ok"]
        oom = [i for i in idx if rows[i]["status"] == "oom"]
        keep.update(ok[-1:] + oom[:1])
    return keep


def jobs_for(path, edge):
    rows = list(csv.DictReader(open(path)))
    carry_known = rows and "fwd_peak" in rows[0] and "reserved_at_start" not in rows[0]
    only = edge_rows(rows) if edge else None
    out = []
    for i, r in enumerate(rows):
        if (only is not None and i not in only) or not replayable(r):
            continue
        a = [r["model"], "--method", r["method"], "--dtype", r["dtype"], "--mb", r["micro_batch"],
             "--seq", r["seq_len"], "--attention", r.get("attention") or "sdpa"]
        if r.get("checkpointing") == "on":
            a.append("--ckpt")
        if r.get("lora_targets") == "all-linear":
            a.append("--all-linear")
        if r.get("head") == "classifier":
            a += ["--head", "classifier"]
        if r.get("optimizer") == "adafactor":
            a += ["--optimizer", "adafactor"]
        if os.path.basename(os.path.dirname(os.path.abspath(path))) == "expandable":
            a.append("--expandable")
        carry = ""
        if carry_known and i > 0:
            p = rows[i - 1]
            carry = f"{p['model']}:{stored_dtype(p)}"
            a += ["--carry", carry]
        out.append((os.path.relpath(path, os.path.join(HERE, "..", "bench", "data")), i + 2, r,
                    carry, a))
    return out


def run(job):
    rel, line, r, carry, a = job
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "r.json")
        p = subprocess.run([sys.executable, os.path.join(HERE, "alloc_sim.py"), *a,
                            "--min-capacity", "--json", js], capture_output=True, text=True)
        if not os.path.exists(js):
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{rel}:{line}: replay failed: {tail}", file=sys.stderr, flush=True)
            return None
        d = json.loads(open(js).read())
    print(f"{rel}:{line} {' '.join(a)}: reserved {d['reserved'] / 2**30:.2f} GiB", flush=True)
    return dict(file=rel, line=line, model=r["model"], method=r["method"], dtype=r["dtype"],
                micro_batch=r["micro_batch"], seq_len=r["seq_len"],
                checkpointing=r.get("checkpointing", "off"), attention=r.get("attention") or "sdpa",
                lora_targets=r.get("lora_targets", ""), carry=carry,
                allocated_bytes=d["allocated"], reserved_bytes=d["reserved"],
                least_bytes=d["least"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grids", nargs="+", help="measured CSV files under bench/data/h100/")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--edge", action="store_true",
                    help="only the last point that ran and the first that did not, per series")
    ap.add_argument("--append", action="store_true", help="add to --out instead of replacing it")
    ap.add_argument("--fresh", action="store_true",
                    help="replay from an empty allocator even where the point began with a "
                         "carried cache (what a job on its own would hold)")
    ap.add_argument("--workspaces-mib", type=float, default=0,
                    help="replay each point making its cuBLAS workspaces in its first step, "
                         "as a fresh job does (alloc_sim.py --workspaces-mib; 32 on Hopper)")
    ap.add_argument("--lines", help="comma-separated CSV line numbers to replay (default: all)")
    args = ap.parse_args()
    jobs = [j for g in args.grids for j in jobs_for(g, args.edge)]
    if args.lines:
        keep = {int(x) for x in args.lines.split(",")}
        jobs = [j for j in jobs if j[1] in keep]
    if args.fresh:
        jobs = [(rel, line, r, "", a[:a.index("--carry")] if "--carry" in a else a)
                for rel, line, r, _, a in jobs]
    if args.workspaces_mib:
        jobs = [(rel, line, r, c, a + ["--workspaces-mib", str(args.workspaces_mib)])
                for rel, line, r, c, a in jobs]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        results = [x for x in ex.map(run, jobs) if x]
    new = not (args.append and os.path.exists(args.out))
    with open(args.out, "w" if new else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerows(results)
    print(f"wrote {len(results)} of {len(jobs)} rows to {args.out}")
    return 0 if len(results) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
