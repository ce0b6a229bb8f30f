"""One scheduler-like rank for the multi-rank tests (run by test/ranks.py).

Joins a gloo group on 127.0.0.1 (FileStore, explicit timeout), loads plugins
through SGLang's real load_plugins(), then runs every scenario of the spec file
against a real UnifiedRadixCache on that group and writes what it popped, step
by step, to <out-dir>/rank<R>.json.

Scenario traffic: a generator seeded with the scenario seed (the same on every
rank) decides what is enqueued and which lifecycle events run at which step, as
the scheduler would symmetrically; a second generator seeded per rank decides
when each transfer finishes on this rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from datetime import timedelta

STORAGE_QUEUES = (
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)
EVENTS = (
    "write_back_flush",
    "reset",
    "detach",
    "attach",
    "drain_local",
    "loading_check",
    "drain_storage",
)


def run_scenario(spec: dict, rank: int, world: int, group) -> dict:
    from hicache_async_ack import sglang_plugin
    from hicache_async_ack.simulated import build_cache

    for k in ("SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC", "SGLANG_HICACHE_ASYNC_ACK_DEPTH"):
        os.environ.pop(k, None)
    os.environ.update(spec.get("env", {}))
    storage = spec.get("storage", False)
    extra = tuple(spec.get("extra_pools", ()))
    sim = build_cache(tp_group=group, tp_world_size=world, storage=storage, extra_pools=extra)
    sglang_plugin.after_init_hicache(None, sim.cache)  # as init_hicache would
    state = sglang_plugin.state_of(sim.cache)

    sched = random.Random(spec["seed"])
    mine = random.Random(spec["seed"] * 7919 + rank)
    max_delay = spec.get("max_delay", 3)
    event_p = spec.get("event_p", 0.0)
    events = tuple(e for e in spec.get("events", EVENTS) if storage or "drain" not in e)
    step = 0
    future_puts: list[tuple] = []  # (visible at step, queue name, uid)
    last_visible: dict = {}
    per_step: list = []
    counts = {"enqueued": 0, "events": {}}

    def finish_at(delay_rank_skew: int):
        t = step + mine.randint(0, max_delay) + delay_rank_skew
        return lambda: step >= t

    def storage_names():
        return list(STORAGE_QUEUES) + [("extra", p) for p in extra]

    total = spec["steps"] + spec.get("drain_steps", max_delay + 8)
    for step in range(total):
        traffic = step < spec["steps"]
        if spec.get("diverge_at") == step and rank == 1:
            sim.tree.write_back_duplicate_reclaim_digest += 1
        if spec.get("die_at") == step and rank == world - 1:
            os._exit(17)  # a rank dies mid-run, no goodbye
        if traffic:
            skew = rank if spec.get("skew") else 0
            for _ in range(sched.randint(0, 3)):
                sim.add_ack("write", finish_at(skew), pending=sched.random() < 0.3)
                counts["enqueued"] += 1
            for _ in range(sched.randint(0, 2)):
                sim.add_ack("load", finish_at(skew))
                counts["enqueued"] += 1
            if sim.cc.enable_storage:
                for name in storage_names():
                    if sched.random() < 0.4:
                        # appears on this rank a little later, order kept per queue
                        t = max(last_visible.get(name, 0), step + mine.randint(0, 2))
                        last_visible[name] = t
                        future_puts.append((t, name, sim.cc.next_uid()))
        for put in [p for p in future_puts if p[0] <= step]:
            future_puts.remove(put)
            sim.cc.put_storage(put[1], uid=put[2])
        if traffic and event_p and sched.random() < event_p:
            ev = sched.choice(events)
            counts["events"][ev] = counts["events"].get(ev, 0) + 1
            if ev == "write_back_flush":
                sim.write_back_flush()
            elif ev == "reset":
                sim.reset()
                future_puts.clear()
            elif ev == "detach" and sim.cc.enable_storage:
                sim.detach_storage()
                future_puts.clear()
            elif ev == "attach" and storage and not sim.cc.enable_storage:
                sim.attach_storage()
                last_visible.clear()
            elif ev == "drain_local" and sim.cc.enable_storage:
                sim.cache.drain_storage_control_queues_local()
            elif ev == "loading_check":
                sim.cache.loading_check()  # upstream's own blocking reduce
            elif ev == "drain_storage" and sim.cc.enable_storage:
                sim.cache.drain_storage_control_queues()
            pre = sim.take_pops()  # popped by the lifecycle path itself
        else:
            pre = []
        sim.cache.check_hicache_events()
        per_step.append([pre, sim.take_pops()])

    sim.cache.release_host_resources()
    sim.cache.shutdown()
    cc = sim.cc
    left = {
        "write": len(cc.ack_write_queue) + len(cc.pending_writes),
        "load": len(cc.ack_load_queue),
        "ongoing_write": len(sim.cache.ongoing_write_through),
        "ongoing_load": len(sim.cache.ongoing_load_back),
    }
    if cc.enable_storage:
        for name in storage_names():
            left[str(name)] = cc.storage_queue(name).qsize()
    return {
        "pops": per_step,
        "violations": cc.violations,
        "left": left,
        "pending": state.sync.pending if state.sync else 0,
        "pipelined": state.decide(sim.cache).pipelined,
        "counts": counts,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()

    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what run_scheduler_process does first
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(args.store, args.world),
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    group = dist.new_group(
        list(range(args.world)), backend="gloo", timeout=timedelta(seconds=args.timeout)
    )
    with open(args.spec) as f:
        specs = json.load(f)
    results = {}
    broken = False
    for spec in specs:
        if broken:
            results[spec["name"]] = {"error": "skipped after an earlier failure"}
            continue
        t0 = time.monotonic()
        try:
            results[spec["name"]] = run_scenario(spec, args.rank, args.world, group)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[spec["name"]] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            broken = not spec.get("expect_error")
        results[spec["name"]]["seconds"] = time.monotonic() - t0
        with open(f"{args.out}/rank{args.rank}.json", "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown races at exit; results are on disk


if __name__ == "__main__":
    main()
