"""``bench-server --workload pd``'s report (pd.py runs the rounds): the arm table, every
ratio paired by round with its 95% interval, what an injected latency adds to the
sync on a decode pass, and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from hicache_async_ack_lab.bench.stats import Claim, paired_difference, paired_ratio, verdict
from hicache_async_ack_lab.bench.summary import render

PD_ARMS = ("stock", "plugin", "bound")
FIGURES = (("output_throughput", "out tok/s"), ("median_itl_ms", "ITL p50 ms"))
HEADLINE = 0.95  # plugin at latency / its own 0 ms


Conf = tuple[str, float]  # (arm, injected latency in ms): one decode server's setting
Spec = tuple[str, Conf, Conf, Optional[Claim]]


def conf_of(visit: dict) -> Conf:
    return visit["arm"], visit["latency_ms"]


def confs_of(visits: list[dict]) -> list[Conf]:
    """The settings the visits ran, by latency, then in PD_ARMS' order."""
    return sorted({conf_of(v) for v in visits}, key=lambda c: (c[1], PD_ARMS.index(c[0])))


def ratio_specs(cfg: dict) -> list[tuple[str, Conf, Conf, Optional[Claim], float]]:
    """(name, numerator, denominator, claim or None: printed only, latency)."""
    arms = set(cfg["arms"])
    out: list[tuple[str, Conf, Conf, Optional[Claim], float]] = []
    for lat in cfg["latencies_ms"]:
        plugin, stock, bnd = ("plugin", lat), ("stock", lat), ("bound", 0.0)
        specs: list[Spec] = [("plugin / stock", plugin, stock, None),
                 ("plugin / bound", plugin, bnd, None),
                 ("stock / bound", stock, bnd, None)]  # fmt: skip
        if lat and 0.0 in cfg["latencies_ms"]:
            specs += [("plugin / own 0 ms", plugin, ("plugin", 0.0), Claim(HEADLINE)),
                      ("stock / own 0 ms", stock, ("stock", 0.0), None)]  # fmt: skip
        out += [(n, a, b, c, lat) for n, a, b, c in specs if a[0] in arms and b[0] in arms]
    return out


def ratios(cfg: dict, visits: list[dict]) -> list[dict]:
    """Every ratio of both figures, paired by round (ITL: lower is better, so its
    ratio is the denominator's ITL over the numerator's: > 1 is faster, as for tok/s)."""
    rows = []
    for key, label in FIGURES:
        by: dict = {}
        for v in visits:
            if v.get(key):
                by.setdefault(conf_of(v), {})[v["round"]] = v[key]
        for name, num, den, claim, lat in ratio_specs(cfg):
            a, b = by.get(num, {}), by.get(den, {})
            common = sorted(set(a) & set(b))
            if not common:
                continue
            x, y = [a[r] for r in common], [b[r] for r in common]
            iv = paired_ratio(y, x) if key == "median_itl_ms" else paired_ratio(x, y)
            rows.append({"figure": label, "ratio": name, "latency_ms": lat, "n": iv.n,
                         "value": iv.ratio, "low": iv.low, "high": iv.high,
                         "interval": iv.fmt(), "claim": str(claim) if claim else "-",
                         "verdict": verdict(iv, claim) if claim else "-"})  # fmt: skip
    return rows


CHECK_COLUMNS = (("sync_ms_running", "passes_running", "sync ms: running"),
                 ("sync_ms_idle", "passes_idle", "idle"),
                 ("pops_ms_running", "passes_running", "pops ms: running"))  # fmt: skip


