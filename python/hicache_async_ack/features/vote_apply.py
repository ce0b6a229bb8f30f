"""Where the prefetch decisions of a pass land on SGLang's UnifiedRadixCache:
right after the section is read back, before that boundary's pops, in the
order the interval made them (:class:`hicache_async_ack.protocol.votes.Verdicts`).

That point holds exactly the agreed state stock had when its walk made them:
the pops since the walk are those stock did before its walk (the ack counts'
reduce of pass p is popped at pass p + depth), and the pops of this boundary,
which stock did after its walk, have not run yet (docs/design.md). So each
decision runs through upstream's own code there, unchanged:

* a reach the group stopped: ``check_prefetch_progress`` with
  ``_can_terminate_prefetch`` answering yes for it; under ``timeout`` only
  where ``_prefetch_deadline_expired``'s KV-landed exemption does not hold on
  that state (judged with the group's deadline in place of this rank's clock),
  as stock judges it at the reach. Pages it inserts into the tree are host
  locked until the request is admitted or aborted: stock admits it in the same
  walk visit, so no pop runs between the two there (:class:`Pins`).
* a deferred abort: upstream's ``release_aborted_request``.
* a provisional prefetch (a request that arrived while this rank's budget was
  still held by operations stock had already ended): its budget judged as
  stock's was when it arrived; where stock would have declined it, the
  operation is revoked (nothing of it was drained yet) and upstream's own
  decline replayed (:func:`confirm`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..names import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)
PREDICATE = "_prefetch_deadline_expired"
RATE_LIMIT = "prefetch_rate_limited"


def operation_key(handle) -> tuple:
    return (handle.rid, handle.attempt_id)


# ---------------------------------------------------------------- the entries
@dataclass
class Provisional:
    """A prefetch started where this rank's budget said no, to be confirmed
    at the point stock decided it (``order``: its interval and sequence)."""

    handle: Any
    op: Any
    order: tuple
    span: int  # the occupancy it took
    stats: dict  # what it added to upstream's prefetch-outcome counters
    had_wait: bool  # the request had a deadline timer before it
    original: Callable
    args: tuple
    kwargs: dict


@dataclass
class Abort:
    original: Callable
    handle: Any
    args: tuple
    kwargs: dict


def apply(state, cache, verdicts) -> None:
    """Every entry of one interval, in its order (see the module docstring)."""
    for _, kind, payload in verdicts.entries:
        if kind == "reach":
            reach, stop = payload
            if stop:
                stop_reached(state, cache, reach.op)
        elif isinstance(payload, Abort):
            run_abort(state, cache, payload)
        elif isinstance(payload, Provisional):
            confirm(state, cache, payload)
    prune_creations(state)


def current(cache, op) -> bool:
    info = cache.ongoing_prefetch.get(op.handle)
    return info is not None and info.operation is op


def stop_reached(state, cache, op) -> None:
    """End ``op`` as stock's walk ended it, if it is still the request's
    operation (one that completed, was revoked or aborted since never is)."""
    if not current(cache, op) or op.is_terminated():
        return
    if cache.prefetch_stop_policy == "timeout" and kv_landed(cache, op):
        return  # stock's predicate says no at the reach: the prefetch goes on
    state.applying = op
    try:
        with capture_insert(cache) as inserted:
            cache.check_prefetch_progress(op.handle)
    finally:
        state.applying = None
    state.stopped += 1
    if state.metrics is not None:
        state.metrics.on_stop()
    if inserted is None:
        state.pins.cannot_watch(cache)
    elif inserted:
        state.pins.pin(cache, op.handle, inserted[-1])


def kv_landed(cache, op) -> bool:
    """Whether upstream's deadline predicate exempts ``op`` on this state: asked
    with the group's verdict (the deadline passed) in place of this rank's clock."""
    wait = cache._storage_prefetch_wait.get(op.handle)
    if wait is None:
        return True  # never polled here: no deadline of this rank to judge
    saved = wait.expired
    wait.expired = True
    try:
        return not getattr(cache, PREDICATE)(op)
    finally:
        wait.expired = saved


@contextmanager
def capture_insert(cache):
    """The host nodes ``tree_core.insert_host`` creates while the block runs."""
    tree = cache.tree_core
    found: list = []
    inst = getattr(tree, "__dict__", None)
    real = getattr(tree, "insert_host", None)
    if inst is None or real is None or "insert_host" in inst:
        yield None  # a tree core we cannot watch: no pin (said once, by Pins)
        return

    def insert_host(*args, **kwargs):
        result = real(*args, **kwargs)
        node = getattr(result, "inserted_host_node", None)
        if node is not None and not getattr(result, "host_insert_dropped", False):
            found.append(node)
        return result

    inst["insert_host"] = insert_host
    try:
        yield found
    finally:
        inst.pop("insert_host", None)


class Pins:
    """Host locks on the pages a stop inserted, released at the request's
    admission, abort, or the tree's reset."""

    def __init__(self):
        self.held: dict = {}  # handle -> (node id, dec params)
        self.said = False

    def cannot_watch(self, cache) -> None:
        if not self.said and cache.cache_controller is not None:
            self.said = True
            logger.warning(
                "HiCache prefetch votes: %s.insert_host cannot be watched: pages a stop "
                "inserts are not host-locked until their request is admitted (they can "
                "be evicted in between, where stock admits at once)",
                type(cache.tree_core).__name__,
            )

    def pin(self, cache, handle, node) -> None:
        self.release(cache, handle)
        self.held[handle] = (node, cache.inc_host_lock_ref(node).to_dec_params())

    def release(self, cache, handle) -> None:
        held = self.held.pop(handle, None)
        if held is not None:
            cache.dec_host_lock_ref(*held)

    def forget(self) -> None:
        """The tree was reset: its nodes, and their locks, are gone."""
        self.held.clear()


