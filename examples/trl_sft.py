"""LoRA SFT of a small MoE model with TRL's ``SFTTrainer``: memfine experts vs eager + PEFT.

A small random Qwen3-MoE, GPT-OSS or Mixtral language model is built from a config (no
download), with a byte-level tokenizer built locally (``tokenizers``: the 256 byte symbols,
an end-of-text and a pad token), and fine-tuned with ``trl.SFTTrainer`` and a
``peft.LoraConfig`` on the experts' 3-D weights (``target_parameters``) over text windows of
Python's ``pydoc_data/topics.py``, once per experts implementation, from the same initial
weights, adapters and batches. TRL's defaults are kept (gradient checkpointing, AdamW) except
fp32 (``bf16=False``: the two runs must agree to fp32 reassociation) and a constant learning
rate. Per implementation the script records the loss of every step, the adapters' gradients of
step 1 (before the optimizer; compared between implementations), the peak live bytes of step 1
(memfine's CPU storage tracker) and of step 2 (``torch.profiler``, the CPU ground truth), and
writes CSV rows (docs/style.md §6 schema).

    pip install -e '.[trl]'            # transformers, accelerate, peft, trl
    python examples/trl_sft.py         # the three families, eager and memfine, 6 steps each
    python examples/trl_sft.py --models mixtral --steps 20
    python examples/trl_sft.py --csv benchmarks/results/trl_sft_cpu.csv   # the committed CSV

The only memfine-specific lines are ``register()`` and ``experts_implementation="memfine"``
(here ``model.set_experts_implementation``); SFTTrainer applies PEFT itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_finetune: models, callbacks

from hf_finetune import (  # noqa: E402
    build_model,
    example_parser,
    import_trainer,
    parse_checked,
    step_stats_callback,
)

from memfine.bench.harness import cpu_clock  # noqa: E402
from memfine.bench.results import collect_environment, csv_row, write_csv  # noqa: E402
from memfine.data import ByteCorpus  # noqa: E402
from memfine.flags.values import int_at_least  # noqa: E402
from memfine.integrations.transformers import register  # noqa: E402

_MiB = 1 << 20
DEFAULT_CSV = "runs/trl_sft/trl_sft_cpu.csv"  # git-ignored; results are committed by --csv
TARGET_PARAMETERS = {"qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                     "mixtral": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                     "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def byte_tokenizer() -> Any:
    """A byte-level fast tokenizer built locally: ids 0-255 are bytes, 256 EOS, 257 pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = pre_tokenizers.ByteLevel.alphabet()  # one printable symbol per byte
    byte_symbol = {b: s for b, s in zip(range(256), _bytes_to_symbols(), strict=True)}
    assert set(byte_symbol.values()) == set(symbols)
    vocab = {byte_symbol[b]: b for b in range(256)} | {"<|endoftext|>": 256, "<|pad|>": 257}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")


def _bytes_to_symbols() -> list[str]:
    """GPT-2's byte → printable-symbol table (the ByteLevel pre-tokenizer's), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def text_dataset(args: argparse.Namespace) -> Any:
    """A ``datasets.Dataset`` of ``text`` windows (seq_len − 1 bytes: room for the EOS)."""
    import datasets

    corpus = ByteCorpus.load("pydoc", val_fraction=0.05, seq_len=args.seq_len)
    data = bytes(corpus.train_ids.tolist()).decode("ascii", errors="ignore")
    width = args.seq_len - 1
    windows = [data[i:i + width] for i in range(0, len(data) - width, width)]
    return datasets.Dataset.from_dict({"text": windows[:args.steps * args.batch_size * 4]})


def grads_callback() -> Any:
    """A TrainerCallback keeping a copy of the trained parameters' gradients of step 1."""
    from transformers import TrainerCallback

    class FirstGrads(TrainerCallback):
        def __init__(self) -> None:
            self.grads: dict[str, torch.Tensor] = {}
            self.init: dict[str, torch.Tensor] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.init = {n: p.detach().clone()
                         for n, p in kwargs["model"].named_parameters() if p.requires_grad}

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                                  **kwargs: Any) -> None:
            if state.global_step == 0:
                self.grads = {n: p.grad.detach().clone()
                              for n, p in kwargs["model"].named_parameters()
                              if p.requires_grad and p.grad is not None}

    return FirstGrads()


def train(model_type: str, impl: str, dataset: Any, tokenizer: Any, args: argparse.Namespace
          ) -> dict[str, Any]:
    """One SFTTrainer run: losses, step-1 adapter gradients, step times (ms), peaks (bytes)."""
    import peft
    from trl import SFTConfig, SFTTrainer

    model = build_model(model_type, args, vocab_size=len(tokenizer))
    model.set_experts_implementation(impl)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=[],
                           target_parameters=TARGET_PARAMETERS[model_type])
    stats = step_stats_callback(measure_step=1, clock=cpu_clock()[1])
    grads = grads_callback()
    with tempfile.TemporaryDirectory() as out_dir:
        config = SFTConfig(
            output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
            max_length=args.seq_len, seed=args.seed, data_seed=args.seed,
            dataloader_num_workers=0, disable_tqdm=True)
        torch.manual_seed(args.seed)  # the adapters' initialisation (PEFT draws A)
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                             processing_class=tokenizer, peft_config=lora,
                             callbacks=[stats, grads])
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"  {model_type} {impl:>8}: loss {losses[0]:.6f} -> {losses[-1]:.6f}, "
          f"median {statistics.median(stats.step_ms):.1f} ms/step, peak "
          f"{stats.peak_bytes / _MiB:.2f} MiB (profiler {stats.profiled_peak_bytes / _MiB:.2f}"
          f" MiB)", flush=True)
    return {"loss": losses, "grads": grads.grads, "init": grads.init, "step_ms": stats.step_ms,
            "peak_bytes": stats.peak_bytes, "profiled_peak_bytes": stats.profiled_peak_bytes}


