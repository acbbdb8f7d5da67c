"""What a training run reads and writes, and what can be done with it afterwards.

Modules: ``rundir`` (safe run directories, the lock), ``checkpoint`` (atomic single-file and
sharded DCP checkpoints, checked load), ``metrics`` (``metrics.jsonl``, expert load, plots),
``memory_log`` (measured and predicted bytes per step), ``outputs`` (progress bar, TensorBoard,
plots), ``evaluation`` (validation loss, a sample), ``inference`` (``memfine generate``,
``memfine eval``, ``memfine export`` on a checkpoint), ``environment`` (the machine and versions a
result file records).
"""
