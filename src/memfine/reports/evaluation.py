"""Validation loss on fixed windows and the end-of-run text sample.

Legend: Q sequence length.
"""

from __future__ import annotations

import torch

from memfine.config import TrainConfig
from memfine.data import ByteCorpus, decode
from memfine.nn import MoETransformerLM

SAMPLE_PROMPT_BYTES = 48


@torch.no_grad()
def evaluate(model: MoETransformerLM, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> float:
    """Mean cross-entropy over every token of fixed batches, nats/byte.

    Args:
        model: the language model (left in train mode afterwards).
        batches: ``(x_BQ, y_BQ)`` int64 pairs, e.g. from :func:`memfine.data.val_batches`.
        device: where the model lives.

    Returns:
        The mean over all tokens (each batch's mean weighted by its tokens, so the same windows
        cut into other batch sizes give the same value), nats/byte.
    """
    model.eval()
    total = sum(float(model(x.to(device), y.to(device)).loss) * y.numel() for x, y in batches)
    model.train()
    return total / sum(y.numel() for _, y in batches)


def sample_after_validation_prompt(model: MoETransformerLM, corpus: ByteCorpus,
                                   config: TrainConfig, device: torch.device, *,
                                   temperature: float) -> str:
    """Generate ``sample_tokens`` bytes after a prompt from the validation split.

    The prompt is the split's first ``SAMPLE_PROMPT_BYTES`` bytes after its first newline (so it
    starts at a line), at most ``seq_len``.
    """
    if config.sample_tokens == 0:
        return ""
    val = corpus.val_ids
    newlines = (val[:SAMPLE_PROMPT_BYTES] == ord("\n")).nonzero()
    start = int(newlines[0]) + 1 if newlines.numel() else 0
    prompt_1Q = val[start:start + min(SAMPLE_PROMPT_BYTES, config.seq_len)][None].to(device)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    model.eval()
    ids = model.generate(prompt_1Q, config.sample_tokens, temperature=temperature,
                         generator=gen)
    return decode(ids[0].cpu())
