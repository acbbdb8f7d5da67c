"""The optional outputs of a training run: progress bar, experiment tracker, plots.

Each is checked before the run writes anything (:meth:`Outputs.check`): a missing plotting or
tracker package (TensorBoard, trackio, wandb) stops the run with the extra to install; a missing
progress-bar package only turns the bar off. ``metrics.jsonl`` stays the source of truth; the
tracker gets the same scalars (:mod:`memfine.reports.trackers`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfine._optional import is_available, require
from memfine.config import TrainConfig
from memfine.reports.metrics import METRICS_NAME, MetricsLog
from memfine.reports.trackers import check_tracker, open_tracker


@dataclass(frozen=True, slots=True)
class Outputs:
    """The optional outputs of a run, checked before anything is written.

    Attributes:
        progress: show a tqdm progress bar (without tqdm installed: none, with a note); None:
            only when stderr is a terminal (tqdm's ``disable=None``), not into a piped log.
        tracker: also send the logged scalars to this tracker (``tensorboard``, ``trackio``,
            ``wandb``; :mod:`memfine.reports.trackers`), or None.
        plot: write ``loss.png`` and ``chunks.png`` at the end (needs matplotlib).
    """

    progress: bool | None = True
    tracker: str | None = None
    plot: bool = False

    def check(self) -> Outputs:
        """Return the outputs this environment can give.

        Raises:
            ValueError: ``tracker`` is not a known tracker.
            ImportError: naming the extra to install when ``plot`` or ``tracker`` is asked
                for and its package is missing (before the run writes anything).
        """
        if self.plot:
            require("matplotlib")
        if self.tracker is not None:
            check_tracker(self.tracker)
        if self.progress is not False and not is_available("tqdm"):
            print("note: no progress bar (tqdm is not installed: pip install 'memfine[train]')")
            return dataclasses.replace(self, progress=False)
        return self

    def open(self, out_dir: Path, config: TrainConfig, *, start: int, resume: bool,
             is_main: bool) -> tuple[MetricsLog | None, Any]:
        """Open ``metrics.jsonl`` (with the tracker) and the progress bar.

        Returns:
            The metrics log and the tqdm bar (None when off); both None off the main rank.
        """
        if not is_main:
            return None, None
        tracker = None
        if self.tracker is not None:
            tracker = open_tracker(self.tracker, out_dir, config=config.to_dict(), start=start)
        log = MetricsLog(out_dir / METRICS_NAME, keep_until_step=start if resume else None,
                         tracker=tracker)
        bar = require("tqdm").tqdm(
            total=config.max_steps, initial=start, unit="step", dynamic_ncols=True,
            mininterval=0.5, disable=None if self.progress is None else False,
        ) if self.progress is not False else None
        return log, bar
