"""Figures for docs/python.md: `import gpufit` time and suggest_config
latency (median of 1,000 calls). Run with the Python the wheel is installed
in: `.build/py-venv/bin/python scripts/python_bench.py`."""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def import_ms(runs=15):
    def median_of(code):
        ts = []
        for _ in range(runs):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    return 1000 * (median_of("import gpufit") - median_of("pass"))


def main():
    tmp = tempfile.mkdtemp()
    os.environ["GPUFIT_HISTORY"] = f"sqlite:{tmp}/history.db"
    import gpufit

    a100 = "NVIDIA A100-SXM4-80GB"
    model = "llama3_1/8B_lora_single_device"
    first = gpufit.suggest_config(model, 2048, gpu_type=a100)
    for bs, gb in [(2, 30.0), (4, 45.0), (6, 60.0)]:
        gpufit.log_run_result({**first, "batch_size": bs}, {"success": True, "peak_memory_gb": gb})
    out = {"import_gpufit_ms": round(import_ms(), 1)}
    for name, kw in [("sqlite_history_3_runs", {}), ("no_history", {"history": False})]:
        ts = []
        for _ in range(1000):
            t = time.perf_counter()
            gpufit.suggest_config(model, 2048, gpu_type=a100, **kw)
            ts.append(time.perf_counter() - t)
        out[f"suggest_config_median_ms_{name}"] = round(1000 * statistics.median(ts), 3)
        out[f"suggest_config_p99_ms_{name}"] = round(1000 * sorted(ts)[989], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
