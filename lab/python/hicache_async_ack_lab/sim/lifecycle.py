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
  base controller allocates, ``terminate_prefetch``, ``append_host_mem_release``,
  the rate limit), a :class:`HostPool` that refuses a double free;
* the tree's side (:class:`LifecycleTree`): an inserted prefix is a node
  holding its host pages; ``cold`` nodes stand for other requests' cached
  prefixes, evicted oldest first; a request's own node is evictable only in
  ``exposed`` mode, while the request is not running (SGLang's load-back holds
  it from its admission until it finishes), never while a host lock holds it
  nor while a node inserted on top of it is there; requests that share a
  prefix insert it once (the second insert finds it: upstream frees its copy);
* the storage (:class:`Script`): per rank, a hit answer, read progress and the
  final ack, each delivered a number of passes after the prefetch was
  submitted, with the values every rank agrees on (upstream's query and sync
  threads MIN-reduce them before the scheduler sees them), capped by what the
  allocation kept when the scheduler reads them; one script per submission of a
  request (a storage retry submits again), and the synchronous hit query of a
  PD decode node's prealloc (``_storage_hit_query``) answered from the next
  one; every L3 query and every read started is counted;
* the deadline (:class:`PassTimer`): upstream's admission-poll timer counted in
  passes, per rank, from the first check that finds the prefetch unfinished.

Everything the lifecycle does is recorded in :class:`Record`, per request.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Optional, cast

from hicache_async_ack_lab.sim.cache import SimController, SimTreeCore

ROOT = 0


class SimViolation(AssertionError):
    """The lifecycle broke an invariant SGLang relies on (a double free, a
    release of pages never allocated)."""


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
    """Host pages 0..size-1 (page size 1); the lowest free pages go first."""

    def __init__(self, size: int):
        self.size = self.logical_size = size
        self.page_size = 1
        self.free_pages = set(range(size))

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, n: int):
        import torch

        if n <= 0 or n > len(self.free_pages):
            return None
        pages = sorted(self.free_pages)[:n]
        self.free_pages.difference_update(pages)
        return torch.tensor(pages, dtype=torch.int64)

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
class Node:
    id: int
    key: Any  # a request's (rid, attempt), or a cold node's name
    pages: Any  # host indices (a tensor)
    cold: bool = False
    admitted: bool = False
    locks: int = 0
    tokens: tuple = ()  # the token ids from the root to this node's end
    parent: int = ROOT


class LifecycleTree(SimTreeCore):
    """The tree's host side, as far as the prefetch lifecycle touches it."""

    def __init__(self, record: Record, exposed: bool = False):
        super().__init__()
        self.record = record
        self.exposed = exposed
        self.is_eagle = False
        self.nodes: dict[int, Node] = {}
        self.by_key: dict = {}
        self.owner: Any = None  # the request whose prefetch result is being inserted
        self._next = ROOT + 1

    def add_cold(self, name: str, pages) -> None:
        node = Node(self._next, name, pages, cold=True)
        self.nodes[node.id] = node
        self._next += 1

    def prefetch_anchor_info(self, node_id):
        return None, None

    def inc_host_lock_ref(self, node_id):
        from sglang.srt.mem_cache.base_prefix_cache import IncLockRefResult

        if node_id in self.nodes:
            self.nodes[node_id].locks += 1
        return IncLockRefResult(delta=0, node_id=node_id)

    def dec_host_lock_ref(self, node_id, params=None):
        from sglang.srt.mem_cache.base_prefix_cache import DecLockRefResult

        node = self.nodes.get(node_id)
        if node is not None:
            if node.locks <= 0:
                raise SimViolation(f"host lock of node {node_id} released more than taken")
            node.locks -= 1
        return DecLockRefResult(delta=0)

    def insert_host(self, node_id, key, host_value, hash_value):
        from sglang.srt.mem_cache.base_prefix_cache import InsertResult

        if len(key) == 0:
            return InsertResult(prefix_len=0, mamba_exist=True)
        tokens = tuple(int(t) for t in key.token_ids)
        # the deepest node already holding a prefix of these tokens (a shared prefix)
        parent = max(
            (n for n in self.nodes.values() if n.tokens and tokens[: len(n.tokens)] == n.tokens),
            key=lambda n: len(n.tokens),
            default=None,
        )
        prefix = 0 if parent is None else len(parent.tokens)
        owner = self.owner
        node = Node(self._next, owner, host_value[prefix:].clone(), tokens=tokens,
                    parent=ROOT if parent is None else parent.id)  # fmt: skip
        self._next += 1
        if prefix < len(tokens):
            self.nodes[node.id] = node
            self.by_key[owner] = node.id
        self.record.add(owner, "inserted", len(key), prefix)
        return InsertResult(prefix_len=prefix, total_len=len(key), inserted_host_node=node.id)

    def host_locks(self) -> int:
        """Host locks held on the tree's nodes (prefetch anchors, pins)."""
        return sum(n.locks for n in self.nodes.values())

    def commit_hicache_transfers(self, *args, **kwargs) -> None:
        pass

    def admit(self, key) -> None:
        node = self.nodes.get(self.by_key.get(key, -1))
        if node is not None:
            node.admitted = True

    def finished(self, key) -> None:
        """The request finished running: its node is the tree's again."""
        node = self.nodes.get(self.by_key.get(key, -1))
        if node is not None:
            node.admitted = False

    def evictable(self, node: Node) -> bool:
        if node.locks or node.admitted:
            return False
        if any(n.parent == node.id for n in self.nodes.values()):
            return False  # a leaf first
        return node.cold or self.exposed

    def evict(self, num_tokens: int, pool: HostPool) -> int:
        freed = 0
        while freed < num_tokens:
            node = next((n for n in sorted(self.nodes.values(), key=lambda n: n.id)
                         if self.evictable(n)), None)  # fmt: skip
            if node is None:
                break
            del self.nodes[node.id]
            pool.free(node.pages)
            freed += len(node.pages)
            self.record.add(node.key, "evicted", len(node.pages))
        return freed


