"""LoRA adapters on the routed experts: the frozen config and the rank/shape/dtype checks.

A LoRA adapter adds a low-rank update to a frozen weight, computed as two thin products (split
LoRA) and never as the dense W + s·B·A (Hu et al. 2021, "LoRA"; the per-expert form of PEFT's
``target_parameters``). Per expert e and adapted projection:

    y = x·W_e + s·((drop(x)·A_eᵀ)·B_eᵀ),   A_e (r, d_in), B_e (d_out, r), s = α / r.

Targets: ``w_up`` (the gate/up projection, d_in = d, d_out = G) and ``w_down`` (d_in = n,
d_out = d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from memfine._checks import check_float, check_int, fail
from memfine.config.base import ConfigBase

LoRATarget = Literal["w_up", "w_down"]
LORA_TARGETS: tuple[str, ...] = get_args(LoRATarget)
BASE_QUANTS = (None, "nf4")  # LoRAConfig.base_quant
QUANT_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' block sizes


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRAConfig(ConfigBase):
    """Per-expert LoRA adapters of one MoE layer.

    Attributes:
        rank: r ≥ 1, the adapters' rank; at most min(d_in, d_out) of every adapted weight
            (checked by :func:`check_lora_rank` where the shapes are known).
        alpha: α > 0; the update is scaled by s = α / r.
        dropout: probability in [0, 1) of dropping an element of the adapter's input (the base
            path never sees dropout); 0 disables it.
        targets: adapted expert weights, a non-empty subset of ``("w_up", "w_down")``, kept in
            that order whatever order it is given in.
        train_router: also train the router (the base weights stay frozen otherwise).
        train_attention: also train attention, norms, embeddings and shared experts (on a
            single :class:`memfine.nn.MoELayer`: its shared experts and their gate).
        base_quant: None (the frozen base stays in the model's dtype) or ``"nf4"``: the routed
            experts' frozen w_up / w_down held 4-bit NF4 (QLoRA; :mod:`memfine.lora.quant`,
            needs bitsandbytes), dequantised per row block.
        base_quant_block_size: values per NF4 absmax block (bitsandbytes' sizes, 64 default);
            each expert's d·G and n·d must be multiples of it (checked where the shapes are
            known).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    train_router: bool = False
    train_attention: bool = False
    base_quant: str | None = None
    base_quant_block_size: int = 64

    def __post_init__(self) -> None:
        """Validate every field.

        Raises:
            ValueError: naming the class and the field, e.g.
                ``LoRAConfig.rank must be >= 1, got 0``.
        """
        check_int(self, "rank", 1)
        check_float(self, "alpha", 0.0, lo_open=True)
        p = self.dropout
        if (isinstance(p, (int, float)) and not isinstance(p, bool) and p == p
                and not 0.0 <= p < 1.0):
            fail(self, "dropout", "in [0.0, 1.0)", p)
        check_float(self, "dropout", 0.0)
        targets = tuple(self.targets) if isinstance(self.targets, (tuple, list)) else ()
        if not targets or any(t not in LORA_TARGETS for t in targets):
            fail(self, "targets", f"a non-empty subset of {LORA_TARGETS}", self.targets)
        if len(set(targets)) != len(targets):
            fail(self, "targets", f"a subset of {LORA_TARGETS} without duplicates",
                 self.targets)
        # one order (LORA_TARGETS'), so "w_down,w_up" is the same config as "w_up,w_down"
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in targets))
        for name in ("train_router", "train_attention"):
            if not isinstance(getattr(self, name), bool):
                fail(self, name, "a bool", getattr(self, name))
        if self.base_quant not in BASE_QUANTS:
            fail(self, "base_quant", f"one of {BASE_QUANTS}", self.base_quant)
        if self.base_quant_block_size not in QUANT_BLOCK_SIZES:
            fail(self, "base_quant_block_size", f"one of {QUANT_BLOCK_SIZES}",
                 self.base_quant_block_size)

    @property
    def scale(self) -> float:
        """The update's scale s = α / r."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, object]:
        """The fields as a JSON-ready dict (targets as a list; the 4-bit base's only when set)."""
        out: dict[str, object] = {
            "rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
            "targets": list(self.targets), "train_router": self.train_router,
            "train_attention": self.train_attention}
        if self.base_quant is not None:
            out.update(base_quant=self.base_quant,
                       base_quant_block_size=self.base_quant_block_size)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> LoRAConfig:
        """Build from :meth:`to_dict` output.

        Raises:
            ValueError: on a key that is not a field, or an invalid value.
        """
        if not isinstance(data, dict):
            raise ValueError(f"LoRAConfig must be built from a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"LoRAConfig has no field(s) {unknown}; allowed: "
                             f"{sorted(cls.__dataclass_fields__)}")
        kwargs = dict(data)
        if "targets" in kwargs and isinstance(kwargs["targets"], list):
            kwargs["targets"] = tuple(kwargs["targets"])
        return cls(**kwargs)  # type: ignore[arg-type]


def check_lora_rank(rank: int, d_in: int, d_out: int, name: str = "LoRAConfig.rank") -> None:
    """Raise ValueError unless 1 ≤ rank ≤ min(d_in, d_out).

    Args:
        rank: r.
        d_in: the adapted weight's input features.
        d_out: its output features.
        name: the field or flag named in the message.

    Raises:
        ValueError: ``<name> must be in [1, min(d_in, d_out)=m], got r``.
    """
    hi = min(d_in, d_out)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= hi:
        raise ValueError(f"{name} must be in [1, min(d_in, d_out)={hi}] (d_in={d_in}, "
                         f"d_out={d_out}), got {rank!r}")


def dequant_window(block_rows: int, num_experts: int, hidden_size: int, intermediate_size: int,
                   up_width: int) -> int:
    """m: the most experts of a 4-bit base dequantised at once (QLoRA's window).

    As many experts' largest weight (max(d·G, n·d) elements) as one row block's transients
    hold (B·(3·d + 3·n + G) elements, :func:`memfine.config.backward_block_rows`), at least
    one and at most E: m = clamp(⌊B·(3·d + 3·n + G) / max(d·G, n·d)⌋, 1, E). A row block
    holding more than m experts runs them in windows of m (:mod:`memfine.lora.quant`), so
    whatever the routing no more than m experts' weights exist in full precision.
    """
    per = max(hidden_size * up_width, intermediate_size * hidden_size)
    rows = block_rows * (3 * hidden_size + 3 * intermediate_size + up_width)
    return max(1, min(num_experts, rows // per))
