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
``(key, "completed")``. ``deadline`` replaces the
real admission-poll timer with a predicate (per rank, in passes) where a test
needs ranks whose clocks disagree deterministically.
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

    def read_queue(self):
        """The ack queue a read submitted now reports to (reset and storage
        attach build new ones; a read of an older one reports nowhere)."""
        return self.sim.cc.storage_queue("ack_prefetch_queue")

    def complete(self, operation, queue) -> bool:
        """This rank's transfer worker finished ``operation``'s read, submitted
        while ``queue`` was the ack queue: its final ack goes there, as
        upstream's worker sends one for every operation, also a terminated one
        (False if that queue was replaced meanwhile)."""
        if queue is not self.read_queue():
            return False
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
        """flush_cache: upstream's reset (which clears what it tracks)."""
        for handle in list(self.cache.ongoing_prefetch):
            self.revoke(handle)
        self.sim.reset()


def add_prefetch(
    sim: SimCache,
    policy: str = "timeout",
    timeout_s: float = 3600.0,
    deadline: Optional[Callable[[Any], bool]] = None,
) -> PrefetchSim:
    """Give ``sim``'s cache what the prefetch path reads. ``deadline(op)``, if
    given, stands in for ``_prefetch_deadline_expired`` (this rank's clock)."""
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
    return ps
