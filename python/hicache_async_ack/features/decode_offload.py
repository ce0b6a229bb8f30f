"""PD decode KV offload progress, pipelined with the ack sync's core.

With ``--disaggregation-decode-enable-offload-kvcache`` the decode scheduler calls
``DecodeKVCacheOffloadManager.check_offload_progress`` every step: a blocking
MIN all_reduce over the TP group of ``[len(ack_write_queue),
ack_backup_queue.qsize()]``, then it pops that many device-to-host acks
(``_check_offload_progress``, which synchronizes each ack's event) and storage
backups (``_check_backup_progress``). Here the reduce is
:class:`~hicache_async_ack.core.PipelinedAckSync`'s: issued async at the end
of step t, consumed at step t+1, popped by identity (entries another path
removed meanwhile are skipped), the stamp agreed in every reduce. Like upstream
it counts every queued entry, finished or not.

A rank on SGLang's blocking path would pair its ``int32[2]`` reduce with the
others' longer one, which gloo answers by aborting the process. So the first
call on every rank is a blocking agreement in upstream's own layout
(``int32[2]``, MIN): the plugin's ranks send ``[CODE + on, -(CODE + on)]``, a
stock rank its two queue sizes, which are far below ``CODE``: every plugin rank
learns whether a peer is stock or has the setting off, and stops naming it.
"""

from __future__ import annotations

import os
import time
from typing import Hashable, Optional, Sequence

from ..adapter import (
    Collectives,
    Decision,
    Feature,
    FeatureState,
    Hook,
    announce_path,
    blocking,
    hook,
    keep_state,
    queue_head,
)
from ..core import PipelinedAckSync
from ..env import ENABLE_VAR, OFFLOAD_SYNC_VAR, offload_sync_enabled
from ..guard import MANAGER_CLASS, feature_release
from ..stamp import HiCacheAckSyncError, HiCacheAckSyncMismatch

QUEUES = ("ack_write_queue", "ack_backup_queue")
CODE = 1 << 30  # above any queue size a stock rank sends in the agreement
STATE_ATTR = "_hicache_offload_sync_state"
STOCK_HINT = (
    "that rank runs SGLang's blocking offload sync: give every node of the TP group "
    f"the same install and the same {ENABLE_VAR} / {OFFLOAD_SYNC_VAR}."
)


class OffloadSyncState(FeatureState):
    feature = "decode_offload"

    def __init__(
        self, manager, enabled: bool, release: Optional[str], coll: Optional[Collectives] = None
    ):
        super().__init__(static_decision(manager, release), coll)
        self.enabled = enabled
        self.sync: Optional[PipelinedAckSync] = None
        if self.static.pipelined:
            self.sync = PipelinedAckSync(
                self.collectives.async_min(manager.tp_group),
                1,
                hints={"stock": STOCK_HINT, "protocol": STOCK_HINT},
            )
        self.agreed = False
        self.draining = False  # inside drain_before_retraction: upstream's path
        if self.static.pipelined:
            self.metrics = metrics_for(manager)

    def decide(self, manager) -> Decision:
        if not self.static.pipelined:
            return self.static
        if not self.agreed:
            self.agree()
        if not self.enabled:
            return blocking(f"{OFFLOAD_SYNC_VAR}=0", "feature_disabled_by_env")
        if self.draining:
            return blocking("drain_before_retraction (pops everything now)", "draining")
        return self.static

    def agree(self) -> None:
        """Once, blocking, in upstream's layout: see the module docstring."""
        s = CODE + int(self.enabled)
        try:
            lo, hi = self.collectives.int32_min(self.static.group, [s, -s])
        except Exception as exc:
            raise HiCacheAckSyncError(
                f"HiCache decode offload sync: the one-time agreement failed ({exc})"
            ) from exc
        hi = -hi
        if lo < CODE:
            raise HiCacheAckSyncMismatch(
                "HiCache decode offload sync: this node pipelines, a peer does not: "
                f"{STOCK_HINT} Stopping before any pop."
            )
        if lo != hi:
            raise HiCacheAckSyncMismatch(
                f"HiCache decode offload sync: {OFFLOAD_SYNC_VAR} differs across the TP "
                f"group: this rank {int(self.enabled)}, group min {lo - CODE}, max "
                f"{hi - CODE}. Set it identically on every node. Stopping before any pop."
            )
        self.agreed = True

    def path_line(self, decision: Decision) -> str:
        line = super().path_line(decision)
        return line[:-1] + ", depth 1)" if decision.pipelined else line

    def announce(self, decision: Decision) -> None:
        announce_path(self, decision)


