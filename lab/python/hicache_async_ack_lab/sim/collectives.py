"""One fake MIN all_reduce for in-process ranks (no torch, no SGLang needed).

``MinHub(world)`` joins ``world`` ranks living in one process:

* :meth:`MinHub.collective` is what the pipelined path issues: an async MIN
  reduce whose handle, on ``wait()``, reduces what every rank issued as its n-th
  reduce (a real process group pairs collectives by order too) and fails
  loudly if a rank never issued it or the layouts differ.
* :meth:`MinHub.blocking` stands in for upstream's blocking ``_all_reduce`` when
  the ranks run on threads.

For single-rank unit tests, ``peer(values)`` adds one programmable peer to every
reduce, ``events`` logs issues and waits in order, and ``fail_on_wait`` makes
the next ``wait()`` raise. ``latency_steps`` models a slow collective in steps
(the owner advances ``now`` and lets ``step_s`` pass per step): a reduce
completes ``latency_steps`` steps after it was issued, and a wait before that
stalls for the steps still missing.

:func:`delayed` wraps a real collective with a wall-clock latency instead
(the bench's model of a slow host, and the gloo tests of auto depth).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence


class FakeGroup:
    """A process-group stand-in: a size, a name, and (for the hub) a rank."""

    def __init__(self, size: int, name: str = "tp", hub: "Optional[MinHub]" = None, rank: int = 0):
        self.size = size
        self.name = name
        self.hub = hub
        self.rank = rank

    def __repr__(self) -> str:
        return f"FakeGroup({self.name}, {self.size})"


class HubHandle:
    def __init__(self, hub: "MinHub", rank: int, seq: int, values: Sequence[int]):
        self.hub = hub
        self.rank = rank
        self.seq = seq
        self.values = list(values)
        self.waited = False
        self.issued_at = hub.now

    def is_completed(self) -> bool:
        hub = self.hub
        issued = len(hub.slots[self.seq]) == hub.world
        return issued and hub.now - self.issued_at >= hub.latency_steps

    def wait(self) -> list[int]:
        hub = self.hub
        if not self.is_completed():  # the modelled latency, as a wait that shows
            steps_short = hub.latency_steps - (hub.now - self.issued_at)
            time.sleep(hub.step_s * max(1, steps_short))
        self.waited = True
        hub.events.append(("wait", self.seq))
        if hub.fail_on_wait is not None:
            raise hub.fail_on_wait
        slot = hub.slots[self.seq]
        missing = sorted(set(range(hub.world)) - set(slot))
        assert not missing, (
            f"rank {self.rank} waits on reduce #{self.seq}; {missing} never issued it"
        )
        rows = list(slot.values())
        if hub.peer is not None:
            rows.append(list(hub.peer(self.values)))
        lens = {len(v) for v in rows}
        assert len(lens) == 1, f"reduce #{self.seq}: layouts differ across ranks {lens}"
        return [min(col) for col in zip(*rows)]


class MinHub:
    def __init__(self, world: int = 1, peer: Optional[Callable[[list[int]], Sequence[int]]] = None):
        self.world = world
        self.peer = peer
        self.slots: dict[int, dict[int, list[int]]] = defaultdict(dict)
        self.seq = [0] * world
        self.issued: list[list[int]] = []  # every reduce issued, in order (all ranks)
        self.handles: list[HubHandle] = []
        self.events: list[tuple] = []
        self.fail_on_wait: Optional[BaseException] = None
        self.now = 0  # the step, as the owner counts it
        self.latency_steps = 0
        self.step_s = 0.001
        self._barrier = threading.Barrier(world, timeout=10)
        self._blocking_in: dict[int, list[int]] = {}

    def group(self, rank: int = 0, name: str = "tp") -> FakeGroup:
        return FakeGroup(self.world, name, self, rank)

    def collective(self, rank: int = 0) -> Callable[[list[int]], HubHandle]:
        def issue(values: list[int]) -> HubHandle:
            seq = self.seq[rank]
            self.seq[rank] += 1
            self.slots[seq][rank] = list(values)
            self.issued.append(list(values))
            self.events.append(("issue", list(values)))
            handle = HubHandle(self, rank, seq, values)
            self.handles.append(handle)
            return handle

        return issue

    def blocking(self, rank: int):
        """A blocking MIN all_reduce of a tensor in place, across threads."""

        def all_reduce(tensor, op=None):
            self._blocking_in[rank] = tensor.tolist()
            self._barrier.wait()
            rows = list(self._blocking_in.values())
            assert len({len(v) for v in rows}) == 1, "blocking reduce layouts differ"
            reduced = [min(col) for col in zip(*rows)]
            self._barrier.wait()
            tensor.copy_(tensor.new_tensor(reduced).reshape(tensor.shape))
            if rank == 0:
                self._blocking_in.clear()
            self._barrier.wait()

        return all_reduce


class DelayedHandle:
    """A collective handle that completes no earlier than ``ready_at``
    (perf_counter seconds); wait() sleeps until then, then returns the real result."""

    __slots__ = ("inner", "ready_at")

    def __init__(self, inner, ready_at: float):
        self.inner = inner
        self.ready_at = ready_at

    def wait(self):
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self.inner.wait()

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.ready_at and self.inner.is_completed()


def delayed(collective: Callable, latency_s: Callable[[], float]) -> Callable:
    """``collective`` whose reduces complete ``latency_s()`` (read at issue) late."""

    def issue(values):
        return DelayedHandle(collective(values), time.perf_counter() + latency_s())

    return issue


class EchoHandle:
    """A reduce every rank agreed on at once: what a step costs without the collective
    (valid only where every rank's values are equal, as on CPU without skew)."""

    __slots__ = ("values",)

    def __init__(self, values):
        self.values = list(values)

    def wait(self):
        return self.values

    def is_completed(self) -> bool:
        return True
