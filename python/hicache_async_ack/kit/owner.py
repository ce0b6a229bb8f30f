"""The owner-sync template, written once: a sync that owns a pipelined MIN-reduce of an
object's queue counts (ack counts on a cache, decode offload on a manager) runs
every step as decide -> announce -> stand down (the one drain) -> first exchange once
-> consume -> pop -> run upstream -> count -> issue. An owner subclasses
:class:`OwnerState` over its SGLang object's view (``kit.views``) and provides the
abstract :meth:`~OwnerState.first_exchange`, :meth:`~OwnerState.ready` and
:meth:`~OwnerState.pop`, and optionally :meth:`~OwnerState.run`; a rider (the prefetch
votes, ``kit.feature.Rider``) adds a section to every reduce whose agreed layout has its
bit, seeing only a ``Carrier``. The protocol's errors become the owner's here, once.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, Callable, ClassVar, Generic, Hashable, Mapping, Optional, Sequence, TypeVar

from ..errors import HiCacheAsyncAckError
from ..names import EXTRA_POOL_QUEUES, ExtraPool
from ..protocol.errors import ProtocolError
from ..protocol.reduce import Consumed, PipelinedReduce
from .decision import Decision
from .environment import Environment
from .feature import FeatureState, Rider

Obj = TypeVar("Obj")  # the SGLang object the state lives on (a kit.views Protocol)
Pops = Mapping[Hashable, int]  # queue name (names.QueueName) -> entries to pop
Tails = list[tuple[Any, list[int]]]  # (riders' tokens, the reduced tail) per reduce


def queue_of(cc: object, name: Hashable) -> Any:
    """A controller queue by name (names.QueueName, an extra pool's too)."""
    if isinstance(name, ExtraPool):
        return getattr(cc, EXTRA_POOL_QUEUES, {}).get(name.pool)
    return getattr(cc, str(name), None)


def queue_head(q: Any, n: int) -> list[Any]:
    """The first ``n`` entries of a list or a ``queue.Queue`` (under its mutex)."""
    if q is None:
        return []
    if isinstance(q, list):
        return q[:n]
    with q.mutex:  # filled by storage threads
        return list(itertools.islice(q.queue, n))


class OwnerState(FeatureState, Generic[Obj], ABC):
    """A sync owning a pipelined reduce on an object: the step, its riders, its failure.
    ``exchange_while_blocking``: first exchange also while its setting keeps it blocking
    (decode offload); ``core_class``: the reduce it builds (a negative control's)."""

    exchange_while_blocking: ClassVar[bool] = False
    core_class: ClassVar[type[PipelinedReduce]] = PipelinedReduce

    def __init__(self, static: Decision, env: Environment) -> None:
        super().__init__(static, env)
        self.core: Optional[PipelinedReduce] = None  # built where static is pipelined
        self.riders: list[Rider] = []
        self.layout = 0  # the group's agreed layout flags (first exchange, each consume)

    @abstractmethod
    def first_exchange(self, obj: Obj) -> bool:
        """The one blocking agreement in upstream's shape; sets ``agreed``. False: the
        sync decided blocking meanwhile (on every rank)."""

    @abstractmethod
    def ready(self, obj: Obj) -> tuple[Mapping[Hashable, Sequence[object]], int]:
        """What is ready now at each queue's head (fresh lists) and the digest."""

    @abstractmethod
    def pop(self, obj: Obj, pops: Pops) -> None:
        """Pop one agreement's counts through upstream's own methods."""

    def controller(self, obj: Obj) -> object:
        return getattr(obj, "cache_controller", None)

    def run(self, obj: Obj, original: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any], due: Optional[Consumed]) -> Any:  # fmt: skip
        """Upstream's part of the step with the newest pops (by default the pops alone)."""
        if due is not None:
            self.pop(obj, due.pops)
        return None

    def local_flags(self, obj: Obj) -> int:
        flags = 0
        for rider in self.riders:
            flags |= rider.local_flags(obj)
        return flags

    def pipelines(self, obj: Obj) -> bool:
        return self.core is not None and self.decide(obj).pipelined

    def exchange(self, values: list[int]) -> list[int]:
        assert self.core is not None
        try:
            return [int(v) for v in self.core.collective(values).wait()]
        except Exception as exc:  # raised as the protocol's: the rider titles it
            raise ProtocolError(f"an exchange over the group failed: {exc!r}") from exc

    def add_rider(self, rider: Rider) -> None:
        """``rider``'s section rides every pipelined reduce whose layout has its bit."""
        self.riders.append(rider)
        if self.core is not None and self.core.flag_names is not None:
            self.core.flag_names.update(rider.flags)

    def head(self, obj: Obj) -> Callable[[Hashable, int], list[Any]]:
        def head(name: Hashable, n: int) -> list[Any]:
            cc = self.controller(obj)
            return [] if cc is None else queue_head(queue_of(cc, name), n)

        return head

    def step(self, obj: Obj, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One step of the object's upstream method ``original``."""
        decision = self.decide(obj)
        self.announce(decision)
        try:
            if not self.agreed and (decision.pipelined or (
                    self.exchange_while_blocking and self.static.pipelined)):  # fmt: skip
                if not self.first_exchange(obj):
                    decision = self.decide(obj)
                    self.announce(decision)
            if not decision.pipelined or self.core is None:
                self.stand_down(obj)
                return original(obj, *args, **kwargs)
            clock, timed = self.env.clock, self.metrics is not None
            due, waited = self.consume(obj, timed)
            result = self.run(obj, original, args, kwargs, due)
            t1 = clock() if timed else 0.0
            self.issue(obj)
        except ProtocolError as exc:
            raise self.fail(exc) from exc
        except HiCacheAsyncAckError as exc:
            if isinstance(exc, self.sync.errors.error):  # the owner's own (not a rider's)
                self.failed(exc)
            raise
        if self.metrics is not None:
            self.metrics.on_step(waited, clock() - t1, due.pops if due else {})
        return result

    def stand_down(self, obj: Obj) -> None:
        """The one drain: leaving the pipelined path, every rank consumes and pops what is
        in flight (sections, then pops); upstream's path handles the rest."""
        core = self.core
        if core is None or not core.pending:
            return
        drained = core.drain(self.head(obj))
        if drained is None:
            return
        self.adopt(drained, pipelined=False)
        for pops, tails in drained.parts:
            self.take_sections(obj, tails)
            self.pop(obj, pops)

    def consume(self, obj: Obj, timed: bool) -> tuple[Optional[Consumed], Optional[float]]:
        """Wait on the due reduce(s) (timed if ``timed``); sections before pops, the
        older ones' pops made here, the newest's left to :meth:`run`."""
        assert self.core is not None
        clock = self.env.clock
        t0 = clock() if timed else 0.0
        due = self.core.consume_due(self.head(obj))
        if due is None:
            return None, None
        waited = clock() - t0 if timed else None
        self.adopt(due, pipelined=True)
        for pops, tails in due.parts[:-1]:
            self.take_sections(obj, tails)
            self.pop(obj, pops)
        newest, tails = due.parts[-1]
        self.take_sections(obj, tails)
        return (replace(due, pops=newest) if len(due.parts) > 1 else due), waited

    def issue(self, obj: Obj) -> None:
        """Count what is ready now and issue the next reduce, with the riders' sections."""
        assert self.core is not None
        ready, digest = self.ready(obj)
        tail: list[int] = []
        tokens = []
        for rider in self.riders:
            on = bool(self.layout >> rider.layout_bit & 1)
            # a walk the rider held when the group dropped its bit still gets its verdicts:
            # its last section rides (``holds_walk`` is agreed state, as the layout is)
            if on or rider.holds_walk(obj):
                values, token = rider.section(obj, last=not on)
                tail += values
                tokens.append((rider, token, len(values)))
            else:
                rider.no_section(obj)
        self.core.issue(ready, digest, self.local_flags(obj), tail, tokens)

    def adopt(self, consumed: Consumed, pipelined: bool) -> None:
        """The newest agreed layout, and a depth the group moved (same step everywhere)."""
        if consumed.flags is not None:
            self.layout = consumed.flags
        if consumed.depth_change is not None:
            self.depth_changed(*consumed.depth_change, pipelined=pipelined)

    def depth_changed(self, before: int, after: int, pipelined: bool) -> None:
        """Auto depth moved (owners with auto depth say so)."""

    def take_sections(self, obj: Obj, tails: Tails) -> None:
        """Hand each rider its reduced sections of one reduce (before its pops); the
        protocol's error in a rider's section is that rider's, translated here."""
        for tokens, reduced in tails:
            at = 0
            for rider, token, width in tokens:
                try:
                    rider.take(obj, token, reduced[at : at + width], self)
                except ProtocolError as exc:
                    raise rider.fail(exc) from exc
                at += width


__all__ = ["OwnerState", "Pops", "queue_head", "queue_of"]
