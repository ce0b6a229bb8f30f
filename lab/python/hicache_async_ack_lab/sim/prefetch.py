"""Storage prefetch operations on the real ``UnifiedRadixCache`` of :mod:`.cache`.

Test support (tests and bench). ``check_prefetch_progress``,
``_can_terminate_prefetch``, the deadline timer (``_start_storage_prefetch_wait``,
``_prefetch_deadline_expired``, ``_mark_prefetch_deadline_expired``) and
``revoke_pending_prefetch`` are upstream's code on upstream's
``PrefetchOperation``; the bookkeeping a terminated operation lands in (the
retire, the outcome accounting, the retry tracker) is recorded instead of
applied, as :mod:`.cache` does for acks.

Operations carry no host indices (the storage query has not returned), so a
terminated one is revoked; every revoke is recorded as ``(key, reason)`` in
``PrefetchSim.ended`` with the check that ended it. A storage read that
finishes (:meth:`PrefetchSim.complete`) puts its final ack on the
controller's ``ack_prefetch_queue``, as the transfer worker does for every
operation; upstream's drain (inside ``check_hicache_events``, by the agreed
count) hands a still-current one to ``_handle_prefetch_result``, recorded as
``(key, "completed")``.

The deadline is upstream's admission-poll timer, counted in passes: it starts
at the first check that finds the operation unfinished (upstream's own
``_start_storage_prefetch_wait``), and passes ``budget(op)`` passes later on
this rank's clock (``clock.now``), or when the group marked it expired. So, as
in SGLang, a request the waiting-queue walk never reaches is never timed out,
and each rank's deadline can fall in another pass, deterministically.
``deadline`` replaces the whole predicate instead (a bench that wants
deadlines at fixed passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional, cast

from hicache_async_ack_lab.sim.cache import Entry, SimCache


@dataclass
class PrefetchSim:
    sim: SimCache
    ended: list = field(default_factory=list)  # (key, reason), in termination order
    checks: int = 0  # check_prefetch_progress calls
    first_poll: dict = field(default_factory=dict)  # handle -> the pass its wait started
    epoch: int = 0  # bumped by reset: the storage workers were stopped
    _seq: int = 0

    @property
    def cache(self):
        return self.sim.cache

    def add(self, rid: str, attempt: int = 0, pages: int = 4):
        """A new ongoing prefetch for request ``rid`` (as prefetch_from_storage
        leaves it after submitting); returns its handle."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            PrefetchOperation,
        )
        from sglang.srt.mem_cache.unified_radix_cache import _OngoingPrefetch

        handle = CacheRequestHandle(rid=rid, attempt_id=attempt)
        op = PrefetchOperation(handle, list(range(pages)))
        op.stats_requested_tokens = pages
        self.cache.ongoing_prefetch[handle] = _OngoingPrefetch(None, None, None, op, None, {})
        return handle

    def check(self, handle) -> bool:
        """The scheduler's call for one waiting request."""
        self.checks += 1
        return self.cache.check_prefetch_progress(handle)

    def read_queue(self) -> tuple:
        """Where a read submitted now reports to: the ack queue and the
        controller's epoch (upstream's reset stops and joins the storage
        threads before it clears the queues, and storage attach builds new
        ones, so a read in flight then never reports)."""
        return (self.sim.cc.storage_queue("ack_prefetch_queue"), self.epoch)

    def complete(self, operation, where: tuple) -> bool:
        """This rank's transfer worker finished ``operation``'s read, submitted
        when ``where`` was :meth:`read_queue`: its final ack goes there, as
        upstream's worker sends one for every operation, also a terminated one
        (False if its worker was stopped or its queue replaced meanwhile)."""
        if where != self.read_queue():
            return False
        queue = where[0]
        operation.ack_releases_incomplete_host_indices = False  # no host indices
        uid = self.sim.cc.next_uid()
        ack = Entry(uid=uid, id=uid, handle=operation.handle, operation=operation)
        ack.completed_req = True
        if not operation.is_terminated():
            ack.completed_tokens = len(operation.token_ids)
        queue.put(ack)
        return True

    def revoke(self, handle) -> None:
        """release_aborted_request's path for a prefetch without host indices."""
        info = self.cache.ongoing_prefetch.get(handle)
        if info is not None:
            self.cache.cache_controller.terminate_prefetch(info.operation)
            self.cache.revoke_pending_prefetch(handle)

    def detach(self) -> None:
        """detach_storage_backend: release every tracked prefetch, storage off."""
        for handle in list(self.cache.ongoing_prefetch):
            self.revoke(handle)
        self.sim.detach_storage()

    def reset(self) -> None:
        """flush_cache: upstream's reset (which clears what it tracks, after
        stopping the storage workers: reads in flight never report)."""
        for handle in list(self.cache.ongoing_prefetch):
            self.revoke(handle)
        self.sim.reset()
        self.epoch += 1


