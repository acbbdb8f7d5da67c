"""Summary of PEFT's ``tests/test_target_parameters.py`` run with and without memfine.

Usage: python summary.py DEFAULT_XML MEMFINE_XML [--out FILE]

Reads the JUnit reports written by ``scripts/run_peft_tests.sh`` (``default``: transformers as
shipped; ``memfine``: memfine forced as the experts implementation), prints the versions, the
outcome counts per run and every test whose outcome differs, each marked ``by design`` (with the
reason and the memfine test that pins the behaviour) or ``NOT EXPECTED``. Exit status 1 when a
difference is not by design.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "hf_model_tests"))
from compare import counts_text, differing, emit, outcomes  # noqa: E402

# test name -> why memfine differs by design, and the memfine test that holds that behaviour
BY_DESIGN = {
    "test_target_parameter_result_caching_works": (
        "counts how often PEFT's _LoraFactorsProxy forms W + s·B·A (2 on the first call: "
        "PEFT's registration check, then the experts' read of the parametrized weight); "
        "memfine's experts never read the parametrized weight (split LoRA on the original "
        "weight), so the first call forms it once (the check) and later calls not at all",
        "tests/integrations/test_lora_peft.py::test_plain_peft_runs_split_lora"),
}


def summary(default_xml: Path, memfine_xml: Path) -> tuple[list[str], int]:
    """The summary's lines and the exit status (1: a difference that is not by design)."""
    import peft
    import torch
    import transformers

    runs = {"default": outcomes(default_xml), "memfine": outcomes(memfine_xml)}
    lines = [f"PEFT {peft.__version__} tests/test_target_parameters.py; transformers "
             f"{transformers.__version__}, torch {torch.__version__}, Python "
             f"{platform.python_version()}, {datetime.date.today().isoformat()}",
             "command: scripts/run_peft_tests.sh --out benchmarks/results/"
             "peft_target_parameters.txt (offline; tiny models built locally under the Hub ids "
             "by scripts/peft_tests/build_tiny_models.py)",
             "default = transformers as shipped (its default experts implementation); memfine = "
             "memfine forced as the experts implementation (scripts/hf_model_tests/conftest.py)",
             ""]
    lines += [f"{name:>8}: {counts_text(res)}" for name, res in runs.items()]
    unexpected = 0
    diff = differing(runs["default"], runs["memfine"])
    lines += ["", f"tests whose outcome differs: {len(diff)}"]
    for test_id in diff:
        before = runs["default"].get(test_id, ("absent", ""))[0]
        after, message = runs["memfine"].get(test_id, ("absent", ""))
        name = test_id.rsplit("::", 1)[-1].split("[", 1)[0]
        lines.append(f"  {test_id}: default {before} -> memfine {after} {message}".rstrip())
        if name in BY_DESIGN and after == "failed":
            why, pinned = BY_DESIGN[name]
            lines += [f"    by design: {why}", f"    memfine's behaviour is tested by {pinned}"]
        else:
            unexpected += 1
            lines.append("    NOT EXPECTED")
    lines += ["", f"differences not by design: {unexpected}"]
    return lines, int(bool(unexpected))


def main(argv: list[str]) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("default_xml", type=Path)
    parser.add_argument("memfine_xml", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines, status = summary(args.default_xml, args.memfine_xml)
    emit(lines, args.out)
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
