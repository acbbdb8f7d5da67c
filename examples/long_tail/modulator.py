"""Classifiers for long-tailed recognition: softmax, logit adjustment, mutual exclusive modulator.

Legend: B batch, P pixels (64), H hidden width, C classes, G frequency groups (3).

- :class:`SoftmaxClassifier`: an MLP trained with cross-entropy on the class.
- :func:`logit_adjusted`: post-hoc logit adjustment (Menon et al., "Long-tail learning via logit
  adjustment", ICLR 2021, §4): subtract τ·log π_c from the trained classifier's logits at test time.
- :class:`ModulatorClassifier`: the mutual exclusive modulator ("Mutual Exclusive
  Modulator for Long-Tailed Recognition"), built from its description: a shared feature
  extractor, one classifier head per frequency group (each head covers only its group's classes)
  and a modulator that predicts P(g | x) with a G-way softmax, trained by cross-entropy on the
  group label (exactly one group is right: the mutual-exclusive objective). The class probability
  is p(c | x) = Σ_g P(g | x) · P(c | x, head g), with P(c | x, head g) = 0 for c outside group g.
  The modulator is memfine's fp32 :class:`memfine.routing.TopKRouter` over G "experts" with
  top-k = G (soft mixture); :meth:`ModulatorClassifier.predict_top1` routes each image to its
  top-1 group instead (:func:`memfine.routing.route` with k = 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfine.routing import TopKRouter, route


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Optimisation settings shared by every model (AdamW, shuffled mini-batches, fp32, CPU).

    Raises:
        ValueError: naming the field, when a field is out of range.
    """

    epochs: int = 150
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 1e-4
    hidden_size: int = 128

    def __post_init__(self) -> None:
        """Check every field."""
        for name in ("epochs", "batch_size", "hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay}")


def feature_extractor(num_pixels: int, hidden_size: int) -> nn.Sequential:
    """Shared two-layer ReLU MLP: (B, P) -> (B, H)."""
    return nn.Sequential(nn.Linear(num_pixels, hidden_size), nn.ReLU(),
                         nn.Linear(hidden_size, hidden_size), nn.ReLU())


