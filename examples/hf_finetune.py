"""Fine-tune a small random transformers MoE model with experts_implementation="memfine".

A Qwen3-MoE model is built from a config (no download), then trained on the same real text as
``memfine train`` (Python's ``pydoc_data/topics.py``, byte-level: vocabulary 256) once per
experts implementation, from the same initial weights and on the same batches. The script prints
the loss curves side by side (equal to fp32 rounding until a rounding difference flips one top-k
routing decision; from there on the runs diverge, as transformers' own eager and grouped_mm do),
the time per step and the bytes the forward pass saves for backward.

    python examples/hf_finetune.py                        # eager, grouped_mm, memfine; 300 steps
    python examples/hf_finetune.py --steps 400 --num-chunks 4 --csv out.csv --plot out.png

The only memfine-specific lines are ``register()`` and ``set_experts_implementation("memfine")``.
"""

from __future__ import annotations

import argparse
import csv
import time

import torch
import torch.nn.functional as F

from memfine._optional import pyplot
from memfine.integrations.transformers import register
from memfine.measure.saved import SavedTensorsTracker
from memfine.train.data import VOCAB_SIZE, ByteCorpus, train_batch, val_batches

_MiB = 1 << 20


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A small Qwen3-MoE language model over bytes, initialised from ``args.seed``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.hidden_size, intermediate_size=args.hidden_size,
        moe_intermediate_size=args.moe_intermediate_size, num_experts=args.num_experts,
        num_experts_per_tok=args.top_k, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden_size // 4, max_position_embeddings=args.seq_len,
        decoder_sparse_step=1, norm_topk_prob=True, use_cache=False, tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    return Qwen3MoeForCausalLM(config).float().train()


def lm_loss(model: torch.nn.Module, inputs_BQ: torch.Tensor, targets_BQ: torch.Tensor
            ) -> torch.Tensor:
    """Mean next-byte cross-entropy, nats per byte."""
    logits_BQV = model(input_ids=inputs_BQ).logits
    return F.cross_entropy(logits_BQV.flatten(0, 1), targets_BQ.flatten())


def train(impl: str, corpus: ByteCorpus, args: argparse.Namespace) -> dict[str, list[float]]:
    """Train one fresh model with ``impl``; return per-step losses, times and saved bytes."""
    model = build_model(args)
    model.set_experts_implementation(impl)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    log: dict[str, list[float]] = {"loss": [], "step_ms": [], "saved_mib": []}
    for step in range(args.steps):
        inputs_BQ, targets_BQ = train_batch(corpus.train_ids, batch_size=args.batch_size,
                                            seq_len=args.seq_len, seed=args.seed, step=step)
        t0 = time.perf_counter()
        with SavedTensorsTracker(exclude=params) as saved:
            loss = lm_loss(model, inputs_BQ, targets_BQ)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["step_ms"].append(1e3 * (time.perf_counter() - t0))
        log["loss"].append(loss.item())
        log["saved_mib"].append(saved.total_bytes / _MiB)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"  {impl:>10} step {step:4d}  loss {loss.item():.4f}  "
                  f"{log['step_ms'][-1]:7.1f} ms  saved {log['saved_mib'][-1]:.2f} MiB",
                  flush=True)
    with torch.no_grad():
        batches = val_batches(corpus.val_ids, num_batches=4, batch_size=args.batch_size,
                              seq_len=args.seq_len)
        log["val_loss"] = [sum(lm_loss(model, x, y).item() for x, y in batches) / len(batches)]
    return log


def summarise(logs: dict[str, dict[str, list[float]]], reference: str) -> None:
    """Print one line per implementation: losses vs the reference, time, saved bytes.

    ``equal steps`` counts the leading steps whose loss is within 1e-4 of the reference's. Top-k
    routing is discontinuous, so once fp32 rounding flips one token's expert choice the runs
    follow different (equally good) trajectories; transformers' own eager and grouped_mm
    diverge the same way.
    """
    ref = logs[reference]["loss"]
    print(f"\n{'impl':>10} {'final loss':>10} {'val loss':>9} {'equal steps':>11} "
          f"{'max |Δloss|':>12} {'median ms/step':>15} {'saved MiB/step':>15}")
    for impl, log in logs.items():
        diffs = [abs(a - b) for a, b in zip(log["loss"], ref, strict=True)]
        equal = next((i for i, diff in enumerate(diffs) if diff > 1e-4), len(diffs))
        ms = sorted(log["step_ms"])[len(log["step_ms"]) // 2]
        print(f"{impl:>10} {log['loss'][-1]:10.4f} {log['val_loss'][0]:9.4f} {equal:11d} "
              f"{max(diffs):12.2e} {ms:15.1f} {max(log['saved_mib']):15.2f}")


def write_outputs(logs: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    """Optional CSV (one row per implementation and step) and loss-curve plot."""
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["impl", "step", "loss", "step_ms", "saved_mib"])
            for impl, log in logs.items():
                for step, row in enumerate(zip(log["loss"], log["step_ms"], log["saved_mib"],
                                               strict=True)):
                    writer.writerow([impl, step, *row])
        print(f"wrote {args.csv}")
    if args.plot:
        plt = pyplot()

        fig, (ax_loss, ax_ms) = plt.subplots(1, 2, figsize=(11, 4))
        for impl, log in logs.items():
            ax_loss.plot(log["loss"], label=impl, linewidth=1)
            ax_ms.plot(log["step_ms"], label=impl, linewidth=1)
        ax_loss.set(xlabel="step", ylabel="train loss (nats/byte)", title="loss")
        ax_ms.set(xlabel="step", ylabel="ms / step", title="time per step", yscale="log")
        ax_loss.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


def main() -> None:
    """Parse arguments, train once per implementation, print the comparison."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default="eager,grouped_mm,memfine",
                   help="comma-separated experts implementations (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--hidden-size", type=int, default=64, help="d")
    p.add_argument("--moe-intermediate-size", type=int, default=64,
                   help="n (an odd value such as 30 makes transformers' grouped_mm fail on CPU)")
    p.add_argument("--num-experts", type=int, default=8, help="E")
    p.add_argument("--top-k", type=int, default=2, help="k")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="init and batch-order seed")
    p.add_argument("--num-chunks", type=int, default=None,
                   help="memfine: fixed token chunks per experts block (recompute per chunk)")
    p.add_argument("--memory-budget", default=None,
                   help="memfine: activation budget per experts block, e.g. 2MiB")
    p.add_argument("--log-every", type=int, default=50, help="print every this many steps")
    p.add_argument("--csv", default=None, help="write per-step rows to this CSV file")
    p.add_argument("--plot", default=None, help="write loss/time curves to this PNG file")
    args = p.parse_args()

    register(num_chunks=args.num_chunks, memory_budget=args.memory_budget)
    corpus = ByteCorpus.load("pydoc", val_fraction=0.05, seq_len=args.seq_len)
    print(f"data: {corpus.description}, {corpus.train_ids.numel()} training bytes")
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    logs = {}
    for impl in impls:
        print(f"training with experts_implementation={impl!r}")
        logs[impl] = train(impl, corpus, args)
    summarise(logs, impls[0])
    write_outputs(logs, args)


if __name__ == "__main__":
    main()
