"""``hicache-async-ack-lab bench``: options, the arms run back to back, the report."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from hicache_async_ack import __version__
from hicache_async_ack.env import DEPTH_AUTO, DEPTH_DEFAULT, DEPTH_MAX, DEPTH_VAR, PLUGINS_VAR
from hicache_async_ack.tools import Job, int_in, nonneg_float, run_ranks, subcommand
from hicache_async_ack_lab.bench import offload, plot, prefetch, summary
from hicache_async_ack_lab.bench.workload import (
    BLOCKING_PLUGINS,
    COPY_MS,
    KINDS,
    LOCAL_POPS,
    ArmSpec,
    Schedule,
)
from hicache_async_ack_lab.cli_support import ToolError
from hicache_async_ack_lab.fresh import preload

T = TypeVar("T")
REDUCE_GROUPS = ("shared", "dedicated")
MIN_STEPS = 20
DEFAULT_STEPS = 400
DEFAULT_WARMUP = 20
GROUP_TIMEOUT_S = 60.0  # every gloo collective; a dead peer surfaces within this
BENCH_RANK_MODULE = "hicache_async_ack_lab.bench.rank_loop"
RANK_TARGET = f"{BENCH_RANK_MODULE}:bench_rank"


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
    worst_ms = max(ms for ms, _ in cfg["latency_phases"])
    per_step = (cfg["step_ms"] + worst_ms + 5.0) / 1000.0
    return 60.0 + 2.0 * world + 4.0 * per_step * (cfg["steps"] + cfg["warmup"])


def arm_specs(kinds: tuple[str, ...], depths: tuple[str, ...]) -> list[ArmSpec]:
    """The arms in the order asked; one pipelined arm per depth."""
    out = []
    for kind in kinds:
        if kind != "pipelined":
            out.append(ArmSpec(kind, kind))
            continue
        for d in depths:
            out.append(ArmSpec("pipelined" if len(depths) == 1 else f"pipelined@{d}", kind, d))
    return out


def run_arm(spec: ArmSpec, cfg: dict, quiet: bool) -> list[dict]:
    from tqdm import tqdm

    world = cfg["tp"]
    total = cfg["steps"] + cfg["warmup"]
    job = Job(
        target=RANK_TARGET,
        world_size=world,
        payload=dict(cfg, arm=spec),
        timeout_s=cfg["timeout_s"] or arm_timeout_s(cfg, world),
        label=f"{spec.name} arm",
        group_timeout_s=cfg["group_timeout_s"],
    )
    # A bar on a terminal only: quiet in logs and CI.
    with tqdm(
        total=total,
        desc=f"{spec.name} ({world} ranks)",
        unit="step",
        leave=False,
        disable=quiet or not sys.stderr.isatty(),
    ) as bar:

        def progress(done_per_rank: list[int]) -> None:
            bar.update(max(0, min(done_per_rank)) - bar.n)

        t0 = time.monotonic()
        results = run_ranks(job, on_progress=progress)
    if not quiet:
        took = time.monotonic() - t0
        print(f"[{spec.name}] {world} ranks, {total} steps in {took:.1f} s", file=sys.stderr)
    return [r for r in results if r is not None]


def latency_text(phases) -> str:
    if len(phases) == 1:
        return f"{phases[0][0]:g} ms"
    return " -> ".join(f"{ms:g} ms x {n}" for ms, n in phases)


def title_of(cfg: dict) -> str:
    return (
        f"TP={cfg['tp']}, {cfg['steps']} steps (+{cfg['warmup']} warmup), "
        f"forward {cfg['step_ms']:g} ms, injected latency {latency_text(cfg['latency_phases'])}, "
        f"depth {','.join(cfg['depths'])}, reduce group {cfg['reduce_group']}"
        + (f", attention CP={cfg['cp']} x TP={cfg['tp'] // cfg['cp']}" if cfg["cp"] > 1 else "")
        + (", storage" if cfg["storage"] else "")
    )


def config_of(args) -> dict:
    if args.tp % args.cp:
        divisors = [d for d in range(1, args.tp + 1) if args.tp % d == 0]
        raise ToolError(f"--cp {args.cp} must divide --tp {args.tp}; accepted: {divisors}")
    phases = tuple(args.inject_latency_ms)
    if sum(n for _, n in phases[:-1]) >= args.steps:
        raise ToolError(
            f"--inject-latency-ms {latency_text(phases)}: its phases before the last must "
            f"leave steps for the last one (--steps {args.steps})"
        )
    last = args.steps - sum(n for _, n in phases[:-1])
    return {
        "tp": args.tp,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_ms": args.step_ms,
        "arms": list(args.arms),
        "latency_phases": phases[:-1] + ((phases[-1][0], last),),
        "storage": args.storage,
        "seed": args.seed,
        "depths": list(args.depth),
        "cp": args.cp,
        "reduce_group": args.reduce_group,
        "timeout_s": args.timeout,
        "group_timeout_s": GROUP_TIMEOUT_S,
        "crash": args.crash_rank_at,
    }


def report(cfg: dict, figures: dict, lim: dict, load_at_start) -> None:
    print(f"hicache-async-ack-lab bench {__version__}: {title_of(cfg)}")
    if load_at_start is not None:
        print(
            f"host: {os.cpu_count()} CPUs, load average {load_at_start[0]:.2f} at start "
            f"(other work on the box skews every figure)"
        )
    print(summary.format_table(figures))
    for arm, s in figures.items():
        print(f"  {arm}: {s['path']}")
    if lim:
        print("against the limit (check p50; shares of what blocking costs above the bound):")
        print(summary.format_limits(lim))
    phases = summary.format_phases(figures)
    if phases:
        print(phases)


def write_outputs(args, cfg: dict, figures: dict, lim: dict, load_at_start) -> None:
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
        "limits": lim,
    }
    save(args, record, "bench", lambda png: plot.draw_png(png, figures, title_of(cfg)))


def save(args, record: dict, stem: str, draw: Callable[[Path], None]) -> None:
    """Append ``record`` to --out (JSONL) and draw the PNG (--png, else next to
    --out, else ./STEM.png); without matplotlib, a warning instead of the PNG."""
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if not args.quiet:
            print(f"appended results to {out}", file=sys.stderr)
    png = Path(args.png) if args.png else Path(args.out or stem).with_suffix(".png")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        draw(png)
        if not args.quiet:
            print(f"wrote {png}", file=sys.stderr)
    except ImportError as exc:
        print(f"warning: no PNG ({exc}); pip install 'hicache-async-ack[bench]'", file=sys.stderr)


def run(args) -> int:
    if prefetch.wanted(args):  # the storage-prefetch arms instead
        return prefetch.run(args)
    if args.decode_offload:  # the PD decode offload arms instead
        return offload.run(args)
    cfg = config_of(args)
    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    preload(args.quiet, BENCH_RANK_MODULE)
    schedule = Schedule(cfg["latency_phases"], cfg["warmup"])
    figures = {}
    for spec in arm_specs(tuple(cfg["arms"]), tuple(cfg["depths"])):
        raw = run_arm(spec, cfg, args.quiet)
        figures[spec.name] = summary.summarize_arm(raw, schedule, spec.kind in LOCAL_POPS)
    summary.add_relative(figures)
    lim = summary.limits(figures)
    report(cfg, figures, lim, load_at_start)
    write_outputs(args, cfg, figures, lim, load_at_start)
    bad = {a: s["violations"] for a, s in figures.items() if s["violations"]}
    for a, v in bad.items():
        print(f"VIOLATIONS in {a}: " + "; ".join(v[:10]), file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------ options
def parse_list(flag: str, raw: str, item, accepted: str) -> tuple:
    """A comma-separated option value; names the accepted values when it fails."""
    picked = [x.strip() for x in raw.split(",") if x.strip()]
    try:
        values = tuple(item(x) for x in picked)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"invalid {flag} {raw!r} ({exc}); accepted values: {accepted}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"empty {flag}; accepted values: {accepted}")
    return values


def list_of(flag: str, item: Callable[[str], T], accepted: str) -> Callable[[str], tuple[T, ...]]:
    """An option's type: ``parse_list``'s values, a repeat dropped (the first kept)."""

    def parse(raw: str) -> tuple[T, ...]:
        return tuple(dict.fromkeys(parse_list(flag, raw, item, accepted)))

    return parse


def _known(choices: tuple[str, ...]) -> Callable[[str], str]:
    def item(x: str) -> str:
        if x.lower() not in choices:
            raise ValueError(f"{x!r} is not one of them")
        return x.lower()

    return item


def choice_list(flag: str, choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An option's type: some of ``choices``, in any case, comma-separated."""
    return list_of(flag, _known(choices), f"a comma-separated list of {', '.join(choices)}")


