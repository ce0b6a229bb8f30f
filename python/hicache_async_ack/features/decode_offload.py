"""PD decode KV offload progress, an owner on the kit's template.

Upstream's ``check_offload_progress`` runs a blocking MIN all_reduce of the two queue
sizes every decode step, then pops that many acks and backups; here that reduce is
the protocol's pipelined one (consumed a step later, popped by identity). A stock
rank's ``int32[2]`` reduce paired with a longer one aborts gloo, so the first call on
every rank is a blocking agreement in that layout: plugin ranks send ``[OFFLOAD_CODE +
on, -(OFFLOAD_CODE + on)]``, far above a stock rank's sizes, and a differing peer is named.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, cast

from ..env import ENABLE_VAR, OFFLOAD_SYNC_VAR
from ..errors import OffloadSyncError, OffloadSyncMismatch
from ..guard import MANAGER_CLASS
from ..kit.decision import Decision, blocking, untested_release
from ..kit.environment import Environment
from ..kit.feature import Feature, feature_release
from ..kit.hooks import Fn
from ..kit.owner import OwnerState, Pops
from ..kit.views import OffloadController, OffloadManager
from ..names import DECODE_OFFLOAD, OFFLOAD_QUEUES
from ..protocol.stamp import OFFLOAD_CODE
from ..wire import protocol_hint

STOCK_HINT = (
    "that rank runs SGLang's blocking offload sync: give every node of the TP group "
    f"the same install and the same {ENABLE_VAR} / {OFFLOAD_SYNC_VAR}."
)
DRAINING = blocking("drain_before_retraction (pops everything now)", "draining")


def static_decision(manager: OffloadManager, release: Optional[str]) -> Decision:
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


class OffloadSyncState(OwnerState[OffloadManager]):
    """What is kept per DecodeKVCacheOffloadManager (its setting read when built, at the
    manager's first step)."""

    sync = DECODE_OFFLOAD
    exchange_while_blocking = True

    def __init__(
        self, manager: OffloadManager, blocker: Optional[Decision], env: Environment
    ) -> None:
        release = feature_release(self.sync.name)
        super().__init__(blocker or static_decision(manager, release), env)
        self.enabled = self.sync.setting.read()
        if self.static.pipelined:
            self.core = self.core_class(
                env.collectives.async_min(manager.tp_group),
                1,
                hints={"stock": STOCK_HINT, "protocol": protocol_hint()},
                clock=env.clock,
            )
        self.draining = False  # inside drain_before_retraction: upstream's path
        if self.static.pipelined and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # SGLang's metrics are on; the manager has no metrics flag nor collector
            self.metrics = self.make_metrics({"tp_rank": self.collectives.rank(manager.tp_group)})

    def dynamic_blocker(self, manager: OffloadManager) -> Optional[Decision]:
        if not self.enabled:
            return blocking(f"{OFFLOAD_SYNC_VAR}=0", "feature_disabled_by_env")
        return DRAINING if self.draining else None

    def announce(self, decision: Decision) -> None:
        if not self.draining:  # a retraction is not a change of path worth a log line
            super().announce(decision)

    def pipelined_details(self, decision: Decision) -> Sequence[str]:
        return (f"world size {decision.world_size}, depth 1",)

    def first_exchange(self, manager: OffloadManager) -> bool:
        """Once, blocking, in upstream's layout: see the module docstring."""
        s = OFFLOAD_CODE + int(self.enabled)
        try:
            lo, hi = self.collectives.int32_min(self.static.group, [s, -s])
        except Exception as exc:
            raise OffloadSyncError(
                f"{self.sync.title}: the one-time agreement failed ({exc})"
            ) from exc
        hi = -hi
        if lo < OFFLOAD_CODE:
            raise OffloadSyncMismatch(
                f"{self.sync.title}: this node pipelines, a peer does not: {STOCK_HINT} "
                "Stopping before any pop."
            )
        if lo != hi:
            raise OffloadSyncMismatch(
                f"{self.sync.title}: {OFFLOAD_SYNC_VAR} differs across the TP group: this "
                f"rank {int(self.enabled)}, group min {lo - OFFLOAD_CODE}, max "
                f"{hi - OFFLOAD_CODE}. Set it identically on every node. Stopping before any pop."
            )
        self.agreed = True
        return True

    def ready(self, manager: OffloadManager) -> tuple[Mapping[Hashable, Sequence[object]], int]:
        """Every queued entry (upstream counts them all, finished or not)."""
        writes, backups = OFFLOAD_QUEUES
        cc = cast(OffloadController, manager.cache_controller)  # static_decision: present
        every_backup = self.head(manager)(backups, sys.maxsize)
        return {writes: list(cc.ack_write_queue), backups: every_backup}, 0

    def pop(self, manager: OffloadManager, pops: Pops) -> None:
        manager._check_offload_progress(pops.get(OFFLOAD_QUEUES[0], 0))
        manager._check_backup_progress(pops.get(OFFLOAD_QUEUES[1], 0))

    def drain_before_retraction(self, manager: OffloadManager, original: Callable[..., Any],
                                *args: object, **kwargs: object) -> Any:  # fmt: skip
        """A retraction must see every offload popped: upstream's blocking path runs."""
        self.draining = True
        try:
            result = original(manager, *args, **kwargs)
        finally:
            self.draining = False
        return result


FEATURE = Feature(DECODE_OFFLOAD, OffloadSyncState, MANAGER_CLASS)


# ------------------------------------------------------------------------ hooks
# Target: sglang.srt.disaggregation.decode_kvcache_offload_manager.
# DecodeKVCacheOffloadManager (0.5.21-0.5.23; 0.5.20 lacks drain_before_retraction).
# Upstream PR: none yet (#39903's pattern). Removal: when upstream pipelines this reduce.


@FEATURE.hook(MANAGER_CLASS, "check_offload_progress", "AROUND")
def around_check_offload_progress(
    original: Fn, manager: OffloadManager, *args: object, **kwargs: object
) -> Any:
    """check_offload_progress, AROUND.
    Why: a blocking MIN all_reduce of the two queue sizes every decode step.
    How: the owner template's step: agreement once; consume, pop by identity, issue.
    Stands down: world size 1, missing queues, setting off: upstream's (after a drain)."""
    return FEATURE.ensure(manager).step(manager, original, *args, **kwargs)


@FEATURE.hook(MANAGER_CLASS, "drain_before_retraction", "AROUND")
def around_drain_before_retraction(
    original: Fn, manager: OffloadManager, *args: object, **kwargs: object
) -> Any:
    """drain_before_retraction, AROUND.
    Why: a retraction must find every offload popped, as upstream leaves it.
    How: its check_offload_progress runs upstream's blocking path (after a drain).
    Stands down: never needed; it only marks the call."""
    state = FEATURE.state_of(manager)
    if state is None:
        return original(manager, *args, **kwargs)
    return state.drain_before_retraction(manager, original, *args, **kwargs)
