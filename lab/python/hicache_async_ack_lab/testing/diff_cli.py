"""``hicache-async-ack-lab differential``: stock SGLang against the plugin on N
random prefetch-lifecycle scenarios (or one to replay), over real gloo at TP=2
(some at 3 or 4), driven through SGLang's own scheduling code
(:mod:`.diff_compare`); prints how many fail (a hard clause anywhere, an outcome
where the walk was not limited), the outcomes that moved where it was, L3
queries, reads and locks plugin vs stock, how often each path of issue 52's list
was exercised (a warning for any at 0 in a run of 200 or more), and the first
failure as a scenario to replay."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from hicache_async_ack_lab.cli_support import ToolError

SUMMARY = "stock vs the plugin on random prefetch scenarios, through SGLang's scheduling code"
DESCRIPTION = (
    SUMMARY + ". Each scenario (arrivals matched on the device and host trees, shared "
    "prefixes read while others wait, slow and failing hit answers and reads, deadlines, "
    "the queue orders fcfs, lpm, dfs-weight and priority, aborts, retractions, requeues, "
    "storage retries, device pressure, flushes, storage detach and attach, walks limited "
    "by arrival or by what the batch admitted, PD decode probes and transfer queue, more "
    "than 256 ongoing, page sizes 1 to 4 and a sidecar pool, depth 1 to 8 and auto, the "
    "votes and read once on and off, every stop policy and host memory mode) runs on "
    "SGLang's real UnifiedRadixCache and Scheduler methods at TP=2, 3 or 4 over real gloo, "
    "once with the plugin and once without. Every scenario must hold the contract's hard "
    "clauses (agreement, liveness, resources, host-served); where the walk was not "
    "limited, every outcome must be stock's (read once aside)."
)
WARN_FROM = 200  # scenarios: a run this long that never exercised an item says so


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("differential", help=SUMMARY, description=DESCRIPTION)
    p.add_argument(
        "--scenarios",
        type=int,
        default=200,
        metavar="N",
        help="how many random scenarios (default 200)",
    )
    p.add_argument("--seed", type=int, default=0, help="the scenarios' seed (default 0)")
    p.add_argument(
        "--crowd-every",
        type=int,
        default=50,
        metavar="K",
        help="every K-th scenario holds more than 256 ongoing prefetches (default 50; 0: none)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=250,
        metavar="B",
        help="scenarios per rank launch (default 250)",
    )
    p.add_argument(
        "--replay",
        metavar="FILE",
        help="run the scenario(s) in FILE (a JSON object or list) instead",
    )
    p.add_argument(
        "--first", metavar="FILE", help="write the first scenario that differs there (JSON)"
    )
    p.add_argument(
        "--failed",
        metavar="FILE",
        help="write every scenario that differs there (a JSON list --replay runs)",
    )
    p.add_argument(
        "--show",
        type=int,
        default=6,
        metavar="M",
        help="differences shown for the first scenario that differs (default 6)",
    )
    p.set_defaults(func=run)  # fmt: skip
    return p


def load(path: str) -> list[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(f"--replay {path}: not a readable JSON scenario ({exc})") from exc
    specs = data if isinstance(data, list) else [data]
    if not specs or not all(isinstance(s, dict) and "requests" in s for s in specs):
        raise ToolError(f"--replay {path}: expected a scenario object or a list of them")
    from hicache_async_ack_lab.testing.diff_controls import CONTROLS

    for spec in specs:  # before any rank starts
        unknown = sorted(set(spec.get("control", [])) - set(CONTROLS))
        if unknown:
            raise ToolError(
                f"--replay {path}: scenario {spec.get('name')!r}: unknown control(s) "
                f"{unknown}; accepted: {', '.join(CONTROLS)}"
            )
    return specs


HARD = ("agreement", "liveness", "resources", "host-served")


def clause(difference: str) -> str:
    """The clause a difference names ("resources: ..." -> "resources")."""
    return difference.split(":")[0]


def add(into: dict, more: dict) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def run(args) -> int:
    from hicache_async_ack_lab.testing import diff_compare, diff_gen, diff_items

    if args.replay:
        specs = load(args.replay)
    else:
        if args.scenarios < 1 or args.batch < 1:
            raise ToolError("--scenarios and --batch take a positive count")
        specs = diff_gen.draw_scenarios(args.scenarios, args.seed, args.crowd_every)
    from hicache_async_ack_lab.testing import diff_checks

    t0 = time.monotonic()
    bad: list = []
    seen: dict = {}
    items: dict = {}
    moves: dict = {}
    overspent = 0
    totals: dict = {"stock": {}, "plugin": {}}
    for at in range(0, len(specs), args.batch):
        part = specs[at : at + args.batch]
        stock, plugin = diff_compare.run_arms(part, timeout_s=120.0 + 3.0 * len(part))
        bad += diff_compare.judge(part, stock, plugin)
        add(seen, diff_compare.coverage(part, stock, plugin))
        add(items, diff_items.exercised(part, stock, plugin))
        add(moves, diff_compare.outcome_moves(part, stock, plugin))
        overspent += diff_checks.limited_overspent(part, stock, plugin)
        for arm, t in diff_checks.totals(part, stock, plugin).items():
            add(totals[arm], t)
        done = at + len(part)
        print(f"differential: {done}/{len(specs)} run, {len(bad)} fail "
              f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
    hard = sum(1 for _, d in bad if any(clause(x) in HARD for x in d))
    took = time.monotonic() - t0
    print(f"differential: {len(specs)} scenarios, {len(bad)} differ from stock "
          f"({hard} on a hard clause; seed {args.seed}, {took:.0f} s)")  # fmt: skip
    print("differential: exercised: " + ", ".join(f"{k} {v}" for k, v in seen.items()))
    print("differential: issue 52's paths: " + ", ".join(f"{k} {v}" for k, v in items.items()))
    never = diff_items.never(items)
    if never and len(specs) >= WARN_FROM:
        print(f"differential: WARNING: never exercised in {len(specs)} scenarios: "
              + ", ".join(never))  # fmt: skip
    print("differential: outcomes where the walk was limited: "
          + ", ".join(f"{k} {v}" for k, v in moves.items()))  # fmt: skip
    print(f"differential: where the walk was limited, {overspent} scenarios spent more than "
          "stock on some count (L3 queries, reads, keys, allocations, pages)")  # fmt: skip
    print("differential: resources (rank 0), stock / plugin: " + ", ".join(
        f"{k} {totals['stock'][k]} / {totals['plugin'][k]}" for k in totals["stock"]))  # fmt: skip
    if bad:
        by = Counter(c for _, d in bad for c in {clause(x) for x in d})
        print("differential: failing scenarios by clause: "
              + ", ".join(f"{k} {v}" for k, v in sorted(by.items())))  # fmt: skip
        if args.failed:
            Path(args.failed).write_text(json.dumps([s for s, _ in bad], indent=1))
            print(f"differential: all {len(bad)} are in {args.failed}")
        spec, diffs = bad[0]
        print(diff_compare.replay_text(spec, diffs, args.show))
        if args.first:
            Path(args.first).write_text(json.dumps(spec, indent=1))
            print(f"differential: the first one is in {args.first}")
    return 1 if bad else 0
