"""``memfine generate``: continue a prompt with the model of a training run's checkpoint."""

from __future__ import annotations

import argparse

from memfine.flags.checkpoint import DEVICE_FLAG, OUT_FLAG, load_run, run_directory
from memfine.flags.table import Flag, NotGiven, add_flags, value
from memfine.flags.threads import THREADS_FLAG
from memfine.flags.values import finite_float
from memfine.inference.trained import generate_text

_FLAGS = (
    OUT_FLAG,
    Flag("--prompt", (), "text to continue (UTF-8)", str, default=NotGiven(text="required")),
    Flag("--max-new-bytes", (), "bytes to generate after the prompt", default=NotGiven(300)),
    Flag("--temperature", (), "sampling temperature, >= 0; 0 is greedy decoding (the most "
         "likely byte each time)", finite_float, default=NotGiven(0.8)),
    Flag("--seed", (), "seed of the sampling", default=NotGiven(0)),
    DEVICE_FLAG,
    THREADS_FLAG,
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
    run_directory(args)  # a missing --out is named before a missing --prompt
    if value(args, "prompt") is None:
        raise ValueError("--prompt is required: the text to continue")
    prompt = _utf8_prompt(value(args, "prompt"))
    trained = load_run(args)
    text = generate_text(trained, prompt, max_new_bytes=value(args, "max_new_bytes"),
                         temperature=value(args, "temperature"), seed=value(args, "seed"))
    print(prompt + text)
    return 0


def _utf8_prompt(prompt: str) -> str:
    """``prompt`` when it is UTF-8 text.

    An argument that is not valid UTF-8 reaches Python with its bytes as surrogate escapes
    (U+DCFF for byte 0xff), which cannot be encoded for the model or printed.

    Raises:
        ValueError: naming ``--prompt``, the first byte that is no UTF-8 and its position.
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(prompt[err.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise ValueError(f"--prompt must be UTF-8 text; it holds {byte} at character "
                         f"{err.start}, which is not (convert the text to UTF-8, e.g. with "
                         f"iconv)") from None
    return prompt
