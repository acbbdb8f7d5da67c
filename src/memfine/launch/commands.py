"""The commands that run a planned layout: ``torchrun -m memfine train``, torchtitan's trainer.

``memfine train`` runs data and expert parallelism only (its mesh is ``dp_shard`` × ``ep``, W =
dp), so its command is given for layouts with t = p = cp = 1; torchtitan's trainer takes every
size (``--parallelism.*_degree``) for the presets it has a config of. Neither was run from here.
"""

from __future__ import annotations

from memfine.plan.stage import Plan

GPUS_PER_NODE = 8
TORCHTITAN_CONFIGS = {"qwen3-30b-a3b": "qwen3_30b_a3b", "deepseek-v3": "deepseek_v3_671b"}
"""``memfine plan`` preset → config function of :mod:`memfine.integrations.torchtitan_configs`."""


def _torchrun(devices: int) -> str:
    """``torchrun`` with one process per device, ``GPUS_PER_NODE`` per node."""
    per_node = GPUS_PER_NODE if devices % GPUS_PER_NODE == 0 else devices
    nodes = devices // per_node
    rendezvous = (f"--nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 "
                  if nodes > 1 else "")
    return f"torchrun {rendezvous}--nproc-per-node {per_node}"


def _chunks(plan: Plan) -> int | None:
    """MACT's c at the limiting stage and skew, or None (no MoE layer there, or no fit)."""
    return plan.limiting[1].num_chunks


def memfine_train_command(plan: Plan) -> str | None:
    """``torchrun ... -m memfine train`` for this layout, or None when it needs t, p or cp > 1.

    The model is memfine's own byte-level language model at the preset's MoE sizes (d, n, E,
    k, L, heads, shared experts); ``--batch-size`` is dp·b sequences per micro-batch and
    ``--grad-accum`` the m micro-batches of one global batch; a fixed ``--num-chunks`` is the
    chunk count that fits at the worst skew.
    """
    cfg = plan.config
    if (cfg.t, cfg.p, cfg.cp, cfg.v) != (1, 1, 1, 1):
        return None
    m = cfg.model
    flags = [f"--ep {cfg.e}", f"--dp-shard {cfg.dp // cfg.e}", "--device cuda",
             f"--hidden-size {m.hidden_size}", f"--intermediate-size {m.moe_intermediate_size}",
             f"--num-experts {m.num_experts}", f"--top-k {m.top_k}",
             f"--num-layers {m.num_layers}", f"--num-heads {m.num_heads}",
             f"--seq-len {cfg.seq_len}", f"--batch-size {cfg.dp * cfg.micro_batch}"]
    if m.num_shared_experts:
        flags += [f"--num-shared-experts {m.num_shared_experts}",
                  f"--shared-intermediate-size {m.shared_intermediate_size}"]
    if cfg.micro_batches is not None and cfg.micro_batches > 1:
        flags.append(f"--grad-accum {cfg.micro_batches}")
    flags.append(f"--recompute {cfg.recompute}")
    chunks = _chunks(plan)
    if cfg.recompute != "none" and chunks is not None and chunks > 1:
        flags.append(f"--num-chunks {chunks}")
    return f"{_torchrun(cfg.devices)} -m memfine train " + " ".join(flags)


def torchtitan_command(plan: Plan) -> str | None:
    """Torchtitan's trainer on this layout with memfine's experts, or None without a config."""
    cfg = plan.config
    name = TORCHTITAN_CONFIGS.get(cfg.model.name)
    if name is None:
        return None
    local = cfg.micro_batch
    if cfg.p > 1:  # the pipeline splits the local batch into micro-batches of b
        local *= cfg.micro_batches or 4 * cfg.p
    flags = [f"--parallelism.data_parallel_shard_degree {cfg.dp}",
             f"--parallelism.tensor_parallel_degree {cfg.t}",
             f"--parallelism.pipeline_parallel_degree {cfg.p}",
             f"--parallelism.context_parallel_degree {cfg.cp}",
             f"--parallelism.expert_parallel_degree {cfg.e}",
             f"--training.local_batch_size {local}", f"--training.seq_len {cfg.seq_len}"]
    if cfg.p > 1:
        flags.append(f"--parallelism.pipeline_parallel_microbatch_size {cfg.micro_batch}")
    if cfg.p > 1 or cfg.e > 1:  # torchtitan's CUDA graphs take neither (its config check says)
        flags.append("--training.disable_cuda_graphs")
    if cfg.global_batch is not None:
        flags.append(f"--training.global_batch_size {cfg.global_batch}")
    chunks = _chunks(plan)
    if cfg.recompute != "none" and chunks is not None and chunks > 1:
        flags.append("--override.imports 'memfine.integrations.torchtitan_modules."
                     f"memfine_experts={{\"num_chunks\": {chunks}}}'")
    # a subcommand: the flags after it would be its own, so it comes last
    flags.append("activation-checkpoint:full" if cfg.recompute == "full"
                 else "activation-checkpoint:none")
    return (f"{_torchrun(cfg.devices)} -m torchtitan.train --module "
            f"memfine.integrations.torchtitan_configs --config {name} " + " ".join(flags))


def launch_commands(plan: Plan) -> dict[str, str | None]:
    """``{"memfine_train": ..., "torchtitan": ...}``: each command, or None where none applies."""
    return {"memfine_train": memfine_train_command(plan), "torchtitan": torchtitan_command(plan)}


def launch_lines(plan: Plan) -> list[str]:
    """The ``run it`` lines printed under a plan (a note when no command applies)."""
    lines = []
    train = memfine_train_command(plan)
    if train is not None:
        lines += ["run it with memfine train (its own byte-level model at these MoE sizes):",
                  "  " + train]
    titan = torchtitan_command(plan)
    if titan is not None:
        lines += ["run it with torchtitan's trainer and memfine's experts (docs/torchtitan.md):",
                  "  " + titan]
        if plan.config.recompute == "experts" and (_chunks(plan) or 1) == 1:
            lines.append("  (recompute experts at c = 1: memfine's experts recompute only with "
                         "num_chunks >= 2 under torchtitan)")
    if not lines:
        lines.append(f"run it: memfine train takes t = p = cp = 1 only, and torchtitan has a "
                     f"config for {', '.join(sorted(TORCHTITAN_CONFIGS))} only "
                     "(docs/torchtitan.md)")
    return lines
