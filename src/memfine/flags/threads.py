"""``--threads``: torch's CPU threads, lowered to the CPUs this process may use."""

from __future__ import annotations

import os
import sys

from memfine.flags.table import Flag, NotGiven

THREADS_FLAG = Flag("--threads", (), "CPU threads for torch; the small models here gain little "
                    "from more, and on a CPU shared with other jobs more threads can be many "
                    "times slower; more than this process's CPUs (shared by the local ranks "
                    "under torchrun) is lowered to them with a warning", default=NotGiven(1))
"""``--threads`` of ``memfine train``, ``generate`` and ``eval`` (default 1)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else ``os.cpu_count()``), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def clamp_threads(threads: int, flag: str = "--threads") -> int:
    """``threads`` at most this process's share of the CPUs, with a one-line warning if lowered.

    ``torch.set_num_threads`` takes any count and oversubscribes the CPUs, which makes every
    operator many times slower; torchrun likewise sets ``OMP_NUM_THREADS`` and warns. The share
    is :func:`usable_cpus` over torchrun's ``LOCAL_WORLD_SIZE`` (the ranks of this host).

    Raises:
        ValueError: naming ``flag`` when ``threads`` is below 1.
    """
    if threads < 1:
        raise ValueError(f"{flag} must be >= 1, got {threads}")
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    share = max(usable_cpus() // local, 1)
    if threads > share:
        ranks = f" shared by {local} local ranks" if local > 1 else ""
        print(f"warning: {flag} {threads} is more than the {share} CPU(s) this process may use"
              f"{ranks}; using {share}", file=sys.stderr)
        return share
    return threads
