#!/usr/bin/env bash
# CI lane that simulates the GPU machine's image on the CPU: a fresh venv from the package index
# with the image's triton, transformers and a numpy >= 2.4 (torch from constraints.txt: the CPU
# wheel), memfine NOT installed; then, offline (PIP_NO_INDEX=1), the hf and Triton test
# directories and `scripts/gpu_check.sh --dry-run` with no other flag, checking that it returns
# at most 4 files with every part `ok` or `skipped: <reason>`.
#
#   scripts/ci_image_lane.sh [VENV_DIR]     (default: a new temporary directory, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
VENV="${1:-$TMP/venv}"
# The image: python 3.12, torch 2.11+cu130, triton 3.6.0, transformers 5.17.0, peft, accelerate,
# pytest, numpy, matplotlib, tensorboard (no torchtitan, no hatchling, no network).
IMAGE=(triton==3.6.0 transformers==5.17.0 "numpy>=2.4" peft accelerate pytest matplotlib)
start=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -c constraints.txt torch "${IMAGE[@]}"
fi
echo "image lane: venv ready in $((SECONDS - start)) s"
"$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('memfine') is not None)" \
  || { echo "image lane: memfine must not be installed in $VENV" >&2; exit 1; }
export PIP_NO_INDEX=1 PIP_FIND_LINKS= PATH="$VENV/bin:$PATH"
PYTHONPATH="$ROOT/src" python -m pytest -q -p no:cacheprovider tests/hf tests/triton_kernels
echo "image lane: tests in $((SECONDS - start)) s"
OUT="$TMP/out"
scripts/gpu_check.sh --dry-run --out "$OUT"  # its exit status: 1 when a part failed
python - "$OUT" <<'PY'
import csv, sys
from pathlib import Path
out = Path(sys.argv[1])
files = sorted(p.name for p in out.rglob("*"))
assert len(files) <= 4, f"gpu_check wrote {len(files)} files: {files}"
with (out / "gpu_check.csv").open(newline="") as f:
    parts = [r for r in csv.DictReader(f) if r["metric"] == "wall_time"]
bad = [(r["part"], r["status"]) for r in parts
       if r["status"] != "ok" and not r["status"].startswith("skipped: ")]
assert len(parts) == 6 and not bad, f"parts not ok: {bad or parts}"
print(f"image lane: {len(files)} files {files}; parts {[r['part'] for r in parts]} ok or skipped")
PY
echo "image lane: done in $((SECONDS - start)) s"
