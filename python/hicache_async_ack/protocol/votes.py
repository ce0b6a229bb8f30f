"""Engine-agnostic core: the storage-prefetch decisions of one scheduling pass,
as one section of a reduce another sync carries, and the order they are made in.

No SGLang or torch import here. Stock SGLang decides, each time a rank's
waiting-queue walk reaches a request with an ongoing prefetch, whether that
prefetch stops now: under the ``timeout`` policy with one blocking MAX
all_reduce of "this rank's deadline passed" per request reached; under
``best_effort`` at once. Either way it decides on the cache's agreed state at
that point of the walk. The rule this module serves: **every decision stock
makes at pass p from agreed state, the plugin makes at pass p + depth + 1 from
the state as agreed at pass p** (docs/design.md says why the point where the
section is read back is exactly that state).

A :class:`VoteBook` keeps, per interval between two pass boundaries (the
walk, then whatever the scheduler does until the next boundary), everything
that must be decided there in the order it happened, each with a sequence
number: the reaches of the walk (:meth:`VoteBook.poll`) and the calls the
adapter holds back to that point (:meth:`VoteBook.defer`); and the requests
admitted to the batch with their prefix and extend lengths
(:meth:`VoteBook.admit`). At the next boundary :meth:`VoteBook.close` turns the
interval into one fixed-size section of int64 values riding a MIN-reduce, and
:meth:`VoteBook.read` turns the reduced section back into :class:`Verdicts`:
the interval's entries in order, each reach with the group's verdict.

The section (``LAYOUT`` values): ``[n, -n, x, -x]`` (ongoing operations, and a
stamp carrying the protocol and the stop policy), ``[r, -r]`` (reaches),
``[a, -a]``, one ``[h, -h]`` per position of the first ADMIT_SLOTS admissions
(a hash of key, prefix length and extend length) and ``[d, -d]`` over all of
them; then one slot of three values per reach, in walk order: ``[v, h, -h]``,
v 0 for none, 2 reached with the deadline passed here, 3 reached and not; h a
hash of the request's key. MIN over the group: v == 2 (every rank reached it,
some rank's deadline passed: stock's MAX) is a stop; v == 0 (a rank's walk
stopped before it) is a veto; min h != max h where both are set: the ranks'
walks reached different requests at that position (they diverged), and
every rank stops with :class:`PrefetchVoteMismatch` before any verdict.

Reaches past ``VOTE_SLOTS`` in one walk are not carried: the adapter decides
them on SGLang's own per-request reduce at the walk (counted, named), and the
book keeps their answers in the same order (:meth:`VoteBook.poll` with
``decided``), so they are applied at the same point as the others.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, NoReturn, Optional, Sequence

from ..errors import AdmissionMismatch, PrefetchVoteError, PrefetchVoteMismatch
from .stamp import (
    STOCK_LIMIT,
    Stamp,
    describe_mismatch,
    pack_stamp,
    stamps_differ,
)

# The stamp's protocol field for vote sections and the votes' own first exchange.
# Far from the ack sync's versions (1, 2, ...). 11: reach-ordered slots with their
# identity, admissions with their lengths, the interval's deferred calls.
VOTES_PROTOCOL = 11
VOTE_SLOTS = 256  # reaches carried per section (6 KiB of int64 with the rest)
ADMIT_SLOTS = 16  # admitted requests compared one by one (the rest by one digest)
HEADER = 4  # [n, -n, x, -x]
REACH = 2  # [r, -r]
ADMIT = 2 + 2 * ADMIT_SLOTS + 2  # [a, -a], [h, -h] per position, [d, -d]
SLOT = 3  # [v, h, -h]
LAYOUT = HEADER + REACH + ADMIT + SLOT * VOTE_SLOTS  # values per section
NOT_REACHED, REACHED_EXPIRED, REACHED = 0, 2, 3  # a slot's v; MIN == 2: stop
POLICIES = {"timeout": 1, "best_effort": 2}  # the stop policies a walk decides under
SKEW_ISSUE = "SGLang #30760"


def key_hash(key: Hashable) -> int:
    """A 42-bit hash of one key, never 0 (0 marks "none")."""
    h = hashlib.blake2b(repr(key).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big") % (STOCK_LIMIT - 1) + 1


def seq_digest(items: Sequence[Hashable]) -> int:
    """A 42-bit digest of a sequence (order matters)."""
    h = hashlib.blake2b(digest_size=8)
    for k in items:
        h.update(repr(k).encode())
        h.update(b"\0")
    return int.from_bytes(h.digest(), "big") % STOCK_LIMIT


def pairs(values: Sequence[int]) -> list[int]:
    """``[v, -v]`` for each value: MIN-reduced, the group's min and max of each."""
    return [w for v in values for w in (v, -v)]


