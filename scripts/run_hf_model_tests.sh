#!/usr/bin/env bash
# Run transformers' own common model tests on every MoE architecture with an experts module that
# has a text causal LM (six hand-written tiny configs, the others shrunk generically; see
# scripts/hf_model_tests/test_memfine_moe_models.py) twice: with transformers' reference experts
# loop ("eager") as the default experts implementation, then with "memfine"; print the tests
# whose outcome differs. Each run also compares memfine with eager inside the test (generation
# with a cache on a left-padded batch; the load-balancing loss of a padded batch). (transformers' own CPU default, "grouped_mm", cannot run these tiny models:
# their expert intermediate size n = 30 breaks torch._grouped_mm's 16-byte stride rule.)
#
# transformers' per-model test files (tests/models/<arch>/test_modeling_<arch>.py) and
# tests/causal_lm_tester.py are not shipped in its sdist or wheel. The sdist does ship the common
# mixins (tests/test_modeling_common.py: ModelTesterMixin; tests/test_training_mixin.py:
# TrainingTesterMixin), which hold the bulk of every model's CPU tests. This script downloads the
# sdist of the installed version (pip, no other network access), stubs the two helper mixins the
# sdist lacks (generation and export tests: those tests are left out), adds
# scripts/hf_model_tests/test_memfine_moe_models.py (one tiny config per architecture) and runs.
#
# Usage: scripts/run_hf_model_tests.sh [extra pytest args, e.g. -k qwen3]
# Env: PY (python, default .venv/bin/python), HF_TESTS_DIR (work dir, default
#      $TMPDIR/memfine_hf_model_tests/<version>), RUN_TRAINING_TESTS (default 1).
# Needs: transformers (memfine[hf]), pytest, parameterized (pip install parameterized).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
VER=$("$PY" -c "import transformers; print(transformers.__version__)")
WORK=${HF_TESTS_DIR:-${TMPDIR:-/tmp}/memfine_hf_model_tests/$VER}
mkdir -p "$WORK"
if [ ! -f "$WORK/tests/test_modeling_common.py" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "transformers==$VER" -d "$WORK/sdist"
  tar -xzf "$WORK/sdist/transformers-$VER.tar.gz" -C "$WORK" --strip-components=1 \
    "transformers-$VER/tests"
fi
T="$WORK/tests"
mkdir -p "$T/exporters" "$T/generation" "$T/models/memfine_moe"
touch "$T/__init__.py" "$T/exporters/__init__.py" "$T/generation/__init__.py" \
  "$T/models/__init__.py" "$T/models/memfine_moe/__init__.py"
[ -f "$T/exporters/test_export.py" ] || printf 'class ExportTesterMixin:\n    pass\n' \
  > "$T/exporters/test_export.py"
[ -f "$T/generation/test_utils.py" ] || printf 'class GenerationTesterMixin:\n    pass\n' \
  > "$T/generation/test_utils.py"
cp scripts/hf_model_tests/test_memfine_moe_models.py "$T/models/memfine_moe/"
cp scripts/hf_model_tests/conftest.py "$WORK/conftest.py"
export RUN_TRAINING_TESTS=${RUN_TRAINING_TESTS:-1}
status=0
for impl in eager memfine; do
  echo "== experts implementation: $impl"
  (cd "$WORK" && MEMFINE_HF_EXPERTS=$impl "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
    --rootdir "$WORK" -W ignore::DeprecationWarning "tests/models/memfine_moe" \
    --junitxml "$WORK/$impl.xml" "$@" | tail -n 3) || status=1
done
(cd "$WORK" && "$PY" -c "
from tests.models.memfine_moe import test_memfine_moe_models as m
print(len(m.ARCHS), 'architectures run:', ', '.join(sorted(m.ARCHS)))
for arch, why in sorted(m.SKIPPED.items()):
    print('not run:', arch + ':', why)")
"$PY" scripts/hf_model_tests/compare.py "$WORK/eager.xml" "$WORK/memfine.xml"
exit $status
