"""The result record a training process writes about itself.

One JSON object (schema version 1, docs/python.md "The result record"):
the settings the job really ran beside those gpufit injected, the exact
per-rank peak from PyTorch's allocator and the measured throughput. The
record is checked by the same Rust parser the recorders use
(``gpufit-core``'s ``result_record``) before it is written, to:

- the container's termination-message file on Kubernetes (default
  ``/dev/termination-log``, written when it exists; at most 4096 bytes);
- the file the Slurm TaskProlog names in ``GPUFIT_RESULT_FILE``;
- optionally a URL of the operator's own (``GPUFIT_RESULT_URL``, with the
  token of ``GPUFIT_TOKEN_FILE``): gpufit's controller has no endpoint that
  takes records yet; its recorders read the two files above.

Only the global rank 0 writes; the other ranks' peaks reach it through
``torch.distributed`` when that is initialised.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from . import _native


def _warn(msg: str, *args: Any) -> None:
    # logging, tempfile and urllib are imported when used: `import gpufit`
    # stays quick in a training script's start-up.
    import logging

    logging.getLogger("gpufit").warning(msg, *args)

SCHEMA_VERSION: int = _native.RESULT_SCHEMA_VERSION
MAX_RECORD_BYTES: int = _native.MAX_RECORD_BYTES
TERMINATION_LOG = "/dev/termination-log"
RESULT_FILE_ENV: str = _native.RESULT_FILE_ENV

_SETTING_KEYS = (
    "micro_batch_size",
    "gradient_accumulation_steps",
    "dtype",
    "activation_checkpointing",
    "activation_offloading",
    "compile",
    "num_workers",
)


def injected_settings() -> Optional[Dict[str, Any]]:
    """The settings gpufit injected (``GPUFIT_MICRO_BATCH_SIZE``, …), or None."""
    s = _native.injected_settings()
    return None if s is None else json.loads(s)


def dtype_name(text: Any) -> Optional[str]:
    """gpufit's spelling of a precision (``"bfloat16"`` → ``"bf16"``,
    Lightning's ``"16-mixed"`` → ``"fp16-mixed"``); None when unknown."""
    if text is None:
        return None
    return _native.dtype_name(str(text).replace("torch.", ""))


def validate(record: Dict[str, Any]) -> Dict[str, Any]:
    """The record as the recorders read it; raises GpufitError when refused."""
    out: Dict[str, Any] = json.loads(_native.validate_result_record(json.dumps(record)))
    return out


def mismatches(record: Dict[str, Any]) -> List[List[str]]:
    """``[field, injected, ran]`` for every setting the job ran otherwise."""
    out: List[List[str]] = json.loads(_native.result_record_mismatches(json.dumps(record)))
    return out


def _int_env(*names: str) -> Optional[int]:
    for n in names:
        v = os.environ.get(n, "").strip()
        if v.isdigit():
            return int(v)
    return None


