"""Seeded PD decode offload scenarios on real gloo ranks (rank target
``run_offload_specs`` for :func:`hicache_async_ack.tools.run_ranks`).

Per step, as the decode scheduler does: this step's device-to-host offloads
are queued (the same on every rank), storage backups acked by the storage
thread arrive at a rank-specific step (skew), sometimes a retraction drains
everything (``drain_before_retraction``, the same step on every rank), then
``check_offload_progress`` runs. What each step popped is recorded.

Spec keys: name, seed, steps, drain (extra steps with no traffic), env /
rank_env ({rank: settings}), retract (probability per step), expect_error.
"""

from __future__ import annotations

import random
import traceback

from hicache_async_ack.env import ENABLE_VAR, OFFLOAD_SYNC_VAR
from hicache_async_ack_lab.sim.offload import build_manager
from hicache_async_ack_lab.testing.spec_ranks import run_specs

VARS = (ENABLE_VAR, OFFLOAD_SYNC_VAR)


def run_offload_scenario(spec: dict, rank: int, world: int, group) -> dict:
    om = build_manager(group, world)
    shared = random.Random(spec["seed"])
    local = random.Random(spec["seed"] * 1000 + rank)
    later: list[tuple[int, int]] = []  # (arrival step, uid) of backups not yet acked
    uid = 0  # the same on every rank: entries are named where they start
    per_step: list = []
    added = {"offload": 0, "backup": 0}
    out: dict = {"retractions": 0}
    step = 0
    try:
        for step in range(spec["steps"] + spec.get("drain", 10)):
            if step < spec["steps"]:
                for _ in range(shared.randint(0, 3)):
                    uid += 1
                    om.add_offload(uid=uid)
                    added["offload"] += 1
                for _ in range(shared.randint(0, 2)):
                    uid += 1
                    # acked in the order issued (one storage thread), each rank late its own way
                    last = later[-1][0] if later else 0
                    later.append((max(last, step + local.randint(0, 2)), uid))
            for at, b in [x for x in later if x[0] <= step]:
                later.remove((at, b))
                om.add_backup(uid=b)
                added["backup"] += 1
            if step < spec["steps"] and shared.random() < spec.get("retract", 0.0):
                om.manager.drain_before_retraction()
                out["retractions"] += 1
            om.manager.check_offload_progress()
            per_step.append([list(p) for p in om.take_pops()])
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["error_step"] = step
    from hicache_async_ack.sglang_plugin import state_of

    state = state_of(om.manager, "decode_offload")
    out.update(
        per_step=per_step,
        added=added,
        left=len(om.cc.ack_write_queue) + om.cc.ack_backup_queue.qsize(),
        pipelined=bool(state and state.agreed and state.enabled and state.static.pipelined),
        violations=om.cc.violations,
    )
    return out


def run_offload_specs(ctx, payload: dict) -> dict:
    """Rank target: SGLang's load_plugins(), then each spec on a fresh TP group."""
    return run_specs(ctx, payload, VARS, run_offload_scenario)