def add_prefetch(
    sim: SimCache,
    policy: str = "timeout",
    timeout_s: float = 3600.0,
    deadline: Optional[Callable[[Any], bool]] = None,
    budget: Optional[Callable[[Any], int]] = None,
    clock: Any = None,
) -> PrefetchSim:
    """Give ``sim``'s cache what the prefetch path reads. With ``budget(op)`` and
    ``clock`` (``.now``, in passes), the deadline passes ``budget(op)`` passes
    after the operation's first unfinished check; ``deadline(op)`` stands in
    for the whole predicate."""
    ps = PrefetchSim(sim)
    cache, cc = sim.cache, cast(Any, sim.cc)  # gains the controller calls of the path
    d = cache.__dict__
    d.update(
        prefetch_stop_policy=policy,
        prefetch_timeout_base=timeout_s,
        prefetch_timeout_per_page=0.0,
        page_size=1,
        _storage_prefetch_wait={},
        storage_prefetch_retries=SimpleNamespace(
            cancel=lambda rid: None, poll_miss=lambda rid: None, refetch=lambda *a: None
        ),
    )
    cc.pp_prefetch_decisions = {}

    def terminate_prefetch(operation):
        operation.mark_terminate()
        return operation.completed_tokens, operation.hash_value

    cc.terminate_prefetch = terminate_prefetch

    reasons: dict = {}  # request -> the first outcome recorded for it

    def finish(request, fulfilled_tokens=0, reason=""):
        reasons.setdefault(request, reason)

    def retire(request, host_indices, extra_pools):
        cache.ongoing_prefetch.pop(request)
        ps.ended.append(((request.rid, request.attempt_id), reasons.pop(request, "")))

    def handle_result(operation):  # the completed read, inserted into the tree upstream
        cache.ongoing_prefetch.pop(operation.handle)
        key = (operation.handle.rid, operation.handle.attempt_id)
        ps.ended.append((key, "completed"))

    d["_finish_storage_prefetch"] = finish
    d["_handle_prefetch_result"] = handle_result
    d["_retire_ongoing_prefetch"] = retire
    if deadline is not None:
        d["_prefetch_deadline_expired"] = deadline
    elif budget is not None:
        assert clock is not None, "a budget counts passes of a clock"
        d["_prefetch_deadline_expired"] = poll_deadline(ps, budget, clock)
        start = cache._start_storage_prefetch_wait  # upstream's, bound

        def start_wait(operation):
            started = operation.handle in cache._storage_prefetch_wait
            start(operation)
            if not started and operation.handle in cache._storage_prefetch_wait:
                ps.first_poll[operation.handle] = clock.now

        d["_start_storage_prefetch_wait"] = start_wait
    return ps


def poll_deadline(ps: PrefetchSim, budget: Callable[[Any], int], clock: Any):
    """Upstream's deadline predicate on a pass clock: no wait before the first
    unfinished check; the group's expired mark; else ``budget`` passes on."""

    def expired(operation) -> bool:
        wait = ps.cache._storage_prefetch_wait.get(operation.handle)  # reset() replaces it
        if wait is None:
            return False
        if wait.expired:
            return True
        started = ps.first_poll.get(operation.handle)
        return started is not None and clock.now >= started + budget(operation)

    return expired
