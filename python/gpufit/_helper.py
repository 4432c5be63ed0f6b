"""``GPUEfficiencyHelper``: the helper's class, a thin layer over the functions."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Union

from . import _api
from ._api import History


class GPUEfficiencyHelper:
    """Manages GPU-specific configuration for optimal resource usage.

    Separates engineering decisions (how to fit in memory) from scientific
    decisions (what to learn), and learns from runs: from the history store
    the ``gpufit`` command line uses, and from ``run_log_dir/run_logs.jsonl``.

    Args:
        run_log_dir: directory of ``run_logs.jsonl`` (read by suggestions,
            appended by ``log_run_result``); None: the history store only.
        gpu_type: GPU as nvidia-smi names it (``"NVIDIA A100-SXM4-80GB"``);
            None: ``GPUFIT_GPU``, else this machine's GPU (NVML), learnt at
            the first suggestion.
        history: the history store: a URL (``sqlite:PATH``,
            ``postgres://…``), None for the command line's own
            (``GPUFIT_HISTORY``, else the per-user SQLite file), False for none.

    Example:
        >>> helper = GPUEfficiencyHelper(run_log_dir="logs/", gpu_type="NVIDIA A100-SXM4-80GB")
        >>> config = helper.suggest_config("llama3_1/8B_lora_single_device", 2048)
    """

    def __init__(
        self,
        run_log_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
        gpu_type: Optional[str] = None,
        *,
        history: History = None,
    ) -> None:
        self.run_log_dir = None if run_log_dir is None else os.fspath(run_log_dir)
        self.gpu_type = gpu_type
        self.history = history
        self._last: Optional[Dict[str, Any]] = None

    def suggest_config(
        self,
        model_config: str,
        max_seq_length: Optional[int] = None,
        strategy: str = "balanced",
        prefer_speed: bool = False,
        **kwargs: Any,
    ) -> Dict[str, Any]:
        """Suggest GPU efficiency settings; see :func:`gpufit.suggest_config`."""
        kwargs.setdefault("gpu_type", self.gpu_type)
        kwargs.setdefault("run_log_dir", self.run_log_dir)
        kwargs.setdefault("history", self.history)
        s = _api.suggest_config(model_config, max_seq_length, strategy, prefer_speed, **kwargs)
        if self.gpu_type is None:
            # What detection (or GPUFIT_GPU) found: runs are logged under it.
            self.gpu_type = s["gpu_type"]
        self._last = s
        return s

    def log_run_result(self, config: Mapping[str, Any], result: Mapping[str, Any]) -> Dict[str, Any]:
        """Log a completed run for learning; see :func:`gpufit.log_run_result`.

        The workload defaults to the last suggestion's when ``config`` does
        not name it.
        """
        last = self._last or {}
        return _api.log_run_result(
            config,
            result,
            run_log_dir=self.run_log_dir,
            gpu_type=self.gpu_type or last.get("gpu_type"),
            history=self.history,
            model_config=last.get("model_config"),
            max_seq_length=last.get("max_seq_length"),
        )

    @staticmethod
    def parse_torchtune_log(log_file: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
        """Extract efficiency metrics from a training log; see :func:`gpufit.parse_torchtune_log`."""
        return _api.parse_torchtune_log(log_file)

    def find_max_batch_size(
        self,
        model_config: str,
        max_seq_length: Optional[int] = None,
        test_run: bool = False,
        max_search: int = 64,
        **kwargs: Any,
    ) -> int:
        """Largest micro batch predicted to fit; see :func:`gpufit.find_max_batch_size`."""
        kwargs.setdefault("gpu_type", self.gpu_type)
        kwargs.setdefault("run_log_dir", self.run_log_dir)
        kwargs.setdefault("history", self.history)
        return _api.find_max_batch_size(model_config, max_seq_length, test_run, max_search, **kwargs)

    def estimate(
        self, model_config: str, max_seq_length: Optional[int] = None, batch_size: int = 1, **kwargs: Any
    ) -> Dict[str, Any]:
        """Peak memory of one step; see :func:`gpufit.estimate`."""
        kwargs.setdefault("gpu_type", self.gpu_type)
        return _api.estimate(model_config, max_seq_length, batch_size, **kwargs)

    def __repr__(self) -> str:
        return (
            f"GPUEfficiencyHelper(run_log_dir={self.run_log_dir!r}, gpu_type={self.gpu_type!r}, "
            f"history={self.history!r})"
        )
