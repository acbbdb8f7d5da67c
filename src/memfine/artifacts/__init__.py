"""What a training run reads and writes, and what can be done with it afterwards.

Modules: ``rundir`` (safe run directories, the lock), ``checkpoint`` (atomic single-file and
sharded DCP checkpoints, checked load), ``adapters`` (a LoRA run's adapters), ``inference``
(``memfine generate``, ``memfine eval``, ``memfine export`` on a checkpoint). What a run reports
(metrics, memory log, progress, evaluation) is :mod:`memfine.reports`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
