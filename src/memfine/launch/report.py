"""Text and JSON output of ``memfine plan``: formats the memory package's frozen plans, no logic.

Bytes are shown in MiB = 2^20 and GiB = 2^30; a value that does not apply (no MoE layer on a
stage, no bin large enough) is ``-`` in text and ``null`` in JSON, never a negative number.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from memfine.launch import launch_commands, launch_lines
from memfine.plan.layout import PlanConfig
from memfine.plan.search import RANK_RULE, Candidate, SearchResult, layout_cost, parallel_kinds
from memfine.plan.stage import Plan, SkewPlan, StagePlan, plan_layout
from memfine.units import format_bytes

_FB = format_bytes
VERBOSE_SKEWS = (1.0, 2.0, 4.0, 8.0, 16.0)
"""Skews of the chosen layout's tables under ``--search --verbose`` (capped at its worst)."""


def _opt(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def layout_text(cfg: PlanConfig, *, dtype: bool = True) -> str:
    """``t=1 p=16 e=64 dp=128 cp=1 b=1 bfloat16 recompute full bins 1,2,4,8``."""
    text = (f"t={cfg.t} p={cfg.p} e={cfg.e} dp={cfg.dp} cp={cfg.cp} "
            + (f"v={cfg.v} " if cfg.v > 1 else "") + f"b={cfg.micro_batch} "
            + (f"{cfg.dtype} " if dtype else "") + f"recompute {cfg.recompute}")
    return text + (f" bins {','.join(map(str, cfg.bins))}" if cfg.recompute != "none" else "")


def _chunks(st: StagePlan, sk: SkewPlan, cfg: PlanConfig) -> str:
    """``, MACT c=2`` / ``, even with c=8`` / nothing (no MoE layer, or no chunking)."""
    if st.s_prime_max is None or cfg.recompute == "none":
        return ""
    if sk.num_chunks is None:
        return f" even with c={cfg.bins[-1]}"
    return f", MACT c={sk.num_chunks}"


def answer(plan: Plan) -> str:
    """The one-line answer: fits or not, peak per device, the limiting stage, by how much."""
    cfg = plan.config
    st, sk = plan.limiting
    where = f"stage {st.rank} at skew {sk.skew:g}{_chunks(st, sk, cfg)}"
    head = (f"{cfg.model.name} on {cfg.devices} × {_FB(cfg.device_memory_bytes)} "
            f"({layout_text(cfg)}): ")
    margin = st.budget_bytes - sk.total_bytes
    if plan.fits:
        return (head + f"fits: peak {_FB(sk.total_bytes)} per device ({where}), "
                f"{_FB(margin)} under alpha·M = {_FB(st.budget_bytes)}")
    return (head + f"does not fit: {where} needs {_FB(sk.total_bytes)}, {_FB(-margin)} over "
            f"alpha·M = {_FB(st.budget_bytes)}; the smallest device memory that fits is "
            f"{_FB(plan.min_device_memory_bytes)} (alpha={cfg.alpha:g})")


def stage_summary(st: StagePlan) -> str:
    """Static and activation of one stage at its worst skew, itemised."""
    sk, s = st.worst, st.static
    row = (f" + {st.row_bytes:,} bytes × s''={sk.recv_rows:,} rows / c"
           f" (s'_max {_opt(st.s_prime_max)} rows)" if st.row_bytes else " (no MoE layer)")
    return (f"stage {st.rank}: static {_FB(st.static_bytes)} (Eq. 1: parameters "
            f"{_FB(s.parameter_bytes)}, gradients {_FB(s.gradient_bytes)}, optimizer "
            f"{_FB(s.optimizer_state_bytes)}); activation {_FB(sk.activation_bytes)} = "
            f"{_FB(st.fixed_activation_bytes)} not scaling with s''{row}")


def _why(st: StagePlan, sk: SkewPlan, cfg: PlanConfig) -> str:
    if st.s_prime_max is None or sk.chunks_needed is None:
        kept = max(st.fixed_activation_bytes, st.floor_activation_bytes)
        return (f"stage {st.rank}: static {_FB(st.static_bytes)} + activation not scaling "
                f"with s'' {_FB(kept)} exceed alpha·M = {_FB(st.budget_bytes)}")
    return (f"stage {st.rank} at skew {sk.skew:g}: s''={sk.recv_rows:,} rows need "
            f"c=ceil({sk.recv_rows}/{st.s_prime_max})={sk.chunks_needed} > largest bin "
            f"{cfg.bins[-1] if cfg.recompute != 'none' else 1}")


def stage_tables(plan: Plan) -> list[str]:
    """Per-stage lines and per-skew tables (``--verbose``)."""
    lines = []
    for st in plan.stages:
        lines.append(f"{stage_summary(st)}; layers {st.layers[0]}-{st.layers[-1]}, "
                     f"m_g={st.in_flight}, alpha·M {_FB(st.budget_bytes)}")
        lines.append(f"  {'skew':>6} {'s_rows':>11} {'c_need':>6} {'MACT c':>6} "
                     f"{'act c=1':>11} {'act c=max':>11} {'act MACT':>11} {'total':>11} fits")
        for sk in st.skews:
            lines.append(
                f"  {sk.skew:>6g} {sk.recv_rows:>11,} {_opt(sk.chunks_needed):>6} "
                f"{_opt(sk.num_chunks):>6} {_FB(sk.activation_unchunked_bytes):>11} "
                f"{_FB(sk.activation_max_chunks_bytes):>11} {_FB(sk.activation_bytes):>11} "
                f"{_FB(sk.total_bytes):>11} {'yes' if sk.fits else 'NO'}")
    return lines


def plan_json(plan: Plan, sources: dict[str, str]) -> dict[str, Any]:
    """Everything of one plan as JSON-ready values (bytes as ints; ``null`` = not applicable)."""
    st, sk = plan.limiting
    data = dataclasses.asdict(plan)
    data.update(fits=plan.fits, peak_bytes=plan.peak_bytes, limiting_stage=st.rank,
                limiting_skew=sk.skew, min_device_memory_bytes=plan.min_device_memory_bytes,
                devices=plan.config.devices, sources=sources, answer=answer(plan),
                cost=dataclasses.asdict(layout_cost(plan.config)),
                commands=launch_commands(plan) if plan.fits else None)
    return data


def print_plan(cfg: PlanConfig, sources: dict[str, str], *, verbose: bool,
               as_json: bool) -> Plan:
    """Plan ``cfg`` and print the answer (and tables with ``verbose``), or the JSON."""
    plan = plan_layout(cfg)
    if as_json:
        print(json.dumps(plan_json(plan, sources), indent=2))
        return plan
    print(answer(plan))
    if not verbose:  # the tables say it, with every other stage
        print("  " + stage_summary(plan.limiting[0]))
    given = sorted(k for k, v in sources.items() if v in ("published", "assumed"))
    if given:
        setting = cfg.model.setting
        published = [k for k in given if sources[k] == "published"]
        assumed = [k for k in given if sources[k] == "assumed"]
        print(f"  setting of {cfg.model.name}: published {', '.join(published) or '-'}; "
              f"assumed {', '.join(assumed) or '-'}"
              + (f" ({setting.note})" if setting is not None else ""))
    if verbose:
        print("config: " + json.dumps(dataclasses.asdict(cfg)))
        _print_tables(plan)
    else:
        print("  (--verbose: every stage and skew; --json: everything)")
    if plan.fits:
        print("\n".join(launch_lines(plan)))
    return plan


def _print_tables(plan: Plan) -> None:
    """The per-stage and per-skew tables, and why each row that does not fit does not."""
    print("\n".join(stage_tables(plan)))
    for st in plan.stages:  # a stage's static reason holds at every skew: said once
        for why in dict.fromkeys(_why(st, sk, plan.config) for sk in st.skews if not sk.fits):
            print("does not fit: " + why)


def _candidate_json(c: Candidate) -> dict[str, Any]:
    cfg, (st, sk) = c.plan.config, c.plan.limiting
    return {"t": cfg.t, "p": cfg.p, "e": cfg.e, "dp": cfg.dp, "cp": cfg.cp,
            "micro_batch": cfg.micro_batch, "recompute": cfg.recompute, "bins": list(cfg.bins),
            "peak_bytes": c.plan.peak_bytes, "limiting_stage": st.rank,
            "worst_skew": sk.skew, "num_chunks": sk.num_chunks,
            "cost": dataclasses.asdict(c.cost)}


def print_search(result: SearchResult, base: PlanConfig, devices: int, *, top: int,
                 as_json: bool, verbose: bool = False) -> None:
    """The ranked layouts that fit on ``devices`` (a table of the ``top`` first), or the JSON.

    Under the table: the rule that ranked them, the commands that run the first, and with
    ``verbose`` its per-stage and per-skew tables at :data:`VERBOSE_SKEWS` and the worst skew.
    """
    head = (f"{base.model.name} on {devices} × {_FB(base.device_memory_bytes)} "
            f"(alpha={base.alpha:g}, {base.dtype}, s={base.seq_len}, global batch "
            f"{base.global_batch or 'unset: m = 4p'})")
    if as_json:
        print(json.dumps({
            "model": dataclasses.asdict(base.model), "devices": devices,
            "device_memory_bytes": base.device_memory_bytes, "considered": result.considered,
            "fits": bool(result.fitting), "merged": result.merged, "rank_rule": RANK_RULE,
            "smallest_device_memory_bytes": result.smallest_device_memory_bytes,
            "smallest_devices": result.smallest_devices,
            "layouts": [_candidate_json(c) for c in result.fitting]}, indent=2))
        return
    if not result.fitting:
        least = result.smallest_device_memory_bytes
        more = result.smallest_devices
        print(f"{head}: none of {result.considered} layouts fits at the worst skew; "
              + (f"the least device memory that fits on {devices} devices is {_FB(least)}"
                 if least is not None else "no valid layout")
              + (f"; {more} devices of {_FB(base.device_memory_bytes)} fit (full recompute, "
                 "b=1)" if more is not None else "; no device count up to N·4096 fits"))
        return
    best = result.fitting[0]
    merged = (f" ({result.merged} more differ only in bins no stage uses)"
              if result.merged else "")
    print(f"{head}: {len(result.fitting)} of {result.considered} layouts fit at the worst "
          f"skew{merged}; best: {layout_text(best.plan.config)}, peak "
          f"{_FB(best.plan.peak_bytes)}, relative time {best.cost.relative_time:.3f}")
    print(f"  {'#':>2} {'layout':<57} {'peak':>10} {'c':>2} {'recomp':>6} {'bubble':>6} "
          f"{'time':>6} {'kinds':>5}")
    for i, c in enumerate(result.fitting[:top], 1):
        sk = c.plan.limiting[1]
        print(f"  {i:>2} {layout_text(c.plan.config, dtype=False):<57} "
              f"{_FB(c.plan.peak_bytes):>10} "
              f"{_opt(sk.num_chunks):>2} {c.cost.recompute_fraction:>6.1%} "
              f"{c.cost.bubble_fraction:>6.1%} {c.cost.relative_time:>6.3f} "
              f"{parallel_kinds(c.plan.config):>5}")
    print(f"  {RANK_RULE}; time = (1 + recompute FLOPs share)·(m + p - 1)/m, communication "
          "not modelled; --json lists every layout that fits")
    if verbose:
        worst = best.plan.config.worst_skew
        chosen = dataclasses.replace(best.plan.config, skews=tuple(sorted(
            {min(x, worst) for x in (*VERBOSE_SKEWS, worst)})))
        print(f"#1 {layout_text(chosen)}:")
        _print_tables(plan_layout(chosen))
    print("\n".join(launch_lines(best.plan)))
