"""How ``memfine train`` resolves its flags into a :class:`memfine.config.TrainConfig`.

In the order of :func:`resolve_config`, over the flags of :mod:`memfine.flags.train_flags`. With
``--init-from`` a flag may change the model's settings (chunking, budget, kernels, ``--seq-len``)
but not its architecture (:data:`memfine.artifacts.weights.ARCHITECTURE_FIELDS`). Errors name
the flag that caused them (:func:`memfine.flags.table.name_flag`).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from memfine._optional import is_available
from memfine.artifacts.checkpoint import (
    BASE_COPY_NAME,
    CheckpointNotFoundError,
    find_checkpoint,
    read_checkpoint,
)
from memfine.artifacts.rundir import RUN_FILES
from memfine.artifacts.weights import ARCHITECTURE_FIELDS
from memfine.config import TrainConfig
from memfine.config.lora import LoRAConfig
from memfine.flags.checkpoint import run_directory
from memfine.flags.table import (
    NotGiven,
    apply_config_file,
    flag_names,
    given,
    name_flag,
    typed_fields,
    value,
)
from memfine.flags.train_flags import LORA_FLAGS, RUN_FLAGS, SETTING_FLAGS
from memfine.train import PRESETS, preset
from memfine.train.setup import RESUMABLE_FIELDS
from memfine.units import MiB, format_bytes


def preset_default(path: str) -> NotGiven:
    """The presets' value of a config field, for ``--help`` (e.g. ``small: 128, tiny: 64``)."""
    values = {name: _get(preset(name).to_dict(), path) for name in PRESETS}
    values = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in values.items()}
    if len({repr(v) for v in values.values()}) == 1:
        return NotGiven(text=str(next(iter(values.values()))))
    return NotGiven(text=", ".join(f"{name}: {v}" for name, v in values.items()))


def _set(tree: dict[str, Any], path: str, new: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree[key]
    tree[leaf] = new


def _get(tree: dict[str, Any], path: str) -> Any:
    """The value at a dotted path; None below a None or for a key the checkpoint lacks.

    (``lora.rank`` of a run without LoRA; ``lora.base_quant`` of a plain LoRA run.)
    """
    value: Any = tree
    for key in path.split("."):
        if value is None:
            return None
        value = value.get(key)
    return value


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, Path]:
    """Build the run's TrainConfig and output directory from parsed flags.

    Order: the preset (or, with ``--resume``, the checkpoint's config; with ``--init-from``, the
    preset with that checkpoint's model and ``seq_len``), then ``--config`` FILE, then the flags
    given.

    Raises:
        ValueError: one line naming the flag, the value and what is allowed, on an invalid
            value; ``--preset`` or ``--init-from`` with ``--resume`` that would start another
            run than the checkpoint's, or ``--init-from`` naming another base run than a LoRA
            checkpoint's (:func:`_check_same_base`) or a ``--lora-base-quant`` run; a flag that
            changes a value resume may not change (naming the flag first); a flag that changes
            ``--init-from``'s architecture;
            ``--num-chunks`` given with a memory budget (:func:`_check_one_chunk_setting`).
    """
    if given(args, "config"):
        apply_config_file(args, value(args, "config"), RUN_FLAGS + SETTING_FLAGS)
    resume = bool(value(args, "resume"))
    name = value(args, "preset")
    out = Path(value(args, "out") or f"runs/{name}")
    if resume:
        payload = _checkpoint_of("--out", out, _no_checkpoint_hint(out))
        tree = payload["config"]
        _apply_flags(args, tree, resume=True, out=out)  # a changed flag is named first
        _check_same_base(args, payload.get("base"), out)
        _check_unchanged_origin(args, tree, out, kept=_kept_base(payload, out))
    else:
        tree, source = _fresh_tree(args, name)
        _apply_flags(args, tree, resume=False, out=out)
        _check_source_architecture(args, tree, source)
        _cuda_autocast_default(args, tree)
    config = _build(args, tree)
    _check_one_chunk_setting(args, config, out)
    return config, out


