"""A sync as declared (:class:`Feature`: its names row, state builder, order, hooks) and
what every sync's state does alike (:class:`FeatureState`: path decision, announcement,
failure); the step itself is :mod:`.owner`'s."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, Iterable, Mapping, Optional, Sequence, TypeVar

from .. import path_info
from ..errors import HiCacheAsyncAckError, HiCacheAsyncAckMismatch
from ..guard import UNTESTED
from ..names import LOGGER_NAME, Sync, SyncName
from .decision import Decision, ReasonCode
from .environment import Environment, environment, judged
from .hooks import Fn, Hook, HookKind, hook

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
    metrics sink (None costs nothing), ``agreed`` (first exchange ran), last announcement."""

    sync: ClassVar[Sync]

    def __init__(self, static: Decision, env: Environment) -> None:
        self.static = static
        self.env = env
        self.collectives = env.collectives
        self.metrics: Any = None
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

    def cache_metrics(self, cache: Any) -> Any:
        """This sync's metrics for a cache, labelled like its other metrics."""
        collector = getattr(cache, "metrics_collector", None)
        labels = getattr(collector, "labels", None) or {"cache_type": type(cache).__name__}
        return self.make_metrics(labels, collector)

    def make_metrics(self, labels: Mapping[str, Any], collector: Any = None) -> Any:
        """This sync's metrics for ``labels`` (the environment's factory, else SGLang's
        pipeline); None, logged, if they cannot be made: metrics never fail HiCache."""
        from ..metrics import series_for

        make = self.env.metrics or series_for
        try:
            return make(self.sync.metrics_key, labels, collector)
        except Exception as exc:  # noqa: BLE001 (e.g. a collector backend refusing the names)
            logger.warning("%s: metrics not exported for %s: %r", self.sync.title,
                           dict(labels), exc)  # fmt: skip
            return None


@dataclass
class Feature(Generic[S]):
    """A sync, declared once: ``build(obj)`` makes its state; ``after``: the syncs whose
    hooks it wraps (registered before its own)."""

    sync: Sync
    build: Callable[[Any], S]
    after: tuple[SyncName, ...] = ()
    hooks: list[Hook] = field(default_factory=list)

    def hook(self, target: str, method: str, kind: HookKind) -> Callable[[Fn], Fn]:
        """Declare the decorated function as this feature's ``kind`` hook on ``target.method``."""

        def declare(fn: Fn) -> Fn:
            self.hooks.append(Hook(target, method, kind, hook(fn, self.sync.name),
                                   self.sync.name))  # fmt: skip
            return fn

        return declare

    def hooked_on(self, target: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h.method for h in self.hooks if h.target == target))

    def state_of(self, obj: Any) -> Optional[S]:
        state: Optional[S] = obj.__dict__.get(self.sync.state_attr)
        return state

    def attach(self, obj: Any, init_args: Sequence[Any] = (), **init_kwargs: Any) -> S:
        """Build the object's state now (a setting is read when its state is built);
        with ``init_hicache(server_args, params)``'s arguments, its metrics too
        where ``params.enable_metrics`` (--enable-metrics)."""
        state = obj.__dict__[self.sync.state_attr] = self.build(obj)
        params = init_kwargs.get("params", init_args[1] if len(init_args) > 1 else None)
        if getattr(params, "enable_metrics", False):
            state.metrics = state.cache_metrics(obj)
        return state

    def ensure(self, obj: Any) -> S:
        """The object's state, built on first use if init's hook did not run."""
        state = self.state_of(obj)
        return self.attach(obj) if state is None else state


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


def state_class(sync: Sync, default: type[S]) -> type[S]:
    """The class to build ``sync``'s state with, in the environment in force."""
    return environment().state_class(sync.name, default)
