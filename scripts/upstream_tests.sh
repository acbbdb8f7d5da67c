# shellcheck shell=bash
# What scripts/run_peft_tests.sh and scripts/run_hf_model_tests.sh share, sourced (not run) from
# the repository root: ROOT, PY (default .venv/bin/python) and the functions below.
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}

upstream_help() {  # upstream_help SCRIPT: print SCRIPT's comment block from "# Usage:" on
  awk '/^# Usage:/{on=1} /^set /{on=0} on' "$1" | sed 's/^# \{0,1\}//'
}

upstream_setup() {  # upstream_setup RUNNER PACKAGE WORK_GIVEN WORK_NAME: set VER and WORK
  # VER: PACKAGE's installed version; WORK: WORK_GIVEN, else $TMPDIR/memfine_WORK_NAME/VER.
  # A PY that is no executable python: one line naming it, exit 2.
  if [ ! -x "$PY" ]; then
    echo "$1: PY=$PY is not an executable python (set PY, or run make install)" >&2
    exit 2
  fi
  VER=$("$PY" -c "import $2; print($2.__version__)")
  WORK=${3:-${TMPDIR:-/tmp}/memfine_$4/$VER}
}

upstream_sdist_tests() {  # upstream_sdist_tests PACKAGE: its sdist's tests/ into $WORK/tests
  "$PY" -m pip download -q --no-deps --no-binary :all: "$1==$VER" -d "$WORK/sdist"
  tar -xzf "$WORK/sdist/$1-$VER.tar.gz" -C "$WORK" --strip-components=1 "$1-$VER/tests"
}
