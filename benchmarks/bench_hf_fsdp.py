"""A transformers MoE model with memfine experts under FSDP2 on 2 gloo ranks vs one process.

A small random Qwen3-MoE language model (fp32, built from a config) is trained for a few AdamW
steps on seeded random token ids, full fine-tune or PEFT LoRA on the experts' 3-D weights
(``target_parameters``, adapters drawn at random, ``init_lora_weights=False``), as a user would
write it: ``fully_shard`` (``torch.distributed.fsdp``, FSDP2) on every decoder layer and on the
model, each rank taking its half of the global batch. Runs per mode:

- ``eager``, one process: the reference (the whole batch);
- ``eager``, 2 ranks: the per-rank peak of eager (+ PEFT) at the same shape;
- ``memfine``, 2 ranks: losses against the reference, per-rank peak against eager's;
- ``memfine_budget``, 2 ranks and one process: ``register(memory_budget=...)``; MACT sees each
  rank's tokens, so a rank picks its chunk count c (and predicts its experts block's peak) for
  half the tokens the one process has at the same budget.

Per run and rank: the global loss of every step (the mean of the ranks' losses, all-reduced),
the peak live bytes of step 2 (``torch.profiler`` with ``profile_memory=True``: unsharded
parameters, activations, gradients, optimizer state created in the step) and, with memfine,
every experts module's chunk count and MACT's predicted experts-block peak
(:func:`memfine.hf.experts.last_decision`). Output: a printed table and a CSV (docs/style.md §6
schema; ``x_value`` = ``mode/world``).

Usage: ``python benchmarks/bench_hf_fsdp.py [--modes full lora] [--steps 4] [--out PATH]``.
Legend: d hidden size, n expert intermediate size, E experts, k top-k, T tokens per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.hf.experts import last_decision
from memfine.integrations.transformers import register
from memfine.measure.profiled import ProfiledPeakMemory

RESULTS = Path(__file__).parent / "results"
_MiB = 1 << 20
SHAPE = {"hidden_size": 64, "moe_intermediate_size": 512, "num_experts": 32, "top_k": 8,
         "layers": 2, "vocab_size": 256, "batch_size": 8, "seq_len": 128, "rank": 8,
         "lr": 1e-3, "seed": 0, "gradient_checkpointing": False}


def build_model(shape: dict[str, Any], impl: str, mode: str) -> torch.nn.Module:
    """The fp32 Qwen3-MoE model of ``shape`` on ``impl`` experts; with PEFT LoRA for ``lora``."""
    import transformers

    d = shape["hidden_size"]
    config = transformers.Qwen3MoeConfig(
        vocab_size=shape["vocab_size"], hidden_size=d, intermediate_size=d,
        num_hidden_layers=shape["layers"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=d // 4, max_position_embeddings=shape["seq_len"],
        moe_intermediate_size=shape["moe_intermediate_size"], num_experts=shape["num_experts"],
        num_experts_per_tok=shape["top_k"], decoder_sparse_step=1, norm_topk_prob=True,
        use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(shape["seed"])
    model = transformers.Qwen3MoeForCausalLM(config).float().train()
    model.set_experts_implementation(impl)
    if shape["gradient_checkpointing"]:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    if mode == "lora":
        import peft

        lora = peft.LoraConfig(r=shape["rank"], lora_alpha=2 * shape["rank"], target_modules=[],
                               target_parameters=["mlp.experts.gate_up_proj",
                                                  "mlp.experts.down_proj"],
                               init_lora_weights=False)
        torch.manual_seed(shape["seed"] + 1)
        model = peft.get_peft_model(model, lora)
    return model


def shard(model: torch.nn.Module) -> None:
    """FSDP2 as users write it: ``fully_shard`` on every decoder layer, then on the model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)


