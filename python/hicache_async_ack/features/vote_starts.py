"""Prefetch starts the votes hold back, so a prefix in flight is not read again
(docs/design.md, "Shared prefixes").

Stock starts a request's storage prefetch where the request arrives
(``Scheduler._prefetch_kvcache``): it matches the device and host trees, then reads the
remainder from L3, anchored on the matched host node. A read already in flight from that
anchor which covers the remainder's first pages brings them to the host when it lands,
and here it lands depth + 1 passes after stock's walk landed it. So a start whose
remainder such a read covers is held, on agreed state only (which reads are in flight,
their anchors and keys; never a rank's own progress):

* until its interval's section is read back (``PASS``): there, after the stops of the walk
  before the arrival and before that boundary's pops, the plugin holds what stock held
  when the request arrived; the start then runs through upstream's code, as stock's did.
* read once (``READ_ONCE``, its own setting): where the read covers at least
  ``prefetch_threshold`` tokens and its policy ends it for sure (``timeout``: its
  deadline; ``best_effort``: the walk's first reach; never ``wait_complete``), until
  that read lands (complete, cut, aborted, failed, or gone with a flush or a detach),
  once per request; the start then matches the host
  and reads only the rest (a rest shorter than the threshold, SGLang's own bar for an L3
  read, is not read: up to threshold - 1 tokens fewer than stock's one read brought).

A held start holds nothing (no host page, no budget, no L3 query); its request answers
"not ready" to the walk until the start has run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Literal,
    Optional,
    Sequence,
    TypeVar,
    cast,
)

from ..kit.views import Cache, Request, RequestHandle, Scheduler
from ..protocol.votes import WAIT_COMPLETE, covering, shared_tokens

Emit = Callable[..., None]
T = TypeVar("T")
Why = Literal["pass", "read_once"]
PASS: Why = "pass"
READ_ONCE: Why = "read_once"


@dataclass(eq=False)
class Start:
    """A held start: what re-runs ``Scheduler._prefetch_kvcache`` for its request."""

    handle: Hashable
    scheduler: Scheduler
    req: Request
    storage_hit_end: Optional[int]
    tokens: int  # the L3 remainder it asked for when held
    why: Why
    awaits: Optional[Hashable]  # READ_ONCE: the handle whose read it waits for
    interval: int  # PASS: the interval whose section releases it
    held_at: int  # the pass it was held at (its start in stock)

    @property
    def longer(self) -> int:
        """PASS: how many passes it is held past its own interval, behind a late read."""
        return max(0, self.interval - self.held_at - 1) if self.why == PASS else 0


@dataclass(frozen=True)
class Remainder:
    """What a start asks L3 for: its anchor, its tokens, their namespace."""

    anchor: object
    tokens: Sequence[int]
    extra_key: Optional[str]
    cache_salt: Optional[str]


def reads_from(cache: Cache, want: Remainder) -> Iterator[tuple[Hashable, Sequence[int]]]:
    """(handle, tokens) of every read in flight from ``want``'s anchor in its namespace,
    oldest first (upstream's ``_OngoingPrefetch``, as ``_handle_prefetch_result``, which
    the guard fingerprints, reads it)."""
    salt = want.cache_salt or None  # as RadixKey keeps it
    for handle, info in cache.ongoing_prefetch.items():
        key = info.prefetch_key
        if (
            info.anchor_node_id == want.anchor
            and key.extra_key == want.extra_key
            and key.cache_salt == salt
        ):
            yield handle, key.raw_token_ids()


class Starts:
    """The prefetch starts held on one cache, the start in progress, the one re-run now."""

    def __init__(self, emit: Emit) -> None:
        self.held: dict[Hashable, Start] = {}  # by handle, in hold order
        self.waited: set[Hashable] = set()  # handles that waited on a read once already
        self.context: Optional[tuple[Scheduler, Request, Optional[int]]] = None  # req's end
        self.rerun: Optional[Hashable] = None  # the handle whose held start runs now
        self.rerun_tokens: Optional[int] = None  # what that re-run asked L3 for
        # per read in flight from a held start: the passes its own hold delayed it
        self.late: dict[Hashable, int] = {}
        self.emit = emit

    def starting(
        self, scheduler: Scheduler, req: Request, end: Optional[int], run: Callable[[], T]
    ) -> T:
        """``Scheduler._prefetch_kvcache`` for ``req``: its start may be held inside."""
        outer, self.context = self.context, (scheduler, req, end)
        try:
            return run()
        finally:
            self.context = outer

    def is_held(self, handle: Hashable) -> bool:
        return handle in self.held

    def awaited(self, handle: Hashable) -> bool:
        """Whether a held start waits on ``handle``'s read."""
        return any(s.awaits == handle for s in self.held.values())

    def admitted(self, handle: Hashable) -> None:
        """The request joined a batch: its one wait is behind it."""
        self.waited.discard(handle)

    def choose(self, cache: Cache, handle: Hashable, want: Remainder, read_once: bool,
               now: int, interval: Optional[int]) -> Optional[Start]:  # fmt: skip
        """The hold for this start (None: it runs now); ``now``: this pass; ``interval``:
        the open interval, where a section will carry it."""
        context = self.context
        if context is None or context[1].cache_request_handle != handle:
            return None  # not a scheduler's start (a PD decode prealloc asks on its own)
        if cache.tree_core.is_eagle:
            return None  # bigram keys: a shared prefix is not a token prefix
        page = cache.page_size
        reads = list(reads_from(cache, want))
        found = covering(reads, want.tokens, page)
        if found is None:
            return None
        awaits, shared = found
        scheduler, req, end = context
        tokens = len(want.tokens) - len(want.tokens) % page
        # read once where the read ahead brings at least what SGLang deems worth an L3
        # read (a rest it then finds too short for one is not read: SGLang's own bar),
        # and ends for sure: under wait_complete a read ends only when it completes, so
        # one that hangs would hang every request waiting on it, where stock's own
        # reads hang only their own requests
        if (read_once and handle not in self.waited and shared >= cache.prefetch_threshold
                and cache.prefetch_stop_policy != WAIT_COMPLETE):  # fmt: skip
            self.waited.add(handle)
            return Start(handle, scheduler, req, end, tokens, READ_ONCE, awaits, -1, now)
        if interval is None:
            return None
        # a read that itself started late (held) lands as much later again: the hold
        # lasts as much longer as the latest of them (by their own holds, so the extra
        # passes never add up along a chain), so the start still matches what stock's
        # matched
        late = max((self.late.get(h, 0) for h, t in reads
                    if shared_tokens(t, want.tokens, page) > 0), default=0)  # fmt: skip
        return Start(handle, scheduler, req, end, tokens, PASS, None, interval + late, now)

    def hold(self, start: Start) -> None:
        self.held[start.handle] = start
        self.emit("hold", key=key_of(start.handle), why=start.why, longer=start.longer,
                  awaits=None if start.awaits is None else key_of(start.awaits))  # fmt: skip

    def drop(self, handle: Hashable) -> None:
        """The request is gone (aborted): its start never runs."""
        if self.held.pop(handle, None) is not None:
            self.emit("release", key=key_of(handle), why="abort")
        self.waited.discard(handle)

    def due(self, interval: int) -> list[Start]:
        """The PASS holds of every interval up to ``interval`` (its section was read)."""
        if not self.held:  # the common pass: nothing held (no generator, no list)
            return []
        return self._take(s for s in self.held.values() if s.why == PASS and s.interval <= interval)

    def landed(self, cache: Cache) -> list[Start]:
        """The READ_ONCE holds whose read is no longer in flight (and forget how late
        the reads that left were)."""
        live = cache.ongoing_prefetch
        if self.late:
            self.late = {h: n for h, n in self.late.items() if h in live}
        if not self.held:
            return []
        return self._take(s for s in self.held.values() if s.why == READ_ONCE
                          and s.awaits not in live)  # fmt: skip

    def every(self) -> list[Start]:
        return self._take(self.held.values()) if self.held else []

    def _take(self, starts: Iterable[Start]) -> list[Start]:
        out = list(starts)
        for s in out:
            del self.held[s.handle]
        return out

    def run(self, start: Start, now: int) -> Optional[int]:
        """Run ``start`` again through the scheduler's (hooked) ``_prefetch_kvcache``, on
        the state as it is now (pass ``now``); returns the tokens its read asked for
        (None: no read)."""
        self.rerun, self.rerun_tokens = start.handle, None
        try:
            start.scheduler._prefetch_kvcache(start.req, start.storage_hit_end)
        finally:
            self.rerun = None
        # its own lateness only, not the read it was held behind: a herd of starts, each
        # covered by the one before, would otherwise wait longer and longer
        own = now - start.held_at - start.longer
        if self.rerun_tokens is not None and own > 0:
            self.late[start.handle] = own
        self.emit("release", key=key_of(start.handle), why=start.why,
                  tokens=start.tokens, now=self.rerun_tokens)  # fmt: skip
        return self.rerun_tokens

    def forget(self) -> None:
        """The tree was reset: no request waits (flush_cache runs on an idle scheduler)."""
        self.held.clear()
        self.waited.clear()
        self.late.clear()


def key_of(handle: Hashable) -> tuple[str, int]:
    """A request handle's ``(rid, attempt)``, as the events and the lab name it."""
    h = cast(RequestHandle, handle)
    return (h.rid, h.attempt_id)