def _check_one_chunk_setting(args: argparse.Namespace, config: TrainConfig, out: Path) -> None:
    """Refuse ``--num-chunks`` given together with a memory budget, which would override it.

    With a budget MACT chooses c per step and MoE layer (MemFine Eq. 8-9) and a fixed
    ``--num-chunks`` is not used; a value given on the command line or in ``--config`` must not
    be dropped silently. Its default is no conflict.

    Raises:
        ValueError: one line naming both flags, what each does and what to drop.
    """
    budget = config.model.chunk.memory_budget_bytes
    if budget is None or not given(args, "num_chunks"):
        return
    chunks = f"--num-chunks {value(args, 'num_chunks')}"
    does = ("--num-chunks fixes c for every MoE layer call, --memory-budget lets MACT choose c "
            "per step and layer within the budget")
    if given(args, "memory_budget"):
        raise ValueError(f"{chunks} and --memory-budget {_bytes_text(budget)} both set the "
                         f"chunk count c: {does}; give one of them")
    source = (f"the checkpoint in --out {str(out)!r}" if value(args, "resume")
              else f"--init-from {str(value(args, 'init_from'))!r}" if given(args, "init_from")
              else f"--preset {value(args, 'preset')}")
    also = "" if value(args, "resume") else ", or add --memory-budget none for a fixed c"
    raise ValueError(f"{chunks} would not be used: {source} sets --memory-budget "
                     f"{_bytes_text(budget)} ({does}); drop --num-chunks{also}")


def _bytes_text(num_bytes: int) -> str:
    """Bytes as people read them (``16.00 MiB``); the exact count too below 1 MiB."""
    return format_bytes(num_bytes, exact=num_bytes < MiB)


def _setting_text(path: str, got: Any) -> str:
    """A value in a message: ``unset``, ``on``/``off``, bytes with a unit, ``w_up,w_down``, repr."""
    if got is None:
        return "unset"
    if isinstance(got, bool):
        return "on" if got else "off"
    if path.endswith("_bytes") and isinstance(got, int):
        return _bytes_text(got)
    if isinstance(got, (list, tuple)):
        return ",".join(str(item) for item in got)
    return repr(got)


def _build(args: argparse.Namespace, tree: dict[str, Any]) -> TrainConfig:
    """TrainConfig of ``tree``; its errors name the flags (:func:`name_flag`)."""
    if not given(args, "renormalize") and tree["model"]["moe"]["top_k"] == 1:
        tree["model"]["moe"]["renormalize"] = False
    try:
        return TrainConfig.from_dict(tree)
    except ValueError as err:
        raise ValueError(name_flag(err, typed_fields(args, SETTING_FLAGS),
                                   flag_names(SETTING_FLAGS))) from err


def _kept_base(payload: dict[str, Any], out: Path) -> Path | None:
    """The base checkpoint a LoRA run in ``out`` keeps (``lora_base/``), or None."""
    name = (payload.get("base") or {}).get("copy")
    kept = None if name is None else out / BASE_COPY_NAME / name
    return kept if kept is not None and kept.exists() else None


