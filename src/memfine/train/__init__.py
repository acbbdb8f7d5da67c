"""Training of the small byte-level MoE language model on real text (``memfine train``).

Modules: ``setup`` (resume rules, data, model,
optimizer), ``loop`` (:func:`train`: the run directory, the loop, finish), ``step`` (one optimizer
step), ``events`` (validate, checkpoint, metrics line, progress), ``parallel`` (the
``ParallelTraining`` protocol), ``execution`` (autocast, one forward), ``stop`` (SIGINT and
SIGTERM), ``optim`` (AdamW, LR schedule), ``presets`` (``tiny``, ``small``). The data lives in
:mod:`memfine.data`; the run directory, checkpoints and metrics in :mod:`memfine.artifacts`.
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
