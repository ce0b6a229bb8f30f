"""A real SGLang ``DecodeKVCacheOffloadManager`` around a simulated controller.

Test support. The manager is the real class (``object.__new__``, as
:mod:`.cache` builds the cache), so ``check_offload_progress``,
``_check_offload_progress``, ``_check_backup_progress`` and
``drain_before_retraction`` are upstream's code; the controller's queues are
:class:`~.cache.SimController`'s, and what a popped offload or backup lands
in (the storage backup it triggers, the host pages it frees) is recorded as
``("offload", uid)`` / ``("ack_backup_queue", uid)`` in the controller's pops.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from hicache_async_ack_lab.sim.cache import Entry, RecordingQueue, SimController, SimEvent


class SimReq:
    """What the manager reads of a request."""

    def __init__(self, rid: str):
        self.rid = rid

    def finished(self) -> bool:
        return False


class _HostPool:
    def free(self, indices) -> None:
        pass

    def get_pool(self, name):
        return self


@dataclass
class OffloadSim:
    manager: Any
    cc: Any  # a SimController whose ack_backup_queue is a RecordingQueue

    def add_offload(self, done: Callable[[], bool] = lambda: True, uid: int = 0) -> int:
        """A device-to-host copy queued by offload_kv_cache; returns its uid."""
        from sglang.srt.managers.cache_controller import HiCacheAck

        uid = uid or self.cc.next_uid()
        ev = SimEvent(done, self.cc, ("offload", uid))
        self.manager.ongoing_offload[uid] = (SimReq(f"q{uid}"), uid, [], 0.0, [])
        self.manager._mark_offload_started(self.manager.ongoing_offload[uid][0])
        self.cc.ack_write_queue.append(HiCacheAck(start_event=ev, finish_event=ev, node_ids=[uid]))
        return uid

    def add_backup(self, uid: int = 0) -> int:
        """A storage backup acked by the storage thread; returns its uid."""
        uid = uid or self.cc.next_uid()
        self.manager.ongoing_backup[uid] = (f"q{uid}", [uid], 0.0, [])  # host pages
        self.cc.ack_backup_queue.put(Entry(uid=uid, id=uid))
        return uid

    def take_pops(self) -> list:
        out = list(self.cc.pops)
        self.cc.pops.clear()
        return out


def build_manager(tp_group=None, tp_world_size: int = 1) -> OffloadSim:
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager,
    )

    cc: Any = SimController()
    cc.ack_backup_queue = RecordingQueue("ack_backup_queue", cc.pops)
    m = object.__new__(DecodeKVCacheOffloadManager)
    m.__dict__.update(
        cache_controller=cc,
        tp_group=tp_group,
        tp_world_size=tp_world_size,
        ongoing_offload={},
        ongoing_backup={},
        offloaded_state=weakref.WeakKeyDictionary(),
        offload_inflight=weakref.WeakKeyDictionary(),
        decode_host_mem_pool=_HostPool(),
    )

    def trigger_backup(req, host_indices, *rest):
        cc.pops.append(("offload", host_indices))  # host_indices carries the uid
        return None

    m.__dict__["_trigger_backup"] = trigger_backup
    return OffloadSim(m, cc)
