"""Pipelined ready-count all_reduce for UnifiedRadixCache.check_hicache_events.

The all_reduce of the counts ready after step t's pops is issued with
async_op=True and waited on at step t + depth, so its latency overlaps the
forwards in between instead of delaying the next launch.
"""

from __future__ import annotations

import logging
from collections import deque
from queue import Queue
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

logger = logging.getLogger(__name__)

MAX_DEPTH = 8
# The reduce ends with [x, -x] where the blocking path sends [digest, -digest]
# (below 2**42): x = depth << 42 | digest lies in [2**42, 2**58). Values from
# 2**58 up are sent by an out-of-tree implementation of this reduce.
_DIGEST_BITS = 42
_FOREIGN_STAMP = 1 << 58


class _Counted(NamedTuple):
    """What this rank counted in one queue: how many, the first and the last."""

    n: int
    first: Any = None
    last: Any = None


class _Reduce(NamedTuple):
    work: torch.distributed.Work
    tensor: torch.Tensor
    counted: list[_Counted]  # per queue, in tensor order
    extra_pool_names: tuple


def _pipelined_group(cache: UnifiedRadixCache, disaggregation_mode: str):
    """(group, None) when the step can be pipelined, else (None, why not)."""
    if cache.cache_controller is None:
        return None, "no HiCache controller"
    if cache.pp_size > 1:
        return None, "pp_size > 1"
    if cache.host_memory_mode != "cache":
        return None, f"host memory mode {cache.host_memory_mode}"
    if disaggregation_mode == "decode":
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
    def create(
        cls, cache: UnifiedRadixCache, disaggregation_mode: str
    ) -> Optional[HiCacheAckSync]:
        """Called at the end of init_hicache. Returns None, and logs why, where
        the step keeps the blocking all_reduce."""
        depth = envs.SGLANG_HICACHE_ASYNC_ACK_DEPTH.get()
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(
                f"SGLANG_HICACHE_ASYNC_ACK_DEPTH={depth}: expected an integer "
                f"from 1 to {MAX_DEPTH}"
            )
        group, reason = _pipelined_group(cache, disaggregation_mode)
        if not envs.SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC.get():
            reason = "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=false"
        if reason is not None:
            logger.info(f"HiCache ready-count all_reduce: blocking ({reason})")
            return None
        logger.info(f"HiCache ready-count all_reduce: pipelined, depth {depth}")
        return cls(cache, group, depth)

    def issue(self) -> None:
        """Count what is ready after this step's pops and start reducing it."""
        cache = self.cache
        write, load, sizes, extra_pool_names = cache._local_hicache_ready_counts()
        counts = [write, load, *sizes]
        queues = cache._hicache_ready_queues()
        counted = [_ends(q, n) for q, n in zip(queues, counts)]
        digest = cache.tree_core.write_back_duplicate_reclaim_digest
        x = (self.depth << _DIGEST_BITS) | (digest & ((1 << _DIGEST_BITS) - 1))
        tensor = torch.tensor([*counts, x, -x], dtype=torch.int64, device="cpu")
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
        # Entries leave these queues only from the head, on every rank at the
        # same point of the schedule (the storage threads only append): what
        # was popped since the reduce was issued is a prefix of what it counted.
        queues = self.cache._hicache_ready_queues()
        pops = [
            _still_queued(q, c, n) for q, c, n in zip(queues, reduce.counted, agreed)
        ]
        return pops[0], pops[1], tuple(pops[2:]), reduce.extra_pool_names

    def _disagreement(self, lo: int, hi: int) -> str:
        lo_depth, hi_depth = lo >> _DIGEST_BITS, hi >> _DIGEST_BITS
        if hi >= _FOREIGN_STAMP:
            why = (
                "a peer runs the hicache-async-ack plugin, not this SGLang's "
                "pipelined all_reduce (uninstall it there or exclude it with "
                "SGLANG_PLUGINS, or run this SGLang build on that node too)"
            )
        elif lo_depth == 0:
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


def _ends(q, n: int) -> _Counted:
    if n == 0:
        return _Counted(0)
    if isinstance(q, Queue):
        with q.mutex:  # Queue has no peek; put() appends under this lock
            return _Counted(n, q.queue[0], q.queue[n - 1])
    return _Counted(n, q[0], q[n - 1])


def _still_queued(q, counted: _Counted, agreed: int) -> int:
    """How many of the first `agreed` counted entries are still at the head of
    q: where the last counted entry now sits says how many others took."""
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
