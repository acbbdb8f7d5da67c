"""Adapter-only checkpoints of LoRA runs: the reference to the frozen base and its content hash.

A ``memfine train --init-from RUN --lora-rank r`` run keeps RUN's weights frozen. Its checkpoint
(:func:`memfine.artifacts.checkpoint.save_checkpoint`) stores only what training changes — the
trainable parameters (adapters, and router / attention where the LoRA config trains them), the
buffers, the optimizer, scheduler and RNG states and the step — plus ``base``: RUN's directory,
the checkpoint file read from it and the SHA-256 of that checkpoint's bytes. Loading (resume,
eval, generate, export) reads the base weights from there first, after checking the hash: a
changed base is a one-line error, since the adapters were trained against the other weights.

The model carries its reference as the attribute :data:`BASE_ATTRIBUTE` (set by
:func:`set_lora_base` when the run starts, and again when a checkpoint is loaded), so every save
of the run writes the same reference.

The LoRA run keeps the exact base bytes it trains on (:func:`keep_base_copy`):
``RUN_DIR/lora_base/<sha256[:16]>.pt`` (``.dcp`` for a sharded base) is a hard link to the
base's checkpoint file — the base run's next save replaces its file by a rename, which leaves
the linked inode as it was — or a copy where no link can be made (another file system), checked
against the SHA-256. With stacked adapters the base run's own ``lora_base/`` files are kept too.
Loading takes the base from there (the reference's ``copy``), so the LoRA run stays usable after
its base run is resumed, overwritten or deleted; a checkpoint without a copy (written before
copies were kept, or with the folder deleted) reads the base run as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from memfine.artifacts.checkpoint import BASE_COPY_NAME, LoRABaseError, find_checkpoint

BASE_ATTRIBUTE = "_memfine_lora_base"
_HASH_CHUNK = 1 << 20
_hash_cache: dict[tuple[str, int, int], str] = {}


def content_hash(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a checkpoint: a file's bytes, or every file of a DCP directory.

    A directory's digest covers each file's relative path and bytes, in sorted order. Results
    are cached per (path, size, modification time), so a run hashes its base once.

    Raises:
        ValueError: naming the path when it does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"the LoRA base checkpoint {str(path)!r} does not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [p.stat() for p in files]
    key = (str(path.resolve()), sum(s.st_size for s in stats),
           max((s.st_mtime_ns for s in stats), default=0))
    if key in _hash_cache:
        return _hash_cache[key]
    digest = hashlib.sha256()
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            while block := f.read(_HASH_CHUNK):
                digest.update(block)
    _hash_cache[key] = digest.hexdigest()
    return _hash_cache[key]


def set_lora_base(model: torch.nn.Module, run_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Record ``run_dir``'s newest checkpoint as the frozen base of ``model`` (a LoRA model).

    Returns:
        The reference ``{"run_dir", "checkpoint", "sha256"}`` (absolute paths).

    Raises:
        ValueError: when ``run_dir`` holds no checkpoint.
    """
    checkpoint = find_checkpoint(run_dir).resolve()
    reference = {"run_dir": str(Path(run_dir).resolve()), "checkpoint": str(checkpoint),
                 "sha256": content_hash(checkpoint)}
    setattr(model, BASE_ATTRIBUTE, reference)
    return reference


