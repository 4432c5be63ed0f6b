"""docs/python.md's Python blocks run as written (in an empty directory with
the installed package); blocks fenced `python fragment` need the user's
model and are not run."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

DOC = REPO / "docs" / "python.md"


def blocks():
    text = DOC.read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_doc_has_the_three_patterns_and_track():
    b = blocks()
    assert len(b) == 4, "bootstrap, learning loop, explicit API, track"
    assert any("log_run_result" in x and "parse_torchtune_log" in x for x in b)


@pytest.mark.parametrize("i", range(4))
def test_python_blocks_of_the_doc_run_as_written(i, tmp_path):
    code = blocks()[i]
    (tmp_path / "logs").mkdir()
    # Pattern 2's training output: a torchtune run that used 21.4 GB.
    (tmp_path / "logs" / "exp_042.log").write_text(
        "INFO:torchtune.training:Starting training...\n"
        "INFO:torchtune.training:GPU Memory: Used 21.4GB / 80.0GB\n"
        "INFO:torchtune.training:Throughput: 12.5 samples/sec\n"
        "INFO:torchtune.training:Training completed in 3600.0 seconds\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFIT_")}
    env["HOME"] = str(tmp_path / "home")
    env["XDG_DATA_HOME"] = str(tmp_path / "home" / "data")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    if "log_run_result" in code:
        # The run reached both the file and the per-user store the CLI reads.
        assert (tmp_path / "logs" / "run_logs.jsonl").exists()
        assert (tmp_path / "home" / "data" / "gpufit" / "history.db").exists()
        assert p.stdout.split()[0] != "heuristic", p.stdout
