#!/usr/bin/env python3
"""Real-GPU check of `gpufit sidecar --backend nvml`.

Runs the sidecar beside a PyTorch process that allocates a known amount of
GPU memory (rising, holding a peak, falling), then checks:

  * /v1/gpus against nvidia-smi: same UUID and name per GPU, total memory
    equal (to nvidia-smi's MiB rounding), used memory close;
  * the job's current memory while the peak is held against nvidia-smi's
    per-process used memory (both come from NVML: equal to 1 MiB);
  * the job's peak (GET /v1/jobs/{id}, after the process ended) against
    torch.cuda.max_memory_reserved(): the sidecar sees the whole process, so
    its peak is max_memory_reserved plus the CUDA context (and cuBLAS
    workspace etc.); it must lie in [reserved, reserved + context + 16 MiB],
    where the context is measured as nvidia-smi's process memory minus
    torch's reserved memory while nothing else is allocated;
  * the same peak in /metrics (gpufit_job_gpu_memory_peak_bytes).

The PyTorch process is attributed to a job through its environment
(SLURM_JOB_ID, read from /proc/<pid>/environ) and the mapping directory
(<dir>/<gpu index> holding the job id), so no Slurm or Kubernetes is needed.
Run it where the sidecar sees host PIDs (on the host, or a container with
--pid=host) and where `nvidia-smi` and `python3 -c "import torch"` work.

Usage:
    cargo build --release
    python3 scripts/gpu_sidecar_check.py [--gpufit target/release/gpufit] [--gib 8] [--gpu 0]

Writes one row per check to bench/data/sidecar_gpu_check.csv (appends; the
header is written when the file is new) and exits 1 if any check failed,
2 if the environment is missing something (no GPU, no torch, no binary).
"""

import argparse
import csv
import datetime
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

MIB = 1 << 20
GIB = 1 << 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The PyTorch workload, run as its own process (its own CUDA context).
# Protocol on stdout, one JSON object per line: {"phase": ..., ...}; it waits
# for a line on stdin before each phase change so the checker can look at the
# GPU while the peak is held.
WORKLOAD = r"""
import json, sys, time, torch
gpu, target = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda", gpu)
torch.cuda.set_device(dev)
def say(**kv):
    kv["reserved"] = torch.cuda.memory_reserved(dev)
    kv["max_reserved"] = torch.cuda.max_memory_reserved(dev)
    kv["max_allocated"] = torch.cuda.max_memory_allocated(dev)
    print(json.dumps(kv), flush=True)
def wait():
    sys.stdin.readline()
torch.zeros(1, device=dev); torch.cuda.synchronize(dev)   # context only
say(phase="context")
wait()
chunks, step = [], max(target // 8, 1 << 20)
allocated = 0
while allocated < target:                                 # rise in 8 steps
    n = min(step, target - allocated)
    chunks.append(torch.empty(n, dtype=torch.uint8, device=dev)); allocated += n
    torch.cuda.synchronize(dev); time.sleep(0.3)
say(phase="peak", allocated=allocated)
wait()
del chunks[len(chunks) // 2:]                              # fall
torch.cuda.synchronize(dev); torch.cuda.empty_cache()
say(phase="fallen")
wait()
say(phase="exit")
"""


