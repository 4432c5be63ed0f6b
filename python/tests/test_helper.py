"""The helper's API and its test cases (seed spec, "Testing Requirements"),
on gpufit's core: names and keys as the helper's, values from gpufit's
memory model and learner."""

import json
import os
import sqlite3
from pathlib import Path

import pytest

import gpufit
from gpufit import GPUEfficiencyHelper, GpufitError

from conftest import A100, MODEL

COMPONENT = "torchtune.models.llama3_1.lora_llama3_1_8b"
KEYS = {
    "batch_size",
    "gradient_accumulation_steps",
    "dtype",
    "enable_activation_checkpointing",
    "enable_activation_offloading",
    "compile",
    "confidence",
    "source",
    "reasoning",
    "predicted_peak_memory_gb",
    "predicted_peak_bytes",
}


def write_logs(d: Path, runs):
    with open(d / "run_logs.jsonl", "w") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")


def run(bs, result, ckpt=False):
    return {
        "config": {
            "model": COMPONENT,
            "max_seq_length": 2048,
            "batch_size": bs,
            "dtype": "bf16",
            "enable_activation_checkpointing": ckpt,
            "compile": False,
        },
        "result": result,
        "gpu_type": A100,
    }


def test_bootstrap_suggestion_8b_lora():
    helper = GPUEfficiencyHelper(gpu_type=A100)
    config = helper.suggest_config(model_config=MODEL, max_seq_length=2048, strategy="balanced")
    assert KEYS <= set(config)
    assert config["batch_size"] >= 1
    assert config["dtype"] in ["bf16", "fp16", "bf16-mixed", "fp16-mixed", "fp32"]
    assert config["source"] == "heuristic"
    assert config["confidence"] < 0.5
    assert config["model"] == "meta-llama/Llama-3.1-8B" and config["method"] == "lora"
    # The predicted peak is within the GPU and in the two units.
    assert 0 < config["predicted_peak_memory_gb"] < 80 * 2**30 / 1e9
    assert config["predicted_peak_bytes"] == round(config["predicted_peak_memory_gb"] * 1e9)


def test_bootstrap_strategies_order_memory_and_unknown_strategy_is_refused():
    helper = GPUEfficiencyHelper(gpu_type=A100)
    s = {st: helper.suggest_config(MODEL, 2048, st) for st in gpufit.STRATEGIES}
    assert (
        s["conservative"]["memory_fraction"]
        <= s["balanced"]["memory_fraction"]
        <= s["aggressive"]["memory_fraction"]
    )
    assert s["conservative"]["enable_activation_checkpointing"] is True
    with pytest.raises(ValueError, match="Unknown strategy: reckless"):
        helper.suggest_config(MODEL, 2048, "reckless")


def test_learned_suggestion_with_data(tmp_path):
    write_logs(
        tmp_path,
        [run(2, {"success": True, "peak_memory_gb": 45.2}), run(4, {"success": False, "failure_reason": "OOM"})],
    )
    helper = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100)
    config = helper.suggest_config(MODEL, 2048, "balanced")
    assert config["history_runs"] == 2
    assert config["source"] in ("historical_data", "historical_data_with_memory")
    assert config["confidence"] > 0.5
    # Between the run that fitted and the one that ran out of memory.
    assert 2 <= config["batch_size"] < 4


def test_memory_aware_suggests_higher_batch_size(tmp_path):
    write_logs(tmp_path, [run(2, {"success": True, "peak_memory_gb": 35.0, "samples_per_sec": 12.5})])
    config = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100).suggest_config(MODEL, 2048, "balanced")
    assert config["batch_size"] > 2
    assert config["source"] == "historical_data_with_memory"
    assert "memory analysis" in config["reasoning"].lower()
    assert config["confidence"] >= 0.5


def test_memory_aware_respects_high_utilization(tmp_path):
    write_logs(tmp_path, [run(2, {"success": True, "peak_memory_gb": 72.0, "samples_per_sec": 12.5})])
    config = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100).suggest_config(MODEL, 2048, "balanced")
    assert config["batch_size"] == 2


