"""torchtitan's real trainer (``torchtitan.trainer.Trainer``) on a CPU, for tests and benchmarks.

torchtitan 0.3.0 targets accelerators; its trainer runs on a CPU-only torch after these shims,
which live here (test harness), not in memfine:

- device: ``torchtitan.tools.utils`` falls back to ``"cuda"`` without an accelerator; the modules
  that read its ``device_type`` / ``device_module`` get ``"cpu"`` / ``torch.cpu`` (the process
  group backend then follows torch's map: gloo);
- process-group timeouts: torchtitan shortens them after the first step with
  ``torch.distributed.set_timeout``, which the CPU build lacks; skipped (one process);
- attention: flex attention has no CPU backward, so a torchtitan override (this module's
  ``causal_sdpa``, activated like any ``--override.imports`` entry) swaps every
  ``FlexAttention.Config`` for torchtitan's causal ``ScaledDotProductAttention.Config``;
- assets: torchtitan's debug configs read ``./tests/assets/tokenizer`` and the ``c4_test`` data
  set from its source tree, which the wheel lacks. :func:`write_assets` writes a byte-level BPE
  tokenizer and a c4-style JSON data set made from Python's own ``pydoc_data.topics`` (shipped
  with every CPython): no downloads.

Run as a script (one process, one gloo group of size 1, the runs one after the other)::

    python tests/integrations/torchtitan_trainer.py RUNS_JSON OUT_JSON

``RUNS_JSON`` is a list of ``{"name", "config", "args"}``: ``config`` a ``--module:--config`` pair,
``args`` torchtitan command-line arguments. ``OUT_JSON`` receives per run the losses of each step
and, when ``"profile": true``, the peak bytes of the training steps from ``torch.profiler``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
SDPA_OVERRIDE = "torchtitan_trainer.causal_sdpa"
MEMFINE_OVERRIDE = "memfine.integrations.torchtitan_modules.memfine_experts"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _register_sdpa_override() -> None:
    from torchtitan.config import override
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    @override(target=FlexAttention.Config, description="causal SDPA (CPU test harness)")
    def causal_sdpa(cfg: Any) -> Any:
        return ScaledDotProductAttention.Config()

    globals()["causal_sdpa"] = causal_sdpa


class _CpuDeviceModule:
    """``torch.cpu`` plus what torchtitan reads from a CUDA-like device module: an integer
    ``current_device`` (its barrier's ``device_ids``) and no memory statistics (the metrics line
    shows -1 GiB; memory is measured with ``torch.profiler`` instead)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: Any = None) -> Any:
        import types

        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE")
                                     * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None


def _no_pg_timeouts(**kwargs: Any) -> None:
    return None


def apply_cpu_shims() -> None:
    """Point torchtitan's device globals at the CPU (gloo follows) and register the override."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as utils

    for module in (utils, metrics, dist_utils, token_dispatcher, parallel_dims):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CpuDeviceModule()
    # after the first step torchtitan shortens every group's timeout (torch.distributed
    # .set_timeout, absent from the CPU build); one process on gloo has nothing to time out
    dist_utils.set_pg_timeouts = _no_pg_timeouts
    if "causal_sdpa" not in globals():
        _register_sdpa_override()


def write_assets(root: Path, vocab_size: int = 1024) -> dict[str, str]:
    """Tokenizer (byte-level BPE) and c4-style data set from ``pydoc_data.topics``.

    Returns:
        ``{"tokenizer": dir, "dataset": dir}``.
    """
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [text for _, text in sorted(topics.items())]
    data_dir, tok_dir = root / "c4_test", root / "tokenizer"
    data_dir.mkdir(parents=True, exist_ok=True)
    tok_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "train.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}))
    return {"tokenizer": str(tok_dir), "dataset": str(data_dir)}


# Test size: torchtitan's qwen3 ``debugmodel_moe`` (8 layers, d = 256, n = 768, E = 64, k = 8)
# with its first SMALL_LAYERS layers and n = SMALL_HIDDEN, so that a step takes seconds on a CPU.
# Learning rate SMALL_LR (the config's: 3e-4): Adam's first updates are about lr · sign(g), so
# where a gradient is near zero the bf16 rounding of either experts implementation (torchtitan's
# grouped GEMMs, or memfine's under torchtitan's bf16 autocast) flips a sign and moves the weight
# by up to 2 · lr; the loss differences after a step scale with lr.
SMALL_LAYERS, SMALL_HIDDEN, SMALL_LR = 2, 128, 1e-4


def _small(config: Any) -> Any:
    from torchtitan.components.optimizer import default_adamw

    config.optimizer = default_adamw(lr=SMALL_LR)
    model = config.model_spec.model
    model.layers = model.layers[:SMALL_LAYERS]
    for layer in model.layers:
        layer.moe.routed_experts.inner_experts.hidden_dim = SMALL_HIDDEN
    return config


def qwen3_moe_small() -> Any:
    """torchtitan's ``qwen3_moe_debug`` at test size, torchtitan's own experts."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    return _small(qwen3_moe_debug())