@dataclass(frozen=True)
class Reach:
    """The walk reached ``op`` (its request's ``key``); ``decided``: the group's
    answer already taken on SGLang's per-request reduce (past the slots)."""

    seq: int
    key: Hashable
    op: Any
    expired: bool
    decided: Optional[bool] = None


@dataclass(frozen=True)
class Deferred:
    """A call held back to the point of the interval it was made in."""

    seq: int
    what: Any


@dataclass(frozen=True)
class Ballot:
    """What one rank put in a section (its token, handed back with the reduce).
    ``pass_no``: the interval's boundary (the cache's Nth check_hicache_events
    call, the same on every rank); ``label``: how the scheduler numbers that
    pass, for messages."""

    pass_no: int
    label: str
    reaches: tuple  # every Reach, in walk order (the first VOTE_SLOTS carried)
    deferred: tuple  # every Deferred of the interval
    n: int
    x: int
    admitted: tuple  # (key, prefix length, extend length) per admission, in order


@dataclass
class Verdicts:
    """The group's verdicts of one interval, as (seq, kind, payload) in order:
    ``("reach", (reach, stop))`` or ``("deferred", what)``."""

    pass_no: int
    entries: list = field(default_factory=list)

    def stops(self) -> list:
        """The operations the group stopped, in walk order."""
        return [p[0].op for _, kind, p in self.entries if kind == "reach" and p[1]]


