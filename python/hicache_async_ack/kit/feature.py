"""A sync as declared (:class:`Feature`: its names row, state class, the class it lives
on, what it rides, its hooks) and what every sync's state does alike
(:class:`FeatureState`: path decision, announcement, failure, metrics); the step itself
is :mod:`.owner`'s. One build for every sync (:meth:`Feature.build`), one
:func:`state_of`."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    ClassVar,
    Generic,
    Iterable,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
    cast,
)

from .. import path_info
from ..errors import HiCacheAsyncAckError, HiCacheAsyncAckMismatch
from ..guard import UNTESTED
from ..names import LOGGER_NAME, ReasonCode, Sync, SyncName
from ..protocol.errors import ProtocolError
from .decision import Decision, blocking
from .environment import Environment, environment, judged
from .hooks import Fn, Hook, HookKind, hook, unhooked
from .views import SyncMetrics

logger = logging.getLogger(LOGGER_NAME)
S = TypeVar("S", bound="FeatureState")


def feature_release(sync: SyncName) -> Optional[str]:
    """The tested release ``sync``'s methods behave like here; ``UNTESTED`` under the
    opt-in; None where the sync stays on upstream's path."""
    now = judged()
    if now.verdict is None:
        return None
    verdict = now.verdict.feature(sync)
    if verdict.release is None and now.untested_ok and verdict.status == "untested":
        return UNTESTED
    return verdict.release


class FeatureState:
    """What every sync keeps per object: its lifetime decision (``static``), environment,
    metrics (None costs nothing), ``agreed`` (first exchange ran), last announcement.
    A state class is built as ``cls(obj, blocker, env)`` (:meth:`Feature.build`):
    ``blocker``, where given, keeps it on upstream's path for the object's lifetime."""

    sync: ClassVar[Sync]

    def __init__(self, static: Decision, env: Environment) -> None:
        self.static = static
        self.env = env
        self.collectives = env.collectives
        self.metrics: Optional[SyncMetrics] = None
        self.agreed = False
        self.announced: Optional[tuple[bool, ReasonCode, str]] = None

    def dynamic_blocker(self, obj: Any) -> Optional[Decision]:
        """Per-step conditions (cheap reads, no collective) that force upstream's path."""
        return None

    def decide(self, obj: Any) -> Decision:
        """This step's path: a query, never a collective."""
        if not self.static.pipelined:
            return self.static
        return self.dynamic_blocker(obj) or self.static

    def announce(self, decision: Decision) -> None:
        """THE announcement of a sync's path (log line, metrics, path info) on each change;
        called every step, so it compares before it formats."""
        key = (decision.pipelined, decision.code, decision.reason)
        if key == self.announced:
            return
        self.announced = key
        if self.metrics is not None:
            self.path_metrics(decision)
            labels = getattr(self.metrics, "labels", None)
            if isinstance(labels, Mapping):  # the "why" series; never raises
                path = "pipelined" if decision.pipelined else "blocking"
                path_info.publish(self.sync.name, path, decision.code, labels)
        logger.info("%s", self.path_line(decision))

    def path_metrics(self, decision: Decision) -> None:
        if self.metrics is not None:
            self.metrics.on_path(decision.pipelined)

    def pipelined_details(self, decision: Decision) -> Sequence[str]:
        return (f"world size {decision.world_size}",)

    def blocking_details(self) -> Sequence[str]:
        return ()

    def path_line(self, decision: Decision) -> str:
        title = self.sync.title
        if decision.pipelined:
            details = "; ".join(self.pipelined_details(decision))
            return f"{title}: pipelined over the {decision.reason} ({details})"
        extra = "; ".join(self.blocking_details())
        line = f"{title}: blocking (upstream path) because {decision.reason}"
        return f"{line} ({extra})" if extra else line

    def failed(self, exc: HiCacheAsyncAckError) -> None:
        """A sync error on this rank: counted and logged (the scheduler may die first)."""
        if self.metrics is not None:
            reason = "mismatch" if isinstance(exc, HiCacheAsyncAckMismatch) else "failure"
            self.metrics.on_failure(reason)
        logger.error("%s", exc)

    def fail(self, exc: ProtocolError) -> HiCacheAsyncAckError:
        """The protocol's error, as this sync's (titled), counted and logged: the one
        translation; the caller raises it ``from exc``."""
        err = self.sync.errors.translate(self.sync.title, exc)
        self.failed(err)
        return err

    def cache_metrics(self, cache: object) -> Optional[SyncMetrics]:
        """This sync's metrics for a cache, labelled like its other metrics."""
        collector = getattr(cache, "metrics_collector", None)
        labels = getattr(collector, "labels", None) or {"cache_type": type(cache).__name__}
        return self.make_metrics(labels, collector)

    def make_metrics(self, labels: Mapping[str, object], collector: object = None
                     ) -> Optional[SyncMetrics]:  # fmt: skip
        """This sync's metrics for ``labels`` (the environment's factory, else SGLang's
        pipeline); None, logged, if they cannot be made: metrics never fail HiCache."""
        from ..metrics import series_for

        make = self.env.metrics or series_for
        try:
            return make(self.sync, labels, collector)
        except Exception as exc:  # noqa: BLE001 (e.g. a collector backend refusing the names)
            logger.warning("%s: metrics not exported for %s: %r", self.sync.title,
                           dict(labels), exc)  # fmt: skip
            return None


