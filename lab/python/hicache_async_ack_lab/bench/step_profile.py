"""Profile the pipelined step's own cost, for trimming it to the floor.

``python -m hicache_async_ack_lab.bench.step_profile python``: one process,
SGLang's real UnifiedRadixCache with the plugin's hooks (applied by SGLang's
loader), the bench's traffic, and in place of gloo a reduce that every rank
agreed on at once (it hands back what was issued): what the plugin's Python
costs per step, without the collective. Figures are per step, the minimum and
median over batches (the minimum is what the code costs when nothing else runs
on the box), for the
pipelined arm and for the bound (upstream's check, no collective); ``--cprofile``
adds the functions the pipelined step spends its time in.

``python -m hicache_async_ack_lab.bench.step_profile collective``: two ranks
over real gloo on 127.0.0.1; issuing and waiting on one async MIN all_reduce of
upstream's size, three ways, interleaved in blocks so that load on the box
falls on all of them alike: a fresh tensor and ``dist.all_reduce`` (what the
plugin did first), a preallocated tensor and ``dist.all_reduce``, and a
preallocated tensor and the process group's own ``allreduce`` (what
the plugin's own ``Collectives().async_min`` does).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

BATCH = 100


def _stats(samples_s: list[float]) -> str:
    us = np.asarray(samples_s) * 1e6
    return f"min {us.min():7.2f} us  median {np.median(us):7.2f} us  (n={len(us)} batches)"


def _sim_cache(storage: bool):
    from hicache_async_ack.sglang_plugin import Collectives, Environment, use_environment
    from hicache_async_ack_lab.sim.cache import build_cache
    from hicache_async_ack_lab.sim.collectives import EchoHandle

    # a profiling stand-in: no process group here
    collectives = Collectives(async_min=lambda group: EchoHandle, world_size=lambda group: 2)
    use_environment(Environment(collectives=collectives))
    sim = build_cache(tp_group=object(), tp_world_size=2, storage=storage)
    # upstream's blocking _all_reduce as a world of one: the bound's collective,
    # and the pipelined arm's first exchange (it runs through the cache's own)
    sim.cache.__dict__["_all_reduce"] = lambda data, op: None
    return sim


def python_cost(steps: int, cprofile: bool, storage: bool) -> None:
    """Per-step cost of check_hicache_events, pipelined and bound, no gloo (``storage``:
    a storage backend attached, its control queues fed, as the bench's --storage)."""
    from sglang.srt.plugins import load_plugins

    from hicache_async_ack.env import ENTRY_POINT_NAME, PLUGINS_VAR
    from hicache_async_ack_lab.bench.workload import TRAFFIC
    from hicache_async_ack_lab.sim.traffic import StepClock, Traffic

    runs = ("bound", "pipelined", "pipelined") if cprofile else ("bound", "pipelined")
    for n, arm in enumerate(runs):
        if n == 1:  # the bound runs first, on the class without hooks
            os.environ[PLUGINS_VAR] = ENTRY_POINT_NAME
            load_plugins()
        sim = _sim_cache(storage)
        traffic = Traffic(sim, TRAFFIC, seed=0, rank=0, clock=StepClock(max_delay=2))
        check = sim.cache.check_hicache_events
        prof = cProfile.Profile() if n == 2 else None  # a separate pass: untimed
        batches: list[float] = []
        for b in range(steps // BATCH):
            spent = 0.0
            for i in range(BATCH):
                traffic.enqueue(b * BATCH + i)
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                check()
                spent += time.perf_counter() - t0
                if prof is not None:
                    prof.disable()
                sim.take_pops()
            batches.append(spent / BATCH)
        if prof is None:
            print(f"{arm:9s} check_hicache_events per step: {_stats(batches[2:])}")
        else:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print(f"cProfile of the pipelined step ({steps} steps):\n{out.getvalue()}")


def collective_rank(ctx, cfg: dict) -> dict:
    """Rank target: the three ways of issuing and waiting on the reduce."""
    import torch
    import torch.distributed as dist

    from hicache_async_ack.sglang_plugin import Collectives

    group = dist.group.WORLD
    size = cfg["size"]
    values = list(range(size))
    pre = torch.zeros(size, dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    plugin = Collectives().async_min(group)

    def fresh_dist():
        t = torch.tensor(values, dtype=torch.int64)
        return dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True), t

    def prealloc_dist():
        pre.numpy()[:] = values
        return dist.all_reduce(pre, op=dist.ReduceOp.MIN, group=group, async_op=True), pre

    def prealloc_pg():
        pre.numpy()[:] = values
        return group.allreduce([pre], opts), pre

    def plugin_collective():
        h = plugin(values)
        return h, None

    ways = {
        "fresh tensor + dist.all_reduce": fresh_dist,
        "prealloc + dist.all_reduce": prealloc_dist,
        "prealloc + ProcessGroup.allreduce": prealloc_pg,
        "the plugin's async_min": plugin_collective,
    }
    issue: dict[str, list[float]] = {w: [] for w in ways}
    wait: dict[str, list[float]] = {w: [] for w in ways}
    dist.barrier()
    for _block in range(cfg["blocks"]):
        for name, way in ways.items():
            spent_issue = spent_wait = 0.0
            for _ in range(cfg["per_block"]):
                dist.barrier()
                t0 = time.perf_counter()
                work, t = way()
                t1 = time.perf_counter()
                time.sleep(cfg["gap_ms"] / 1000.0)  # the forward: the reduce completes meanwhile
                t2 = time.perf_counter()
                work.wait()
                if t is not None:
                    t.tolist()
                t3 = time.perf_counter()
                spent_issue += t1 - t0
                spent_wait += t3 - t2
            issue[name].append(spent_issue / cfg["per_block"])
            wait[name].append(spent_wait / cfg["per_block"])
    dist.barrier()
    return {"issue": issue, "wait": wait}


def collective_cost(blocks: int, per_block: int, size: int, gap_ms: float) -> None:
    from hicache_async_ack.tools import Job, run_ranks

    job = Job(
        target=f"{__name__}:collective_rank",
        world_size=2,
        payload={"blocks": blocks, "per_block": per_block, "size": size, "gap_ms": gap_ms},
        timeout_s=600,
        label="collective profile",
    )
    r0 = run_ranks(job)[0]
    assert r0 is not None
    for name in r0["issue"]:
        print(f"{name:36s} issue: {_stats(r0['issue'][name])}")
        print(f"{'':36s} wait:  {_stats(r0['wait'][name])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache_async_ack_lab.bench.step_profile")
    sub = p.add_subparsers(dest="what", required=True)
    py = sub.add_parser("python", help="the plugin's Python per step (no gloo)")
    py.add_argument("--steps", type=int, default=5000)
    py.add_argument("--cprofile", action="store_true")
    py.add_argument(
        "--storage",
        action="store_true",
        help="a storage backend attached (the step bench's --storage)",
    )
    co = sub.add_parser("collective", help="ways to issue one async all_reduce (2 gloo ranks)")
    co.add_argument("--blocks", type=int, default=20)
    co.add_argument("--per-block", type=int, default=50)
    co.add_argument("--size", type=int, default=10, help="values per reduce (upstream's size)")
    co.add_argument("--gap-ms", type=float, default=2.0)
    args = p.parse_args(argv)
    if args.what == "python":
        python_cost(args.steps, args.cprofile, args.storage)
    else:
        collective_cost(args.blocks, args.per_block, args.size, args.gap_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