def max_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over tensors of ‖got − want‖∞ / ‖want‖∞ (same names required)."""
    if got.keys() != want.keys() or not want:
        raise ValueError(f"the runs trained different parameters: {sorted(got)} vs "
                         f"{sorted(want)}")
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30))
               for n in want)


def compare(log: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Loss per step and step-1 adapter gradients of ``log`` against ``reference`` (relative)."""
    if max_relative(log["init"], reference["init"]) != 0.0:
        raise ValueError("the two runs started from different weights or adapters")
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(log["loss"], reference["loss"],
                                                        strict=True))
    return {"loss_max_rel_diff": loss_rel,
            "grad_max_rel_diff": max_relative(log["grads"], reference["grads"]),
            "peak_ratio": log["peak_bytes"] / reference["peak_bytes"],
            "profiled_peak_ratio": log["profiled_peak_bytes"] / reference["profiled_peak_bytes"]}


def rows_of(model_type: str, impl: str, log: dict[str, Any], diffs: dict[str, float],
            config: dict[str, Any], env: Any) -> list[dict[str, str]]:
    """CSV rows of one run: time, peaks, first/last loss, and its differences from eager."""
    q = statistics.quantiles(log["step_ms"], n=10, method="inclusive")
    metrics: list[tuple[str, str, Any]] = [
        ("time", "ms", (q[1], statistics.median(log["step_ms"]), q[7])),
        ("peak_bytes", "bytes", log["peak_bytes"]),
        ("profiled_peak_bytes", "bytes", log["profiled_peak_bytes"]),
        ("first_loss", "nats/token", log["loss"][0]), ("final_loss", "nats/token", log["loss"][-1])]
    metrics += [(name, "ratio", value) for name, value in diffs.items()]
    return [csv_row(benchmark="trl_sft", method=impl, mode="full", metric=metric, unit=unit,
                    x_name="model", x_value=model_type, values=values, config=config, env=env)
            for metric, unit, values in metrics]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = example_parser(__doc__, models="qwen3_moe,gpt_oss,mixtral", steps=6,
                       min_steps=(4, "two measured steps and two timed ones"),
                       moe_intermediate_size=512, num_experts=32, top_k=8, lr=1e-3,
                       csv=DEFAULT_CSV, seq_len="tokens per sequence (EOS included)")
    p.add_argument("--rank", type=int_at_least(1), default=8, help="LoRA rank r (α = 2r)")
    p.add_argument("--lm-head-tile", type=int_at_least(0), default=512,
                   help="vocabulary tile width of TRL's fused LM-head loss (its default, 32768, "
                        "allocates a tokens x 32768 buffer whatever the vocabulary); 0 keeps "
                        "TRL's")
    return parse_checked(p, argv)


def main(argv: list[str] | None = None) -> int:
    """Train eager + PEFT, then memfine + PEFT, per model; print the comparison, write the CSV."""
    args = parse_args(argv)
    import_trainer()
    torch.set_num_threads(args.threads)
    register()
    if args.lm_head_tile:
        import trl.trainer.utils

        trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE = args.lm_head_tile  # private: see --help
    tokenizer, dataset = byte_tokenizer(), text_dataset(args)
    env = collect_environment("cpu")
    import transformers
    import trl

    config = {k: v for k, v in vars(args).items() if k not in ("csv", "models")}
    config.update(dtype="float32", gradient_checkpointing=True, trainer="trl.SFTTrainer",
                  transformers_version=transformers.__version__, trl_version=trl.__version__,
                  measured_step=1, profiled_step=2, clock=cpu_clock()[0])
    rows = []
    for model_type in args.models:
        eager = train(model_type, "eager", dataset, tokenizer, args)
        memfine = train(model_type, "memfine", dataset, tokenizer, args)
        diffs = compare(memfine, eager)
        print(f"  {model_type}: memfine vs eager + PEFT: loss max rel diff "
              f"{diffs['loss_max_rel_diff']:.2e}, adapter grads {diffs['grad_max_rel_diff']:.2e}"
              f", peak {diffs['peak_ratio']:.3f}x (profiler {diffs['profiled_peak_ratio']:.3f}x)")
        rows += rows_of(model_type, "eager", eager, {}, config, env)
        rows += rows_of(model_type, "memfine", memfine, diffs, config, env)
    print(f"wrote {write_csv(rows, args.csv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
