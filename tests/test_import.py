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
import json, logging, os, sys
import torch

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
        if frame is not None and "memfine" in frame.f_code.co_filename.split(os.sep):
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
os.environ = SpyEnviron(original_environ)
import memfine
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
