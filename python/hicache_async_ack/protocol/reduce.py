"""Engine-agnostic core: the pipelined MIN-reduce of HiCache ready counts (no SGLang/torch).

Per step the caller hands in the entries ready at the head of each queue and a collective
that MIN-reduces a list of ints; this module keeps the reduces in flight and turns an
agreed count back into "how many to pop now". Agreement is by identity: we keep the
entries ready at issue and pop only those of the first c still at the head (any other
path pops a FIFO prefix, on every rank alike). The last two values of every reduce are
``[x, -x]`` with x a :class:`Stamp` (>= 2**58, above upstream's digest), so MIN gives
the group's min and max of x and any disagreement is named (docs/design.md).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, NoReturn, Optional, Sequence

from .depth import AutoDepth, observation
from .errors import PeerMismatch, ProtocolError
from .stamp import (
    DEPTH_LIMIT,
    OBS_MAX,
    PROTOCOL_VERSION,
    Collective,
    Handle,
    Stamp,
    describe_mismatch,
    pack_stamp,
    stamps_differ,
)

# (queue name, n) -> (up to) the first n entries now in that queue, () if it is gone
Head = Callable[[Hashable, int], Sequence[object]]


@dataclass(slots=True, eq=False)
class _Pending:
    """A reduce in flight: queue names (tensor order), entries ready at issue, the stamp
    and flags this rank sent, its step, the rider tail's length and the rider's token."""

    handle: Handle
    names: tuple[Hashable, ...]
    ready: tuple[Sequence[object], ...]
    x: int
    flags: int
    step: int
    tail: int
    token: object


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
    flags: Optional[int] = None  # the newest reduce's agreed flags (None: sends none)
    # per reduce, oldest first: (its own pops, after the older ones'; its tails)
    parts: list[tuple[dict[Hashable, int], list[tuple[object, list[int]]]]] = field(
        default_factory=list
    )


def still_queued(agreed: Sequence[object], head: Sequence[object]) -> int:
    """How many of ``agreed`` (ready on every rank at issue) are still at the head of
    the queue: others pop only from the head, so what is left is ``agreed[j:]``."""
    if not agreed or not head:
        return 0
    first = head[0]
    j = next((i for i, entry in enumerate(agreed) if entry is first), None)
    if j is None:
        return 0  # every agreed entry has already been removed by another path
    n = len(agreed) - j
    for i in range(n):
        if i >= len(head) or head[i] is not agreed[j + i]:
            raise ProtocolError(
                "a queue was reordered or lost entries from its middle between the "
                "reduce's issue and its consume; FIFO order is required",
                {"agreed": len(agreed), "still_queued_from": j, "mismatch_at": i},
            )
    return n


class PipelinedReduce:
    """Keeps up to ``depth`` MIN-reduces of queue counts in flight, for any sync that
    pops a FIFO prefix its group agreed on (the ack counts, the decode offload).

    Per step: :meth:`consume_due` (the reduce issued ``depth`` steps ago; by step count
    alone, never ``is_completed()``), then, after popping, :meth:`issue`. ``hints``: what
    to do per stamp field that differs ("stock": a peer on the blocking path); ``auto``:
    the depth rule, ``clock`` times its waits. ``flag_names`` (bit -> meaning) adds
    ``[f, -f]`` layout flags after the stamp, checked like it; a rider's ``tail`` comes
    back reduced, with its ``token``, in ``Consumed.parts``. Raises :class:`ProtocolError`
    and :class:`PeerMismatch` (the sync's state titles them).
    """

    still_queued = staticmethod(still_queued)  # a negative control's override point

    def __init__(
        self,
        collective: Collective,
        depth: int = 1,
        *,
        auto: Optional[AutoDepth] = None,
        hints: Optional[Mapping[str, str]] = None,
        clock: Callable[[], float] = time.perf_counter,
        flag_names: Optional[Mapping[int, str]] = None,
    ) -> None:
        if not 1 <= depth <= DEPTH_LIMIT:
            raise ValueError(f"depth must be from 1 to {DEPTH_LIMIT}, got {depth}")
        self.collective = collective
        self.depth = depth
        self.auto = auto
        if auto is not None:
            auto.depth = depth
        self.hints = dict(hints or {})
        self.flag_names = None if flag_names is None else dict(flag_names)
        self.protocol = PROTOCOL_VERSION  # what this build speaks (a test may play another)
        self._pending: deque[_Pending] = deque()
        self._failed: Optional[BaseException] = None
        self._step = 0
        self._obs = 0  # this rank's observation, sent with the next issue
        self.clock = clock
        self._since: Optional[float] = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def failed(self) -> Optional[BaseException]:
        return self._failed

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise ProtocolError(
                f"already failed on this rank and will not retry: {self._failed}",
                {"failed": repr(self._failed)},
            ) from self._failed

    def issue(
        self,
        ready: Mapping[Hashable, Sequence[object]],
        digest: int,
        flags: int = 0,
        tail: Sequence[int] = (),
        token: object = None,
    ) -> None:
        """Start the MIN-reduce of the counts, ``[x, -x]``, ``[f, -f]`` (flags), ``tail``.
        ``ready`` is kept until consumed: hand in fresh slices, never the queues."""
        self._check_usable()
        names = tuple(ready)
        snap = tuple(ready.values())
        x = pack_stamp(self.protocol, self.auto is not None, self.depth, digest, self._obs)
        values = [len(s) for s in snap] + [x, -x]
        values += (flags, -flags) if self.flag_names is not None else ()
        values += tail
        try:
            handle = self.collective(values)
        except Exception as exc:  # re-raised with context
            self._fail(exc, "issuing")
        self._step += 1
        self._pending.append(_Pending(handle, names, snap, x, flags, self._step, len(tail), token))

    def consume_due(self, head: Head) -> Optional[Consumed]:
        """Consume every due reduce (none while the depth grows, two when it shrinks),
        else None. ``head(name, n)``: up to the first ``n`` entries of queue ``name``."""
        self._check_usable()
        return self._consume(head, self.depth)

    def drain(self, head: Head) -> Optional[Consumed]:
        """Consume every reduce in flight, oldest first, as one result (standing down)."""
        self._check_usable()
        return self._consume(head, 1)

    def _consume(self, head: Head, keep_below: int) -> Optional[Consumed]:
        """Consume the oldest reduces while ``keep_below`` or more are in flight, each
        against the heads the older ones' pops leave, so each entry pops once."""
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

    def _wait(self, p: _Pending) -> Sequence[int]:
        try:
            reduced = p.handle.wait()
        except Exception as exc:  # re-raised with context
            self._fail(exc, f"waiting on this cache's reduce #{p.step}")
        issued = len(p.names) + 2 + (self.flag_names is not None) * 2 + p.tail
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
        reduce: Callable[[list[int]], Sequence[int]],
        flags: int = 0,
    ) -> int:
        """The first exchange, in the blocking path's shape and groups (``reduce``, so a
        stock peer pairs with it): ``slots`` counts (with ``flag_names`` the first two
        carry ``[f, -f]``, the rest 0), then ``[x, -x]``; checked at once, raising the
        mismatch on every rank before any other collective. Returns the group's flags."""
        self._check_usable()
        x = pack_stamp(self.protocol, self.auto is not None, self.depth, digest, 0)
        values = [0] * slots + [x, -x]
        if self.flag_names is not None:
            values[:2] = (flags, -flags)
        try:
            reduced = reduce(values)
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
        """The group's flags, or stop naming the bits min and max differ in."""
        if lo == hi:
            return lo
        bits = self.flag_names or {}
        names = "; ".join(
            f"{bits[b]}: this rank {mine >> b & 1}" for b in sorted(bits) if (lo ^ hi) >> b & 1
        )
        self._stop(
            what,
            f"the layout flags differ across the group (group min {lo:#x}, max {hi:#x}): "
            f"{names or 'unknown bits'}. Give every node of the TP group the same settings "
            "and storage backend. Nothing was popped; stopping.",
            {"flags": mine, "group_min": lo, "group_max": hi},
        )

    def _mismatch(self, what: str, x: int, lo_x: int, hi_x: int) -> NoReturn:
        mine, lo, hi = Stamp.unpack(x), Stamp.unpack(lo_x), Stamp.unpack(hi_x)
        why = describe_mismatch(mine, lo, hi, self.hints)
        seen = {"stamp": mine, "group_min": lo, "group_max": hi}
        self._stop(what, f"{why} Nothing was popped; stopping.", seen)

    def _stop(self, what: str, why: str, seen: Mapping[str, object]) -> NoReturn:
        self._pending.clear()
        self._failed = err = PeerMismatch(f"ranks disagree on {what}: {why}", seen)
        raise err

    def _consume_oldest(self, head: Head, out: Consumed) -> None:
        """Wait on the oldest reduce, check the agreement, add its pops to ``out``."""
        p = self._pending.popleft()
        reduced = self._wait(p)
        at = len(p.names)  # [x, -x] right after the counts
        lo_x, hi_x = reduced[at], -reduced[at + 1]
        if stamps_differ(p.x, lo_x, hi_x):
            self._mismatch(f"this cache's reduce #{p.step}", p.x, lo_x, hi_x)
        if self.flag_names is not None:
            lo_f, hi_f = reduced[at + 2], -reduced[at + 3]
            agreed_now = lo_f == hi_f  # the message is formatted only where they differ
            out.flags = lo_f if agreed_now else self._agreed_flags(
                f"this cache's reduce #{p.step}", p.flags, lo_f, hi_f)  # fmt: skip
        tails = [(p.token, list(reduced[len(reduced) - p.tail :]))] if p.tail else []
        pops, agreed = out.pops, out.agreed
        before = dict(pops) if pops else None  # None: the step's first reduce (most steps)
        for name, snap, count in zip(p.names, p.ready, reduced):
            if count:
                if not 0 <= count <= len(snap):
                    self._fail(
                        ValueError(f"agreed {count} for {name!r}, {len(snap)} were ready"),
                        "checking the reduced counts",
                    )
                taken = pops.get(name, 0)  # popped by an older reduce consumed this step
                left = head(name, taken + count)[taken:]
                pops[name] = taken + self.still_queued(snap[:count], left)
                agreed[name] = agreed.get(name, 0) + count
            else:
                pops.setdefault(name, 0)
                agreed.setdefault(name, 0)
        mine = dict(pops) if before is None else {n: pops[n] - before.get(n, 0) for n in pops}
        out.parts.append((mine, tails))
        out.issued_step = p.step
        out.reduces += 1
        out.obs_max = hi_x & OBS_MAX

    def _fail(self, exc: BaseException, doing: str) -> NoReturn:
        self._pending.clear()
        self._failed = exc
        raise ProtocolError(
            f"failed while {doing}: {exc}. A peer rank may have died or the collective "
            "timed out; not retrying.",
            {"doing": doing, "error": repr(exc)},
        ) from exc


__all__ = ["Consumed", "Head", "PipelinedReduce", "still_queued"]
