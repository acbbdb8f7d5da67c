"""Training text: corpora that ship with Python, a byte-level tokenizer, split and batches.

Legend: B batch, Q sequence length (bytes = tokens), N corpus bytes.

Corpora (``TrainConfig.data``):

* ``pydoc``: ``pydoc_data/topics.py``, the documentation topics behind ``help()`` (English prose
  and code; ≈0.5-0.8 MB depending on the Python version);
* ``stdlib``: the standard library's own ``.py`` sources (≈10 MB; tests, ``idlelib``,
  ``lib2to3`` and ``site-packages`` left out);
* a path: one text file, or a directory whose files are read recursively in sorted order
  (hidden entries are skipped). Only regular files are read (a FIFO, a device such as
  ``/dev/zero`` or a socket stops the load, naming the path), at most :data:`MAX_DATA_BYTES` in
  all. An empty or binary file given alone stops the load naming it; inside a directory it is
  skipped and named in the corpus description.

The tokenizer is the identity on bytes (vocabulary 256): no downloads, no unknown tokens, and a
loss in nats per token is a loss in nats per byte.
"""

from __future__ import annotations

import importlib.util
import math
import os
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
BUILTIN_CORPORA = ("pydoc", "stdlib")
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                          "idlelib", "lib2to3", "__pycache__"})
_BINARY_CONTROL = bytes(b for b in range(32) if b not in b"\t\n\r\f\v\x1b") + b"\x7f"
_MAX_CONTROL_SHARE = 0.05  # text has (almost) no control bytes; random binary ≈ 12%
MAX_DATA_BYTES = 2 * 1024 ** 3
"""The most bytes a ``--data`` path may hold (2 GiB, files of a directory together): the corpus
is held in memory as int64 ids, 8 bytes per byte of text."""


