"""Compare JUnit XML reports of the same tests run with two experts implementations.

Usage:
    python compare.py eager.xml memfine.xml
        outcome counts and every test whose outcome differs (labels: the file names);
    python compare.py --summary SLICES_DIR ARCHITECTURES_JSON [--out FILE]
        one summary over every slice ``SLICES_DIR/<arch>/{eager,memfine}.xml`` written by
        scripts/run_hf_model_tests.sh: per architecture and in total the tests run, passed,
        failed, errored and skipped per implementation, the tests whose outcome differs, the
        failures both implementations share (by test name), the architectures not run and why,
        the transformers/torch versions and the date; with ``checks.xml`` beside SLICES_DIR
        (``run_hf_model_tests.sh --checks``), the outcome of memfine's in-test comparisons.
Exit status 1 when any outcome differs (or, for --summary, when an architecture has no slice or a
memfine-vs-eager check failed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

IMPLS = ("eager", "memfine")
OUTCOMES = ("passed", "failed", "error", "skipped")


def outcomes(path: str | Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of the message) from a JUnit XML file."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").splitlines()[0][:160] if node.get(
                    "message") else ""
                break
        result[test_id] = (outcome, message)
    return result


def seconds(path: str | Path, name: str | None = None) -> float:
    """Summed test time in a JUnit XML file (of the tests called ``name`` only, if given), s."""
    return sum(float(case.get("time") or 0) for case in ET.parse(path).getroot().iter("testcase")
               if name is None or case.get("name") == name)


def differing(base: dict[str, tuple[str, str]], other: dict[str, tuple[str, str]]) -> list[str]:
    """Test ids whose outcome differs (a test missing from one side counts as ``absent``)."""
    return sorted(t for t in base.keys() | other.keys()
                  if base.get(t, ("absent", ""))[0] != other.get(t, ("absent", ""))[0])


def counts_text(res: dict[str, tuple[str, str]]) -> str:
    """``N run: a passed, b failed, c error, d skipped``."""
    counts = Counter(outcome for outcome, _ in res.values())
    return f"{len(res)} run: " + ", ".join(f"{counts[k]} {k}" for k in OUTCOMES)


def compare(base_path: str, other_path: str) -> int:
    """Print the counts per outcome and the tests whose outcome differs; 1 if any differs."""
    base, other = outcomes(base_path), outcomes(other_path)
    base_name, other_name = (Path(p).stem for p in (base_path, other_path))
    for name, res in ((base_name, base), (other_name, other)):
        print(f"{name:>8}: {counts_text(res)}")
    differ = differing(base, other)
    for test_id in differ:
        b, o = base.get(test_id, ("absent", "")), other.get(test_id, ("absent", ""))
        print(f"DIFF {test_id}: {base_name} {b[0]} -> {other_name} {o[0]} {o[1]}")
    print(f"{len(differ)} tests differ")
    return int(bool(differ))


def checks_lines(path: Path) -> tuple[list[str], bool]:
    """The summary's part for ``--checks`` (memfine's in-test comparisons with eager), and
    whether a check failed or errored."""
    if not path.is_file():
        return ["", "memfine-vs-eager checks (--checks): not run"], False
    res = outcomes(path)
    lines = ["", "memfine-vs-eager checks (--checks: greedy generation with a cache on a "
             "left-padded batch; loss and load-balancing loss of a padded batch with "
             f"output_router_logits=True), {len(res) // 2} architectures: {counts_text(res)}"]
    lines += [f"  {outcome} {test_id.rsplit('.', 1)[-1]}: {message}"
              for test_id, (outcome, message) in sorted(res.items()) if outcome != "passed"]
    return lines, any(outcome in ("failed", "error") for outcome, _ in res.values())


def summary_lines(slices: Path, listing: dict) -> tuple[list[str], int]:
    """The summary's lines and its exit status (1: a difference or a missing slice)."""
    import torch
    import transformers

    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}, Python "
             f"{platform.python_version()}, {datetime.date.today().isoformat()}",
             "command: scripts/run_hf_model_tests.sh (one slice per architecture, both "
             "implementations; eager = transformers' reference loop, memfine = memfine's experts)",
             "", f"{'architecture':<18} {'impl':<8} outcomes"]
    totals = {impl: {} for impl in IMPLS}
    differ, missing, extra_args = [], [], []
    for arch in listing["run"]:
        if not (slices / arch / "memfine.xml").is_file():
            missing.append(arch)
            continue
        res = {impl: outcomes(slices / arch / f"{impl}.xml") for impl in IMPLS}
        settings = (slices / arch / "settings.txt").read_text().strip()
        if settings != "RUN_TRAINING_TESTS=1":
            extra_args.append(f"  {arch}: {settings}")
        for impl in IMPLS:
            totals[impl].update(res[impl])
            name, xml = arch if impl == "eager" else "", slices / arch / f"{impl}.xml"
            lines.append(f"{name:<18} {impl:<8} {counts_text(res[impl])}; {seconds(xml):.0f} s, "
                         f"test_training_overfit {seconds(xml, 'test_training_overfit'):.0f} s")
        differ += [f"DIFF {arch} {t}: eager {res['eager'].get(t, ('absent',))[0]} -> memfine "
                   f"{res['memfine'].get(t, ('absent', ''))[0]} "
                   f"{res['memfine'].get(t, ('', ''))[1]}" for t in differing(*res.values())]
    lines += ["", f"architectures run: {len(listing['run']) - len(missing)} of "
              f"{len(listing['run'])} buildable"]
    lines += [f"{'total ' + impl:<27} {counts_text(totals[impl])}" for impl in IMPLS]
    lines += [f"differences between eager and memfine: {len(differ)}", *differ]
    shared = Counter(t.split("::")[-1] for t, (o, _) in totals["memfine"].items()
                     if o in ("failed", "error") and totals["eager"].get(t, ("",))[0] == o)
    lines += ["", "failed or errored with both implementations (test: architectures):"]
    lines += [f"  {name}: {n}" for name, n in sorted(shared.items())] or ["  none"]
    lines += ["", "slices run with other settings than RUN_TRAINING_TESTS=1 and no pytest "
              "arguments (RUN_TRAINING_TESTS=0 skips test_training_overfit, 300 steps):",
              *(extra_args or ["  none"])]
    lines += ["", "not run yet: " + (", ".join(missing) or "none")]
    checks, checks_failed = checks_lines(slices.parent / "checks.xml")
    lines += checks
    lines += ["", f"not run ({len(listing['not_run'])}; their experts classes are compared with "
              "eager at the experts level by tests/integrations):"]
    lines += [f"  {arch}: {why}" for arch, why in sorted(listing["not_run"].items())]
    return lines, int(bool(differ or missing or checks_failed))


def main(argv: list[str]) -> int:
    """Command line: see the module docstring."""
    if not argv or argv[0] != "--summary":
        return compare(*argv[:2])
    parser = argparse.ArgumentParser()
    parser.add_argument("--summary", dest="slices", type=Path, required=True)
    parser.add_argument("listing", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines, status = summary_lines(args.slices, json.loads(args.listing.read_text()))
    emit(lines, args.out)
    return status


def emit(lines: list[str], out: Path | None) -> None:
    """Print ``lines``; with ``out``, write them there too (and say so)."""
    text = "\n".join(lines) + "\n"
    if out:
        out.write_text(text)
        print(f"wrote {out}")
    print(text, end="")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
