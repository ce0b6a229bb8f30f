"""The whole storage-prefetch lifecycle on the real ``UnifiedRadixCache``: a
host pool with a capacity, a tree that takes inserted prefixes and evicts
host pages, and a storage backend that answers hit queries and reads on a
script, so upstream's own code decides everything in between.

Test support (the differential harness, :mod:`hicache_async_ack_lab.testing.
differential`). Upstream's code runs unchanged: ``prefetch_from_storage``
(threshold, rate limit, anchor lock, occupancy), ``check_prefetch_progress``
and ``_can_terminate_prefetch`` (the deadline, with its KV-landed exemption),
the storage drain (hit allocation, with eviction and partial allocation; the
progress and final acks; host releases), ``_handle_prefetch_result``,
``revoke_pending_prefetch``, ``release_aborted_request`` and the accounting
(``_finish_storage_prefetch``, ``_account_prefetch_outcome``). What stands in:

* the controller's side (``submit_prefetch``, ``allocate_storage_hit`` as the
  base controller allocates, ``terminate_prefetch``, ``append_host_mem_release``
  by page, the rate limit), a :class:`HostPool` of pages that refuses a double
  free; with a sidecar pool, its release queue (a KV-derived sidecar reuses the
  KV's indices, so upstream queues nothing of its own there);
* the tree's side: :class:`~hicache_async_ack_lab.sim.host_tree.HostTree`;
* the storage (:class:`Script`): per rank, a hit answer, read progress and the
  final ack, each delivered a number of passes after the prefetch was
  submitted, with the values every rank agrees on (upstream's query and sync
  threads MIN-reduce them before the scheduler sees them), capped by what the
  allocation kept when the scheduler reads them. The hit is what L3 holds of
  the request's prompt from its first token, so a query from a matched prefix
  finds the rest of it; a failed query answers 0, a failed read stops short
  (``error``). One script per submission of a request (a storage retry submits
  again), and the synchronous hit query of a PD decode node's prealloc
  (``_storage_hit_query``) answered from the next one; every L3 query, every
  read started and the keys (pages) it reads are counted;
* the deadline (:class:`PassTimer`): upstream's admission-poll timer counted in
  passes, per rank, from the first check that finds the prefetch unfinished.

Everything the lifecycle does is recorded in :class:`Record`, per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, cast

from hicache_async_ack_lab.sim.cache import RecordingQueue, SimController
from hicache_async_ack_lab.sim.host_tree import SimViolation


@dataclass
class Record:
    """What happened, in order: (pass, key, kind, detail) per event; ``key`` is a
    request handle's (rid, attempt), or a cold node's name."""

    clock: Any
    events: list = field(default_factory=list)
    admitting: bool = False  # inside the admission accounting

    def add(self, key, kind: str, *detail) -> None:
        self.events.append((self.clock.now, key, kind, list(detail)))


def handle_key(handle) -> tuple:
    return (handle.rid, handle.attempt_id)


class HostPool:
    """Host slots 0..size-1 in pages of ``page_size``; the lowest free pages go
    first (``free_pages``: the free slots)."""

    def __init__(self, size: int, page_size: int = 1):
        self.page_size = page_size
        self.size = self.logical_size = size // page_size * page_size
        self.free_pages = set(range(self.size))

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, n: int):
        import torch

        ps = self.page_size
        if n <= 0 or n % ps or n > len(self.free_pages):
            return None
        starts = sorted(p for p in self.free_pages if p % ps == 0)[: n // ps]
        slots = [s + i for s in starts for i in range(ps)]
        self.free_pages.difference_update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, indices, pool=None) -> None:
        pages = [int(i) for i in indices.tolist()]
        taken = [p for p in pages if p in self.free_pages or not 0 <= p < self.size]
        if taken or len(set(pages)) != len(pages):
            raise SimViolation(f"host pages freed twice or never allocated: {taken or pages}")
        self.free_pages.update(pages)

    def clear(self) -> None:
        self.free_pages = set(range(self.size))


class PassTimer:
    """A PollTimer that counts passes of ``clock`` instead of seconds."""

    def __init__(self, clock):
        self.clock = clock
        self.started_at: Optional[int] = clock.now

    @property
    def running(self) -> bool:
        return self.started_at is not None

    def elapsed(self) -> float:
        return float(self.clock.now - self.started_at) if self.started_at is not None else 0.0

    def observe(self, ready: bool) -> float:
        if ready:
            out, self.started_at = self.elapsed(), None
            return out
        if self.started_at is None:
            self.started_at = self.clock.now
        return 0.0


@dataclass
class Script:
    """One request's storage, as this rank sees it: passes after submission."""

    hit_at: Optional[int]  # the hit answer (None: the query never returns)
    hit_tokens: int  # what L3 holds of the prompt, from its first token
    progress: list  # [(passes after submission, tokens read so far)], rising
    finish_at: Optional[int]  # the final ack (completed_req)
    error: Optional[str] = None  # "query": it answers 0; "read": progress stops short


