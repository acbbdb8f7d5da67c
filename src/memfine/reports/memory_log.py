"""Memory in the training logs: measured step peaks next to the memory model's prediction.

Measured (:func:`measured_peak`): the peak live tensor bytes of one step's forward + backward,
above what was alive when the step began, from :class:`memfine.measure.PeakMemoryTracker` (the
storage tracker on the CPU, ``torch.cuda.max_memory_allocated`` after a reset on CUDA). The
tracker slows CPU operators (docs/design.md §8), so the loop measures only the steps that write a
``metrics.jsonl`` line. The CPU tracker is a ``TorchDispatchMode``, under which Dynamo does not
compile, so a compiled run (``--compile``) on the CPU measures with
:class:`memfine.measure.ProfiledPeakMemory` (``torch.profiler`` allocation events) instead, and its
logged steps run the compiled graph like every other step.

Predicted (:func:`predicted_moe_layer_peak`): the memory model's peak of one MoE layer's forward
+ backward (:func:`memfine.memory.layer.moe_layer_memory`) at the step's tokens and dtype, with
each layer's own recompute mode and chunk count c (a step-scope budget plans them per layer). The
model covers MoE layers only; attention, norms, embedding and logits are not modelled, so the
whole step's measured peak is larger.

Before training (:func:`check_fits`): static bytes (parameters, gradients, AdamW's two moments)
plus every MoE layer's predicted saved bytes plus one layer's peak, against the memory the
device has free; a warning line when it does not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from memfine.config import TrainConfig
from memfine.measure import PeakMemoryTracker, ProfiledPeakMemory
from memfine.memory.layer import MemoryBreakdown as MoELayerMemory
from memfine.memory.layer import moe_layer_memory
from memfine.memory.lora import LoRALayerMemory, lora_layer_memory, quantized_base_bytes
from memfine.nn import MoETransformerLM
from memfine.units import format_bytes

ADAM_MOMENTS = 2  # AdamW keeps exp_avg and exp_avg_sq per parameter, in the parameter dtype


def _dtype_bytes(config: TrainConfig) -> int:
    """D_t, bytes per element of the run's dtype."""
    return int(getattr(torch, config.dtype).itemsize)


def _device_type(config: TrainConfig) -> str:
    """The run's device type: the MoE layers' default row blocks and index builder there."""
    return torch.device(config.device).type


@contextlib.contextmanager
def measured_peak(device: torch.device, enabled: bool, *, compiled: bool = False
                  ) -> Iterator[PeakMemoryTracker | ProfiledPeakMemory | None]:
    """Measure the region's peak live bytes when ``enabled`` (yields the measurement, else None).

    Args:
        device: where the step runs.
        enabled: measure this region (the loop measures logged steps only).
        compiled: the region runs ``torch.compile``d code; on the CPU it is then measured with
            ``torch.profiler`` (:class:`ProfiledPeakMemory`), which leaves Dynamo compiling.

    Yields:
        The measurement (its ``peak_bytes``, in bytes, is valid after the block), or None.
    """
    if not enabled:
        yield None
        return
    if compiled and device.type == "cpu":
        with ProfiledPeakMemory() as profiled:
            yield profiled
        return
    with PeakMemoryTracker(device) as tracker:
        yield tracker


def predicted_moe_layer_peak(config: TrainConfig, num_tokens: int, num_chunks: int,
                             recompute: str | None = None, *, block_rows: int | None = None
                             ) -> int | None:
    """The memory model's peak bytes of one MoE layer forward + backward.

    Args:
        config: the run (MoE config, dtype).
        num_tokens: T, tokens entering the layer on this process.
        num_chunks: c, the chunk count the layer ran with.
        recompute: the recompute mode the layer ran with (``none``, ``experts`` or ``full``;
            a step-scope budget plans one per layer, ``MoEAux.recompute``); None: the config's.
        block_rows: the fused path's rows per row block the layer ran (``MoEAux.block_rows``);
            None: the config's own on the run's device.

    Returns:
        Bytes (int), or None when the model does not cover the setting (T < c).

    Reference: :func:`memfine.memory.layer.moe_layer_memory` (MemFine Table 2 items, our timeline).
    """
    if num_tokens < num_chunks:
        return None
    return moe_layer_memory(config.model.moe, num_tokens, _dtype_bytes(config),
                            num_chunks=num_chunks,
                            recompute=recompute or config.model.chunk.resolved_recompute,
                            device_type=_device_type(config), block_rows=block_rows).peak_bytes


