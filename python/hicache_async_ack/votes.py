"""Engine-agnostic core: pipelined termination votes for ongoing storage prefetches.

No SGLang or torch import here. Under a deadline ("timeout") policy, every rank
must reach the same verdict on whether an ongoing prefetch operation may stop
waiting, although each rank reads its own clock. Upstream asks one blocking
collective per operation checked. Here the owner hands in, once per scheduling
pass, every ongoing operation with this rank's vote (deadline passed or not);
one MIN-reduce of a fixed-size vector carries all of them, issued async and
consumed at the next pass: an operation is terminated when *some* rank voted
for it (upstream's MAX, sent as MIN of ``1 - vote``).

Agreement by identity. The verdicts consumed at pass t+1 are keyed by the
operation objects voted on at pass t, never by position or request id: an
operation that left meanwhile (completed, revoked, reset, storage detached) is
never asked about again, and a new operation for the same request has no
verdict until it has been voted on. Operations are ordered by their key (the
request handle) before voting, so arrival order on each rank does not matter.

Agreement on the set. Every reduce starts with ``[n, -n, x, -x]``: the number of
operations and a :class:`~hicache_async_ack.core.Stamp` whose digest is a hash
of the sorted keys. Ranks that disagree on the set of ongoing operations (or on
the protocol) stop with :class:`PrefetchVoteMismatch` before any verdict is used.

Fixed size. Gloo aborts the process when two ranks pair collectives of different
sizes, so the vector always has ``VOTE_SLOTS`` slots: with more operations than
that, each pass votes on the ``VOTE_SLOTS`` that were voted on longest ago (never
first, then by key): a round robin by staleness that every rank derives from the
same history (the same agreed sets, pass after pass), so every operation is voted
on at least once every ``ceil(n / VOTE_SLOTS)`` passes whatever order its key sorts
in and however the set churns (a window sliding by ``VOTE_SLOTS mod n`` let the
same operation fall outside it for hundreds of passes).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, NoReturn, Optional, Sequence

from .stamp import (
    OBS_BITS,
    STOCK_LIMIT,
    Collective,
    Handle,
    HiCacheAckSyncError,
    HiCacheAckSyncMismatch,
    Stamp,
    describe_mismatch,
    pack_stamp,
)

# The stamp's protocol field for vote reduces. Far from the ack sync's versions
# (1, 2, ...), so a vote reduce that pairs with an ack reduce is named as such.
VOTES_PROTOCOL = 9
VOTE_SLOTS = 256  # votes per reduce (2 KiB of int64: costs gloo what 8 bytes cost)
HEADER = 4  # [n, -n, x, -x]
LAYOUT = HEADER + VOTE_SLOTS
NO_VOTE = 1  # a slot's value when nobody wants to stop: MIN == 0 means "stop"


class PrefetchVoteError(HiCacheAckSyncError):
    """The prefetch vote sync cannot continue on this rank (peer died, timeout,
    ranks that disagree). Never retried."""


class PrefetchVoteMismatch(PrefetchVoteError, HiCacheAckSyncMismatch):
    """The ranks disagree on the set of ongoing prefetch operations or on the
    protocol; raised on every rank before any verdict of that reduce is used."""


def set_digest(keys: Sequence[Hashable]) -> int:
    """A 42-bit digest of the sorted operation keys (the stamp's digest field)."""
    h = hashlib.blake2b(digest_size=8)
    for k in keys:
        h.update(repr(k).encode())
        h.update(b"\0")
    return int.from_bytes(h.digest(), "big") % STOCK_LIMIT


def window(keys: Sequence[Hashable], last_voted: Mapping[Hashable, int]) -> range | list[int]:
    """Indices (into the key-sorted operations ``keys``) voted on this pass: all
    of them if they fit, else the VOTE_SLOTS voted on longest ago, in key order."""
    n = len(keys)
    if n <= VOTE_SLOTS:
        return range(n)
    stale = sorted(range(n), key=lambda i: (last_voted.get(keys[i], -1), i))
    return sorted(stale[:VOTE_SLOTS])


@dataclass
class Verdicts:
    """The group's verdicts from one reduce: which operations may stop."""

    pass_no: int  # the pass the reduce was issued at
    voted: int  # operations it voted on
    stop: dict[int, object] = field(default_factory=dict)  # id(op) -> op (kept alive)
    waited_s: float = 0.0  # how long this rank waited on it

    def __call__(self, op: object) -> bool:
        return self.stop.get(id(op)) is op

    def __len__(self) -> int:
        return len(self.stop)


class _Ballot:
    __slots__ = ("handle", "ops", "n", "x", "pass_no")

    def __init__(self, handle: Handle, ops: tuple, n: int, x: int, pass_no: int):
        self.handle = handle
        self.ops = ops  # the operations in this pass's window, in slot order
        self.n = n
        self.x = x
        self.pass_no = pass_no


class PipelinedVotes:
    """One vote reduce per pass in flight; its verdicts are consumed at the next.

    Per pass the owner calls :meth:`consume` (waits on the reduce issued at the
    previous pass, if any) and then :meth:`issue`. Every rank issues exactly one
    reduce per pass and waits on it at the next, by pass count alone."""

    def __init__(self, collective: Collective, *, hints: Optional[Mapping[str, str]] = None):
        self.collective = collective
        self.hints = dict(hints or {})
        self._pending: Optional[_Ballot] = None
        self._failed: Optional[BaseException] = None
        self._passes = 0
        # key -> the pass it was last voted on (only while there are more
        # operations than slots: below that, every one is voted on every pass)
        self._last_voted: dict[Hashable, int] = {}

    @property
    def pending(self) -> int:
        return int(self._pending is not None)

    @property
    def failed(self) -> Optional[BaseException]:
        return self._failed

    @property
    def passes(self) -> int:
        return self._passes

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise PrefetchVoteError(
                f"HiCache prefetch votes already failed on this rank and will not retry: "
                f"{self._failed}"
            ) from self._failed

    def issue(self, ops: Sequence[tuple[Any, object, bool]]) -> None:
        """Start the reduce over ``(key, operation, this rank votes to stop)``
        for every ongoing operation (any order; keys sortable and equal across
        ranks for the same operation)."""
        self._check_usable()
        if self._pending is not None:
            raise PrefetchVoteError("HiCache prefetch votes: issue() twice without consume()")
        ranked = sorted(ops, key=lambda o: o[0])
        n = len(ranked)
        x = pack_stamp(VOTES_PROTOCOL, False, 1, set_digest([k for k, _, _ in ranked]), 0)
        values = [n, -n, x, -x] + [NO_VOTE] * VOTE_SLOTS
        picked = []
        keys = [k for k, _, _ in ranked]
        chosen = window(keys, self._last_voted)
        for slot, i in enumerate(chosen):
            _, op, stop = ranked[i]
            picked.append(op)
            values[HEADER + slot] = 0 if stop else NO_VOTE
        if n <= VOTE_SLOTS:
            self._last_voted.clear()  # all voted: no one is staler than another
        else:
            last = self._last_voted
            self._last_voted = {k: last[k] for k in keys if k in last}
            for i in chosen:
                self._last_voted[keys[i]] = self._passes
        try:
            handle = self.collective(values)
        except Exception as exc:  # re-raised with context
            self._fail(exc, "issuing")
        self._passes += 1
        self._pending = _Ballot(handle, tuple(picked), n, x, self._passes)

    def consume(self) -> Optional[Verdicts]:
        """The verdicts of the reduce issued at the previous pass (None if none)."""
        self._check_usable()
        b, self._pending = self._pending, None
        if b is None:
            return None
        t0 = time.perf_counter()
        try:
            reduced = b.handle.wait()
        except Exception as exc:  # re-raised with context
            self._fail(exc, f"waiting on vote reduce #{b.pass_no}")
        waited = time.perf_counter() - t0
        if len(reduced) != LAYOUT:
            self._fail(ValueError(f"reduced {len(reduced)} values, issued {LAYOUT}"), "reading")
        lo_n, hi_n, lo_x, hi_x = reduced[0], -reduced[1], reduced[2], -reduced[3]
        agreed = b.x >> OBS_BITS
        if lo_x >> OBS_BITS != agreed or hi_x >> OBS_BITS != agreed or lo_n != hi_n:
            self._mismatch(b, lo_n, hi_n, lo_x, hi_x)
        out = Verdicts(b.pass_no, len(b.ops), waited_s=waited)
        for slot, op in enumerate(b.ops):
            if reduced[HEADER + slot] == 0:
                out.stop[id(op)] = op
        return out

    def drain(self) -> None:
        """Wait on the reduce in flight and drop its verdicts (standing down:
        every rank does so at the same pass, so the collectives stay paired)."""
        self.consume()

    def _mismatch(self, b: _Ballot, lo_n: int, hi_n: int, lo_x: int, hi_x: int) -> NoReturn:
        lo, hi = Stamp.unpack(lo_x), Stamp.unpack(hi_x)
        if lo.protocol != hi.protocol or lo.protocol != VOTES_PROTOCOL:
            why = describe_mismatch(Stamp.unpack(b.x), lo, hi, self.hints)
        elif lo_n != hi_n:
            why = (
                f"the number of ongoing storage prefetch operations differs across the "
                f"group: this rank {b.n}, group min {lo_n}, max {hi_n} (ranks diverged)."
            )
        else:
            why = (
                f"the set of ongoing storage prefetch operations differs across the group "
                f"({b.n} on every rank, but not the same requests: ranks diverged)."
            )
        err = PrefetchVoteMismatch(
            f"HiCache prefetch votes: ranks disagree on vote reduce #{b.pass_no}: {why} "
            "No verdict was used; stopping."
        )
        self._failed = err
        raise err

    def _fail(self, exc: BaseException, doing: str) -> NoReturn:
        self._pending = None
        self._failed = exc
        raise PrefetchVoteError(
            f"HiCache prefetch votes failed while {doing}: {exc}. A peer rank may have "
            "died, run another configuration, or the collective timed out; not retrying."
        ) from exc


__all__ = [
    "LAYOUT",
    "VOTES_PROTOCOL",
    "VOTE_SLOTS",
    "PipelinedVotes",
    "PrefetchVoteError",
    "PrefetchVoteMismatch",
    "Verdicts",
    "set_digest",
    "window",
]
