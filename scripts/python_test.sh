#!/usr/bin/env bash
# The Python package (python/): builds its wheel with maturin in a virtual
# environment under .build/, installs the wheel there (not the source tree)
# and runs python/tests with pytest — the callbacks against the real Hugging
# Face Trainer and Lightning on CPU (torch, transformers, accelerate and
# lightning from PyPI: about 3.5 min and 5.6 GiB on a fresh machine, cached
# in the venv afterwards), the CLI comparisons against the `gpufit` binary.
# Usage: bash scripts/python_test.sh [PATH_TO_GPUFIT_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."

bin="${1:-${CARGO_TARGET_DIR:-target}/debug/gpufit}"
venv=.build/py-venv
py="$venv/bin/python"

command -v python3 >/dev/null || {
  echo "python3 is missing: apt-get install -y python3 python3-venv" >&2
  exit 1
}
if [ ! -x "$py" ]; then
  mkdir -p .build
  python3 -m venv "$venv"
fi
if ! "$py" -c 'import maturin, pytest' >/dev/null 2>&1; then
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q 'maturin>=1.9,<2' pytest
fi
if ! "$py" -c 'import torch, transformers, accelerate, lightning' >/dev/null 2>&1; then
  "$py" -m pip install -q torch transformers accelerate lightning
fi

# The dev profile reuses what `cargo test` compiled; the release wheel is
# `maturin build --release -m python/Cargo.toml` (docs/python.md).
rm -rf .build/wheels
"$venv/bin/maturin" build --quiet --profile dev -m python/Cargo.toml -o .build/wheels
"$py" -m pip install -q --force-reinstall --no-deps .build/wheels/gpufit-*.whl

# From the tests' folder, so `import gpufit` can only find the installed package.
cd python/tests
GPUFIT_BIN="$(cd ../.. && realpath "$bin")" PYTHONDONTWRITEBYTECODE=1 \
  "../../$py" -m pytest -q -p no:cacheprovider
