"""What the callbacks share: counting a batch, the sequence length."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Tuple


def seq_len_from_env(seq_len: Optional[int]) -> Optional[int]:
    """The sequence length given, else ``GPUFIT_SEQ_LEN`` (what the job told gpufit)."""
    if seq_len is not None:
        return int(seq_len)
    v = os.environ.get("GPUFIT_SEQ_LEN", "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else None


def batch_counts(batch: Any) -> Tuple[int, int]:
    """(samples, tokens) of a batch: ``input_ids`` of a mapping, else the
    first tensor found; tokens are samples × length for a 2-D tensor."""
    if isinstance(batch, Mapping):
        t = batch.get("input_ids")
        if t is None:
            for v in batch.values():
                s = batch_counts(v)
                if s != (0, 0):
                    return s
            return 0, 0
        return batch_counts(t)
    if isinstance(batch, (list, tuple)):
        for v in batch:
            s = batch_counts(v)
            if s != (0, 0):
                return s
        return 0, 0
    shape = getattr(batch, "shape", None)
    if shape is None or len(shape) == 0:
        return 0, 0
    samples = int(shape[0])
    tokens = samples * int(shape[1]) if len(shape) >= 2 else 0
    return samples, tokens


def loader_batch_size(loader: Any) -> Optional[int]:
    """A DataLoader's batch size (its own, else its batch sampler's)."""
    bs = getattr(loader, "batch_size", None)
    if bs is None:
        bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return int(bs) if isinstance(bs, int) and bs > 0 else None
