"""The helper's functions on gpufit's core.

Each function builds the flags of the matching ``gpufit`` command and hands
them to the Rust core (``gpufit._native``), which parses them with the
command line's own types: a suggestion here is the one ``gpufit suggest``
prints for the same inputs, and errors carry the command line's messages.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Union

from . import _native
from ._native import GpufitError

#: The strategies, least to most GPU memory.
STRATEGIES = ("conservative", "balanced", "aggressive")

#: The suggestion's keys a training config takes (the helper's engineering
#: fields): ``config.update({k: s[k] for k in gpufit.SUGGESTED_FIELDS})``.
SUGGESTED_FIELDS = (
    "batch_size",
    "gradient_accumulation_steps",
    "dtype",
    "enable_activation_checkpointing",
    "enable_activation_offloading",
    "compile",
)

#: Bytes in the helper's ``*_gb`` figures: decimal gigabytes, as
#: ``run_logs.jsonl`` and ``gpufit history import`` read them.
GB = 1e9

History = Union[str, bool, None]


def _check_strategy(strategy: str) -> str:
    s = str(strategy).strip().lower()
    if s == "extreme":
        s = "aggressive"
    if s not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy: {strategy} (use conservative, balanced or aggressive)"
        )
    return s


def _on_off(v: Optional[bool]) -> Optional[str]:
    if v is None:
        return None
    return "on" if v else "off"


def _flags(pairs: List[tuple]) -> List[str]:
    argv: List[str] = []
    for flag, value in pairs:
        if value is None:
            continue
        argv += [flag, str(value)]
    return argv


def _gpu_flag(gpu_type: Optional[str]) -> List[str]:
    # As the helper: no GPU named means this machine's GPU. The command
    # line's GPUFIT_GPU still wins over detection when set.
    if gpu_type:
        return ["--gpu", gpu_type]
    if os.environ.get("GPUFIT_GPU", "").strip():
        return []
    return ["--gpu", "auto"]


def _history_flags(history: History) -> List[str]:
    if history is False:
        return ["--no-history"]
    if history is None or history is True:
        return []
    return ["--history", str(history)]


def _workload_flags(
    model_config: str,
    max_seq_length: Optional[int],
    framework: Optional[str],
    method: Optional[str],
    lora_rank: Optional[int],
    global_batch: Optional[int],
    gpus: Optional[int],
    optimizer: Optional[str],
) -> List[str]:
    return _flags(
        [
            ("--model", model_config),
            ("--seq-len", max_seq_length),
            ("--framework", framework),
            ("--method", method),
            ("--lora-rank", lora_rank),
            ("--global-batch", global_batch),
            ("--gpus", gpus),
            ("--optimizer", optimizer),
        ]
    )


def suggest_config(
    model_config: str,
    max_seq_length: Optional[int] = None,
    strategy: str = "balanced",
    prefer_speed: bool = False,
    *,
    gpu_type: Optional[str] = None,
    run_log_dir: Optional[str] = None,
    history: History = None,
    framework: Optional[str] = None,
    method: Optional[str] = None,
    lora_rank: Optional[int] = None,
    global_batch: Optional[int] = None,
    gpus: Optional[int] = None,
    optimizer: Optional[str] = None,
    batch_size: Optional[int] = None,
    gradient_accumulation_steps: Optional[int] = None,
    dtype: Optional[str] = None,
    enable_activation_checkpointing: Optional[bool] = None,
    enable_activation_offloading: Optional[bool] = None,
    compile: Optional[bool] = None,
    num_workers: Optional[int] = None,
    cpus_per_gpu: Optional[int] = None,
) -> Dict[str, Any]:
    """Suggest GPU efficiency settings (``gpufit suggest``).

    Args:
        model_config: the model: a torchtune config name
            (``"llama3_1/8B_lora_single_device"``), a catalog id
            (``"meta-llama/Llama-3.1-8B"``) or a Hugging Face config.json path.
        max_seq_length: training sequence length (default: the model's).
        strategy: ``"conservative"``, ``"balanced"`` or ``"aggressive"``.
        prefer_speed: accepted for the helper's signature; gpufit's advisor
            already picks the fastest predicted settings within the
            strategy's memory target.
        gpu_type: GPU as nvidia-smi names it (``"NVIDIA A100-SXM4-80GB"``);
            default: ``GPUFIT_GPU``, else this machine's GPU (NVML).
        run_log_dir: a directory whose ``run_logs.jsonl`` adds runs.
        history: the history store: a URL (``sqlite:PATH``,
            ``postgres://…``), ``None`` for the command line's own
            (``GPUFIT_HISTORY``, else the per-user SQLite file), ``False``
            for none.
        batch_size … num_workers: engineering settings to pin (kept; gpufit
            only warns when it predicts an OOM).

    Returns:
        The helper's dict: ``batch_size``, ``gradient_accumulation_steps``,
        ``dtype``, ``enable_activation_checkpointing``,
        ``enable_activation_offloading``, ``compile``, ``confidence``,
        ``source``, ``reasoning``, ``predicted_peak_memory_gb`` (and
        ``predicted_peak_bytes``), plus the data loader, warnings and the
        resolved workload (``model``, ``max_seq_length``, ``gpu_type``).

    Raises:
        GpufitError: with the command line's message (unknown model, GPU…).
        ValueError: an unknown strategy.
    """
    del prefer_speed  # see the docstring
    s = _check_strategy(strategy)
    argv = _workload_flags(
        model_config, max_seq_length, framework, method, lora_rank, global_batch, gpus, optimizer
    )
    argv += _gpu_flag(gpu_type)
    argv += _history_flags(history)
    argv += _flags(
        [
            ("--micro-batch", batch_size),
            ("--grad-accum", gradient_accumulation_steps),
            ("--dtype", dtype),
            ("--checkpointing", _on_off(enable_activation_checkpointing)),
            ("--offloading", _on_off(enable_activation_offloading)),
            ("--compile", _on_off(compile)),
            ("--num-workers", num_workers),
            ("--cpus-per-gpu", cpus_per_gpu),
            ("--strategy", s),
        ]
    )
    out = json.loads(_native.suggest(argv, run_log_dir))
    return _suggestion_dict(out, model_config)


def _suggestion_dict(out: Mapping[str, Any], model_config: str) -> Dict[str, Any]:
    sg = out["suggestion"]
    dl = sg["dataloader"]
    return {
        "batch_size": sg["micro_batch_size"],
        "gradient_accumulation_steps": sg["gradient_accumulation_steps"],
        "dtype": sg["dtype"],
        "enable_activation_checkpointing": sg["activation_checkpointing"],
        "enable_activation_offloading": sg["activation_offloading"],
        "compile": sg["compile"],
        "num_workers": dl["num_workers"],
        "dataloader": dict(dl),
        "confidence": sg["confidence"],
        "source": sg["source"],
        "reasoning": sg["reasoning"],
        "warnings": list(sg["warnings"]),
        "strategy": sg["strategy"],
        "predicted_peak_memory_gb": sg["predicted_peak_bytes"] / GB,
        "predicted_peak_bytes": sg["predicted_peak_bytes"],
        "memory_fraction": sg["memory_fraction"],
        "predicted_tokens_per_sec": sg.get("predicted_tokens_per_sec"),
        "measured_tokens_per_sec": sg.get("measured_tokens_per_sec"),
        "gpu_type": sg["gpu"],
        "gpu_memory_gb": out["gpu_memory_bytes"] / GB,
        "model_config": model_config,
        "model": out["model"],
        "method": out["method"],
        "max_seq_length": out["seq_len"],
        "lora_rank": out["lora_rank"],
        "gpus": out["gpus"],
        "global_batch": out["global_batch"],
        "history_runs": out["history_runs"],
    }


def estimate(
    model_config: str,
    max_seq_length: Optional[int] = None,
    batch_size: int = 1,
    *,
    dtype: str = "bf16",
    enable_activation_checkpointing: bool = False,
    enable_activation_offloading: bool = False,
    compile: bool = False,
    gradient_accumulation_steps: int = 1,
    gpu_type: Optional[str] = None,
    framework: Optional[str] = None,
    method: Optional[str] = None,
    lora_rank: Optional[int] = None,
    gpus: Optional[int] = None,
    optimizer: Optional[str] = None,
) -> Dict[str, Any]:
    """Predict the peak GPU memory of one training step (``gpufit estimate``).

    Returns the memory model's breakdown (``estimate`` holds the bytes by
    component and ``peak_bytes``), ``peak_memory_gb``, and with
    ``gpu_type`` the fit on that GPU (``gpu.fits``, ``gpu.max_micro_batch``).
    """
    argv = _workload_flags(
        model_config, max_seq_length, framework, method, lora_rank, None, gpus, optimizer
    )
    argv += _flags(
        [
            ("--micro-batch", batch_size),
            ("--dtype", dtype),
            ("--checkpointing", _on_off(enable_activation_checkpointing)),
            ("--offloading", _on_off(enable_activation_offloading)),
            ("--compile", _on_off(compile)),
            ("--grad-accum", gradient_accumulation_steps),
            ("--gpu", gpu_type),
        ]
    )
    out = json.loads(_native.estimate(argv))
    out["peak_memory_gb"] = out["estimate"]["peak_bytes"] / GB
    return out


def parse_torchtune_log(log_file: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Extract efficiency metrics from a training log (``gpufit parse-log``).

    Reads torchtune, Hugging Face Trainer and Lightning logs, CUDA OOM
    tracebacks and plain ``Peak memory:`` lines with gpufit's log parsers.

    Returns the result dict ``log_run_result`` takes: ``success``,
    ``peak_memory_gb`` (decimal GB), ``samples_per_sec``, ``failure_reason``
    (``"OOM"``, ``"other_error"`` or None), ``duration_sec``; plus
    ``tokens_per_sec``, ``peak_memory_bytes`` and ``outcome``
    (``completed``, ``out_of_memory``, ``failed`` or None when the log has no
    end-of-training line — then ``success`` is True unless it shows an error).
    """
    p = json.loads(_native.parse_log(os.fspath(log_file)))
    peak = p.get("peak_memory_bytes")
    failure = p.get("failure_reason")
    success = p.get("success")
    if success is None:
        success = failure is None
    return {
        "success": bool(success),
        "peak_memory_gb": None if peak is None else peak / GB,
        "samples_per_sec": p.get("samples_per_sec"),
        "failure_reason": failure,
        "duration_sec": p.get("duration_sec"),
        "tokens_per_sec": p.get("tokens_per_sec"),
        "peak_memory_bytes": peak,
        "outcome": p.get("outcome"),
    }


def find_max_batch_size(
    model_config: str,
    max_seq_length: Optional[int] = None,
    test_run: bool = False,
    max_search: int = 64,
    **kwargs: Any,
) -> int:
    """Largest micro batch predicted to fit (``test_run=False``).

    The aggressive strategy's micro batch: the memory model calibrated by
    the similar runs of the history, the batch ``gpufit find-max-batch``
    starts its search from; capped at ``max_search``. Keyword arguments are
    ``suggest_config``'s.

    ``test_run=True`` runs real training trials: that is the command line's
    ``gpufit find-max-batch --cmd '…'`` (it binary-searches with your
    training command and records every trial); this function refuses it.
    """
    if test_run:
        raise GpufitError(
            "test_run=True runs real training trials: run `gpufit find-max-batch --model … --gpu … "
            "--cmd 'python train.py --batch {micro_batch_size}'`, which searches with your command "
            "and records each trial in the history"
        )
    if max_search < 1:
        raise ValueError(f"max_search must be at least 1 (got {max_search})")
    kwargs.pop("strategy", None)
    s = suggest_config(model_config, max_seq_length, "aggressive", **kwargs)
    return int(min(s["batch_size"], max_search))


def _model_name(config: Mapping[str, Any]) -> Optional[str]:
    m = config.get("model")
    if isinstance(m, Mapping):
        m = m.get("_component_")
    return m if isinstance(m, str) and m.strip() else None


def _seq_len(config: Mapping[str, Any]) -> Optional[int]:
    v = config.get("max_seq_length")
    if v is None:
        tok = config.get("tokenizer")
        if isinstance(tok, Mapping):
            v = tok.get("max_seq_len")
    return None if v is None else int(v)


def _relevant_config(config: Mapping[str, Any], model: str, seq_len: int) -> Dict[str, Any]:
    """The helper's ``_extract_relevant_config``: the engineering fields."""
    return {
        "model": model,
        "max_seq_length": seq_len,
        "batch_size": config.get("batch_size"),
        "dtype": config.get("dtype"),
        "enable_activation_checkpointing": config.get("enable_activation_checkpointing"),
        "enable_activation_offloading": config.get("enable_activation_offloading"),
        "compile": config.get("compile"),
        "gradient_accumulation_steps": config.get("gradient_accumulation_steps"),
    }


def log_run_result(
    config: Mapping[str, Any],
    result: Mapping[str, Any],
    *,
    run_log_dir: Optional[str] = None,
    gpu_type: Optional[str] = None,
    history: History = None,
    model_config: Optional[str] = None,
    max_seq_length: Optional[int] = None,
) -> Dict[str, Any]:
    """Log a completed run for learning.

    Appends one line to ``{run_log_dir}/run_logs.jsonl`` in the helper's
    layout (when ``run_log_dir`` is given) and stores the run in the history
    the command line uses (``history``: a URL, ``None`` for
    ``GPUFIT_HISTORY`` or the per-user SQLite file, ``False`` for none), so
    ``gpufit suggest`` learns from it and the reverse.

    Args:
        config: the run's config: a ``suggest_config`` dict merged with your
            own, or a torchtune config (``model._component_``,
            ``tokenizer.max_seq_len``); ``batch_size`` is required.
        result: ``success``, ``peak_memory_gb`` (decimal GB),
            ``samples_per_sec``, ``failure_reason`` (``"OOM"``,
            ``"other_error"``, None), ``duration_sec``; optionally
            ``tokens_per_sec`` and ``peak_memory_bytes`` (exact, preferred).
        model_config, max_seq_length: the workload when ``config`` names none.

    Returns:
        The run as recorded (``run``), its ``id`` and ``store`` when stored,
        and the ``line`` written to ``run_logs.jsonl``.

    Raises:
        ValueError: nowhere to log (no ``run_log_dir`` and ``history=False``),
            or the config lacks the model, sequence length or GPU.
        GpufitError: the run is refused (batch 0, negative memory…) or the
            store fails; nothing is written then.
    """
    import uuid  # here, not at import: `import gpufit` stays quick

    if run_log_dir is None and history is False:
        raise ValueError("run_log_dir not set, cannot log results")
    model = _model_name(config) or config.get("model_config") or model_config
    if not model:
        raise ValueError(
            "the config names no model: give config['model'] (a name or torchtune's "
            "{'_component_': …}) or model_config="
        )
    seq_len = _seq_len(config) or max_seq_length
    gpu = gpu_type or config.get("gpu_type") or os.environ.get("GPUFIT_GPU", "").strip() or None
    if not gpu:
        raise ValueError("which GPU did the run use? pass gpu_type= (e.g. 'NVIDIA A100-SXM4-80GB')")
    # The workload as every gpufit command resolves it (canonical model,
    # method, default sequence length); a model the catalog does not know is
    # recorded under its name, as `gpufit history import` does.
    extra: Dict[str, Any] = {"source": "cli", "job_id": f"python-{uuid.uuid4()}"}
    try:
        w = json.loads(
            _native.resolve_workload(
                _flags(
                    [
                        ("--model", model),
                        ("--seq-len", seq_len),
                        ("--method", config.get("method")),
                        ("--lora-rank", config.get("lora_rank")),
                        ("--gpus", config.get("gpus")),
                        ("--global-batch", config.get("global_batch")),
                    ]
                )
            )
        )
        seq_len = w["seq_len"]
        extra.update(
            method=w["method"], lora_rank=w["lora_rank"], gpus=w["gpus"], global_batch=w["global_batch"]
        )
    except GpufitError:
        if seq_len is None:
            raise ValueError(
                f"no sequence length for {model}: give config['max_seq_length'] or max_seq_length="
            ) from None
    if result.get("peak_memory_bytes") is not None:
        extra["peak_memory_bytes"] = int(result["peak_memory_bytes"])
    if result.get("tokens_per_sec") is not None:
        extra["tokens_per_sec"] = float(result["tokens_per_sec"])
    if config.get("predicted_peak_bytes") is not None:
        extra["predicted_peak_bytes"] = int(config["predicted_peak_bytes"])
    if isinstance(config.get("dataloader"), Mapping):
        extra["dataloader"] = dict(config["dataloader"])
    extra = {k: v for k, v in extra.items() if v is not None}
    res = {
        "success": result.get("success"),
        "peak_memory_gb": result.get("peak_memory_gb"),
        "samples_per_sec": result.get("samples_per_sec"),
        "failure_reason": result.get("failure_reason"),
        "duration_sec": result.get("duration_sec"),
    }
    line = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
        "config": _relevant_config(config, model, seq_len),
        "result": res,
        "gpu_type": gpu,
        "gpufit": extra,
    }
    text = json.dumps(line)
    # Checked before anything is written: a run the history would refuse
    # goes nowhere.
    stored = json.loads(_native.record_run(text, None, False))
    if run_log_dir is not None:
        os.makedirs(run_log_dir, exist_ok=True)
        path = os.path.join(run_log_dir, "run_logs.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    if history is not False:
        url = None if history is None or history is True else str(history)
        stored = json.loads(_native.record_run(text, url, True))
    stored["line"] = line
    return stored
