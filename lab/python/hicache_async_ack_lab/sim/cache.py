"""A real SGLang ``UnifiedRadixCache`` around a simulated cache controller.

Test support, used by the test suite and by ``hicache-async-ack-lab bench``. The cache object is
the real class (built with ``object.__new__``, as SGLang's own unit tests do),
so ``check_hicache_events``, ``writing_check``, ``loading_check`` and the storage
drain are upstream's code; only the controller (queues, CUDA events) and the
tree bookkeeping that pops land in are simulated, and every pop is recorded.

An ack's "finish_event" is done when a predicate says so (a step number for
deterministic tests, a wall-clock deadline for the benchmark). ``synchronize()``
on an unfinished event is a violation - upstream would block the scheduler in
``finish_event.synchronize()`` - except inside a write-back flush, which blocks
by design.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

from hicache_async_ack.names import STORAGE_QUEUES


class UnfinishedAckPopped(AssertionError):
    """An ack was popped (and synchronized) before its transfer finished."""


class OverDrained(AssertionError):
    """A storage queue was asked for more entries than it held (upstream blocks)."""


class SimEvent:
    __slots__ = ("done", "sim", "label", "forced")

    def __init__(self, done: Callable[[], bool], sim: "SimController", label):
        self.done = done
        self.sim = sim
        self.label = label
        self.forced = False

    def query(self) -> bool:
        return self.forced or self.done()

    def synchronize(self) -> None:
        if self.query():
            return
        if not self.sim.blocking_flush:
            self.sim.violations.append(f"popped unfinished ack {self.label}")
            raise UnfinishedAckPopped(f"ack {self.label} popped before it finished")
        self.forced = True  # a write-back flush waits for the copy, by design

    def elapsed_time(self, other) -> float:
        return 0.0


class RecordingQueue(queue.Queue):
    """queue.Queue whose get() records what leaves and refuses to block (upstream
    would wait for entries the group agreed on but this rank lacks: ``drained``)."""

    drained: type[AssertionError]  # set below: OverDrained (a subclass may name another)

    def __init__(self, name, log):
        super().__init__()
        self.name = name
        self.log = log

    def get(self, block=True, timeout=None):
        if self.empty():
            raise self.drained(f"{self.name} drained past its {self.qsize()} entries")
        item = super().get(block=False)
        uid = getattr(item, "uid", None)  # an entry's, or a release's tensor's first
        self.log.append((self.name, uid if uid is not None else int(item[0])))
        return item


RecordingQueue.drained = OverDrained


@dataclass(eq=False)
class Entry:
    """A storage control entry; carries the fields upstream's drain reads."""

    uid: int
    id: int = 0
    handle: object = None
    operation: object = None
    storage_hit_count: int = 0
    deadline_expired: bool = False
    completed_tokens: Optional[int] = None
    pool_hits: object = None
    completed_req: bool = False

    def is_terminated(self) -> bool:
        return False


class _HostPool:
    def __init__(self, sim):
        self.sim = sim

    def free(self, indices, pool=None):
        pass  # the release entries are recorded by RecordingQueue.get

    def clear(self):
        pass


class SimController:
    """Stands in for HiCacheController: ack lists, storage queues, host pool."""

    def __init__(self, extra_pools: tuple[str, ...] = ()):
        self.pops: list = []  # (queue, uid) in pop order, for this rank
        self.violations: list[str] = []
        self.blocking_flush = False
        self.ack_write_queue: list = []
        self.ack_load_queue: list = []
        self.pending_writes: list = []  # submitted by start_writing()
        self.mem_pool_host = _HostPool(self)
        self.layer_done_counter = None
        self.enable_storage = False
        self.extra_pools = extra_pools
        self.prefetch_hit_queue = None
        self.ack_prefetch_queue = None
        self.ack_backup_queue = None
        self.host_mem_release_queue = None
        self.extra_host_mem_release_queues: dict = {}
        self._uid = 0

    def next_uid(self) -> int:
        self._uid += 1
        return self._uid

    # -- storage lifecycle (attach builds fresh queues, as upstream does)
    def attach_storage(self) -> None:
        for name in STORAGE_QUEUES:
            setattr(self, name, RecordingQueue(name, self.pops))
        self.extra_host_mem_release_queues = {
            p: RecordingQueue(("extra", p), self.pops) for p in self.extra_pools
        }
        self.enable_storage = True

    def detach_storage(self) -> None:
        self.enable_storage = False

    def put_storage(self, name, uid: Optional[int] = None) -> int:
        """Put one entry on a storage queue; returns the uid its pop records."""
        uid = self.next_uid() if uid is None else uid
        if isinstance(name, tuple) or name == "host_mem_release_queue":
            import torch

            item = torch.tensor([uid])  # release queues carry host indices
        else:
            item = Entry(uid=uid, id=uid, handle=("sim", uid))
            item.operation = item
        self.storage_queue(name).put(item)
        return uid

    def storage_queue(self, name) -> RecordingQueue:
        if isinstance(name, tuple):  # ("extra", pool_name)
            return self.extra_host_mem_release_queues[name[1]]
        return getattr(self, name)

    # -- what upstream's controller does
    def start_writing(self) -> None:
        self.ack_write_queue.extend(self.pending_writes)
        self.pending_writes.clear()

    def reset(self) -> None:
        self.pending_writes.clear()
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        if self.enable_storage:
            for name in STORAGE_QUEUES:
                getattr(self, name).queue.clear()
            for q in self.extra_host_mem_release_queues.values():
                q.queue.clear()


