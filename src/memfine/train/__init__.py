"""Training of the small byte-level MoE language model on real text (``memfine train``).

:func:`train` (``loop``) over ``setup``, ``step``, ``events``, ``accumulation``, ``execution``,
``parallel``, ``divergence``, ``optim`` and ``presets``; the data is :mod:`memfine.data`, the
run directory, checkpoints and metrics :mod:`memfine.artifacts`, stop signals
:mod:`memfine.runtime.stop`.
"""

from memfine.artifacts.checkpoint import load_checkpoint, save_checkpoint
from memfine.data import ByteCorpus, decode, encode, load_corpus, unigram_entropy
from memfine.train.loop import TrainResult, train
from memfine.train.presets import DEFAULT_PRESET, PRESETS, preset

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "ByteCorpus",
    "TrainResult",
    "decode",
    "encode",
    "load_checkpoint",
    "load_corpus",
    "preset",
    "save_checkpoint",
    "train",
    "unigram_entropy",
]
