#!/bin/sh
# gpufit Epilog (slurm.conf: Epilog=/etc/slurm/gpufit/epilog.sh).
#
# Runs as root on each node after the job: removes the job's GPU mapping
# files, reads the job's peak GPU memory from the sidecar, its exit state
# and a CUDA out-of-memory error from its output file, and records the run
# with the controller (or the local history). ALWAYS exits 0: a failing
# Epilog drains the node.
# slurmd runs Prolog/Epilog with no PATH.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
GPUFIT_BIN="${GPUFIT_BIN:-/usr/local/bin/gpufit}"
if [ ! -x "$GPUFIT_BIN" ]; then
  echo "gpufit epilog: $GPUFIT_BIN is not executable" >&2
  exit 0
fi
if command -v timeout >/dev/null 2>&1; then
  timeout -k 1 15 "$GPUFIT_BIN" slurm epilog || true
else
  "$GPUFIT_BIN" slurm epilog || true
fi
exit 0
