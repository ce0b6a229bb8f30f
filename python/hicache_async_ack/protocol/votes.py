"""Engine-agnostic (no SGLang/torch): one scheduling pass's storage-prefetch decisions
as a section of a reduce another sync carries (:class:`VoteBook`; docs/design.md).

Rule: every decision stock makes at pass p from agreed state, the plugin makes at pass
p + depth + 1 from that state. Per interval the book keeps the walk's reaches in order
with this rank's vote (:meth:`~VoteBook.poll`, never a collective) and the admissions;
:meth:`~VoteBook.close` makes one ``LAYOUT``-value section: ``[v, -v]`` pairs of
ongoing ops, stamp, reaches, walk digest, admissions (ADMIT_SLOTS hashes and a digest),
then one ``[v, h, -h]`` slot per reach (v: 0 none, 2 expired here, 3 not; MIN == 2 is
stock's MAX: stop; h differing: the walks diverged). :meth:`~VoteBook.read` returns the
verdicts in walk order or raises on every rank; reaches past VOTE_SLOTS are voted in
overflow exchanges there (best_effort walks that agree by count and digest need none).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, NoReturn, Optional, Sequence, TypeVar

from .errors import BatchMismatch, PeerMismatch, ProtocolError
from .stamp import STOCK_LIMIT, Stamp, describe_mismatch, pack_stamp, stamps_differ

# The stamp's protocol field for vote sections and the votes' own first exchange (far
# from the ack sync's versions). 12: reaches in walk order, walk digest, overflow exchanges;
# 14: held prefetch starts, the read-once setting in the first exchange.
VOTES_PROTOCOL = 14
OVERFLOW_PROTOCOL = 13  # the stamp of an overflow exchange
VOTE_SLOTS = 256  # reaches per section, and per overflow exchange
ADMIT_SLOTS = 16  # admitted requests compared one by one (the rest by one digest)
HEADER = 8  # [n, -n, x, -x, r, -r, w, -w]
ADMIT = 2 + 2 * ADMIT_SLOTS + 2  # [a, -a], [h, -h] per position, [d, -d]
SLOT = 3  # [v, h, -h]
LAYOUT = HEADER + ADMIT + SLOT * VOTE_SLOTS  # values per section
OVERFLOW_LAYOUT = 4 + SLOT * VOTE_SLOTS  # [x, -x, c, -c] and the slots
NOT_REACHED, REACHED_EXPIRED, REACHED = 0, 2, 3  # a slot's v; MIN == 2: stop
# SGLang's --hicache-storage-prefetch-policy values (names.py re-exports them).
TIMEOUT, BEST_EFFORT, WAIT_COMPLETE = "timeout", "best_effort", "wait_complete"
POLICIES = {TIMEOUT: 1, BEST_EFFORT: 2, WAIT_COMPLETE: 3}
SKEW_ISSUE = "SGLang #30760"

Exchange = Callable[[list[int]], Sequence[int]]  # a blocking MIN over the carrier's group
K = TypeVar("K")


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
    """The walk reached ``op`` (its request's ``key``); ``expired``: this rank's vote."""

    key: Hashable
    op: object
    expired: bool


@dataclass(frozen=True)
class Ballot:
    """What one rank put in a section (handed back with the reduce); ``pass_no``: the
    interval's boundary (same on every rank); ``label``: the pass, for messages."""

    pass_no: int
    label: str
    reaches: tuple[Reach, ...]
    n: int
    x: int
    policy: str
    admitted: tuple[tuple[Hashable, int, int], ...]


Verdicts = list[tuple[Reach, bool]]  # every reach of an interval, in walk order, and its stop


class VoteBook:
    """One cache's record of the current interval. Per boundary: :meth:`close` (a
    section) or :meth:`discard` (none); :meth:`read` each reduced section, in order."""

    def __init__(self, *, hints: Optional[Mapping[str, str]] = None) -> None:
        self.hints = dict(hints or {})
        self.reaches: list[Reach] = []
        self.admitted: list[tuple[Hashable, int, int]] = []

    # ---------------------------------------------------------------- the walk
    def poll(self, key: Hashable, op: object, expired: bool) -> None:
        """The walk reached ``op`` (request ``key``); ``expired``: this rank's vote."""
        self.reaches.append(Reach(key, op, bool(expired)))

    def admit(self, key: Hashable, prefix_len: int, extend_len: int) -> None:
        self.admitted.append((key, int(prefix_len), int(extend_len)))

    def discard(self) -> int:
        """No section this boundary: drop the interval; returns its reach count."""
        n = len(self.reaches)
        self.reaches, self.admitted = [], []
        return n

    # ------------------------------------------------------------- the section
    def close(self, pass_no: int, n_ongoing: int, policy: str, label: str = ""
              ) -> tuple[list[int], Ballot]:  # fmt: skip
        """The interval as a section, closed at boundary ``pass_no`` (the caller's pass
        count, the same on every rank); a new interval starts."""
        reaches, admitted = tuple(self.reaches), tuple(self.admitted)
        ballot = Ballot(pass_no, label or str(pass_no), reaches, n_ongoing,
                        stamp_of(VOTES_PROTOCOL, policy), policy, admitted)  # fmt: skip
        self.reaches, self.admitted = [], []
        head = [key_hash(a) for a in admitted[:ADMIT_SLOTS]]
        head += [0] * (ADMIT_SLOTS - len(head))
        walk = seq_digest([r.key for r in reaches])
        values = pairs([n_ongoing, ballot.x, len(reaches), walk, len(admitted), *head,
                        seq_digest(admitted)])  # fmt: skip
        return values + slots(reaches[:VOTE_SLOTS]), ballot

    def read(self, ballot: Ballot, reduced: Sequence[int], exchange: Exchange) -> Verdicts:
        """The group's verdict on every reach of ``ballot``'s interval, in walk order,
        or a raise on every rank; ``exchange`` (a blocking MIN) runs the overflow."""
        if len(reduced) != LAYOUT:
            raise ProtocolError(f"reduced {len(reduced)} values, issued {LAYOUT}")
        head = HEADER + ADMIT
        lo = list(reduced[0:head:2])
        hi = [-v for v in reduced[1:head:2]]
        (lo_n, lo_x, lo_r, lo_w, lo_a), (hi_n, hi_x, hi_r, hi_w, hi_a) = lo[:5], hi[:5]
        if stamps_differ(ballot.x, lo_x, hi_x) or lo_n != hi_n:
            self._set_mismatch(ballot, lo_n, hi_n, lo_x, hi_x)
        if lo[5:] != hi[5:] or lo_a != hi_a:
            self._admission_mismatch(ballot, lo_a, hi_a, lo[5:-1], hi[5:-1])
        out = read_slots(ballot, 0, reduced[head:])
        if hi_r <= VOTE_SLOTS:
            return out
        if ballot.policy == BEST_EFFORT and lo_r == hi_r and lo_w == hi_w:
            # every walk reached the same requests: best_effort stops each (no vote)
            return out + [(r, True) for r in ballot.reaches[VOTE_SLOTS:]]
        chunks = -(-(hi_r - VOTE_SLOTS) // VOTE_SLOTS)
        for c in range(1, chunks + 1):
            part = ballot.reaches[c * VOTE_SLOTS : (c + 1) * VOTE_SLOTS]
            x = stamp_of(OVERFLOW_PROTOCOL, ballot.policy)
            got = exchange(pairs([x, c]) + slots(part))
            if len(got) != OVERFLOW_LAYOUT:
                raise ProtocolError(
                    f"overflow exchange reduced {len(got)} values, issued {OVERFLOW_LAYOUT}"
                )
            if stamps_differ(x, got[0], -got[1]) or got[2] != -got[3] or got[2] != c:
                self._set_mismatch(ballot, lo_n, hi_n, got[0], -got[1])
            out += read_slots(ballot, c, got[4:])
        return out

    def _set_mismatch(self, b: Ballot, lo_n: int, hi_n: int, lo_x: int, hi_x: int) -> NoReturn:
        lo, hi = Stamp.unpack(lo_x), Stamp.unpack(hi_x)
        if lo.protocol != hi.protocol or lo.protocol not in (VOTES_PROTOCOL, OVERFLOW_PROTOCOL):
            why = describe_mismatch(Stamp.unpack(b.x), lo, hi, self.hints)
        elif lo.digest != hi.digest:
            why = "the storage prefetch policy differs across the group."
        else:
            why = (
                f"the number of ongoing storage prefetch operations differs across the "
                f"group: this rank {b.n}, group min {lo_n}, max {hi_n} (ranks diverged)."
            )
        raise PeerMismatch(
            f"ranks disagree on the votes of scheduling pass {b.label}: {why} No verdict "
            "was used; stopping.",
            {"pass": b.label, "ongoing": b.n, "group_min": lo_n, "group_max": hi_n},
        )

    def _admission_mismatch(
        self, b: Ballot, lo_a: int, hi_a: int, lo_h: Sequence[int], hi_h: Sequence[int]
    ) -> NoReturn:
        at = next((i for i, (a, c) in enumerate(zip(lo_h, hi_h)) if a != c), None)
        if at is None:  # the first ADMIT_SLOTS agree; only the digest of the rest differs
            first = f"past request #{ADMIT_SLOTS} of the batch (the first {ADMIT_SLOTS} agree)"
        else:
            mine = "nothing"
            if at < len(b.admitted):
                key, prefix, extend = b.admitted[at]
                mine = f"{describe_key(key)} with prefix {prefix} and extend {extend} tokens"
            first = f"request #{at + 1} of the batch, where this rank admitted {mine}"
        raise BatchMismatch(
            "ranks admitted different requests to the batch in "
            f"scheduling pass {b.label}: the first difference is {first} "
            f"(this rank admitted {len(b.admitted)}, the group {lo_a} to "
            f"{hi_a}). The TP ranks would run different batches: their waiting-queue walks "
            f"diverged ({SKEW_ISSUE}: a rank's walk stopped earlier, on its own request "
            "budget, batch_is_full or an add_one_req that another rank accepted, or "
            "matched another prefix). Stopping.",
            {"pass": b.label, "position": at, "admitted": len(b.admitted),
             "group_min": lo_a, "group_max": hi_a},
        )  # fmt: skip


def stamp_of(protocol: int, policy: str) -> int:
    return pack_stamp(protocol, False, 1, POLICIES.get(policy, 0), 0)


def slots(reaches: Sequence[Reach]) -> list[int]:
    """VOTE_SLOTS slots ``[v, h, -h]`` for up to VOTE_SLOTS reaches, the rest none."""
    out = [NOT_REACHED, 0, 0] * VOTE_SLOTS
    for i, r in enumerate(reaches):
        h = key_hash(r.key)
        out[SLOT * i : SLOT * i + SLOT] = [REACHED_EXPIRED if r.expired else REACHED, h, -h]
    return out


def read_slots(b: Ballot, chunk: int, reduced: Sequence[int]) -> Verdicts:
    """The verdicts of chunk ``chunk`` (VOTE_SLOTS reaches each) of ``b``'s walk."""
    out: Verdicts = []
    first = chunk * VOTE_SLOTS
    for i, r in enumerate(b.reaches[first : first + VOTE_SLOTS]):
        v, lo_h, hi_h = reduced[SLOT * i], reduced[SLOT * i + 1], -reduced[SLOT * i + 2]
        if lo_h != 0 and lo_h != hi_h:
            raise PeerMismatch(
                f"the ranks' waiting-queue walks of scheduling pass {b.label} reached "
                f"different requests at position {first + i + 1} (this rank: "
                f"{describe_key(r.key)}): their waiting queues diverged ({SKEW_ISSUE}). No "
                "verdict was used; stopping.",
                {"pass": b.label, "position": first + i + 1, "request": r.key},
            )
        out.append((r, v == REACHED_EXPIRED))
    return out


def shared_tokens(read: Sequence[int], wanted: Sequence[int], page_size: int) -> int:
    """How many leading tokens of ``wanted`` a read of ``read`` from the same anchor
    brings to the host: their common prefix, in whole pages."""
    n = min(len(read), len(wanted))
    common = next((i for i in range(n) if read[i] != wanted[i]), n)
    return common - common % max(1, page_size)


def covering(
    reads: Iterable[tuple[K, Sequence[int]]], wanted: Sequence[int], page_size: int
) -> Optional[tuple[K, int]]:
    """The read (of ``reads``, all from ``wanted``'s anchor, oldest first) that brings the
    most of ``wanted`` to the host, and how much; the oldest among equals; None: none."""
    best: Optional[tuple[K, int]] = None
    for key, tokens in reads:
        n = shared_tokens(tokens, wanted, page_size)
        if n and (best is None or n > best[1]):
            best = (key, n)
    return best


def describe_key(key: Hashable) -> str:
    """A request handle's key ``(rid, attempt)`` as the operator reads it."""
    if isinstance(key, tuple) and len(key) == 2:
        return f"rid={key[0]!r} (attempt {key[1]})"
    return repr(key)


__all__ = ["ADMIT_SLOTS", "LAYOUT", "OVERFLOW_LAYOUT", "POLICIES", "VOTES_PROTOCOL", "VOTE_SLOTS",
    "Ballot", "Exchange", "Reach", "Verdicts", "VoteBook", "covering", "pairs", "seq_digest",
    "shared_tokens"]  # fmt: skip
