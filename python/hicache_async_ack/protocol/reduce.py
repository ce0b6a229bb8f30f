"""Engine-agnostic core: the pipelined MIN-reduce of HiCache ready counts.

No SGLang or torch import here. The caller hands in, per scheduler step, the
entries that are ready at the head of each queue (acks whose finish_event has
fired, storage control entries) and a collective that MIN-reduces a list of
ints across the ranks; this module keeps the reduces in flight and turns an
agreed count back into "how many to pop now".

Agreement by identity. A reduce agrees on a count c per queue: the first c
entries that were ready on every rank when the reduce was issued. Instead of
trusting the count alone when it is consumed one (or k) steps later, we keep
references to the entries that were ready at issue and pop only those of the
first c that are *still at the head* of the queue. Any other path that removed
entries in between (reset, write-back flush, storage drain, a blocking
loading_check) removed them from the head (the queues are FIFO), so the entries
it took are exactly a prefix of ours and are skipped by construction. All those
paths run symmetrically on every rank, so every rank pops the same entries.

Agreement on the protocol itself. The last two values of every reduce are
``[x, -x]`` (upstream carries its reclaim digest there): MIN gives the group's
min and max of x. Here x is a :class:`Stamp` that packs, most significant
first, the protocol version, the depth mode and depth, the digest and one
per-rank observation. Whatever must be equal on all ranks sits above the
observation, so min and max of x differ there exactly when some rank differs;
the observation's max then rides along for free. A stamp is always >= 2**58,
above any digest upstream's blocking path sends (< 2**42), so a rank running
that path on the same reduce fails upstream's own digest check, and we name it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, NoReturn, Optional, Sequence

from .depth import AutoDepth, observation
from .stamp import (
    DEPTH_LIMIT,
    OBS_MAX,
    PROTOCOL_VERSION,
    Collective,
    Handle,
    HiCacheAckSyncError,
    HiCacheAckSyncMismatch,
    Stamp,
    describe_mismatch,
    fold_digest,
    pack_stamp,
    stamps_differ,
)


class _Pending:
    """A reduce in flight and what it was issued over."""

    __slots__ = ("handle", "names", "ready", "x", "flags", "step", "tail", "token")

    def __init__(self, handle: Handle, names, ready, x: int, flags: int, step, tail: int, token):
        self.handle = handle
        self.names: tuple[Hashable, ...] = names  # queue names, in tensor order
        self.ready: tuple[Sequence[object], ...] = ready  # entries ready at issue, per queue
        self.x = x  # the packed stamp this rank sent
        self.flags = flags  # the layout flags this rank sent
        self.step = step
        self.tail = tail  # values a rider appended after the counts (and flags)
        self.token = token  # the rider's own record of what it sent, handed back


@dataclass(slots=True)
class Consumed:
    """Result of consuming the due reduce(s): what to pop now, per queue name."""

    pops: dict[Hashable, int]
    agreed: dict[Hashable, int]
    issued_step: int
    reduces: int = 1  # more than one when the depth was lowered this step
    obs_max: int = 0  # the group's max observation (of the newest one consumed)
    waited_s: float = 0.0  # auto depth: how long this rank waited on the due reduce(s)
    depth_change: Optional[tuple[int, int]] = None  # (from, to), auto depth only
    # layout flags: the group's agreed flags of the newest reduce consumed (None:
    # this sync sends none); tails: (token, reduced tail) per reduce, oldest first
    flags: Optional[int] = None
    tails: list = field(default_factory=list)
    # per reduce consumed, oldest first: (its own pops, its (token, tail) list);
    # a reduce's pops assume the older ones' are applied first
    parts: list = field(default_factory=list)


def still_queued(agreed: Sequence[object], head: Sequence[object]) -> int:
    """How many of ``agreed`` (the first c entries ready on every rank at issue)
    are still at the head of the queue, whose first entries are ``head``.

    Entries only leave a queue from its head, so what another path removed is a
    prefix of ``agreed`` and what is left is ``agreed[j:]`` == ``head[:c-j]``.
    """
    if not agreed or not head:
        return 0
    first = head[0]
    j = next((i for i, entry in enumerate(agreed) if entry is first), None)
    if j is None:
        return 0  # every agreed entry has already been removed by another path
    n = len(agreed) - j
    for i in range(n):
        if i >= len(head) or head[i] is not agreed[j + i]:
            raise HiCacheAckSyncError(
                "HiCache ack sync: a queue was reordered or lost entries from its "
                "middle between issue and consume; FIFO order is required"
            )
    return n


class PipelinedAckSync:
    """Keeps up to ``depth`` MIN-reduces of ready counts in flight.

    Per step the owner calls :meth:`consume_due` (waits on the reduce issued
    ``depth`` steps ago, if any) then, after popping, :meth:`issue`. Both ranks
    and steps are symmetric: every rank waits on the same reduce in the same
    step, decided by the step count alone, never by ``is_completed()``.

    ``hints`` completes a mismatch error with what the operator should do, per
    stamp field ("depth", "auto", "protocol", "digest", and "stock": a peer that
    ran the blocking path). With ``auto``, the depth follows that rule, starting
    at ``depth``; ``clock`` (seconds) times the waits it observes.

    ``title`` starts its messages and ``errors`` are the (error, mismatch)
    classes it raises: the sync it serves (the ack sync's by default).

    ``flag_names`` (bit -> what it means) makes every reduce carry ``[f, -f]``
    after the stamp: layout flags every rank must share (which sections the
    next reduces carry), checked at consume like the stamp's agreed fields, so a
    layout switches only at a step every rank agrees on. A rider may append a
    ``tail`` of values to a reduce; its reduced tail comes back, with the
    rider's ``token``, in :attr:`Consumed.tails`.
    """

    def __init__(
        self,
        collective: Collective,
        depth: int = 1,
        *,
        auto: Optional[AutoDepth] = None,
        hints: Optional[Mapping[str, str]] = None,
        clock: Callable[[], float] = time.perf_counter,
        flag_names: Optional[Mapping[int, str]] = None,
        title: str = "HiCache ack sync",
        errors: tuple[type, type] = (HiCacheAckSyncError, HiCacheAckSyncMismatch),
    ):
        if not 1 <= depth <= DEPTH_LIMIT:
            raise ValueError(f"depth must be from 1 to {DEPTH_LIMIT}, got {depth}")
        self.collective = collective
        self.depth = depth
        self.auto = auto
        if auto is not None:
            auto.depth = depth
        self.hints = dict(hints or {})
        self.flag_names = None if flag_names is None else dict(flag_names)
        self.title = title
        self.error, self.mismatch = errors
        self._pending: deque[_Pending] = deque()
        self._failed: Optional[BaseException] = None
        self._step = 0
        self._obs = 0  # this rank's observation, sent with the next issue
        self.clock = clock
        # auto depth: when this rank's last consume_due returned, so a step's
        # length is its own work and forward, not the waits it observes
        self._since: Optional[float] = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def failed(self) -> Optional[BaseException]:
        return self._failed

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise self.error(
                f"{self.title} already failed on this rank and will not retry: {self._failed}"
            ) from self._failed

    def issue(
        self,
        ready: Mapping[Hashable, Sequence[object]],
        digest: int,
        flags: int = 0,
        tail: Sequence[int] = (),
        token: object = None,
    ) -> None:
        """Start the MIN-reduce of the ready counts (plus the stamp as ``[x, -x]``,
        with ``flag_names`` the flags as ``[f, -f]``, then ``tail``).

        The core keeps the sequences in ``ready`` until the reduce is consumed:
        hand in fresh ones (slices of the queues), never the queues themselves."""
        if self._failed is not None:
            self._check_usable()
        names = tuple(ready)
        snap = tuple(ready.values())
        x = pack_stamp(PROTOCOL_VERSION, self.auto is not None, self.depth, digest, self._obs)
        values = [len(s) for s in snap]
        values += (x, -x)
        if self.flag_names is not None:
            values += (flags, -flags)
        values += tail
        try:
            handle = self.collective(values)
        except Exception as exc:  # re-raised with context
            self._fail(exc, "issuing")
        self._step += 1
        self._pending.append(_Pending(handle, names, snap, x, flags, self._step, len(tail), token))

    def consume_due(self, head: Callable[[Hashable, int], Sequence[object]]) -> Optional[Consumed]:
        """Consume every reduce that is due (one normally; none while the depth
        grows; two in the step the depth shrinks), else None.

        ``head(name, n)`` returns (up to) the first ``n`` entries currently in
        the queue called ``name``, or () if that queue no longer exists.
        """
        self._check_usable()
        return self._consume(head, self.depth)

    def drain(self, head: Callable[[Hashable, int], Sequence[object]]) -> Optional[Consumed]:
        """Consume every reduce in flight, oldest first (when standing down to
        the blocking path), as one result."""
        self._check_usable()
        return self._consume(head, 1)

    def _consume(self, head, keep_below: int) -> Optional[Consumed]:
        """Consume the oldest reduces while ``keep_below`` or more are in flight.
        Each is reconciled against the queue heads as the previous ones will
        have left them (their pops applied), so one result pops each entry once."""
        pending = self._pending
        if self.auto is None:  # only auto depth needs the observation
            if len(pending) < keep_below:
                return None
            out = Consumed({}, {}, 0, 0)
            while len(pending) >= keep_below:
                self._consume_oldest(head, out)
            return out
        clock = self.clock
        now = clock()
        step_s = now - self._since if self._since is not None else 0.0
        if len(pending) < keep_below:
            self._since = now
            return None
        out = Consumed({}, {}, 0, 0)
        waited = 0.0
        while len(pending) >= keep_below:
            p = pending[0]
            t0 = clock() if not p.handle.is_completed() else None
            self._consume_oldest(head, out)
            if t0 is not None:
                waited += clock() - t0
        next_pending = bool(pending) and not pending[0].handle.is_completed()
        self._obs = observation(waited, next_pending, step_s)
        out.waited_s = waited
        before = self.depth
        self.depth = self.auto.update(out.obs_max, out.issued_step, self._step)
        if self.depth != before:
            out.depth_change = (before, self.depth)
        self._since = clock()
        return out

    @property
    def _flag_slots(self) -> int:
        return 0 if self.flag_names is None else 2

    def _wait(self, p: _Pending) -> Sequence[int]:
        try:
            reduced = p.handle.wait()
        except Exception as exc:  # re-raised with context
            self._fail(exc, f"waiting on this cache's reduce #{p.step}")
        issued = len(p.names) + 2 + self._flag_slots + p.tail
        if len(reduced) != issued:
            self._fail(
                ValueError(f"reduced {len(reduced)} values, issued {issued}"),
                "reading the reduced counts",
            )
        return reduced

    def first_exchange(
        self,
        slots: int,
        digest: int,
        reduce: Optional[Callable[[list[int]], Sequence[int]]] = None,
        flags: int = 0,
    ) -> int:
        """The first exchange, before anything the blocking path would not do:
        ``slots`` counts then ``[x, -x]`` with this rank's stamp, MIN-reduced and
        checked at once. ``reduce`` is a blocking MIN-reduce in the blocking
        path's own shape, over its own groups (so a peer running that path pairs
        with it collective for collective, whatever the topology); by default,
        one reduce of our collective, waited on at once. Raises
        :class:`HiCacheAckSyncMismatch` on every rank of a group that disagrees,
        in this step, before any other collective runs. With ``flag_names``, the
        first two count slots carry ``[f, -f]`` (``slots`` >= 2: upstream's two
        ack counts), checked once the stamps agree (a peer on the blocking path
        sends counts there); the others are zero, as the pipelined path pops
        nothing in its first step anyway. Returns the group's flags."""
        self._check_usable()
        x = pack_stamp(PROTOCOL_VERSION, self.auto is not None, self.depth, digest, 0)
        values = [0] * slots + [x, -x]
        if self.flag_names is not None:
            values[:2] = (flags, -flags)
        try:
            reduced = reduce(values) if reduce is not None else self.collective(values).wait()
        except Exception as exc:  # re-raised with context
            self._fail(exc, "the first exchange")
        if len(reduced) != len(values):
            self._fail(
                ValueError(f"reduced {len(reduced)} values, issued {len(values)}"),
                "reading the first exchange",
            )
        lo_x, hi_x = reduced[-2], -reduced[-1]
        if stamps_differ(x, lo_x, hi_x):
            self._mismatch("this cache's first exchange", x, lo_x, hi_x)
        if self.flag_names is None:
            return 0
        return self._agreed_flags("this cache's first exchange", flags, reduced[0], -reduced[1])

    def _agreed_flags(self, what: str, mine: int, lo: int, hi: int) -> int:
        """The group's flags, or stop naming the flags that differ: the min and
        max are two ranks' own flags, so every bit they differ in differs."""
        if lo == hi:
            return lo
        differ = [b for b in sorted(self.flag_names or {}) if (lo ^ hi) >> b & 1]
        names = "; ".join(
            f"{(self.flag_names or {})[b]}: this rank {mine >> b & 1}" for b in differ
        )
        err = self.mismatch(
            f"{self.title}: ranks disagree on {what}: the layout flags differ across "
            f"the group (group min {lo:#x}, max {hi:#x}): {names or 'unknown bits'}. Give "
            "every node of the TP group the same settings and storage backend. Nothing "
            "was popped; stopping."
        )
        self._pending.clear()
        self._failed = err
        raise err

    def _mismatch(self, what: str, x: int, lo_x: int, hi_x: int) -> NoReturn:
        mine, lo, hi = Stamp.unpack(x), Stamp.unpack(lo_x), Stamp.unpack(hi_x)
        why = describe_mismatch(mine, lo, hi, self.hints)
        err = self.mismatch(
            f"{self.title}: ranks disagree on {what}: {why} Nothing was popped; stopping."
        )
        self._pending.clear()
        self._failed = err
        raise err

    def _consume_oldest(self, head, out: Consumed) -> None:
        """Wait on the oldest reduce, check every rank agrees, and add what it
        lets pop to ``out`` (after what older reduces in ``out`` pop)."""
        p = self._pending.popleft()
        reduced = self._wait(p)
        at = len(p.names)  # [x, -x] right after the counts
        lo_x, hi_x = reduced[at], -reduced[at + 1]
        if stamps_differ(p.x, lo_x, hi_x):
            self._mismatch(f"this cache's reduce #{p.step}", p.x, lo_x, hi_x)
        if self.flag_names is not None:
            lo_f, hi_f = reduced[at + 2], -reduced[at + 3]
            out.flags = self._agreed_flags(f"this cache's reduce #{p.step}", p.flags, lo_f, hi_f)
        tails = [(p.token, list(reduced[len(reduced) - p.tail :]))] if p.tail else []
        out.tails += tails
        pops, agreed = out.pops, out.agreed
        before = dict(pops)
        for name, snap, count in zip(p.names, p.ready, reduced):
            if count:
                if not 0 <= count <= len(snap):
                    self._fail(
                        ValueError(f"agreed {count} for {name!r}, {len(snap)} were ready"),
                        "checking the reduced counts",
                    )
                taken = pops.get(name, 0)  # popped by an older reduce consumed this step
                left = head(name, taken + count)[taken:]
                pops[name] = taken + still_queued(snap[:count], left)
                agreed[name] = agreed.get(name, 0) + count
            else:
                pops.setdefault(name, 0)
                agreed.setdefault(name, 0)
        out.parts.append(({n: pops[n] - before.get(n, 0) for n in pops}, tails))
        out.issued_step = p.step
        out.reduces += 1
        out.obs_max = hi_x & OBS_MAX

    def _fail(self, exc: BaseException, doing: str) -> NoReturn:
        self._pending.clear()
        self._failed = exc
        raise self.error(
            f"{self.title} failed while {doing}: {exc}. A peer rank may have "
            "died or the collective timed out; not retrying."
        ) from exc


__all__ = [
    "PROTOCOL_VERSION",
    "Consumed",
    "HiCacheAckSyncError",
    "HiCacheAckSyncMismatch",
    "PipelinedAckSync",
    "Stamp",
    "fold_digest",
    "still_queued",
]