def add_int(
    p: argparse._ActionsContainer,
    flag: str,
    default: Optional[int],
    lo: int = 1,
    hi: Optional[int] = None,
    **kw: Any,
) -> None:
    """An integer option from ``lo`` (to ``hi``); a value outside is named with the bounds."""
    p.add_argument(flag, type=int_in(flag, lo, hi), default=default, **kw)


def parse_arms(raw: str) -> tuple[str, ...]:
    accepted = f"a comma-separated list without repeats of {', '.join(KINDS)}"
    arms = parse_list("--arms", raw, _known(KINDS), accepted)
    if len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"invalid --arms {raw!r}; accepted values: {accepted}")
    return arms


def _depth(x: str) -> str:
    if x.lower() == DEPTH_AUTO:
        return DEPTH_AUTO
    if not x.isdigit() or not 1 <= int(x) <= DEPTH_MAX:
        raise ValueError(f"{x!r} is not a depth")
    return str(int(x))


parse_depths = list_of(
    "--depth", _depth, f"integers from 1 to {DEPTH_MAX} or {DEPTH_AUTO!r}, comma-separated"
)


def _phase(x: str) -> tuple[float, int]:
    ms, _, steps = x.partition(":")
    value = float(ms)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{ms!r} is not a latency")
    if steps and (not steps.isdigit() or int(steps) < 1):
        raise ValueError(f"{steps!r} is not a step count")
    return value, int(steps) if steps else 0


