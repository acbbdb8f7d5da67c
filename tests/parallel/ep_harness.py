"""Spawn a few gloo processes on 127.0.0.1 and collect per-scenario results (tests only).

Each child initialises the default process group (gloo, a short collective timeout), runs a
``target(rank, world_size, *args) -> dict[scenario, outcome]`` and writes the dict as JSON. An
outcome is ``"ok"``, a value to compare across ranks, or ``{"error": traceback}``. A child that
dies, or a run that exceeds its deadline, fails the calling test with the child's traceback
instead of hanging.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import timeouts

COLLECTIVE_TIMEOUT_S = 60.0  # a stuck collective errors out after this
RUN_DEADLINE_S = 300.0  # the parent kills the children after this (scaled: tests/timeouts.py)

Scenario = Callable[[], Any]
_PARTIAL: dict[str, str] = {}  # in a child: where run_scenarios records results as it goes


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scenarios(scenarios: dict[str, Scenario]) -> dict[str, Any]:
    """Run scenarios in order on this rank; stop after the first one that fails on any rank.

    Every rank must pass the same names in the same order. After each scenario the ranks
    exchange their status, so a failure on one rank skips the rest everywhere (the group may be
    out of step after it) instead of hanging on mismatched collectives.
    """
    results: dict[str, Any] = {}
    failed = False
    for name, fn in scenarios.items():
        if failed:
            results[name] = {"error": "skipped: an earlier scenario failed on some rank"}
            continue
        try:
            value = fn()
            results[name] = "ok" if value is None else value
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        if "path" in _PARTIAL:  # survives a later abort of this process (e.g. gloo mismatch)
            Path(_PARTIAL["path"]).write_text(json.dumps(results), encoding="utf-8")
        flag = torch.tensor([int(isinstance(results[name], dict))])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    return results


def _child(rank: int, world_size: int, port: int, target: Callable[..., dict[str, Any]],
           args: tuple[Any, ...], out_dir: str) -> None:
    torch.set_num_threads(1)
    _PARTIAL["path"] = str(Path(out_dir, f"rank{rank}.partial.json"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeouts.scaled(COLLECTIVE_TIMEOUT_S)))
    try:
        results = target(rank, world_size, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(target: Callable[..., dict[str, Any]], world_size: int, out_dir: str | os.PathLike[str],
          *args: Any) -> list[dict[str, Any]]:
    """Run ``target`` on ``world_size`` spawned gloo ranks; return each rank's result dict.

    Fails the test (``pytest.fail``) with the child's traceback when a child raises or exits
    abnormally, and after :data:`RUN_DEADLINE_S` seconds.
    """
    context = mp.start_processes(_child, args=(world_size, free_port(), target, args,
                                               str(out_dir)),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeouts.scaled(RUN_DEADLINE_S)
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    if proc.is_alive():
                        proc.kill()
                pytest.fail(timeouts.expired_message("distributed run", RUN_DEADLINE_S)
                            + "; children killed")
    except mp.ProcessRaisedException as err:
        pytest.fail(f"a child process raised:\n{err}")
    except mp.ProcessExitedException as err:
        pytest.fail(f"a child process exited abnormally: {err}{_partial_errors(out_dir)}")
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text(encoding="utf-8"))
            for r in range(world_size)]


def _partial_errors(out_dir: str | os.PathLike[str]) -> str:
    """Tracebacks recorded by children before they died (empty when none)."""
    lines = []
    for path in sorted(Path(out_dir).glob("rank*.partial.json")):
        for name, outcome in json.loads(path.read_text(encoding="utf-8")).items():
            if isinstance(outcome, dict) and "error" in outcome:
                lines.append(f"\n{path.name.split('.')[0]}, scenario {name}:\n{outcome['error']}")
    return "".join(lines)


def check_outcome(per_rank: list[dict[str, Any]], name: str) -> list[Any]:
    """Fail with the first rank's traceback when scenario ``name`` failed; return the values."""
    for rank, results in enumerate(per_rank):
        outcome = results.get(name, {"error": "scenario did not run"})
        if isinstance(outcome, dict) and "error" in outcome:
            pytest.fail(f"rank {rank}, scenario {name}:\n{outcome['error']}")
    return [results[name] for results in per_rank]
