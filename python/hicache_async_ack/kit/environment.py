"""What every state is handed when built: the plugin's collaborators, passed in (as httpx
takes ``transport=``), never patched; one in force per process, installed by
``register(env)``. ``collectives``; ``clock`` (seconds); ``judged``: the guard's verdict
(None: judged once from the installed SGLang against ``table``); ``metrics``: a metrics
factory (None: SGLang's pipeline); ``events``: a sink for the votes' events;
``substitutes``: per sync, a subclass of its state class (a negative control);
``features``: the syncs register() judges and hooks (empty: the plugin's own, in order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Literal,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
)

from ..names import Sync
from .collectives import Collectives
from .views import SyncMetrics

if TYPE_CHECKING:
    from ..guard import Judged

# What the prefetch votes report to a sink (reach, verdict, stop, pin, unpin, section;
# a start held and released; their own first exchange).
EventKind = Literal[
    "reach", "verdict", "stop", "pin", "unpin", "section", "hold", "release", "agreed"
]
S = TypeVar("S")


class EventSink(Protocol):
    def __call__(self, kind: EventKind, /, **fields: object) -> None: ...


# (the sync's row, labels, SGLang's collector) -> its metrics
MetricsFactory = Callable[[Sync, Mapping[str, object], object], Optional[SyncMetrics]]


@dataclass(frozen=True)
class Environment:
    """The collaborators every state built from now on is handed."""

    collectives: Collectives = field(default_factory=Collectives)
    clock: Callable[[], float] = time.perf_counter
    judged: Optional["Judged"] = None
    table: Optional[Path] = None
    metrics: Optional[MetricsFactory] = None
    events: Optional[EventSink] = None
    substitutes: Mapping[str, type] = field(default_factory=dict)
    features: Sequence[Any] = ()  # kit.feature.Feature rows (that module builds on this one)

    def state_class(self, sync: str, default: type[S]) -> type[S]:
        """The class to build ``sync``'s state with (a substitute must extend the default)."""
        cls = self.substitutes.get(sync, default)
        if not issubclass(cls, default):
            raise TypeError(f"substitute for {sync}: {cls} does not extend {default}")
        return cls


@dataclass
class Installed:
    current: Environment = field(default_factory=Environment)
    judged: Optional["Judged"] = None  # judged lazily where the environment has none


INSTALLED = Installed()


def environment() -> Environment:
    """The environment states built now are handed."""
    return INSTALLED.current


def use_environment(new: Environment) -> Environment:
    """Install ``new`` for the states built from now on; returns the previous one."""
    old, INSTALLED.current = INSTALLED.current, new
    INSTALLED.judged = None
    return old


def judged() -> "Judged":
    """The guard's verdict in force: the environment's, or the installed SGLang's, judged
    once (a broken table: every feature stands down)."""
    from ..guard import Judged, check_installed

    env = INSTALLED.current
    if env.judged is not None:
        return env.judged
    if INSTALLED.judged is None:
        try:
            INSTALLED.judged = Judged(check_installed(env.table))
        except Exception:  # noqa: BLE001 (a broken table: nothing runs)
            INSTALLED.judged = Judged(None)
    return INSTALLED.judged


__all__ = ["Environment", "EventKind", "EventSink", "environment", "judged", "use_environment"]
