"""Negative controls for the differential runs: the plugin with one of its
guarantees taken out, as it was before (issue 43's findings), so a test can
show that the comparison catches each. Applied to one scenario's plugin arm
(``spec["control"]``: a list of names) and undone after it.

* ``after_pops``: an interval's decisions made after the boundary's pops (what
  landed in between decides how a prefetch ends, what it keeps, whether its
  hit is allocated): findings 2 and 3.
* ``no_exemption``: the KV-landed exemption judged only at the walk, on the
  plugin's older state: finding 2.
* ``drop_overflow``: reaches past the section's slots lost: finding 1.
* ``no_provisional``: a start this rank's budget refuses is declined at once
  (stock's budget was freer): finding 3.
* ``immediate_calls``: aborts and budget-bound starts run at once, on the
  plugin's older state.
* ``no_pins``: pages a stop inserted stay evictable until the admission:
  finding 4.
* ``keys_only``: the admission check without the prefix and extend lengths:
  finding 5.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any, Iterator

CONTROLS = (
    "after_pops",
    "no_exemption",
    "drop_overflow",
    "no_provisional",
    "immediate_calls",
    "no_pins",
    "keys_only",
)


@contextmanager
def patched(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextmanager
def controls(names, cache) -> Iterator[None]:
    """The plugin on ``cache`` with the guarantees ``names`` taken out."""
    unknown = sorted(set(names) - set(CONTROLS))
    if unknown:
        raise ValueError(f"unknown control(s) {unknown}; accepted: {', '.join(CONTROLS)}")
    from hicache_async_ack.features import prefetch_votes, vote_apply, vote_pass

    if not names:
        yield
        return
    state = prefetch_votes.FEATURE.state_of(cache)
    if state is None:
        raise ValueError(f"controls {list(names)}: the plugin holds no vote state on this cache")
    with ExitStack() as stack:
        if "after_pops" in names:
            held: list = []

            def take(c, token, reduced):
                held.append(state.book.read(token, reduced))

            def after_pops(c):
                while held:
                    vote_apply.apply(state, c, held.pop(0))

            end = vote_pass.end_pass

            def end_pass(s, c):
                if s.mode == vote_pass.RIDE_UPSTREAM:
                    after_pops(c)
                end(s, c)

            state.take, state.after_pops = take, after_pops
            stack.enter_context(patched(vote_pass, "end_pass", end_pass))
        if "no_exemption" in names:
            stack.enter_context(patched(vote_apply, "kv_landed", lambda c, op: False))
        if "drop_overflow" in names:
            poll = state.book.poll

            def dropping(key, op, expired, decided=None):
                return True if decided is not None else poll(key, op, expired)

            state.book.poll = dropping
        if "no_provisional" in names:

            def start(s, c, original, request, args, kwargs):
                return original(c, request, *args, **kwargs)

            stack.enter_context(patched(vote_apply, "start", start))
        if "immediate_calls" in names:
            stack.enter_context(patched(prefetch_votes, "deferring", lambda s: False))
        if "no_pins" in names:
            state.pins.pin = lambda c, handle, node: None
        if "keys_only" in names:
            admit = state.book.admit
            state.book.admit = lambda key, prefix, extend: admit(key, 0, 0)
        yield
