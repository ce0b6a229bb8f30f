"""The shared-prompt workload's figures (shared_prompt.py): per measured run, per arm
with intervals across rounds, each arm / stock paired by round, and the issue's goal.

The goal (issue 52), read-once against stock, paired by round: L3 keys read per
request at most a third of stock's in the dense and burst patterns and not above
stock's in any; TTFT p50 and p99 not above stock's beyond noise. "Beyond noise" is
the 95% interval of the paired ratio lying wholly above 1 (fails); one round gives
no interval (inconclusive). Printed, never asserted: the box decides what it shows.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hicache_async_ack_lab.bench.stats import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    Claim,
    Interval,
    paired_ratio,
    t975,
    verdict,
)
from hicache_async_ack_lab.bench.summary import render

# (key in a run's figures, column, format)
FIGURES = (
    ("l3_queries_per_request", "L3 queries/req", ".1f"),
    ("l3_keys_read_per_request", "keys read/req", ".0f"),
    ("median_ttft_ms", "TTFT p50 ms", ".0f"),
    ("p99_ttft_ms", "TTFT p99 ms", ".0f"),
    ("output_throughput", "out tok/s", ".1f"),
    ("read_once_waits", "read-once waits", ".1f"),
    ("read_once_saved_tokens", "saved tokens", ".0f"),
)
RATIO_FIGURES = FIGURES[:5]  # what each arm is held against stock on
STOCK, READ_ONCE = "stock", "read-once"
ARM_ORDER = (STOCK, "plugin", READ_ONCE)
FEWER_READS = ("dense", "burst")  # where read-once must read at most a third of stock's
ONE_THIRD = Claim(1 / 3, "<")


def round_figures(
    replies: list[dict],
    wall: float,
    before: Mapping[str, float],
    after: Mapping[str, float],
    read_once: Mapping[str, Optional[float]],
) -> dict:
    """One measured run: the replies' TTFT and throughput, the master's counters'
    growth (before / after: mooncake_metrics.parse snapshots), the read-once counts."""
    from hicache_async_ack_lab.bench.storage import round_figures as replies_figures
    from hicache_async_ack_lab.cpu_server.mooncake_metrics import l3_work

    if not replies:
        raise ValueError("a measured run with no request")
    base = replies_figures(replies, wall, {})
    keep = ("wall_s", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "storage_tokens")
    l3 = l3_work(before, after)
    n = len(replies)
    per_request = {f"{k}_per_request": v / n for k, v in l3.items()}
    return {"requests": n, **{k: base[k] for k in keep}, **l3, **per_request, **read_once}


def _mean_interval(values: Sequence[float]) -> Optional[Interval]:
    """The mean across rounds and its 95% t-interval (none from one round)."""
    if not values:
        return None
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return Interval(mean, None, None, 1)
    half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def cell(iv: Optional[Interval], spec: str) -> str:
    if iv is None:
        return "-"
    if iv.low is None or iv.high is None:
        return format(iv.ratio, spec)
    return f"{iv.ratio:{spec}} [{iv.low:{spec}}, {iv.high:{spec}}]"


def per_round(visits: list[dict], arm: str, lat: float, pattern: str, key: str) -> dict[int, float]:
    """round -> the visit's median over its runs of ``key`` in ``pattern``."""
    out = {}
    for v in visits:
        fig = v["patterns"].get(pattern, {}).get("median", {}).get(key)
        if v["arm"] == arm and v["latency_ms"] == lat and fig is not None:
            out[v["round"]] = float(fig)
    return out


def paired(visits: list[dict], arm: str, lat: float, pattern: str, key: str) -> Optional[Interval]:
    """``arm`` / stock over the rounds both ran with the figure above zero."""
    a, b = (per_round(visits, x, lat, pattern, key) for x in (arm, STOCK))
    common = sorted(r for r in set(a) & set(b) if a[r] > 0 and b[r] > 0)
    if not common:
        return None
    return paired_ratio([a[r] for r in common], [b[r] for r in common])


def _confs(visits: list[dict]) -> list[tuple[str, float]]:
    confs = {(v["arm"], v["latency_ms"]) for v in visits}
    return sorted(confs, key=lambda c: (c[1], ARM_ORDER.index(c[0])))


def arm_table(cfg: dict, visits: list[dict]) -> str:
    rows: list[tuple[str, ...]] = [("pattern", "arm", "injected", "rounds",
                                    *(c for _, c, _ in FIGURES))]  # fmt: skip
    for pattern in cfg["patterns"]:
        for arm, lat in _confs(visits):
            cols = [per_round(visits, arm, lat, pattern, k) for k, _, _ in FIGURES]
            cells = [
                cell(_mean_interval(list(c.values())), s) for c, (_, _, s) in zip(cols, FIGURES)
            ]
            rows.append((pattern, arm, f"{lat:g} ms", str(len(cols[2])), *cells))
    return render(rows)


def ratio_table(cfg: dict, visits: list[dict]) -> str:
    rows: list[tuple[str, ...]] = [("pattern", "ratio", "injected",
                                    *(c for _, c, _ in RATIO_FIGURES))]  # fmt: skip
    arms = [a for a in ARM_ORDER[1:] if any(v["arm"] == a for v in visits)]
    for lat in sorted({v["latency_ms"] for v in visits}):
        for pattern in cfg["patterns"]:
            for arm in arms:
                ivs = [paired(visits, arm, lat, pattern, k) for k, _, _ in RATIO_FIGURES]
                rows.append((pattern, f"{arm} / stock", f"{lat:g} ms",
                             *(cell(iv, ".2f") for iv in ivs)))  # fmt: skip
    return render(rows)


