"""Per-arm figures from the ranks' raw results, the limits they are measured
against, and the text tables."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from hicache_async_ack_lab.bench.workload import Schedule


def quantiles(values: list[float], *qs: float) -> list[float]:
    if not values:
        return [math.nan] * len(qs)
    return [float(v) for v in np.quantile(np.asarray(values, dtype=float), qs)]


def _mean(values) -> Optional[float]:
    return float(np.mean(values)) if len(values) else None


def _acks(results: list[dict], warmup: int) -> tuple[list[tuple[int, int]], int, int, int]:
    """(pop step, lag) per ack popped in the window - lag being the pop step minus
    the step by whose start it had finished on every rank -, acks and storage
    entries popped in the window, entries popped in different steps on
    different ranks."""
    r0 = results[0]
    lags, acks, storage, divergent = [], 0, 0, 0
    for uid, (queue_name, pop_step) in r0["popped"].items():
        others = [r["popped"].get(uid) for r in results[1:]]
        if any(o is None or o[1] != pop_step for o in others):
            divergent += 1
        if pop_step < warmup:
            continue
        if queue_name in ("write", "load"):
            acks += 1
            fin = [r["finish"].get(uid) for r in results]
            if all(f is not None for f in fin):
                lags.append((pop_step, pop_step - max(f for f in fin if f is not None)))
        else:
            storage += 1
    for r in results[1:]:
        divergent += sum(1 for uid in r["popped"] if uid not in r0["popped"])
    return lags, acks, storage, divergent


def _phases(r0: dict, lags: list[tuple[int, int]], schedule: Schedule) -> list[dict]:
    """Throughput (rank 0's own step times), mean lag and mean depth per phase."""
    out = []
    warmup = schedule.warmup
    for i, (ms, _) in enumerate(schedule.phases):
        idx = [k for k in range(len(r0["step_ms"])) if schedule.phase_of(k + warmup) == i]
        secs = sum(r0["step_ms"][k] for k in idx) / 1000.0
        phase_lags = [lag for step, lag in lags if schedule.phase_of(step) == i]
        depths = [r0["depths"][k] for k in idx if k < len(r0["depths"])]
        out.append(
            {
                "latency_ms": ms,
                "steps": len(idx),
                "steps_per_s": len(idx) / secs if secs > 0 else math.nan,
                "mean_lag_steps": _mean(phase_lags),
                "mean_depth": _mean(depths),
            }
        )
    return out


def summarize_arm(results: list[dict], schedule: Schedule, local_pops: bool) -> dict:
    """Per-arm figures. The broadcast is split into waiting for the last rank to
    arrive (skew: e.g. a slower check on some rank) and what it took after that
    (the collective itself; a reduce left in flight on the group shows here).
    ``local_pops``: the arm pops each rank's own counts by design (the bound and
    the floor), so pops that differ across ranks are expected there."""
    r0 = results[0]
    check = [x for r in results for x in r["check_ms"]]  # pooled over ranks
    bcast = [x for r in results for x in r["bcast_ms"]]
    after_last = []
    for per_step in zip(*(r["bcast_at"] for r in results)):
        last = max(t_in for t_in, _ in per_step)
        after_last += [(t_out - last) * 1000.0 for _, t_out in per_step]
    violations = [v for r in results for v in r["violations"]]
    lags, acks, storage, divergent = _acks(results, schedule.warmup)
    if divergent and not local_pops:
        violations.append(f"{divergent} entries popped in different steps across ranks")
    check_ms: Optional[dict] = None
    if check:
        p50, p90, p99 = quantiles(check, 0.5, 0.9, 0.99)
        check_ms = {"median": p50, "p90": p90, "p99": p99, "mean": float(np.mean(check))}
        check_ms["max"] = max(check)
    b50, b90 = quantiles(bcast, 0.5, 0.9)
    a50, a90 = quantiles(after_last, 0.5, 0.9)
    s50, s99 = quantiles(r0["step_ms"], 0.5, 0.99)
    steps = len(r0["step_ms"])
    return {
        "path": r0["path"],
        "check_ms": check_ms,
        "bcast_ms": {
            "median": b50,
            "p90": b90,
            "after_last_rank_median": a50,
            "after_last_rank_p90": a90,
        },
        "step_ms_median": s50,
        "step_ms_p99": s99,
        "steps_per_s": steps / r0["window_s"] if r0["window_s"] > 0 else math.nan,
        "throughput_vs_l1": None,
        "throughput_vs_bound": None,
        "acks_popped": acks,
        "storage_popped": storage,
        "pops_per_step_mean": _mean(r0["pops_per_step"]) or 0.0,
        "mean_lag_steps": _mean([lag for _, lag in lags]),
        "max_lag_steps": max(lag for _, lag in lags) if lags else None,
        "phases": _phases(r0, lags, schedule) if len(schedule.phases) > 1 else [],
        "violations": violations,
        "_check_samples": check,
    }


def add_relative(figures: dict[str, dict]) -> None:
    """Throughput of every arm relative to L1 and to the zero-sync bound."""
    for ref, key in (("l1", "throughput_vs_l1"), ("bound", "throughput_vs_bound")):
        if ref in figures and figures[ref]["steps_per_s"]:
            base = figures[ref]["steps_per_s"]
            for s in figures.values():
                s[key] = s["steps_per_s"] / base


def limits(figures: dict[str, dict]) -> dict[str, dict]:
    """Against the limit, per pipelined arm (from the medians of the check):
    the sync cost left above the bound, as a share of what blocking costs above
    it, split into the one collective's share (floor - bound) and the plugin's
    own (pipelined - floor); and steps/s relative to the bound and the floor."""
    need = ("blocking", "bound", "floor")
    if not all(figures.get(a, {}).get("check_ms") for a in need):
        return {}
    med = {a: figures[a]["check_ms"]["median"] for a in need}
    span = med["blocking"] - med["bound"]
    out = {}
    for arm, s in figures.items():
        if not arm.startswith("pipelined") or not s["check_ms"] or span <= 0:
            continue
        p = s["check_ms"]["median"]
        out[arm] = {
            "sync_cost_left": (p - med["bound"]) / span,
            "collective_share": (med["floor"] - med["bound"]) / span,
            "plugin_share": (p - med["floor"]) / span,
            "vs_bound_steps": s["steps_per_s"] / figures["bound"]["steps_per_s"],
            "vs_floor_steps": s["steps_per_s"] / figures["floor"]["steps_per_s"],
        }
    return out


def fmt(v, spec=".3f", none="-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def pct(rel: Optional[float], spec=".2f") -> str:
    return "-" if rel is None or math.isnan(rel) else f"{rel * 100:{spec}}%"


HEAD = (
    "arm",
    "check p50 ms",
    "p90",
    "p99",
    "bcast p50",
    "after last",
    "step p50 ms",
    "steps/s",
    "vs L1",
    "vs bound",
    "popped",
    "lag (steps)",
    "violations",
)


def format_table(figures: dict[str, dict]) -> str:
    rows: list[tuple[str, ...]] = [HEAD]
    for arm, s in figures.items():
        c = s["check_ms"] or {}
        rows.append(
            (
                arm,
                fmt(c.get("median")),
                fmt(c.get("p90")),
                fmt(c.get("p99")),
                fmt(s["bcast_ms"]["median"]),
                fmt(s["bcast_ms"]["after_last_rank_median"]),
                fmt(s["step_ms_median"], ".2f"),
                fmt(s["steps_per_s"], ".2f"),
                pct(s["throughput_vs_l1"]),
                pct(s["throughput_vs_bound"]),
                str(s["acks_popped"] + s["storage_popped"]),
                fmt(s["mean_lag_steps"], ".2f"),
                str(len(s["violations"])),
            )
        )
    return render(rows)


def format_limits(lim: dict[str, dict]) -> str:
    head = ("arm", "sync cost left", "= collective", "+ plugin", "steps/s vs bound", "vs floor")
    rows: list[tuple[str, ...]] = [head]
    for arm, x in lim.items():
        rows.append(
            (
                arm,
                pct(x["sync_cost_left"], ".1f"),
                pct(x["collective_share"], ".1f"),
                pct(x["plugin_share"], ".1f"),
                pct(x["vs_bound_steps"]),
                pct(x["vs_floor_steps"]),
            )
        )
    return render(rows)


def format_phases(figures: dict[str, dict]) -> str:
    """Per injected-latency phase: steps/s relative to the bound (else L1), mean
    lag, and mean depth, for every arm that ran the phases."""
    ref = "bound" if "bound" in figures else "l1" if "l1" in figures else None
    arms = [a for a, s in figures.items() if s["phases"]]
    if not arms:
        return ""
    phases = figures[arms[0]]["phases"]
    head = ["arm"] + [f"{p['latency_ms']:g} ms ({p['steps']} steps)" for p in phases]
    rows: list[Sequence[str]] = [head]
    for arm in arms:
        cells = [arm]
        for i, p in enumerate(figures[arm]["phases"]):
            base = figures[ref]["phases"][i]["steps_per_s"] if ref else math.nan
            rel = p["steps_per_s"] / base if ref and base else None
            depth = f" d{p['mean_depth']:.2f}" if p["mean_depth"] is not None else ""
            cells.append(f"{pct(rel, '.1f')} lag {fmt(p['mean_lag_steps'], '.2f')}{depth}")
        rows.append(cells)
    label = f"per phase: steps/s vs {ref or '-'}, mean ack lag (steps), mean depth"
    return label + "\n" + render(rows)


def render(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, a rule under the head."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
