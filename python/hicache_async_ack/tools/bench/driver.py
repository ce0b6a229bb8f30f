"""``hicache-async-ack bench``: options, the arms run back to back, the report."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

from ... import __version__
from ...env import DEPTH_DEFAULT, DEPTH_MAX, DEPTH_VAR, PLUGINS_VAR
from ..options import ToolError, int_in, nonneg_float, subcommand
from ..ranks import SGLANG_PRELOAD, Job, run_ranks
from . import plot, summary
from .workload import ARMS, BLOCKING_PLUGINS, COPY_MS

REDUCE_GROUPS = ("shared", "dedicated")
MIN_STEPS = 20
DEFAULT_STEPS = 400
DEFAULT_WARMUP = 20
GROUP_TIMEOUT_S = 60.0  # every gloo collective; a dead peer surfaces within this
RANK_TARGET = "hicache_async_ack.tools.bench.rank_loop:bench_rank"


def versions() -> dict:
    from importlib import metadata

    out: dict = {"plugin": __version__, "python": platform.python_version()}
    for dist in ("torch", "sglang", "hicache-async-ack"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def arm_timeout_s(cfg: dict, world: int) -> float:
    per_step = (cfg["step_ms"] + cfg["inject_latency_ms"] + 5.0) / 1000.0
    return 60.0 + 2.0 * world + 4.0 * per_step * (cfg["steps"] + cfg["warmup"])


def run_arm(arm: str, cfg: dict, quiet: bool) -> list[dict]:
    from tqdm import tqdm

    world = cfg["tp"]
    total = cfg["steps"] + cfg["warmup"]
    job = Job(
        target=RANK_TARGET,
        world_size=world,
        payload=dict(cfg, arm=arm),
        timeout_s=cfg["timeout_s"] or arm_timeout_s(cfg, world),
        label=f"{arm} arm",
        group_timeout_s=cfg["group_timeout_s"],
    )
    # A bar on a terminal only: quiet in logs and CI.
    with tqdm(
        total=total,
        desc=f"{arm} ({world} ranks)",
        unit="step",
        leave=False,
        disable=quiet or not sys.stderr.isatty(),
    ) as bar:

        def progress(done_per_rank: list[int]) -> None:
            bar.update(max(0, min(done_per_rank)) - bar.n)

        t0 = time.monotonic()
        results = run_ranks(job, on_progress=progress)
    if not quiet:
        print(
            f"[{arm}] {world} ranks, {total} steps in {time.monotonic() - t0:.1f} s",
            file=sys.stderr,
        )
    return [r for r in results if r is not None]


def title_of(cfg: dict) -> str:
    return (
        f"TP={cfg['tp']}, {cfg['steps']} steps (+{cfg['warmup']} warmup), "
        f"forward {cfg['step_ms']:g} ms, injected latency {cfg['inject_latency_ms']:g} ms, "
        f"depth {cfg['depth']}, reduce group {cfg['reduce_group']}"
        + (f", attention CP={cfg['cp']} x TP={cfg['tp'] // cfg['cp']}" if cfg["cp"] > 1 else "")
        + (", storage" if cfg["storage"] else "")
    )


def config_of(args) -> dict:
    if args.tp % args.cp:
        divisors = [d for d in range(1, args.tp + 1) if args.tp % d == 0]
        raise ToolError(f"--cp {args.cp} must divide --tp {args.tp}; accepted: {divisors}")
    return {
        "tp": args.tp,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_ms": args.step_ms,
        "arms": list(args.arms),
        "inject_latency_ms": args.inject_latency_ms,
        "storage": args.storage,
        "seed": args.seed,
        "depth": args.depth,
        "cp": args.cp,
        "reduce_group": args.reduce_group,
        "timeout_s": args.timeout,
        "group_timeout_s": GROUP_TIMEOUT_S,
        "crash": args.crash_rank_at,
    }


def preload(quiet: bool) -> None:
    """Import what the ranks need once, before forking them."""
    t = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in (*SGLANG_PRELOAD, RANK_TARGET.partition(":")[0]):
            importlib.import_module(module)
    if not quiet:
        print(
            f"imported sglang once for all ranks in {time.monotonic() - t:.1f} s", file=sys.stderr
        )


def report(cfg: dict, figures: dict, load_at_start) -> None:
    print(f"hicache-async-ack bench {__version__}: {title_of(cfg)}")
    if load_at_start is not None:
        print(
            f"host: {os.cpu_count()} CPUs, load average {load_at_start[0]:.2f} at start "
            f"(other work on the box skews every figure)"
        )
    print(summary.format_table(figures))
    for arm, s in figures.items():
        print(f"  {arm}: {s['path']}")
    if "blocking" in figures and "pipelined" in figures:
        b, p = figures["blocking"]["check_ms"], figures["pipelined"]["check_ms"]
        if b and p and b["median"] > 0:
            print(
                f"pipelined median check_hicache_events cost is "
                f"{100 * p['median'] / b['median']:.1f}% of blocking"
            )


def write_outputs(args, cfg: dict, figures: dict, load_at_start) -> None:
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in cfg.items() if k != "crash"},
        "versions": versions(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_start": load_at_start,
        "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "arms": {
            a: {k: v for k, v in s.items() if not k.startswith("_")} for a, s in figures.items()
        },
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if not args.quiet:
            print(f"appended results to {out}", file=sys.stderr)
    png = Path(args.png) if args.png else Path(args.out or "bench").with_suffix(".png")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot.draw_png(png, figures, title_of(cfg))
        if not args.quiet:
            print(f"wrote {png}", file=sys.stderr)
    except ImportError as exc:
        print(f"warning: no PNG ({exc}); install matplotlib", file=sys.stderr)


def run(args) -> int:
    cfg = config_of(args)
    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    preload(args.quiet)
    raw = {arm: run_arm(arm, cfg, args.quiet) for arm in cfg["arms"]}
    figures = {arm: summary.summarize_arm(raw[arm], cfg["warmup"], cfg["steps"]) for arm in raw}
    if "l1" in figures:
        base = figures["l1"]["steps_per_s"]
        for s in figures.values():
            s["throughput_vs_l1"] = s["steps_per_s"] / base if base else None
    report(cfg, figures, load_at_start)
    write_outputs(args, cfg, figures, load_at_start)
    bad = {a: s["violations"] for a, s in figures.items() if s["violations"]}
    for a, v in bad.items():
        print(f"VIOLATIONS in {a}: " + "; ".join(v[:10]), file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------ options
def parse_arms(raw: str) -> tuple[str, ...]:
    picked = [a.strip().lower() for a in raw.split(",") if a.strip()]
    accepted = ", ".join(ARMS)
    for a in picked:
        if a not in ARMS:
            raise argparse.ArgumentTypeError(
                f"unknown arm {a!r}; accepted values: {accepted} (comma-separated)"
            )
    if not picked or len(set(picked)) != len(picked):
        raise argparse.ArgumentTypeError(
            f"invalid arms {raw!r}; accepted values: a comma-separated list without "
            f"repeats of {accepted}"
        )
    return tuple(picked)


def parse_crash(raw: str) -> Optional[tuple[int, int]]:
    try:
        r, s = raw.split(":")
        return (int(r), int(s))
    except ValueError:
        raise argparse.ArgumentTypeError("expected RANK:STEP") from None


EPILOG = f"""\
arms (run back to back, each on fresh ranks):
  l1         no HiCache: check_hicache_events is not called (the baseline)
  blocking   stock SGLang ({PLUGINS_VAR}={BLOCKING_PLUGINS} before load_plugins())
  pipelined  this plugin, applied by SGLang's own load_plugins()

