"""The collectives the features run, handed to each state when it is built:
an async MIN all_reduce (the pipelined reduces), upstream's own blocking reduce
through the cache (first exchanges) and the decode offload agreement's int32
MIN. Tests, the bench and cpu-server's latency model install theirs here.
torch is imported only inside the functions that need it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from ..names import ACK_QUEUES, EXTRA_POOL_QUEUES, STORAGE_QUEUES
from ..protocol.stamp import DEPTH_LIMIT


class TorchHandle:
    __slots__ = ("work", "tensor")

    def __init__(self, work, tensor):
        self.work = work
        self.tensor = tensor

    def wait(self) -> list[int]:
        self.work.wait()
        return self.tensor.tolist()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def torch_min_all_reduce(group) -> Callable[[list[int]], Any]:
    """An async MIN all_reduce over ``group``, through the public
    ``torch.distributed.all_reduce(..., async_op=True)`` as upstream's blocking
    one goes: whatever wraps or patches it (tracing, fault injection, tests)
    sees our collective too (calling the ProcessGroup directly saves ~0.04 ms a
    step, docs/bench.md: not worth a collective tracing cannot see). Tensors
    are preallocated and reused round-robin, DEPTH_LIMIT + 1 per layout, so one
    is never refilled while a reduce on it can be in flight."""
    import torch
    import torch.distributed as dist

    op = dist.ReduceOp.MIN
    rings: dict[int, Any] = {}  # layout length -> cycle of (tensor, numpy view)

    def issue(values: list[int]) -> TorchHandle:
        ring = rings.get(len(values))
        if ring is None:
            tensors = [torch.zeros(len(values), dtype=torch.int64) for _ in range(DEPTH_LIMIT + 1)]
            ring = rings[len(values)] = itertools.cycle([(t, t.numpy()) for t in tensors])
        tensor, view = next(ring)
        view[:] = values
        return TorchHandle(dist.all_reduce(tensor, op=op, group=group, async_op=True), tensor)

    return issue


def torch_int32_min(group, values: list[int]) -> list[int]:
    """A blocking MIN all_reduce of an int32 tensor over one group: the decode
    offload sync's upstream layout and dtype."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def upstream_count_slots(cache) -> int:
    """How many counts precede ``[digest, -digest]`` in upstream's ack-count
    reduce: the two ack queues, with storage the four control queues plus one
    per extra host pool (a first exchange must match its length)."""
    if not cache.enable_storage:
        return len(ACK_QUEUES)
    cc = cache.cache_controller
    return len(ACK_QUEUES) + len(STORAGE_QUEUES) + len(getattr(cc, EXTRA_POOL_QUEUES, None) or {})


def upstream_reduce(cache) -> Callable[[list[int]], list[int]]:
    """A blocking MIN-reduce through the cache's own ``_all_reduce``: upstream's
    shape on upstream's groups (attn CP then attn TP, as its ready-count sync)."""
    import torch

    def reduce(values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        cache._all_reduce(tensor, torch.distributed.ReduceOp.MIN)
        return [int(v) for v in tensor.tolist()]

    return reduce


@dataclass(frozen=True)
class Collectives:
    """The collectives the features run, handed to each state when it is built.

    ``async_min(group)``: values -> handle, an async MIN all_reduce (int64);
    ``blocking_min(cache)``: values -> reduced, upstream's own ``_all_reduce``
    on the cache (the first exchange); ``int32_min(group, values)``: a blocking
    int32 MIN (the decode offload agreement, in upstream's layout)."""

    async_min: Callable[[Any], Callable[[list[int]], Any]] = torch_min_all_reduce
    blocking_min: Callable[[Any], Callable[[list[int]], list[int]]] = upstream_reduce
    int32_min: Callable[[Any, list[int]], list[int]] = torch_int32_min


@dataclass
class Installed:
    current: Collectives = field(default_factory=Collectives)


INSTALLED = Installed()  # public: tests install theirs (monkeypatch) through it


def collectives() -> Collectives:
    """The collectives states built now are handed."""
    return INSTALLED.current


def use_collectives(new: Collectives) -> Collectives:
    """Install the collectives states built from now on are handed (tests, the
    bench, cpu-server's latency model); returns the previous ones."""
    old, INSTALLED.current = INSTALLED.current, new
    return old


def use_async_min(wrap: Callable[[Callable], Callable]) -> Collectives:
    """Install ``wrap(current async_min factory)`` as the async MIN factory
    (a latency model, another group); returns the previous collectives."""
    from dataclasses import replace

    current = collectives()
    return use_collectives(replace(current, async_min=wrap(current.async_min)))