def trainable_state(model: torch.nn.Module, state: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """``state`` without the frozen parameters of ``model`` (buffers and trained ones kept).

    ``state``: keyed by parameter name; default ``model.state_dict()``.
    """
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return {k: v for k, v in (model.state_dict() if state is None else state).items()
            if k not in frozen}


def keep_base_copy(model: torch.nn.Module, out_dir: str | os.PathLike[str]) -> Path:
    """Keep the recorded base checkpoint of ``model`` inside the LoRA run ``out_dir``.

    A hard link (every file of a DCP directory linked), else a copy; with stacked adapters the
    base run's own ``lora_base/`` entries are kept as well. The reference gets ``copy``, the
    kept file's name in ``out_dir/lora_base``.

    Returns:
        The kept checkpoint's path.

    Raises:
        LoRABaseError: when the kept bytes do not hash to the recorded SHA-256 (the base
            changed since it was recorded); nothing is kept then.
    """
    reference = getattr(model, BASE_ATTRIBUTE)
    source = Path(reference["checkpoint"])
    folder = Path(out_dir) / BASE_COPY_NAME
    folder.mkdir(exist_ok=True)
    name = reference["sha256"][:16] + (".dcp" if source.is_dir() else ".pt")
    kept = folder / name
    _link_or_copy(source, kept)
    if content_hash(kept) != reference["sha256"]:
        _remove(kept)
        raise LoRABaseError(f"the LoRA base checkpoint {str(source)!r} changed while this run "
                            f"started (sha256 {reference['sha256'][:12]}… when read); start it "
                            f"again")
    inner = source.parent / BASE_COPY_NAME  # a stacked base's own bases
    if inner.is_dir():
        for entry in inner.iterdir():
            _link_or_copy(entry, folder / entry.name)
    setattr(model, BASE_ATTRIBUTE, {**reference, "copy": name})
    return kept


def _link_or_copy(source: Path, target: Path) -> None:
    """Hard-link ``source`` (a file, or every file of a folder) to ``target``; copy if need be.

    An existing ``target`` is kept (the names are content hashes). Files appear atomically
    (a temporary name, then a rename).
    """
    if target.exists():
        return
    if source.is_dir():
        target.mkdir()
        for entry in source.iterdir():
            _link_or_copy(entry, target / entry.name)
        return
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # another file system, or links not allowed: the bytes themselves
        shutil.copy2(source, tmp)
    os.replace(tmp, target)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _kept_copy(reference: dict[str, str], where: Path | None) -> Path | None:
    """The kept base of ``reference`` beside the checkpoint that holds it, or None.

    ``where``: the folder of that checkpoint — a LoRA run directory (its ``lora_base/``), or
    a ``lora_base/`` folder itself (a stacked base's base sits beside it).
    """
    name = reference.get("copy")
    if name is None or where is None:
        return None
    return next((p for p in (where / BASE_COPY_NAME / name, where / name) if p.exists()), None)


def load_base_(reference: dict[str, str], config: dict[str, Any],
               model: torch.nn.Module, *, where: Path | None = None) -> None:
    """Load the frozen base of a LoRA checkpoint into ``model`` and record the reference.

    Args:
        reference: the checkpoint's ``base``.
        config: the checkpoint's ``config`` (``TrainConfig.to_dict()``).
        model: the LoRA model (its adapters are loaded afterwards from the checkpoint).
        where: the folder of the LoRA checkpoint; its kept base (:func:`keep_base_copy`) is
            read when there, else the base run's checkpoint.

    Raises:
        LoRABaseError: one line when the kept base or the base checkpoint is gone or its
            content changed (naming the base run, its checkpoint and both hashes), or when its
            weights do not fit. When the base is itself a LoRA run (stacked adapters), a change
            below it is named where it happened: ``its LoRA base run 'A' is a LoRA run too;
            checkpoint 'A/checkpoint.pt': its LoRA base run 'R' changed ...``.
    """
    from memfine.artifacts.weights import language_model, load_checkpoint_weights
    from memfine.config import TrainConfig

    kept = _kept_copy(reference, where)
    path = kept if kept is not None else _base_checkpoint(reference)
    if kept is not None and content_hash(kept) != reference["sha256"]:
        raise LoRABaseError(f"the kept copy {str(kept)!r} of its LoRA base checkpoint "
                            f"{reference['checkpoint']!r} changed (sha256 "
                            f"{reference['sha256'][:12]}… when trained, now "
                            f"{content_hash(kept)[:12]}…); restore it")
    base_config = dataclasses.replace(TrainConfig.from_dict(config), lora=None)
    plain = language_model(base_config)
    try:
        load_checkpoint_weights(plain, base_config.model, path)
    except LoRABaseError as err:  # stacked adapters: the base's own base is gone or changed
        raise LoRABaseError(f"its LoRA base run {reference['run_dir']!r} is a LoRA run too; "
                            f"{err}") from err
    from memfine.nn.lora import load_quantized_bases_

    state = plain.state_dict()
    quantized = load_quantized_bases_(model, state)  # a 4-bit base: quantised again (same codes)
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in state.items() if k not in quantized}, strict=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or not set(missing) <= trained:
        raise LoRABaseError(f"the LoRA base {str(path)!r} does not fit the model (missing "
                            f"{sorted(set(missing) - trained)[:3]}, unexpected "
                            f"{unexpected[:3]})")
    setattr(model, BASE_ATTRIBUTE, dict(reference))


def _base_checkpoint(reference: dict[str, str]) -> Path:
    """The base run's checkpoint of ``reference``, checked unchanged (no kept copy).

    Raises:
        LoRABaseError: when it is gone, changed or no longer the run's newest.
    """
    path = Path(reference["checkpoint"])
    if not path.exists() or (path.is_dir() and not any(p.is_file() for p in path.rglob("*"))):
        what = "is gone" if not path.exists() else "is now an empty directory"
        raise LoRABaseError(f"the LoRA base checkpoint {str(path)!r} {what}; this run's "
                            f"checkpoint holds only the adapters (restore the base run)")
    now = content_hash(path)
    if now != reference["sha256"]:
        raise LoRABaseError(f"its LoRA base run {reference['run_dir']!r} changed since the "
                            f"adapters were trained: the base checkpoint {str(path)!r} had "
                            f"sha256 {reference['sha256'][:12]}…, now {now[:12]}…; restore it, "
                            f"or start a new run with --init-from")
    if find_checkpoint(reference["run_dir"]).resolve() != path.resolve():
        raise LoRABaseError(f"the LoRA base run {reference['run_dir']!r} has a newer checkpoint "
                            f"than {str(path)!r}, which the adapters were trained on; restore "
                            f"it")
    return path
