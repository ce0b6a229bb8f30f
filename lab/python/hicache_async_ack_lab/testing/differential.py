"""One differential scenario on real gloo ranks: SGLang's real UnifiedRadixCache
(:mod:`.diff_build`) driven pass by pass through SGLang 0.5.23's own scheduling
code (:mod:`.diff_scheduler`, :mod:`.diff_walk`), with the plugin registered or
not, so stock's run and the plugin's can be compared (:mod:`.diff_compare`,
:mod:`.diff_checks`).

A rank target for :mod:`hicache_async_ack_lab.testing.spec_ranks`
(``run_differential``). Per pass p, in the event loop's order: arrivals and
retractions (``Scheduler._add_request_to_queue``: ``_prefetch_kvcache`` matches
the device and host trees and prefetches the remainder, anchored on the matched
host node; on a PD decode node the prealloc's probe, then the prefetch of its
hit), aborts (``_release_aborted_request``), this rank's storage reports, finished
requests, device pressure, the operator's flush / detach / attach once idle, the
boundary and the due storage retries (``Scheduler._process_hicache_events``),
then the waiting-queue walk (``calc_priority``, ``check_prefetch_progress``, a real
``PrefillAdder``) or a PD decode node's transfer queue. After the last pass the
run drains (no arrivals) until nothing is left or a limit is reached.

What is recorded per rank: the lifecycle events
(:class:`~hicache_async_ack_lab.sim.lifecycle.Record`), what limited the walk
(``limits``), each pass's collectives, the L3 queries, reads and keys read, the
host locks left (and those ongoing prefetches hold as anchors), and the plugin's
events (its reaches, verdicts, stops, pins, held and released starts), each
stamped with the driver's pass (``at``).

The spec (JSON; :mod:`.diff_gen` draws them): name, mode, world (TP size),
passes, policy, host_memory_mode, page_size, sidecar, host_pages (in pages),
capacity, threshold, exposed, cold, warm ([name, family, tokens, backed]), env,
skew (per rank), order (fcfs, lpm, dfs-weight, priority), limits ({full: [pass],
cutoff: {pass: arrival}, running: N, tokens: N}), retry ({interval, attempts}),
evict_device ({pass: tokens}), admin ([[pass, flush | paused_flush | detach |
attach]]), requests ([{rid, arrive, tokens, family: [id, shared] or None,
priority, budget: [per rank] or None, scripts: [{hit: {at: [per rank], tokens}
or None, progress, finish, error}], abort, retract, requeue, decode}]).
"""

from __future__ import annotations

import os
import traceback
from types import SimpleNamespace

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.sim.lifecycle import handle_key
from hicache_async_ack_lab.sim.sched_shim import server_config
from hicache_async_ack_lab.testing.diff_build import StampedLog, build, per_rank, scripts_of
from hicache_async_ack_lab.testing.diff_records import READ_ONCE_VAR
from hicache_async_ack_lab.testing.diff_scheduler import Scheduler
from hicache_async_ack_lab.testing.spec_ranks import run_specs

VARS = (ENABLE_VAR, PREFETCH_VOTES_VAR, DEPTH_VAR, READ_ONCE_VAR)
DRAIN = 60  # passes after the last one, at most, for what is left to settle


def count_collectives():
    """Count every torch.distributed.all_reduce this process runs, per pass."""
    import torch.distributed as dist

    counts: list[int] = []
    real = dist.all_reduce

    def counted(*a, **kw):
        counts[-1] += 1
        return real(*a, **kw)

    dist.all_reduce = counted
    return counts, lambda: setattr(dist, "all_reduce", real)


def track_ops(cache, p: int, seen: dict) -> None:
    """Per prefetch operation (its request's key and its number among that
    request's operations): the pass it was first seen ongoing, its read
    stopped (terminated), and its budget and locks released (gone)."""
    live = {}
    for h, info in cache.ongoing_prefetch.items():
        k = handle_key(h)
        ops = seen.setdefault(k, [])
        entry = next((e for e in ops if e["op"] is info.operation), None)
        if entry is None:
            entry = {"started": p, "op": info.operation}
            ops.append(entry)
        live[id(info.operation)] = True
        if info.operation.is_terminated():
            entry.setdefault("terminated", p)
    for ops in seen.values():
        for e in ops:
            if "released" not in e and id(e["op"]) not in live:
                e["released"] = p
                e.setdefault("terminated", p)


