"""Chunking, model and training configs: ChunkConfig, ModelConfig, TrainConfig."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memfine._checks import check_bins, check_choice, check_float, check_int, fail
from memfine.config.base import (
    _SUBCONFIGS,
    MAX_BIN,
    AutocastDType,
    BudgetScope,
    ConfigBase,
    DType,
    Recompute,
    RecomputeMode,
)
from memfine.config.lora import LoRAConfig
from memfine.config.moe import MoEConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkConfig(ConfigBase):
    """Token chunking of the MoE expert part (MemFine §4).

    Attributes:
        num_chunks: fixed chunk count c (>= 1); ignored when ``memory_budget_bytes`` is set.
        memory_budget_bytes: per-layer MoE activation budget in bytes; when set, c is chosen per
            step and layer from the received tokens (MACT, MemFine Eq. 8-9).
        bins: allowed chunk counts under a budget, strictly increasing ints in
            [1, :data:`MAX_BIN`], e.g. (1, 2, 4, 8); MACT picks the smallest whose exact
            predicted peak (:func:`memfine.memory.layer.layer_peak_bytes`) fits.
        recompute: ``none`` (no checkpointing), ``experts`` (checkpoint each chunk of the expert
            part), ``full`` (checkpoint the whole transformer layer), or ``auto`` (the default:
            ``experts`` when chunking is asked for — ``num_chunks > 1`` or a memory budget —
            else ``none``, so an unchunked layer pays no recompute). Read the concrete mode from
            :attr:`resolved_recompute`.
        allow_over_budget: when no bin meets the budget, use the largest bin and warn once
            instead of raising.
        budget_scope: what ``memory_budget_bytes`` bounds: ``layer`` (each MoE layer call's
            peak; MACT picks c per call) or ``step`` (the whole training step's activation
            peak: :class:`memfine.nn.MoETransformerLM` plans, per layer, no recompute, chunked
            experts or full block recompute; :class:`memfine.memory.step.StepPlanner`).
    """

    num_chunks: int = 1
    memory_budget_bytes: int | None = None
    bins: tuple[int, ...] = (1, 2, 4, 8)
    recompute: Recompute = "auto"
    allow_over_budget: bool = False
    budget_scope: BudgetScope = "layer"

    @property
    def resolved_recompute(self) -> RecomputeMode:
        """The concrete recompute mode (``auto`` resolved as documented on the class)."""
        if self.recompute != "auto":
            return self.recompute
        chunked = self.num_chunks > 1 or self.memory_budget_bytes is not None
        return "experts" if chunked else "none"

    def __post_init__(self) -> None:
        """Validate every field and cross-field rule, and store ``bins`` as a tuple.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        check_int(self, "num_chunks", 1)
        if self.memory_budget_bytes is not None:
            check_int(self, "memory_budget_bytes", 1)
        object.__setattr__(self, "bins", check_bins(self, hi=MAX_BIN))
        check_choice(self, "recompute", Recompute)
        if not isinstance(self.allow_over_budget, bool):
            fail(self, "allow_over_budget", "a bool", self.allow_over_budget)
        check_choice(self, "budget_scope", BudgetScope)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig(ConfigBase):
    """A small decoder-only MoE transformer language model.

    Attributes:
        vocab_size: V (256 for the byte tokenizer).
        num_layers: transformer blocks, each attention + MoE feed-forward.
        num_heads: attention heads; ``moe.hidden_size`` must be divisible by it and the head
            size ``moe.hidden_size / num_heads`` must be even (rotary embeddings rotate pairs).
        max_seq_len: longest sequence (positions), in tokens.
        moe: the MoE feed-forward configuration (its hidden_size is the model width d).
        chunk: token chunking / recompute of the MoE layers.
        rope_theta: rotary embedding base.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 256
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(
        hidden_size=128, intermediate_size=128, num_experts=8, top_k=2))
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        """Validate every field and cross-field rule.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        check_int(self, "vocab_size", 1)
        check_int(self, "num_layers", 1)
        check_int(self, "num_heads", 1)
        check_int(self, "max_seq_len", 1)
        if not isinstance(self.moe, MoEConfig):
            fail(self, "moe", "a MoEConfig", self.moe)
        if not isinstance(self.chunk, ChunkConfig):
            fail(self, "chunk", "a ChunkConfig", self.chunk)
        if self.moe.hidden_size % self.num_heads:
            fail(self, "num_heads", f"a divisor of moe.hidden_size={self.moe.hidden_size}",
                  self.num_heads)
        if (self.moe.hidden_size // self.num_heads) % 2:
            fail(self, "num_heads", f"a divisor of moe.hidden_size={self.moe.hidden_size} "
                  "giving an even head size (rotary embeddings)", self.num_heads)
        check_float(self, "rope_theta", 0.0, lo_open=True)
        check_float(self, "norm_eps", 0.0, lo_open=True)



@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig(ConfigBase):
    """Training of the byte-level MoE language model (``memfine train``).

    Attributes:
        model: the model to train; its ``max_seq_len`` must cover ``seq_len``.
        data: ``pydoc`` (Python's documentation topics, ``pydoc_data/topics.py``), ``stdlib``
            (the standard library's own ``.py`` sources) or a path to a text file or a directory
            of text files.
        val_fraction: share of the corpus (its last bytes) held out for validation, in (0, 0.5].
        seq_len: training context length Q, in bytes (= tokens).
        batch_size: sequences per micro-batch B (over all ranks); a step sees
            B·``grad_accum``·Q tokens.
        grad_accum: micro-batches per optimizer step N; the step's gradient is the one of a
            single batch of N·B sequences (the step's batch, cut into N micro-batches).
        max_steps: optimizer steps of the run, in [1, 2^32) (a resumed run stops at the same
            step; the step is the low half of each batch's 64-bit seed).
        lr: peak learning rate of AdamW.
        min_lr_ratio: final learning rate as a fraction of ``lr`` (end of the cosine decay).
        warmup_steps: linear warm-up steps from lr/warmup_steps to lr.
        lr_decay_steps: step at which the cosine decay reaches ``min_lr_ratio·lr`` (then flat);
            ``None`` means ``max(max_steps, warmup_steps)``. Training resolves it before
            writing ``config.json``, so a resumed run keeps its schedule when ``max_steps``
            grows.
        weight_decay: AdamW decoupled weight decay of matrices and expert weights (not of norms).
        grad_clip: maximum global gradient L2 norm; 0 disables clipping.
        seed: seeds the initialisation, the batch order and the text sample; in [0, 2^32 - 1]
            (the high half of each batch's 64-bit seed).
        eval_every: validate (and, unless ``save_every`` is set, checkpoint) every this many
            steps.
        save_every: write ``checkpoint.pt`` every this many steps (and at the last step);
            ``None``: at each evaluation.
        eval_batches: validation batches of 8 fixed windows each
            (:data:`memfine.data.VAL_WINDOWS_PER_BATCH`; the same for every batch size).
        log_every: write a ``metrics.jsonl`` line every this many steps.
        sample_tokens: bytes of text generated at the end (0 skips the sample).
        dtype: parameter and activation dtype (fp32 on CPU; bf16 matmuls are slow there).
            ``bfloat16`` means bf16 weights (and optimizer updates on them); the router's
            selection bias stays fp32.
        device: torch device string, ``cpu`` or ``cuda[:i]``.
        compile: run the training step's forward and backward under ``torch.compile``
            (inductor; evaluation and sampling stay eager).
        autocast: ``bfloat16`` runs the forward under ``torch.autocast`` with bf16: fp32 master
            weights, bf16 compute (the router stays fp32); ``none`` for plain ``dtype``.
            ``memfine train --device cuda`` defaults to ``bfloat16`` (with fp32 weights).
        deterministic: run with ``torch.use_deterministic_algorithms(True)`` and
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (bitwise repeatable on one GPU, at some speed).
        lora: fine-tune LoRA adapters on the routed experts only (:class:`LoRAConfig`; the base
            weights frozen, the router and attention as its ``train_*`` fields say); its rank
            must be at most min(d_in, d_out) of every adapted expert weight and the experts
            ``fused``. None: train every weight.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: str = "pydoc"
    val_fraction: float = 0.05
    seq_len: int = 128
    batch_size: int = 32
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    lr_decay_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 200
    save_every: int | None = None
    eval_batches: int = 8
    log_every: int = 10
    sample_tokens: int = 300
    dtype: DType = "float32"
    device: str = "cpu"
    compile: bool = False
    autocast: AutocastDType = "none"
    deterministic: bool = False
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        """Validate every field and cross-field rule.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        if not isinstance(self.model, ModelConfig):
            fail(self, "model", "a ModelConfig", self.model)
        if not isinstance(self.data, str) or not self.data.strip():
            fail(self, "data", "'pydoc', 'stdlib' or a path to text", self.data)
        check_float(self, "val_fraction", 0.0, 0.5, lo_open=True)
        check_int(self, "seq_len", 1, self.model.max_seq_len)
        check_int(self, "batch_size", 1)
        check_int(self, "grad_accum", 1)
        check_int(self, "max_steps", 1, 2**32 - 1)
        check_float(self, "lr", 0.0, lo_open=True)
        check_float(self, "min_lr_ratio", 0.0, 1.0)
        check_int(self, "warmup_steps", 0)
        if self.lr_decay_steps is not None:
            check_int(self, "lr_decay_steps", max(1, self.warmup_steps))
        check_float(self, "weight_decay", 0.0)
        check_float(self, "grad_clip", 0.0)
        check_int(self, "seed", 0, 2**32 - 1)
        check_int(self, "eval_every", 1)
        if self.save_every is not None:
            check_int(self, "save_every", 1)
        check_int(self, "eval_batches", 1)
        check_int(self, "log_every", 1)
        check_int(self, "sample_tokens", 0)
        check_choice(self, "dtype", DType)
        if self.dtype == "float16":
            fail(self, "dtype", "'float32', 'bfloat16' or 'float64' (float16 training would "
                  "need loss scaling, which memfine does not do)", self.dtype)
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            fail(self, "device", "'cpu' or 'cuda[:i]'", self.device)
        if not isinstance(self.compile, bool):
            fail(self, "compile", "True or False", self.compile)
        check_choice(self, "autocast", AutocastDType)
        if not isinstance(self.deterministic, bool):
            fail(self, "deterministic", "True or False", self.deterministic)
        if self.lora is not None:
            self._check_lora()

    def _check_lora(self) -> None:
        """``lora`` is a LoRAConfig whose rank fits every adapted expert weight (fused experts)."""
        if not isinstance(self.lora, LoRAConfig):
            fail(self, "lora", "None or a LoRAConfig", self.lora)
        moe = self.model.moe
        if moe.experts_impl != "fused":
            fail(moe, "experts_impl", "'fused' with LoRA adapters (split LoRA runs in the fused "
                 "experts)", moe.experts_impl)
        shapes = {"w_up": (moe.hidden_size, moe.up_width),
                  "w_down": (moe.intermediate_size, moe.hidden_size)}
        hi = min(min(shapes[t]) for t in self.lora.targets)
        if self.lora.rank > hi:
            dims = ", ".join(f"{t}: d_in={shapes[t][0]}, d_out={shapes[t][1]}"
                             for t in self.lora.targets)
            fail(self.lora, "rank", f"in [1, min(d_in, d_out)={hi}] ({dims})", self.lora.rank)

    @property
    def resolved_lr_decay_steps(self) -> int:
        """``lr_decay_steps``, or ``max(max_steps, warmup_steps, 1)`` when it is None."""
        if self.lr_decay_steps is not None:
            return self.lr_decay_steps
        return max(self.max_steps, self.warmup_steps, 1)  # shorter than its warm-up: no decay

    def evaluates_at(self, step: int) -> bool:
        """Whether completed step ``step`` validates: every ``eval_every`` and the last step."""
        return step % self.eval_every == 0 or step == self.max_steps

    def saves_at(self, step: int) -> bool:
        """Whether completed step ``step`` checkpoints: every ``save_every`` and the last step.

        Without ``save_every``, every ``eval_every`` steps.
        """
        every = self.save_every if self.save_every is not None else self.eval_every
        return step % every == 0 or step == self.max_steps

    def logs_at(self, step: int) -> bool:
        """Whether completed step ``step`` writes a ``metrics.jsonl`` line.

        Every ``log_every`` steps and at each evaluation (:meth:`evaluates_at`).
        """
        return step % self.log_every == 0 or self.evaluates_at(step)


_SUBCONFIGS.update({("ModelConfig", "moe"): MoEConfig, ("ModelConfig", "chunk"): ChunkConfig,
                    ("TrainConfig", "model"): ModelConfig, ("TrainConfig", "lora"): LoRAConfig})
