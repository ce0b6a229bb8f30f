"""Per-arm figures from the ranks' raw results, and the text table."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np


def quantiles(values: list[float], *qs: float) -> list[float]:
    if not values:
        return [math.nan] * len(qs)
    return [float(v) for v in np.quantile(np.asarray(values, dtype=float), qs)]


def _lags(results: list[dict], warmup: int) -> tuple[list[int], int, int, int]:
    """Ack lags (pop step minus the step by whose start it had finished on every
    rank), acks and storage entries popped in the window, entries popped in
    different steps on different ranks."""
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
                lags.append(pop_step - max(fin))
        else:
            storage += 1
    for r in results[1:]:
        divergent += sum(1 for uid in r["popped"] if uid not in r0["popped"])
    return lags, acks, storage, divergent


def summarize_arm(results: list[dict], warmup: int, steps: int) -> dict:
    """Per-arm figures. The broadcast is split into waiting for the last rank to
    arrive (skew: e.g. a slower check on some rank) and what it took after that
    (the collective itself; a reduce left in flight on the group shows here)."""
    r0 = results[0]
    check = [x for r in results for x in r["check_ms"]]  # pooled over ranks
    bcast = [x for r in results for x in r["bcast_ms"]]
    after_last = []
    for per_step in zip(*(r["bcast_at"] for r in results)):
        last = max(t_in for t_in, _ in per_step)
        after_last += [(t_out - last) * 1000.0 for _, t_out in per_step]
    violations = [v for r in results for v in r["violations"]]
    lags, acks, storage, divergent = _lags(results, warmup)
    if divergent:
        violations.append(f"{divergent} entries popped in different steps across ranks")
    check_ms: Optional[dict] = None
    if check:
        p50, p90, p99 = quantiles(check, 0.5, 0.9, 0.99)
        check_ms = {"median": p50, "p90": p90, "p99": p99, "mean": float(np.mean(check))}
        check_ms["max"] = max(check)
    b50, b90 = quantiles(bcast, 0.5, 0.9)
    a50, a90 = quantiles(after_last, 0.5, 0.9)
    s50, s99 = quantiles(r0["step_ms"], 0.5, 0.99)
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
        "acks_popped": acks,
        "storage_popped": storage,
        "pops_per_step_mean": float(np.mean(r0["pops_per_step"])) if r0["pops_per_step"] else 0.0,
        "mean_lag_steps": float(np.mean(lags)) if lags else None,
        "max_lag_steps": max(lags) if lags else None,
        "violations": violations,
        "_check_samples": check,
    }


def _fmt(v, spec=".3f", none="-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def _pct(rel: Optional[float]) -> str:
    return "-" if rel is None else f"{rel * 100:.2f}%"


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
    "acks popped",
    "lag (steps)",
    "violations",
)


def format_table(summary: dict[str, dict]) -> str:
    rows: list[tuple[str, ...]] = [HEAD]
    for arm, s in summary.items():
        c = s["check_ms"] or {}
        rows.append(
            (
                arm,
                _fmt(c.get("median")),
                _fmt(c.get("p90")),
                _fmt(c.get("p99")),
                _fmt(s["bcast_ms"]["median"]),
                _fmt(s["bcast_ms"]["after_last_rank_median"]),
                _fmt(s["step_ms_median"], ".2f"),
                _fmt(s["steps_per_s"], ".2f"),
                _pct(s["throughput_vs_l1"]),
                str(s["acks_popped"] + s["storage_popped"]),
                _fmt(s["mean_lag_steps"], ".2f"),
                str(len(s["violations"])),
            )
        )
    return render(rows)


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
