"""The environment a result file records (memfine.environment)."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

import torch

import timeouts
from memfine import environment
from memfine.bench.results import collect_environment as bench_collect_environment
from memfine.environment import collect_environment


def test_environment_fields() -> None:
    env = collect_environment("cpu")
    assert (env.device, env.threads, env.torch_version) == (
        "cpu", torch.get_num_threads(), torch.__version__)
    stamp = datetime.datetime.fromisoformat(env.utc_timestamp)
    assert stamp.utcoffset() == datetime.timedelta(0)
    assert env.memfine_version and env.git_sha and env.cpu_model
    assert env.torch_version in env.line()
    assert bench_collect_environment is collect_environment  # benchmarks import it from there


def test_git_sha_is_the_checkout_commit() -> None:
    here = Path(environment.__file__).resolve().parent  # the installed package's checkout
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, text=True,
                              capture_output=True, check=True,
                              timeout=timeouts.scaled(10)).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = "unknown"
    assert collect_environment().git_sha.removesuffix("-dirty") == head