class VoteBook:
    """One cache's record of the current interval. Per pass boundary the owner
    calls :meth:`close` (the interval as a section) or :meth:`discard` (none
    rides this boundary), and :meth:`read` on each section reduced, in the
    order they were closed."""

    def __init__(self, *, hints: Optional[Mapping[str, str]] = None):
        self.hints = dict(hints or {})
        self.reaches: list[Reach] = []
        self.deferred: list[Deferred] = []
        self.admitted: list[tuple] = []
        self.walks = 0  # pass boundaries seen (the same on every rank)
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # ---------------------------------------------------------------- the walk
    def poll(self, key: Hashable, op: object, expired: bool, decided=None) -> bool:
        """The walk reached ``op`` (request ``key``): ``expired``, this rank's
        vote. False when the section has no slot left for it (the caller decides
        it another way and polls again with ``decided``)."""
        carried = sum(r.decided is None for r in self.reaches)
        if decided is None and carried >= VOTE_SLOTS:
            return False
        self.reaches.append(Reach(self.next_seq(), key, op, bool(expired), decided))
        return True

    def defer(self, what: Any) -> None:
        self.deferred.append(Deferred(self.next_seq(), what))

    def admit(self, key: Hashable, prefix_len: int, extend_len: int) -> None:
        self.admitted.append((key, int(prefix_len), int(extend_len)))

    def take_interval(self) -> tuple[list[Reach], list[Deferred], list[tuple]]:
        """Start a new interval; returns what the old one held."""
        out = (self.reaches, self.deferred, self.admitted)
        self.reaches, self.deferred, self.admitted = [], [], []
        self.walks += 1
        return out

    def discard(self) -> list[Deferred]:
        """A boundary with no section: the interval's calls (to run now)."""
        return self.take_interval()[1]

    # ------------------------------------------------------------- the section
    def close(self, n_ongoing: int, policy: str, label: str = "") -> tuple[list[int], Ballot]:
        """The interval as a section; a new interval starts."""
        pass_no = self.walks
        reaches, deferred, admitted = self.take_interval()
        x = pack_stamp(VOTES_PROTOCOL, False, 1, POLICIES.get(policy, 0), 0)
        carried = [r for r in reaches if r.decided is None]
        head = [key_hash(a) for a in admitted[:ADMIT_SLOTS]]
        head += [0] * (ADMIT_SLOTS - len(head))
        values = pairs([n_ongoing, x, len(carried), len(admitted), *head, seq_digest(admitted)])
        slots = [NOT_REACHED, 0, 0] * VOTE_SLOTS
        for i, r in enumerate(carried):
            h = key_hash(r.key)
            slots[SLOT * i : SLOT * i + SLOT] = [REACHED_EXPIRED if r.expired else REACHED, h, -h]
        ballot = Ballot(pass_no, label or str(pass_no), tuple(reaches), tuple(deferred),
                        n_ongoing, x, tuple(admitted))  # fmt: skip
        return values + slots, ballot

    def read(self, ballot: Ballot, reduced: Sequence[int]) -> Verdicts:
        """The group's verdicts; raises on every rank, before any verdict is
        used, if the ranks disagree."""
        if len(reduced) != LAYOUT:
            raise PrefetchVoteError(
                f"HiCache prefetch votes: reduced {len(reduced)} values, issued {LAYOUT}"
            )
        head = HEADER + REACH + ADMIT
        lo = list(reduced[0:head:2])
        hi = [-v for v in reduced[1:head:2]]
        (lo_n, lo_x, _, lo_a), (hi_n, hi_x, _, hi_a) = lo[:4], hi[:4]
        if stamps_differ(ballot.x, lo_x, hi_x) or lo_n != hi_n:
            self._set_mismatch(ballot, lo_n, hi_n, lo_x, hi_x)
        if lo[4:] != hi[4:] or lo_a != hi_a:
            self._admission_mismatch(ballot, lo_a, hi_a, lo[4:-1], hi[4:-1])
        out = Verdicts(ballot.pass_no)
        carried = 0
        entries = []
        for r in ballot.reaches:
            if r.decided is not None:
                entries.append((r.seq, "reach", (r, bool(r.decided))))
                continue
            at = head + SLOT * carried
            carried += 1
            v, lo_h, hi_h = reduced[at], reduced[at + 1], -reduced[at + 2]
            if lo_h != 0 and lo_h != hi_h:
                self._reach_mismatch(ballot, carried, r)
            entries.append((r.seq, "reach", (r, v == REACHED_EXPIRED)))
        entries += [(d.seq, "deferred", d.what) for d in ballot.deferred]
        out.entries = sorted(entries, key=lambda e: e[0])
        return out

    def _set_mismatch(self, b: Ballot, lo_n: int, hi_n: int, lo_x: int, hi_x: int) -> NoReturn:
        lo, hi = Stamp.unpack(lo_x), Stamp.unpack(hi_x)
        if lo.protocol != hi.protocol or lo.protocol != VOTES_PROTOCOL:
            why = describe_mismatch(Stamp.unpack(b.x), lo, hi, self.hints)
        elif lo.digest != hi.digest:
            why = "the storage prefetch policy differs across the group."
        else:
            why = (
                f"the number of ongoing storage prefetch operations differs across the "
                f"group: this rank {b.n}, group min {lo_n}, max {hi_n} (ranks diverged)."
            )
        raise PrefetchVoteMismatch(
            f"HiCache prefetch votes: ranks disagree on the votes of scheduling pass "
            f"{b.label}: {why} No verdict was used; stopping."
        )

    def _reach_mismatch(self, b: Ballot, position: int, mine: Reach) -> NoReturn:
        raise PrefetchVoteMismatch(
            f"HiCache prefetch votes: the ranks' waiting-queue walks of scheduling pass "
            f"{b.label} reached different requests at position {position} (this rank: "
            f"{describe_key(mine.key)}): their waiting queues diverged ({SKEW_ISSUE}). "
            "No verdict was used; stopping."
        )

    def _admission_mismatch(
        self, b: Ballot, lo_a: int, hi_a: int, lo_h: Sequence[int], hi_h: Sequence[int]
    ) -> NoReturn:
        at = next((i for i, (a, c) in enumerate(zip(lo_h, hi_h)) if a != c), None)
        if at is None:  # the first ADMIT_SLOTS agree; only the digest of the rest differs
            first = f"past request #{ADMIT_SLOTS} of the batch (the first {ADMIT_SLOTS} agree)"
        else:
            mine = describe_admission(b.admitted[at]) if at < len(b.admitted) else "nothing"
            first = f"request #{at + 1} of the batch, where this rank admitted {mine}"
        raise AdmissionMismatch(
            f"HiCache prefetch votes: ranks admitted different requests to the batch in "
            f"scheduling pass {b.label}: the first difference is {first} "
            f"(this rank admitted {len(b.admitted)}, the group {lo_a} to "
            f"{hi_a}). The TP ranks would run different batches: their waiting-queue walks "
            f"diverged ({SKEW_ISSUE}: a rank's walk stopped earlier, on its own request "
            "budget, batch_is_full or an add_one_req that another rank accepted, or "
            "matched another prefix). Stopping."
        )


def describe_key(key: Hashable) -> str:
    """A request handle's key ``(rid, attempt)`` as the operator reads it."""
    if isinstance(key, tuple) and len(key) == 2:
        return f"rid={key[0]!r} (attempt {key[1]})"
    return repr(key)


def describe_admission(entry: tuple) -> str:
    key, prefix, extend = entry
    return f"{describe_key(key)} with prefix {prefix} and extend {extend} tokens"


__all__ = [
    "ADMIT_SLOTS",
    "LAYOUT",
    "POLICIES",
    "VOTES_PROTOCOL",
    "VOTE_SLOTS",
    "AdmissionMismatch",
    "Ballot",
    "Deferred",
    "PrefetchVoteError",
    "PrefetchVoteMismatch",
    "Reach",
    "Verdicts",
    "VoteBook",
    "pairs",
    "seq_digest",
]
