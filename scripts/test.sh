#!/usr/bin/env bash
# The whole test suite: installs the real servers the integration tests start
# on loopback (Slurm + munge, Prometheus, PostgreSQL) when missing, then runs
# every test. Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
command -v prometheus >/dev/null || need+=(prometheus)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
# Headless Chromium renders `gpufit report --html` in tests/report.rs.
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}"
  # Debian starts the packaged daemons; the tests start their own on loopback.
  for s in prometheus postgresql slurmctld slurmd munge; do
    (systemctl stop "$s" || service "$s" stop) >/dev/null 2>&1 || true
  done
fi

# Helm rendering/validation runs in a Python virtual environment under .build/.
if [ -f scripts/helm_venv.sh ]; then
  bash scripts/helm_venv.sh
fi

cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# Benchmarks are built (clippy --all-targets) but not run here: `cargo bench --bench NAME`.
# Except the accuracy table: it fails when the advisor's stated margins
# (crates/gpufit-core/src/advisor/margin.rs) no longer cover the measured under-prediction,
# or when a memory-model target it met is missed.
cargo test --bench accuracy --quiet > /dev/null
# And the per-block terms against autograd's counted saved tensors.
cargo test --bench saved_tensors --quiet > /dev/null
# The caching-allocator model behind scripts/alloc_sim.py (stdlib only).
python3 scripts/test_alloc_sim.py
# The measuring script's grid files (stdlib only).
python3 scripts/test_gpu_measure.py
cargo test --workspace --lib --bins --tests -- --test-threads 2
# The GPU loop's suggest -> record wiring, with the binary the tests built
# (in cargo's target directory, wherever CARGO_TARGET_DIR puts it).
python3 scripts/test_gpu_loop.py "${CARGO_TARGET_DIR:-target}/debug/gpufit"
# The Python package: its wheel built and installed in .build/py-venv, its
# tests (pytest) against the installed package and the binary above.
bash scripts/python_test.sh "${CARGO_TARGET_DIR:-target}/debug/gpufit"
