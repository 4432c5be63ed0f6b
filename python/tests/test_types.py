"""The installed package type-checks strictly against its own stubs
(`_native.pyi`, `py.typed`): what a user's mypy sees."""

import subprocess
import sys

import pytest


def test_the_package_passes_mypy_strict(tmp_path):
    pytest.importorskip("mypy")
    p = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "gpufit", "--strict", "--ignore-missing-imports",
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