class SimTreeCore:
    def __init__(self):
        self.write_back_duplicate_reclaim_digest = 0
        self.enable_storage = False  # UnifiedRadixCache.enable_storage reads this
        self.page_size = 1
        self.kv_events = self

    def finish_load_back(self, node):
        pass

    def reset(self):
        pass

    def record_all_cleared(self):
        pass


@dataclass
class SimCache:
    """The real cache plus the handles the tests and the bench drive it with."""

    cache: Any  # a real UnifiedRadixCache
    cc: SimController
    tree: SimTreeCore
    acks: dict = field(default_factory=dict)  # uid -> SimEvent

    def add_ack(self, kind: str, done: Callable[[], bool], pending: bool = False):
        """Enqueue a write ("write") or load ("load") ack finishing when done()."""
        from sglang.srt.managers.cache_controller import HiCacheAck

        uid = self.cc.next_uid()
        ev = SimEvent(done, self.cc, (kind, uid))
        ack = HiCacheAck(start_event=ev, finish_event=ev, node_ids=[uid])
        if kind == "write":
            self.cache.ongoing_write_through[uid] = None
            # SGLang 0.5.20 compatibility: before flush_pending_backups() existed,
            # check_hicache_events submitted nothing, so there are no held writes.
            pending = pending and hasattr(type(self.cache), "flush_pending_backups")
            (self.cc.pending_writes if pending else self.cc.ack_write_queue).append(ack)
        else:
            self.cache.ongoing_load_back[uid] = (uid, None, None)
            self.cc.ack_load_queue.append(ack)
        return uid

    def attach_storage(self) -> None:
        """attach_storage_backend: fresh storage queues, storage on."""
        self.cc.attach_storage()
        self.cache.enable_storage = True

    def detach_storage(self) -> None:
        """detach_storage_backend: local best-effort drain, then storage off."""
        self.cache.drain_storage_control_queues_local()
        self.cc.detach_storage()
        self.cache.enable_storage = False

    def reset(self) -> None:
        """UnifiedRadixCache.reset() (flush_cache), upstream's own code."""
        self.cache.reset()

    def write_back_flush(self) -> None:
        """writing_check(write_back=True): the eviction / write-back drain."""
        self.cc.blocking_flush = True
        try:
            self.cache.writing_check(write_back=True)
        finally:
            self.cc.blocking_flush = False

    def take_pops(self) -> list:
        out = list(self.cc.pops)
        self.cc.pops.clear()
        return out


def build_cache(
    *,
    tp_group=None,
    tp_world_size: int = 1,
    attn_cp_group=None,
    attn_tp_group=None,
    pp_size: int = 1,
    storage: bool = False,
    extra_pools: tuple[str, ...] = (),
    host_memory_mode: str = "cache",
    prefetch_stop_policy: str = "timeout",
    metrics_labels: Optional[dict] = None,
    cc: Optional[SimController] = None,
    tree: Optional[SimTreeCore] = None,
) -> SimCache:
    """A real UnifiedRadixCache wired to a SimController. ``metrics_labels``
    stand for --enable-metrics: the cache gets a metrics collector carrying them
    (SGLang's RadixCacheMetricsCollector registers its families once per process,
    and the plugin reads only its labels; simulated acks carry no sizes or
    timings, so upstream never records into it). ``cc`` and ``tree`` replace the
    simulated controller and tree (the prefetch lifecycle's, :mod:`.lifecycle`).
    ``prefetch_stop_policy``: SGLang's default; with storage the prefetch votes judge the
    walk under it (where this SGLang runs them), as the ack sync pipelines storage then."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    cc = SimController(extra_pools) if cc is None else cc
    tree = SimTreeCore() if tree is None else tree
    cache = object.__new__(UnifiedRadixCache)
    d = cache.__dict__
    d.update(
        cache_controller=cc,
        tree_core=tree,
        linker=None,
        work_list=[],
        tp_group=tp_group,
        tp_world_size=tp_world_size,
        attn_cp_group=attn_cp_group,
        attn_tp_group=attn_tp_group,
        pp_group=None,
        pp_rank=0,
        pp_size=pp_size,
        host_memory_mode=host_memory_mode,
        prefetch_stop_policy=prefetch_stop_policy,
        buffer_pipeline=None,
        enable_storage_metrics=False,
        storage_metrics_collector=None,
        metrics_collector=None
        if metrics_labels is None
        else SimpleNamespace(labels=metrics_labels),
        ongoing_write_through={},
        ongoing_load_back={},
        ongoing_backup={},
        ongoing_prefetch={},
        session_refs=tree,  # reset() only calls .reset() on it
        session=SimpleNamespace(slots={}),
        host_pool_group=None,
        _storage_attachment=None,
    )
    sim = SimCache(cache, cc, tree)

    def finish_write(ack_id):
        cache.ongoing_write_through.pop(ack_id)
        cc.pops.append(("write", ack_id))

    def dec_lock_ref(node, params=None):
        cc.pops.append(("load", node))

    # Tree bookkeeping that the pops land in; recorded instead of applied.
    d["_finish_write_through_ack"] = finish_write
    d["dec_lock_ref"] = dec_lock_ref
    d["dec_host_lock_ref"] = lambda node, params=None: None
    d["_account_prefetch_outcome"] = lambda op, revoked: None
    if storage:
        sim.attach_storage()
    return sim


def deadline(seconds_from_now: float) -> Callable[[], bool]:
    t = time.monotonic() + seconds_from_now
    return lambda: time.monotonic() >= t
