"""Compare two JUnit XML reports of the same tests: outcome counts and every test that differs.

Usage: python compare.py eager.xml memfine.xml (labels are the file names without .xml)
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, tuple[str, str]]:
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


def main(base_path: str, other_path: str) -> int:
    """Print the counts per outcome and the tests whose outcome differs; 1 if any differs."""
    base, other = outcomes(base_path), outcomes(other_path)
    base_name, other_name = (p.rsplit("/", 1)[-1].removesuffix(".xml") for p in (base_path,
                                                                                other_path))
    for name, res in ((base_name, base), (other_name, other)):
        counts = Counter(outcome for outcome, _ in res.values())
        print(f"{name:>8}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    differ = sorted(t for t in base.keys() | other.keys()
                    if base.get(t, ("absent", ""))[0] != other.get(t, ("absent", ""))[0])
    for test_id in differ:
        b, o = base.get(test_id, ("absent", "")), other.get(test_id, ("absent", ""))
        print(f"DIFF {test_id}: {base_name} {b[0]} -> {other_name} {o[0]} {o[1]}")
    print(f"{len(differ)} tests differ")
    return int(bool(differ))


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
