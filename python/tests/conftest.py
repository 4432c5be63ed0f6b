"""Shared fixtures: every test gets its own history store and no GPUFIT_*
setting from the caller's environment."""

import os
import shutil
from pathlib import Path

import pytest

A100 = "NVIDIA A100-SXM4-80GB"
MODEL = "llama3_1/8B_lora_single_device"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith("GPUFIT_") and k != "GPUFIT_BIN":
            monkeypatch.delenv(k)
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("GPUFIT_HISTORY", f"sqlite:{tmp_path / 'history.db'}")
    # Nothing may land in the per-user store.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "home" / "data"))
    yield


@pytest.fixture
def gpufit_bin():
    """The `gpufit` binary the same tree built (GPUFIT_BIN, else target/debug/gpufit)."""
    p = os.environ.get("GPUFIT_BIN") or str(REPO / "target" / "debug" / "gpufit")
    if not (os.path.isfile(p) and os.access(p, os.X_OK)):
        found = shutil.which("gpufit")
        if not found:
            pytest.fail(f"the gpufit binary is needed to compare with the CLI: build it (cargo build) or set GPUFIT_BIN ({p} missing)")
        p = found
    return p