def train_rank(rank: int, world: int, shape: dict[str, Any], impl: str, mode: str,
               steps: int, budget: str | None = None) -> dict[str, Any]:
    """One rank's run: global losses, step-2 peak (bytes), the experts' chunk decisions."""
    register(memory_budget=budget) if budget else register()
    model = build_model(shape, impl, mode)
    if world > 1:
        shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=shape["lr"])
    B, S = shape["batch_size"], shape["seq_len"]
    losses, peak = [], 0
    for step in range(steps):
        ids = torch.randint(0, shape["vocab_size"], (B, S),
                            generator=torch.Generator().manual_seed(shape["seed"] + step))
        local = ids[rank * B // world:(rank + 1) * B // world]
        measure = ProfiledPeakMemory() if step == 1 else nullcontext()
        with measure:
            loss = model(input_ids=local, labels=local).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if isinstance(measure, ProfiledPeakMemory):
            peak = measure.peak_bytes
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    decisions = [last_decision(m) for m in model.modules() if hasattr(m, "_memfine_chunk_policy")]
    register()
    return {"loss": losses, "peak_bytes": peak,
            "num_chunks": [d.num_chunks for d in decisions if d is not None],
            "predicted_peak_bytes": [d.predicted_peak_bytes for d in decisions if d is not None]}


def _child(rank: int, world: int, port: int, out_dir: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = train_rank(rank, world, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, shape: dict[str, Any], impl: str, mode: str, steps: int,
        budget: str | None = None, port: int = 0) -> list[dict[str, Any]]:
    """Each rank's result of one run (one process in this one when ``world == 1``)."""
    if world == 1:
        return [train_rank(0, 1, shape, impl, mode, steps, budget)]
    import socket

    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_child, args=(world, port, out_dir, (shape, impl, mode, steps, budget)),
                           nprocs=world, join=True, start_method="spawn")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text(encoding="utf-8"))
                for r in range(world)]


def max_rel(got: list[float], want: list[float]) -> float:
    """max over steps of |got − want| / |want|."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def runs_of(mode: str, shape: dict[str, Any], steps: int, budget: str
            ) -> dict[str, list[dict[str, Any]]]:
    """Every run of one mode (keys ``impl/world``)."""
    out = {"eager/1": run(1, shape, "eager", mode, steps),
           "eager/2": run(2, shape, "eager", mode, steps),
           "memfine/2": run(2, shape, "memfine", mode, steps),
           "memfine_budget/1": run(1, shape, "memfine", mode, steps, budget),
           "memfine_budget/2": run(2, shape, "memfine", mode, steps, budget)}
    for key, ranks in out.items():
        print(f"  {mode:>4} {key:>16}: loss {' '.join(f'{v:.6f}' for v in ranks[0]['loss'])}; "
              f"peak/rank MiB {[round(r['peak_bytes'] / _MiB, 2) for r in ranks]}"
              + (f"; c {ranks[0]['num_chunks']}, predicted experts peak MiB "
                 f"{[round(b / _MiB, 2) for b in ranks[0]['predicted_peak_bytes']]}"
                 if ranks[0]["num_chunks"] else ""), flush=True)
    return out


def rows_of(mode: str, runs: dict[str, list[dict[str, Any]]], config: dict[str, Any],
            env: Any) -> list[dict[str, str]]:
    """CSV rows: per run its per-rank peak (max over ranks), losses vs the reference, c."""
    reference = runs["eager/1"][0]["loss"]
    eager_peak = max(r["peak_bytes"] for r in runs["eager/2"])
    rows = []
    for key, ranks in runs.items():
        impl, world = key.split("/")
        peak = max(r["peak_bytes"] for r in ranks)
        metrics: list[tuple[str, str, Any]] = [
            ("peak_bytes_per_rank", "bytes", peak),
            ("peak_ratio_to_eager_2_ranks", "ratio", peak / eager_peak),
            ("first_loss", "nats/token", ranks[0]["loss"][0]),
            ("final_loss", "nats/token", ranks[0]["loss"][-1]),
            ("loss_max_rel_diff_to_eager_1_process", "ratio", max_rel(ranks[0]["loss"],
                                                                      reference))]
        if ranks[0]["num_chunks"]:
            metrics += [("num_chunks", "count", max(ranks[0]["num_chunks"])),
                        ("predicted_experts_peak_bytes", "bytes",
                         max(ranks[0]["predicted_peak_bytes"]))]
        rows += [csv_row(benchmark="hf_fsdp", method=impl, mode="full", metric=metric,
                         unit=unit, x_name="mode/world", x_value=f"{mode}/{world}",
                         values=values, config=config, env=env)
                 for metric, unit, values in metrics]
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every mode; print, write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps (>= 2)")
    parser.add_argument("--budget", default="26MiB",
                        help="memory budget of the memfine_budget runs (register's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_fsdp_cpu.csv")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (step 2 is measured), got {args.steps}")
    torch.set_num_threads(1)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    import transformers

    env, rows = collect_environment("cpu"), []
    config = {**SHAPE, "steps": args.steps, "budget": args.budget, "dtype": "float32",
              "sharding": "fully_shard per decoder layer + root", "backend": "gloo",
              "measured_step": 2, "transformers_version": transformers.__version__}
    for mode in args.modes:
        rows += rows_of(mode, runs_of(mode, SHAPE, args.steps, args.budget), config, env)
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
