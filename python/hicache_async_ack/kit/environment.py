"""What the plugin's states are handed when they are built: a sink for the
events a test or a bench watches, and the state classes to build (a test's
negative control is a subclass of the plugin's, handed in). One instance is in
force per process; :func:`hicache_async_ack.sglang_plugin.register` installs
the one it is given (SGLang's loader gives none: the default), as httpx takes
``transport=``: collaborators are passed in, never patched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Protocol

# What the prefetch votes report to a sink: a reach noted in a walk, the group's
# verdict on it where its section is read back, a stop applied, a pin taken or
# released, overflow exchanges run, a section closed.
EventKind = Literal["reach", "verdict", "stop", "pin", "unpin", "overflow", "section"]


class EventSink(Protocol):
    def __call__(self, kind: EventKind, /, **fields: object) -> None: ...


@dataclass(frozen=True)
class Environment:
    """The collaborators every state built from now on is handed."""

    events: Optional[EventSink] = None
    # sync name -> the state class built for it (a subclass of the plugin's own)
    substitutes: Mapping[str, type] = field(default_factory=dict)

    def state_class(self, sync: str, default: type) -> Any:
        cls = self.substitutes.get(sync, default)
        assert issubclass(cls, default), f"{cls} does not extend {default}"
        return cls


@dataclass
class Installed:
    current: Environment = field(default_factory=Environment)


INSTALLED = Installed()


def environment() -> Environment:
    """The environment states built now are handed."""
    return INSTALLED.current


def use_environment(new: Environment) -> Environment:
    """Install ``new`` for the states built from now on; returns the previous one."""
    old, INSTALLED.current = INSTALLED.current, new
    return old


__all__ = ["Environment", "EventKind", "EventSink", "environment", "use_environment"]
