"""docs/style.md §2 import table, checked with ``ast`` over src/memfine.

Every ``import memfine...`` / ``from memfine... import`` / relative import of a module is mapped to
its layer and checked against the layers it may import. Imports inside a layer are free. Optional
dependencies (triton, transformers) may be imported at module level only inside
``triton_kernels/``; elsewhere only lazily, inside a function (docs/style.md §8); ``ops`` and
``experts`` load ``triton_kernels/`` lazily.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import memfine

SRC = Path(memfine.__file__).parent

BASE = {"config", "units", "_checks", "environment"}
ALL_BELOW_NN = BASE | {"_optional", "counts", "measure", "routing", "router_node", "dispatch",
                       "activations", "ops", "triton_kernels", "lora", "experts", "parallel",
                       "schedule", "timeline", "layer_timeline", "memory"}
ALLOWED: dict[str, set[str]] = {
    "units": set(),
    "_checks": set(),
    "config": {"_checks", "units"},
    "_optional": set(),
    "environment": set(),
    # the process a run lives in: stop signals, deterministic algorithms
    "runtime": BASE,
    "reference": BASE,
    "data": BASE,
    # what a GPU would pay, counted on the CPU (ATen ops, host syncs, roofline floors)
    "counts": BASE,
    # measured bytes; re-exports counts' OpCounter
    "measure": {"counts"} | BASE,
    "routing": BASE,
    # the router and its losses as one autograd node (logits recomputed in backward)
    "router_node": {"routing"} | BASE,
    "dispatch": {"routing"} | BASE,
    "triton_kernels": {"_optional"},
    # the expert activations' table and their closed-form backward (MoEBlaze §4)
    "activations": BASE,
    "ops": {"activations", "dispatch", "_optional", "triton_kernels"} | BASE,
    # the split LoRA's adapter math and the 4-bit (NF4) base, below the experts path
    "lora": {"ops", "_optional"} | BASE,
    # the experts path: run_experts (plain or fused), the fused Function (MoEBlaze §4), split LoRA
    "experts": {"activations", "ops", "lora", "dispatch", "_optional", "triton_kernels"} | BASE,
    # prediction: replays the code's allocations from configs; never imports the code it models
    "timeline": {"dispatch"} | BASE,
    # one whole MoE layer's timeline (router, routed and shared experts, combine)
    "layer_timeline": {"timeline"} | BASE,
    "memory": {"layer_timeline", "timeline", "dispatch"} | BASE,
    # whole training layouts: pipeline stages, presets, the layout search (prediction only)
    "plan": {"memory"} | BASE,
    # what memfine plan prints: a plan's report, the commands that run its layout
    "launch": {"plan"} | BASE,
    "parallel": {"ops", "lora", "experts", "dispatch", "schedule", "memory"} | BASE,
    "schedule": {"ops", "experts", "dispatch", "memory"} | BASE,
    "nn": ALL_BELOW_NN,
    # what the transformers backend runs on HF experts modules' weights (the transformers experts
    # interface hands it routed tokens, not an MoELayer), so it may import dispatch and schedule
    # as nn does.
    "hf": {"nn", "activations", "ops", "lora", "experts", "dispatch", "schedule", "memory",
           "_optional"} | BASE,
    "integrations": {"hf", "nn", "activations", "ops", "lora", "experts", "dispatch",
                     "schedule", "memory", "_optional"} | BASE,
    # what a run reports: metrics, the memory log, progress, evaluation; tqdm/matplotlib/
    # tensorboard are optional extras, loaded through _optional.
    "reports": {"nn", "data", "memory", "measure", "_optional"} | BASE,
    # a run's directory, checkpoints, loading a checkpoint's weights into a model
    "artifacts": {"nn", "data", "memory", "measure", "reports", "_optional"} | BASE,
    # what is done with a checkpoint afterwards: generate, evaluate, export (adapters too)
    "inference": {"nn", "data", "artifacts", "reports", "_optional"} | BASE,
    "train": {"nn", "data", "artifacts", "reports", "schedule", "memory", "measure",
              "runtime", "_optional"} | BASE,
    # the benchmark system's measuring core (harness, options, CSV results, tables and plots)
    "bench": {"measure", "_optional"} | BASE,
    # the peer layers the suites measure against
    "baselines": ALL_BELOW_NN | {"nn", "hf", "integrations", "bench"},
    # the suites measure every layer of the package (never against the reference); the
    # benchmark scripts parse their flags with the flags' value parsers
    "suites": ALL_BELOW_NN | {"nn", "hf", "integrations", "train", "data", "artifacts",
                              "inference", "reports", "plan", "launch", "bench", "baselines",
                              "flags", "runtime"},
    # the flag tables of the commands and how they resolve into configs
    "flags": ALL_BELOW_NN | {"nn", "train", "data", "artifacts", "inference", "reports",
                             "plan"},
    "cli": {"*"},
    "__main__": {"cli"},
    # The package root re-exports the public API; it must not pull in the reference.
    "__init__": ALL_BELOW_NN | {"nn", "hf", "integrations", "train", "data", "artifacts",
                                "reports"},
}
OPTIONAL_PACKAGES = ("triton", "transformers", "torchtitan")
# Modules that subclass an optional package's classes import it at module level; they are
# themselves loaded only lazily (inside a function), like triton_kernels/.
LAZY_MODULES = {"memfine.integrations.torchtitan_modules": "torchtitan"}


def layer_of(module: str) -> str:
    """'memfine.triton_kernels.kernels' → 'ops.triton'; 'memfine.routing.router' → 'routing'."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    return parts[0]


