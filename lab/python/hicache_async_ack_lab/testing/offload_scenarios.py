"""Seeded PD decode offload scenarios on real gloo ranks (rank target
``run_offload_specs`` for :func:`hicache_async_ack.tools.run_ranks`).

Per step, as the decode scheduler does: this step's device-to-host offloads
are queued (the same on every rank), storage backups acked by the storage
thread arrive at a rank-specific step (skew), sometimes a retraction drains
everything (``drain_before_retraction``, the same step on every rank), then
``check_offload_progress`` runs. What each step popped is recorded.

Spec keys: name, seed, steps, drain (extra steps with no traffic), env /
rank_env ({rank: settings}), retract (probability per step), expect_error, metrics
(SGLang's metrics on: PROMETHEUS_MULTIPROC_DIR set, as --enable-metrics does; the sync's
failures counter is read back), reorder_from (from that step, the first time the last
reduce agreed on 3 or more offloads, the 2nd and 3rd swap on every rank: a FIFO
violation between the reduce's issue and its consume).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import traceback

from hicache_async_ack.env import ENABLE_VAR, OFFLOAD_SYNC_VAR
from hicache_async_ack.metrics import FAILURE_REASONS, OffloadSyncMetrics
from hicache_async_ack.names import LOGGER_NAME
from hicache_async_ack_lab.sim.offload import build_manager
from hicache_async_ack_lab.testing.spec_ranks import run_specs

VARS = (ENABLE_VAR, OFFLOAD_SYNC_VAR)


class Errors(logging.Handler):
    """The plugin's error lines, as an operator's log would show them."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_offload_scenario(spec: dict, rank: int, world: int, group) -> dict:
    metrics_dir = tempfile.mkdtemp(prefix="offload-metrics-") if spec.get("metrics") else None
    if metrics_dir is not None:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    errors = Errors()
    logging.getLogger(LOGGER_NAME).addHandler(errors)
    try:
        # the rank's series outlive a spec (one label set per rank): count from here
        before = failures(OffloadSyncMetrics({"tp_rank": rank})) if metrics_dir else {}
        out = run_with(spec, rank, world, group, errors)
        if out["failures"] is not None:
            out["failures"] = {r: n - before.get(r, 0) for r, n in out["failures"].items()}
        return out
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(errors)
        if metrics_dir is not None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            shutil.rmtree(metrics_dir, ignore_errors=True)


def failures(metrics) -> dict:
    """The sync's failures counter, by reason (read back from its series)."""
    return {r: metrics.counter("failures", r)._value.get() for r in FAILURE_REASONS}


def run_with(spec: dict, rank: int, world: int, group, errors: Errors) -> dict:
    om = build_manager(group, world)
    shared = random.Random(spec["seed"])
    local = random.Random(spec["seed"] * 1000 + rank)
    later: list[tuple[int, int]] = []  # (arrival step, uid) of backups not yet acked
    uid = 0  # the same on every rank: entries are named where they start
    per_step: list = []
    issued = 0
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
            q = om.cc.ack_write_queue
            reorder = step >= spec.get("reorder_from", 1 << 30) and "reordered" not in out
            if reorder and issued >= 3:
                q[1], q[2] = q[2], q[1]  # entries the reduce in flight agreed on, out of order
                out["reordered"] = step
            if step < spec["steps"] and shared.random() < spec.get("retract", 0.0):
                om.manager.drain_before_retraction()
                out["retractions"] += 1
            om.manager.check_offload_progress()
            issued = len(om.cc.ack_write_queue)  # what the next reduce counts
            per_step.append([list(p) for p in om.take_pops()])
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["error_step"] = step
    from hicache_async_ack.sglang_plugin import OFFLOAD_FEATURE, state_of

    state = state_of(OFFLOAD_FEATURE, om.manager)
    metrics = getattr(state, "metrics", None)
    out["failures"] = failures(metrics) if hasattr(metrics, "counter") else None
    out["logged_errors"] = errors.lines
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
