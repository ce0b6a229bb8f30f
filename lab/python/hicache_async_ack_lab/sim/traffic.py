"""The one HiCache traffic model, for the tests and the bench.

Two random generators per rank: ``sched`` is seeded with the scenario seed (the
same on every rank) and decides what is enqueued at each step, as the scheduler
would, symmetrically; ``mine`` is seeded per rank and decides when each transfer
finishes (and when a storage entry becomes visible) on this rank. Time is a
:class:`StepClock` (deterministic: the step number) or a :class:`WallClock`
(the bench: seconds, with copy times in milliseconds).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Hashable

from hicache_async_ack.names import STORAGE_QUEUES
from hicache_async_ack_lab.sim.cache import SimCache


class StepClock:
    """Time is the scheduler step; a transfer finishes 0..max_delay steps after
    it was enqueued (plus ``skew`` steps on every transfer of this rank)."""

    def __init__(self, max_delay: int, skew: int = 0):
        self.max_delay = max_delay
        self.skew = skew
        self.step = 0

    def now(self) -> float:
        return self.step

    def delay(self, rng: random.Random) -> float:
        return rng.randint(0, self.max_delay) + self.skew


class WallClock:
    """Time is ``perf_counter``; a copy takes ``copy_ms`` (uniform) on a side stream."""

    def __init__(self, copy_ms: tuple[float, float]):
        self.copy_ms = copy_ms
        self.step = 0

    def now(self) -> float:
        return time.perf_counter()

    def delay(self, rng: random.Random) -> float:
        return rng.uniform(*self.copy_ms) / 1000.0


@dataclass(frozen=True)
class TrafficSpec:
    max_writes: int = 3  # write-through backups per step: uniform 0..max_writes
    pending_p: float = 0.3  # of those, held until flush_pending_backups (start_writing)
    max_loads: int = 2  # load-backs per step: uniform 0..max_loads
    storage_p: float = 0.4  # per storage queue and step: one control entry
    storage_lag: int = 2  # it shows up on this rank 0..storage_lag steps later


class Traffic:
    """Enqueues one step's acks and storage entries on one rank's SimCache."""

    def __init__(self, sim: SimCache, spec: TrafficSpec, seed: int, rank: int, clock):
        self.sim = sim
        self.spec = spec
        self.clock = clock
        self.sched = random.Random(seed)
        self.mine = random.Random(seed * 7919 + rank)
        self.extra_pools = tuple(sim.cc.extra_pools)
        self.enqueued = 0
        self._future_puts: list[tuple[int, Hashable, int]] = []  # (visible at, queue, uid)
        self._last_visible: dict[Hashable, int] = {}

    def storage_names(self) -> list[Hashable]:
        return list(STORAGE_QUEUES) + [("extra", p) for p in self.extra_pools]

    def finish_predicate(self) -> Callable[[], bool]:
        due = self.clock.now() + self.clock.delay(self.mine)
        now = self.clock.now
        return lambda: now() >= due

    def enqueue(self, step: int, new_work: bool = True) -> list[tuple[int, Callable[[], bool]]]:
        """This step's traffic; returns the acks added as (uid, finished?)."""
        self.clock.step = step
        sim, sched, spec = self.sim, self.sched, self.spec
        added = []
        if new_work:
            for _ in range(sched.randint(0, spec.max_writes)):
                done = self.finish_predicate()
                pending = sched.random() < spec.pending_p
                added.append((sim.add_ack("write", done, pending=pending), done))
            for _ in range(sched.randint(0, spec.max_loads)):
                done = self.finish_predicate()
                added.append((sim.add_ack("load", done), done))
            if sim.cc.enable_storage:
                for name in self.storage_names():
                    if sched.random() < spec.storage_p:
                        # FIFO order kept per queue across ranks
                        lag = self.mine.randint(0, spec.storage_lag)
                        t = max(self._last_visible.get(name, 0), step + lag)
                        self._last_visible[name] = t
                        self._future_puts.append((t, name, sim.cc.next_uid()))
            self.enqueued += len(added)
        for put in [p for p in self._future_puts if p[0] <= step]:
            self._future_puts.remove(put)
            sim.cc.put_storage(put[1], uid=put[2])
        return added

    def forget_storage(self) -> None:
        """The storage queues were cleared or replaced (reset, detach, attach)."""
        self._future_puts.clear()
        self._last_visible.clear()
