"""``memfine export``: write a training run's model to safetensors, with its config."""

from __future__ import annotations

import argparse
from pathlib import Path

from memfine.artifacts.inference import export_safetensors
from memfine.cli._checkpoint import OUT_FLAG, load_run_directory, run_directory
from memfine.cli._flags import Flag, NotGiven, add_flags, path_flag, value

_FLAGS = (
    OUT_FLAG,
    Flag("--to", (), "the safetensors file to write (the config goes to <stem>_config.json "
         "beside it)", path_flag, default=NotGiven(text="--out/model.safetensors")),
    Flag("--overwrite", (), "replace existing files", action="store_true",
         default=NotGiven(False)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine export`` flags."""
    add_flags(parser, _FLAGS)


def run(args: argparse.Namespace) -> int:
    """Export; returns 0.

    Raises:
        ValueError: when ``--out`` is missing, the checkpoint is missing or corrupt, the
            target's folder does not exist, or the target exists without ``--overwrite``.
    """
    out = run_directory(args)
    target = Path(value(args, "to") or Path(out) / "model.safetensors")
    config_path = target.with_name(f"{target.stem}_config.json")
    if not target.parent.is_dir():
        raise ValueError(f"--to {str(target)!r}: the folder {str(target.parent)!r} does not "
                         f"exist; create it or choose another --to")
    existing = [str(p) for p in (target, config_path) if p.exists()]
    if existing and not value(args, "overwrite"):
        raise ValueError(f"--to: {', '.join(existing)} already exist(s); pass --overwrite to "
                         f"replace them")
    trained = load_run_directory(out)
    written = export_safetensors(trained, target)
    print(f"step {trained.step}: wrote " + ", ".join(str(p) for p in written))
    return 0
