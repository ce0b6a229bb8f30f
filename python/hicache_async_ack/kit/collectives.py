"""The collectives the syncs run, torch's by default (an environment may hand in others);
torch is imported only inside the functions that need it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..names import ACK_QUEUES, EXTRA_POOL_QUEUES, STORAGE_QUEUES
from ..protocol.stamp import DEPTH_LIMIT, Handle

AsyncMin = Callable[[list[int]], Handle]  # values -> a handle on the reduce in flight
BlockingMin = Callable[[list[int]], list[int]]


class TorchHandle:
    __slots__ = ("work", "tensor")

    def __init__(self, work: Any, tensor: Any) -> None:
        self.work = work
        self.tensor = tensor

    def wait(self) -> list[int]:
        self.work.wait()
        return [int(v) for v in self.tensor.tolist()]

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def torch_min_all_reduce(group: Any) -> AsyncMin:
    """An async MIN all_reduce over ``group`` through the public ``dist.all_reduce`` (what
    wraps it sees ours too); DEPTH_LIMIT + 1 tensors per layout reused round-robin, so
    none is refilled while a reduce on it can be in flight."""
    import torch
    import torch.distributed as dist

    op = dist.ReduceOp.MIN
    rings: dict[int, Any] = {}  # layout length -> cycle of (tensor, numpy view)

    def issue(values: list[int]) -> Handle:
        ring = rings.get(len(values))
        if ring is None:
            tensors = [torch.zeros(len(values), dtype=torch.int64) for _ in range(DEPTH_LIMIT + 1)]
            ring = rings[len(values)] = itertools.cycle([(t, t.numpy()) for t in tensors])
        tensor, view = next(ring)
        view[:] = values
        return TorchHandle(dist.all_reduce(tensor, op=op, group=group, async_op=True), tensor)

    return issue


def torch_int32_min(group: Any, values: list[int]) -> list[int]:
    """A blocking int32 MIN all_reduce over one group (the decode offload's layout)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def upstream_count_slots(cache: Any) -> int:
    """How many counts precede ``[digest, -digest]`` in upstream's ack-count reduce."""
    if not cache.enable_storage:
        return len(ACK_QUEUES)
    cc = cache.cache_controller
    return len(ACK_QUEUES) + len(STORAGE_QUEUES) + len(getattr(cc, EXTRA_POOL_QUEUES, None) or {})


ALL_REDUCE = "_all_reduce"  # the cache's own reduce over upstream's groups


def upstream_reduce(cache: Any) -> BlockingMin:
    """A blocking MIN-reduce through the cache's own ``_all_reduce`` (upstream's groups)."""
    import torch

    def reduce(values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        cache._all_reduce(tensor, torch.distributed.ReduceOp.MIN)
        return [int(v) for v in tensor.tolist()]

    return reduce


def ride_ready_counts(
    cache: Any, original: Callable[..., Any], values: Sequence[int]
) -> tuple[Any, Optional[list[int]]]:
    """Run ``original`` (``_sync_hicache_ready_counts``) with ``_all_reduce`` shadowed on
    the instance so its first 1-D int64 reduce carries ``values`` too; returns its
    result and the reduced ``values`` (None: it ran no such reduce)."""
    import torch

    inst = cache.__dict__
    shadowed = ALL_REDUCE in inst
    before = inst.get(ALL_REDUCE)
    base = getattr(cache, ALL_REDUCE)  # whatever upstream would call (a test's wrapper too)
    reduced: list[list[int]] = []

    def all_reduce(tensor: Any, op: Any, *a: Any, **kw: Any) -> Any:
        if reduced or tensor.dim() != 1 or tensor.dtype != torch.int64:
            return base(tensor, op, *a, **kw)
        n = tensor.numel()
        fused = torch.cat([tensor, torch.tensor(list(values), dtype=torch.int64)])
        out = base(fused, op, *a, **kw)
        tensor.copy_(fused[:n])
        reduced.append([int(v) for v in fused[n:].tolist()])
        return out

    inst[ALL_REDUCE] = all_reduce
    try:
        result = original(cache)
    finally:
        if shadowed:
            inst[ALL_REDUCE] = before
        else:
            inst.pop(ALL_REDUCE, None)
    return result, reduced[0] if reduced else None


def torch_world_size(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_world_size(group=group))


def torch_rank(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(group=group))


def spanning_group(cache: Any, cp_group: Any, attn_tp_group: Any) -> Optional[Any]:
    """The existing group over which one MIN equals upstream's MIN over CP then attn TP,
    or None: the TP group G qualifies iff the union of CP(t) for t in TP(r) is G for
    every r in G. Gathers every member's ranks once over G (after the first exchange,
    so every rank runs it); every member reaches the same verdict. No group is created."""
    import torch.distributed as dist

    tp = cache.tp_group
    if tp is None or cache.tp_world_size <= 1:
        return None
    mine = (
        dist.get_rank(),
        sorted(dist.get_process_group_ranks(cp_group)),
        sorted(dist.get_process_group_ranks(attn_tp_group)),
    )
    gathered: list[Any] = [None] * cache.tp_world_size
    dist.all_gather_object(gathered, mine, group=tp)
    members = set(dist.get_process_group_ranks(tp))
    cp_of = {rank: set(cp) for rank, cp, _ in gathered}
    for _, _, tp_ranks in gathered:
        if not set(tp_ranks) <= cp_of.keys():
            return None
        if set().union(*(cp_of[t] for t in tp_ranks)) != members:
            return None
    return tp


@dataclass(frozen=True)
class Collectives:
    """The collectives the syncs run: ``async_min(group)``, ``blocking_min(cache)`` (first
    exchanges), ``int32_min`` (decode offload), ``world_size``, ``rank``, ``span``."""

    async_min: Callable[[Any], AsyncMin] = torch_min_all_reduce
    blocking_min: Callable[[Any], BlockingMin] = upstream_reduce
    int32_min: Callable[[Any, list[int]], list[int]] = torch_int32_min
    world_size: Callable[[Any], int] = torch_world_size
    rank: Callable[[Any], int] = torch_rank
    span: Callable[[Any, Any, Any], Optional[Any]] = spanning_group


__all__ = ["Collectives", "TorchHandle", "upstream_count_slots"]
