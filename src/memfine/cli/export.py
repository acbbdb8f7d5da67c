"""``memfine export``: write a training run's model to safetensors, with its config.

A LoRA fine-tune (``memfine train --lora-rank``) exports its adapters to
``adapters.safetensors``; ``--merged`` writes the model with the adapters folded in instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memfine.artifacts.rundir import RUN_FILES, write_error
from memfine.flags.checkpoint import OUT_FLAG, load_run_directory, run_directory
from memfine.flags.table import Flag, NotGiven, add_flags, value
from memfine.flags.values import file_flag
from memfine.inference.adapters import ADAPTERS_NAME, export_adapters, merged
from memfine.inference.trained import export_safetensors

_FLAGS = (
    OUT_FLAG,
    Flag("--to", (), "the safetensors file to write (a model's config goes to "
         "<stem>_config.json beside it)", file_flag("the safetensors file to write"),
         default=NotGiven(text=f"--out/model.safetensors; --out/{ADAPTERS_NAME} for a LoRA "
                          "run without --merged")),
    Flag("--merged", (), "for a LoRA run (memfine train --lora-rank): write the model with "
         "the adapters folded into the expert weights instead of the adapters alone",
         action="store_true", default=NotGiven(False)),
    Flag("--overwrite", (), "replace existing files", action="store_true",
         default=NotGiven(False)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine export`` flags."""
    add_flags(parser, _FLAGS)


def run(args: argparse.Namespace) -> int:
    """Export; returns 0.

    Raises:
        ValueError: when ``--out`` is missing, the checkpoint is missing or corrupt,
            ``--merged`` is given for a run without adapters or with a 4-bit base
            (``--lora-base-quant``), the target's folder does not exist or is not writable, or
            the target exists without ``--overwrite``.
    """
    out = run_directory(args)
    if value(args, "to") is not None:
        _check_folder(Path(value(args, "to")))  # before the checkpoint is read
    merge = bool(value(args, "merged"))
    trained = load_run_directory(out, base=merge)  # the adapters alone never need the base
    lora = trained.config.lora is not None
    if merge and not lora:
        raise ValueError("--merged needs a LoRA run (trained with --lora-rank); this run "
                         "trained every weight: export it without --merged")
    if merge and trained.config.lora is not None and trained.config.lora.base_quant is not None:
        raise ValueError(f"--merged cannot fold adapters trained on a 4-bit base "
                         f"(--lora-base-quant {trained.config.lora.base_quant}): folded into the "
                         f"full-precision base they give another model than the one trained "
                         f"(they were fitted to the NF4 rounding), and the NF4 base cannot hold "
                         f"the update; export the adapters without --merged (allowed: --merged "
                         f"on a run whose base was not quantised)")
    adapters = lora and not merge
    target = Path(value(args, "to") or Path(out) / (ADAPTERS_NAME if adapters
                                                     else "model.safetensors"))
    _check_folder(target)
    paths = [target] if adapters else [target, target.with_name(f"{target.stem}_config.json")]
    _check_targets(paths, Path(out))
    existing = [str(p) for p in paths if p.exists()]
    if existing and not value(args, "overwrite"):
        given = ("--to" if value(args, "to") is not None
                 else f"the export of --out {str(out)!r} (no --to given)")
        raise ValueError(f"{given}: {', '.join(existing)} already exist(s), e.g. from an "
                         f"export of an earlier step; pass --overwrite to replace them or "
                         f"give another --to")
    if adapters:
        written = export_adapters(trained, target)
    else:
        written = export_safetensors(merged(trained) if merge else trained, target)
    print(f"step {trained.step}: wrote " + ", ".join(str(p) for p in written)
          + (f" (--overwrite replaced the earlier {', '.join(existing)})" if existing else ""))
    return 0


def _check_targets(paths: list[Path], out: Path) -> None:
    """Raise ValueError naming ``--to`` for a run file or a path that is no regular file.

    A file to write may be neither one of the run's own files (its checkpoint, config, logs) nor
    an existing folder, FIFO or device.
    """
    run_files = {(out / name).resolve() for name in RUN_FILES}
    for path in paths:
        if path.resolve() in run_files:
            raise ValueError(f"--to {str(path)!r} is a file of the run in --out (its checkpoint, "
                             f"config or logs): choose another --to")
        if path.exists() and not path.is_file():
            raise ValueError(f"--to {str(path)!r} exists and is not a regular file: choose "
                             f"another --to")


def _check_folder(target: Path) -> None:
    """Raise ValueError naming ``--to`` when ``target``'s folder is missing, or unwritable.

    Unwritable: no folder, a read-only mount, no permission.
    """
    if target.parent.exists() and not target.parent.is_dir():
        raise ValueError(f"--to {str(target)!r}: {str(target.parent)!r} is not a folder; "
                         f"choose another --to")
    if not target.parent.is_dir():
        raise ValueError(f"--to {str(target)!r}: the folder {str(target.parent)!r} does not "
                         f"exist; create it or choose another --to")
    err = write_error(target.parent)
    if err is not None:
        raise ValueError(f"--to {str(target)!r}: the folder {str(target.parent)!r} is not "
                         f"writable ({err.strerror or err}); choose another --to") from err
