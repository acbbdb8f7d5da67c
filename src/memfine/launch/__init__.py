"""The commands that run a planned layout (``memfine plan`` prints them under its answer).

- :mod:`memfine.launch.commands`: ``torchrun ... -m memfine train`` for a data- and
  expert-parallel layout, and torchtitan's trainer with memfine's experts for the presets
  torchtitan has a config of.
"""

from memfine.launch.commands import (
    launch_commands,
    launch_lines,
    memfine_train_command,
    torchtitan_command,
)

__all__ = ["launch_commands", "launch_lines", "memfine_train_command", "torchtitan_command"]
