"""Held prefetch starts (features/vote_starts.py) and the engine-agnostic choice of the
read in flight that covers a start (protocol.covering), one process, no collective.
The multi-rank behaviour beside stock is the differential's (test/multirank/
test_differential.py)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

import pytest

from hicache_async_ack.protocol import covering, shared_tokens


@dataclass(frozen=True)
class Handle:
    rid: str
    attempt_id: int = 0


class Key:
    """What a read in flight keeps of its key (upstream's RadixKey)."""

    def __init__(self, tokens, extra_key=None, cache_salt=None):
        self.tokens, self.extra_key, self.cache_salt = list(tokens), extra_key, cache_salt

    def raw_token_ids(self):
        return self.tokens


class Ongoing(NamedTuple):
    """What upstream's _OngoingPrefetch leads with."""

    anchor_node_id: Any
    prefetch_key: Key
    host_indices: Any = None
    operation: Any = None


def cache(page_size=2, threshold=4, policy="timeout", **reads):
    """ongoing_prefetch as upstream keeps it: handle -> _OngoingPrefetch."""
    ongoing = {Handle(rid): Ongoing(anchor, Key(tokens)) for rid, (anchor, tokens) in
               reads.items()}  # fmt: skip
    return SimpleNamespace(
        ongoing_prefetch=ongoing,
        page_size=page_size,
        prefetch_threshold=threshold,
        prefetch_stop_policy=policy,
        tree_core=SimpleNamespace(is_eagle=False),
    )


class Scheduler:
    """Stands for SGLang's scheduler: _prefetch_kvcache runs the start again."""

    def __init__(self, starts):
        self.starts, self.calls = starts, []

    def _prefetch_kvcache(self, req: Any, storage_hit_end: Optional[int] = None) -> None:
        self.calls.append((req.cache_request_handle, storage_hit_end))


def starts_with_context():
    from hicache_async_ack.sglang_plugin import Starts

    events: list[tuple[str, dict]] = []
    starts = Starts(lambda kind, **f: events.append((kind, f)))
    return starts, events


def remainder(tokens, anchor="n1"):
    from hicache_async_ack.sglang_plugin import Remainder

    return Remainder(anchor, tokens, None, None)


def choose(starts, c, rid, tokens, read_once=False, interval=7, anchor="n1"):
    handle = Handle(rid)
    req = SimpleNamespace(cache_request_handle=handle)
    now = -1 if interval is None else interval - 1
    return starts.starting(
        Scheduler(starts), req, None,
        lambda: starts.choose(c, handle, remainder(tokens, anchor), read_once, now, interval),
    )  # fmt: skip


def test_shared_tokens_counts_whole_pages_of_the_common_prefix():
    assert shared_tokens([1, 2, 3, 4, 5], [1, 2, 3, 9], 2) == 2
    assert shared_tokens([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], 2) == 4
    assert shared_tokens([7], [1, 2], 1) == 0
    assert shared_tokens([], [1, 2], 1) == 0


def test_covering_takes_the_read_bringing_most_the_oldest_among_equals():
    reads = [("a", [1, 2, 9]), ("b", [1, 2, 3, 4]), ("c", [1, 2, 3, 4, 8])]
    assert covering(reads, [1, 2, 3, 4, 5], 1) == ("b", 4)
    assert covering([("a", [5])], [1, 2], 1) is None
    assert covering([], [1, 2], 1) is None


def test_a_start_no_read_covers_runs_at_once():
    starts, _ = starts_with_context()
    c = cache(a=("n1", [1, 2, 3, 4]))
    assert choose(starts, c, "b", [9, 9, 9, 9]) is None  # nothing shared
    assert choose(starts, c, "b", [1, 2, 3, 4], anchor="n2") is None  # another anchor
    assert choose(starts, cache(), "b", [1, 2]) is None  # nothing in flight


def test_a_covered_start_waits_for_its_pass_with_read_once_off():
    starts, _ = starts_with_context()
    c = cache(a=("n1", [1, 2, 3, 4, 5, 6]))
    held = choose(starts, c, "b", [1, 2, 3, 4, 7, 7], read_once=False, interval=7)
    assert held is not None and held.why == "pass" and held.interval == 7
    assert held.tokens == 6 and held.awaits is None
    # no section will carry the interval: nothing to wait for, it runs at once
    assert choose(starts, c, "c", [1, 2, 3, 4], interval=None) is None


def test_read_once_waits_on_the_read_once_per_request():
    starts, _ = starts_with_context()
    c = cache(threshold=4, a=("n1", [1, 2, 3, 4, 5, 6]))
    held = choose(starts, c, "b", [1, 2, 3, 4], read_once=True)  # all of it in flight
    assert held is not None and held.why == "read_once" and held.awaits == Handle("a")
    again = choose(starts, c, "b", [1, 2, 3, 4], read_once=True)
    assert again is not None and again.why == "pass"  # its one wait is used
    # a rest still worth an L3 read of its own: waits, then reads only that rest
    long = choose(starts, c, "e", [1, 2, 3, 4, 7, 7, 7, 7], read_once=True)
    assert long is not None and long.why == "read_once"
    # below stock's threshold the read is not worth waiting for: a pass hold only
    small = choose(starts, c, "d", [1, 2, 9, 9], read_once=True)
    assert small is not None and small.why == "pass"
    # a rest shorter than the threshold: read once still (SGLang would not read it alone)
    short_rest = choose(starts, c, "f", [1, 2, 3, 4, 7, 7], read_once=True)
    assert short_rest is not None and short_rest.why == "read_once"


def test_only_a_schedulers_start_is_held():
    starts, _ = starts_with_context()
    c = cache(a=("n1", [1, 2, 3, 4]))
    # no _prefetch_kvcache around it (a PD decode prealloc's own start)
    assert starts.choose(c, Handle("b"), remainder([1, 2, 3, 4]), True, 6, 7) is None
    # another request's start inside this one's _prefetch_kvcache
    req = SimpleNamespace(cache_request_handle=Handle("x"))
    got = starts.starting(Scheduler(starts), req, None,
                          lambda: starts.choose(c, Handle("b"), remainder([1, 2, 3, 4]),
                                                True, 6, 7))  # fmt: skip
    assert got is None
    c.tree_core.is_eagle = True  # bigram keys: a shared prefix is not a token prefix
    assert choose(starts, c, "b", [1, 2, 3, 4]) is None


def test_held_starts_run_again_when_due_in_hold_order():
    starts, events = starts_with_context()
    c = cache(a=("n1", [1, 2, 3, 4]))
    scheduler = Scheduler(starts)
    for rid, interval in (("b", 3), ("c", 4), ("d", 3)):
        req = SimpleNamespace(cache_request_handle=Handle(rid))

        def decide(h=req.cache_request_handle, at=interval):
            return starts.choose(c, h, remainder([1, 2]), False, at - 1, at)

        held = starts.starting(scheduler, req, 11, decide)
        assert held is not None
        starts.hold(held)
    assert starts.is_held(Handle("b")) and not starts.is_held(Handle("a"))
    due = starts.due(3)
    assert [s.handle.rid for s in due] == ["b", "d"]
    for s in due:
        starts.run(s, 3)
    assert scheduler.calls == [(Handle("b"), 11), (Handle("d"), 11)]
    assert starts.is_held(Handle("c")) and not starts.is_held(Handle("b"))
    assert [k for k, _ in events].count("hold") == 3
    assert [k for k, _ in events].count("release") == 2


def test_a_read_once_wait_ends_when_its_read_leaves_the_flight():
    starts, _ = starts_with_context()
    c = cache(threshold=2, a=("n1", [1, 2, 3, 4]))
    held = choose(starts, c, "b", [1, 2, 3, 4], read_once=True)
    assert held is not None
    starts.hold(held)
    assert starts.awaited(Handle("a"))
    assert starts.landed(c) == []  # a is still in flight
    del c.ongoing_prefetch[Handle("a")]  # landed, cut, aborted, failed: gone from flight
    assert [s.handle for s in starts.landed(c)] == [Handle("b")]
    assert not starts.awaited(Handle("a"))


def test_an_aborted_request_never_starts_and_forgets_its_wait():
    starts, events = starts_with_context()
    c = cache(threshold=2, a=("n1", [1, 2, 3, 4]))
    held = choose(starts, c, "b", [1, 2, 3, 4], read_once=True)
    assert held is not None
    starts.hold(held)
    starts.drop(Handle("b"))
    assert not starts.is_held(Handle("b")) and Handle("b") not in starts.waited
    assert ("release", {"key": ("b", 0), "why": "abort"}) in events
    starts.forget()
    assert not starts.held and not starts.waited


@pytest.mark.parametrize("read_once", [False, True])
def test_nothing_is_kept_once_every_start_ran(read_once):
    """The plugin's state is empty once idle: no held start, no wait remembered past
    the request's admission."""
    starts, _ = starts_with_context()
    c = cache(threshold=2, a=("n1", [1, 2, 3, 4]))
    held = choose(starts, c, "b", [1, 2, 3, 4], read_once=read_once, interval=1)
    assert held is not None
    starts.hold(held)
    c.ongoing_prefetch.clear()
    for s in starts.due(1) + starts.landed(c):
        starts.run(s, 1)
    starts.admitted(Handle("b"))
    assert not starts.held and not starts.waited and not starts.late


def test_read_once_never_waits_under_wait_complete():
    """There a read ends only when it completes: one that hangs would hang every request
    waiting on it, where stock's own reads hang only their own; a pass hold only."""
    starts, _ = starts_with_context()
    c = cache(threshold=2, policy="wait_complete", a=("n1", [1, 2, 3, 4]))
    held = choose(starts, c, "b", [1, 2, 3, 4], read_once=True)
    assert held is not None and held.why == "pass" and held.awaits is None
    c.prefetch_stop_policy = "best_effort"  # the walk's first reach ends it
    held = choose(starts, c, "e", [1, 2, 3, 4], read_once=True)
    assert held is not None and held.why == "read_once"


class Rerun(Scheduler):
    """_prefetch_kvcache that reads: the start's read goes into flight."""

    def __init__(self, starts, c):
        super().__init__(starts)
        self.c = c

    def _prefetch_kvcache(self, req: Any, storage_hit_end: Optional[int] = None) -> None:
        super()._prefetch_kvcache(req, storage_hit_end)
        self.starts.rerun_tokens = 4
        self.c.ongoing_prefetch[req.cache_request_handle] = Ongoing("n1", Key([1, 2, 3, 4]))


def test_a_pass_hold_behind_a_read_that_started_late_lasts_as_much_longer():
    """A's start was held 3 passes, so its read lands 3 passes after stock's: B, covered
    by it, is held 3 passes past its own interval, so it still matches what stock's B
    matched at its arrival (A's pages) instead of reading them again."""
    starts, _ = starts_with_context()
    c = cache(x=("n1", [1, 2, 3, 4]))
    a = choose(starts, c, "a", [1, 2, 3, 4], interval=5)
    assert a is not None and a.interval == 5 and a.held_at == 4
    starts.hold(a)
    del c.ongoing_prefetch[Handle("x")]
    scheduler = Rerun(starts, c)
    for s in starts.due(5):
        s.scheduler = scheduler
        starts.run(s, 7)
    assert starts.late == {Handle("a"): 3}
    b = choose(starts, c, "b", [1, 2, 3, 4], interval=9)
    assert b is not None and b.why == "pass" and b.interval == 9 + 3
    starts.hold(b)
    for s in starts.due(12):  # B's read starts 5 passes late, 3 of them behind A's
        s.scheduler = scheduler
        starts.run(s, 13)
    assert starts.late[Handle("b")] == 2  # its own hold only: a chain does not add up
    third = choose(starts, c, "c", [1, 2, 3, 4], interval=14)
    assert third is not None and third.interval == 14 + 3  # the latest: A (3), B (2)
    del c.ongoing_prefetch[Handle("a")]  # A's and B's reads left: nothing kept
    del c.ongoing_prefetch[Handle("b")]
    starts.landed(c)
    assert not starts.late
