#!/usr/bin/env bash
# Ctrl-C on the test suite: start pytest on test files whose tests train in-process
# (tests/train/test_loop.py, tests/cli/test_train.py by default), wait until a training run
# inside a test has written its first step (a metrics.jsonl under pytest's --basetemp), send
# SIGINT to pytest's process group (what a terminal's Ctrl-C does), and report how many seconds
# pytest took to exit, its exit status (2: interrupted) and whether it printed its summary.
#
# Usage: scripts/ctrl_c_check.sh [--out FILE] [test files...]
# Env: PY (python, default .venv/bin/python). Exit status 1 when pytest did not stop with a
# summary within 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=""
if [ "${1:-}" = "--out" ]; then OUT=$2; shift 2; fi
FILES=("$@")
# tests/dispatch/test_index.py: collected (not reached) so that, as in `make test`, hypothesis is
# imported before the interrupt (otherwise its end-of-session summary imports it then)
[ ${#FILES[@]} -gt 0 ] || FILES=(tests/train/test_loop.py tests/cli/test_train.py
                                 tests/dispatch/test_index.py)
TMP=$(mktemp -d); [ -z "${KEEP:-}" ] || echo "work dir: $TMP"
trap '[ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT
LOG="$TMP/pytest.log"
# job control: pytest runs in its own process group with SIGINT at its default (a script's
# background jobs otherwise start with SIGINT ignored)
set -m
PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 "$PY" -m pytest \
  -p no:cacheprovider -p no:warnings --basetemp "$TMP/base" "${FILES[@]}" > "$LOG" 2>&1 &
PID=$!
set +m
until [ -n "$(find "$TMP/base" -name metrics.jsonl -size +0 2>/dev/null | head -1)" ]; do
  kill -0 "$PID" 2>/dev/null || { echo "pytest ended before a run started"; cat "$LOG"; exit 1; }
  sleep 0.1
done
RUNNING=$(find "$TMP/base" -name metrics.jsonl -size +0 | head -1)
START=$(date +%s.%N)
kill -INT -- "-$PID"
SUMMARY_AT=""
while kill -0 "$PID" 2>/dev/null; do
  if [ -z "$SUMMARY_AT" ] && grep -qE " in [0-9.]+s" "$LOG"; then
    SUMMARY_AT=$(echo "$(date +%s.%N) - $START" | bc)
  fi
  sleep 0.05
done
set +e
wait "$PID"
STATUS=$?
set -e
SECONDS_TAKEN=$(echo "$(date +%s.%N) - $START" | bc)
SUMMARY_AT=${SUMMARY_AT:-$SECONDS_TAKEN}
SUMMARY=$(grep -E " in [0-9.]+s( \(.*\))?$" "$LOG" | tail -1 || true)
{
  echo "command: scripts/ctrl_c_check.sh ${FILES[*]}"
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ); load average: $(cut -d' ' -f1-3 /proc/loadavg); CPUs: $(nproc)"
  echo "SIGINT to pytest's process group while a test's training run was writing ${RUNNING#"$TMP/base/"}"
  echo "pytest printed its summary $(printf '%.1f' "$SUMMARY_AT") s after SIGINT and exited after $(printf '%.1f' "$SECONDS_TAKEN") s (the rest: the interpreter's exit) with status $STATUS (2 = interrupted)"
  echo "KeyboardInterrupt reported: $(grep -q KeyboardInterrupt "$LOG" && echo yes || echo no)"
  echo "summary line: ${SUMMARY:-none}"
} | tee "$TMP/result.txt"
[ -z "$OUT" ] || cp "$TMP/result.txt" "$OUT"
[ "$STATUS" = 2 ] && [ -n "$SUMMARY" ] && [ "$(echo "$SECONDS_TAKEN < 10" | bc)" = 1 ]
