"""``import memfine`` has no side effects (docs/style.md §8), checked in a fresh interpreter.

It must not import triton or transformers, change torch's global flags (default dtype,
determinism, TF32, matmul precision, threads, RNG state), touch CUDA, read environment variables
or add log handlers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import importlib.util, json, logging, os, sys, time
start = time.process_time()
import torch
torch_seconds = time.process_time() - start
# memfine's own files: the package directory, wherever the checkout lives (a path component
# named "memfine" also holds .venv/ and its site-packages in a clone named memfine).
PACKAGE = os.path.dirname(os.path.abspath(importlib.util.find_spec("memfine").origin)) + os.sep

def flags():
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "num_threads": torch.get_num_threads(),
        "grad_enabled": torch.is_grad_enabled(),
        "rng_state": torch.get_rng_state().sum().item(),
        "root_handlers": len(logging.getLogger().handlers),
    }

HEAVY = ("sympy", "mpmath", "torch._dynamo", "torch._dynamo.config",
         "torch.fx.experimental.symbolic_shapes", "torch._inductor")
cuda_calls = []
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device",
             "set_device", "synchronize"):
    original = getattr(torch.cuda, name)
    def spy(*args, _name=name, _original=original, **kwargs):
        cuda_calls.append(_name)
        return _original(*args, **kwargs)
    setattr(torch.cuda, name, spy)

env_reads = []
original_environ = os.environ

class SpyEnviron(dict):
    # Records keys read by memfine code itself (the first caller outside os.py).

    def _note(self, key):
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == os.__file__:
            frame = frame.f_back
        if frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE):
            env_reads.append(key)

    def __getitem__(self, key):
        self._note(key)
        return original_environ[key]
    def get(self, key, default=None):
        self._note(key)
        return original_environ.get(key, default)
    def __contains__(self, key):
        self._note(key)
        return key in original_environ

before = flags()
heavy_before = sorted(m for m in HEAVY if m in sys.modules)
os.environ = SpyEnviron(original_environ)
start = time.process_time()
import memfine
memfine_seconds = time.process_time() - start
os.environ = original_environ
after = flags()
memfine_loggers = {
    name: [type(h).__name__ for h in logger.handlers]
    for name, logger in logging.Logger.manager.loggerDict.items()
    if name.startswith("memfine") and isinstance(logger, logging.Logger)}
print(json.dumps({
    "before": before, "after": after,
    "optional_loaded": sorted(m for m in ("triton", "transformers") if m in sys.modules),
    "cuda_calls": cuda_calls, "cuda_initialized": torch.cuda.is_initialized(),
    "env_reads": env_reads,
    "heavy_loaded": sorted(m for m in HEAVY if m in sys.modules and m not in heavy_before),
    "torch_seconds": torch_seconds, "memfine_seconds": memfine_seconds,
    "memfine_handlers": {k: v for k, v in memfine_loggers.items()
                         if any(h != "NullHandler" for h in v)},
}))
"""


def _probe(env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          check=False, env=env)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_import_has_no_side_effects() -> None:
    result = _probe()
    assert result["optional_loaded"] == [], "import memfine loaded optional dependencies"
    assert result["after"] == result["before"], "import memfine changed torch global state"
    assert result["cuda_calls"] == [] and result["cuda_initialized"] is False
    assert result["env_reads"] == [], "import memfine read environment variables"
    assert result["memfine_handlers"] == {}, "import memfine added log handlers"
    assert result["heavy_loaded"] == [], "import memfine loaded sympy or torch.compile's stack"


def test_import_is_light_next_to_torch() -> None:
    """``import memfine`` after torch costs a fraction of ``import torch`` itself.

    Import time is the measured quantity here (not a speed target): loading sympy and dynamo's
    config at import takes about as long as torch; memfine's own modules take a small part.
    """
    result = _probe()
    memfine_s, torch_s = result["memfine_seconds"], result["torch_seconds"]
    assert isinstance(memfine_s, float) and isinstance(torch_s, float)
    assert memfine_s < max(1.0, torch_s), (
        f"import memfine took {memfine_s:.2f} s after import torch ({torch_s:.2f} s)")


BAD_PACKAGE = """
import logging, os, sys
import torch
os.environ.get("MEMFINE_BACKEND")
torch.set_default_dtype(torch.float64)
torch.use_deterministic_algorithms(True)
torch.cuda.is_available()
sys.modules.setdefault("triton", sys)
logging.getLogger("memfine").addHandler(logging.StreamHandler())
"""


def test_probe_detects_side_effects(tmp_path: Path) -> None:
    fake = tmp_path / "memfine"
    fake.mkdir()
    (fake / "__init__.py").write_text(BAD_PACKAGE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                       os.environ.get("PYTHONPATH", "")])}
    result = _probe(env)
    assert result["optional_loaded"] == ["triton"]
    changed = {k for k, v in result["after"].items()  # type: ignore[union-attr]
               if v != result["before"][k]}  # type: ignore[index]
    assert changed == {"default_dtype", "deterministic"}
    assert result["cuda_calls"] == ["is_available"]
    assert result["env_reads"] == ["MEMFINE_BACKEND"]
    assert result["memfine_handlers"] == {"memfine": ["StreamHandler"]}


def test_probe_counts_only_the_package_itself(tmp_path: Path) -> None:
    """A checkout named ``memfine`` holds its .venv: a dependency there is not memfine's code."""
    checkout = tmp_path / "memfine"
    package, venv = checkout / "src" / "memfine", checkout / ".venv" / "site-packages"
    package.mkdir(parents=True)
    venv.mkdir(parents=True)
    (venv / "memfine_dependency.py").write_text("import os\nos.environ.get('DEPENDENCY_VAR')\n")
    (package / "__init__.py").write_text("import os\nimport memfine_dependency\n"
                                         "os.environ.get('PACKAGE_VAR')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package.parent), str(venv)])}
    assert _probe(env)["env_reads"] == ["PACKAGE_VAR"]


def test_bare_install_without_numpy_imports_quietly() -> None:
    """torch warns "Failed to initialize NumPy" where numpy is absent; memfine never uses it."""
    code = ("import sys, warnings\nsys.modules['numpy'] = None  # as in a bare install\n"
            "filters = len(warnings.filters)\nimport memfine\n"
            "assert len(warnings.filters) == filters, 'import memfine changed warning filters'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
