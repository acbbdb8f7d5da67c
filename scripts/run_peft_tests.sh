#!/usr/bin/env bash
# Run PEFT's own tests of LoRA on MoE expert weights (tests/test_target_parameters.py:
# target_parameters on GPT-OSS and Llama4) twice: with transformers as shipped, then with memfine
# forced as the default experts implementation (the plugin of scripts/run_hf_model_tests.sh,
# scripts/hf_model_tests/conftest.py: MEMFINE_HF_EXPERTS=memfine); compare the outcomes test by
# test and write a summary that names each difference and whether it is a documented by-design
# one (scripts/peft_tests/summary.py).
#
# Offline: the tiny models the tests load from the Hub are built locally under their Hub ids into
# a private Hugging Face cache (scripts/peft_tests/build_tiny_models.py; HF_HUB_OFFLINE=1). PEFT's
# test sources are not in its wheel: they come from PEFT's sdist of the installed version (pip
# download, no other network access), or from a PEFT source checkout given as --peft-src. Nothing
# of PEFT's is copied into this repository.
#
# Usage:
#   scripts/run_peft_tests.sh [--peft-src DIR] [--out FILE] [extra pytest args, e.g. -k merge]
#     --out FILE: write the summary there too (benchmarks/results/peft_target_parameters.txt)
# Env: PY (python, default .venv/bin/python), PEFT_TESTS_DIR (work dir, default
#      $TMPDIR/memfine_peft_tests/<version>).
# Needs: peft, transformers (memfine[hf]), pytest; PEFT's test helpers import datasets and
#        diffusers (diffusers is stubbed when absent: only its Stable Diffusion tests use it).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/upstream_tests.sh  # ROOT, PY, upstream_help, upstream_setup, upstream_sdist_tests
PEFT_SRC="" OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) upstream_help "$0"; exit 0 ;;
    --peft-src) PEFT_SRC=$(cd "$2" && pwd); shift 2 ;;
    --out) OUT=$ROOT/$2; [ "${2#/}" != "$2" ] && OUT=$2; shift 2 ;;
    *) break ;;
  esac
done
upstream_setup run_peft_tests peft "${PEFT_TESTS_DIR:-}" peft_tests
mkdir -p "$WORK"
if [ -n "$PEFT_SRC" ]; then
  rm -rf "$WORK/tests" && cp -r "$PEFT_SRC/tests" "$WORK/tests"
elif [ ! -f "$WORK/tests/test_target_parameters.py" ]; then
  upstream_sdist_tests peft
fi
touch "$WORK/tests/__init__.py"
cp scripts/hf_model_tests/conftest.py "$WORK/conftest.py"
STUBS="$WORK/stubs"
if ! "$PY" -c "import diffusers" 2>/dev/null; then
  mkdir -p "$STUBS/diffusers"
  printf 'class StableDiffusionPipeline:  # stub: diffusers is not installed\n    pass\n' \
    > "$STUBS/diffusers/__init__.py"
fi
export HF_HUB_CACHE="$WORK/hub" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PY" scripts/peft_tests/build_tiny_models.py "$HF_HUB_CACHE"
status=0
for impl in default memfine; do
  echo "== PEFT $VER tests/test_target_parameters.py: experts implementation $impl"
  (cd "$WORK" && PYTHONPATH="$ROOT/src:$STUBS${PYTHONPATH:+:$PYTHONPATH}" \
    MEMFINE_HF_EXPERTS=$impl "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
    --rootdir "$WORK" -W ignore::DeprecationWarning tests/test_target_parameters.py \
    --junitxml "$WORK/$impl.xml.partial" "$@" | tail -n 3) || true
  mv "$WORK/$impl.xml.partial" "$WORK/$impl.xml"
done
"$PY" scripts/peft_tests/summary.py "$WORK/default.xml" "$WORK/memfine.xml" ${OUT:+--out "$OUT"} \
  || status=1
exit $status
