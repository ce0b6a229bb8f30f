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

import logging
import os
import time
from typing import Any, Callable, Hashable, Optional, Sequence

from . import ack_sync
from .ack_sync import Decision
from .core import HiCacheAckSyncError, HiCacheAckSyncMismatch, PipelinedAckSync
from .env import ENABLE_VAR, OFFLOAD_SYNC_VAR

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")

MANAGER_MODULE = "sglang.srt.disaggregation.decode_kvcache_offload_manager"
MANAGER_CLASS = f"{MANAGER_MODULE}.DecodeKVCacheOffloadManager"
# Releases whose check_offload_progress / _check_offload_progress /
# _check_backup_progress / drain_before_retraction were read for this (the four
# are identical from 0.5.21 to 0.5.23; 0.5.20 has no drain_before_retraction).
VERIFIED_RELEASES = ("0.5.21", "0.5.22", "0.5.23")
# Their fingerprints there (hicache_async_ack.fingerprint, BODY scope), checked
# on the live methods when a manager is first seen: a later release that changed
# one of them stays on upstream's path, naming it.
VERIFIED_FINGERPRINTS = {
    "check_offload_progress": "7f009a5799255553",
    "_check_offload_progress": "835a5e1f74e1411f",
    "_check_backup_progress": "29898ef013bdee2b",
    "drain_before_retraction": "999b3eaf0cc17589",
}
QUEUES = ("ack_write_queue", "ack_backup_queue")
CODE = 1 << 30  # above any queue size a stock rank sends in the agreement
_STATE_ATTR = "_hicache_offload_sync_state"
STOCK_HINT = (
    "that rank runs SGLang's blocking offload sync: give every node of the TP group "
    f"the same install and the same {ENABLE_VAR} / {OFFLOAD_SYNC_VAR}."
)


def torch_agreement(group, values: list[int]) -> list[int]:
    """A blocking MIN all_reduce of an int32 tensor: upstream's layout and dtype."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


# (group, values) -> reduced; tests swap in their own
agreement_reduce: Callable[[Any, list[int]], list[int]] = torch_agreement


class OffloadSyncState:
    def __init__(self, manager, enabled: bool, release: Optional[str]):
        self.enabled = enabled
        self.static = static_decision(manager, release)
        self.sync: Optional[PipelinedAckSync] = None
        if self.static.pipelined:
            self.sync = PipelinedAckSync(
                ack_sync.collective_factory(manager.tp_group),
                1,
                hints={"stock": STOCK_HINT, "protocol": STOCK_HINT},
            )
        self.agreed = False
        self.draining = False  # inside drain_before_retraction: upstream's path
        self.metrics: Any = metrics_for(manager) if self.static.pipelined else None
        self.announced: Optional[tuple] = None

    def decide(self, manager) -> Decision:
        if not self.static.pipelined:
            return self.static
        if not self.agreed:
            self.agree()
        if not self.enabled:
            return Decision(False, f"{OFFLOAD_SYNC_VAR}=0")
        if self.draining:
            return Decision(False, "drain_before_retraction (pops everything now)")
        return self.static

    def agree(self) -> None:
        """Once, blocking, in upstream's layout: see the module docstring."""
        s = CODE + int(self.enabled)
        try:
            lo, hi = agreement_reduce(self.static.group, [s, -s])
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

    def announce(self, decision: Decision) -> None:
        ack_sync.announce_path(self, decision, "HiCache decode offload sync", ", depth 1", logger)


def changed_methods() -> list[str]:
    """The manager's methods whose live fingerprint differs from the verified one."""
    from .upstream import BODY, Target, probe_live

    out = []
    for name, fp in VERIFIED_FINGERPRINTS.items():
        probe = probe_live(
            Target(MANAGER_MODULE, f"DecodeKVCacheOffloadManager.{name}", None, BODY, "")
        )
        if probe.fingerprint != fp:
            out.append(name)
    return out


def metrics_for(manager):
    """With --enable-metrics SGLang sets PROMETHEUS_MULTIPROC_DIR before the
    schedulers start; the manager has no metrics flag of its own."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    import torch.distributed as dist

    from .metrics import OffloadSyncMetrics

    return OffloadSyncMetrics({"tp_rank": dist.get_rank(group=manager.tp_group)})


def static_decision(manager, release: Optional[str]) -> Decision:
    verified = ", ".join(VERIFIED_RELEASES)
    if release not in VERIFIED_RELEASES:
        seen = release or "an untested release"
        return Decision(
            False, f"SGLang's decode offload path here is that of {seen}; verified on {verified}"
        )
    changed = changed_methods()
    if changed:
        return Decision(
            False, f"DecodeKVCacheOffloadManager.{', '.join(changed)} differ from {verified}"
        )
    cc = getattr(manager, "cache_controller", None)
    missing = [q for q in QUEUES if not hasattr(cc, q)]
    if missing:
        return Decision(False, f"the offload controller lacks {', '.join(missing)}")
    ws = int(getattr(manager, "tp_world_size", 1))
    if ws <= 1:
        return Decision(False, "world size 1: upstream runs no collective, nothing to hide")
    return Decision(True, "TP group", manager.tp_group, ws)


def state_of(manager) -> Optional[OffloadSyncState]:
    return manager.__dict__.get(_STATE_ATTR)


def attach_state(manager, enabled: bool, release: Optional[str]) -> OffloadSyncState:
    state = OffloadSyncState(manager, enabled, release)
    manager.__dict__[_STATE_ATTR] = state
    return state


def _head(manager):
    def head(name, n: int) -> list:
        return ack_sync._queue_head(getattr(manager.cache_controller, str(name), None), n)

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