def metrics_for(manager):
    """With --enable-metrics SGLang sets PROMETHEUS_MULTIPROC_DIR before the
    schedulers start; the manager has no metrics flag of its own, nor a collector:
    the classes come from SGLang's scheduler role (metrics.collector_classes)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    import torch.distributed as dist

    from ..metrics import OffloadSyncMetrics, never_raising

    labels = {"tp_rank": dist.get_rank(group=manager.tp_group)}
    return never_raising(lambda: OffloadSyncMetrics(labels), "HiCache decode offload sync", labels)


def static_decision(manager, release: Optional[str]) -> Decision:
    if release is None:
        return blocking(
            "the guard matched no tested release for DecodeKVCacheOffloadManager's "
            "methods (docs/versions.md)",
            "untested_release",
        )
    cc = getattr(manager, "cache_controller", None)
    missing = [q for q in QUEUES if not hasattr(cc, q)]
    if missing:
        return blocking(f"the offload controller lacks {', '.join(missing)}", "missing_attrs")
    ws = int(getattr(manager, "tp_world_size", 1))
    if ws <= 1:
        return blocking(
            "world size 1: upstream runs no collective, nothing to hide", "world_size_1"
        )
    return Decision(True, "TP group", group=manager.tp_group, world_size=ws)


def state_of(manager) -> Optional[OffloadSyncState]:
    return manager.__dict__.get(STATE_ATTR)


def attach_state(manager, enabled: bool, release: Optional[str]) -> OffloadSyncState:
    return keep_state(manager, STATE_ATTR, OffloadSyncState(manager, enabled, release))


def _head(manager):
    def head(name, n: int) -> list:
        return queue_head(getattr(manager.cache_controller, str(name), None), n)

    return head


def _pop(manager, pops: dict) -> None:
    manager._check_offload_progress(pops.get("ack_write_queue", 0))
    manager._check_backup_progress(pops.get("ack_backup_queue", 0))


def check_offload_progress(state: OffloadSyncState, manager, original, *args, **kwargs):
    """One step: consume the due reduce and pop what it agreed on (upstream's
    pop methods), then count every queued entry and issue the next reduce."""
    decision = state.decide(manager)
    if not state.draining:  # a retraction is not a change of path worth a log line
        state.announce(decision)
    sync = state.sync
    if not decision.pipelined:
        if sync is not None and sync.pending:
            drained = sync.drain(_head(manager))  # every rank leaves with the same pops
            if drained is not None:
                _pop(manager, drained.pops)
        return original(manager, *args, **kwargs)
    assert sync is not None
    head = _head(manager)
    t0 = time.perf_counter()
    due = sync.consume_due(head)
    if due is not None:
        if state.metrics is not None:
            state.metrics.on_step(time.perf_counter() - t0, due.pops)
        _pop(manager, due.pops)
    cc = manager.cache_controller
    ready: dict[Hashable, Sequence[object]] = {
        "ack_write_queue": list(cc.ack_write_queue),
        "ack_backup_queue": head(QUEUES[1], CODE),  # every queued entry, under its mutex
    }
    sync.issue(ready, 0)
    return None


def drain_before_retraction(state: Optional[OffloadSyncState], manager, original, *a, **kw):
    """Retraction must see every offload popped now: its check_offload_progress
    runs upstream's blocking path (after popping what is in flight)."""
    if state is None:
        return original(manager, *a, **kw)
    state.draining = True
    try:
        return original(manager, *a, **kw)
    finally:
        state.draining = False


# ------------------------------------------------------------------------ hooks
# Target: sglang.srt.disaggregation.decode_kvcache_offload_manager.
# DecodeKVCacheOffloadManager (0.5.21-0.5.23 by the guard's table; 0.5.20 has no
# drain_before_retraction). Upstream PR: none yet (the ack sync's #39903 pattern
# on the offload queues); removable when upstream pipelines this reduce.


@hook
def around_check_offload_progress(original, manager, *args, **kwargs):
    """check_offload_progress, AROUND.
    Why: a blocking MIN all_reduce of the two queue sizes every decode step.
    How: at the first call, one blocking agreement in upstream's own layout
    (a stock peer or one with the setting off is named); then consume the
    reduce issued the step before, pop through upstream's _check_offload_progress
    / _check_backup_progress by identity, count every queued entry, issue async.
    Stands down: world size 1, missing queues, the setting off: upstream's
    method (after draining what is in flight), reason logged."""
    state = state_of(manager)
    if state is None:  # the setting is read at the manager's first step
        release = feature_release("decode_offload")
        state = attach_state(manager, offload_sync_enabled(), release)
    return check_offload_progress(state, manager, original, *args, **kwargs)


@hook
def around_drain_before_retraction(original, manager, *args, **kwargs):
    """drain_before_retraction, AROUND.
    Why: a retraction must find every offload popped, as upstream leaves it.
    How: its check_offload_progress runs upstream's blocking path (after
    popping the reduce in flight); no log line.
    Stands down: never needed; it only marks the call."""
    return drain_before_retraction(state_of(manager), manager, original, *args, **kwargs)


FEATURE = Feature(
    "decode_offload",
    (
        Hook(MANAGER_CLASS, "check_offload_progress", "AROUND", around_check_offload_progress),
        Hook(MANAGER_CLASS, "drain_before_retraction", "AROUND", around_drain_before_retraction),
    ),
    order="none: its two hooks wrap different methods of a class no other feature hooks",
)
