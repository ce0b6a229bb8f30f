"""The one protocol every sync (feature) follows, and what the kit does for
all of them once: state lookup and attach, the path announcement (log line,
``pipelined`` gauge, path info series), metrics and the first exchange's flag.

A :class:`Feature` declares its name (one of :data:`~hicache_async_ack.names.SYNCS`),
where its per-object state lives and how it is built, the features whose
hooks must be inside its own (registered first), and its hooks, in the order
they need, each declared with :meth:`Feature.hook` beside its notes (target,
why, how, what makes it stand down). Its state, a :class:`FeatureState`,
declares the static decision (fixed for the object's lifetime), the dynamic
blockers (per step, no collective: :meth:`FeatureState.decide` is a query),
the one first exchange (:meth:`FeatureState.first_exchange`, which sets
``agreed``) and the step. :func:`check_order` asserts the declared order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

from .. import path_info
from ..names import LOGGER_NAME, SYNCS, TITLES
from .collectives import Collectives, collectives
from .decision import Decision
from .hooks import Hook, hook

logger = logging.getLogger(LOGGER_NAME)


class FeatureState:
    """What every feature keeps per object: its lifetime decision (``static``),
    the collectives it was handed, a metrics sink (None costs nothing), whether
    its first exchange ran (``agreed``) and what it last announced."""

    feature = ""  # its sync name, one of SYNCS

    def __init__(self, static: Decision, coll: Optional[Collectives] = None):
        self.static = static
        self.collectives = collectives() if coll is None else coll
        self.metrics: Any = None
        self.agreed = False
        self.announced: Optional[tuple] = None

    def dynamic_blocker(self, obj) -> Optional[Decision]:
        """Per-step conditions (cheap reads, no collective) that force upstream's path."""
        return None

    def decide(self, obj) -> Decision:
        """This step's path: a query, never a collective."""
        if not self.static.pipelined:
            return self.static
        return self.dynamic_blocker(obj) or self.static

    def first_exchange(self, obj) -> None:
        """The one blocking agreement in upstream's own shape, before anything the
        blocking path would not run; sets ``agreed`` (or raises, naming the
        disagreement, on every rank)."""
        raise NotImplementedError

    def announce(self, decision: Decision) -> None:
        """Called every step: logs and exports only a change (announce_path)."""
        announce_path(self, decision)

    def path_metrics(self, decision: Decision) -> None:
        """Export a change of path (the feature's ``pipelined`` gauge)."""
        self.metrics.on_path(decision.pipelined)

    def pipelined_details(self, decision: Decision) -> Sequence[str]:
        """What the pipelined line says in its parentheses."""
        return (f"world size {decision.world_size}",)

    def blocking_details(self) -> Sequence[str]:
        return ()

    def path_line(self, decision: Decision) -> str:
        title = TITLES[self.feature]
        if decision.pipelined:
            details = "; ".join(self.pipelined_details(decision))
            return f"{title}: pipelined over the {decision.reason} ({details})"
        extra = "; ".join(self.blocking_details())
        line = f"{title}: blocking (upstream path) because {decision.reason}"
        return f"{line} ({extra})" if extra else line


def announce_path(state: FeatureState, decision: Decision) -> None:
    """THE announcement of a sync's path, for all three: one line per rank, and
    one more on each change of path (decision and reason code), with the
    feature's ``pipelined`` metrics updated alike. Called every step: compares
    before it formats."""
    key = (decision.pipelined, decision.code, decision.reason)
    if key == state.announced:
        return
    state.announced = key
    if state.metrics is not None:
        state.path_metrics(decision)
        labels = getattr(state.metrics, "labels", None)
        if isinstance(labels, Mapping):  # the "why" series; never raises
            path = path_info.path_of(decision.pipelined)
            path_info.publish(state.feature, path, decision.code, labels)
    logger.info("%s", state.path_line(decision))


@dataclass
class Feature:
    """A sync, declared once (see the module docstring). ``build(obj)`` makes
    its state for an object (a cache, a manager); ``after`` names the features
    whose hooks it wraps (registered before its own)."""

    sync: str
    state_attr: str
    build: Callable[[Any], FeatureState]
    after: tuple[str, ...] = ()
    hooks: list[Hook] = field(default_factory=list)

    def __post_init__(self):
        assert self.sync in SYNCS, self.sync

    def hook(self, target: str, method: str, kind: str) -> Callable[[Callable], Callable]:
        """Declare the decorated function as this feature's ``kind`` hook on
        ``target.method``, after those declared before it."""
        assert kind in ("BEFORE", "AFTER", "AROUND"), kind

        def declare(fn: Callable) -> Callable:
            self.hooks.append(Hook(target, method, kind, hook(fn, self.sync), self.sync))
            return fn

        return declare

    def state_of(self, obj) -> Optional[Any]:
        return obj.__dict__.get(self.state_attr)

    def attach(self, obj) -> Any:
        """Build the object's state now (a setting is read when its state is built)."""
        state = obj.__dict__[self.state_attr] = self.build(obj)
        return state

    def ensure(self, obj) -> Any:
        """The object's state, built on first use if init's hook did not run."""
        state = self.state_of(obj)
        return self.attach(obj) if state is None else state


def check_order(features: Iterable[Feature]) -> tuple[Feature, ...]:
    """The features in registration order, asserting each one's ``after``: a
    feature's hooks must wrap those of the features it names, so those are
    registered (and nested) first."""
    seen: list[str] = []
    out = tuple(features)
    for f in out:
        missing = [dep for dep in f.after if dep not in seen]
        assert not missing, f"{f.sync} must be registered after {missing}"
        assert f.sync not in seen, f"{f.sync} declared twice"
        seen.append(f.sync)
    return out


class Rider(Protocol):
    """A section another feature adds to the ack sync's pipelined reduce, so
    its agreement costs no collective of its own (the prefetch votes).

    ``flags`` names the layout-flag bits it owns (bit -> what it means);
    ``layout_bit`` is the one whose agreement puts its section in a reduce.
    Per pipelined step the ack sync calls, in order: :meth:`take` for each of
    its sections in the reduces consumed (before any pop: it may raise),
    :meth:`after_pops` once upstream's pops are done, then :meth:`section` if the
    group agreed on ``layout_bit`` (its values and a token, handed back with
    the reduced values to :meth:`take`), else :meth:`no_section`."""

    flags: Mapping[int, str]
    layout_bit: int

    def local_flags(self, cache) -> int: ...

    def take(self, cache, token: object, reduced: Sequence[int]) -> None: ...

    def after_pops(self, cache) -> None: ...

    def section(self, cache) -> tuple[list[int], object]: ...

    def no_section(self, cache) -> None: ...
