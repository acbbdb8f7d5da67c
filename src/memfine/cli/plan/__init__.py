"""``memfine plan``: the command (flags, validation, the plan) and its text output."""

from memfine.cli.plan.command import PRESETS, add_arguments, resolve, run

__all__ = ["PRESETS", "add_arguments", "resolve", "run"]
