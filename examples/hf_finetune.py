"""Fine-tune a small transformers MoE model with the HF Trainer: memfine vs grouped_mm vs eager.

A small random Qwen3-MoE (or GPT-OSS or Mixtral, ``--models``) language model is built from a config
(no download) and trained with ``transformers.Trainer`` on real text (Python's
``pydoc_data/topics.py``, byte-level: vocabulary 256), with gradient checkpointing and bf16
autocast on the CPU, once per experts implementation, from the same initial weights and on the
same batches. Per implementation the script records the time of each step (the calling thread's
CPU time, ``time.thread_time``, at one torch thread, ``--threads 1``; the wall clock at more
threads; named in the CSV's ``config_json`` as ``clock``), the peak live bytes
of one step (memfine's CPU storage tracker) and of the next (``torch.profiler`` with
``profile_memory=True``), the bytes saved for backward outside the checkpointed layers, and
writes them as CSV rows (docs/style.md §6 schema).

    pip install -e '.[hf]'                 # transformers + accelerate (the Trainer needs it)
    python examples/hf_finetune.py         # both models, 3 implementations, 12 steps each
    python examples/hf_finetune.py --models qwen3_moe --steps 40 --csv out.csv
    python examples/hf_finetune.py --csv benchmarks/results/hf_finetune_cpu.csv  # the committed CSV

The CSV goes to ``runs/hf_finetune/hf_finetune_cpu.csv`` (git-ignored) unless ``--csv`` names
another file.

The only memfine-specific lines are ``register()`` and ``experts_implementation="memfine"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from memfine.bench.harness import cpu_clock
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.data import VOCAB_SIZE, ByteCorpus
from memfine.flags.values import finite_float, int_at_least
from memfine.integrations.transformers import register
from memfine.lora.quant import without_kernels_note
from memfine.measure.peak import PeakMemoryTracker
from memfine.measure.profiled import ProfiledPeakMemory
from memfine.measure.saved import SavedTensorsTracker

_MiB = 1 << 20
DEFAULT_CSV = "runs/hf_finetune/hf_finetune_cpu.csv"  # git-ignored; results are committed by --csv
MODELS = ("qwen3_moe", "gpt_oss", "mixtral")
IMPLS = ("eager", "batched_mm", "grouped_mm", "memfine")  # transformers' and memfine's


def comma_choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``allowed`` (at least one)."""
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        if not names or any(name not in allowed for name in names):
            raise argparse.ArgumentTypeError(f"expected comma-separated names from "
                                             f"{', '.join(allowed)}, got {text!r}")
        return names
    return parse


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``PROG: error: MESSAGE``, exit 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: message`` to stderr and exit 2 (no usage block)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def check_csv(text: str) -> str:
    """An argparse ``type`` for ``--csv``: a file path that can be written, checked up front.

    The path must not be a folder, an existing file must be writable, and the nearest existing
    folder above it must take a new file (a temporary one is made and removed; the missing
    folders are made when the CSV is written).

    Raises:
        argparse.ArgumentTypeError: naming the path and why it cannot be written.
    """
    path = Path(text).expanduser().absolute()
    if not text.strip() or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a CSV file's path, got {text!r} (a folder)")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable")
    folder = next(p for p in path.parents if p.exists())
    try:
        if not folder.is_dir():
            raise NotADirectoryError(0, "not a folder")
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no file can be made in "
                                         f"{str(folder)!r} ({err.strerror})") from err
    return text


