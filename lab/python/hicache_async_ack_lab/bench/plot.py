"""The bench's PNG: per-step check cost per arm, and throughput."""

from __future__ import annotations

from pathlib import Path

ARM_COLORS = {
    "l1": "#888888",
    "blocking": "#d62728",
    "bound": "#1f77b4",
    "floor": "#9467bd",
    "pipelined": "#2ca02c",
}


def color(arm: str) -> str:
    return ARM_COLORS[arm.partition("@")[0]]  # pipelined@3 is a pipelined arm


def draw_png(path: Path, summary: dict[str, dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    with_check = [a for a, s in summary.items() if s["_check_samples"]]
    if with_check:
        data = [summary[a]["_check_samples"] for a in with_check]
        ax1.boxplot(data, showfliers=True, whis=(1, 99), flierprops={"markersize": 2})
        ax1.set_xticks(range(1, len(with_check) + 1), with_check)
        ax1.set_yscale("log")
        for i, a in enumerate(with_check, start=1):
            med = summary[a]["check_ms"]["median"]
            ax1.annotate(
                f"p50 {med:.3f}",
                (i, med),
                xytext=(30, 0),
                textcoords="offset points",
                fontsize=8,
                va="center",
            )
    ax1.set_ylabel("check_hicache_events per step (ms, log)")
    ax1.set_title("per-step cost (all ranks; whiskers p1-p99)", fontsize=10)
    ax1.grid(axis="y", alpha=0.3, which="both")

    arms = list(summary)
    # Relative to the zero-sync bound when it ran (what no ack sync can beat), else L1.
    key, ref = ("throughput_vs_l1", "L1")
    if "bound" in summary:
        key, ref = ("throughput_vs_bound", "the bound")
    rel = [summary[a][key] for a in arms]
    if all(r is not None for r in rel):
        vals = [r * 100 for r in rel]
        bars = ax2.bar(arms, vals, color=[color(a) for a in arms])
        lo = min(vals)
        ax2.set_ylim(max(0.0, lo - max(2.0, (100 - lo) * 0.3)), max(103.0, max(vals) + 3.0))
        ax2.axhline(100.0, ls="--", lw=1, color="k", alpha=0.6, label=ref)
        ax2.legend(loc="lower left", fontsize=8)
        ax2.set_ylabel(f"steps/s vs {ref} (%)")
        ax2.tick_params(axis="x", labelsize=8)
        for b, v in zip(bars, vals):
            ax2.annotate(
                f"{v:.1f}%",
                (b.get_x() + b.get_width() / 2, v),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=9,
            )
    else:
        vals = [summary[a]["steps_per_s"] for a in arms]
        ax2.bar(arms, vals, color=[color(a) for a in arms])
        ax2.set_ylabel("steps/s")
    ax2.set_title("throughput", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
