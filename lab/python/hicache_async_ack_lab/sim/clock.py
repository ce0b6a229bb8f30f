"""Model time for auto depth: what the depth rule sees comes from a latency
model, never from the wall clock, so a busy box cannot change it.

:class:`ModelClock` is the clock handed to the protocol's ``PipelinedReduce``:
the owner advances it by a step's forward, and a wait on a :func:`modelled`
reduce advances it to when the model says that reduce completes. The real
collective underneath still runs (over gloo in the multi-rank tests); it only
decides the values, not the time.
"""

from __future__ import annotations

from typing import Callable


class ModelClock:
    """Seconds of model time; callable, as a clock."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ModelledHandle:
    """A reduce that completes ``ready_at`` in model time."""

    __slots__ = ("inner", "ready_at", "clock")

    def __init__(self, inner, ready_at: float, clock: ModelClock):
        self.inner = inner
        self.ready_at = ready_at
        self.clock = clock

    def wait(self):
        if self.clock.now < self.ready_at:  # the modelled wait
            self.clock.now = self.ready_at
        return self.inner.wait()

    def is_completed(self) -> bool:
        return self.clock.now >= self.ready_at


def modelled(collective: Callable, latency_s: Callable[[], float], clock: ModelClock) -> Callable:
    """``collective`` whose reduces complete ``latency_s()`` (read at issue)
    after they were issued, in ``clock``'s time."""

    def issue(values):
        return ModelledHandle(collective(values), clock.now + latency_s(), clock)

    return issue
