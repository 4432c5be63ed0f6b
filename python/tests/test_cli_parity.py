"""The package answers what `gpufit suggest` answers, and both share one history."""

import json
import subprocess

import gpufit

from conftest import A100, MODEL

COMPARED = [
    ("batch_size", "micro_batch_size"),
    ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ("dtype", "dtype"),
    ("enable_activation_checkpointing", "activation_checkpointing"),
    ("enable_activation_offloading", "activation_offloading"),
    ("compile", "compile"),
    ("confidence", "confidence"),
    ("source", "source"),
    ("reasoning", "reasoning"),
    ("predicted_peak_bytes", "predicted_peak_bytes"),
    ("gpu_type", "gpu"),
    ("strategy", "strategy"),
]


def cli(gpufit_bin, *args):
    p = subprocess.run([gpufit_bin, *args, "-o", "json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def same(py, cli_json):
    for k_py, k_cli in COMPARED:
        assert py[k_py] == cli_json[k_cli], (k_py, py[k_py], cli_json[k_cli])
    assert py["dataloader"] == cli_json["dataloader"]


def test_suggestion_matches_gpufit_suggest_for_the_same_inputs(gpufit_bin):
    cases = [
        (MODEL, 2048, "balanced", {}),
        (MODEL, 4096, "conservative", {}),
        ("meta-llama/Llama-3.1-8B", 1024, "aggressive", {"global_batch": 64}),
        ("Qwen/Qwen2.5-0.5B", 2048, "balanced", {"framework": "hf", "gpu_type": "NVIDIA L4"}),
    ]
    for model, seq, strategy, kw in cases:
        gpu = kw.pop("gpu_type", A100)
        py = gpufit.suggest_config(model, seq, strategy, gpu_type=gpu, **kw)
        flags = ["suggest", "--model", model, "--seq-len", str(seq), "--strategy", strategy, "--gpu", gpu]
        if "global_batch" in kw:
            flags += ["--global-batch", str(kw["global_batch"])]
        if "framework" in kw:
            flags += ["--framework", kw["framework"]]
        same(py, cli(gpufit_bin, *flags))


def test_a_run_logged_from_python_teaches_the_cli_and_the_reverse(gpufit_bin, tmp_path):
    flags = ["suggest", "--model", MODEL, "--seq-len", "2048", "--gpu", A100]
    first = gpufit.suggest_config(MODEL, 2048, gpu_type=A100)
    # Python logs a run that used little memory: the CLI's next suggestion learns from it.
    gpufit.log_run_result(
        {**first},
        {"success": True, "peak_memory_gb": 20.0, "samples_per_sec": 3.0, "failure_reason": None, "duration_sec": 60.0},
    )
    after_py = cli(gpufit_bin, *flags)
    assert after_py["source"] != "heuristic"
    same(gpufit.suggest_config(MODEL, 2048, gpu_type=A100), after_py)
    # The CLI records an OOM at a larger batch: Python's next suggestion heeds it.
    big = after_py["micro_batch_size"]
    rec = subprocess.run(
        [gpufit_bin, "record", "--model", MODEL, "--seq-len", "2048", "--gpu", A100,
         "--micro-batch", str(big), "--failure", "oom", "--dtype", after_py["dtype"]],
        capture_output=True, text=True, timeout=120,
    )
    assert rec.returncode == 0, rec.stderr
    py = gpufit.suggest_config(MODEL, 2048, gpu_type=A100)
    assert py["history_runs"] == 2
    if not py["enable_activation_checkpointing"]:
        assert py["batch_size"] < big
    same(py, cli(gpufit_bin, *flags))


def test_errors_are_the_clis(gpufit_bin):
    p = subprocess.run(
        [gpufit_bin, "suggest", "--model", "nonexistent/model-zz", "--seq-len", "2048", "--gpu", A100],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode != 0
    cli_msg = p.stderr.strip().splitlines()[0].removeprefix("error: ")
    try:
        gpufit.suggest_config("nonexistent/model-zz", 2048, gpu_type=A100)
    except gpufit.GpufitError as e:
        assert str(e).splitlines()[0] == cli_msg
        assert e.exit_code == p.returncode
    else:
        raise AssertionError("no error")
