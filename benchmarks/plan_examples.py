"""docs/results.md's ``memfine plan`` examples and its comparison with DeepSpeed's ZeRO estimator.

Writes ``benchmarks/results/plan_examples.json`` (bytes as ints) with:

- ``deepseek_v3_published``: ``memfine plan --preset deepseek-v3`` (the report's 2,048 × 80 GB);
- ``deepseek_v3_64x80GiB``: ``--search --devices 64 --device-memory 80GiB``;
- ``qwen3_30b_a3b_8x80GiB``: ``--search --devices 8 --device-memory 80GiB --global-batch 1024``;
- ``memfine_paper``: the MemFine presets (model II at skew 19.25 with the measured static
  memory 39.5 GiB; model I at skew 16 with Eq. 1), as ``memfine plan --preset ... --skew``;
- ``zero``: static bytes per device of pure data parallelism (t = p = e = cp = 1, dp = N) from
  memfine's Eq. 1 and from DeepSpeed's ``estimate_zero2_model_states_mem_needs`` without
  offload, which is ``2·P + 18·P/N`` bytes per GPU (16-bit parameters on every GPU; 16-bit and
  fp32 gradients, fp32 parameters and the two fp32 Adam moments partitioned over N).

Usage: ``python benchmarks/plan_examples.py [--out PATH]``. Pure arithmetic, no device needed.
Reference: MemFine Eq. 1; DeepSpeed ``deepspeed/runtime/zero/stage_1_and_2.py`` (0.19.8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from memfine.plan.layout import PlanConfig
from memfine.plan.presets import get_preset
from memfine.plan.search import search
from memfine.plan.stage import layer_activation, plan_layout, static_memory
from memfine.units import GiB

RESULTS = Path(__file__).parent / "results"


def deepspeed_zero2_gpu_bytes(total_params: int, num_gpus: int) -> int:
    """DeepSpeed's ZeRO-2 estimate per GPU without offload: 2·P + 18·P/N bytes."""
    return 2 * total_params + int(18 * total_params / num_gpus)


def _search(name: str, devices: int, global_batch: int, optimizer_bytes: int) -> dict[str, Any]:
    base = PlanConfig(model=get_preset(name), device_memory_bytes=80 * GiB,
                      global_batch=global_batch, optimizer_bytes=optimizer_bytes)
    result = search(base, devices)
    top = [{**{k: getattr(c.plan.config, k) for k in ("t", "p", "e", "dp", "cp",
                                                       "micro_batch", "recompute", "bins")},
            "peak_bytes": c.plan.peak_bytes, **dataclasses.asdict(c.cost)}
           for c in result.fitting[:5]]
    return {"devices": devices, "considered": result.considered, "fitting": len(result.fitting),
            "top": top, "smallest_device_memory_bytes": result.smallest_device_memory_bytes,
            "smallest_devices": result.smallest_devices}


def _zero_rows(name: str, devices: int) -> dict[str, Any]:
    """Pure data parallelism on ``devices``: memfine Eq. 1 (two byte conventions) vs DeepSpeed."""
    base = PlanConfig(model=get_preset(name), device_memory_bytes=80 * GiB, dp=devices)
    st = static_memory(base, 0)
    params = st.dense_params + st.expert_params
    same = static_memory(dataclasses.replace(base, grad_bytes=0, optimizer_bytes=18), 0)
    return {"model": name, "devices": devices, "params": params,
            "memfine_eq1_bytes": st.static_bytes,
            "memfine_grad0_opt18_bytes": same.static_bytes,
            "deepspeed_zero2_bytes": deepspeed_zero2_gpu_bytes(params, devices)}


def _memfine_paper() -> dict[str, Any]:
    """MemFine's reduced DeepSeek-V3 (Table 4): model II at skew 19.25, model I's need."""
    out: dict[str, Any] = {}
    for name, skew in (("memfine-paper-II", 19.25), ("memfine-paper-I", 16.0)):
        model = get_preset(name)
        setting = model.setting
        assert setting is not None, "the MemFine presets carry the paper's setting"
        values = {k: setting.get(k) for k in ("t", "p", "e", "dp")}
        static = setting.get("static_memory")
        cfg = PlanConfig(model=model, device_memory_bytes=64 * GiB, skews=(skew,),
                         static_bytes=None if static is None else int(39.5 * GiB),
                         **values)  # type: ignore[arg-type]
        plan = plan_layout(cfg)
        st = plan.stages[-1]
        sk = st.skews[0]
        out[name] = {"skew": skew, "fits": plan.fits, "s_prime_max": st.s_prime_max,
                     "eq1_static_bytes": st.static.static_bytes, "num_chunks": sk.num_chunks,
                     "activation_unchunked_bytes": sk.activation_unchunked_bytes,
                     "activation_max_chunks_bytes": sk.activation_max_chunks_bytes,
                     "activation_bytes": sk.activation_bytes,
                     "min_device_memory_bytes": plan.min_device_memory_bytes,
                     "moe_layer_activation": dataclasses.asdict(
                         layer_activation(cfg, moe_layer=True))}
    return out


def main(argv: list[str] | None = None) -> int:
    """Compute the examples and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_examples.json")
    args = parser.parse_args(argv)
    ds = get_preset("deepseek-v3")
    setting = ds.setting
    assert setting is not None, "the deepseek-v3 preset carries its published setting"
    layout = {k: setting.get(k) for k in ("t", "p", "e", "dp", "optimizer_bytes",
                                          "global_batch")}
    published = PlanConfig(model=ds, device_memory_bytes=80 * GiB, skews=(1.0, 32.0),
                           **layout)  # type: ignore[arg-type]
    plan = plan_layout(published)
    st, sk = plan.limiting
    data = {
        "deepseek_v3_published": {"fits": plan.fits, "peak_bytes": plan.peak_bytes,
                                  "limiting_stage": st.rank, "static_bytes": st.static_bytes,
                                  "skew": sk.skew, "num_chunks": sk.num_chunks},
        "deepseek_v3_64x80GiB": _search("deepseek-v3", 64, 15360, layout["optimizer_bytes"]),
        "qwen3_30b_a3b_8x80GiB": _search("qwen3-30b-a3b", 8, 1024, 12),
        "zero": [_zero_rows("qwen3-30b-a3b", 8), _zero_rows("deepseek-v3", 2048)],
        "memfine_paper": _memfine_paper(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
