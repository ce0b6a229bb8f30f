"""Where the prefetch votes' verdicts land: right after a section is read back, before
that boundary's pops, in walk order (docs/design.md).

That point holds the agreed state stock's walk saw, so a stop runs through upstream's
own ``check_prefetch_progress`` with ``_can_terminate_prefetch`` answering yes for that
operation (:attr:`Landing.applying`); under ``timeout`` only where the deadline
predicate's KV-landed exemption does not hold, judged with the group's verdict. Stock
admits a stopped request in the same walk visit; here this boundary's pops run in
between, so the node a stop inserts is host-locked (:class:`Pins`) until the request's
admission or abort, or at the latest the next pass boundary.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional, cast

from ..kit.views import Cache, InsertResult, Operation, RequestHandle
from ..names import LOGGER_NAME, PREFETCH_VOTES, TIMEOUT
from ..protocol.votes import Verdicts

logger = logging.getLogger(LOGGER_NAME)
PREDICATE = "_prefetch_deadline_expired"
Emit = Callable[..., None]


def operation_key(handle: Hashable) -> tuple[str, int]:
    h = cast(RequestHandle, handle)
    return (h.rid, h.attempt_id)


class Pins:
    """Host locks on the nodes stops inserted, for one pass at most."""

    def __init__(self, emit: Emit) -> None:
        self.held: dict[Hashable, tuple[object, object]] = {}  # handle -> (node, dec params)
        self.emit = emit
        self.said = False

    def pin(self, cache: Cache, handle: Hashable, node: object) -> None:
        self.release(cache, handle, "replaced")
        self.held[handle] = (node, cache.inc_host_lock_ref(node).to_dec_params())
        self.emit("pin", key=operation_key(handle))

    def release(self, cache: Cache, handle: Hashable, why: str) -> None:
        held = self.held.pop(handle, None)
        if held is not None:
            cache.dec_host_lock_ref(*held)
            self.emit("unpin", key=operation_key(handle), why=why)

    def release_all(self, cache: Cache) -> None:
        """The pass is over: what its walk did not admit is unpinned."""
        for handle in list(self.held):
            self.release(cache, handle, "pass")

    def forget(self) -> None:
        """The tree was reset: its nodes, and their locks, are gone."""
        self.held.clear()

    def cannot_watch(self, cache: Cache) -> None:
        if not self.said and cache.cache_controller is not None:
            self.said = True
            logger.warning(
                "%s: %s.insert_host cannot be watched: the pages a stop "
                "inserts are not host-locked until the walk that follows (they can be "
                "evicted by that boundary's pops, where stock admits at once)",
                PREFETCH_VOTES.title,
                type(cache.tree_core).__name__,
            )


class Landing:
    """Applies one interval's verdicts; owns the pins and the operation being stopped."""

    pins_class: type[Pins] = Pins

    def __init__(self, emit: Emit) -> None:
        self.applying: Optional[object] = None
        self.pins = self.pins_class(emit)
        self.emit = emit

    def apply(self, cache: Cache, verdicts: Verdicts) -> int:
        """Every stop of one interval, in walk order; returns how many landed."""
        stopped = 0
        for reach, stop in verdicts:
            self.emit("verdict", key=reach.key, stop=stop)
            if stop and self.stop(cache, cast(Operation, reach.op)):
                stopped += 1
        return stopped

    def stop(self, cache: Cache, op: Operation) -> bool:
        """End ``op`` as stock's walk did, if still its request's live operation."""
        info = cache.ongoing_prefetch.get(op.handle)
        if info is None or info.operation is not op or op.is_terminated():
            return False
        if cache.prefetch_stop_policy == TIMEOUT and self.kv_landed(cache, op):
            return False  # stock's predicate says no at the reach: the prefetch goes on
        self.applying = op
        try:
            with captured_insert(cache) as inserted:
                cache.check_prefetch_progress(op.handle)
        finally:
            self.applying = None
        self.emit("stop", key=operation_key(op.handle))
        if inserted is None:
            self.pins.cannot_watch(cache)
        elif inserted:
            self.pins.pin(cache, op.handle, inserted[-1])
        return True

    def kv_landed(self, cache: Cache, op: Operation) -> bool:
        """Whether upstream's deadline predicate exempts ``op``, asked with the group's
        verdict (deadline passed) in place of this rank's clock."""
        wait = cache._storage_prefetch_wait.get(op.handle)
        if wait is None:
            return True  # never polled here: no deadline of this rank to judge
        saved = wait.expired
        wait.expired = True
        try:
            expired: Callable[[Operation], bool] = getattr(cache, PREDICATE)
            return not expired(op)
        finally:
            wait.expired = saved


@contextmanager
def captured_insert(cache: Cache) -> Iterator[Optional[list[object]]]:
    """The host nodes ``tree_core.insert_host`` creates in the block (None: unwatchable)."""
    tree = cache.tree_core
    found: list[object] = []
    inst = getattr(tree, "__dict__", None)
    real = getattr(tree, "insert_host", None)
    if inst is None or real is None or "insert_host" in inst:
        yield None
        return

    def insert_host(*args: object, **kwargs: object) -> object:
        result = cast(InsertResult, real(*args, **kwargs))
        node = getattr(result, "inserted_host_node", None)
        if node is not None and not getattr(result, "host_insert_dropped", False):
            found.append(node)
        return result

    inst["insert_host"] = insert_host
    try:
        yield found
    finally:
        inst.pop("insert_host", None)
