"""What a training run reads and writes.

Modules: ``rundir`` (safe run directories, the lock), ``checkpoint`` (atomic single-file and
sharded DCP checkpoints, read back checked), ``restore`` (their states into a whole or sharded
model and optimizer), ``weights`` (a checkpoint's weights into a model:
``--init-from``, a LoRA run's base), ``lora_base`` (the base a LoRA run keeps). What is done with
a checkpoint afterwards (generate, evaluate, export) is :mod:`memfine.inference`; what a run
reports (metrics, memory log, progress, evaluation) is :mod:`memfine.reports`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
