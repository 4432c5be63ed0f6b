#!/bin/sh
# gpufit TaskProlog (slurm.conf: TaskProlog=/etc/slurm/gpufit/task_prolog.sh).
#
# Runs as the job's user before each task. Prints only `export GPUFIT_…=value`
# lines, which Slurm puts into the task's environment. ALWAYS exits 0: a
# TaskProlog that fails makes the job fail, and gpufit being down must never
# do that. Diagnostics go to stderr.
#
# GPUFIT_BIN: the gpufit binary (default /usr/local/bin/gpufit).
# Site settings: /etc/gpufit/slurm.toml, or the file named by GPUFIT_SLURM_CONFIG.
GPUFIT_BIN="${GPUFIT_BIN:-/usr/local/bin/gpufit}"
if [ ! -x "$GPUFIT_BIN" ]; then
  echo "gpufit task-prolog: $GPUFIT_BIN is not executable; job runs without gpufit settings" >&2
  exit 0
fi
# gpufit keeps its own budget (1.5 s by default); `timeout` is the belt to
# those braces in case the binary itself cannot start (a hung file system).
if command -v timeout >/dev/null 2>&1; then
  timeout -k 1 2 "$GPUFIT_BIN" slurm task-prolog || true
else
  "$GPUFIT_BIN" slurm task-prolog || true
fi
exit 0