def module_name(path: Path, src: Path) -> tuple[str, bool]:
    """Dotted module name of a file under ``src`` and whether it is a package ``__init__``."""
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    if base == "memfine":  # `from memfine import ops` names submodules
        return [f"memfine.{alias.name}" for alias in node.names]
    lazy = [f"{base}.{alias.name}" for alias in node.names
            if f"{base}.{alias.name}" in LAZY_MODULES]  # `from package import lazy_module`
    return [base, *lazy]


def _imports(tree: ast.Module, module: str, is_package: bool
             ) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level?) for every import statement."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.extend((m, child.lineno, top)
                             for m in _resolve(child, module, is_package))
            visit(child, inner)

    visit(tree, True)
    return found


def violations(src: Path, only_layer: str | None = None) -> list[str]:
    """Every import that breaks the table, as 'file:line: layer imports target'."""
    bad = []
    for path in sorted(src.rglob("*.py")):
        module, is_package = module_name(path, src)
        layer = layer_of(module)
        if only_layer is not None and layer != only_layer:
            continue
        allowed = ALLOWED.get(layer)
        where = f"{path.relative_to(src.parent)}"
        if allowed is None:
            bad.append(f"{where}: layer {layer!r} is not in the docs/style.md §2 table")
            continue
        for target, line, top in _imports(ast.parse(path.read_text(), str(path)), module,
                                          is_package):
            root = target.split(".")[0]
            eager_ok = layer == "triton_kernels" or LAZY_MODULES.get(module) == root
            if root in OPTIONAL_PACKAGES and top and not eager_ok:
                bad.append(f"{where}:{line}: module-level import of optional {root!r}")
            if target in LAZY_MODULES and top:
                bad.append(f"{where}:{line}: {target} must be loaded lazily (inside a function)")
            if root != "memfine":
                continue
            target_layer = layer_of(target)
            if target_layer == layer or "*" in allowed:
                continue
            if target_layer == "triton_kernels" and layer in ("ops", "experts") and top:
                bad.append(f"{where}:{line}: {layer} must load triton_kernels lazily (inside a "
                           "function)")
            elif target_layer not in allowed:
                bad.append(f"{where}:{line}: {layer} may not import {target_layer} ({target})")
    return bad


@pytest.mark.parametrize("layer", list(ALLOWED))
def test_src_follows_the_import_table(layer: str) -> None:
    found = violations(SRC, layer)
    assert not found, "\n".join(found)


def test_every_file_belongs_to_a_layer() -> None:
    layers = {layer_of(module_name(p, SRC)[0]) for p in SRC.rglob("*.py")}
    assert layers <= set(ALLOWED), layers - set(ALLOWED)


STYLE = Path(__file__).parents[1] / "docs" / "style.md"


def test_suites_may_import_everything_below_cli_but_the_reference() -> None:
    """docs/style.md's row for suites: "everything below `cli` except `reference`"."""
    below_cli = set(ALLOWED) - {"cli", "__main__", "__init__", "suites", "reference"}
    assert ALLOWED["suites"] == below_cli