class Rider(Protocol):
    """A section another sync adds to an owner's pipelined reduce (``flags``: its bits;
    ``layout_bit``: the one that puts its section in). Per step: :meth:`take` for each
    section consumed (before the pops), then :meth:`section` or :meth:`no_section`."""

    flags: Mapping[int, str]
    layout_bit: int

    def local_flags(self, obj: Any) -> int: ...

    def decides_walk(self, obj: Any) -> bool:
        """Whether it, not upstream's per-request path, decides what the owner's lag
        would otherwise make stale."""
        ...

    def take(self, obj: Any, token: object, reduced: Sequence[int], carrier: Carrier) -> None: ...

    def holds_walk(self, obj: Any) -> bool:
        """Whether the interval now closing held a walk (its reaches await verdicts)."""
        ...

    def section(self, obj: Any, last: bool = False) -> tuple[list[int], object]:
        """Close the interval into the next reduce's section (``last``: the group dropped
        the rider's bit; the walk after it is not held)."""
        ...

    def no_section(self, obj: Any) -> None: ...

    def fail(self, exc: ProtocolError) -> HiCacheAsyncAckError:
        """The protocol's error in its section, as its own (counted, logged)."""
        ...


class Carrier(Protocol):
    """What a rider may use of its owner."""

    def pipelines(self, obj: Any) -> bool:
        """Whether this step's reduce is the owner's pipelined one (sections ride it)."""
        ...

    def exchange(self, values: list[int]) -> list[int]:
        """A blocking MIN over the owner's group, in every rank's collective sequence."""
        ...

    def add_rider(self, rider: Rider) -> None:
        """Carry ``rider``'s section in every pipelined reduce whose layout has its bit."""
        ...


# Every feature declared, by sync name (a rider finds its carrier here).
DECLARED: dict[SyncName, "Feature[Any]"] = {}


@dataclass
class Feature(Generic[S]):
    """A sync, declared once: its row, its state class, the dotted class its state lives
    on (``owner``), ``rides``: the sync whose reduce carries its section (a rider);
    ``after``: the syncs whose hooks it wraps (registered before its own)."""

    sync: Sync
    state: type[S]
    owner: str
    rides: Optional[SyncName] = None
    after: tuple[SyncName, ...] = ()
    hooks: list[Hook] = field(default_factory=list)

    def __post_init__(self) -> None:
        DECLARED[self.sync.name] = self

    def hook(self, target: str, method: str, kind: HookKind) -> Callable[[Fn], Fn]:
        """Declare the decorated function as this feature's ``kind`` hook on ``target.method``."""

        def declare(fn: Fn) -> Fn:
            self.hooks.append(Hook(target, method, kind, hook(fn, self.sync.name),
                                   self.sync.name))  # fmt: skip
            return fn

        return declare

    def hooked_on(self, target: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h.method for h in self.hooks if h.target == target))

    def hooks_missing(self, obj: object) -> Optional[str]:
        """Why this feature's hooks are not in place (on ``obj``'s class, overridden by a
        subclass, or on another class it hooks, e.g. the scheduler's), or None."""
        problem = unhooked(type(obj), self.hooked_on(self.owner), self.sync.name)
        for target in dict.fromkeys(h.target for h in self.hooks if h.target != self.owner):
            if problem is not None:
                break
            module, _, name = target.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name)
            except Exception as exc:  # noqa: BLE001 (no such module here: nothing runs it)
                return f"{target} cannot be imported ({exc!r})"
            problem = unhooked(cls, self.hooked_on(target), self.sync.name)
        return problem

    def build(self, obj: object) -> S:
        """``obj``'s state (its settings read now), blocking where its hooks are not in
        place; a rider joins its carrier."""
        problem = self.hooks_missing(obj)
        env = environment()
        cls = env.state_class(self.sync.name, self.state)
        make = cast(Callable[[object, Optional[Decision], Environment], S], cls)  # the class doc
        state = make(obj, blocking(problem, "hooks_missing") if problem else None, env)
        if self.rides is not None:
            self.carrier_of(obj).add_rider(cast(Rider, state))
        return state

    def carrier_of(self, obj: object) -> Carrier:
        """The state of the sync this one rides, on ``obj`` (built on first use)."""
        assert self.rides is not None, f"{self.sync.name} rides no other sync"
        return cast(Carrier, DECLARED[self.rides].ensure(obj))

    def state_of(self, obj: object) -> Optional[S]:
        state: Optional[S] = obj.__dict__.get(self.sync.state_attr)
        return state

    def attach(self, obj: object, init_args: Sequence[object] = (), **init_kwargs: object) -> S:
        """Build the object's state now (a setting is read when its state is built);
        with ``init_hicache(server_args, params)``'s arguments, its metrics too
        where ``params.enable_metrics`` (--enable-metrics)."""
        state = obj.__dict__[self.sync.state_attr] = self.build(obj)
        params = init_kwargs.get("params", init_args[1] if len(init_args) > 1 else None)
        if getattr(params, "enable_metrics", False):
            state.metrics = state.cache_metrics(obj)
        return state

    def ensure(self, obj: object) -> S:
        """The object's state, built on first use if init's hook did not run."""
        state = self.state_of(obj)
        return self.attach(obj) if state is None else state


def state_of(feature: Feature[S], obj: object) -> Optional[S]:
    """``obj``'s state for ``feature`` (a cache's, a decode offload manager's), if built."""
    return None if obj is None else feature.state_of(obj)


def check_order(features: Iterable[Feature[Any]]) -> tuple[Feature[Any], ...]:
    """The features in registration order, asserting each one's ``after``."""
    seen: list[str] = []
    out = tuple(features)
    for f in out:
        missing = [dep for dep in f.after if dep not in seen]
        assert not missing, f"{f.sync.name} must be registered after {missing}"
        assert f.sync.name not in seen, f"{f.sync.name} declared twice"
        seen.append(f.sync.name)
    return out
