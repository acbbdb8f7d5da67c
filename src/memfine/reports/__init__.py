"""What a training run reports while and after it runs.

Modules: ``metrics`` (``metrics.jsonl``, expert load, plots), ``memory_log`` (measured and
predicted bytes per step), ``outputs`` (progress bar, TensorBoard, plots), ``evaluation``
(validation loss, a sample).
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
