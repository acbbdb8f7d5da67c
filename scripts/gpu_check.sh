#!/usr/bin/env bash
# memfine on one CUDA GPU in about 10 minutes (the part timeouts sum to 550 s); every result
# under one folder, printed at the start and the end.
#
#   scripts/gpu_check.sh [--skip-install] [--dry-run] [--out DIR]
#
# Parts (timeout): install (120 s: a venv with torch from constraints.txt and the dev, hf and
# torchtitan extras, from the package index: PyPI's Linux torch wheel is the CUDA build), gpu
# tests (110 s: pytest -m gpu), layer benchmark (90 s: bf16 at the Qwen3-30B-A3B layer d 2048,
# n 768, E 128, k 8, T 16384; memfine fused, fused_mact (MACT), memfine_c4 (4 chunks) against
# torchtitan's own GroupedExperts (the `torchtitan` method: same weights, same routing),
# torch._grouped_mm experts in torchtitan's style and HF transformers' grouped_mm experts;
# CUDA-event times, peak and saved bytes), equality (40 s: each method's output and dx against
# fused and an fp32 layer, torchtitan's experts included), peak (60 s: measured against
# predicted CUDA peak per case, DIR/cuda_peak.csv: the measurement the gpu tests' CUDA peak
# tolerance is set from), train (40 s: 50 steps of `memfine train --device cuda`), compile
# (90 s: 20 steps with --compile). Without torchtitan (0.3, Python >= 3.11) its method is
# skipped with a line saying why. Results: DIR/gpu_check.csv (part, name, status, metric,
# value, unit, detail), DIR/cuda_peak.csv, DIR/bench/, DIR/train*/ and one log per part.
# --skip-install uses the python already on PATH (or $PYTHON), e.g. a CUDA torch you installed.
# --dry-run runs every part on the CPU at tiny shapes (CI runs it so the script cannot rot); it
# never installs. DIR (relative to where you run it) defaults to
# gpu_check/ in the clone.
set -uo pipefail
CALLER_DIR="$PWD"
cd "$(dirname "$0")/.."

DRY=0 INSTALL=1 OUT=gpu_check
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 INSTALL=0 ;;
    --skip-install) INSTALL=0 ;;
    --out) OUT="$2"; [ "${OUT#/}" = "$OUT" ] && OUT="$CALLER_DIR/$OUT"; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
CSV="$OUT/gpu_check.csv" PEAK_CSV="$OUT/cuda_peak.csv"
rm -f "$CSV" "$PEAK_CSV"
echo "gpu_check: results in $OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
FAILED=0

# run PART TIMEOUT_S CMD...: the command under `timeout`, its log in $OUT/PART.log, a status row.
run() {
  local part="$1" limit="$2"; shift 2
  local start=$SECONDS rc
  echo "== $part (timeout ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$part.log" 2>&1
  rc=$?
  local status=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status=timeout
  [ $rc -ne 0 ] && [ "$status" = ok ] && status="failed(rc=$rc)"
  [ "$status" != ok ] && FAILED=1 && tail -20 "$OUT/$part.log"
  "$PY" scripts/gpu_check_csv.py "$CSV" part "$part" "$status" "$((SECONDS - start))"
  echo "   $status in $((SECONDS - start)) s"
}

if [ $INSTALL -eq 1 ]; then
  run install 120 bash -c "python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -q -U pip \
    && .venv-gpu/bin/pip install -q -c constraints.txt -e '.[dev,hf,torchtitan]'"
  PY=.venv-gpu/bin/python
fi
"$PY" scripts/gpu_check_csv.py "$CSV" environment  # prints the torchtitan skip line, if any

if [ $DRY -eq 1 ]; then
  DEVICE=cpu SHAPE=(--hidden-size 64 --intermediate-size 32 --num-experts 8 --top-k 2
                    --tokens 256 --quick)
  TINY=(--tiny) PEAK_LIMIT=120  # the CPU's profiler passes, not the GPU's budget
  EQUAL=(--tokens 256 --hidden-size 64 --intermediate-size 32 --num-experts 8 --top-k 2)
  TRAIN=(--preset tiny --data tests/assets/pydoc_topics_sample.txt) STEPS=2 CSTEPS=1
  COMPILE_ENV=(env TORCHDYNAMO_DISABLE=1)  # the flags and files only: inductor on CPU is minutes
  TESTS=(tests/gpu tests/test_devices.py -k "not suite_passes")
else
  DEVICE=cuda SHAPE=(--hidden-size 2048 --intermediate-size 768 --num-experts 128 --top-k 8
                     --tokens 16384 --repeats 5 --warmup 2)
  TINY=() PEAK_LIMIT=60
  EQUAL=()
  TRAIN=(--preset small) STEPS=50 CSTEPS=20
  COMPILE_ENV=(env)
  TESTS=(tests/gpu tests/measure/test_peak.py)
fi

# gpu tests: their own process, TRITON_INTERPRET unset (native kernels; the conftest leaves it)
run gpu_tests 110 env -u TRITON_INTERPRET "$PY" -m pytest -p no:cacheprovider -q -m gpu \
  --junitxml "$OUT/gpu_tests.xml" "${TESTS[@]}"
"$PY" scripts/gpu_check_csv.py "$CSV" junit "$OUT/gpu_tests.xml"

run layer_bench 90 "$PY" -m memfine bench --suites experts hf --device "$DEVICE" \
  --dtype bfloat16 "${SHAPE[@]}" --out "$OUT/bench" --overwrite \
  --methods fused fused_mact grouped_mm torchtitan hf_grouped_mm memfine_c4
"$PY" scripts/gpu_check_csv.py "$CSV" bench "$OUT"/bench/bench_*.csv
run equality 40 "$PY" scripts/gpu_check_equal.py "$CSV" --device "$DEVICE" "${EQUAL[@]}"
run peak "$PEAK_LIMIT" "$PY" scripts/gpu_check_peak.py "$PEAK_CSV" "$CSV" --device "$DEVICE" "${TINY[@]}"

COMMON=(--device "$DEVICE" --no-progress --sample-tokens 0 --overwrite --log-every 1)
run train 40 "$PY" -m memfine train "${TRAIN[@]}" "${COMMON[@]}" --max-steps "$STEPS" \
  --eval-every "$STEPS" --out "$OUT/train"
"$PY" scripts/gpu_check_csv.py "$CSV" train train "$OUT/train"
run compile 90 "${COMPILE_ENV[@]}" "$PY" -m memfine train "${TRAIN[@]}" "${COMMON[@]}" --compile \
  --max-steps "$CSTEPS" --eval-every "$CSTEPS" --out "$OUT/train_compile"
"$PY" scripts/gpu_check_csv.py "$CSV" train compile "$OUT/train_compile"

echo "gpu_check: results in $OUT"
echo "  gpu_check.csv  every part's status and metrics"
echo "  cuda_peak.csv  measured vs predicted peak per case (sets the CUDA peak tolerance)"
echo "  bench/ train/ train_compile/ *.log  the benchmark CSVs, the runs, one log per part"
exit $FAILED