@dataclass
class Script:
    """One request's storage, as this rank sees it: passes after submission."""

    hit_at: Optional[int]  # the hit answer (None: the query never returns)
    hit_tokens: int
    progress: list  # [(passes after submission, tokens read so far)], rising
    finish_at: Optional[int]  # the final ack (completed_req)


class SimAck:
    """A PrefetchAck as upstream's sync thread publishes it; the tokens are read
    when the scheduler drains it, capped by the pages the allocation kept."""

    def __init__(self, uid: int, operation, tokens: Optional[int], completed_req: bool):
        self.uid = uid
        self.operation = operation
        self.tokens = tokens
        self.completed_req = completed_req
        self.pool_hits = None

    @property
    def completed_tokens(self) -> Optional[int]:
        if self.tokens is None:
            return None
        op = self.operation
        return max(op.completed_tokens, min(self.tokens, len(op.hash_value)))


class LifecycleController(SimController):
    """The controller's side of the prefetch path (see the module docstring)."""

    def __init__(self, clock, record: Record, host_pages: int, capacity: int, mode: str):
        super().__init__()
        self.clock = clock
        self.record = record
        self.pool = HostPool(host_pages)
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
        self.extra_host_mem_release_queues = {}
        self.enable_storage = True

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

        op = PrefetchOperation(handle, prefetch_key, last_hash, prefix_keys=prefix_keys)
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
        hit = s.hit_tokens
        op.hash_value = [f"{op.handle.rid}:{i}" for i in range(hit)]
        op.storage_hit_count = hit
        op.uid = self.next_uid()
        cast(Any, self.prefetch_hit_queue).put(op)

    def _ack(self, op, tokens: Optional[int], completed_req: bool) -> None:
        cast(Any, self.ack_prefetch_queue).put(SimAck(self.next_uid(), op, tokens, completed_req))

    def bypass(self, what: str) -> None:
        self.bypassed[what] = self.bypassed.get(what, 0) + 1

    def put(self, op) -> None:  # prefetch_buffer.put: the read starts
        op.ack_releases_incomplete_host_indices = True
        self.reads += 1
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
            if alloc_len >= min_tokens:
                host = pool.alloc(alloc_len)
        key = handle_key(operation.handle)
        self.record.add(key, "alloc", hit_tokens, alloc_len if host is not None else None)
        return host, alloc_len

    def append_host_mem_release(self, host_indices=None, extra_pools=None) -> None:
        if host_indices is None or host_indices.numel() == 0:
            return
        for page in host_indices.split(1):
            cast(Any, self.host_mem_release_queue).put(page)


class LifecycleQueue(queue.Queue):
    """A storage queue whose get() records what leaves and refuses to block
    (upstream would wait for entries the group agreed on but this rank lacks:
    a bug to report)."""

    def __init__(self, name, log: list):
        super().__init__()
        self.name = name
        self.log = log

    def get(self, block=True, timeout=None):
        if self.empty():
            raise SimViolation(f"{self.name} was drained past its entries")
        item = super().get(block=False)
        uid = getattr(item, "uid", None)
        self.log.append((self.name, uid if uid is not None else int(item[0])))
        return item
