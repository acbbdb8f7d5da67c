"""scikit-learn's digits made long-tailed: exponential training profile, balanced test split.

Legend: N images, C classes (10), G frequency groups (3: many, medium, few), P pixels (64).

Per seed, ``test_per_class`` images of every class go to the test split (balanced); the rest of
each class is its training pool. Class c keeps ``max(1, int(n_max · ratio^(-c / (C - 1))))``
images of its pool (all of it when the pool is smaller), where n_max is the pool size of class 0
(the largest class keeps all its training images) and ratio is the imbalance ratio: the
exponential profile of the long-tailed CIFAR benchmarks (Cui et al. 2019, "Class-Balanced Loss
Based on Effective Number of Samples"). Classes are then grouped by training count: many
(``>= many_min``), few (``< few_below``), medium in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_NAMES = ("many", "medium", "few")


@dataclass(frozen=True, slots=True)
class LongTailSplit:
    """One seed's long-tailed training split and balanced test split.

    Attributes:
        x_train_NP: (N_train, 64) float32 pixels scaled to [0, 1].
        y_train_N: (N_train,) int64 class ids in [0, C).
        x_test_NP: (N_test, 64) float32 pixels scaled to [0, 1].
        y_test_N: (N_test,) int64 class ids, ``test_per_class`` of each class.
        train_counts_C: (C,) int64 training images per class.
        group_of_class_C: (C,) int64 group id per class: 0 many, 1 medium, 2 few.
    """

    x_train_NP: torch.Tensor
    y_train_N: torch.Tensor
    x_test_NP: torch.Tensor
    y_test_N: torch.Tensor
    train_counts_C: torch.Tensor
    group_of_class_C: torch.Tensor

    @property
    def num_classes(self) -> int:
        """C, the number of classes."""
        return int(self.train_counts_C.numel())

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The classes of each group, in group order (many, medium, few)."""
        return tuple(tuple(int(c) for c in (self.group_of_class_C == g).nonzero().flatten())
                     for g in range(len(GROUP_NAMES)))

    @property
    def class_prior_C(self) -> torch.Tensor:
        """(C,) float32 training class frequencies π_c (sum to 1)."""
        return (self.train_counts_C / self.train_counts_C.sum()).float()


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Load scikit-learn's bundled 8×8 digits (1,797 images; no download).

    Returns:
        ``(x_NP, y_N)``: (1797, 64) float32 pixels scaled from [0, 16] to [0, 1] and (1797,)
        int64 labels.

    Raises:
        ImportError: when scikit-learn is missing, naming the extra to install.
    """
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError as err:
        raise ImportError("this example needs scikit-learn: pip install -e '.[examples]'") from err
    digits = load_digits()
    x_NP = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0
    return x_NP, torch.as_tensor(digits.target, dtype=torch.int64)


def exponential_counts(n_max: int, num_classes: int, imbalance_ratio: float) -> list[int]:
    """Training images per class under the exponential long-tail profile.

    Args:
        n_max: images of class 0, the largest class.
        num_classes: C >= 2.
        imbalance_ratio: n_max / n_min, >= 1.

    Returns:
        ``[max(1, int(n_max · ratio^(-c / (C - 1)))) for c in range(C)]``.

    Raises:
        ValueError: if an argument is out of range.
    """
    if n_max < 1:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if not imbalance_ratio >= 1.0:
        raise ValueError(f"imbalance_ratio must be >= 1, got {imbalance_ratio}")
    return [max(1, int(n_max * imbalance_ratio ** (-c / (num_classes - 1))))
            for c in range(num_classes)]


def assign_groups(train_counts: list[int], *, many_min: int, few_below: int) -> list[int]:
    """Group id per class by training count: 0 many (>= many_min), 2 few (< few_below), else 1.

    Raises:
        ValueError: if ``few_below > many_min`` or a group is left without classes.
    """
    if few_below > many_min:
        raise ValueError(f"few_below must be <= many_min={many_min}, got {few_below}")
    group_of_class = [0 if n >= many_min else 2 if n < few_below else 1 for n in train_counts]
    for g, name in enumerate(GROUP_NAMES):
        if g not in group_of_class:
            raise ValueError(f"group {name!r} has no class: training counts {train_counts} with "
                             f"many >= {many_min}, few < {few_below}; change the thresholds or "
                             f"the imbalance ratio")
    return group_of_class


def make_split(x_NP: torch.Tensor, y_N: torch.Tensor, *, seed: int, imbalance_ratio: float,
               test_per_class: int, many_min: int, few_below: int) -> LongTailSplit:
    """Draw one seed's balanced test split and long-tailed training split.

    Args:
        x_NP: (N, P) float32 images.
        y_N: (N,) int64 labels in [0, C).
        seed: seeds the test draw and the training subsample (torch.Generator).
        imbalance_ratio: largest / smallest training class size, >= 1.
        test_per_class: test images per class, >= 1 and below the smallest class size.
        many_min: classes with at least this many training images are "many".
        few_below: classes with fewer training images are "few".

    Returns:
        A :class:`LongTailSplit`.

    Raises:
        ValueError: if ``test_per_class`` leaves a class without training images, or any argument
            of :func:`exponential_counts` / :func:`assign_groups` is out of range.
    """
    num_classes = int(y_N.max()) + 1
    per_class = torch.bincount(y_N, minlength=num_classes)
    if not 1 <= test_per_class < int(per_class.min()):
        raise ValueError(f"test_per_class must be in [1, {int(per_class.min()) - 1}] (the "
                         f"smallest class has {int(per_class.min())} images), got {test_per_class}")
    gen = torch.Generator().manual_seed(seed)
    pools = []
    test_idx = []
    for c in range(num_classes):
        idx = (y_N == c).nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        test_idx.append(idx[:test_per_class])
        pools.append(idx[test_per_class:])
    counts = exponential_counts(pools[0].numel(), num_classes, imbalance_ratio)
    train_idx = torch.cat([pool[:n] for pool, n in zip(pools, counts, strict=True)])
    test_all = torch.cat(test_idx)
    train_counts_C = torch.bincount(y_N[train_idx], minlength=num_classes)
    groups = assign_groups(train_counts_C.tolist(), many_min=many_min, few_below=few_below)
    return LongTailSplit(x_train_NP=x_NP[train_idx], y_train_N=y_N[train_idx],
                         x_test_NP=x_NP[test_all], y_test_N=y_N[test_all],
                         train_counts_C=train_counts_C,
                         group_of_class_C=torch.tensor(groups, dtype=torch.int64))
