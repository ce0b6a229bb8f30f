"""One bench rank: a loop that models the scheduler's step.

Per step: rank 0 broadcasts a small tensor on the TP group (``recv_requests``),
then ``check_hicache_events`` runs (timed: the per-step cost), then the forward
"runs" for ``step_ms`` with the host idle while this step's write-through
backups and load-backs finish on a side stream after a per-rank random delay.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from hicache_async_ack_lab.bench import workload
from hicache_async_ack_lab.cli_support import ToolError


class SimFailure(ToolError):
    def __init__(self, msg: str, violations: list[str]):
        super().__init__(msg)
        self.violations = violations


@dataclass
class Record:
    """What one rank measured; ``finish``/``popped`` give each ack's lag."""

    check_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    bcast_ms: list[float] = field(default_factory=list)
    bcast_at: list[tuple[float, float]] = field(default_factory=list)
    pops_per_step: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # pipelined: the lag depth per step
    outstanding: dict[int, Callable[[], bool]] = field(default_factory=dict)
    finish: dict[int, int] = field(default_factory=dict)  # ack uid -> step it was seen done
    popped: dict[int, tuple[str, int]] = field(default_factory=dict)  # uid -> (queue, step)

    def note_pops(self, pops: list, step: int, measured: bool) -> None:
        for queue_name, uid in pops:
            self.popped[uid] = (str(queue_name), step)
            if self.outstanding.pop(uid, None) is not None:
                self.finish[uid] = step  # popped before this rank saw it done
        if measured:
            self.pops_per_step.append(len(pops))

    def note_finished(self, step: int) -> None:
        """What has finished by the start of ``step``, as this rank sees it."""
        for uid in [u for u, done in self.outstanding.items() if done()]:
            del self.outstanding[uid]
            self.finish[uid] = step


def timed_check(arm: workload.Arm, rec: Record, step: int, measured: bool) -> None:
    sim = arm.sim
    assert sim is not None
    c0 = time.perf_counter()
    try:
        sim.cache.check_hicache_events()
    except Exception as exc:
        raise SimFailure(
            f"check_hicache_events failed at step {step}: {exc!r}", list(sim.cc.violations)
        ) from exc
    if measured:
        rec.check_ms.append((time.perf_counter() - c0) * 1000.0)
    rec.note_pops(sim.take_pops(), step, measured)
    if sim.cc.violations:
        raise SimFailure(f"violations at step {step}", list(sim.cc.violations))


def current_depth(arm: workload.Arm) -> int:
    from hicache_async_ack.sglang_plugin import ACK_FEATURE, state_of

    state = state_of(ACK_FEATURE, arm.sim.cache) if arm.sim is not None else None
    return state.core.depth if state is not None and state.core is not None else 0


def bench_rank(ctx, cfg: dict) -> dict:
    """Rank target for tools.run_ranks: one arm (``cfg["arm"]``, an ArmSpec) here."""
    import torch
    import torch.distributed as dist

    rank, world = ctx.rank, ctx.world_size
    warmup, total = cfg["warmup"], cfg["steps"] + cfg["warmup"]
    step_s = cfg["step_ms"] / 1000.0
    crash = cfg.get("crash")
    schedule = workload.Schedule(cfg["latency_phases"], warmup)
    arm = workload.prepare(cfg["arm"], cfg, rank, world, schedule)
    path = workload.describe_path(arm, world) if arm.sim is None else ""
    bcast = torch.zeros(4, dtype=torch.int64)
    rec = Record()
    t_window = time.perf_counter()
    ctx.report(0)
    dist.barrier()
    for step in range(total):
        if crash is not None and tuple(crash) == (rank, step):
            os._exit(3)  # --crash-rank-at: model a rank dying mid-run
        measured = step >= warmup
        schedule.step = step
        t0 = time.perf_counter()
        if step == warmup:
            t_window = t0
        # recv_requests: rank 0 broadcasts the step's requests on the same group.
        if rank == 0:
            bcast[0] = step
        dist.broadcast(bcast, src=0)
        if measured:
            t_b = time.perf_counter()
            rec.bcast_ms.append((t_b - t0) * 1000.0)
            rec.bcast_at.append((t0, t_b))  # CLOCK_MONOTONIC: comparable across ranks
        if arm.sim is not None:
            timed_check(arm, rec, step, measured)
            if step == 0:
                path = workload.describe_path(arm, world)
            if measured and arm.spec.kind == "pipelined":
                rec.depths.append(current_depth(arm))
        # Forward: launched now, the host is idle until it completes. Backups of
        # this step's KV and load-backs for the next are copied on a side stream.
        fwd_end = time.perf_counter() + step_s
        if arm.traffic is not None:
            rec.outstanding.update(arm.traffic.enqueue(step))
        left = fwd_end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        rec.note_finished(step + 1)
        if measured:
            rec.step_ms.append((time.perf_counter() - t0) * 1000.0)
        ctx.report(step + 1)
    window_s = time.perf_counter() - t_window
    # Let every collective still in flight (the last issued reduce) complete on
    # all ranks before any of them exits: gloo's barrier waits for prior work.
    if arm.dedicated is not None:
        dist.barrier(group=arm.dedicated)
    dist.barrier()
    return {
        "rank": rank,
        "arm": arm.spec.name,
        "path": path,
        "check_ms": rec.check_ms,
        "step_ms": rec.step_ms,
        "bcast_ms": rec.bcast_ms,
        "bcast_at": rec.bcast_at,
        "pops_per_step": rec.pops_per_step,
        "depths": rec.depths,
        "window_s": window_s,
        "finish": rec.finish,
        "popped": rec.popped,
        "violations": list(arm.sim.cc.violations) if arm.sim is not None else [],
    }
