"""bench-server's figures: what is run per round, the paired ratios, the table, the PNG."""

from __future__ import annotations

import os
import statistics
import textwrap
from pathlib import Path
from typing import Optional

from hicache_async_ack_lab.bench.stats import Claim, paired_ratio, verdict
from hicache_async_ack_lab.bench.summary import render

Conf = tuple[str, float, Optional[int]]  # (arm, injected ms, lanes or None for gsp)
# l1, the bound and the local reduce delay no HiCache collective: one visit per round
# stands for every latency.
NO_LATENCY_ARMS = ("l1", "bound", "local")
ARM_ORDER = ("l1", "bound", "local", "stock", "plugin", "dedicated")
LATENCY_ARMS = ("stock", "plugin", "dedicated")


def configs(cfg: dict) -> list[Conf]:
    """One round's servers: per lanes value, l1 and bound once, stock and plugin per latency."""
    out: list[Conf] = []
    for lanes in cfg["lanes"]:
        out += [(a, 0.0, lanes) for a in NO_LATENCY_ARMS if a in cfg["arms"]]
        for lat in cfg["latencies_ms"]:
            out += [(a, lat, lanes) for a in LATENCY_ARMS if a in cfg["arms"]]
    return out


def _ratio_specs(cfg: dict) -> list[tuple[str, Conf, Conf, Claim, float, Optional[int]]]:
    """(name, numerator, denominator, claim, latency, lanes) for every ratio the arms allow."""
    arms, specs = set(cfg["arms"]), []
    for lanes in cfg["lanes"]:
        if {"bound", "l1"} <= arms:  # HiCache's own cost, no collective at all
            specs.append(
                ("bound / L1", ("bound", 0.0, lanes), ("l1", 0.0, lanes), Claim(0.98), 0.0, lanes)
            )
        if {"local", "bound"} <= arms:  # what popping a step late costs, collective aside
            local, bnd = ("local", 0.0, lanes), ("bound", 0.0, lanes)
            specs.append(("local / bound", local, bnd, Claim(0.98), 0.0, lanes))
        for lat in cfg["latencies_ms"]:
            plugin, stock = ("plugin", lat, lanes), ("stock", lat, lanes)
            dedicated, bnd = ("dedicated", lat, lanes), ("bound", 0.0, lanes)
            pairs = [
                # At 0 ms the plugin must cost nothing; with latency it must beat stock.
                ("plugin / stock", plugin, stock, Claim(1.0 if lat else 0.98)),
                ("plugin / bound", plugin, ("bound", 0.0, lanes), Claim(0.98)),
                ("plugin / L1", plugin, ("l1", 0.0, lanes), Claim(0.98)),
                # what the real async collective costs beside the same step-late pop
                ("plugin / local", plugin, ("local", 0.0, lanes), Claim(0.98)),
                # the same reduce on a gloo group of its own (measurement device)
                ("dedicated / bound", dedicated, bnd, Claim(0.98)),
                ("dedicated / plugin", dedicated, plugin, Claim(1.0)),
                ("stock / L1", stock, ("l1", 0.0, lanes), Claim(1.0, "<")),
            ]
            if lat and 0.0 in cfg["latencies_ms"]:
                pairs += [
                    ("stock / own 0 ms", stock, ("stock", 0.0, lanes), Claim(1.0, "<")),
                    ("plugin / own 0 ms", plugin, ("plugin", 0.0, lanes), Claim(0.98)),
                ]
            specs += [
                (n, a, b, c, lat, lanes) for n, a, b, c in pairs if a[0] in arms and b[0] in arms
            ]
    return specs


def _by_conf(visits: list[dict]) -> dict[Conf, dict[int, float]]:
    out: dict[Conf, dict[int, float]] = {}
    for v in visits:
        if v["output_throughput"]:
            conf = (v["arm"], v["latency_ms"], v["lanes"])
            out.setdefault(conf, {})[v["round"]] = v["output_throughput"]
    return out


def ratios(cfg: dict, visits: list[dict]) -> list[dict]:
    """Every ratio, paired by round, with its 95% interval and its claim's verdict."""
    by = _by_conf(visits)
    rows = []
    for name, num, den, claim, lat, lanes in _ratio_specs(cfg):
        a, b = by.get(num, {}), by.get(den, {})
        common = sorted(set(a) & set(b))
        if not common:
            continue
        iv = paired_ratio([a[r] for r in common], [b[r] for r in common])
        rows.append(
            {
                "ratio": name,
                "latency_ms": lat,
                "lanes": lanes,
                "rounds": common,
                "per_round": [a[r] / b[r] for r in common],
                "value": iv.ratio,
                "low": iv.low,
                "high": iv.high,
                "n": iv.n,
                "claim": str(claim),
                "verdict": verdict(iv, claim),
                "interval": iv.fmt(),
            }
        )
    return rows