def run_passes(spec: dict, sim, sched: Scheduler, clock, counts: list, seen: dict) -> int:
    trace = os.environ.get("HICACHE_ASYNC_ACK_DIFF_TRACE")  # a folder: per-rank traces
    cache = sim.cache
    p = 0
    for p in range(spec["passes"] + DRAIN):
        if p >= spec["passes"] and sched.idle():
            break
        clock.now = p
        counts.append(0)
        sched.step(p, arriving=p < spec["passes"])
        track_ops(cache, p, seen)
        if trace:
            with open(f"{trace}/{spec['name']}-{sched.rank}.txt", "a") as f:
                ongoing = sorted(h.rid for h in cache.ongoing_prefetch)
                f.write(f"{p} {ongoing} {[r.rid for r in sched.waiting]} {counts[-1]}\n")
                f.write("".join(f"   {e}\n" for e in sched.record.events if e[0] == p))
    return p


def plugin_loaded() -> bool:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from hicache_async_ack.sglang_plugin import is_hooked

    return is_hooked(UnifiedRadixCache.check_hicache_events)


def run_scenario(spec: dict, rank: int, world: int, group) -> dict:
    with server_config(spec):
        return run_configured(spec, rank, world, group)


def run_configured(spec: dict, rank: int, world: int, group) -> dict:
    plugin = plugin_loaded()
    clock = SimpleNamespace(now=-1)
    log = StampedLog(clock)
    sim, record = build(spec, rank, world, group, clock, log, plugin)
    sim.cc.scripts = scripts_of(spec, rank)
    sim.cc.delay = per_rank(spec.get("skew", 0), rank)
    sched = Scheduler(spec, rank, sim, record)
    out: dict = {"plugin": plugin}
    counts, restore = count_collectives()
    seen: dict = {}
    last = 0
    try:
        last = run_passes(spec, sim, sched, clock, counts, seen)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["error_pass"] = clock.now
    finally:
        restore()
    cc, cache = sim.cc, sim.cache
    if spec.get("count_live"):
        out["live_operations"] = live_operations()
    if spec.get("final_evict"):
        out["final_evict"] = sim.tree.evict(1 << 30, cc.pool)
    out.update(
        events=[
            [at, list(k) if isinstance(k, tuple) else k, kind, det]
            for at, k, kind, det in record.events
        ],  # fmt: skip
        stats={k: v for k, v in sorted(cache._prefetch_outcome_stats.items()) if v},
        metrics=dict(sorted(cache.storage_metrics_collector.totals.items())),
        pops=sorted([str(n), u] for n, u in cc.pops),
        free_pages=len(cc.pool.free_pages),
        occupied=cc.prefetch_tokens_occupied,
        waiting=sorted(r.rid for r in list(sched.waiting) + sched.transfer),
        ongoing=sorted(h.rid for h in cache.ongoing_prefetch),
        limits=[
            [at, kind, list(k) if isinstance(k, tuple) else k] for at, kind, k in sched.limits
        ],  # fmt: skip
        collectives=counts,
        l3_queries=cc.l3_queries,
        reads=cc.reads,
        keys_read=cc.keys_read,
        bypassed=dict(sorted(cc.bypassed.items())),
        host_locks=sim.tree.host_locks(),
        # the anchor locks of prefetches still ongoing at the end (not a leak)
        anchored=sum(
            1 for i in cache.ongoing_prefetch.values() if i.anchor_lock_params is not None
        ),  # fmt: skip
        last_pass=last,
        ops={
            json_key(k): [{n: v for n, v in e.items() if n != "op"} for e in ops]
            for k, ops in seen.items()
        },  # fmt: skip
        plugin_events=[
            [kind, {k: json_value(v) for k, v in f.items()}] for kind, f in log.events
        ],  # fmt: skip
        idle=sched.idle(),
        state=plugin_state(cache) if plugin else {},
    )
    return out


def live_operations() -> int:
    """PrefetchOperation objects still alive in this process (what the run kept)."""
    import gc

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, PrefetchOperation))


def plugin_state(cache) -> dict:
    """What the plugin's vote state holds (0 each once the run is idle)."""
    from hicache_async_ack.sglang_plugin import VOTES_FEATURE, PrefetchVoteState, state_of

    state = state_of(VOTES_FEATURE, cache)
    if not isinstance(state, PrefetchVoteState):
        return {}
    return {"reaches": len(state.book.reaches), "admitted": len(state.book.admitted),
            "pins": len(state.landing.pins.held)}  # fmt: skip


def json_key(key) -> str:
    import json

    return json.dumps(list(key) if isinstance(key, tuple) else key)


def json_value(v):
    return list(v) if isinstance(v, tuple) else v


def run_differential(ctx, payload: dict) -> dict:
    """Rank target: SGLang's load_plugins() (stock's arm excludes the plugin
    through SGLANG_PLUGINS), then each scenario on a fresh TP group."""
    return run_specs(ctx, payload, VARS, run_scenario)
