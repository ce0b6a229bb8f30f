"""PD decode KV offload progress, pipelined with the ack sync's core.

With ``--disaggregation-decode-enable-offload-kvcache`` the decode scheduler calls
``DecodeKVCacheOffloadManager.check_offload_progress`` every step: a blocking
MIN all_reduce over the TP group of ``[len(ack_write_queue),
ack_backup_queue.qsize()]``, then it pops that many device-to-host acks
(``_check_offload_progress``, which synchronizes each ack's event) and storage
backups (``_check_backup_progress``). Here the reduce is
:class:`~hicache_async_ack.protocol.reduce.PipelinedAckSync`'s: issued async at the end
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

from ..env import ENABLE_VAR, OFFLOAD_SYNC_VAR, offload_sync_enabled
from ..errors import OffloadSyncError, OffloadSyncMismatch
from ..guard import MANAGER_CLASS, feature_release
from ..kit.collectives import Collectives
from ..kit.decision import Decision, blocking, untested_release
from ..kit.feature import Feature, FeatureState
from ..kit.queues import head_reader
from ..names import OFFLOAD, OFFLOAD_QUEUES, TITLES
from ..protocol.reduce import PipelinedAckSync

CODE = 1 << 30  # above any queue size a stock rank sends in the agreement


STOCK_HINT = (
    "that rank runs SGLang's blocking offload sync: give every node of the TP group "
    f"the same install and the same {ENABLE_VAR} / {OFFLOAD_SYNC_VAR}."
)


class OffloadSyncState(FeatureState):
    """What is kept per DecodeKVCacheOffloadManager."""

    feature = OFFLOAD

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
                title=TITLES[OFFLOAD],
                errors=(OffloadSyncError, OffloadSyncMismatch),
            )
        self.draining = False  # inside drain_before_retraction: upstream's path
        self.head = head_reader(manager)
        if self.static.pipelined:
            self.metrics = metrics_for(manager)

    def dynamic_blocker(self, manager) -> Optional[Decision]:
        if not self.enabled:
            return blocking(f"{OFFLOAD_SYNC_VAR}=0", "feature_disabled_by_env")
        if self.draining:
            return blocking("drain_before_retraction (pops everything now)", "draining")
        return None

    def first_exchange(self, manager) -> None:
        """Once, blocking, in upstream's layout: see the module docstring."""
        s = CODE + int(self.enabled)
        try:
            lo, hi = self.collectives.int32_min(self.static.group, [s, -s])
        except Exception as exc:
            raise OffloadSyncError(
                f"HiCache decode offload sync: the one-time agreement failed ({exc})"
            ) from exc
        hi = -hi
        if lo < CODE:
            raise OffloadSyncMismatch(
                "HiCache decode offload sync: this node pipelines, a peer does not: "
                f"{STOCK_HINT} Stopping before any pop."
            )
        if lo != hi:
            raise OffloadSyncMismatch(
                f"HiCache decode offload sync: {OFFLOAD_SYNC_VAR} differs across the TP "
                f"group: this rank {int(self.enabled)}, group min {lo - CODE}, max "
                f"{hi - CODE}. Set it identically on every node. Stopping before any pop."
            )
        self.agreed = True

    def pipelined_details(self, decision: Decision):
        return (f"world size {decision.world_size}, depth 1",)


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
    untested = untested_release(release, "DecodeKVCacheOffloadManager's methods")
    if untested is not None:
        return untested
    cc = getattr(manager, "cache_controller", None)
    missing = [q for q in OFFLOAD_QUEUES if not hasattr(cc, q)]
    if missing:
        return blocking(f"the offload controller lacks {', '.join(missing)}", "missing_attrs")
    ws = int(getattr(manager, "tp_world_size", 1))
    if ws <= 1:
        return blocking(
            "world size 1: upstream runs no collective, nothing to hide", "world_size_1"
        )
    return Decision(True, "TP group", group=manager.tp_group, world_size=ws)


def build(manager) -> OffloadSyncState:
    """The manager's state (the setting read at its first step, as for the caches)."""
    return OffloadSyncState(manager, offload_sync_enabled(), feature_release(OFFLOAD))


FEATURE = Feature(OFFLOAD, "_hicache_offload_sync_state", build)


def pop_agreed(manager, pops: dict) -> None:
    manager._check_offload_progress(pops.get(OFFLOAD_QUEUES[0], 0))
    manager._check_backup_progress(pops.get(OFFLOAD_QUEUES[1], 0))


def check_offload_progress(state: OffloadSyncState, manager, original, *args, **kwargs):
    """One step: at the first, the agreement; then consume the due reduce and
    pop what it agreed on (upstream's pop methods), count every queued entry and
    issue the next reduce."""
    if state.static.pipelined and not state.agreed:
        state.first_exchange(manager)
    decision = state.decide(manager)
    if not state.draining:  # a retraction is not a change of path worth a log line
        state.announce(decision)
    sync = state.sync
    if not decision.pipelined:
        if sync is not None and sync.pending:
            drained = sync.drain(state.head)  # every rank leaves with the same pops
            if drained is not None:
                pop_agreed(manager, drained.pops)
        return original(manager, *args, **kwargs)
    assert sync is not None
    t0 = time.perf_counter()
    due = sync.consume_due(state.head)
    if due is not None:
        if state.metrics is not None:
            state.metrics.on_step(time.perf_counter() - t0, due.pops)
        pop_agreed(manager, due.pops)
    cc = manager.cache_controller
    writes, backups = OFFLOAD_QUEUES
    ready: dict[Hashable, Sequence[object]] = {
        writes: list(cc.ack_write_queue),
        backups: state.head(backups, CODE),  # every queued entry, under its mutex
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


@FEATURE.hook(MANAGER_CLASS, "check_offload_progress", "AROUND")
def around_check_offload_progress(original, manager, *args, **kwargs):
    """check_offload_progress, AROUND.
    Why: a blocking MIN all_reduce of the two queue sizes every decode step.
    How: at the first call, one blocking agreement in upstream's own layout
    (a stock peer or one with the setting off is named); then consume the
    reduce issued the step before, pop through upstream's _check_offload_progress
    / _check_backup_progress by identity, count every queued entry, issue async.
    Stands down: world size 1, missing queues, the setting off: upstream's
    method (after draining what is in flight), reason logged."""
    state = FEATURE.ensure(manager)  # the setting is read at the manager's first step
    return check_offload_progress(state, manager, original, *args, **kwargs)


@FEATURE.hook(MANAGER_CLASS, "drain_before_retraction", "AROUND")
def around_drain_before_retraction(original, manager, *args, **kwargs):
    """drain_before_retraction, AROUND.
    Why: a retraction must find every offload popped, as upstream leaves it.
    How: its check_offload_progress runs upstream's blocking path (after
    popping the reduce in flight); no log line.
    Stands down: never needed; it only marks the call."""
    state = FEATURE.state_of(manager)
    return drain_before_retraction(state, manager, original, *args, **kwargs)