def test_memory_aware_respects_oom_limits(tmp_path):
    write_logs(
        tmp_path,
        [
            run(2, {"success": True, "peak_memory_gb": 40.0, "samples_per_sec": 12.5}),
            run(4, {"success": False, "failure_reason": "OOM", "peak_memory_gb": None}),
        ],
    )
    for st in gpufit.STRATEGIES:
        config = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100).suggest_config(MODEL, 2048, st)
        if not config["enable_activation_checkpointing"]:
            assert config["batch_size"] < 4, st  # never the batch that ran out of memory
    assert config["source"] == "historical_data_with_memory"


def test_memory_aware_graceful_fallback(tmp_path):
    write_logs(tmp_path, [run(2, {"success": True, "peak_memory_gb": None, "samples_per_sec": 12.5})])
    config = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100).suggest_config(MODEL, 2048, "balanced")
    assert config["batch_size"] == 2
    assert config["source"] == "historical_data"
    assert "memory analysis" not in config["reasoning"].lower()


def test_malformed_lines_of_run_logs_are_skipped(tmp_path):
    (tmp_path / "run_logs.jsonl").write_text(
        "not json\n" + json.dumps(run(0, {"success": True})) + "\n" + json.dumps(run(2, {"success": True, "peak_memory_gb": 35.0})) + "\n"
    )
    config = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100).suggest_config(MODEL, 2048)
    assert config["history_runs"] == 1


def test_log_run_result_appends_the_helpers_layout_and_the_history(tmp_path):
    helper = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100)
    config = {"batch_size": 2, "dtype": "bf16", "model": {"_component_": COMPONENT}, "max_seq_length": 2048}
    result = {"success": True, "peak_memory_gb": 45.2, "samples_per_sec": 12.5, "failure_reason": None, "duration_sec": 3600.0}
    out = helper.log_run_result(config, result)
    log_file = tmp_path / "run_logs.jsonl"
    logged = json.loads(log_file.read_text().splitlines()[0])
    assert logged["result"]["success"] is True
    assert logged["result"]["peak_memory_gb"] == 45.2
    assert logged["config"]["model"] == COMPONENT and logged["gpu_type"] == A100
    assert logged["timestamp"].endswith("Z")
    # The same run in the store the CLI reads (GPUFIT_HISTORY).
    db = os.environ["GPUFIT_HISTORY"].removeprefix("sqlite:")
    rows = sqlite3.connect(db).execute("select count(*) from runs").fetchone()[0]
    assert rows == 1 and out["id"] is not None
    assert out["run"]["result"]["peak_memory_bytes"] == 45_200_000_000
    assert out["run"]["result"]["samples_per_sec"] == 12.5
    # Counted once although both the file and the store hold it.
    again = helper.suggest_config(MODEL, 2048)
    assert again["history_runs"] == 1


def test_log_run_result_refuses_bad_runs_and_writes_nothing(tmp_path):
    helper = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100)
    base = {"model": COMPONENT, "max_seq_length": 2048, "dtype": "bf16"}
    with pytest.raises(GpufitError):
        helper.log_run_result({**base, "batch_size": 0}, {"success": True})
    with pytest.raises(GpufitError):
        helper.log_run_result({**base, "batch_size": 2}, {"success": True, "peak_memory_gb": -3})
    assert not (tmp_path / "run_logs.jsonl").exists()
    with pytest.raises(ValueError, match="run_log_dir not set"):
        GPUEfficiencyHelper(gpu_type=A100, history=False).log_run_result({**base, "batch_size": 2}, {"success": True})
    with pytest.raises(ValueError, match="names no model"):
        GPUEfficiencyHelper(gpu_type=A100).log_run_result({"batch_size": 2}, {"success": True})