def rank_and_world() -> "tuple[int, int]":
    """Global rank and world size: torch.distributed, else torchrun's or Slurm's variables."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    rank = _int_env("RANK", "SLURM_PROCID") or 0
    world = _int_env("WORLD_SIZE", "SLURM_NTASKS") or 1
    return rank, max(world, rank + 1)


def _torch() -> Any:
    # Never imported by gpufit itself: a script without torch still records.
    return sys.modules.get("torch")


def _dist() -> Any:
    torch = _torch()
    if torch is None:
        return None
    d = getattr(torch, "distributed", None)
    try:
        if d is not None and d.is_available() and d.is_initialized():
            return d
    except Exception:  # pragma: no cover - a broken backend is no reason to fail training
        return None
    return None


def _cuda() -> Any:
    torch = _torch()
    try:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda
    except Exception:  # pragma: no cover
        return None
    return None


class Meter:
    """Measures one training run: steps, samples, tokens, wall time and the
    allocator's exact peak. Shared by the callbacks and :func:`gpufit.track`."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.steps = 0
        self.samples = 0
        self.tokens = 0
        self.started: Optional[float] = None
        self.elapsed: Optional[float] = None

    def start(self) -> None:
        cuda = _cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()

    def step(self, samples: int = 0, tokens: int = 0) -> None:
        """One optimizer step, with what this rank trained on."""
        self.steps += 1
        self.add(samples, tokens)

    def add(self, samples: int = 0, tokens: int = 0) -> None:
        """Samples and tokens of a micro batch (steps counted elsewhere)."""
        self.samples += int(samples)
        self.tokens += int(tokens)

    def stop(self) -> None:
        if self.started is not None and self.elapsed is None:
            self.elapsed = time.perf_counter() - self.started

    def _peaks(self, rank: int) -> List[Dict[str, int]]:
        cuda = _cuda()
        if cuda is None:
            return []
        mine = {
            "rank": rank,
            "allocated_bytes": int(cuda.max_memory_allocated()),
            "reserved_bytes": int(cuda.max_memory_reserved()),
        }
        dist = _dist()
        if dist is None:
            return [mine]
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return sorted((p for p in everyone if p), key=lambda p: p["rank"])

    def _totals(self, world: int) -> "tuple[float, float]":
        dist = _dist()
        if dist is None:
            # Data-parallel ranks run the same step: each rank's rate × world.
            return float(self.tokens * world), float(self.samples * world)
        counts: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(counts, (self.tokens, self.samples))
        return float(sum(c[0] for c in counts)), float(sum(c[1] for c in counts))

    def record(self, ran: Dict[str, Any], outcome: str = "completed") -> Dict[str, Any]:
        """The record (a dict of the schema); collective when distributed."""
        self.stop()
        rank, world = rank_and_world()
        tokens, samples = self._totals(world)
        secs = self.elapsed or 0.0
        rec: Dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "source": self.source,
            "world_size": world,
            "ran": {k: v for k, v in ran.items() if k in _SETTING_KEYS and v is not None},
            "peaks": self._peaks(rank),
            "steps": self.steps,
            "outcome": outcome,
        }
        injected = injected_settings()
        if injected is not None:
            rec["injected"] = injected
        if secs > 0:
            rec["duration_sec"] = secs
            if tokens > 0:
                rec["tokens_per_sec"] = tokens / secs
            if samples > 0:
                rec["samples_per_sec"] = samples / secs
        cuda = _cuda()
        if cuda is not None:
            rec["device"] = str(cuda.get_device_name())[:200]
        job = os.environ.get("GPUFIT_JOB_ID", "").strip()
        if job:
            rec["job_id"] = job[:200]
        try:
            # As the recorders will read it (numbers as they parse them).
            return validate(rec)
        except _native.GpufitError:
            return rec  # write() says why, or keeps what fits


def write(
    record: Dict[str, Any],
    *,
    termination_log: Optional[str] = None,
    result_file: Optional[str] = None,
    controller_url: Optional[str] = None,
    token: Optional[str] = None,
) -> List[str]:
    """Writes the record where gpufit looks; returns the destinations written.

    Rank 0 writes; other ranks return ``[]``. A destination that fails is
    logged (a record is never worth failing the training for).

    Args:
        termination_log: the termination-message file (default:
            ``GPUFIT_TERMINATION_LOG``, else ``/dev/termination-log`` when it exists).
        result_file: default ``GPUFIT_RESULT_FILE`` (the Slurm TaskProlog exports it).
        controller_url: default ``GPUFIT_RESULT_URL``: the record is POSTed
            there with ``Authorization: Bearer`` and the token (``token``,
            else the file ``GPUFIT_TOKEN_FILE`` names).
    """
    rank, _ = rank_and_world()
    if rank != 0:
        return []
    text = _fit(record)
    written: List[str] = []
    term = termination_log or os.environ.get("GPUFIT_TERMINATION_LOG") or None
    if term is None and os.path.exists(TERMINATION_LOG):
        term = TERMINATION_LOG
    for path in [term, result_file or os.environ.get(RESULT_FILE_ENV) or None]:
        if not path:
            continue
        try:
            _write_file(path, text)
            written.append(path)
        except OSError as e:
            _warn("gpufit: cannot write the result record to %s: %s", path, e)
    url = controller_url or os.environ.get("GPUFIT_RESULT_URL") or None
    if url:
        try:
            _post(url, text, token)
            written.append(url)
        except Exception as e:  # noqa: BLE001 - any failure is logged, never raised
            _warn("gpufit: cannot send the result record to %s: %s", url, e)
    return written


def _fit(record: Dict[str, Any]) -> str:
    """The validated text, within the termination message's 4096 bytes: with
    many ranks, only the rank with the largest reserved peak is kept."""
    try:
        return _native.validate_result_record(json.dumps(record))
    except _native.GpufitError:
        peaks = record.get("peaks") or []
        if len(peaks) <= 1:
            raise
        top = max(peaks, key=lambda p: p["reserved_bytes"])
        return _native.validate_result_record(json.dumps({**record, "peaks": [top]}))


def _write_file(path: str, text: str) -> None:
    if path.startswith("/dev/"):
        # A device file (the kubelet's bind mount) is written in place.
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    import tempfile

    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gpufit-result-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # the reader never sees half a record
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _post(url: str, text: str, token: Optional[str]) -> None:
    import urllib.request

    if token is None:
        tf = os.environ.get("GPUFIT_TOKEN_FILE")
        if tf:
            with open(tf, encoding="utf-8") as f:
                token = f.read().strip()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=text.encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - the operator's URL
        r.read()
