#!/usr/bin/env bash
# Creates .build/helm-venv with the two Python packages the Helm chart checks
# need, when missing. No helm binary is needed:
#   - helm-python-sdk bundles Helm's own Go library (render + lint),
#   - kubernetes-validate validates the rendered manifests offline (strict).
# Idempotent: a venv that already imports both packages is left alone.
# Usage: bash scripts/helm_venv.sh   (then: .build/helm-venv/bin/python scripts/helm_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.build/helm-venv
py="$venv/bin/python"

if [ -x "$py" ] && "$py" -c 'import helm_python, kubernetes_validate' >/dev/null 2>&1; then
  echo "helm venv ready: $venv"
  exit 0
fi

command -v python3 >/dev/null || {
  echo "python3 is missing: install it (Debian: apt-get install -y python3 python3-venv)" >&2
  exit 1
}
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  echo "python3 venv/ensurepip module is missing: apt-get install -y python3-venv" >&2
  exit 1
fi

mkdir -p .build
rm -rf "$venv"
python3 -m venv "$venv"
"$py" -m pip install --quiet --upgrade pip
# Versions pinned to those the checks were written against (TESTBED.md).
"$py" -m pip install --quiet 'helm-python-sdk>=0.2,<0.3' 'kubernetes-validate>=1.30'
"$py" -c 'import helm_python, kubernetes_validate' || {
  echo "the helm venv was created but its packages do not import" >&2
  exit 1
}
echo "helm venv ready: $venv"
