"""A PostgreSQL history shared by the package and the CLI (a throwaway
server on 127.0.0.1; scripts/test.sh installs the Debian server binaries)."""

import glob
import os
import shutil
import socket
import subprocess
import tempfile

import pytest

import gpufit

from conftest import A100, MODEL
from test_cli_parity import cli, same


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres_url():
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not bins:
        pytest.fail("PostgreSQL server binaries not found: apt-get install -y --no-install-recommends postgresql (scripts/test.sh does it)")
    bindir = os.path.dirname(bins[-1])
    root = tempfile.mkdtemp(prefix="gpufit-pg-")
    os.chmod(root, 0o755)
    as_pg = os.geteuid() == 0  # initdb refuses root
    pre = ["runuser", "-u", "postgres", "--"] if as_pg else []
    data = os.path.join(root, "data")
    if as_pg:
        subprocess.run(["chown", "postgres:postgres", root], check=True)
    port = free_port()
    subprocess.run(pre + [f"{bindir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                   check=True, capture_output=True)
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
    subprocess.run(pre + [f"{bindir}/pg_ctl", "-D", data, "-l", os.path.join(root, "log"), "-o", opts, "-w", "-t", "30", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgres://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(pre + [f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_python_and_the_cli_share_a_postgres_history(postgres_url, gpufit_bin):
    helper = gpufit.GPUEfficiencyHelper(gpu_type=A100, history=postgres_url)
    first = helper.suggest_config(MODEL, 2048)
    out = helper.log_run_result(
        {**first}, {"success": True, "peak_memory_gb": 20.0, "samples_per_sec": 3.0, "failure_reason": None, "duration_sec": 60.0}
    )
    assert out["id"] is not None and out["store"].startswith("postgres://")
    flags = ["suggest", "--model", MODEL, "--seq-len", "2048", "--gpu", A100, "--history", postgres_url]
    c = cli(gpufit_bin, *flags)
    assert c["source"] != "heuristic"
    same(helper.suggest_config(MODEL, 2048), c)
    listed = cli(gpufit_bin, "history", "list", "--history", postgres_url)
    assert len(listed if isinstance(listed, list) else listed["runs"]) == 1