def title_of(cfg: dict) -> str:
    if cfg["workload"] == "multiturn":
        lanes = ",".join(str(x) for x in cfg["lanes"])
        work = (
            f"multi-turn {lanes} lanes x {cfg['turns']} turns (system {cfg['system_words']}"
            f" words, question {cfg['question_words']} words, reply {cfg['output_len']} "
            "tokens; bench_serving agentic-trace)"
        )
    else:
        work = (
            f"generated-shared-prefix {cfg['num_groups']}x{cfg['prompts_per_group']} "
            f"(system {cfg['system_prompt_len']}, question {cfg['question_len']}, "
            f"output {cfg['output_len']} tokens)"
        )
    return (
        f"real server, TP={cfg['tp']}, {work}, device pool {cfg['max_total_tokens']} "
        f"tokens, {cfg['rounds']} rounds x {cfg['runs']} run(s)"
    )


def _lanes_col(lanes: Optional[int]) -> str:
    return "-" if lanes is None else str(lanes)


def arm_table(visits: list[dict], tp: int = 1) -> str:
    head = (
        "arm",
        "injected",
        "lanes",
        "rounds",
        "out tok/s median",
        "range",
        "host hits",
        "load start-end",
        "start-up s",
        "ack wait",
    )
    rows: list[tuple[str, ...]] = [head]
    seen: list[Conf] = []
    for v in visits:
        conf = (v["arm"], v["latency_ms"], v["lanes"])
        if conf not in seen:
            seen.append(conf)
    seen.sort(key=lambda c: (c[2] or 0, c[1], ARM_ORDER.index(c[0])))
    for conf in seen:
        vs = [v for v in visits if (v["arm"], v["latency_ms"], v["lanes"]) == conf]
        tput = [v["output_throughput"] for v in vs if v["output_throughput"]]
        shares = [r["host_share"] for v in vs for r in v["runs"] if r.get("host_share") is not None]
        loads = [x for v in vs for x in (v["loadavg_start"][0], v["loadavg_end"][0])]
        ups = [v["startup_s"] for v in vs if v["startup_s"]]
        # the plugin's wait on due reduces, per rank, as a share of the client's runs
        waits = [
            (r["ack_wait_s"], r["client_wall_s"] * tp)
            for v in vs
            for r in v["runs"]
            if r.get("ack_waits") and r.get("client_wall_s")
        ]
        lat = "-" if conf[0] in NO_LATENCY_ARMS else f"{conf[1]:g} ms"
        rows.append(
            (
                conf[0],
                lat,
                _lanes_col(conf[2]),
                str(len(vs)),
                f"{statistics.median(tput):.1f}" if tput else "-",
                f"{min(tput):.0f}-{max(tput):.0f}" if tput else "-",
                f"{100 * statistics.mean(shares):.0f}%" if shares else "-",
                f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-",
                f"{statistics.median(ups):.0f}" if ups else "-",
                f"{100 * sum(w for w, _ in waits) / sum(t for _, t in waits):.1f}%"
                if waits
                else "-",
            )
        )
    return render(rows)


def ratio_table(rows: list[dict]) -> str:
    head = ("ratio", "injected", "lanes", "rounds", "value [95% interval]", "claim", "verdict")
    out: list[tuple[str, ...]] = [head]
    for r in rows:
        lat = "-" if r["ratio"] in ("bound / L1", "local / bound") else f"{r['latency_ms']:g} ms"
        out.append(
            (
                r["ratio"],
                lat,
                _lanes_col(r["lanes"]),
                str(r["n"]),
                r["interval"],
                r["claim"],
                r["verdict"],
            )
        )
    return render(out)


def seed_table(cfg: dict, rows: list[dict]) -> Optional[str]:
    """The seed's form: each L2 arm as a share of L1, per injected latency."""
    if "l1" not in cfg["arms"]:
        return None
    out: list[tuple[str, ...]] = [("injected", "lanes", "L1", "L2 stock", "L2 plugin", "bound")]
    by = {(r["ratio"], r["lanes"], r["latency_ms"]): r["interval"] for r in rows}
    for lanes in cfg["lanes"]:
        for lat in cfg["latencies_ms"]:
            out.append(
                (
                    f"{lat:g} ms",
                    _lanes_col(lanes),
                    "1.00",
                    by.get(("stock / L1", lanes, lat), "-"),
                    by.get(("plugin / L1", lanes, lat), "-"),
                    by.get(("bound / L1", lanes, 0.0), "-"),
                )
            )
    return render(out)


