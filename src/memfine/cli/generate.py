"""``memfine generate``: continue a prompt with the model of a training run's checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from memfine.cli._flags import (
    Flag,
    NotGiven,
    add_flags,
    check_device,
    run_directory,
    value,
)
from memfine.runs.inference import generate_text, load_trained

_FLAGS = (
    Flag("--out", (), "run directory of memfine train (reads its checkpoint.pt)", Path,
         default=NotGiven(text="required")),
    Flag("--prompt", (), "text to continue (UTF-8)", str, default=NotGiven(text="required")),
    Flag("--max-new-bytes", (), "bytes to generate after the prompt", default=NotGiven(300)),
    Flag("--temperature", (), "sampling temperature, > 0", float, default=NotGiven(0.8)),
    Flag("--seed", (), "seed of the sampling", default=NotGiven(0)),
    Flag("--device", (), "torch device: cpu or cuda[:i]", str, default=NotGiven("cpu")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine generate`` flags."""
    add_flags(parser, _FLAGS)


def run(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation; returns 0.

    Raises:
        ValueError: when ``--out`` or ``--prompt`` is missing, the checkpoint is missing or
            corrupt, or a value is out of range.
    """
    out = run_directory(args)
    if value(args, "prompt") is None:
        raise ValueError("--prompt is required: the text to continue")
    trained = load_trained(out, device=check_device(value(args, "device")))
    prompt = value(args, "prompt")
    text = generate_text(trained, prompt, max_new_bytes=value(args, "max_new_bytes"),
                         temperature=value(args, "temperature"), seed=value(args, "seed"))
    print(prompt + text)
    return 0
