"""Using a trained checkpoint: load the model, generate text, evaluate on text, export weights.

Legend: B batch, Q sequence length.

Behind ``memfine generate``, ``memfine eval`` and ``memfine export``. A run directory's
``checkpoint.pt`` holds the model weights and the :class:`memfine.config.TrainConfig` they were
trained with; :func:`load_trained` rebuilds the model from it
(:func:`memfine.artifacts.weights.load_weights` starts a new run from its weights). Export
writes the weights to ``model.safetensors`` (``safetensors`` package) with the model config in
the file's metadata and in ``model_config.json`` beside it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from memfine._optional import require
from memfine.artifacts.atomic import file_mode
from memfine.artifacts.checkpoint import (
    CHECKPOINT_NAME,
    SHARDED_NAME,
    LoRABaseError,
    find_checkpoint,
    read_checkpoint,
)
from memfine.artifacts.finite import check_finite_model
from memfine.artifacts.restore import load_model_state
from memfine.artifacts.weights import language_model
from memfine.config import ModelConfig, TrainConfig
from memfine.data import ByteCorpus, decode, encode, unigram_entropy, val_batches
from memfine.nn import MoETransformerLM
from memfine.reports.evaluation import evaluate
from memfine.reports.metrics import nats_to_bits

EXPORT_FORMAT = "memfine-model-v1"


@dataclass(frozen=True, slots=True)
class Trained:
    """A model rebuilt from a checkpoint, in eval mode.

    Attributes:
        model: the language model with the checkpoint's weights.
        config: the run's config.
        step: completed training steps of the checkpoint.
    """

    model: MoETransformerLM
    config: TrainConfig
    step: int


def load_trained(run_dir: str | os.PathLike[str], device: str = "cpu", *,
                 base: bool = True) -> Trained:
    """Rebuild the model of ``run_dir``'s checkpoint on ``device``.

    ``checkpoint.pt``, or the newest checkpoint when a sharded ``checkpoint.dcp/`` (a torchrun
    run) is there too (:func:`memfine.artifacts.checkpoint.find_checkpoint`). ``base=False``
    skips a LoRA run's frozen base (its weights stay as initialised): the trained tensors alone,
    for exporting the adapters, which never depend on the base.

    Raises:
        ValueError: naming the path when the checkpoint is missing, corrupt, does not fit
            its own config or holds NaN/±inf weights
            (:func:`memfine.artifacts.finite.check_finite_model`);
            :class:`memfine.artifacts.checkpoint.LoRABaseError` naming it when its LoRA base
            run is gone or changed.
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    if (Path(run_dir) / SHARDED_NAME).is_dir() or not path.is_file():
        path = find_checkpoint(run_dir)  # the newer of the two; names both when neither is there
    payload = read_checkpoint(path)
    config = TrainConfig.from_dict(payload["config"])
    model = language_model(config)
    try:
        load_model_state(payload, model, base=base)
    except LoRABaseError as err:
        raise LoRABaseError(f"checkpoint {str(path)!r}: {err}") from err
    except (RuntimeError, KeyError, ValueError) as err:
        raise ValueError(f"checkpoint {str(path)!r} does not match its config "
                         f"({str(err).splitlines()[0]})") from err
    check_finite_model(model, str(path))
    model = model.to(device=torch.device(device), dtype=getattr(torch, config.dtype)).eval()
    return Trained(model=model, config=config, step=int(payload["step"]))


# The most bytes one generate call samples: a larger request is a typo, not a plan.
MAX_NEW_BYTES = 1_000_000