def _fresh_tree(args: argparse.Namespace, name: str, kept: Path | None = None
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The preset's config with ``--init-from``'s model and context length (not the flags).

    ``kept``: on resume of a LoRA run, the base checkpoint it keeps, read instead of the
    ``--init-from`` directory (which may have moved on or be gone).

    Returns:
        That config tree, and the ``--init-from`` run's saved config (None without it).
    """
    tree = preset(name).to_dict()
    if not given(args, "init_from"):
        return tree, None
    if kept is not None:
        source = read_checkpoint(kept)["config"]
    else:
        source_dir = run_directory(args, "init_from")
        out = value(args, "out")
        if (out is not None and not given(args, "resume")  # --resume's own check names that case
                and Path(out).resolve() == source_dir.resolve()):
            raise ValueError(f"--init-from and --out are the same directory {str(out)!r}: the new "
                             f"run would replace the checkpoint it starts from (and any LoRA run "
                             f"whose base it is); give the new run another --out")
        payload = _checkpoint_of("--init-from", source_dir, "--init-from takes the --out of a "
                                 "memfine train run that has saved a checkpoint")
        source, quant = payload["config"], _get(payload["config"], "lora.base_quant")
        if quant is not None:  # its adapters cannot be folded: the full-precision base is gone
            raise ValueError(f"--init-from {str(value(args, 'init_from'))!r} was trained with "
                             f"--lora-base-quant {quant}: its adapters sit on a 4-bit base with no "
                             f"full-precision weights to start from; --init-from takes a run "
                             f"trained without --lora-base-quant (e.g. its base run "
                             f"{(payload.get('base') or {}).get('run_dir')!r})")
    tree["model"] = copy.deepcopy(source["model"])  # and its context length:
    tree["seq_len"] = source["seq_len"]
    return tree, source


def _check_source_architecture(args: argparse.Namespace, tree: dict[str, Any],
                               source: dict[str, Any] | None) -> None:
    """Refuse a flag that changes the architecture of ``--init-from``'s model.

    The fine-tune keeps the source model's :data:`memfine.artifacts.weights.ARCHITECTURE_FIELDS`
    (its weights mean nothing in another shape); its chunking, memory budget, kernels, loss
    coefficients and context length are settings of the new run.

    Raises:
        ValueError: naming the flag, the source's value and the one given.
    """
    if source is None:
        return
    fixed = {f"model.{path}" for path in ARCHITECTURE_FIELDS}
    for flag in SETTING_FLAGS:
        for path in flag.paths:
            if path in fixed and given(args, flag.dest) and _get(tree, path) != _get(source, path):
                raise ValueError(f"{flag.name} {_get(tree, path)!r} cannot change the model of "
                                 f"--init-from {str(value(args, 'init_from'))!r} (it has "
                                 f"{_get(source, path)!r}): a fine-tune keeps the source "
                                 f"model's architecture; drop {flag.name}")


def _check_same_base(args: argparse.Namespace, base: dict[str, str] | None, out: Path) -> None:
    """Refuse ``--init-from`` on ``--resume`` of a LoRA run whose frozen base is another run.

    A LoRA checkpoint records the run its adapters were trained on (``base``,
    :mod:`memfine.artifacts.lora_base`); resume keeps that base, so another directory given to
    ``--init-from`` would be ignored. The paths are compared resolved; the same directory with
    changed weights is refused when the base is loaded (its hash no longer matches).

    Raises:
        ValueError: naming ``--init-from``, the checkpoint's base run and the given one.
    """
    if base is None or not given(args, "init_from"):
        return
    got = Path(value(args, "init_from")).resolve()  # a base run since deleted is still named
    if got != Path(base["run_dir"]).resolve():
        raise ValueError(f"--init-from cannot change on --resume (the checkpoint in "
                         f"{str(out)!r} has --init-from {base['run_dir']!r}, the frozen base "
                         f"of its LoRA adapters, got {str(got)!r})")


def _check_unchanged_origin(args: argparse.Namespace, saved: dict[str, Any], out: Path, *,
                            kept: Path | None = None) -> None:
    """Accept ``--preset``/``--init-from`` on ``--resume`` when they start the checkpoint's run.

    The original command repeated with ``--resume`` passes; a preset or source that would start
    another run is refused, naming the fields that would change. ``kept``: a LoRA run's kept
    base checkpoint, which stands for ``--init-from`` (:func:`_fresh_tree`).
    """
    if not (given(args, "preset") or given(args, "init_from")):
        return
    fresh, source = _fresh_tree(args, value(args, "preset"), kept)
    _apply_flags(args, fresh, resume=False, out=out)
    _check_source_architecture(args, fresh, source)
    _cuda_autocast_default(args, fresh)
    started = _build(args, fresh).to_dict()
    differ = [path for path in _leaf_paths(saved) if path not in RESUMABLE_FIELDS
              and path != "lr_decay_steps" and _get(started, path) != _get(saved, path)]
    if differ:
        flags = [f"--{f.replace('_', '-')}" for f in ("preset", "init_from") if given(args, f)]
        origin = " and ".join(flags)
        start, ones = ("starts", "one") if len(flags) == 1 else ("start", "ones")
        names = {path: flag.name for flag in SETTING_FLAGS for path in flag.paths}
        changes = list(dict.fromkeys(f"{names.get(path, path)} "
                                     f"{_setting_text(path, _get(saved, path))} -> "
                                     f"{_setting_text(path, _get(started, path))}"
                                     for path in differ))
        shown = ", ".join(changes[:4]) + (", ..." if len(changes) > 4 else "")
        raise ValueError(f"{origin} {start} another run than the checkpoint in {str(out)!r} "
                         f"(checkpoint -> {origin}: {shown}); --resume continues the run as "
                         f"saved: drop {origin}, or give the original {ones} and the original "
                         f"command's flags for the fields above")


def _leaf_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, item in tree.items():
        path = f"{prefix}{key}"
        out += _leaf_paths(item, path + ".") if isinstance(item, dict) else [path]
    return out


def _no_checkpoint_hint(out: Path) -> str:
    """What to do when ``--resume`` finds no checkpoint (``--overwrite`` when files are left)."""
    left = [name for name in RUN_FILES if (out / name).exists()]
    if left:
        return (f"train without --resume first; --out still holds {', '.join(left)}, so "
                f"add --overwrite to replace them")
    return "train without --resume first"


def _cuda_autocast_default(args: argparse.Namespace, tree: dict[str, Any]) -> None:
    """On CUDA, bf16 autocast over fp32 master weights unless --autocast or --dtype said else."""
    if (tree["device"].startswith("cuda") and tree["dtype"] == "float32"
            and not given(args, "autocast") and not given(args, "dtype")):
        tree["autocast"] = "bfloat16"


def _checkpoint_of(flag: str, run_dir: Path, hint: str) -> dict[str, Any]:
    """The newest checkpoint payload of ``run_dir``.

    Raises:
        ValueError: naming ``flag``; with ``hint`` when there is no checkpoint.
    """
    try:
        return read_checkpoint(find_checkpoint(run_dir))
    except CheckpointNotFoundError as err:
        raise ValueError(f"{flag}: {err} ({hint})") from err
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from err


def _apply_flags(args: argparse.Namespace, tree: dict[str, Any], *, resume: bool,
                 out: Path) -> None:
    """Set the given flags' fields in ``tree``; on resume only :data:`RESUMABLE_FIELDS` change.

    Raises:
        ValueError: naming every flag that changes where resume does not allow it (one line),
            or a LoRA flag that cannot apply (:func:`_start_lora`).
    """
    _start_lora(args, tree, resume=resume, out=out)
    changed: dict[str, str] = {}  # flag → "old, got new"
    for flag in SETTING_FLAGS:
        if not given(args, flag.dest):
            continue
        new = getattr(args, flag.dest)
        for path in flag.paths:
            if resume and path not in RESUMABLE_FIELDS and _get(tree, path) != new:
                changed.setdefault(flag.name, f"{_setting_text(path, _get(tree, path))}, got "
                                              f"{_setting_text(path, new)}")
            _set(tree, path, new)
    if changed:
        names = list(changed)
        flags = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"
        shown = "; ".join(f"{name} {text}" for name, text in changed.items())
        raise ValueError(f"{flags} cannot change on --resume (the checkpoint in {str(out)!r} "
                         f"has {shown})")


def _start_lora(args: argparse.Namespace, tree: dict[str, Any], *, resume: bool,
                out: Path) -> None:
    """Give a fresh run with ``--lora-rank`` the default LoRA config the other flags then set.

    Raises:
        ValueError: one line naming the flag: a LoRA flag without ``--lora-rank``, ``--lora-rank``
            without ``--init-from``, a LoRA flag on ``--resume`` of a run without adapters, or
            ``--lora-base-quant`` without bitsandbytes installed.
    """
    if given(args, "lora_base_quant") and not is_available("bitsandbytes"):
        raise ValueError(f"--lora-base-quant {args.lora_base_quant} needs bitsandbytes: pip "
                         f"install 'memfine[qlora]'")
    lora_flags = [flag.name for flag in LORA_FLAGS if given(args, flag.dest)]
    if not lora_flags or tree.get("lora") is not None:
        return
    if resume:
        raise ValueError(f"{lora_flags[0]} cannot change on --resume (the checkpoint in "
                         f"{str(out)!r} trains every weight, without LoRA adapters)")
    if not given(args, "lora_rank"):
        raise ValueError(f"{lora_flags[0]} needs --lora-rank (without it no adapters are "
                         f"trained)")
    if not given(args, "init_from"):
        raise ValueError("--lora-rank needs --init-from RUN: LoRA fine-tunes adapters on the "
                         "frozen weights of a trained model (the --out of a memfine train run)")
    tree["lora"] = LoRAConfig().to_dict()
