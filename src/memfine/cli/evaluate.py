"""``memfine eval``: validation loss and bits/byte of a training run's checkpoint on any text."""

from __future__ import annotations

import argparse
import json

from memfine.flags.checkpoint import DEVICE_FLAG, OUT_FLAG, load_run
from memfine.flags.table import Flag, NotGiven, add_flags, value
from memfine.flags.threads import THREADS_FLAG
from memfine.flags.values import text_flag
from memfine.inference.trained import evaluate_text

_FLAGS = (
    OUT_FLAG,
    Flag("--data", (), "'pydoc', 'stdlib' or a path to a text file or directory; its last "
         "val_fraction is evaluated, as in training", text_flag,
         default=NotGiven(text="the run's own data")),
    DEVICE_FLAG,
    THREADS_FLAG,
    Flag("--json", (), "print one JSON object", action="store_true", default=NotGiven(False)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine eval`` flags."""
    add_flags(parser, _FLAGS)


def run(args: argparse.Namespace) -> int:
    """Print the validation loss (nats/byte and bits/byte) and the unigram baseline; returns 0.

    Raises:
        ValueError: when ``--out`` is missing, the checkpoint is missing or corrupt, or the text
            is missing, empty, binary or too short.
    """
    trained = load_run(args)
    result = evaluate_text(trained, value(args, "data"))
    if value(args, "json"):
        print(json.dumps({"step": trained.step, "data": result.description,
                          "val_loss_nats_per_byte": result.val_loss,
                          "val_loss_bits_per_byte": result.bits_per_byte,
                          "unigram_entropy_nats_per_byte": result.unigram_entropy}))
    else:
        print(f"checkpoint of step {trained.step} on {result.description}: validation loss "
              f"{result.val_loss:.4f} nats/byte = {result.bits_per_byte:.4f} bits/byte "
              f"(unigram entropy {result.unigram_entropy:.4f} nats/byte)")
    return 0