def not_above(iv: Optional[Interval]) -> str:
    """Not above stock beyond noise: fails only where the whole interval is above 1."""
    if iv is None or iv.low is None:
        return INCONCLUSIVE
    return FAILS if iv.low > 1 else HOLDS


def goal(cfg: dict, visits: list[dict], lat: float) -> list[dict]:
    """The goal's clauses at one injected latency, read-once / stock by round."""
    out = []
    for pattern in cfg["patterns"]:
        keys = paired(visits, READ_ONCE, lat, pattern, "l3_keys_read_per_request")
        if pattern in FEWER_READS:
            ok = INCONCLUSIVE if keys is None else verdict(keys, ONE_THIRD)
            out.append((pattern, "keys read/req", "<= 1/3", keys, ok))
        else:
            out.append((pattern, "keys read/req", "not above", keys, not_above(keys)))
        for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
            iv = paired(visits, READ_ONCE, lat, pattern, key)
            out.append((pattern, label, "not above", iv, not_above(iv)))
    none = Interval(math.nan, None, None, 0)
    return [{"pattern": p, "figure": f, "claim": c, "verdict": v,
             "ratio": None if iv is None else iv.ratio, "low": (iv or none).low,
             "high": (iv or none).high} for p, f, c, iv, v in out]  # fmt: skip


def overall(clauses: list[dict]) -> str:
    verdicts = [c["verdict"] for c in clauses]
    if FAILS in verdicts:
        return FAILS
    return HOLDS if verdicts and all(v == HOLDS for v in verdicts) else INCONCLUSIVE


def print_report(cfg: dict, visits: list[dict]) -> dict:
    """The tables and the goal's verdict lines; returns them for the record."""
    print(title_of(cfg))
    print(arm_table(cfg, visits))
    print()
    print(ratio_table(cfg, visits))
    goals = {}
    if {STOCK, READ_ONCE} <= {v["arm"] for v in visits}:
        for lat in sorted({v["latency_ms"] for v in visits}):
            clauses = goal(cfg, visits, lat)
            goals[f"{lat:g}"] = {"verdict": overall(clauses), "clauses": clauses}
            print(f"\ngoal at {lat:g} ms (read-once / stock, paired by round; keys read/req "
                  f"<= 1/3 in dense and burst, nothing above stock beyond noise): "
                  f"{goals[f'{lat:g}']['verdict']}")  # fmt: skip
            for c in clauses:
                iv = None if c["ratio"] is None else Interval(c["ratio"], c["low"], c["high"], 0)
                print(f"  {c['pattern']:<8} {c['figure']:<14} {cell(iv, '.3f'):<24} "
                      f"{c['claim']:<10} {c['verdict']}")  # fmt: skip
    silent = [v for v in visits if v["arm"] == READ_ONCE and not _read_once_seen(v)]
    if silent:
        print(f"\nnote: {len(silent)} read-once server(s) exported no read-once counters "
              "(a runtime without the mechanism runs that arm as the plugin)")  # fmt: skip
    return {"goal": goals}


def _read_once_seen(visit: dict) -> bool:
    return any(r.get("read_once_waits") is not None
               for p in visit["patterns"].values() for r in p["runs"])  # fmt: skip


def title_of(cfg: dict) -> str:
    gaps = f"poisson {cfg['poisson_gap_ms']:g} ms mean gap, dense {cfg['dense_gap_ms']:g} ms"
    return (
        f"real server on Mooncake, TP={cfg['tp']}, write-through: a "
        f"{cfg.get('prompt_tokens_counted', cfg['prompt_tokens'])}-token system prompt shared "
        f"by {cfg['requests']} requests per run (+{cfg['question_words']} words each), "
        f"arrivals {', '.join(cfg['patterns'])} ({gaps}), device and host flushed before "
        f"each run, output {cfg['output_len']} tokens, device pool {cfg['max_total_tokens']}, "
        f"host x{cfg['hicache_ratio']:g}; {cfg['rounds']} round(s) x {cfg['runs']} run(s), a "
        "fresh server and master each; intervals: 95% across rounds"
    )


def visit_line(rec: dict) -> str:
    parts = []
    for pattern, p in rec["patterns"].items():
        m = p["median"]
        parts.append(f"{pattern} keys read/req {m.get('l3_keys_read_per_request', 0):.0f}, "
                     f"TTFT p50 {m.get('median_ttft_ms', 0):.0f} ms")  # fmt: skip
    return "; ".join(parts) + f"; {rec['keys_stored']} keys stored after warm-up"


def draw_png(path: Path, cfg: dict, visits: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confs = _confs(visits)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.8 / max(1, len(confs))
    panels = (("l3_keys_read_per_request", "L3 keys read per request"),
              ("median_ttft_ms", "TTFT p50 ms"))  # fmt: skip
    for ax, (key, label) in zip(axes, panels):
        for j, (arm, lat) in enumerate(confs):
            for i, pattern in enumerate(cfg["patterns"]):
                pts = list(per_round(visits, arm, lat, pattern, key).values())
                if not pts:
                    continue
                x = i + (j - (len(confs) - 1) / 2) * width
                ax.bar(x, statistics.median(pts), width, color=f"C{ARM_ORDER.index(arm)}",
                       alpha=1.0 if lat == confs[0][1] else 0.5,
                       label=f"{arm} {lat:g} ms" if i == 0 else None)  # fmt: skip
                ax.plot([x] * len(pts), pts, "k.", markersize=4)
        ax.set_xticks(range(len(cfg["patterns"])), cfg["patterns"])
        ax.set_ylabel(label + " (median of rounds; dots: each)")
        ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title_of(cfg), 110)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
