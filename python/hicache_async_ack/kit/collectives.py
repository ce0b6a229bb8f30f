"""The collectives the syncs run, torch's by default (an environment may hand in others);
torch is imported only inside the functions that need it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, cast

from ..names import ACK_QUEUES, EXTRA_POOL_QUEUES, STORAGE_QUEUES
from ..protocol.stamp import DEPTH_LIMIT, Handle
from .torch_api import Buffer, Tensor, Work, dist, torch
from .views import Cache

AsyncMin = Callable[[list[int]], Handle]  # values -> a handle on the reduce in flight
BlockingMin = Callable[[list[int]], list[int]]


class TorchHandle:
    __slots__ = ("work", "tensor")

    def __init__(self, work: Work, tensor: Tensor) -> None:
        self.work = work
        self.tensor = tensor

    def wait(self) -> list[int]:
        self.work.wait()
        return [int(v) for v in self.tensor.tolist()]

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def torch_min_all_reduce(group: object) -> AsyncMin:
    """An async MIN all_reduce over ``group`` through the public ``dist.all_reduce`` (what
    wraps it sees ours too); DEPTH_LIMIT + 1 tensors per layout reused round-robin, so
    none is refilled while a reduce on it can be in flight."""
    t, d = torch(), dist()
    op = d.ReduceOp.MIN
    rings: dict[int, Iterator[tuple[Tensor, Buffer]]] = {}  # length -> (tensor, numpy view)

    def issue(values: list[int]) -> Handle:
        ring = rings.get(len(values))
        if ring is None:
            tensors = [t.zeros(len(values), dtype=t.int64) for _ in range(DEPTH_LIMIT + 1)]
            ring = rings[len(values)] = itertools.cycle([(x, x.numpy()) for x in tensors])
        tensor, view = next(ring)
        view[:] = values
        work = cast(Work, d.all_reduce(tensor, op=op, group=group, async_op=True))
        return TorchHandle(work, tensor)

    return issue


def torch_int32_min(group: object, values: list[int]) -> list[int]:
    """A blocking int32 MIN all_reduce over one group (the decode offload's layout)."""
    t, d = torch(), dist()
    tensor = t.tensor(values, dtype=t.int32)
    d.all_reduce(tensor, op=d.ReduceOp.MIN, group=group)
    return [int(v) for v in tensor.tolist()]


def upstream_count_slots(cache: Cache) -> int:
    """How many counts precede ``[digest, -digest]`` in upstream's ack-count reduce."""
    if not cache.enable_storage:
        return len(ACK_QUEUES)
    pools: dict[str, object] = getattr(cache.cache_controller, EXTRA_POOL_QUEUES, None) or {}
    return len(ACK_QUEUES) + len(STORAGE_QUEUES) + len(pools)


ALL_REDUCE = "_all_reduce"  # the cache's own reduce over upstream's groups
AllReduce = Callable[..., object]


def upstream_reduce(cache: Cache) -> BlockingMin:
    """A blocking MIN-reduce through the cache's own ``_all_reduce`` (upstream's groups)."""
    t, d = torch(), dist()

    def reduce(values: list[int]) -> list[int]:
        tensor = t.tensor(values, dtype=t.int64)
        cache._all_reduce(tensor, d.ReduceOp.MIN)
        return [int(v) for v in tensor.tolist()]

    return reduce


def ride_ready_counts(
    cache: Cache, original: Callable[[Cache], object], values: Sequence[int]
) -> tuple[object, Optional[list[int]]]:
    """Run ``original`` (``_sync_hicache_ready_counts``) with ``_all_reduce`` shadowed on
    the instance so its first 1-D int64 reduce carries ``values`` too; returns its
    result and the reduced ``values`` (None: it ran no such reduce)."""
    t = torch()
    inst: dict[str, object] = cache.__dict__
    shadowed = ALL_REDUCE in inst
    before = inst.get(ALL_REDUCE)
    base: AllReduce = getattr(cache, ALL_REDUCE)  # what upstream would call (a test's too)
    reduced: list[list[int]] = []

    def all_reduce(tensor: Tensor, op: object, *a: object, **kw: object) -> object:
        if reduced or tensor.dim() != 1 or tensor.dtype != t.int64:
            return base(tensor, op, *a, **kw)
        n = tensor.numel()
        fused = t.cat([tensor, t.tensor(list(values), dtype=t.int64)])
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


def torch_world_size(group: object) -> int:
    return int(dist().get_world_size(group=group))


def torch_rank(group: object) -> int:
    return int(dist().get_rank(group=group))


def spanning_group(cache: Cache, cp_group: object, attn_tp_group: object) -> Optional[object]:
    """The existing group over which one MIN equals upstream's MIN over CP then attn TP,
    or None: the TP group G qualifies iff the union of CP(t) for t in TP(r) is G for
    every r in G. Gathers every member's ranks once over G (after the first exchange,
    so every rank runs it); every member reaches the same verdict. No group is created."""
    d = dist()
    tp = cache.tp_group
    if tp is None or cache.tp_world_size <= 1:
        return None
    mine = (
        d.get_rank(),
        sorted(d.get_process_group_ranks(cp_group)),
        sorted(d.get_process_group_ranks(attn_tp_group)),
    )
    gathered: list[object] = [None] * cache.tp_world_size
    d.all_gather_object(gathered, mine, group=tp)
    members = set(d.get_process_group_ranks(tp))
    ranks = cast(list[tuple[int, list[int], list[int]]], gathered)
    cp_of = {rank: set(cp) for rank, cp, _ in ranks}
    for _, _, tp_ranks in ranks:
        if not set(tp_ranks) <= cp_of.keys():
            return None
        if set[int]().union(*(cp_of[r] for r in tp_ranks)) != members:
            return None
    return tp


@dataclass(frozen=True)
class Collectives:
    """The collectives the syncs run: ``async_min(group)``, ``blocking_min(cache)`` (first
    exchanges), ``int32_min`` (decode offload), ``world_size``, ``rank``, ``span``."""

    async_min: Callable[[object], AsyncMin] = torch_min_all_reduce
    blocking_min: Callable[[Cache], BlockingMin] = upstream_reduce
    int32_min: Callable[[object, list[int]], list[int]] = torch_int32_min
    world_size: Callable[[object], int] = torch_world_size
    rank: Callable[[object], int] = torch_rank
    span: Callable[[Cache, object, object], Optional[object]] = spanning_group


__all__ = ["Collectives", "TorchHandle", "ride_ready_counts", "upstream_count_slots"]
