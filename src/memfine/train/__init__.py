"""Training of the small byte-level MoE language model on real text (``memfine train``).

Modules: ``data`` (corpora, byte tokenizer, split, batches), ``setup`` (resume rules, data, model,
optimizer), ``loop`` (:func:`train`: step, log, evaluate, checkpoint, finish), ``parallel`` (the
``ParallelTraining`` protocol), ``rundir`` (safe run directories, the lock), ``stop`` (SIGINT and
SIGTERM), ``optim`` (AdamW, LR schedule), ``checkpoint`` (atomic save, checked load),
``metrics`` (``metrics.jsonl``, expert load, plots), ``memory_log`` (measured and predicted
bytes), ``outputs`` (progress bar, TensorBoard, plots), ``evaluation`` (validation loss, sample),
``inference`` (generate, eval, export), ``presets`` (``tiny``, ``small``).
"""

from memfine.train.checkpoint import load_checkpoint, save_checkpoint
from memfine.train.data import ByteCorpus, decode, encode, load_corpus, unigram_entropy
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