def encode(text: str | bytes) -> torch.Tensor:
    """Byte tokenizer: text (UTF-8) or bytes → (N,) int64 ids in [0, 256)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor) -> str:
    """(N,) integer ids in [0, 256) → text; invalid UTF-8 sequences become U+FFFD."""
    return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def looks_binary(raw: bytes) -> bool:
    """True when ``raw`` holds a NUL byte or more than 5% non-whitespace control bytes."""
    if b"\x00" in raw:
        return True
    if not raw:
        return False
    control = len(raw) - len(raw.translate(None, _BINARY_CONTROL))
    return control / len(raw) > _MAX_CONTROL_SHARE


def pydoc_topics_path() -> Path:
    """Path of ``pydoc_data/topics.py`` in this Python.

    Raises:
        ValueError: if this Python ships without ``pydoc_data``.
    """
    spec = importlib.util.find_spec("pydoc_data")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data 'pydoc': this Python has no pydoc_data package; pass --data PATH")
    return Path(next(iter(spec.submodule_search_locations))) / "topics.py"


def _read_file(path: Path) -> bytes:
    """The bytes of the regular file ``path``, at most the limit; ValueError naming the path."""
    limit = MAX_DATA_BYTES
    try:
        with path.open("rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(_not_regular(path))
            raw = f.read(limit + 1)  # bounded even where st_size is 0 (/proc) or still growing
    except OSError as err:
        raise ValueError(f"--data file {str(path)!r} cannot be read: {err.strerror or err}"
                         ) from err
    if len(raw) > limit:
        raise ValueError(_too_large(path))
    return raw


def _not_regular(path: Path) -> str:
    return (f"--data {str(path)!r} is not a regular file (a FIFO, device or socket); "
            "--data reads text files and directories of them only")


def _too_large(path: Path) -> str:
    return (f"--data {str(path)!r} holds more than {MAX_DATA_BYTES} bytes, the --data limit "
            "(files of a directory together)")


def _check_regular(path: Path) -> int:
    """The size of ``path`` in bytes; ValueError naming it when it is not a regular file.

    Checked before opening: opening a FIFO for reading blocks until a writer appears.
    """
    try:
        info = path.stat()
    except OSError as err:
        raise ValueError(f"--data file {str(path)!r} cannot be read: {err.strerror or err}"
                         ) from err
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(_not_regular(path))
    return info.st_size


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py"))
            if not _STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1])]


def _directory_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    return out


def load_corpus(source: str) -> tuple[bytes, str]:
    """Read a corpus as raw bytes.

    Args:
        source: ``pydoc``, ``stdlib``, or a path to a text file or a directory of text files.

    Returns:
        ``(raw, description)``: the bytes (files joined by a newline, in sorted path order) and
        a one-line description naming where they came from.

    Raises:
        ValueError: naming the path, when it is missing, unreadable, not a regular file (a
            FIFO, a device), larger than :data:`MAX_DATA_BYTES`, empty or binary (a single
            file), or a directory without any non-empty text file.
    """
    if source == "pydoc":
        path = pydoc_topics_path()
        raw = _read_file(path)
        return raw, f"pydoc documentation topics ({path})"
    if source == "stdlib":
        files = _stdlib_sources()
        raw = b"\n".join(_read_file(p) for p in files)
        return raw, f"{len(files)} standard-library sources ({sysconfig.get_paths()['stdlib']})"
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"--data {source!r} does not exist (expected 'pydoc', 'stdlib', "
                         f"a text file or a directory of text files)")
    if path.is_dir():
        files = _directory_files(path)
        total = sum(_check_regular(p) for p in files)  # nothing is opened before all pass
        if total > MAX_DATA_BYTES:
            raise ValueError(_too_large(path))
        texts, skipped = [], []
        for p in files:
            raw = _read_file(p)
            if not raw or looks_binary(raw):
                skipped.append(f"{p.relative_to(path)} ({'empty' if not raw else 'binary'})")
            else:
                texts.append(raw)
        note = _skipped_note(skipped)
        if not texts:
            raise ValueError(f"--data directory {source!r} holds no non-empty text file{note}")
        return b"\n".join(texts), f"{len(texts)} text file(s) under {path}{note}"
    _check_regular(path)
    raw = _read_file(path)
    if not raw:
        raise ValueError(f"--data file {source!r} is empty")
    if looks_binary(raw):
        raise ValueError(f"--data file {source!r} does not look like text (it holds NUL or "
                         f"control bytes); pass a text file")
    return raw, f"text file {path}"


_NAMED_SKIPS = 5


def _skipped_note(skipped: list[str]) -> str:
    """``"; skipped 2 file(s): a.bin (binary), b.txt (empty)"`` (the first few named), or ""."""
    if not skipped:
        return ""
    more = len(skipped) - _NAMED_SKIPS
    named = ", ".join(skipped[:_NAMED_SKIPS]) + (f" and {more} more" if more > 0 else "")
    return f"; skipped {len(skipped)} file(s): {named}"


def unigram_entropy(ids: torch.Tensor) -> float:
    """Byte-frequency (unigram) entropy -Σ p·ln p of a token sequence, in nats per token.

    Args:
        ids: (N,) integer ids in [0, 256), N ≥ 1.

    Returns:
        The entropy in nats (divide by ln 2 for bits); 0.0 for a single repeated byte.

    Raises:
        ValueError: if ``ids`` is empty.
    """
    if ids.numel() == 0:
        raise ValueError("unigram_entropy needs at least one token, got 0")
    counts = torch.bincount(ids.reshape(-1), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return max(0.0, float(-(p * p.log()).sum()))  # one byte: 0.0, not -0.0


@dataclass(frozen=True, slots=True)
class ByteCorpus:
    """A corpus split deterministically into train (first bytes) and validation (last bytes).

    Attributes:
        train_ids: (N_train,) int64 byte ids.
        val_ids: (N_val,) int64 byte ids (the last ``val_fraction`` of the corpus).
        description: where the bytes came from.
    """

    train_ids: torch.Tensor
    val_ids: torch.Tensor
    description: str

    @classmethod
    def from_bytes(cls, raw: bytes, *, val_fraction: float, seq_len: int,
                   description: str = "bytes", settings_from: str | None = None) -> ByteCorpus:
        """Split ``raw``: the last ⌈val_fraction·N⌉ bytes are validation.

        Args:
            raw: the corpus bytes.
            val_fraction: share held out for validation (its last bytes), in (0, 1).
            seq_len: window length in bytes; each part needs one window plus one target byte.
            description: where the bytes came from, for messages.
            settings_from: where ``seq_len`` and ``val_fraction`` come from when they cannot be
                changed (e.g. ``"the run's checkpoint"``); the error then asks only for more
                data. ``None``: they are ``--seq-len`` and ``--val-fraction``, and the error
                also suggests values of those.

        Raises:
            ValueError: if either part is shorter than ``seq_len + 1`` bytes (one window with
                its next-byte targets); the message names the sizes needed.
        """
        ids = encode(raw)
        n_val = math.ceil(val_fraction * ids.numel())
        need = seq_len + 1
        total = ids.numel()
        if n_val < need or total - n_val < need:
            part = (f"its validation part (the last {n_val} bytes)" if n_val < need
                    else f"its training part ({total - n_val} bytes)")
            smallest = max(math.ceil(need / val_fraction), 2 * need)
            more = (f"at least {smallest} bytes" if smallest < 2**63 else "more data")
            if settings_from is not None:
                settings = (f"the seq_len {seq_len} and val_fraction {val_fraction} of "
                            f"{settings_from}")
                fix = f"give a longer --data file ({more})"
            else:
                settings = f"--seq-len {seq_len} and --val-fraction {val_fraction}"
                fix = (f"give --val-fraction between {need / total:.4g} and "
                       f"{(total - need) / total:.4g}, or {more}" if total >= 2 * need
                       else f"give {more} or a shorter --seq-len")
            raise ValueError(f"--data {description}: {total} bytes are too few for {settings}: "
                             f"{part} holds less than one window of {need} bytes; {fix}")
        split = ids.numel() - n_val
        return cls(train_ids=ids[:split], val_ids=ids[split:], description=description)

    @classmethod
    def load(cls, source: str, *, val_fraction: float, seq_len: int,
             settings_from: str | None = None) -> ByteCorpus:
        """:func:`load_corpus` then :meth:`from_bytes` (same arguments and errors)."""
        raw, description = load_corpus(source)
        return cls.from_bytes(raw, val_fraction=val_fraction, seq_len=seq_len,
                              description=description, settings_from=settings_from)


def train_batch(train_ids: torch.Tensor, *, batch_size: int, seq_len: int, seed: int,
                step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a training step: B random windows, a pure function of (seed, step).

    No RNG state is carried between steps, so a resumed run draws exactly the batches a run
    without interruption draws.

    Returns:
        ``(input_ids_BQ, targets_BQ)``, int64; targets are the inputs shifted by one byte.
    """
    gen = torch.Generator().manual_seed((seed << 32) | step)
    starts_B = torch.randint(0, train_ids.numel() - seq_len, (batch_size,), generator=gen)
    return _windows(train_ids, starts_B, seq_len)


VAL_WINDOWS_PER_BATCH = 8
"""Windows in one validation batch (``TrainConfig.eval_batches`` counts these, whatever the
training batch size, so every batch size and layout validates on the same windows)."""


def val_batches(val_ids: torch.Tensor, *, num_batches: int, batch_size: int,
                seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation windows, evenly spaced over the validation split (no randomness).

    The set is ``num_batches × VAL_WINDOWS_PER_BATCH`` windows, fixed by the data, ``seq_len``
    and ``num_batches`` alone; ``batch_size`` only cuts it into micro-batches of at most that
    many rows (the last may be smaller), so the memory of one forward stays that of training.

    Returns:
        Pairs ``(input_ids_BQ, targets_BQ)``, int64, holding every window once.
    """
    count = num_batches * VAL_WINDOWS_PER_BATCH
    starts = torch.linspace(0, val_ids.numel() - seq_len - 1, count).round().to(torch.int64)
    return [_windows(val_ids, starts_B, seq_len) for starts_B in starts.split(batch_size)]


def _windows(ids: torch.Tensor, starts_B: torch.Tensor, seq_len: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    offsets_BQ = starts_B[:, None] + torch.arange(seq_len + 1)
    rows = ids[offsets_BQ]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
