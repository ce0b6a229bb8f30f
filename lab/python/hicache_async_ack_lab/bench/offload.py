"""``hicache-async-ack-lab bench --decode-offload N``: PD decode KV offload progress.

Per step each rank: rank 0 broadcasts on the TP group (``recv_requests``), then
SGLang's real ``DecodeKVCacheOffloadManager.check_offload_progress`` runs
(timed: the step's cost), then the forward "runs" for ``--step-ms`` with the
host idle while N device-to-host offloads (finished by the next step) and about
N/2 storage backups are queued. Arms, each on fresh ranks: ``blocking`` (stock
SGLang: one blocking MIN all_reduce per step), ``pipelined`` (the plugin), and
``bound`` (stock with the all_reduce replaced by a local no-op: a measurement
device only).
"""

from __future__ import annotations

import os
import random
import time

from hicache_async_ack.env import ENABLE_VAR, ENTRY_POINT_NAME, OFFLOAD_SYNC_VAR, PLUGINS_VAR
from hicache_async_ack_lab.bench.side_bench import Passes, add_option, arm_results, pass_config
from hicache_async_ack_lab.cli_support import ToolError

ARMS = ("blocking", "pipelined", "bound")
RANK_TARGET = "hicache_async_ack_lab.bench.offload:offload_rank"


def offload_rank(ctx, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    from hicache_async_ack_lab.sim.collectives import delayed
    from hicache_async_ack_lab.sim.offload import build_manager

    arm, world = cfg["arm"], ctx.world_size
    latency_s = cfg["latency_ms"] / 1000.0
    if arm == "pipelined":
        os.environ.update({PLUGINS_VAR: ENTRY_POINT_NAME, ENABLE_VAR: "1", OFFLOAD_SYNC_VAR: "1"})
    else:
        os.environ[PLUGINS_VAR] = "none_selected"
    load_plugins()
    if arm == "pipelined" and latency_s:
        from hicache_async_ack_lab.plugin_env import wrap_async_min

        wrap_async_min(lambda base: lambda g: delayed(base(g), lambda: latency_s))
    real = torch.distributed.all_reduce
    if arm == "bound":
        torch.distributed.all_reduce = lambda *a, **k: None
    elif arm == "blocking" and latency_s:

        def slow(*a, **k):
            time.sleep(latency_s)
            return real(*a, **k)

        torch.distributed.all_reduce = slow
    om = build_manager(dist.group.WORLD, world)
    rng = random.Random(cfg["seed"])  # the same traffic on every rank
    check_ms, popped = [], 0
    passes = Passes(ctx, cfg)
    for _, measured in passes:
        c0 = time.perf_counter()
        om.manager.check_offload_progress()
        if measured:
            check_ms.append((time.perf_counter() - c0) * 1000.0)
        popped += len(om.take_pops())
        for _ in range(cfg["offloads"]):
            om.add_offload()
        for _ in range(rng.randint(0, cfg["offloads"])):
            om.add_backup()
    torch.distributed.all_reduce = real
    dist.barrier()
    from hicache_async_ack.sglang_plugin import OFFLOAD_FEATURE, state_of

    state = state_of(OFFLOAD_FEATURE, om.manager)
    return {
        "check_ms": check_ms,
        "window_s": passes.window_s,
        "steps": cfg["steps"],
        "popped": popped,
        "pipelined": bool(state and state.agreed and state.enabled and state.static.pipelined),
        "violations": om.cc.violations,
    }


def run(args) -> int:
    import numpy as np

    tp = args.tp
    cfg = pass_config(args) | {"offloads": args.decode_offload, "seed": args.seed}
    latency = cfg["latency_ms"]
    rows = {}
    for arm, results in arm_results(args, ARMS, RANK_TARGET, cfg, tp, latency, "decode offload"):
        if any(r["violations"] for r in results):
            raise ToolError(f"{arm} arm: {results[0]['violations'][:5]}")
        if arm == "pipelined" and not results[0]["pipelined"]:
            raise ToolError("decode offload pipelined arm did not pipeline")
        r0 = results[0]
        q = np.quantile(np.asarray(r0["check_ms"], dtype=float), [0.5, 0.9])
        rows[arm] = (q[0], q[1], min(r["steps"] / r["window_s"] for r in results), r0["popped"])
    bound = rows["bound"][2]
    print(
        f"hicache-async-ack-lab bench --decode-offload {args.decode_offload}: TP={tp}, "
        f"{args.steps} steps (+{args.warmup} warmup), forward {args.step_ms:g} ms, "
        f"injected latency {latency:g} ms"
    )
    head = ("arm", "check p50 ms", "p90", "steps/s", "vs bound", "popped")
    print(f"{head[0]:<10} {head[1]:>12} {head[2]:>7} {head[3]:>8} {head[4]:>8} {head[5]:>7}")
    for arm, (p50, p90, sps, n) in rows.items():
        print(f"{arm:<10} {p50:>12.3f} {p90:>7.3f} {sps:>8.2f} {100 * sps / bound:>7.2f}% {n:>7}")
    return 0


def add_arguments(p) -> None:
    what = "PD decode offload progress with N offloads per step"
    add_option(p, "--decode-offload", what, ARMS)
