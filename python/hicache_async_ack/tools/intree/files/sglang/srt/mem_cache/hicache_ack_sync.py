"""Pipelined all_reduce of the HiCache ready counts for UnifiedRadixCache.

Every scheduler step, check_hicache_events MIN-reduces across the attention TP
ranks how many write / load acks (and, with a storage backend, storage control
entries) each rank has ready, then pops that many. _sync_hicache_ready_counts
does it with a blocking gloo all_reduce right before the next forward is
launched, so the collective's latency is paid on the critical path every step.

HiCacheAckSync issues the same all_reduce with async_op=True right after the
pops of step t and waits on it at step t + depth, when it has normally long
completed: every rank pops at step t + depth what the blocking path pops at t.

Why popping late is safe:
- Readiness is monotonic: a finished ack stays finished and a queued entry
  stays queued until popped, so what every rank had ready at step t is still
  ready, or already popped, at step t + depth.
- Entries leave these queues only from the head, and the other paths that pop
  them (reset, writing_check(write_back=True), a blocking loading_check, the
  storage drains) run on every rank at the same point of the schedule. So what
  they took between issue and wait is a prefix of the counted entries, the
  same on every rank. Each reduce keeps the first and the last entry it
  counted per queue; when it completes, the first one still at the head means
  nothing was taken, else the position of the last one gives how many of the
  agreed entries are still queued. Only those are popped.
- The reduce ends with [x, -x] where the blocking path sends [digest, -digest],
  with x = depth << 42 | digest. A rank on the blocking path, at another depth,
  or whose reclaim digest diverged makes min and max differ: every pipelining
  rank raises before popping anything, and a blocking rank fails its digest
  assert on the same reduce.

Only a single all_reduce per step can be pipelined this way. PP (PP0's counts
reach the other stages through PP sends), attention CP x attention TP (two
dependent reduces), buffer_only host memory and PD decode (load-back slots are
freed when acks are popped, so a late pop would hold them longer) keep the
blocking path.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from queue import Queue
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg

if TYPE_CHECKING:
    from sglang.srt.environ import EnvField
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

logger = logging.getLogger(__name__)

MAX_DEPTH = 8
# write_back_duplicate_reclaim_digest is masked to 42 bits; the depth sits above.
_DIGEST_BITS = 42
_STORAGE_QUEUES = (
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)


class _Counted(NamedTuple):
    """What one rank counted in one queue: how many, the first and the last."""

    n: int
    first: Any = None
    last: Any = None


class _Reduce(NamedTuple):
    work: torch.distributed.Work
    tensor: torch.Tensor
    counted: list[_Counted]  # per queue, in tensor order
    extra_pool_names: tuple


def _read_setting(field: EnvField, accepted: str):
    # EnvField.get() warns and falls back to the default on a value it cannot
    # parse; the nodes of a TP group must agree on these, so stop instead.
    if not field.is_set():
        return field.get()
    try:
        return field.parse(os.environ[field.name])
    except ValueError as e:
        raise ValueError(f"{field.name}: {e}; expected {accepted}") from None


def _pipelined_group(cache: UnifiedRadixCache):
    """(group, None) when the step can be pipelined, else (None, why not)."""
    if cache.cache_controller is None:
        return None, "no HiCache controller"
    if cache.pp_size > 1:
        return None, "pp_size > 1"
    if cache.host_memory_mode != "cache":
        return None, f"host memory mode {cache.host_memory_mode}"
    if get_disagg().disaggregation_mode == "decode":
        return None, "PD decode"
    # The group _all_reduce_attn_groups reduces over, if it reduces over one.
    groups = [
        group
        for group in (cache.attn_cp_group, cache.attn_tp_group)
        if group is not None and torch.distributed.get_world_size(group=group) > 1
    ]
    if len(groups) > 1:
        return None, "attention CP x attention TP takes two all_reduces"
    if not groups and cache.tp_world_size > 1:
        groups = [cache.tp_group]
    if not groups:
        return None, "a single rank has nothing to reduce"
    return groups[0], None


class HiCacheAckSync:
    """Up to `depth` ready-count all_reduces in flight for one cache."""

    def __init__(self, cache: UnifiedRadixCache, group, depth: int):
        self.cache = cache
        self.group = group
        self.depth = depth
        self.in_flight: deque[_Reduce] = deque()

    @classmethod
    def create(cls, cache: UnifiedRadixCache) -> Optional[HiCacheAckSync]:
        """Called at the end of init_hicache. Validates the settings; returns
        None, and logs why, where the step keeps the blocking all_reduce."""
        enabled = _read_setting(
            envs.SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC, "true/1/yes/y or false/0/no/n"
        )
        depth = _read_setting(
            envs.SGLANG_HICACHE_ASYNC_ACK_DEPTH, f"an integer from 1 to {MAX_DEPTH}"
        )
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(
                f"SGLANG_HICACHE_ASYNC_ACK_DEPTH={depth}: expected an integer "
                f"from 1 to {MAX_DEPTH}"
            )
        group, reason = _pipelined_group(cache)
        if not enabled:
            reason = "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=false"
        if reason is not None:
            logger.info(f"HiCache ready-count all_reduce: blocking ({reason})")
            return None
        logger.info(f"HiCache ready-count all_reduce: pipelined, depth {depth}")
        return cls(cache, group, depth)

    def _queues(self, extra_pool_names: tuple, storage: bool) -> list:
        cc = self.cache.cache_controller
        queues = [cc.ack_write_queue, cc.ack_load_queue]
        if storage:
            extra = getattr(cc, "extra_host_mem_release_queues", {})
            queues += [getattr(cc, name, None) for name in _STORAGE_QUEUES]
            queues += [extra.get(name) for name in extra_pool_names]
        return queues

    def issue(self) -> None:
        """Count what is ready after this step's pops and start reducing it."""
        cache = self.cache
        storage = cache.enable_storage
        extra = getattr(cache.cache_controller, "extra_host_mem_release_queues", {})
        extra_pool_names = tuple(extra) if storage else ()
        counted = []
        for q in self._queues(extra_pool_names, storage):
            if isinstance(q, list):
                counted.append(_ends(q, cache._count_ready_acks(q)))
            else:
                with q.mutex:  # filled by the storage threads
                    counted.append(_ends(q.queue, len(q.queue)))
        digest = cache.tree_core.write_back_duplicate_reclaim_digest
        x = (self.depth << _DIGEST_BITS) | (digest & ((1 << _DIGEST_BITS) - 1))
        tensor = torch.tensor(
            [*(c.n for c in counted), x, -x], dtype=torch.int64, device="cpu"
        )
        work = torch.distributed.all_reduce(
            tensor,
            op=torch.distributed.ReduceOp.MIN,
            group=self.group,
            async_op=True,
        )
        self.in_flight.append(_Reduce(work, tensor, counted, extra_pool_names))

    def agreed_counts(self) -> tuple[int, int, tuple[int, ...], tuple]:
        """The counts to pop this step, as _sync_hicache_ready_counts returns
        them: those agreed by the all_reduce issued `depth` steps ago."""
        if len(self.in_flight) < self.depth:  # the first steps
            return 0, 0, (), ()
        reduce = self.in_flight.popleft()
        reduce.work.wait()
        *agreed, lo, neg_hi = reduce.tensor.tolist()
        if lo != -neg_hi:
            self.in_flight.clear()
            raise RuntimeError(self._disagreement(lo, -neg_hi))
        queues = self._queues(reduce.extra_pool_names, len(agreed) > 2)
        pops = [
            _still_queued(q, c, n) for q, c, n in zip(queues, reduce.counted, agreed)
        ]
        return pops[0], pops[1], tuple(pops[2:]), reduce.extra_pool_names

    def _disagreement(self, lo: int, hi: int) -> str:
        lo_depth, hi_depth = lo >> _DIGEST_BITS, hi >> _DIGEST_BITS
        if lo_depth == 0:
            why = (
                "a rank ran the blocking all_reduce (its cache is not eligible, or "
                "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=false there)"
            )
        elif lo_depth != hi_depth:
            why = (
                f"SGLANG_HICACHE_ASYNC_ACK_DEPTH differs across ranks "
                f"({lo_depth} to {hi_depth}, {self.depth} here)"
            )
        else:
            why = "write_back duplicate-reclaim victims diverged across TP ranks"
        return (
            f"HiCache ready-count all_reduce: {why}. Nothing was popped; set the "
            "HiCache settings identically on every node of the TP group."
        )


def _ends(entries, n: int) -> _Counted:
    return _Counted(n, entries[0], entries[n - 1]) if n else _Counted(0)


def _still_queued(q, counted: _Counted, agreed: int) -> int:
    """How many of the first `agreed` counted entries are still at the head of
    q. Other paths pop from the head, so they took a prefix of the counted
    entries; where the last counted entry now sits says how long."""
    if agreed == 0 or q is None:
        return 0
    if isinstance(q, Queue):
        with q.mutex:
            return _still_queued(q.queue, counted, agreed)
    if q and q[0] is counted.first:
        return agreed
    for i, entry in enumerate(q):
        if i == counted.n:
            break
        if entry is counted.last:
            return max(0, agreed - (counted.n - 1 - i))
    return 0