@dataclass(eq=False)
class SimAck:
    """A PrefetchAck as upstream's sync thread publishes it; the tokens are read
    when the scheduler drains it, capped by the pages the allocation kept."""

    uid: int
    operation: Any
    tokens: Optional[int]
    completed_req: bool
    page_size: int = 1
    pool_hits: Any = None

    @property
    def completed_tokens(self) -> Optional[int]:
        if self.tokens is None:
            return None
        op, ps = self.operation, self.page_size
        return max(op.completed_tokens, min(self.tokens // ps, len(op.hash_value)) * ps)


class LifecycleController(SimController):
    """The controller's side of the prefetch path (see the module docstring)."""

    def __init__(self, clock, record: Record, host_pages: int, capacity: int, mode: str,
                 page_size: int = 1, sidecar: Any = None):  # fmt: skip
        super().__init__()
        self.clock = clock
        self.record = record
        self.page_size = page_size
        self.sidecar = sidecar  # a sidecar pool's name: its release queue
        self.pool = HostPool(host_pages, page_size)
        self.mem_pool_host = cast(Any, self.pool)
        self.prefetch_capacity_limit = capacity
        self.prefetch_tokens_occupied = 0
        self.host_memory_mode = mode
        self.host_write_staged_tokens_fn = None
        self.pp_prefetch_decisions: dict = {}
        self.pp_prefetch_command_group = None
        self.storage_backend = self
        self.scripts: dict = {}  # rid -> [Script per submission] for this rank
        self.submitted: dict = {}  # rid -> submissions so far
        self.l3_queries = 0  # hit queries sent to the store (prefetches, decode probes)
        self.reads = 0  # reads started
        self.keys_read = 0  # the pages (L3 keys) those reads asked for
        self.probing: Any = None  # the rid a decode prealloc's probe is for (its handle is a dummy)
        # work started where stock's own rule says no, on this state (must stay 0)
        self.bypassed: dict[str, int] = {}
        self.delay = 0  # this rank's storage reports this many passes late
        self.due: list = []  # (wall pass, order, callable)
        self.scheduled = 0
        self.prefetch_buffer = self  # put(op): the read starts

    def attach_storage(self) -> None:
        from hicache_async_ack.names import STORAGE_QUEUES

        for name in STORAGE_QUEUES:
            setattr(self, name, LifecycleQueue(name, self.pops))
        self.extra_host_mem_release_queues = (
            {} if self.sidecar is None else {self.sidecar: LifecycleQueue(self.sidecar, self.pops)}
        )
        self.enable_storage = True

    def reset(self) -> None:
        """``flush_cache``: queues cleared, occupancy 0, the storage threads'
        work in flight dropped (upstream stops and restarts them)."""
        super().reset()
        self.prefetch_tokens_occupied = 0
        self.due = []

    def detach_storage(self) -> None:
        """``detach_storage_backend``: the storage threads stop (what they had in
        flight is never reported)."""
        super().detach_storage()
        self.due = []

    def get_stats(self):
        return None

    def get_prefetch_submission(self, rid):
        return None

    def prefetch_rate_limited(self) -> bool:
        if self.host_memory_mode == "buffer_only":
            pool = self.pool
            return pool.size - pool.available_size() >= self.prefetch_capacity_limit
        return self.prefetch_tokens_occupied >= self.prefetch_capacity_limit

    def submit_prefetch(self, handle, prefetch_key, last_hash, prefix_keys, *args, **kwargs):
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            PrefetchOperation,
            PrefetchSubmission,
        )

        aux = args[1] if len(args) > 1 else kwargs.get("pool_transfers")
        op = PrefetchOperation(handle, prefetch_key, last_hash, prefix_keys=prefix_keys,
                               pool_transfers=aux)  # fmt: skip
        op.requested = len(prefetch_key)
        op.ack_releases_incomplete_host_indices = False  # until its read starts
        if self.host_memory_mode == "cache" and self.prefetch_rate_limited():
            self.bypass("a prefetch started past the limiter")
        script = self.next_script(handle.rid)
        self.l3_queries += 1
        self.record.add(handle_key(handle), "query")
        if script is not None:
            self._schedule(op, script)
        return PrefetchSubmission(operation=op)

    def next_script(self, rid, peek: bool = False) -> Optional[Script]:
        scripts = self.scripts.get(rid) or []
        n = self.submitted.get(rid, 0)
        if not peek:
            self.submitted[rid] = n + 1
        return scripts[min(n, len(scripts) - 1)] if scripts else None

    def _storage_hit_query(self, operation):
        """A PD decode prealloc's synchronous probe: the hit of the request's
        next submission, as the store answers it now."""
        script = self.next_script(self.probing, peek=True)
        hit = 0 if script is None or script.hit_at is None else script.hit_tokens
        hit = 0 if script is not None and script.error == "query" else hit
        if self.prefetch_rate_limited():
            self.bypass("an L3 probe past the limiter")
        self.l3_queries += 1
        return [f"{operation.handle.rid}:{i}" for i in range(hit)], hit

    def _schedule(self, op, s: Script) -> None:
        op.script = s
        now = self.clock.now
        if s.hit_at is not None:
            self._due(now + s.hit_at, lambda: self._answer(op, s))
        if self.host_memory_mode != "buffer_only":
            self._reads(op, s, now)

    def _reads(self, op, s: Script, start: int) -> None:
        """The read's acks, ``start`` plus their offsets on this rank's clock. In
        buffer_only mode a hit may be parked for host capacity, so its read is
        timed from its start (put), an agreed point: every rank then reports
        them in the same order, this rank's delay apart."""
        for at, tokens in s.progress:
            self._due(start + at, lambda t=tokens: self._ack(op, t, False))
        if s.finish_at is not None:
            self._due(start + s.finish_at, lambda: self._ack(op, None, True))

    def _due(self, at: int, put) -> None:
        self.scheduled += 1  # ties go in scheduling order (the same on every rank)
        self.due.append((at, self.scheduled, put))

    def deliver(self) -> None:
        """Put on the queues what this rank's storage reports by now."""
        ready = sorted((d for d in self.due if d[0] <= self.clock.now), key=lambda d: d[:2])
        self.due = [d for d in self.due if d[0] > self.clock.now]
        for _, _, put in ready:
            put()

    def _answer(self, op, s: Script) -> None:
        """The store's answer for this query: what it holds of the prompt past the
        query's start (``storage_start``: the matched prefix), in whole pages."""
        ps = self.page_size
        start = getattr(op, "storage_start", 0) or 0
        hit = 0 if s.error == "query" else max(0, min(s.hit_tokens - start, op.requested))
        hit -= hit % ps
        op.hash_value = [f"{op.handle.rid}:{start + i}" for i in range(0, hit, ps)]
        op.storage_hit_count = hit
        op.uid = self.next_uid()
        cast(Any, self.prefetch_hit_queue).put(op)

    def _ack(self, op, tokens: Optional[int], completed_req: bool) -> None:
        ack = SimAck(self.next_uid(), op, tokens, completed_req, self.page_size)
        cast(Any, self.ack_prefetch_queue).put(ack)

    def bypass(self, what: str) -> None:
        self.bypassed[what] = self.bypassed.get(what, 0) + 1

    def put(self, op) -> None:  # prefetch_buffer.put: the read starts
        op.ack_releases_incomplete_host_indices = True
        self.reads += 1
        self.keys_read += len(op.hash_value)
        if op.is_terminated():
            self.bypass("a read of an ended prefetch")
        s = getattr(op, "script", None)
        if self.host_memory_mode == "buffer_only" and s is not None:
            hit_at = s.hit_at or 0  # the offsets count from the hit answer here
            start = self.clock.now + self.delay - hit_at
            self._reads(op, s, start)
        self.record.add(handle_key(op.handle), "read", len(op.hash_value))

    def terminate_prefetch(self, operation):
        operation.mark_terminate()
        return operation.completed_tokens, operation.hash_value

    def alloc_prefetch_host_buffers(self, operation, need_size: int):
        return self.pool.alloc(need_size)

    def allocate_storage_hit(self, operation, hit_tokens, *, allow_partial, min_tokens, evict_host):
        if operation.is_terminated():
            self.bypass("a host allocation for an ended prefetch")
        pool = self.pool
        host = pool.alloc(hit_tokens)
        if host is None:
            evict_host(hit_tokens)
            host = pool.alloc(hit_tokens)
        alloc_len = hit_tokens
        if host is None and allow_partial:
            alloc_len = min(hit_tokens, pool.available_size())
            alloc_len -= alloc_len % self.page_size
            if alloc_len >= min_tokens:
                host = pool.alloc(alloc_len)
        key = handle_key(operation.handle)
        self.record.add(key, "alloc", hit_tokens, alloc_len if host is not None else None)
        return host, alloc_len

    def append_host_mem_release(self, host_indices=None, extra_pools=None) -> None:
        # a KV-derived sidecar's indices are the KV's: upstream queues none of its own
        if host_indices is None or host_indices.numel() == 0:
            return
        for page in host_indices.split(self.page_size):
            cast(Any, self.host_mem_release_queue).put(page)


class LifecycleQueue(RecordingQueue):
    """A storage queue of the prefetch lifecycle: over-draining it is a violation the
    scenario reports."""

    drained = SimViolation
