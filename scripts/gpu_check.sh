#!/usr/bin/env bash
# memfine on one CUDA GPU within one budget (default 360 s); at most four result files.
#
#   scripts/gpu_check.sh [--dry-run] [--out DIR] [--budget SECONDS]
#
# Runs scripts/gpu_check.py with $PYTHON, else the python3 on PATH (the one with a CUDA torch):
# no install, no network; memfine from this tree when it is not installed. See docs/gpu.md.
export GPU_CHECK_CALLER_DIR="$PWD"
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