def generate_text(trained: Trained, prompt: str, *, max_new_bytes: int, temperature: float,
                  seed: int = 0) -> str:
    """Sample ``max_new_bytes`` bytes after ``prompt`` (UTF-8); returns the continuation only.

    Raises:
        ValueError: when ``prompt`` is empty, ``max_new_bytes`` is outside
            [0, :data:`MAX_NEW_BYTES`] or ``temperature < 0`` (0 is greedy decoding), or the
            model's probabilities are not finite (outputs that overflow).
    """
    if not prompt:
        raise ValueError("--prompt must hold at least one character, got ''")
    if not 0 <= max_new_bytes <= MAX_NEW_BYTES:
        raise ValueError(f"--max-new-bytes must be in [0, {MAX_NEW_BYTES}], got {max_new_bytes}")
    if not temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy decoding), got {temperature}")
    device = next(trained.model.parameters()).device
    prompt_1Q = encode(prompt)[None].to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    try:
        ids = trained.model.generate(prompt_1Q, max_new_bytes, temperature=temperature,
                                     generator=gen)
    except RuntimeError as err:  # torch.multinomial on NaN/inf probabilities
        if "probability tensor" not in str(err):
            raise
        raise ValueError(f"the checkpoint of step {trained.step} gives non-finite "
                         f"probabilities: its weights are finite but its outputs overflow (the "
                         f"run was diverging); use an earlier checkpoint or train with a lower "
                         f"--lr") from err
    return decode(ids[0, prompt_1Q.shape[1]:].cpu())


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Validation loss of a checkpoint on a text's validation split.

    Attributes:
        val_loss: mean cross-entropy, nats/byte.
        bits_per_byte: the same in bits/byte.
        unigram_entropy: byte-unigram entropy of the split, nats/byte (the baseline).
        description: the text evaluated.
    """

    val_loss: float
    bits_per_byte: float
    unigram_entropy: float
    description: str


def evaluate_text(trained: Trained, data: str | None = None) -> Evaluation:
    """Validation loss on the last ``val_fraction`` of ``data`` (default: the run's own data).

    Uses the run's ``val_fraction``, ``seq_len``, ``batch_size`` and ``eval_batches``, so on the
    run's own data it repeats the training's final validation.

    Raises:
        ValueError: on a missing, empty, binary or too short text (naming the path), or a
            non-finite loss (outputs that overflow).
    """
    config = trained.config
    corpus = ByteCorpus.load(data if data is not None else config.data,
                             val_fraction=config.val_fraction, seq_len=config.seq_len,
                             settings_from="the run's checkpoint")
    batches = val_batches(corpus.val_ids, num_batches=config.eval_batches,
                          batch_size=config.batch_size, seq_len=config.seq_len)
    device = next(trained.model.parameters()).device
    loss = evaluate(trained.model, batches, device)
    trained.model.eval()
    if not math.isfinite(loss):
        raise ValueError(f"the validation loss of the checkpoint of step {trained.step} is "
                         f"{loss}: its weights are finite but its outputs overflow (the run was "
                         f"diverging); use an earlier checkpoint or train with a lower --lr")
    return Evaluation(val_loss=loss, bits_per_byte=nats_to_bits(loss),
                      unigram_entropy=unigram_entropy(corpus.val_ids),
                      description=corpus.description)


def export_safetensors(trained: Trained, path: str | os.PathLike[str]) -> list[Path]:
    """Write the weights to ``path`` (safetensors) and the model config to ``<stem>_config.json``.

    The file's metadata holds ``format`` (``memfine-model-v1``), ``model_config`` (JSON of
    :class:`memfine.config.ModelConfig`), ``dtype`` and ``step``. Both files are written to a
    temporary name and renamed.

    Returns:
        The written paths.

    Raises:
        ImportError: naming the extra when ``safetensors`` is missing (nothing is written).
    """
    save_file = require("safetensors.torch").save_file
    path = Path(path)
    config_json = json.dumps(trained.config.model.to_dict(), indent=2)
    metadata = {"format": EXPORT_FORMAT, "model_config": config_json,
                "dtype": trained.config.dtype, "step": str(trained.step)}
    tensors = {k: v.detach().cpu().contiguous() for k, v in trained.model.state_dict().items()}
    config_path = path.with_name(f"{path.stem}_config.json")
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    atomic_write(config_path,
                 lambda tmp: Path(tmp).write_text(config_json + "\n", encoding="utf-8"))
    return [path, config_path]


def load_safetensors(path: str | os.PathLike[str]) -> MoETransformerLM:
    """Rebuild a model written by :func:`export_safetensors` (CPU, the exported dtype).

    Raises:
        ValueError: when the file is not a memfine export.
    """
    safe_open = require("safetensors").safe_open
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != EXPORT_FORMAT:
            raise ValueError(f"{str(path)!r} is not a {EXPORT_FORMAT} file")
        state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
    model = MoETransformerLM(ModelConfig.from_dict(json.loads(metadata["model_config"])))
    model = model.to(dtype=getattr(torch, metadata["dtype"]))
    model.load_state_dict(state)
    return model.eval()


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call ``write(tmp_name)`` and rename the result to ``path`` (0644 like other files).

    Raises:
        OSError: naming ``path`` (not the temporary file, which is removed) when the folder
            cannot be written or the write fails (a full disk, a file-size limit).
    """
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise OSError(err.errno, f"cannot create a file in {str(path.parent)!r} "
                                 f"({err.strerror})", str(path)) from err
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(err.errno, f"writing {str(path)!r} failed ({err.strerror or err}); "
                                 f"nothing was written there", str(path)) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