# ------------------------------------------------------------------- aborts
def run_abort(state, cache, abort: Abort) -> None:
    state.pins.release(cache, abort.handle)
    abort.original(cache, abort.handle, *abort.args, **abort.kwargs)


# -------------------------------------------------------- provisional starts
@contextmanager
def rate_limited(cc, value: Optional[bool]):
    """The controller's prefetch_rate_limited() answering ``value`` meanwhile
    (None: upstream's own answer)."""
    inst = cc.__dict__
    if value is None:
        yield
        return
    inst[RATE_LIMIT] = lambda: value
    try:
        yield
    finally:
        inst.pop(RATE_LIMIT, None)


def start(state, cache, original: Callable, request, args: tuple, kwargs: dict):
    """prefetch_from_storage inside a deferring interval: upstream's, and its
    order noted; where this rank's budget is spent (cache mode), started
    provisionally and confirmed where stock decided it."""
    cc = cache.cache_controller
    before = request in cache.ongoing_prefetch
    occupied = cc.prefetch_tokens_occupied
    provisional = cache.host_memory_mode == "cache" and cc.prefetch_rate_limited()
    stats = dict(cache._prefetch_outcome_stats) if provisional else {}
    had_wait = request in cache._storage_prefetch_wait
    with rate_limited(cc, False if provisional else None):
        result = original(cache, request, *args, **kwargs)
    info = cache.ongoing_prefetch.get(request)
    if before or info is None:
        return result
    order = (state.book.walks, state.book.next_seq())
    span = cc.prefetch_tokens_occupied - occupied
    state.creations.append((order, info.operation, span))
    if provisional:
        added = {k: v - stats.get(k, 0) for k, v in cache._prefetch_outcome_stats.items()}
        prov = Provisional(request, info.operation, order, span,
                           {k: v for k, v in added.items() if v}, had_wait,
                           original, args, kwargs)  # fmt: skip
        state.book.defer(prov)
        state.provisional += 1
        state.unconfirmed += 1
    return result


def confirm(state, cache, prov: Provisional) -> None:
    """Judge ``prov``'s budget as stock judged it when it arrived: the
    occupancy now, less what was started after it; revoke it and replay
    upstream's decline where stock said no."""
    state.unconfirmed -= 1
    if not current(cache, prov.op):
        return
    cc = cache.cache_controller
    later = sum(span for order, op, span in state.creations
                if order > prov.order and current(cache, op))  # fmt: skip
    held = later + prov.span
    cc.prefetch_tokens_occupied -= held
    try:
        limited = cc.prefetch_rate_limited()
    finally:
        cc.prefetch_tokens_occupied += held
    if not limited:
        return
    state.rolling_back = prov.handle
    try:
        cc.terminate_prefetch(prov.op)
        cache.revoke_pending_prefetch(prov.handle)
        if not prov.had_wait:
            cache._storage_prefetch_wait.pop(prov.handle, None)
        for k, v in prov.stats.items():
            cache._prefetch_outcome_stats[k] -= v
    finally:
        state.rolling_back = None
    with rate_limited(cc, True):
        prov.original(cache, prov.handle, *prov.args, **prov.kwargs)
    state.declined += 1


def prune_creations(state) -> None:
    """Creations matter only after a provisional start still to be confirmed."""
    if state.unconfirmed == 0:
        state.creations.clear()
