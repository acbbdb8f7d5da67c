"""The optional outputs of a training run: progress bar, TensorBoard, plots.

Each is checked before the run writes anything (:meth:`Outputs.check`): a missing plotting or
TensorBoard package stops the run with the extra to install; a missing progress-bar package only
turns the bar off. ``metrics.jsonl`` stays the source of truth; TensorBoard gets the same scalars.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfine._optional import is_available, require
from memfine.config import TrainConfig
from memfine.reports.metrics import METRICS_NAME, MetricsLog


@dataclass(frozen=True, slots=True)
class Outputs:
    """The optional outputs of a run, checked before anything is written.

    Attributes:
        progress: show a tqdm progress bar (without tqdm installed: none, with a note).
        tensorboard: also write TensorBoard scalars to ``out_dir/tensorboard``.
        plot: write ``loss.png`` and ``chunks.png`` at the end (needs matplotlib).
    """

    progress: bool = True
    tensorboard: bool = False
    plot: bool = False

    def check(self) -> Outputs:
        """Return the outputs this environment can give.

        Raises:
            ImportError: naming the extra to install when ``plot`` or ``tensorboard`` is asked
                for and its package is missing (before the run writes anything).
        """
        if self.plot:
            require("matplotlib")
        if self.tensorboard:
            require("tensorboard")
        if self.progress and not is_available("tqdm"):
            print("note: no progress bar (tqdm is not installed: pip install 'memfine[train]')")
            return dataclasses.replace(self, progress=False)
        return self

    def open(self, out_dir: Path, config: TrainConfig, *, start: int, resume: bool,
             is_main: bool) -> tuple[MetricsLog | None, Any]:
        """Open ``metrics.jsonl`` (with the TensorBoard writer) and the progress bar.

        Returns:
            The metrics log and the tqdm bar (None when off); both None off the main rank.
        """
        if not is_main:
            return None, None
        writer = None
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start + 1)
        log = MetricsLog(out_dir / METRICS_NAME, keep_until_step=start if resume else None,
                         tensorboard=writer)
        bar = require("tqdm").tqdm(total=config.max_steps, initial=start, unit="step",
                                   dynamic_ncols=True, mininterval=0.5) if self.progress else None
        return log, bar