def sh(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def nvidia_smi_gpus():
    out = sh("nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.used",
             "--format=csv,noheader,nounits")
    gpus = {}
    for line in out.strip().splitlines():
        idx, uuid, name, total, used = [p.strip() for p in line.split(",")]
        gpus[int(idx)] = {"uuid": uuid, "name": name, "total_mib": int(total), "used_mib": int(used)}
    return gpus


def nvidia_smi_process_mib(pid):
    out = sh("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    for line in out.strip().splitlines():
        p, used = [x.strip() for x in line.split(",")]
        if p == str(pid):
            return int(used)
    return None


def get(base, path):
    try:
        with urllib.request.urlopen(base + path, timeout=5) as r:
            body = r.read().decode()
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Checks:
    def __init__(self, host, gpu_name):
        self.rows, self.host, self.gpu_name = [], host, gpu_name

    def add(self, check, expected, measured, tolerance, ok, note=""):
        self.rows.append({
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": self.host, "gpu": self.gpu_name, "check": check,
            "expected": expected, "measured": measured, "tolerance": tolerance,
            "pass": "yes" if ok else "no", "note": note,
        })
        print(f"[{'PASS' if ok else 'FAIL'}] {check}: expected {expected}, measured {measured}"
              f" (tolerance {tolerance}) {note}")

    def write(self, path):
        new = not os.path.exists(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(self.rows[0].keys()))
            if new:
                w.writeheader()
            w.writerows(self.rows)

    def ok(self):
        return all(r["pass"] == "yes" for r in self.rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target_dir = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
    ap.add_argument("--gpufit", default=os.path.join(target_dir, "release", "gpufit"))
    ap.add_argument("--gib", type=float, default=8.0, help="GiB the PyTorch process allocates at its peak")
    ap.add_argument("--gpu", type=int, default=0, help="GPU index (as nvidia-smi numbers it)")
    ap.add_argument("--interval", default="100ms", help="sidecar sampling interval")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "data", "sidecar_gpu_check.csv"))
    a = ap.parse_args()

    if not shutil.which("nvidia-smi"):
        print("nvidia-smi not found: run this on a machine with an NVIDIA GPU and driver", file=sys.stderr)
        return 2
    if not os.access(a.gpufit, os.X_OK):
        print(f"{a.gpufit} is not an executable: run `cargo build --release` or pass --gpufit", file=sys.stderr)
        return 2
    try:
        subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                       check=True, capture_output=True)
    except subprocess.CalledProcessError:
        print("PyTorch with CUDA is not importable by this python: pip install torch", file=sys.stderr)
        return 2

    smi = nvidia_smi_gpus()
    if a.gpu not in smi:
        print(f"GPU {a.gpu} not found; nvidia-smi lists {sorted(smi)}", file=sys.stderr)
        return 2
    checks = Checks(socket.gethostname(), smi[a.gpu]["name"])
    job_id = str(random.randint(900_000_000, 999_999_999))
    mapping = tempfile.mkdtemp(prefix="gpufit-mapping-")
    with open(os.path.join(mapping, str(a.gpu)), "w") as f:
        f.write(job_id + "\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    sidecar = subprocess.Popen(
        [a.gpufit, "sidecar", "--backend", "nvml", "--listen", f"127.0.0.1:{port}",
         "--interval", a.interval, "--mapping-dir", mapping],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        for _ in range(100):
            if sidecar.poll() is not None:
                print("sidecar exited:\n" + sidecar.stderr.read(), file=sys.stderr)
                return 1
            try:
                if get(base, "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)

        # --- /v1/gpus against nvidia-smi ---
        gpus = json.loads(get(base, "/v1/gpus")[1])["gpus"]
        smi = nvidia_smi_gpus()
        checks.add("gpu_count", len(smi), len(gpus), 0, len(smi) == len(gpus))
        for g in gpus:
            s = smi.get(g["index"], {})
            checks.add(f"gpu{g['index']}_uuid", s.get("uuid"), g["uuid"], 0, s.get("uuid") == g["uuid"])
            checks.add(f"gpu{g['index']}_name", s.get("name"), g["name"], 0, s.get("name") == g["name"])
            total_mib = g["memory_total_bytes"] / MIB
            checks.add(f"gpu{g['index']}_total_mib", s.get("total_mib"), round(total_mib, 1), 1,
                       s.get("total_mib") is not None and abs(total_mib - s["total_mib"]) <= 1)
            used_mib = g["memory_used_bytes"] / MIB
            # Other processes may allocate between the two readings: 256 MiB slack.
            checks.add(f"gpu{g['index']}_used_mib", s.get("used_mib"), round(used_mib, 1), 256,
                       s.get("used_mib") is not None and abs(used_mib - s["used_mib"]) <= 256)

        # --- the PyTorch job ---
        env = dict(os.environ, SLURM_JOB_ID=job_id)
        target = int(a.gib * GIB)
        worker = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(a.gpu), str(target)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

        def phase():
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError("the PyTorch process exited early")
            return json.loads(line)

        def next_phase():
            worker.stdin.write("\n")
            worker.stdin.flush()
            return phase()

        ctx = phase()
        time.sleep(0.5)
        ctx_proc_mib = nvidia_smi_process_mib(worker.pid)
        if ctx_proc_mib is None:
            checks.add("process_visible", "pid in nvidia-smi", None, 0, False,
                       "nvidia-smi does not list the PyTorch pid: run with host PIDs")
            return 1
        context_bytes = ctx_proc_mib * MIB - ctx["reserved"]
        checks.add("cuda_context_mib", "> 0", round(context_bytes / MIB, 1), 0, context_bytes > 0,
                   "nvidia-smi process memory minus torch reserved, nothing allocated")

        peak = next_phase()
        time.sleep(3 * 0.2 + 0.5)
        held_mib = nvidia_smi_process_mib(worker.pid)
        status, body = get(base, f"/v1/jobs/{job_id}")
        note = ""
        if status == 404:
            # Inside a Kubernetes pod or a Slurm step the cgroup wins over
            # SLURM_JOB_ID: take the running job holding memory on this GPU.
            jobs = json.loads(get(base, "/v1/jobs")[1])["jobs"]
            mine = [j for j in jobs if j["running"]
                    and any(g["gpu"] == a.gpu and g["current_bytes"] > 0 for g in j["gpus"])]
            if len(mine) == 1:
                job_id, note = mine[0]["id"], f"attributed by cgroup as {mine[0]['kind']}"
                status, body = get(base, f"/v1/jobs/{job_id}")
        job = json.loads(body) if status == 200 else {}
        checks.add("job_attributed", job_id, job.get("id"), 0, status == 200,
                   note or (body[:200] if status != 200 else ""))
        if status == 200:
            cur_mib = job["current_bytes"] / MIB
            checks.add("job_current_vs_nvidia_smi_process_mib", held_mib, round(cur_mib, 1), 1,
                       held_mib is not None and abs(cur_mib - held_mib) <= 1)

        fallen = next_phase()
        time.sleep(0.5)
        worker.stdin.write("\n")
        worker.stdin.flush()
        phase()  # "exit"
        worker.wait(timeout=60)
        time.sleep(1.0)

        status, body = get(base, f"/v1/jobs/{job_id}")
        job = json.loads(body) if status == 200 else {}
        max_reserved = fallen["max_reserved"]
        tol = context_bytes + 16 * MIB
        peak_bytes = job.get("peak_bytes")
        ok = peak_bytes is not None and max_reserved <= peak_bytes <= max_reserved + tol
        checks.add("job_peak_vs_torch_max_memory_reserved_mib", round(max_reserved / MIB, 1),
                   None if peak_bytes is None else round(peak_bytes / MIB, 1),
                   f"+{round(tol / MIB, 1)}", ok,
                   f"method={job.get('method')} running={job.get('running')} allocated={peak['allocated']}")
        checks.add("job_ended", False, job.get("running"), 0, job.get("running") is False)

        metrics = get(base, "/metrics")[1]
        label = {"slurm": f'slurm_job_id="{job.get("slurm_job_id")}"',
                 "pod": f'pod="{job.get("pod")}"',
                 "pod_uid": f'pod="{job.get("pod_uid")}"'}.get(job.get("kind"), "no job")
        series = [l for l in metrics.splitlines()
                  if l.startswith("gpufit_job_gpu_memory_peak_bytes{") and label in l
                  and f'gpu="{a.gpu}"' in l]
        value = max((float(l.rsplit(" ", 1)[1]) for l in series), default=None)
        checks.add("metrics_peak_equals_api_peak", peak_bytes, value, 0,
                   value is not None and peak_bytes is not None and int(value) == peak_bytes)
    finally:
        if worker and worker.poll() is None:
            worker.kill()
        sidecar.terminate()
        try:
            sidecar.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sidecar.kill()
        shutil.rmtree(mapping, ignore_errors=True)
        if checks.rows:
            checks.write(a.out)
            print(f"wrote {len(checks.rows)} rows to {a.out}")
    return 0 if checks.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
