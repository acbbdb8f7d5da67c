#!/usr/bin/env bash
# Run transformers' own common model tests on every MoE architecture with an experts module that
# has a text causal LM (six hand-written tiny configs, the others shrunk generically; see
# scripts/hf_model_tests/test_memfine_moe_models.py) twice: with transformers' reference experts
# loop ("eager") as the default experts implementation, then with "memfine"; compare the outcomes
# test by test. Each run also compares memfine with eager inside the test (generation with a
# cache on a left-padded batch; the load-balancing loss of a padded batch). (transformers' own
# CPU default, "grouped_mm", cannot run these tiny models: their expert intermediate size n = 30
# breaks torch._grouped_mm's 16-byte stride rule.)
#
# transformers' per-model test files (tests/models/<arch>/test_modeling_<arch>.py) and
# tests/causal_lm_tester.py are not shipped in its sdist or wheel. The sdist does ship the common
# mixins (tests/test_modeling_common.py: ModelTesterMixin; tests/test_training_mixin.py:
# TrainingTesterMixin), which hold the bulk of every model's CPU tests. This script downloads the
# sdist of the installed version (pip, no other network access), stubs the two helper mixins the
# sdist lacks (generation and export tests: those tests are left out), adds
# scripts/hf_model_tests/test_memfine_moe_models.py (one tiny config per architecture) and runs.
#
# The run is sliced by architecture: each architecture is one slice, run with both
# implementations, its JUnit reports kept in $WORK/slices/<arch>/; a slice already there is not
# run again (FORCE=1 reruns it), so an interrupted run continues where it stopped. --summary
# collects every slice into one report.
#
# Usage:
#   scripts/run_hf_model_tests.sh                   # every architecture, slice by slice
#   scripts/run_hf_model_tests.sh --arch olmoe,gpt_oss [extra pytest args, e.g. -x]
#   scripts/run_hf_model_tests.sh --checks          # only memfine's in-test checks against
#                                                   # eager (generation, padded aux loss), every
#                                                   # architecture in one process (minutes)
#   scripts/run_hf_model_tests.sh --list            # architectures run / not run (with why)
#   scripts/run_hf_model_tests.sh --summary [FILE]  # all slices -> one summary (stdout or FILE)
# Env: PY (python, default .venv/bin/python), HF_TESTS_DIR (work dir, default
#      $TMPDIR/memfine_hf_model_tests/<version>), RUN_TRAINING_TESTS (default 1), FORCE (0).
# Needs: transformers (memfine[hf]), pytest, parameterized (pip install parameterized).
# On a shared machine: nice -n 10 scripts/run_hf_model_tests.sh --arch ... (in the background).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/upstream_tests.sh  # ROOT, PY, upstream_help, upstream_setup, upstream_sdist_tests
case "${1:-}" in
  -h|--help) upstream_help "$0"; exit 0 ;;
esac
upstream_setup run_hf_model_tests transformers "${HF_TESTS_DIR:-}" hf_model_tests
mkdir -p "$WORK/slices"
[ -f "$WORK/tests/test_modeling_common.py" ] || upstream_sdist_tests transformers
T="$WORK/tests"
mkdir -p "$T/exporters" "$T/generation" "$T/models/memfine_moe"
touch "$T/__init__.py" "$T/exporters/__init__.py" "$T/generation/__init__.py" \
  "$T/models/__init__.py" "$T/models/memfine_moe/__init__.py"
[ -f "$T/exporters/test_export.py" ] || printf 'class ExportTesterMixin:\n    pass\n' \
  > "$T/exporters/test_export.py"
[ -f "$T/generation/test_utils.py" ] || printf 'class GenerationTesterMixin:\n    pass\n' \
  > "$T/generation/test_utils.py"
cp scripts/hf_model_tests/test_memfine_moe_models.py tests/integrations/hf_models.py \
  "$T/models/memfine_moe/"
cp scripts/hf_model_tests/conftest.py "$WORK/conftest.py"
export RUN_TRAINING_TESTS=${RUN_TRAINING_TESTS:-1}
LISTING="$WORK/architectures.json"

list_architectures() {  # probes every architecture once (a minute or more); cached per work dir
  [ -f "$LISTING" ] || (cd "$WORK" && "$PY" -c "
import json
from tests.models.memfine_moe import test_memfine_moe_models as m
print(json.dumps({'run': sorted(m.ARCHS), 'not_run': m.SKIPPED}, indent=1))" > "$LISTING.tmp" \
    && mv "$LISTING.tmp" "$LISTING")
}

run_slice() {  # run_slice ARCH [pytest args]: both implementations, JUnit XML per implementation
  local arch=$1 dir="$WORK/slices/$1" impl status=0
  shift
  if [ -f "$dir/memfine.xml" ] && [ "${FORCE:-0}" != 1 ]; then
    echo "== $arch: done before ($dir; FORCE=1 reruns)"
    return 0
  fi
  rm -rf "$dir" && mkdir -p "$dir.partial"
  printf 'RUN_TRAINING_TESTS=%s %s\n' "$RUN_TRAINING_TESTS" "$*" > "$dir.partial/settings.txt"
  for impl in eager memfine; do
    echo "== $arch: experts implementation $impl"
    (cd "$WORK" && MEMFINE_HF_ARCHS=$arch MEMFINE_HF_EXPERTS=$impl "$PY" -m pytest -q \
      -p no:cacheprovider -o addopts="" --rootdir "$WORK" -W ignore::DeprecationWarning \
      "tests/models/memfine_moe" --junitxml "$dir.partial/$impl.xml" "$@" | tail -n 2) || status=1
  done
  mv "$dir.partial" "$dir"
  "$PY" scripts/hf_model_tests/compare.py "$dir/eager.xml" "$dir/memfine.xml" || status=1
  return $status
}

case "${1:-}" in
  --list)
    list_architectures && cat "$LISTING"; exit 0 ;;
  --checks)
    shift
    (cd "$WORK" && MEMFINE_HF_EXPERTS=memfine "$PY" -m pytest -q -p no:cacheprovider \
      -o addopts="" --rootdir "$WORK" -W ignore::DeprecationWarning "tests/models/memfine_moe" \
      -k "memfine_generate or memfine_padded" --junitxml "$WORK/checks.xml.partial" "$@" \
      | tail -n 3) && status=0 || status=1
    mv "$WORK/checks.xml.partial" "$WORK/checks.xml"
    exit $status ;;
  --summary)
    list_architectures
    "$PY" scripts/hf_model_tests/compare.py --summary "$WORK/slices" "$LISTING" ${2:+--out "$2"}
    exit ;;
  --arch)
    ARCH_LIST=$2; shift 2 ;;
  *)
    list_architectures
    ARCH_LIST=$("$PY" -c "import json,sys; print(','.join(json.load(open(sys.argv[1]))['run']))" \
      "$LISTING") ;;
esac
status=0
for arch in ${ARCH_LIST//,/ }; do
  run_slice "$arch" "$@" || status=1
done
exit $status
