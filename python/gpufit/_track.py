"""``gpufit.track``: the result record for a custom training loop."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import record as _record


def _is_oom(e: BaseException) -> bool:
    name = type(e).__name__
    return name == "OutOfMemoryError" or "CUDA out of memory" in str(e)


class Tracker:
    """What :func:`track` yields: call :meth:`step` once per optimizer step.

    After the ``with`` block, ``record`` holds the record and ``written``
    where it went.
    """

    def __init__(
        self,
        ran: Dict[str, Any],
        seq_len: Optional[int],
        destinations: Dict[str, Any],
        write: bool,
        source: str = "track",
    ) -> None:
        self.ran = ran
        self.seq_len = seq_len
        self.meter = _record.Meter(source)
        self.destinations = destinations
        self.write = write
        self.record: Optional[Dict[str, Any]] = None
        self.written: List[str] = []

    def step(self, samples: Optional[int] = None, tokens: Optional[int] = None) -> None:
        """One optimizer step of this rank.

        Args:
            samples: sequences this rank trained on in the step (default:
                micro batch × accumulation steps).
            tokens: tokens this rank trained on (default: samples × seq_len
                when ``seq_len`` was given).
        """
        if samples is None:
            samples = int(self.ran["micro_batch_size"]) * int(
                self.ran.get("gradient_accumulation_steps") or 1
            )
        if tokens is None:
            tokens = samples * self.seq_len if self.seq_len else 0
        self.meter.step(samples, tokens)

    def _finish(self, outcome: str) -> None:
        self.record = self.meter.record(self.ran, outcome)
        if self.write:
            self.written = _record.write(self.record, **self.destinations)


class track:  # noqa: N801 - a function-like context manager, as the API names it
    """Records what a custom training loop runs (torchtune recipes, plain PyTorch).

    Example::

        with gpufit.track(micro_batch_size=8, gradient_accumulation_steps=4,
                          dtype="bf16", seq_len=2048) as t:
            for batch in loader:
                ...  # forward, backward, optimizer step
                t.step()

    On leaving the block the record (settings as told, the exact per-rank
    peak when CUDA is present, tokens/s) is written where gpufit looks
    (see :mod:`gpufit.record`); a CUDA OOM is recorded as ``oom``, another
    exception as ``failed``, and the exception propagates.

    Args:
        micro_batch_size: sequences per GPU per forward pass (required).
        gradient_accumulation_steps, dtype, activation_checkpointing,
        activation_offloading, compile, num_workers: what the loop runs.
        seq_len: tokens per sequence, for tokens/s when ``step`` is not told.
        write: False to only build ``record``.
        termination_log, result_file, controller_url, token: see
            :func:`gpufit.record.write`.
    """

    def __init__(
        self,
        *,
        micro_batch_size: int,
        gradient_accumulation_steps: int = 1,
        dtype: Optional[str] = None,
        activation_checkpointing: Optional[bool] = None,
        activation_offloading: Optional[bool] = None,
        compile: Optional[bool] = None,
        num_workers: Optional[int] = None,
        seq_len: Optional[int] = None,
        write: bool = True,
        termination_log: Optional[str] = None,
        result_file: Optional[str] = None,
        controller_url: Optional[str] = None,
        token: Optional[str] = None,
    ) -> None:
        if int(micro_batch_size) < 1:
            raise ValueError(f"micro_batch_size must be at least 1 (got {micro_batch_size})")
        ran = {
            "micro_batch_size": int(micro_batch_size),
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "dtype": _record.dtype_name(dtype),
            "activation_checkpointing": activation_checkpointing,
            "activation_offloading": activation_offloading,
            "compile": compile,
            "num_workers": num_workers,
        }
        dest = {
            "termination_log": termination_log,
            "result_file": result_file,
            "controller_url": controller_url,
            "token": token,
        }
        self.tracker = Tracker(ran, seq_len, dest, write)

    def __enter__(self) -> Tracker:
        self.tracker.meter.start()
        return self.tracker

    def __exit__(self, et: Any, e: Optional[BaseException], tb: Any) -> bool:
        if e is None:
            outcome = "completed"
        elif _is_oom(e):
            outcome = "oom"
        else:
            outcome = "failed"
        self.tracker._finish(outcome)
        return False
