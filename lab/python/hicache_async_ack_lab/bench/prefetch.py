"""``hicache-async-ack-lab bench --prefetch N``: requests waiting on storage prefetches
under the ``timeout`` policy.

Per pass each rank: rank 0 broadcasts on the TP group (``recv_requests``), then
SGLang's real ``check_hicache_events`` runs, then ``check_prefetch_progress``
for each of the N waiting requests (each with an ongoing prefetch, deadline
``--prefetch-life`` passes after it started, the same on every rank; one that
stops is replaced by a new one), all timed as the pass's cost; then the forward
"runs" for ``--step-ms`` with the host idle. Arms, each on fresh ranks:

- ``blocking``: stock SGLang (one blocking MAX all_reduce per waiting request,
  plus the blocking ack reduce).
- ``acks_only``: the plugin with the prefetch votes off (the ack reduce
  pipelined, the per-request reduces still blocking).
- ``pipelined``: the plugin (the votes ride the ack reduce: one async
  all_reduce per pass carries both).
- ``bound``: zero-sync bound: stock, with every cache collective replaced by a
  local no-op (a measurement device only).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Optional

from hicache_async_ack.env import ENABLE_VAR, ENTRY_POINT_NAME, PLUGINS_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.bench.side_bench import Passes, add_option, arm_results, pass_config
from hicache_async_ack_lab.cli_support import ToolError

ARMS = ("blocking", "acks_only", "pipelined", "bound")
RANK_TARGET = "hicache_async_ack_lab.bench.prefetch:prefetch_rank"


def _load(arm: str) -> None:
    from sglang.srt.plugins import load_plugins

    if arm in ("pipelined", "acks_only"):
        os.environ[PLUGINS_VAR] = ENTRY_POINT_NAME
        os.environ[ENABLE_VAR] = "1"
        os.environ[PREFETCH_VOTES_VAR] = "1" if arm == "pipelined" else "0"
    else:
        os.environ[PLUGINS_VAR] = "none_selected"
    load_plugins()


def prefetch_rank(ctx, cfg: dict) -> dict:
    """Rank target: one arm's pass loop."""
    import torch.distributed as dist

    from hicache_async_ack.sglang_plugin import VOTES_FEATURE, init_cache, state_of
    from hicache_async_ack_lab.bench.workload import delayed_all_reduce, local_no_op
    from hicache_async_ack_lab.plugin_env import wrap_async_min
    from hicache_async_ack_lab.sim.cache import build_cache
    from hicache_async_ack_lab.sim.collectives import delayed
    from hicache_async_ack_lab.sim.prefetch import add_prefetch
    from hicache_async_ack_lab.testing.walk_scenarios import counting

    arm, world = cfg["arm"], ctx.world_size
    latency_s = cfg["latency_ms"] / 1000.0
    _load(arm)
    async_calls = [0]
    wrap_async_min(counting(async_calls))  # every async all_reduce the plugin issues
    if latency_s and arm in ("pipelined", "acks_only"):
        wrap_async_min(lambda base: lambda g: delayed(base(g), lambda: latency_s))
    sim = build_cache(tp_group=dist.group.WORLD, tp_world_size=world, storage=True)
    clock = SimpleNamespace(now=0)
    ps = add_prefetch(sim, deadline=lambda op: clock.now >= op.bench_deadline)
    cache = sim.cache
    blocking_calls = [0]
    real = cache._all_reduce

    def counted(data, op):
        blocking_calls[0] += 1
        return real(data, op)

    cache.__dict__["_all_reduce"] = counted
    if arm == "bound":
        cache.__dict__["_all_reduce"] = local_no_op
    elif latency_s:
        cache.__dict__["_all_reduce"] = delayed_all_reduce(counted, lambda: latency_s)
    if arm in ("pipelined", "acks_only"):
        params = SimpleNamespace(enable_metrics=False)
        init_cache(cache, params)
    n_id = 0

    def refill(p: int) -> None:
        nonlocal n_id
        while len(cache.ongoing_prefetch) < cfg["prefetch"]:
            h = ps.add(f"r{n_id}")
            cache.ongoing_prefetch[h].operation.bench_deadline = p + cfg["life"]
            n_id += 1

    pass_ms, blocking, issued, waiting = [], [], [], []
    refill(0)
    passes = Passes(ctx, cfg)
    for p, measured in passes:
        clock.now = p
        c0 = time.perf_counter()
        calls, issues = blocking_calls[0], async_calls[0]
        cache.check_hicache_events()
        handles = sorted(cache.ongoing_prefetch, key=lambda h: int(h.rid[1:]))
        for h in handles:
            ps.check(h)
        c1 = time.perf_counter()
        if measured:
            pass_ms.append((c1 - c0) * 1000.0)
            blocking.append(blocking_calls[0] - calls)  # the ack reduce and per-request ones
            issued.append(async_calls[0] - issues)
            waiting.append(len(handles))
        refill(p + 1)
    dist.barrier()
    state = state_of(VOTES_FEATURE, cache)
    return {
        "pass_ms": pass_ms,
        "step_ms": passes.step_ms,
        "blocking_per_pass": blocking,
        "async_per_pass": issued,
        "waiting": waiting,
        "pipelined": bool(state and state.active),
        "stopped": len(ps.ended),
        "window_s": passes.window_s,
        "steps": cfg["steps"],
    }