def qwen3_moe_small_memfine() -> Any:
    """memfine's ``qwen3_moe_debug`` config function at test size."""
    from memfine.integrations.torchtitan_configs import qwen3_moe_debug

    return _small(qwen3_moe_debug())


SMALL_BATCH, SMALL_SEQ, SMALL_DIM, SMALL_EXPERTS, SMALL_TOP_K = 2, 128, 256, 64, 8
SMALL_TOKENS = SMALL_BATCH * SMALL_SEQ
SMALL_DTYPE_BYTES = 4  # --training.mixed_precision_param float32: no bf16 autocast
SMALL_CONFIGS = {"torchtitan": "torchtitan_trainer:qwen3_moe_small",
                 "memfine": "torchtitan_trainer:qwen3_moe_small_memfine"}


def small_policy(**chunk: Any) -> Any:
    """A fresh :class:`memfine.schedule.ChunkPolicy` of one test-size block (fp32 SwiGLU).

    ``chunk``: :class:`memfine.config.ChunkConfig` fields (default: a fixed c = 1).
    """
    from memfine.config import ChunkConfig, MoEConfig
    from memfine.schedule.policy import ChunkPolicy

    moe = MoEConfig(hidden_size=SMALL_DIM, intermediate_size=SMALL_HIDDEN,
                    num_experts=SMALL_EXPERTS, top_k=SMALL_TOP_K, renormalize=False,
                    activation="swiglu")
    return ChunkPolicy(ChunkConfig(**chunk), moe)


def small_peak(num_chunks: int, num_tokens: int = SMALL_TOKENS, /, **chunk: Any) -> int:
    """The exact predicted peak of one test-size block at T tokens (s'' = T·k), c chunks, fp32."""
    return int(small_policy(**chunk).predicted_peak(num_tokens * SMALL_TOP_K, num_tokens,
                                                    SMALL_DTYPE_BYTES, num_chunks))


def budget_for_chunks(num_chunks: int, num_tokens: int = SMALL_TOKENS) -> int:
    """The exact peak at c under a budget: MACT picks c when the smaller bins exceed it.

    Raises:
        ValueError: if a smaller bin also meets it (MACT would not pick ``num_chunks``).
    """
    budget = small_peak(num_chunks, num_tokens, memory_budget_bytes=1)
    smaller = [c for c in (1, 2, 4, 8) if c < num_chunks
               and small_peak(c, num_tokens, memory_budget_bytes=1) <= budget]
    if smaller:
        raise ValueError(f"bins {smaller} also meet {budget} bytes at T={num_tokens}")
    return budget


