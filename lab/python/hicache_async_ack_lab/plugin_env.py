"""The plugin's environment, as the lab hands it in (the public
``hicache_async_ack.sglang_plugin.use_environment``; nothing is patched): an
event sink for what the votes do, substitutes (a negative control is a subclass
of the plugin's state), other collectives (a latency model, a counter, a
dedicated group, a local answer)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping, Optional

from hicache_async_ack.sglang_plugin import Environment, environment, use_environment


class EventLog:
    """An event sink for the plugin: every event in order, as (kind, fields),
    and how many of each kind."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.counts: dict[str, int] = {}

    def __call__(self, kind: str, /, **fields: object) -> None:
        self.events.append((kind, fields))
        self.counts[kind] = self.counts.get(kind, 0) + 1


def wrap_async_min(wrap: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> Environment:
    """Install ``wrap(the async MIN factory in force)`` for the states built from
    now on; returns the previous environment."""
    env = environment()
    coll = env.collectives
    return use_environment(replace(env, collectives=replace(coll, async_min=wrap(coll.async_min))))


@contextmanager
def installed(
    events: Optional[Callable[..., None]] = None,
    substitutes: Optional[Mapping[str, type]] = None,
    clock: Optional[Callable[[], float]] = None,
    **collectives: Any,
) -> Iterator[Environment]:
    """The plugin's states built inside the block get ``events``, ``substitutes``,
    ``clock`` and these collectives (Collectives' fields), each given one in
    place of the one in force; that environment is put back after."""
    before = environment()
    env = replace(
        before,
        collectives=replace(before.collectives, **collectives),
        events=before.events if events is None else events,
        substitutes=before.substitutes if substitutes is None else dict(substitutes),
        clock=before.clock if clock is None else clock,
    )
    use_environment(env)
    try:
        yield env
    finally:
        use_environment(before)
