#!/bin/sh
# gpufit Prolog (slurm.conf: Prolog=/etc/slurm/gpufit/prolog.sh, with
# PrologFlags=Alloc so it runs when the job is allocated).
#
# Runs as root on each allocated node: writes the GPU → job mapping files
# the sidecar reads (mapping_dir in the site config; one file per GPU index
# holding the job id) and creates the state dir. ALWAYS exits 0: a failing
# Prolog drains the node.
# slurmd runs Prolog/Epilog with no PATH.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
GPUFIT_BIN="${GPUFIT_BIN:-/usr/local/bin/gpufit}"
if [ ! -x "$GPUFIT_BIN" ]; then
  echo "gpufit prolog: $GPUFIT_BIN is not executable" >&2
  exit 0
fi
"$GPUFIT_BIN" slurm prolog || true
exit 0
