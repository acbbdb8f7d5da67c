"""A small decoder-only MoE transformer language model (nanoGPT-sized, byte vocabulary).

Legend: B batch, Q sequence, D = d, V vocab, H heads, A head dim.
Blocks: x + Attn(RMSNorm(x)); x + MoE(RMSNorm(x)). Causal attention through
``F.scaled_dot_product_attention`` with rotary position embeddings; tied input/output embeddings.
``ModelConfig.chunk`` sets the MoE chunking (fixed c or a memory budget, MACT) and the recompute
mode of every block; see :class:`Block`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfine._checks import check_tensor
from memfine.config import ChunkConfig, ModelConfig
from memfine.memory.step import StepPlan
from memfine.nn.attention import CausalSelfAttention
from memfine.nn.moe import MoEAux, MoELayer
from memfine.routing import update_selection_bias
from memfine.schedule.policy import ChunkPolicy
from memfine.schedule.step import plan_step, step_layer_policies


class Block(nn.Module):
    """One transformer block: attention and an MoE feed-forward, pre-norm residuals.

    Recompute modes (``ModelConfig.chunk.recompute``; what each keeps: docs/design.md §4):
    ``none`` and ``experts`` leave attention and norms to autograd; under ``full`` the block
    keeps only its input x, the router input (the MoE norm output, T·d) with the router's saved
    fp32 scores (T·E) and the routing (top-k index and weights, T·k), running as two
    checkpointed regions around the router (the attention sub-layer and MoE norm; the expert
    part, one checkpoint per chunk): the router runs once, so recomputation reuses its routing
    decision, and routing counters and aux losses are produced once.

    Args:
        config: :class:`ModelConfig`.
        policy: the chunk policy shared by the model's MoE layers (default: a new one from
            ``config.chunk``).

    Reference: MemFine §4 (full recompute vs chunked MoE recompute); docs/design.md §2.
    """

    def __init__(self, config: ModelConfig, *, policy: ChunkPolicy | None = None) -> None:
        """Build the norms, attention and MoE layer; arguments as on the class."""
        super().__init__()
        D = config.moe.hidden_size
        self.recompute = config.chunk.resolved_recompute
        self.attn_norm = nn.RMSNorm(D, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.moe_norm = nn.RMSNorm(D, eps=config.norm_eps)
        policy = policy or ChunkPolicy(config.chunk, config.moe)
        self.moe = MoELayer(config.moe, depth=config.num_layers, policy=policy)

    def _attention_part(self, x_BQD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream after attention, and its MoE-normed copy (the router input)."""
        h_BQD = x_BQD + self.attn(self.attn_norm(x_BQD))
        return h_BQD, self.moe_norm(h_BQD)

    def forward(self, x_BQD: torch.Tensor, step_selection_counts: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, MoEAux]:
        """(B, Q, d) → ((B, Q, d), MoEAux).

        ``step_selection_counts``: optional (E + 1,) int64, as :meth:`MoELayer.forward`.
        """
        if self.recompute == "full" and torch.is_grad_enabled():
            # NOTE(memory): keeps x (T·d) instead of the attention activations (q, k, v, scores
            # output, norms: several T·d); recomputed once in backward.
            h_BQD, normed_BQD = checkpoint(self._attention_part, x_BQD, use_reentrant=False,
                                           preserve_rng_state=False)
        else:
            h_BQD, normed_BQD = self._attention_part(x_BQD)
        moe_out, aux = self.moe(normed_BQD, step_selection_counts=step_selection_counts)
        return h_BQD + moe_out, aux


@dataclass(frozen=True, slots=True)
class LMOutput:
    """Language-model outputs.

    Attributes:
        logits: (B, Q, V) fp32 next-token logits.
        loss: 0-dim cross-entropy in nats per token (None without targets).
        aux: one :class:`MoEAux` per layer.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None
    aux: tuple[MoEAux, ...]

    @property
    def load_balancing_loss(self) -> torch.Tensor:
        """Mean over layers of the Switch load-balancing loss."""
        return torch.stack([a.load_balancing_loss for a in self.aux]).mean()

    @property
    def z_loss(self) -> torch.Tensor:
        """Mean over layers of the router z-loss."""
        return torch.stack([a.z_loss for a in self.aux]).mean()

    @property
    def sequence_balance_loss(self) -> torch.Tensor:
        """Mean over layers of DeepSeek-V3's sequence-wise balance loss (0 when not computed)."""
        return torch.stack([a.sequence_balance_loss if a.sequence_balance_loss is not None
                            else a.z_loss.new_zeros(()) for a in self.aux]).mean()

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """(L, E) int64 assignments per layer and expert of this call."""
        return torch.stack([a.tokens_per_expert for a in self.aux])

    @property
    def selection_counts(self) -> torch.Tensor:
        """(L, E + 1) int64 :attr:`MoEAux.selection_counts` per layer (global over the ranks).

        Raises:
            ValueError: when the forward did not keep them (it ran with autograd or was given
                ``step_selection_counts``).
        """
        counts = [a.selection_counts for a in self.aux]
        if any(c is None for c in counts):
            raise ValueError("selection_counts are kept by forwards under torch.no_grad() "
                             "without step_selection_counts only")
        return torch.stack(counts)  # type: ignore[arg-type]


