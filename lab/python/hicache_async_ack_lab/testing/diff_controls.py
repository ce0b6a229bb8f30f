"""Negative controls for the differential runs: the plugin with one of its
guarantees taken out, so a test can show that the checks catch each. Each is
a subclass of the plugin's vote state, handed in through the plugin's
environment (``kit.environment.Environment.substitutes``) for one scenario's
plugin arm (``spec["control"]``: a list of names); nothing is patched.

* ``after_pops``: an interval's stops made after the boundary's pops (what
  landed in between decides how a prefetch ends and what it keeps): issue 43's
  findings 2 and 3.
* ``no_exemption``: the KV-landed exemption not asked where the stop lands:
  issue 43's finding 2.
* ``drop_overflow``: the reaches past a section's slots lost: issue 43's finding 1.
* ``no_pins``: the pages a stop inserted left evictable until the walk: issue 43's
  finding 4.
* ``unbounded_pins``: those pins kept past their pass, until an admission, an
  abort or a reset: issue 47's findings 1 and 8.
* ``walk_fallback``: past the slots, upstream's per-request reduce at the walk
  (a collective in the walk): issue 47's findings 5 and 9.
* ``keys_only``: the admission check without the prefix and extend lengths:
  issue 43's finding 5.
* ``unreached_votes``: every ongoing operation voted on at the boundary,
  reached or not (the votes before issue 43).
"""

from __future__ import annotations

from typing import Any

CONTROLS = (
    "after_pops",
    "no_exemption",
    "drop_overflow",
    "no_pins",
    "unbounded_pins",
    "walk_fallback",
    "keys_only",
    "unreached_votes",
)


def key_of(handle: Any) -> tuple:
    """A request handle's key, as the votes' book keys it."""
    return (handle.rid, handle.attempt_id)


def substitutes(names) -> dict:
    """The plugin's state classes with the guarantees ``names`` taken out."""
    unknown = sorted(set(names) - set(CONTROLS))
    if unknown:
        raise ValueError(f"unknown control(s) {unknown}; accepted: {', '.join(CONTROLS)}")
    if not names:
        return {}
    from hicache_async_ack.protocol import VOTE_SLOTS
    from hicache_async_ack.sglang_plugin import Landing, Pins, PrefetchVoteState

    class ControlPins(Pins):
        def pin(self, cache: Any, handle: Any, node: Any) -> None:
            if "no_pins" not in names:
                super().pin(cache, handle, node)

        def release_all(self, cache: Any) -> None:
            if "unbounded_pins" not in names:
                super().release_all(cache)

    class ControlLanding(Landing):
        pins_class = ControlPins

        def kv_landed(self, cache: Any, op: Any) -> bool:
            return False if "no_exemption" in names else super().kv_landed(cache, op)

    class ControlVotes(PrefetchVoteState):
        landing_class = ControlLanding
        held: list = []

        def land(self, cache: Any, token: Any, reduced: Any, exchange: Any) -> None:
            if "after_pops" not in names:
                return super().land(cache, token, reduced, exchange)
            self.held = self.held + [self.book.read(token, reduced, exchange)]

        def end_pass(self, cache: Any) -> None:
            self.flush(cache)
            super().end_pass(cache)

        def flush(self, cache: Any) -> None:
            held, self.held = self.held, []
            for verdicts in held:
                self.landing.apply(cache, verdicts)

        def reach(self, cache: Any, original: Any, operation: Any) -> bool:
            past = self.active and len(self.book.reaches) >= VOTE_SLOTS
            if past and self.landing.applying is None:
                if "drop_overflow" in names:
                    return False
                if "walk_fallback" in names:
                    return bool(original(cache, operation))
            return super().reach(cache, original, operation)

        def section(self, cache: Any, last: bool = False) -> tuple[list[int], object]:
            if "unreached_votes" in names:
                reached = {id(r.op) for r in self.book.reaches}
                for h in sorted(cache.ongoing_prefetch, key=key_of):
                    op = cache.ongoing_prefetch[h].operation
                    if id(op) not in reached:
                        expired = bool(cache._prefetch_deadline_expired(op))
                        self.book.poll(key_of(h), op, expired)
            return super().section(cache, last)

        def admit(self, req: Any, prefix_len: int) -> None:
            if "keys_only" not in names:
                return super().admit(req, prefix_len)
            if self.active:
                self.book.admit(key_of(req.cache_request_handle), 0, 0)

    return {"prefetch_votes": ControlVotes}