def parse_latency(raw: str) -> tuple[tuple[float, int], ...]:
    accepted = (
        "a number >= 0 (milliseconds), or phases MS:STEPS,...,MS "
        "(each phase but the last with its measured step count)"
    )
    phases = parse_list("--inject-latency-ms", raw, _phase, accepted)
    if any(n == 0 for _, n in phases[:-1]) or (len(phases) > 1 and phases[-1][1]):
        raise argparse.ArgumentTypeError(
            f"invalid --inject-latency-ms {raw!r}; accepted values: {accepted}"
        )
    return phases


def parse_crash(raw: str) -> Optional[tuple[int, int]]:
    try:
        r, s = raw.split(":")
        return (int(r), int(s))
    except ValueError:
        raise argparse.ArgumentTypeError("expected RANK:STEP") from None


EPILOG = f"""\
arms (run back to back, each on fresh ranks):
  l1         no HiCache: check_hicache_events is not called
  blocking   stock SGLang ({PLUGINS_VAR}={BLOCKING_PLUGINS} before load_plugins())
  bound      zero-sync bound: stock check with its collective replaced by a local
             no-op (each rank pops its own counts: a measurement device only)
  floor      one-collective floor: the bound + one async MIN all_reduce per step
             (wait on the previous, issue the next), issued as the plugin does
  pipelined  this plugin, applied by SGLang's own load_plugins(); one arm per
             --depth value (e.g. --depth 1,3,auto)

--inject-latency-ms is a MODEL of a host whose gloo all_reduce is slow, not a
measurement: blocking sleeps X ms before every upstream _all_reduce; pipelined's
and floor's reduces complete no earlier than X ms after they were issued (the
reduce itself still runs over real gloo). Phases change it mid-run:
2:150,25:150,2 = 150 measured steps at 2 ms, 150 at 25 ms, the rest at 2 ms;
the report then gives per-phase throughput, lag and depth.
`hicache-async-ack doctor` measures this host's real gloo latency; the PR saw
0.5 ms on GB300 and 3.2 ms on B200.

Per step each rank: broadcasts a small tensor from rank 0 on the TP group (the
scheduler's recv_requests), runs check_hicache_events (timed), then "runs the
forward" for --step-ms (host idle) while 0-3 write-through backups and up to
one load-back finish after {COPY_MS[0]:g}-{COPY_MS[1]:g} ms (random per rank).
"""


SUMMARY = "measure the blocking ack reduce vs the pipelined one on CPU/gloo"
DESCRIPTION = (
    "Run TP scheduler-like ranks over gloo on 127.0.0.1 driving SGLang's real "
    "UnifiedRadixCache.check_hicache_events, and compare the pipelined plugin with "
    "stock (blocking), the zero-sync bound, the one-collective floor and L1."
)
HELP = {
    "steps": f"measured steps per arm (default {DEFAULT_STEPS}, min {MIN_STEPS})",
    "warmup": f"unmeasured steps first (default {DEFAULT_WARMUP})",
    "arms": f"comma-separated, from {', '.join(KINDS)} (default: all)",
    "inject_latency_ms": "model a slow host: extra latency of the ack reduce, or phases "
    "of it (below; default 0)",
    "storage": "also feed the storage control queues",
    "seed": "workload seed (default 0)",
    "depth": f"{DEPTH_VAR} for the pipelined arm: 1..{DEPTH_MAX} or auto, or several "
    f"comma-separated (one arm each; default {DEPTH_DEFAULT})",
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
    arg("--arms", type=parse_arms, default=KINDS)
    arg("--inject-latency-ms", type=parse_latency, default=((0.0, 0),))
    arg("--storage", action="store_true")
    arg("--seed", type=int, default=0)
    arg("--depth", type=parse_depths, default=(str(DEPTH_DEFAULT),))
    arg("--cp", type=int_in("--cp", 1, 64), default=1)
    arg("--reduce-group", choices=REDUCE_GROUPS, default="shared")
    arg("--out", metavar="FILE.jsonl")
    arg("--png", metavar="FILE")
    arg("--timeout", type=nonneg_float("--timeout", "seconds"), default=0.0)
    arg("--quiet", action="store_true")
    prefetch.add_arguments(p)
    offload.add_arguments(p)
    p.add_argument("--crash-rank-at", type=parse_crash, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p