class MoETransformerLM(nn.Module):
    """Decoder-only MoE language model.

    Args:
        config: :class:`ModelConfig`; ``config.chunk`` sets chunking and recomputation.
            Expert parallelism agrees budget-driven chunk counts inside its experts
            (:class:`memfine.parallel.ExpertParallelExperts`), nothing to pass here.

    Attributes:
        chunk_policy: the :class:`ChunkPolicy` shared by every MoE layer (layer-scope budget or
            a fixed c).
        last_plan: with ``config.chunk.budget_scope == "step"`` and a budget, the
            :class:`memfine.memory.step.StepPlan` of the last training forward (per layer: no
            recompute, chunked experts or full block recompute, and c); else None.

    Step-scope budget (``ChunkConfig(memory_budget_bytes=..., budget_scope="step")``): every
    forward with autograd plans its (B, Q) batch (:meth:`plan_step`: the least recomputation
    whose predicted step peak fits; :func:`memfine.schedule.step.plan_step` says what an unmet
    budget does) and sets each block's recompute mode and chunk count (:meth:`apply_plan`).
    """

    def __init__(self, config: ModelConfig) -> None:
        """Build and initialise the embedding, blocks and final norm; arguments as on the class."""
        super().__init__()
        self.config = config
        D = config.moe.hidden_size
        self.chunk_policy = ChunkPolicy(config.chunk, config.moe)
        self.last_plan: StepPlan | None = None
        self._plans: dict[tuple[int, int, int], StepPlan] = {}
        self._fixed: dict[tuple[str, int], ChunkPolicy] = {}
        self._replanned: dict[tuple[StepPlan, int], list[ChunkPolicy]] = {}
        self.embed = nn.Embedding(config.vocab_size, D)
        self.blocks = nn.ModuleList([Block(config, policy=self.chunk_policy)
                                     for _ in range(config.num_layers)])
        self.norm = nn.RMSNorm(D, eps=config.norm_eps)
        self._init_weights()

    def _block_list(self) -> list[Block]:
        """The blocks, typed (``nn.ModuleList`` yields them as plain ``nn.Module``)."""
        return cast(list[Block], list(self.blocks))

    def _init_weights(self) -> None:
        std = 0.02
        nn.init.normal_(self.embed.weight, std=std)
        for block in self._block_list():
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.proj.weight, std=std / (2 * self.config.num_layers) ** 0.5)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, *,
                step_selection_counts: torch.Tensor | None = None) -> LMOutput:
        """Run the model.

        Args:
            input_ids: (B, Q) int64 token ids in [0, V), Q ≤ max_seq_len.
            targets: optional (B, Q) int64 next-token ids.
            step_selection_counts: optional (L, E + 1) int64, the :attr:`LMOutput.selection_counts`
                of every micro-batch of the optimizer step summed (gradient accumulation's
                routing pre-pass, :mod:`memfine.train.accumulation`): each layer's aux losses
                then use the whole step's expert fractions f (:meth:`MoELayer.forward`).

        Returns:
            :class:`LMOutput` with the mean cross-entropy (nats/token) when targets are given.

        Raises:
            ValueError: on a wrong shape, a sequence longer than max_seq_len, ids out of range, or
                ``step_selection_counts`` not (L, E + 1).
        """
        L = len(self.blocks)
        if step_selection_counts is not None and (step_selection_counts.dim() != 2
                                                  or step_selection_counts.shape[0] != L):
            raise ValueError(f"step_selection_counts must be (L, E + 1) with L={L}, got "
                             f"{tuple(step_selection_counts.shape)}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, Q), got {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids must hold at least one token, got shape "
                             f"{tuple(input_ids.shape)}")
        V = self.config.vocab_size
        check_tensor(((input_ids >= 0) & (input_ids < V)).all(),
                     f"input_ids must lie in [0, vocab_size={V})",
                     lambda: f", got values in [{int(input_ids.min())}, {int(input_ids.max())}]")
        chunk = self.config.chunk
        if (chunk.budget_scope == "step" and chunk.memory_budget_bytes is not None
                and torch.is_grad_enabled() and not torch.compiler.is_compiling()):
            self.apply_plan(self.plan_step(*input_ids.shape), tokens=input_ids.numel())
        x_BQD = self.embed(input_ids)
        auxes = []
        for i, block in enumerate(self.blocks):
            x_BQD, aux = block(x_BQD, None if step_selection_counts is None
                               else step_selection_counts[i])
            auxes.append(aux)
        logits_BQV = F.linear(self.norm(x_BQD), self.embed.weight).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits_BQV.reshape(-1, logits_BQV.shape[-1]),
                                   targets.reshape(-1))
        return LMOutput(logits=logits_BQV, loss=loss, aux=tuple(auxes))

    def plan_step(self, batch: int, seq: int) -> StepPlan:
        """The step-scope plan for a (B, Q) batch (cached per shape; MemFine §4 with the step).

        Raises:
            InfeasibleBudgetError: as :func:`memfine.schedule.step.plan_step`.
        """
        key = (batch, seq, self.embed.weight.element_size())
        if key not in self._plans:
            self._plans[key] = plan_step(self.config, *key, self.embed.weight.device.type)
        return self._plans[key]

    def apply_plan(self, plan: StepPlan, *, tokens: int | None = None) -> None:
        """Set every block's recompute mode and its MoE layer's chunk policy.

        With ``tokens`` (T of this rank), a step budget and expert-parallel experts (a transport
        that receives rows, s″ > T·k possible), each layer gets a policy that runs the plan's c
        and re-decides it from the rows each call receives
        (:func:`memfine.schedule.step.step_layer_policies`); otherwise a fixed chunk count.
        """
        self.last_plan = plan
        blocks, budget = self._block_list(), self.config.chunk.memory_budget_bytes
        transport = [block.moe.experts.transport_row_elements for block in blocks]
        if tokens is not None and budget is not None and any(transport):
            plan_key = (plan, tokens)
            if plan_key not in self._replanned:
                self._replanned[plan_key] = step_layer_policies(
                    self.config, plan, budget, tokens, self.embed.weight.element_size(),
                    transport, self.embed.weight.device.type)
            for block, choice, policy in zip(blocks, plan.choices,
                                             self._replanned[plan_key], strict=True):
                block.recompute, block.moe.policy = choice.recompute, policy
            return
        for block, choice in zip(blocks, plan.choices, strict=True):
            key = (choice.recompute, choice.num_chunks)
            if key not in self._fixed:
                self._fixed[key] = ChunkPolicy(ChunkConfig(
                    num_chunks=choice.num_chunks, recompute=choice.recompute), self.config.moe)
            block.recompute = choice.recompute
            block.moe.policy = self._fixed[key]

    def compile_regions(self, *, backend: str = "inductor") -> MoETransformerLM:
        """Compile, in place, every block's regions that issue no collective; return ``self``.

        For each block: ``attn_norm``, ``attn``, ``moe_norm`` and ``moe.router``
        (``nn.Module.compile``), and the final ``norm``. Left eager: the experts (the
        expert-parallel count exchange, all-to-alls and chunk loop), shared experts, the aux
        losses, the embedding and cross-entropy, and the FSDP2 modules' own hooks (the blocks,
        the experts and the root are FSDP2 modules; none of the compiled regions is). This is
        how ``memfine train --compile`` compiles a sharded model, per block as torchtitan does
        (docs/compile.md).

        Args:
            backend: the ``torch.compile`` backend (``inductor``; tests use ``aot_eager``).

        Returns:
            The model itself; its regions now run compiled wherever it is called (evaluation
            and sampling included).
        """
        regions: list[nn.Module] = [self.norm]
        for block in self._block_list():
            regions += [block.attn_norm, block.attn, block.moe_norm, block.moe.router]
        for region in regions:
            region.compile(backend=backend)
        return self

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing: move every layer's selection bias once, after a step.

        Call once per optimizer step with the step's global counts: summed over the step's
        micro-batches (each forward's ``LMOutput.tokens_per_expert``) and over the data/expert
        parallel ranks. Counts come from the router's single run per call, so recompute never
        counts a token twice. A no-op when ``moe.bias_update_rate`` is 0.

        Args:
            tokens_per_expert_LE: (L, E) int64 global assignment counts of the step.

        Raises:
            ValueError: if the shape is not (L, E).

        Reference: DeepSeek-V3 §2.1.2 (``bias_i += γ·sign(mean_load − load_i)``).
        """
        L, E = len(self.blocks), self.config.moe.num_experts
        if tuple(tokens_per_expert_LE.shape) != (L, E):
            raise ValueError(f"tokens_per_expert must be (L, E)=({L}, {E}), got "
                             f"{tuple(tokens_per_expert_LE.shape)}")
        rate = self.config.moe.bias_update_rate
        if rate == 0:
            return
        for block, counts_E in zip(self._block_list(), tokens_per_expert_LE, strict=True):
            update_selection_bias(block.moe.router.selection_bias, counts_E, rate)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, *,
                 temperature: float = 1.0, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        """Sample continuations (no KV cache; the model is small).

        Args:
            prompt_ids: (B, Q0) int64.
            max_new_tokens: tokens to append.
            temperature: >= 0; sampling temperature; 0 is greedy decoding (the most likely
                token each time; ``generator`` is not used).
            generator: optional RNG for reproducible samples.

        Returns:
            (B, Q0 + max_new_tokens) int64.
        """
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        ids = prompt_ids
        for _ in range(max_new_tokens):
            window = ids[:, -self.config.max_seq_len:]
            logits = self(window).logits[:, -1]
            nxt = (logits.argmax(-1, keepdim=True) if temperature == 0 else
                   torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
            ids = torch.cat([ids, nxt], dim=1)
        return ids