def test_learning_loop_suggest_run_parse_log_next(tmp_path):
    """Pattern 2: suggest → run → parse_torchtune_log → log_run_result → a better next suggestion."""
    helper = GPUEfficiencyHelper(run_log_dir=str(tmp_path), gpu_type=A100)
    first = helper.suggest_config(MODEL, 2048, "balanced")
    assert first["source"] == "heuristic"
    log = tmp_path / "exp_001.log"
    used = 0.5 * first["predicted_peak_memory_gb"]  # the run used half the prediction
    log.write_text(
        "INFO:torchtune.training:Starting training...\n"
        f"INFO:torchtune.training:GPU Memory: Used {used:.1f}GB / 80.0GB\n"
        "INFO:torchtune.training:Throughput: 12.5 samples/sec\n"
        "INFO:torchtune.training:Training completed in 3600.0 seconds\n"
    )
    result = GPUEfficiencyHelper.parse_torchtune_log(str(log))
    helper.log_run_result({**first}, result)  # the suggestion dict names the workload
    second = helper.suggest_config(MODEL, 2048, "balanced")
    assert second["source"] == "historical_data_with_memory"
    assert second["confidence"] > first["confidence"]
    assert second["batch_size"] > first["batch_size"]


def test_parse_successful_log(tmp_path):
    p = tmp_path / "ok.log"
    p.write_text(
        "INFO:torchtune.training:Starting training...\n"
        "INFO:torchtune.training:GPU Memory: Used 45.2GB / 80.0GB\n"
        "INFO:torchtune.training:Throughput: 12.5 samples/sec\n"
        "INFO:torchtune.training:Training completed in 3600.0 seconds\n"
    )
    result = GPUEfficiencyHelper.parse_torchtune_log(str(p))
    assert result["success"] is True
    assert result["peak_memory_gb"] == 45.2
    assert result["samples_per_sec"] == 12.5
    assert result["duration_sec"] == 3600.0
    assert result["failure_reason"] is None


def test_parse_oom_log(tmp_path):
    p = tmp_path / "oom.log"
    p.write_text(
        "INFO:torchtune.training:Starting training...\n"
        "ERROR:RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    result = gpufit.parse_torchtune_log(p)
    assert result["success"] is False
    assert result["failure_reason"] == "OOM"


def test_parse_missing_log_carries_the_clis_message(tmp_path):
    with pytest.raises(GpufitError, match="cannot open log") as e:
        gpufit.parse_torchtune_log(tmp_path / "nope.log")
    assert e.value.exit_code != 0


def test_find_max_batch_size_and_estimate():
    helper = GPUEfficiencyHelper(gpu_type=A100, history=False)
    balanced = helper.suggest_config(MODEL, 2048)
    m = helper.find_max_batch_size(MODEL, 2048)
    assert m >= balanced["batch_size"]
    assert helper.find_max_batch_size(MODEL, 2048, max_search=1) == 1
    with pytest.raises(GpufitError, match="find-max-batch"):
        helper.find_max_batch_size(MODEL, 2048, test_run=True)
    small = helper.estimate(MODEL, 2048, batch_size=1)
    big = helper.estimate(MODEL, 2048, batch_size=8)
    assert 0 < small["estimate"]["peak_bytes"] < big["estimate"]["peak_bytes"]
    assert big["gpu"]["name"] == A100
    assert big["gpu"]["max_micro_batch"] >= 1
    assert big["peak_memory_gb"] == big["estimate"]["peak_bytes"] / 1e9


def test_errors_carry_the_command_lines_messages():
    with pytest.raises(GpufitError, match="unknown GPU|not in the catalog|gpus") as e:
        gpufit.suggest_config(MODEL, 2048, gpu_type="NVIDIA Imaginary 9000")
    assert e.value.exit_code != 0
    with pytest.raises(GpufitError, match="nonexistent"):
        gpufit.suggest_config("nonexistent/model-zz", 2048, gpu_type=A100)
    with pytest.raises(GpufitError, match="--seq-len|sequence"):
        gpufit.suggest_config(MODEL, 10**8, gpu_type=A100)


def test_the_installed_package_is_tested_not_the_source_tree():
    assert "site-packages" in gpufit.__file__, gpufit.__file__
    import gpufit._native as n
    assert n.__file__.endswith((".so", ".pyd")) and "abi3" in n.__file__


def test_without_a_gpu_named_the_local_one_is_asked_for():
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA GPU: detection would succeed")
    with pytest.raises(GpufitError, match="NVML") as e:
        GPUEfficiencyHelper().suggest_config(MODEL, 2048)
    assert "NVIDIA A100-SXM4-80GB" in str(e.value)  # the message shows how to name one