def example_parser(doc: str, *, models: str, steps: int, min_steps: tuple[int, str],
                   moe_intermediate_size: int, num_experts: int, top_k: int, lr: float,
                   csv: str, seq_len: str) -> argparse.ArgumentParser:
    """The flags both examples share, each checked by its type; ``--help`` shows the defaults.

    ``min_steps``: the least ``--steps`` and why, stated by the type and in ``--help``.
    """
    p = OneLineParser(description=doc.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    positive = int_at_least(1)
    p.add_argument("--models", type=comma_choices(MODELS), default=models,
                   help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--steps", type=int_at_least(min_steps[0]), default=steps,
                   help=f"optimizer steps, >= {min_steps[0]} ({min_steps[1]})")
    p.add_argument("--batch-size", type=positive, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int_at_least(2), default=128, help=seq_len)
    p.add_argument("--hidden-size", type=positive, default=64, help="d")
    p.add_argument("--moe-intermediate-size", type=positive, default=moe_intermediate_size,
                   help="n")
    p.add_argument("--num-experts", type=positive, default=num_experts, help="E")
    p.add_argument("--top-k", type=positive, default=top_k, help="k, at most E")
    p.add_argument("--layers", type=positive, default=2,
                   help="transformer blocks (even with gpt_oss)")
    p.add_argument("--lr", type=finite_float, default=lr, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    p.add_argument("--threads", type=positive, default=1, help="torch intra-op threads")
    p.add_argument("--csv", type=check_csv, default=csv, help="CSV to write")
    return p


def parse_checked(p: argparse.ArgumentParser, argv: Sequence[str] | None
                  ) -> argparse.Namespace:
    """Parse; a ``--top-k`` above E, odd ``--layers`` with gpt_oss, or ``--impls grouped_mm`` with
    d or n not a multiple of 8 is one usage line."""
    args = p.parse_args(argv)
    if "gpt_oss" in args.models and args.layers % 2:
        p.error(f"--layers must be even with gpt_oss in --models (GPT-OSS alternates sliding "
                f"and full attention layers), got {args.layers}")
    if args.top_k > args.num_experts:
        p.error(f"--top-k must be at most --num-experts {args.num_experts}, got {args.top_k}")
    unaligned = [f"{flag} {value}" for flag, value in (("--hidden-size", args.hidden_size),
                 ("--moe-intermediate-size", args.moe_intermediate_size)) if value % 8]
    if "grouped_mm" in getattr(args, "impls", ()) and unaligned:
        p.error(f"--impls grouped_mm needs --hidden-size and --moe-intermediate-size multiples "
                f"of 8 (torch._grouped_mm takes bf16 rows of 16-byte multiples), got "
                f"{', '.join(unaligned)}; leave grouped_mm out of --impls")
    return args


def import_trainer() -> None:
    """Import transformers' Trainer without bitsandbytes' note about its CPU 4-bit kernels.

    The Trainer imports peft when it is installed, and peft imports bitsandbytes, which logs that
    note; the 4-bit matmul is never run here. Only that record is dropped.
    """
    with without_kernels_note():
        import transformers.trainer  # noqa: F401


def build_model(model_type: str, args: argparse.Namespace,
                vocab_size: int = VOCAB_SIZE) -> torch.nn.Module:
    """A small fp32 MoE language model (``qwen3_moe``, ``gpt_oss``, ``mixtral``) from a config.

    Initialised from ``args.seed``; ``args`` gives d, n, E, k, the layers and the sequence length.
    """
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=args.hidden_size,
                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=args.hidden_size // 4, max_position_embeddings=args.seq_len,
                  num_experts_per_tok=args.top_k, use_cache=False, tie_word_embeddings=True)
    if model_type == "gpt_oss":
        # GPT-OSS's YaRN reads its factor and original length, never max_position_embeddings;
        # its default keeps the three consistent (transformers warns otherwise)
        del common["max_position_embeddings"]
        config = transformers.GptOssConfig(
            **common, intermediate_size=args.moe_intermediate_size,
            num_local_experts=args.num_experts, sliding_window=args.seq_len // 2,
            layer_types=["sliding_attention", "full_attention"] * (args.layers // 2))
        cls = transformers.GptOssForCausalLM
    elif model_type == "mixtral":
        config = transformers.MixtralConfig(
            **common, intermediate_size=args.moe_intermediate_size,
            num_local_experts=args.num_experts)
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=args.hidden_size,
            moe_intermediate_size=args.moe_intermediate_size, num_experts=args.num_experts,
            decoder_sparse_step=1, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(args.seed)
    return cls(config).float()


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` bytes; labels are the inputs (the model shifts)."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return self.ids.numel() // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


def step_stats_callback(measure_step: int, clock: Callable[[], float]) -> Any:
    """A TrainerCallback timing every step with ``clock`` (seconds), measuring memory on two.

    Step ``measure_step`` runs under memfine's storage tracker (peak live bytes) and a
    saved-tensor tracker; step ``measure_step + 1`` under ``torch.profiler`` with
    ``profile_memory=True`` (:class:`ProfiledPeakMemory`, the CPU ground truth: it does not
    change what the program allocates). Both slow their step down, so their times are left out
    of the timings.
    """
    from transformers import TrainerCallback

    class StepStats(TrainerCallback):
        def __init__(self) -> None:
            self.step_ms: list[float] = []
            self.peak_bytes: int | None = None
            self.profiled_peak_bytes: int | None = None
            self.saved_bytes: int | None = None
            self._trackers: tuple[Any, ...] = ()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == measure_step:
                model = kwargs["model"]
                self._trackers = (PeakMemoryTracker("cpu"),
                                  SavedTensorsTracker(exclude=list(model.parameters())))
            elif state.global_step == measure_step + 1:
                self._trackers = (ProfiledPeakMemory(),)
            for tracker in self._trackers:
                tracker.__enter__()
            self._t0 = clock()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            elapsed_ms = 1e3 * (clock() - self._t0)
            if not self._trackers:
                self.step_ms.append(elapsed_ms)
                return
            for tracker in reversed(self._trackers):
                tracker.__exit__(None, None, None)
            if len(self._trackers) == 2:
                self.peak_bytes = self._trackers[0].peak_bytes
                self.saved_bytes = self._trackers[1].total_bytes
            else:
                self.profiled_peak_bytes = self._trackers[0].peak_bytes
            self._trackers = ()

    return StepStats()


def checkpointing_args(arguments: type) -> dict[str, Any]:
    """Non-reentrant activation checkpointing, under the name ``arguments`` declares.

    transformers' ``TrainingArguments`` calls it ``activation_checkpointing`` where that field
    exists (``gradient_checkpointing`` is then a deprecated alias that warns) and
    ``gradient_checkpointing`` before.
    """
    names = {f.name for f in dataclasses.fields(arguments)}
    key = ("activation_checkpointing" if "activation_checkpointing" in names
           else "gradient_checkpointing")
    return {key: True, f"{key}_kwargs": {"use_reentrant": False}}


def train(model_type: str, impl: str, dataset: ByteWindows, args: argparse.Namespace
          ) -> dict[str, Any]:
    """One Trainer run; returns losses, step times (ms), peak and saved bytes."""
    from transformers import Trainer, TrainingArguments

    model = build_model(model_type, args)
    model.set_experts_implementation(impl)
    stats = step_stats_callback(measure_step=1, clock=cpu_clock()[1])
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = TrainingArguments(
            output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, bf16=True, **checkpointing_args(TrainingArguments), seed=args.seed,
            data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                          callbacks=[stats])
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"  {model_type} {impl:>10}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"median {statistics.median(stats.step_ms):.1f} ms/step, peak "
          f"{stats.peak_bytes / _MiB:.2f} MiB (profiler {stats.profiled_peak_bytes / _MiB:.2f}"
          f" MiB), saved {stats.saved_bytes / _MiB:.2f} MiB",
          flush=True)
    return {"loss": losses, "step_ms": stats.step_ms, "peak_bytes": stats.peak_bytes,
            "profiled_peak_bytes": stats.profiled_peak_bytes, "saved_bytes": stats.saved_bytes}


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    return q[1], statistics.median(values), q[7]


def rows_of(model_type: str, impl: str, log: dict[str, Any], config: dict[str, Any],
            env: Any) -> list[dict[str, str]]:
    """CSV rows of one run: time (ms), peak and saved bytes, first and last loss."""
    metrics = [("time", "ms", _quantiles(log["step_ms"])),
               ("peak_bytes", "bytes", log["peak_bytes"]),
               ("profiled_peak_bytes", "bytes", log["profiled_peak_bytes"]),
               ("saved_bytes", "bytes", log["saved_bytes"]),
               ("first_loss", "nats/byte", log["loss"][0]),
               ("final_loss", "nats/byte", log["loss"][-1])]
    return [csv_row(benchmark="hf_finetune", method=impl, mode="full", metric=metric,
                    unit=unit, x_name="model", x_value=model_type, values=values,
                    config=config, env=env) for metric, unit, values in metrics]


def print_table(logs: dict[tuple[str, str], dict[str, Any]]) -> None:
    """One line per (model, implementation)."""
    print(f"\n{'model':>10} {'impl':>10} {'median ms/step':>15} {'peak MiB':>9} "
          f"{'profiled':>9} {'saved MiB':>10} {'first loss':>10} {'final loss':>10}")
    for (model_type, impl), log in logs.items():
        print(f"{model_type:>10} {impl:>10} {statistics.median(log['step_ms']):15.1f} "
              f"{log['peak_bytes'] / _MiB:9.2f} {log['profiled_peak_bytes'] / _MiB:9.2f} "
              f"{log['saved_bytes'] / _MiB:10.2f} "
              f"{log['loss'][0]:10.4f} {log['loss'][-1]:10.4f}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (sequences are of bytes here)."""
    p = example_parser(__doc__, models="qwen3_moe,gpt_oss", steps=12,
                       min_steps=(3, "step 1 is tracked, step 2 profiled"),
                       moe_intermediate_size=128, num_experts=8, top_k=2, lr=3e-3,
                       csv=DEFAULT_CSV, seq_len="bytes per sequence")
    p.add_argument("--impls", type=comma_choices(IMPLS), default="eager,grouped_mm,memfine",
                   help=f"comma-separated experts implementations, from {', '.join(IMPLS)}")
    return parse_checked(p, argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Train once per model and implementation, print the table, write the CSV."""
    args = parse_args(argv)
    import_trainer()
    torch.set_num_threads(args.threads)
    register()
    corpus = ByteCorpus.load("pydoc", val_fraction=0.05, seq_len=args.seq_len)
    print(f"data: {corpus.description}, {corpus.train_ids.numel()} training bytes")
    dataset = ByteWindows(corpus.train_ids, args.seq_len)
    env = collect_environment("cpu")
    import transformers

    config = {k: v for k, v in vars(args).items() if k not in ("csv", "models", "impls")}
    config.update(bf16_autocast=True, gradient_checkpointing=True, trainer="transformers.Trainer",
                  transformers_version=transformers.__version__, measured_step=1,
                  profiled_step=2, clock=cpu_clock()[0])
    logs, rows = {}, []
    for model_type in args.models:
        for impl in args.impls:
            log = train(model_type, impl, dataset, args)
            logs[model_type, impl] = log
            rows += rows_of(model_type, impl, log, config, env)
    print_table(logs)
    print(f"wrote {write_csv(rows, args.csv)}")


if __name__ == "__main__":
    main()
