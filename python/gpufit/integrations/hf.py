"""``GpufitCallback`` for the Hugging Face Trainer.

Usage::

    from gpufit.integrations.hf import GpufitCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[GpufitCallback()])

At the start of training it reads the settings the Trainer really runs
(``per_device_train_batch_size``, ``gradient_accumulation_steps``,
``bf16``/``fp16`` or the model's dtype, ``activation_checkpointing`` /
``gradient_checkpointing``,
``torch_compile``, ``dataloader_num_workers``) and resets the allocator's
peak; at the end it writes the result record (:mod:`gpufit.record`) with the
exact per-rank peak and tokens/s: ``state.num_input_tokens_seen`` when
``include_num_input_tokens_seen`` is on, else samples × ``seq_len`` (the
argument, else ``GPUFIT_SEQ_LEN``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from transformers import TrainerCallback

from .. import record as _record
from ._common import seq_len_from_env

__all__ = ["GpufitCallback"]


def _dtype(args: Any, model: Any) -> Optional[str]:
    if getattr(args, "bf16", False):
        return "bf16-mixed"  # autocast over fp32 weights
    if getattr(args, "fp16", False):
        return "fp16-mixed"
    return _record.dtype_name(getattr(model, "dtype", None))


class GpufitCallback(TrainerCallback):
    """Confirms and measures a Hugging Face Trainer run for gpufit.

    Args:
        seq_len: tokens per sample, for tokens/s without
            ``include_num_input_tokens_seen`` (default ``GPUFIT_SEQ_LEN``).
        write: False to keep the record in ``self.record`` only.
        termination_log, result_file, controller_url, token: see
            :func:`gpufit.record.write`.
    """

    def __init__(
        self,
        seq_len: Optional[int] = None,
        *,
        write: bool = True,
        termination_log: Optional[str] = None,
        result_file: Optional[str] = None,
        controller_url: Optional[str] = None,
        token: Optional[str] = None,
    ) -> None:
        self.seq_len = seq_len_from_env(seq_len)
        self.write = write
        self.destinations = {
            "termination_log": termination_log,
            "result_file": result_file,
            "controller_url": controller_url,
            "token": token,
        }
        self.meter = _record.Meter("hf")
        self.ran: Dict[str, Any] = {}
        self.record: Optional[Dict[str, Any]] = None
        self.written: List[str] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ran = {
            "micro_batch_size": int(args.per_device_train_batch_size),
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "dtype": _dtype(args, kwargs.get("model")),
            # `activation_checkpointing` since transformers 5, `gradient_checkpointing` before.
            "activation_checkpointing": bool(
                getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
            ),
            "compile": bool(getattr(args, "torch_compile", False)),
            "num_workers": int(getattr(args, "dataloader_num_workers", 0)),
        }
        self.meter = _record.Meter("hf")
        self._tokens_at_start = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self.meter.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        samples = self.ran["micro_batch_size"] * self.ran["gradient_accumulation_steps"]
        self.meter.step(samples, samples * self.seq_len if self.seq_len else 0)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0) - self._tokens_at_start
        if seen > 0:
            # The Trainer's count is over every process already: this
            # rank's share, which the record sums again.
            _, world = _record.rank_and_world()
            self.meter.tokens = seen // world
        self.record = self.meter.record(self.ran, "completed")
        if self.write:
            self.written = _record.write(self.record, **self.destinations)