def print_report(cfg, visits, rows, load_start, load_end, wall_s, workdir: Path) -> None:
    from hicache_async_ack import __version__

    print(f"hicache-async-ack-lab bench-server {__version__}: {title_of(cfg)}")
    print(
        f"host: {os.cpu_count()} CPUs, load average {load_start[0]:.2f} at start, "
        f"{load_end[0]:.2f} at end; {len(visits)} server runs in {wall_s / 60:.1f} min; "
        f"logs in {workdir}"
    )
    print(arm_table(visits, cfg["tp"]))
    print()
    print(ratio_table(rows))
    seed = seed_table(cfg, rows)
    if seed:
        print("\nvs L1 (the seed's form; B200 TP=4, 3.2 ms: stock 0.79, plugin 0.994):")
        print(seed)
    n_inc = sum(r["verdict"] == "inconclusive" for r in rows)
    if n_inc:
        print(
            f"\n{n_inc} of {len(rows)} claims inconclusive: the 95% interval spans the "
            "threshold, or one round gave none (more rounds, or a quieter box, narrow it)."
        )
    if "bound" in cfg["arms"]:
        print(
            "bound: every HiCache collective answered with the rank's own value; valid "
            "because on CPU without skew every rank's counts are equal."
        )
    if "local" in cfg["arms"]:
        print(
            "local: the plugin a step late as usual, its reduces answered with the rank's "
            "own value (valid as the bound is): local / bound is the step-late pop's cost, "
            "plugin / local the real collective's."
        )


def prefetch_votes(server) -> dict:
    """Rank 0's prefetch votes from the server's /metrics: operations and passes."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"operations": 0.0, "passes": 0.0}
    for family in text_string_to_metric_families(server.get("/metrics").decode()):
        for s in family.samples:
            if s.labels.get("tp_rank") != "0":
                continue
            if s.name == "sglang:hicache_prefetch_votes_operations_total":
                out["operations"] += s.value
            elif s.name == "sglang:hicache_prefetch_votes_issue_seconds_count":
                out["passes"] += s.value
    return out


def medians(runs: list[dict]) -> dict:
    """Per figure, the median of the runs that have it."""
    out = {}
    for key in {k for r in runs for k in r}:
        values = [float(r[key]) for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def draw_png(path: Path, cfg: dict, visits: list[dict], rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hicache_async_ack_lab.bench.plot import color

    fig, ax = plt.subplots(figsize=(7, 4.2))
    title = "\n".join(textwrap.wrap(title_of(cfg), 90))
    if len(cfg["lanes"]) > 1:  # the sweep: ratios against lanes, with intervals
        lat = max(cfg["latencies_ms"])
        for name, c in (("plugin / stock", "blocking"), ("plugin / bound", "bound")):
            pts = [r for r in rows if r["ratio"] == name and r["latency_ms"] == lat]
            if not pts:
                continue
            xs = [r["lanes"] for r in pts]
            ys = [r["value"] for r in pts]
            err = [
                [r["value"] - (r["low"] or r["value"]) for r in pts],
                [(r["high"] or r["value"]) - r["value"] for r in pts],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4, color=color(c), label=name)
        ax.axhline(1.0, color="#888888", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cfg["lanes"], [str(x) for x in cfg["lanes"]])
        ax.set_xlabel(f"concurrent lanes ({lat:g} ms injected)")
        ax.set_ylabel("throughput ratio (95% interval over rounds)")
    else:
        arm_color = {
            "l1": "l1",
            "bound": "bound",
            "local": "floor",
            "stock": "blocking",
            "plugin": "pipelined",
            "dedicated": "pipelined",
        }
        confs = configs(cfg)
        for i, conf in enumerate(confs):
            tput = [
                float(v["output_throughput"])
                for v in visits
                if (v["arm"], v["latency_ms"], v["lanes"]) == conf and v["output_throughput"]
            ]
            if not tput:
                continue
            ax.bar(i, statistics.median(tput), 0.7, color=color(arm_color[conf[0]]))
            ax.plot([i] * len(tput), tput, "k.", markersize=4)
        labels = [a if a in NO_LATENCY_ARMS else f"{a}\n{lat:g} ms" for a, lat, _ in confs]
        ax.set_xticks(range(len(confs)), labels, fontsize=8)
        ax.set_ylabel("output tokens/s (median of rounds; dots: each round)")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
