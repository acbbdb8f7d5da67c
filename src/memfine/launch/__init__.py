"""What ``memfine plan`` prints: a plan's report and the commands that run its layout.

- :mod:`memfine.launch.commands`: ``torchrun ... -m memfine train`` for a data- and
  expert-parallel layout, and torchtitan's trainer with memfine's experts for the presets
  torchtitan has a config of.
- :mod:`memfine.launch.report`: the answer line, the per-stage and per-skew tables, the ranked
  layouts of ``--search`` and the JSON of each.
"""

from memfine.launch.commands import (
    launch_commands,
    launch_lines,
    memfine_train_command,
    torchtitan_command,
)

__all__ = ["launch_commands", "launch_lines", "memfine_train_command", "torchtitan_command"]