def test_base_layers_match_the_style_table() -> None:
    """The layers that import nothing are those docs/style.md lists first."""
    row = next(line for line in STYLE.read_text(encoding="utf-8").splitlines()
               if line.endswith("| nothing |"))
    documented = set(re.findall(r"`(\w+)`", row))
    assert documented == {layer for layer, allowed in ALLOWED.items() if not allowed}
    assert {"config"} | (documented - {"_optional"}) == BASE


def test_nothing_below_cli_imports_the_reference() -> None:
    for layer, allowed in ALLOWED.items():
        assert "reference" not in allowed or layer == "cli", layer


CASES = [
    pytest.param("routing/router.py", "from memfine.nn import MoELayer\n",
                 "routing may not import nn", id="upward"),
    pytest.param("ops/fused.py", "from ..reference import reference_experts\n",
                 "ops may not import reference", id="relative"),
    pytest.param("dispatch/index.py", "import memfine.memory.planner\n",
                 "dispatch may not import memory", id="plain_import"),
    pytest.param("nn/moe.py", "from memfine import reference\n",
                 "nn may not import reference", id="from_package"),
    pytest.param("ops/grouped.py", "from memfine.triton_kernels import grouped_mm\n",
                 "ops must load triton_kernels lazily", id="eager_triton"),
    pytest.param("integrations/hf.py", "import transformers\n",
                 "module-level import of optional 'transformers'", id="eager_optional"),
    pytest.param("integrations/torchtitan.py",
                 "from memfine.integrations import torchtitan_modules\n",
                 "must be loaded lazily", id="eager_lazy_module"),
    pytest.param("integrations/torchtitan_modules.py", "import torchtitan\n", None,
                 id="lazy_module_imports_its_package"),
    pytest.param("ops/__init__.py", "from . import experts\nfrom .. import config\n",
                 None, id="allowed_relative"),
    pytest.param("ops/grouped.py", "def f():\n    from memfine.triton_kernels import k\n"
                 "    import triton\n", None, id="lazy_is_allowed"),
]


@pytest.mark.parametrize(("file", "source", "expected"), CASES)
def test_checker_catches_violations(tmp_path: Path, file: str, source: str,
                                    expected: str | None) -> None:
    src = tmp_path / "memfine"
    (src / file).parent.mkdir(parents=True)
    (src / file).write_text(source)
    found = violations(src)
    if expected is None:
        assert not found
    else:
        assert len(found) == 1 and expected in found[0], found


def test_every_package_declares_its_public_names() -> None:
    """Each package's ``__init__`` has an ``__all__`` whose names it defines or imports."""
    missing, undefined = [], []
    for init in sorted(SRC.rglob("__init__.py")):
        module = module_name(init, SRC)[0]
        tree = ast.parse(init.read_text())
        names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                 for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(t, ast.Name)}
        if "__all__" not in names:
            missing.append(module)
            continue
        exported = importlib.import_module(module).__all__
        undefined += [f"{module}.{name}" for name in exported
                      if not hasattr(importlib.import_module(module), name)]
    assert not missing and not undefined, (missing, undefined)


def test_no_private_name_crosses_a_package() -> None:
    """``from memfine.a.b import _name`` only inside package ``memfine.a`` (private stays home)."""
    crossing = []
    for path in sorted(SRC.rglob("*.py")):
        module, is_package = module_name(path, SRC)
        home = module.split(".")[1] if module.count(".") else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            parts = node.module.split(".")
            if parts[0] != "memfine" or len(parts) < 2 or parts[1] == home:
                continue
            crossing += [f"{module}: {node.module}.{alias.name}" for alias in node.names
                         if alias.name.startswith("_") and not alias.name.startswith("__")
                         and not parts[1].startswith("_")]
    assert not crossing, crossing


PACKAGE_LINE_LIMIT = 1300  # docs/style.md §2: a package past this holds two ideas; split it


def test_no_package_is_over_the_line_limit() -> None:
    """Every package of src/memfine, its subpackages included, stays within the limit."""
    sizes = {package.name: sum(len(path.read_text(encoding="utf-8").splitlines())
                               for path in package.rglob("*.py"))
             for package in SRC.iterdir() if (package / "__init__.py").is_file()}
    over = {name: lines for name, lines in sizes.items() if lines > PACKAGE_LINE_LIMIT}
    assert not over, f"packages over {PACKAGE_LINE_LIMIT} lines: {over}"