def _q(values, q):
    import numpy as np

    return float(np.quantile(np.asarray(values, dtype=float), q)) if values else float("nan")


def _mean(values) -> float:
    return sum(values) / max(1, len(values))


def run(args) -> int:
    tp = getattr(args, "tp", 4)
    cfg = pass_config(args) | {"prefetch": args.prefetch, "life": args.prefetch_life}
    latency = cfg["latency_ms"]
    rows: dict[str, dict] = {}
    for arm, results in arm_results(args, ARMS, RANK_TARGET, cfg, tp, 20 * latency, "prefetch"):
        r0 = results[0]
        rows[arm] = {
            "pass_p50": _q(r0["pass_ms"], 0.5),
            "pass_p90": _q(r0["pass_ms"], 0.9),
            "blocking_per_pass": _mean(r0["blocking_per_pass"]),
            "async_per_pass": _mean(r0["async_per_pass"]),
            "waiting": _mean(r0["waiting"]),
            "steps_s": min(r["steps"] / r["window_s"] for r in results),
            "stopped": r0["stopped"],
        }
        if arm == "pipelined" and not r0["pipelined"]:
            raise ToolError("prefetch pipelined arm did not pipeline the votes")
    bound = rows["bound"]["steps_s"]
    print(
        f"hicache-async-ack-lab bench --prefetch {args.prefetch}: TP={tp}, timeout policy, "
        f"{args.steps} passes (+{args.warmup} warmup), forward {args.step_ms:g} ms, "
        f"injected latency {latency:g} ms, prefetch life {args.prefetch_life} passes"
    )
    head = (
        f"{'arm':<10} {'pass p50 ms':>11} {'p90':>7} {'waiting':>7} {'blocking/pass':>13} "
        f"{'async/pass':>10} {'all_reduce/pass':>15} {'steps/s':>8} {'vs bound':>8}"
    )
    print(head)
    for arm, r in rows.items():
        total = r["blocking_per_pass"] + r["async_per_pass"]
        print(
            f"{arm:<10} {r['pass_p50']:>11.3f} {r['pass_p90']:>7.3f} {r['waiting']:>7.1f} "
            f"{r['blocking_per_pass']:>13.2f} {r['async_per_pass']:>10.2f} {total:>15.2f} "
            f"{r['steps_s']:>8.2f} {100.0 * r['steps_s'] / bound:>7.2f}%"
        )
    print(
        "per measured pass, every pass deciding prefetches: blocking/pass: blocking "
        "all_reduces on the scheduler's path (the ack reduce and one per waiting request); "
        "async/pass: async all_reduces issued (the plugin's); bound: none run"
    )
    return 0


def add_arguments(p) -> None:
    what = "N requests waiting on storage prefetches per pass, timeout policy"
    add_option(p, "--prefetch", what, ARMS)
    p.add_argument(
        "--prefetch-life",
        type=int,
        default=20,
        metavar="PASSES",
        help="with --prefetch: passes until a prefetch's deadline (default 20)",
    )


def wanted(args) -> Optional[int]:
    return getattr(args, "prefetch", 0) or None
