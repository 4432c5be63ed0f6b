"""gpufit: engineering settings for GPU training jobs that fill the GPU
without running out of memory, learnt from every finished run.

The helper's API on gpufit's Rust core (the same memory model, advisor,
learner, log parsers and history stores as the ``gpufit`` command line)::

    import gpufit
    helper = gpufit.GPUEfficiencyHelper(run_log_dir="logs/", gpu_type="NVIDIA A100-SXM4-80GB")
    config = helper.suggest_config("llama3_1/8B_lora_single_device", 2048)

Integrations that confirm what a job runs and measure it:
:mod:`gpufit.integrations.hf`, :mod:`gpufit.integrations.lightning` and
:func:`gpufit.track`. See docs/python.md.
"""

from . import record
from ._api import (
    STRATEGIES,
    SUGGESTED_FIELDS,
    estimate,
    find_max_batch_size,
    log_run_result,
    parse_torchtune_log,
    suggest_config,
)
from ._helper import GPUEfficiencyHelper
from ._native import GpufitError, __version__
from ._track import Tracker, track

__all__ = [
    "GPUEfficiencyHelper",
    "GpufitError",
    "STRATEGIES",
    "SUGGESTED_FIELDS",
    "Tracker",
    "__version__",
    "estimate",
    "find_max_batch_size",
    "log_run_result",
    "parse_torchtune_log",
    "record",
    "suggest_config",
    "track",
]
