"""Engine-agnostic core: termination votes for ongoing storage prefetches, and
the admission check, as one section of a reduce another sync carries.

No SGLang or torch import here. Under a deadline ("timeout") policy stock SGLang
decides, each time a rank's waiting-queue walk reaches a request with an ongoing
prefetch, whether that prefetch stops waiting: one blocking MAX all_reduce of
"this rank's deadline passed" per request reached. A deadline is therefore only
ever judged for a request the walk reached, on every rank (a collective), and a
request left behind a full batch keeps prefetching however late it is.

Here each rank notes, during its walk, every request it reached and whether its
deadline had passed then (:meth:`VoteBook.poll`), and every request it admitted
to the batch, in order (:meth:`VoteBook.admit`). At the next pass boundary the
walk is closed into one fixed-size section of int64 values (:meth:`VoteBook.close`)
that rides a MIN-reduce another sync issues anyway (the ack counts' reduce), and
is read back when that reduce is consumed (:meth:`VoteBook.read`): an operation
stops by deadline only where every rank reached it in that walk and some rank
saw its deadline passed, exactly stock's verdict for that walk. A slot is 0 for
"not reached here" (a veto: MIN < 2), 2 for "reached, deadline passed", 3 for
"reached, not passed"; MIN == 2 is stop.

Agreement by identity. The verdicts are keyed by the operation objects voted on,
never by position or request id: an operation that left meanwhile (completed,
revoked, reset, storage detached) is never asked about again, and a new one for
the same request has no verdict until it has been voted on. Operations are
ordered by their key (the request handle) before voting, so arrival order on
each rank does not matter.

Agreement on the set and on the batch. Every section starts with ``[n, -n, x,
-x]``: the number of operations and a stamp whose digest hashes the sorted keys;
then ``[a, -a]``, one ``[h, -h]`` per position of the first ADMIT_SLOTS requests
admitted in that walk and ``[d, -d]`` over all of them. Ranks that disagree on
the set stop with :class:`PrefetchVoteMismatch` before any verdict is used;
ranks that admitted different requests (SGLang #30760's loop skew: the TP ranks
would run different batches) stop with :class:`AdmissionMismatch`, naming the
pass and the first request that differs. Keyed on admission, not on what a walk
reached: a request one rank reached and could not admit leaves the same batch.

Fixed size. Gloo aborts the process when two ranks pair collectives of different
sizes, so a section always has ``VOTE_SLOTS`` vote slots: with more operations
than that, each section votes on the ``VOTE_SLOTS`` voted on longest ago (never
first, then by key): a round robin by staleness every rank derives from the same
agreed history, so every operation is voted on at least once every
``ceil(n / VOTE_SLOTS)`` sections whatever order its key sorts in.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, NoReturn, Optional, Sequence

from .stamp import (
    STOCK_LIMIT,
    HiCacheAsyncAckError,
    HiCacheAsyncAckMismatch,
    Stamp,
    describe_mismatch,
    pack_stamp,
    stamps_differ,
)

# The stamp's protocol field for vote sections and the votes' own first exchange.
# Far from the ack sync's versions (1, 2, ...), so one that pairs with an ack
# reduce is named as such. 10: reached-and-expired slots, the admission check.
VOTES_PROTOCOL = 10
VOTE_SLOTS = 256  # votes per section (2 KiB of int64: costs gloo what 8 bytes cost)
ADMIT_SLOTS = 16  # admitted requests compared one by one (the rest by one digest)
HEADER = 4  # [n, -n, x, -x]
ADMIT = 2 + 2 * ADMIT_SLOTS + 2  # [a, -a], [h, -h] per position, [d, -d]
LAYOUT = HEADER + ADMIT + VOTE_SLOTS  # values per section
NOT_REACHED, REACHED_EXPIRED, REACHED = 0, 2, 3  # a slot's value; MIN == 2: stop
SKEW_ISSUE = "SGLang #30760"


class PrefetchVoteError(HiCacheAsyncAckError):
    """The prefetch vote sync cannot continue on this rank (peer died, timeout,
    ranks that disagree). Never retried."""


class PrefetchVoteMismatch(PrefetchVoteError, HiCacheAsyncAckMismatch):
    """The ranks disagree on the set of ongoing prefetch operations or on the
    protocol; raised on every rank before any verdict of that section is used."""


class AdmissionMismatch(PrefetchVoteMismatch):
    """The ranks admitted different requests to the batch in one scheduling pass
    (their waiting-queue walks diverged: SGLang #30760); raised on every rank."""


def key_hash(key: Hashable) -> int:
    """A 42-bit hash of one key, never 0 (0 marks "no request")."""
    h = hashlib.blake2b(repr(key).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big") % (STOCK_LIMIT - 1) + 1


def set_digest(keys: Sequence[Hashable]) -> int:
    """A 42-bit digest of a sequence of keys (order matters)."""
    h = hashlib.blake2b(digest_size=8)
    for k in keys:
        h.update(repr(k).encode())
        h.update(b"\0")
    return int.from_bytes(h.digest(), "big") % STOCK_LIMIT


def window(keys: Sequence[Hashable], last_voted: Mapping[Hashable, int]) -> range | list[int]:
    """Indices (into the key-sorted operations ``keys``) voted on this section:
    all of them if they fit, else the VOTE_SLOTS voted on longest ago, in key order."""
    n = len(keys)
    if n <= VOTE_SLOTS:
        return range(n)
    stale = sorted(range(n), key=lambda i: (last_voted.get(keys[i], -1), i))
    return sorted(stale[:VOTE_SLOTS])


def pairs(values: Sequence[int]) -> list[int]:
    """``[v, -v]`` for each value: MIN-reduced, the group's min and max of each."""
    return [w for v in values for w in (v, -v)]


@dataclass
class Verdicts:
    """The group's verdicts from one section: which operations stop by deadline."""

    pass_no: int  # the walk the section closed (see Ballot.pass_no)
    voted: int  # operations it voted on
    stop: dict[int, object] = field(default_factory=dict)  # id(op) -> op (kept alive)

    def __call__(self, op: object) -> bool:
        return self.stop.get(id(op)) is op

    def __len__(self) -> int:
        return len(self.stop)


@dataclass(frozen=True)
class Ballot:
    """What one rank put in a section (its token, handed back with the reduce).
    ``pass_no``: the scheduling pass whose walk it closed, N for the walk after
    the cache's Nth pass boundary (its Nth check_hicache_events call), the same
    on every rank."""

    pass_no: int
    ops: tuple  # the operations in the section's window, in slot order
    n: int
    x: int
    admitted: tuple  # the keys this rank admitted in the walk, in order


class VoteBook:
    """One cache's walk record and vote history. Per pass boundary the owner
    calls :meth:`close` (the walk since the last boundary, as a section) or
    :meth:`discard` (no section this pass), and :meth:`read` on each section
    reduced, in the order they were closed."""

    def __init__(self, *, hints: Optional[Mapping[str, str]] = None):
        self.hints = dict(hints or {})
        self.reached: dict[int, tuple[object, bool]] = {}  # id(op) -> (op, expired seen)
        self.admitted: list[Hashable] = []
        self.walks = 0  # pass boundaries seen (walks closed or dropped; equal on every rank)
        # key -> the walk it was last voted in (only while there are more
        # operations than slots: below that, every one is voted on every section)
        self._last_voted: dict[Hashable, int] = {}

    # ---------------------------------------------------------------- the walk
    def poll(self, op: object, expired: bool) -> None:
        """The walk reached ``op``'s request; ``expired``: its deadline had passed
        on this rank then (several reaches in one walk: passed at any of them)."""
        seen = self.reached.get(id(op))
        self.reached[id(op)] = (op, expired or (seen is not None and seen[1]))

    def admit(self, key: Hashable) -> None:
        self.admitted.append(key)

    def discard(self) -> None:
        """A pass boundary with no section: this walk is not voted on."""
        self.reached.clear()
        self.admitted.clear()
        self.walks += 1

    # ------------------------------------------------------------- the section
    def close(self, ops: Sequence[tuple[Any, object]]) -> tuple[list[int], Ballot]:
        """The section for every ongoing operation ``(key, op)`` (any order; keys
        sortable and equal across ranks for the same operation), with this
        walk's reaches and admissions; the walk starts afresh."""
        ranked = sorted(ops, key=lambda o: o[0])
        keys = [k for k, _ in ranked]
        n = len(ranked)
        x = pack_stamp(VOTES_PROTOCOL, False, 1, set_digest(keys), 0)
        admitted = tuple(self.admitted)
        head = [key_hash(k) for k in admitted[:ADMIT_SLOTS]]
        head += [0] * (ADMIT_SLOTS - len(head))
        values = pairs([n, x, len(admitted), *head, set_digest(admitted)])
        chosen = window(keys, self._last_voted)
        picked = []
        slots = [REACHED] * VOTE_SLOTS
        for slot, i in enumerate(chosen):
            op = ranked[i][1]
            picked.append(op)
            seen = self.reached.get(id(op))
            if seen is None or seen[0] is not op:
                slots[slot] = NOT_REACHED
            else:
                slots[slot] = REACHED_EXPIRED if seen[1] else REACHED
        if n <= VOTE_SLOTS:
            self._last_voted.clear()  # all voted: no one is staler than another
        else:
            last = self._last_voted
            self._last_voted = {k: last[k] for k in keys if k in last}
            for i in chosen:
                self._last_voted[keys[i]] = self.walks
        ballot = Ballot(self.walks, tuple(picked), n, x, admitted)  # the walk after boundary #walks
        self.discard()
        return values + slots, ballot

    def read(self, ballot: Ballot, reduced: Sequence[int]) -> Verdicts:
        """The group's verdicts from ``ballot``'s reduced section; raises on every
        rank, before any verdict is used, if the ranks disagree."""
        if len(reduced) != LAYOUT:
            raise PrefetchVoteError(
                f"HiCache prefetch votes: reduced {len(reduced)} values, issued {LAYOUT}"
            )
        lo = reduced[0 : HEADER + ADMIT : 2]
        hi = [-v for v in reduced[1 : HEADER + ADMIT : 2]]
        (lo_n, lo_x, lo_a), (hi_n, hi_x, hi_a) = lo[:3], hi[:3]
        if stamps_differ(ballot.x, lo_x, hi_x) or lo_n != hi_n:
            self._set_mismatch(ballot, lo_n, hi_n, lo_x, hi_x)
        if lo[3:] != hi[3:] or lo_a != hi_a:
            self._admission_mismatch(ballot, lo_a, hi_a, lo[3:-1], hi[3:-1])
        out = Verdicts(ballot.pass_no, len(ballot.ops))
        for slot, op in enumerate(ballot.ops):
            if reduced[HEADER + ADMIT + slot] == REACHED_EXPIRED:
                out.stop[id(op)] = op
        return out

    def _set_mismatch(self, b: Ballot, lo_n: int, hi_n: int, lo_x: int, hi_x: int) -> NoReturn:
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
        raise PrefetchVoteMismatch(
            f"HiCache prefetch votes: ranks disagree on the votes of scheduling pass "
            f"{b.pass_no}: {why} No verdict was used; stopping."
        )

    def _admission_mismatch(
        self, b: Ballot, lo_a: int, hi_a: int, lo_h: Sequence[int], hi_h: Sequence[int]
    ) -> NoReturn:
        at = next((i for i, (a, c) in enumerate(zip(lo_h, hi_h)) if a != c), None)
        if at is None:  # the first ADMIT_SLOTS agree; only the digest of the rest differs
            first = f"past request #{ADMIT_SLOTS} of the batch (the first {ADMIT_SLOTS} agree)"
        else:
            mine = describe_key(b.admitted[at]) if at < len(b.admitted) else "nothing"
            first = f"request #{at + 1} of the batch, where this rank admitted {mine}"
        raise AdmissionMismatch(
            f"HiCache prefetch votes: ranks admitted different requests to the batch in "
            f"scheduling pass {b.pass_no}: the first difference is {first} "
            f"(this rank admitted {len(b.admitted)}, the group {lo_a} to "
            f"{hi_a}). The TP ranks would run different batches: their waiting-queue walks "
            f"diverged ({SKEW_ISSUE}: a rank's walk stopped earlier, on its own request "
            "budget, batch_is_full or an add_one_req that another rank accepted). Stopping."
        )


def describe_key(key: Hashable) -> str:
    """A request handle's key ``(rid, attempt)`` as the operator reads it."""
    if isinstance(key, tuple) and len(key) == 2:
        return f"rid={key[0]!r} (attempt {key[1]})"
    return repr(key)


__all__ = [
    "ADMIT_SLOTS",
    "LAYOUT",
    "VOTES_PROTOCOL",
    "VOTE_SLOTS",
    "AdmissionMismatch",
    "Ballot",
    "PrefetchVoteError",
    "PrefetchVoteMismatch",
    "Verdicts",
    "VoteBook",
    "pairs",
    "set_digest",
    "window",
]
