"""Corpora, byte tokenizer, split, batches and the unigram baseline (memfine.data)."""

from __future__ import annotations

import math
import os
import random
import string
from pathlib import Path

import pytest
import torch

from memfine import data
from memfine.data import (
    ByteCorpus,
    decode,
    encode,
    load_corpus,
    looks_binary,
    train_batch,
    unigram_entropy,
    val_batches,
)

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).encode()


def test_encode_decode_round_trip_utf8() -> None:
    text = "naïve café → π ≈ 3.14\n\tdef f(): return 1"
    ids = encode(text)
    assert ids.dtype == torch.int64
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text


@pytest.mark.parametrize(("raw", "expected"), [
    pytest.param(b"aaaa", 0.0, id="one_symbol"),
    pytest.param(b"aabb", math.log(2), id="two_equal"),
    pytest.param(b"abcd" * 5, math.log(4), id="four_equal"),
    pytest.param(b"aaab", -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), id="skewed"),
])
def test_unigram_entropy_known_values(raw: bytes, expected: float) -> None:
    assert unigram_entropy(encode(raw)) == pytest.approx(expected, abs=1e-12)


def test_unigram_entropy_rejects_empty() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        unigram_entropy(torch.zeros(0, dtype=torch.int64))


def test_split_is_deterministic_and_val_is_the_tail() -> None:
    # Non-periodic text, so a split taken from anywhere but the tail would differ.
    rng = random.Random(0)
    text = "".join(rng.choice(string.ascii_letters + " .\n") for _ in range(1800)).encode()
    a = ByteCorpus.from_bytes(text, val_fraction=0.1, seq_len=16)
    b = ByteCorpus.from_bytes(text, val_fraction=0.1, seq_len=16)
    n_val = math.ceil(0.1 * len(text))
    assert a.val_ids.numel() == n_val
    assert torch.equal(a.val_ids, b.val_ids) and torch.equal(a.train_ids, b.train_ids)
    assert torch.equal(a.val_ids, encode(text[-n_val:]))
    assert torch.equal(torch.cat([a.train_ids, a.val_ids]), encode(text))


def test_split_rejects_corpus_too_small() -> None:
    with pytest.raises(ValueError, match=r"500 bytes are too few for --seq-len 64 and "
                                         r"--val-fraction 0.05: its validation part \(the last 25 "
                                         r"bytes\) holds less than one window of 65 bytes; give "
                                         r"--val-fraction between 0.13 and 0.87, or at least 1300 "
                                         r"bytes"):
        ByteCorpus.from_bytes(b"x" * 500, val_fraction=0.05, seq_len=64)


def test_train_batch_is_a_pure_function_of_seed_and_step() -> None:
    ids = encode(TEXT)
    x1, y1 = train_batch(ids, batch_size=4, seq_len=8, seed=3, step=7)
    torch.manual_seed(123)  # the global RNG plays no part
    x2, y2 = train_batch(ids, batch_size=4, seq_len=8, seed=3, step=7)
    x3, _ = train_batch(ids, batch_size=4, seq_len=8, seed=3, step=8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one byte


def test_val_batches_are_fixed_windows_covering_the_split() -> None:
    ids = torch.arange(100) % 256
    batches = val_batches(ids, num_batches=2, batch_size=3, seq_len=10)
    starts = [int(x[i, 0]) for x, _ in batches for i in range(x.shape[0])]
    assert len(starts) == 2 * data.VAL_WINDOWS_PER_BATCH
    assert starts[0] == 0 and starts[-1] == 100 - 10 - 1
    assert starts == sorted(starts)
    assert [x.shape[0] for x, _ in batches] == [3, 3, 3, 3, 3, 1]
    for x, y in batches:
        assert x.shape == y.shape and x.shape[1] == 10
        assert torch.equal(y, x + 1)


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8, 32])
def test_val_windows_do_not_depend_on_the_batch_size(batch_size: int) -> None:
    """The validation set is fixed by the data: other batch sizes only cut it differently."""
    ids = torch.arange(5000) % 251
    want = torch.cat([x for x, _ in val_batches(ids, num_batches=3, batch_size=8, seq_len=16)])
    got = val_batches(ids, num_batches=3, batch_size=batch_size, seq_len=16)
    assert all(x.shape[0] <= batch_size for x, _ in got)
    assert torch.equal(torch.cat([x for x, _ in got]), want)


def test_pydoc_corpus_is_text() -> None:
    raw, description = load_corpus("pydoc")
    assert len(raw) > 100_000 and not looks_binary(raw)
    assert b"assert" in raw and "topics.py" in description


@pytest.mark.parametrize(("content", "match"), [
    pytest.param(b"", "is empty", id="empty_file"),
    pytest.param(bytes(range(256)) * 8, "does not look like text", id="binary_file"),
])
def test_bad_data_file_names_the_path(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as info:
        load_corpus(str(path))
    assert str(path) in str(info.value)


def test_missing_data_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="does not exist") as info:
        load_corpus(str(missing))
    assert str(missing) in str(info.value)


def test_directory_corpus_sorted_text_files_binary_and_empty_named(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_bytes(b"third")
    (tmp_path / "img.bin").write_bytes(b"\x00\x01\x02" * 10)
    (tmp_path / ".hidden").write_bytes(b"hidden")
    (tmp_path / "empty.txt").write_bytes(b"")
    raw, description = load_corpus(str(tmp_path))
    assert raw == b"first\nsecond\nthird"
    assert description.endswith("3 text file(s) under "
                                 f"{tmp_path}; skipped 2 file(s): empty.txt (empty), img.bin "
                                 "(binary)")


def test_directory_without_text_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "img.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="holds no non-empty text file") as info:
        load_corpus(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def _fifo(path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("where", ["alone", "in_directory"])
def test_data_reads_regular_files_only(tmp_path: Path, where: str) -> None:
    """A FIFO would block forever and a device such as /dev/zero never ends: both refused."""
    (tmp_path / "a.txt").write_bytes(b"text " * 100)
    fifo = _fifo(tmp_path / "pipe.txt")
    source = fifo if where == "alone" else tmp_path
    with pytest.raises(ValueError, match="is not a regular file") as info:
        load_corpus(str(source))  # returns at once: the FIFO is never opened
    assert str(fifo) in str(info.value)
    if Path("/dev/zero").exists():
        with pytest.raises(ValueError, match="'/dev/zero' is not a regular file"):
            load_corpus("/dev/zero")


@pytest.mark.parametrize("where", ["alone", "in_directory"])
def test_data_size_limit_names_the_path(tmp_path: Path, where: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "MAX_DATA_BYTES", 1000)
    (tmp_path / "a.txt").write_bytes(b"x" * 600)
    (tmp_path / "b.txt").write_bytes(b"y" * 600)
    source = tmp_path / "a.txt" if where == "alone" else tmp_path
    if where == "alone":
        assert load_corpus(str(source))[0] == b"x" * 600  # under the limit: read
        (tmp_path / "a.txt").write_bytes(b"x" * 1001)
    with pytest.raises(ValueError, match=r"holds more than 1000 bytes, the --data limit") as info:
        load_corpus(str(source))
    assert str(source) in str(info.value)