def num_parameters(config: TrainConfig, *, trainable_only: bool = False) -> int:
    """Parameters of the whole model of ``config`` (all experts, whatever the EP size).

    With ``config.lora`` the expert adapters are counted; ``trainable_only`` counts only what
    the optimizer updates (the adapters, and routers / attention where ``config.lora`` trains
    them; every parameter without LoRA). Counted on the meta device from a one-block model (the
    blocks are alike), so nothing is allocated and a huge ``num_layers`` costs no time:
    embedding + norm + L · one block.
    """
    from memfine.nn.lora import apply_lora

    one = dataclasses.replace(config.model, num_layers=1)
    with torch.device("meta"):
        model = MoETransformerLM(one)
        if config.lora is not None:
            apply_lora(model, config.lora)
    counted = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    block_ids = {id(p) for p in model.blocks.parameters()}
    block = sum(p.numel() for p in counted if id(p) in block_ids)
    rest = sum(p.numel() for p in counted) - block
    return rest + config.model.num_layers * block


def predicted_run_bytes(config: TrainConfig, total_parameters: int, num_tokens: int) -> int:
    """Predicted bytes of a training step: static memory plus the MoE layers' activations.

    Static: parameters (``total_parameters · D_t``: the model's, or under torchrun this rank's
    shard), and the gradients and AdamW's two moments of
    the trained ones (all of them, or under LoRA those of
    ``num_parameters(config, trainable_only=True)``), ``D_t`` bytes per element each.
    Activations: every MoE layer's saved bytes plus one layer's backward peak above its saved
    bytes, at the configured c (MACT's budget bounds a layer when one is set); a LoRA run's
    layers by :func:`memfine.memory.lora.lora_layer_memory` (adapters, frozen base), and a
    4-bit base's codes and absmax per layer (:func:`memfine.memory.lora.quantized_base_bytes`;
    not parameters).
    Attention, norms, embedding and logits activations are not modelled (a lower bound).

    Reference: MemFine Eq. 1 (static) and Eq. 3 (static + activation ≤ device memory).
    """
    chunk = config.model.chunk
    c, dt, mode = min(chunk.num_chunks, num_tokens), _dtype_bytes(config), chunk.resolved_recompute
    moe, device_type = config.model.moe, _device_type(config)
    layer: MoELayerMemory | LoRALayerMemory = (
        moe_layer_memory(moe, num_tokens, dt, num_chunks=c, recompute=mode,
                         device_type=device_type)
        if config.lora is None else lora_layer_memory(moe, config.lora, num_tokens, dt,
                                                      num_chunks=c, recompute=mode,
                                                      device_type=device_type))
    peak_above_saved = layer.peak_bytes - layer.saved_bytes
    if chunk.memory_budget_bytes is not None:
        peak_above_saved = min(peak_above_saved, chunk.memory_budget_bytes)
    trained = total_parameters
    if config.lora is not None:
        trained = num_parameters(config, trainable_only=True)
    static = (total_parameters + trained * (1 + ADAM_MOMENTS)) * _dtype_bytes(config)
    static += config.model.num_layers * quantized_base_bytes(moe, config.lora)
    return static + config.model.num_layers * layer.saved_bytes + peak_above_saved


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes: CUDA's free memory, or the CPU's ``MemAvailable``.

    Returns:
        Bytes, or None where it cannot be read (no ``/proc/meminfo``).
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(config: TrainConfig, total_parameters: int, num_tokens: int,
               device: torch.device) -> tuple[str, str | None]:
    """Compare the predicted step bytes with the device's free memory.

    Args:
        config: the run.
        total_parameters: parameters of the whole model (all ranks' experts).
        num_tokens: T, tokens entering each MoE layer on this process.
        device: where the run computes.

    Returns:
        An information line, and a warning line when the prediction exceeds the free memory
        (else None).
    """
    predicted = predicted_run_bytes(config, total_parameters, num_tokens)
    free = available_bytes(device)
    line = (f"memory: predicted {format_bytes(predicted)} per step (parameters, gradients, "
            f"AdamW state, MoE layers; attention not modelled); "
            f"{'free: not measured' if free is None else 'free ' + format_bytes(free)}")
    if free is None or predicted <= free:
        return line, None
    return line, (f"warning: predicted step memory {format_bytes(predicted)} exceeds the free "
                  f"memory of {device} ({format_bytes(free)}); lower --batch-size or --seq-len, "
                  f"or set --memory-budget / --num-chunks")
