"""Optional dependencies: ``is_available(name)`` and ``require(name)``, imported lazily.

Extras: ``triton`` → ``pip install memfine[triton]``; ``transformers`` →
``pip install memfine[hf]``; ``torchtitan`` → ``pip install memfine[torchtitan]``; tqdm,
matplotlib, safetensors (and tomli on Python 3.10) → ``memfine[train]``; tensorboard, trackio,
wandb → ``memfine[tensorboard]``, ``memfine[trackio]``, ``memfine[wandb]``; trl →
``memfine[trl]``; bitsandbytes → ``memfine[qlora]``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

_EXTRAS = {"triton": "triton", "transformers": "hf", "tqdm": "train", "matplotlib": "train",
           "safetensors": "train", "tomli": "train", "tensorboard": "tensorboard",
           "trackio": "trackio", "wandb": "wandb", "trl": "trl", "torchtitan": "torchtitan",
           "bitsandbytes": "qlora"}


def is_available(name: str) -> bool:
    """True when the optional package ``name`` can be imported (does not import it)."""
    return importlib.util.find_spec(name) is not None


def require(name: str) -> ModuleType:
    """Import and return the optional package ``name``.

    Raises:
        ImportError: naming the extra to install when the package is missing.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = name.split(".")[0]  # safetensors.torch: the package safetensors
        extra = _EXTRAS.get(top, top)
        raise ImportError(f"{name} is required for this feature: pip install 'memfine[{extra}]'"
                          ) from err


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only ``Agg`` backend, imported on first use.

    Raises:
        ImportError: naming the extra to install when matplotlib is missing.
    """
    require("matplotlib").use("Agg")
    return require("matplotlib.pyplot")