class SoftmaxClassifier(nn.Module):
    """Feature extractor + one linear head over all C classes; trained with cross-entropy."""

    def __init__(self, num_pixels: int, num_classes: int, hidden_size: int) -> None:
        """Build the MLP (PyTorch default initialisation)."""
        super().__init__()
        self.features = feature_extractor(num_pixels, hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x_BP: torch.Tensor) -> torch.Tensor:
        """Return (B, C) class logits for (B, P) float32 images."""
        return self.head(self.features(x_BP))

    def loss(self, x_BP: torch.Tensor, y_B: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the (B,) int64 labels ``y_B``, nats."""
        return F.cross_entropy(self(x_BP), y_B)


def logit_adjusted(logits_BC: torch.Tensor, class_prior_C: torch.Tensor, tau: float
                   ) -> torch.Tensor:
    """Post-hoc logit adjustment: logits_c − τ·log π_c.

    Args:
        logits_BC: (B, C) logits of a classifier trained with plain cross-entropy.
        class_prior_C: (C,) training class frequencies π, all > 0.
        tau: τ >= 0 (τ = 1 is the Bayes-optimal choice for the balanced error).

    Returns:
        (B, C) adjusted logits; their argmax is the prediction.

    Raises:
        ValueError: if τ < 0, a prior entry is <= 0, or the shapes disagree.

    Reference: Menon et al. 2021, §4 (post-hoc correction).
    """
    if not tau >= 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if class_prior_C.shape != logits_BC.shape[-1:]:
        raise ValueError(f"class_prior must be (C,) with C={logits_BC.shape[-1]}, "
                         f"got {tuple(class_prior_C.shape)}")
    if not bool((class_prior_C > 0).all()):
        raise ValueError(f"class_prior must be > 0 everywhere, got {class_prior_C.tolist()}")
    return logits_BC - tau * class_prior_C.log()


@dataclass(frozen=True, slots=True)
class ModulatorOutput:
    """What the modulator classifier computes for B images.

    Attributes:
        group_logits_BG: (B, G) fp32 modulator logits.
        group_probs_BG: (B, G) fp32 P(g | x), a softmax: each row sums to 1.
        head_log_probs_BC: (B, C) log P(c | x, head g(c)), each head's log-softmax over its own
            group's classes, placed at those classes' columns.
        class_log_probs_BC: (B, C) log p(c | x) = log P(g(c) | x) + log P(c | x, head g(c)).
    """

    group_logits_BG: torch.Tensor
    group_probs_BG: torch.Tensor
    head_log_probs_BC: torch.Tensor
    class_log_probs_BC: torch.Tensor


class ModulatorClassifier(nn.Module):
    """Mutual exclusive modulator: G group heads mixed by a learned, supervised group router.

    Args:
        groups: the classes of each group, disjoint, together covering 0..C-1, none empty.
        num_pixels: P.
        hidden_size: H, width of the shared features.

    Raises:
        ValueError: if the groups are empty, overlap or do not cover 0..C-1.
    """

    def __init__(self, groups: tuple[tuple[int, ...], ...], num_pixels: int,
                 hidden_size: int) -> None:
        """Build the features, the heads and the router (memfine init, N(0, 0.02²))."""
        super().__init__()
        flat = [c for classes in groups for c in classes]
        if not groups or any(len(classes) == 0 for classes in groups) \
                or sorted(flat) != list(range(len(flat))):
            raise ValueError(f"groups must be non-empty, disjoint and cover 0..C-1, got {groups}")
        group_of_class_C = torch.empty(len(flat), dtype=torch.int64)
        for g, classes in enumerate(groups):
            group_of_class_C[list(classes)] = g
        self.register_buffer("group_of_class_C", group_of_class_C)
        # column of class c in the heads' concatenated outputs
        self.register_buffer("column_of_class_C", torch.argsort(torch.tensor(flat)))
        self.features = feature_extractor(num_pixels, hidden_size)
        self.heads = nn.ModuleList(nn.Linear(hidden_size, len(classes)) for classes in groups)
        self.router = TopKRouter(hidden_size, len(groups), top_k=len(groups),
                                 score_func="softmax", renormalize=False)

    def forward(self, x_BP: torch.Tensor) -> ModulatorOutput:
        """Run features, router and heads on (B, P) float32 images."""
        h_BH = self.features(x_BP)
        routing = self.router(h_BH)  # top_k = G: routing.scores is the full softmax P(g | x)
        head_log_probs_BC = torch.cat([head(h_BH).log_softmax(-1) for head in self.heads],
                                      dim=-1)[:, self.column_of_class_C]
        group_log_probs_BG = routing.logits.log_softmax(-1)
        class_log_probs_BC = group_log_probs_BG[:, self.group_of_class_C] + head_log_probs_BC
        return ModulatorOutput(group_logits_BG=routing.logits, group_probs_BG=routing.scores,
                               head_log_probs_BC=head_log_probs_BC,
                               class_log_probs_BC=class_log_probs_BC)

    def loss(self, x_BP: torch.Tensor, y_B: torch.Tensor) -> torch.Tensor:
        """Mutual-exclusive group cross-entropy plus the true group's head cross-entropy, nats.

        The sum equals −log p(y | x) of the mixture exactly (the heads are disjoint), so this is
        also the mixture's negative log-likelihood. Each head learns only from its own group's
        images; every image trains the modulator.

        Args:
            x_BP: (B, P) float32 images.
            y_B: (B,) int64 class ids.
        """
        out = self(x_BP)
        group_B = self.group_of_class_C[y_B]
        return (F.cross_entropy(out.group_logits_BG, group_B)
                + F.nll_loss(out.head_log_probs_BC, y_B))

    def predict_top1(self, out: ModulatorOutput) -> torch.Tensor:
        """(B,) int64 predictions with hard routing: the top-1 group's head decides."""
        top1_B1 = route(out.group_logits_BG, 1, score_func="softmax").top_k_index
        in_group_BC = self.group_of_class_C[None, :] == top1_B1
        return out.head_log_probs_BC.masked_fill(~in_group_BC, float("-inf")).argmax(-1)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def train_model(model: nn.Module, loss_fn: LossFn, x_NP: torch.Tensor, y_N: torch.Tensor,
                cfg: TrainConfig, *, seed: int) -> list[float]:
    """Train ``model`` in place with AdamW on shuffled mini-batches.

    Args:
        model: the module whose parameters ``loss_fn`` depends on.
        loss_fn: ``(x_BP, y_B) -> scalar loss``.
        x_NP: (N, P) float32 training images.
        y_N: (N,) int64 labels.
        cfg: epochs, batch size, learning rate, weight decay.
        seed: seeds the batch order (torch.Generator).

    Returns:
        Mean training loss of each epoch, nats.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    epoch_losses = []
    for _ in range(cfg.epochs):
        total = 0.0
        for idx_B in torch.randperm(y_N.numel(), generator=gen).split(cfg.batch_size):
            loss = loss_fn(x_NP[idx_B], y_N[idx_B])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * idx_B.numel()
        epoch_losses.append(total / y_N.numel())
    model.eval()
    return epoch_losses


def accuracy_by_group(pred_N: torch.Tensor, y_N: torch.Tensor, group_of_class_C: torch.Tensor,
                      group_names: tuple[str, ...]) -> dict[str, float]:
    """Test accuracy in percent: ``overall`` and one entry per group name.

    Args:
        pred_N: (N,) int64 predicted classes.
        y_N: (N,) int64 true classes.
        group_of_class_C: (C,) int64 group id of each class.
        group_names: name of group 0, 1, ...

    Returns:
        ``{"overall": %, name: % of images whose true class is in that group, ...}``.
    """
    correct_N = (pred_N == y_N).double()
    group_N = group_of_class_C[y_N]
    acc = {"overall": 100.0 * correct_N.mean().item()}
    for g, name in enumerate(group_names):
        acc[name] = 100.0 * correct_N[group_N == g].mean().item()
    return acc
