"""``GpufitCallback`` for Lightning's Trainer.

Usage::

    from gpufit.integrations.lightning import GpufitCallback
    trainer = L.Trainer(..., callbacks=[GpufitCallback()])

At the start of training it reads the settings the Trainer really runs
(``precision``, ``accumulate_grad_batches``, the train loader's batch size
and ``num_workers``) and resets the allocator's peak; it counts samples and
tokens of every batch, and at the end (or on an exception: ``oom`` for a
CUDA OOM, else ``failed``) writes the result record (:mod:`gpufit.record`)
with the exact per-rank peak and tokens/s.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback  # type: ignore[no-redef]

from .. import record as _record
from .._track import _is_oom
from ._common import batch_counts, loader_batch_size

__all__ = ["GpufitCallback"]


class GpufitCallback(Callback):
    """Confirms and measures a Lightning run for gpufit.

    Args:
        activation_checkpointing, compile: what the module does (Lightning
            does not say); recorded when given.
        write: False to keep the record in ``self.record`` only.
        termination_log, result_file, controller_url, token: see
            :func:`gpufit.record.write`.
    """

    def __init__(
        self,
        *,
        activation_checkpointing: Optional[bool] = None,
        compile: Optional[bool] = None,
        write: bool = True,
        termination_log: Optional[str] = None,
        result_file: Optional[str] = None,
        controller_url: Optional[str] = None,
        token: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.told = {"activation_checkpointing": activation_checkpointing, "compile": compile}
        self.write = write
        self.destinations = {
            "termination_log": termination_log,
            "result_file": result_file,
            "controller_url": controller_url,
            "token": token,
        }
        self.meter = _record.Meter("lightning")
        self.ran: Dict[str, Any] = {}
        self.record: Optional[Dict[str, Any]] = None
        self.written: List[str] = []
        self._done = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        self.ran = {
            "micro_batch_size": loader_batch_size(loader),
            "gradient_accumulation_steps": int(trainer.accumulate_grad_batches),
            "dtype": _record.dtype_name(trainer.precision),
            "num_workers": getattr(loader, "num_workers", None),
            **self.told,
        }
        self.meter = _record.Meter("lightning")
        self._steps_at_start = int(trainer.global_step)
        self._done = False
        self.meter.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        samples, tokens = batch_counts(batch)
        if self.ran.get("micro_batch_size") is None and samples:
            self.ran["micro_batch_size"] = samples  # a loader without a batch size
        self.meter.add(samples, tokens)

    def _finish(self, trainer: Any, outcome: str) -> None:
        if self._done or not self.ran:
            return
        self._done = True
        self.meter.steps = int(trainer.global_step) - self._steps_at_start
        self.record = self.meter.record(self.ran, outcome)
        if self.write:
            self.written = _record.write(self.record, **self.destinations)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(trainer, "completed")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(trainer, "oom" if _is_oom(exception) else "failed")
