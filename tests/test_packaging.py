"""The package as people install it: one version, its license text, a changelog entry."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import memfine

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).parents[1]


def test_version_has_one_source() -> None:
    """pyproject.toml declares the version dynamic; hatch reads memfine.__version__."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["hatch"]["version"]["path"] == "src/memfine/__init__.py"
    assert importlib.metadata.version("memfine") == memfine.__version__


def test_license_file_is_the_declared_license() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_changelog_has_a_section_for_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", text, re.M)
    assert memfine.__version__ in released, released


def test_metadata_names_authors_and_project_urls() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["authors"] and all(a.get("name") for a in project["authors"])
    assert project["urls"] and all(u.startswith("https://") for u in project["urls"].values())
