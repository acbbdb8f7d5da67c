"""The README is a map: short, every doc linked from it, every link resolving, its headline figures
quoted from docs/results.md, its library example runs and adds every aux loss; every results
section of docs/results.md names files that exist; docs/hf.md's snippets import every name they
use."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
RESULTS_DOC = ROOT / "docs" / "results.md"
MAX_README_LINES = 300
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces → '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_readme_is_a_short_map() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, len(lines)


def test_every_doc_is_linked_from_the_readme() -> None:
    linked = {Path(target.split("#")[0]).name
              for target in LINK.findall(README.read_text(encoding="utf-8"))
              if target.startswith("docs/")}
    docs = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert docs - linked == set()


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.exists(), (doc.name, target)
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), (doc.name, target)


def _results_sections() -> list[str]:
    return RESULTS_DOC.read_text(encoding="utf-8").split("\n## ")[1:]


def test_every_results_section_names_its_command_and_existing_files() -> None:
    sections = [s for s in _results_sections()
                if not s.startswith(("Elsewhere", "DeepSeek-V3-style routing"))]
    assert len(sections) >= 10
    for section in sections:
        title = section.splitlines()[0]
        line = re.search(r"^Command: `[^`]+`\. File: (.*)\.$", section, flags=re.M)
        assert line is not None, title
        files = re.findall(r"`(benchmarks/results/[^`]+)`", line.group(1))
        assert files, title
        for name in files:
            assert (ROOT / name).exists(), (title, name)


def test_readme_headline_figures_are_quoted_from_the_results_doc() -> None:
    text = README.read_text(encoding="utf-8")
    headline = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    results = " ".join(RESULTS_DOC.read_text(encoding="utf-8").split())
    figures = re.findall(r"\d[\d,]*\.\d+(?:–[\d.]+)?", headline)
    assert len(figures) >= 10
    for figure in figures:
        assert figure in results, figure


HF_INPUTS = {"path", "model", "tokenizer", "dataset"}
"""The names docs/hf.md's snippets take from the reader (each snippet says which)."""


def _unbound_names(code: str) -> set[str]:
    """Names ``code`` reads that neither it (import, assignment, loop) nor builtins bind."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    return {node.id for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)} - bound


def test_hf_snippets_import_every_name_they_use() -> None:
    text = (ROOT / "docs" / "hf.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    for code in blocks:
        assert _unbound_names(code) <= HF_INPUTS, code


def test_readme_library_example_runs_and_adds_every_aux_loss(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The README's library example runs as printed (stdout captured), and its loss adds each
    loss ``MoEAux`` returns, the sequence-wise one enabled, each times its MoEConfig weight."""
    import dataclasses

    import torch

    from memfine.nn import MoEAux

    code = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 (the README's own code)
    coefs = {"load_balancing_loss": "aux_loss_coef", "z_loss": "z_loss_coef",
             "sequence_balance_loss": "seq_aux_loss_coef"}
    losses = [f.name for f in dataclasses.fields(MoEAux) if f.name.endswith("_loss")]
    assert sorted(losses) == sorted(coefs)
    flat = " ".join(code.split())
    for name in losses:
        assert f"moe.{coefs[name]} * aux.{name}" in flat, name
        assert isinstance(getattr(namespace["aux"], name), torch.Tensor), name
    assert "ChunkDecision(" in capsys.readouterr().out