def arm_table(visits: list[dict]) -> str:
    rows: list[tuple[str, ...]] = [("arm", "injected", "rounds", "out tok/s median", "range",
                                    "ITL p50 ms median", "range",
                                    *(c[2] for c in CHECK_COLUMNS), "start-up s")]  # fmt: skip
    for arm, lat in confs_of(visits):
        vs = [v for v in visits if conf_of(v) == (arm, lat)]
        cells = []
        for key, _ in FIGURES:
            vals = [v[key] for v in vs if v.get(key)]
            cells += [f"{statistics.median(vals):.2f}" if vals else "-",
                      f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"]  # fmt: skip
        for key, passes, _ in CHECK_COLUMNS:  # visits before the pass-times device: "-"
            vals = [v[key] for v in vs if v.get(passes)]
            cells.append(f"{statistics.median(vals):.3f}" if vals else "-")
        ups = [v["startup_s"] for v in vs if v.get("startup_s")]
        rows.append((arm, "-" if arm == "bound" else f"{lat:g} ms", str(len(vs)), *cells,
                     f"{statistics.median(ups):.0f}" if ups else "-"))  # fmt: skip
    return render(rows)


def sync_rows(cfg: dict, visits: list[dict]) -> list[dict]:
    """What an injected latency adds to the sync on a pass with a running batch (ms,
    paired by round within one decode server): stock's blocking reduce takes it on
    every such pass; the plugin's wait should not."""

    def by_round(arm: str, lat: float) -> dict:
        return {v["round"]: v["sync_ms_running"] for v in visits
                if conf_of(v) == (arm, lat) and v.get("passes_running")}  # fmt: skip

    rows = []
    for arm in ("stock", "plugin"):
        own = by_round(arm, 0.0)
        for lat in [x for x in cfg["latencies_ms"] if x]:
            at = by_round(arm, lat)
            common = sorted(set(own) & set(at))
            if common:
                iv = paired_difference([at[r] for r in common], [own[r] for r in common])
                rows.append({"arm": arm, "latency_ms": lat, "n": iv.n, "added_ms": iv.ratio,
                             "low": iv.low, "high": iv.high, "interval": iv.fmt()})  # fmt: skip
    return rows


def sync_table(rows: list[dict]) -> str:
    out: list[tuple[str, ...]] = [("sync ms per pass with a running batch", "injected",
                                   "rounds", "added vs own 0 ms [95% interval]")]  # fmt: skip
    out += [(r["arm"], f"{r['latency_ms']:g} ms", str(r["n"]), r["interval"]) for r in rows]
    return render(out)


def ratio_table(rows: list[dict]) -> str:
    out: list[tuple[str, ...]] = [("figure", "ratio", "injected", "rounds",
                                   "value [95% interval]", "claim", "verdict")]  # fmt: skip
    for r in rows:
        out.append((r["figure"], r["ratio"], f"{r['latency_ms']:g} ms", str(r["n"]),
                    r["interval"], r["claim"], r["verdict"]))  # fmt: skip
    return render(out)


def title_of(cfg: dict) -> str:
    return (
        f"real PD pair (prefill TP 1, decode TP {cfg['tp']} with KV offload to a file store, "
        f"Mooncake TCP, SGLang's router), generated-shared-prefix {cfg['num_groups']}x"
        f"{cfg['prompts_per_group']} (system {cfg['system_prompt_len']}, question "
        f"{cfg['question_len']}, output {cfg['output_len']} tokens), concurrency "
        f"{cfg['max_concurrency'] or 'unbounded'}; {cfg['rounds']} rounds, a fresh pair each; "
        f"{cfg['runs']} run(s) per latency, every latency in one decode server per arm"
    )


def draw_png(path: Path, cfg: dict, visits: list[dict]) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hicache_async_ack_lab.bench.plot import color

    colors = {"stock": "blocking", "plugin": "pipelined", "bound": "bound"}
    confs = confs_of(visits)
    panels = list(FIGURES)
    if any(v.get("passes_running") for v in visits):
        panels.append(("sync_ms_running", "sync ms per pass with a running batch"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6))
    for ax, (key, label) in zip(axes, panels):
        for i, conf in enumerate(confs):
            pts = [v[key] for v in visits if conf_of(v) == conf and v.get(key)]
            if pts:
                ax.bar(i, statistics.median(pts), 0.7, color=color(colors[conf[0]]))
                ax.plot([i] * len(pts), pts, "k.", markersize=4)
        ax.set_xticks(range(len(confs)),
                      [a if a == "bound" else f"{a}\n{lat:g} ms" for a, lat in confs])  # fmt: skip
        ax.set_ylabel(f"{label}\n(median of rounds; dots: each round)")
    fig.suptitle("\n".join(textwrap.wrap(title_of(cfg), 110)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