--inject-latency-ms is a MODEL of a host whose gloo all_reduce is slow, not a
measurement: blocking sleeps X ms before every upstream _all_reduce; pipelined's
handle.wait() returns no earlier than X ms after the reduce was issued (the
reduce itself still runs over real gloo). `hicache-async-ack doctor` measures
this host's real gloo latency; the PR saw 0.5 ms on GB300 and 3.2 ms on B200.

Per step each rank: broadcasts a small tensor from rank 0 on the TP group (the
scheduler's recv_requests), runs check_hicache_events (timed), then "runs the
forward" for --step-ms (host idle) while 0-3 write-through backups and up to
one load-back finish after {COPY_MS[0]:g}-{COPY_MS[1]:g} ms (random per rank).
"""


SUMMARY = "measure the blocking ack reduce vs the pipelined one on CPU/gloo"
DESCRIPTION = (
    "Run TP scheduler-like ranks over gloo on 127.0.0.1 driving SGLang's real "
    "UnifiedRadixCache.check_hicache_events, and compare L1 (no HiCache), blocking "
    "(stock) and pipelined (this plugin)."
)
HELP = {
    "steps": f"measured steps per arm (default {DEFAULT_STEPS}, min {MIN_STEPS})",
    "warmup": f"unmeasured steps first (default {DEFAULT_WARMUP})",
    "arms": f"comma-separated, from {', '.join(ARMS)} (default: all)",
    "inject_latency_ms": "model a slow host: extra latency of the ack reduce (below; default 0)",
    "storage": "also feed the storage control queues",
    "seed": "workload seed (default 0)",
    "depth": f"{DEPTH_VAR} for the pipelined arm (1..{DEPTH_MAX}, default {DEPTH_DEFAULT})",
    "cp": "attention context-parallel size inside the TP group (must divide --tp; "
    "CP>1 with TP/CP>1 makes upstream run two reduces per step)",
    "reduce_group": "pipelined arm: reduce on the TP group the broadcast uses "
    "(shared, as the plugin does) or on a second gloo group (dedicated)",
    "out": "append one JSON object per run (config, versions, figures)",
    "png": "plot (default: next to --out, else ./bench.png)",
    "timeout": "seconds per arm before the ranks are killed (default: from the step count)",
    "quiet": "no progress on stderr",
}


def add_parser(sub) -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter  # keeps the epilog's layout
    p = subcommand(sub, "bench", SUMMARY, DESCRIPTION, epilog=EPILOG, formatter_class=raw)
    few = " (fewer give no meaningful p99)"

    def arg(flag: str, **kw) -> None:  # help from HELP, keyed by the option's dest
        p.add_argument(flag, help=HELP.get(flag.lstrip("-").replace("-", "_")), **kw)

    arg("--steps", type=int_in("--steps", MIN_STEPS, why=few), default=DEFAULT_STEPS)
    arg("--warmup", type=int_in("--warmup", 0), default=DEFAULT_WARMUP)
    arg("--arms", type=parse_arms, default=ARMS)
    arg(
        "--inject-latency-ms", type=nonneg_float("--inject-latency-ms", "milliseconds"), default=0.0
    )
    arg("--storage", action="store_true")
    arg("--seed", type=int, default=0)
    arg("--depth", type=int_in("--depth", 1, DEPTH_MAX), default=DEPTH_DEFAULT)
    arg("--cp", type=int_in("--cp", 1, 64), default=1)
    arg("--reduce-group", choices=REDUCE_GROUPS, default="shared")
    arg("--out", metavar="FILE.jsonl")
    arg("--png", metavar="FILE")
    arg("--timeout", type=nonneg_float("--timeout", "seconds"), default=0.0)
    arg("--quiet", action="store_true")
    p.add_argument("--crash-rank-at", type=parse_crash, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p