def small_runs(workdir: Path, methods: dict[str, str | None], *, steps: int = 3,
               profile: bool = False, batch: int = SMALL_BATCH, seq_len: int = SMALL_SEQ
               ) -> list[dict[str, Any]]:
    """Run specs at test size: ``methods`` maps a name to memfine's override options (JSON)
    or ``None``; the name ``torchtitan`` runs torchtitan's experts. Assets go to ``workdir``."""
    assets = write_assets(workdir)
    common = ["--hf_assets_path", assets["tokenizer"],
              "--dataloader.dataset_path", assets["dataset"],
              "--training.steps", str(steps), "--training.local_batch_size", str(batch),
              "--training.seq_len", str(seq_len),
              "--training.mixed_precision_param", "float32",
              "--debug.seed", "0", "--checkpoint.no-enable", "--metrics.log_freq", "1",
              "--dump_folder", str(workdir / "outputs")]
    runs = []
    for name, options in methods.items():
        overrides = [SDPA_OVERRIDE] + ([f"{MEMFINE_OVERRIDE}={options}"] if options else [])
        config = SMALL_CONFIGS["torchtitan" if name == "torchtitan" else "memfine"]
        runs.append({"name": name, "config": config, "profile": profile,
                     "args": [*common, "--override.imports", *overrides]})
    return runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(module: str, config: str, args: list[str], *, profile: bool = False
          ) -> dict[str, Any]:
    """Build torchtitan's ``Trainer`` from ``--module``/``--config`` + ``args`` and train.

    Returns:
        ``{"losses": [loss of step 1, ...], "peak_bytes": int | None, "budgets": {...},
        "decisions": {...}}``; the peak is that of the training loop (``Trainer.train``: every
        step's forward, backward and optimizer step) from ``torch.profiler``'s allocator
        events; budgets and decisions are memfine's per block (empty without memfine).
    """
    from torchtitan.config import ConfigManager

    from memfine.integrations.torchtitan_budget import budget_report, last_decisions
    from memfine.measure.profiled import ProfiledPeakMemory

    cfg = ConfigManager().parse_args(["--module", module, "--config", config, *args])
    trainer = cfg.build()
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def record(step: int, global_avg_loss: float, *rest: Any, **kwargs: Any) -> Any:
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *rest, **kwargs)

    trainer.metrics_processor.log = record
    peak = None
    try:
        if profile:
            with ProfiledPeakMemory() as prof:
                trainer.train()
            peak = prof.peak_bytes
        else:
            trainer.train()
    finally:
        trainer.close()
    model = trainer.model_parts[0]
    return {"losses": losses, "peak_bytes": peak,
            "budgets": {k: asdict(v) for k, v in budget_report(model).items() if v},
            "decisions": {k: asdict(v) for k, v in last_decisions(model).items() if v}}


def run_in_subprocess(runs: list[dict[str, Any]], workdir: Path, *, timeout_s: float = 900
                      ) -> dict[str, dict[str, Any]]:
    """Run ``runs`` in one fresh process (one gloo group of size 1); results by run name.

    ``timeout_s`` is a base scaled for a loaded machine (``tests/timeouts.py``).
    """
    runs_path, out_path = workdir / "runs.json", workdir / "out.json"
    runs_path.write_text(json.dumps(runs))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(workdir / "hf_cache"), HF_HOME=str(workdir / "hf_home"),
               PYTHONPATH=os.pathsep.join([str(HERE.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    import timeouts  # tests/ (the test process only; this file also runs as the child)

    proc = timeouts.run([sys.executable, str(HERE), str(runs_path), str(out_path)], timeout_s,
                        cwd=workdir, env=env, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchtitan trainer failed ({proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out_path.read_text())


def main(runs_path: str, out_path: str) -> None:
    apply_cpu_shims()
    runs = json.loads(Path(runs_path).read_text())
    results = {}
    for run in runs:
        module, config = run["config"].split(":")
        results[run["name"]] = train(module, config, run["args"],
                                     profile=run.get("profile", False))
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    import torchtitan_trainer  # the override must be registered under this module's name

    torchtitan_trainer.main(*sys.argv[1:3])
