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

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, NoReturn, Optional, Sequence

from .stamp import (
    DEPTH_LIMIT,
    OBS_BITS,
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
)

# ------------------------------------------------------------------ auto depth
WAIT_FLOOR_S = 200e-6  # shorter waits are noise (the collective's own cost), not latency


def observation(waited_s: float, next_pending: bool, step_s: float) -> int:
    """One rank's observation at a consume, for the group's MAX: how long it
    waited on the due reduce, in steps of its own (``step_s``: from the end of
    its previous consume to this one, so the step's work, not its waits)
    rounded up, 0 for a wait under WAIT_FLOOR_S; above one bit:
    whether the reduce after it was still in flight (so one step less depth
    would have waited). Any wait outranks every 'still in flight'."""
    if waited_s < WAIT_FLOOR_S:
        steps = 0
    else:
        steps = max(1, math.ceil(waited_s / step_s)) if step_s > 0 else 1
    return min(OBS_MAX, (steps << 1) | int(next_pending))


@dataclass
class AutoDepth:
    """The depth rule every rank applies to the same agreed observations at the
    same consume, so the depth moves on every rank at once with no extra
    collective. An observation says how many steps some rank waited (rounded
    up) and whether the next reduce was still in flight.

    * Once some rank waited on ``raise_after`` of the last ``depth + 1``
      consumed reduces (a sustained latency: one long reduce is an outlier and
      moves nothing; at depth k a sustained one shows on every k-th consume,
      since the k - 1 reduces issued right after the one waited on are done by
      then), the depth rises by the smallest of those waits in steps: the depth
      that would not have waited on any of them, at once.
    * Lower by one when, on ``lower_after`` consecutive ones, nobody waited and
      every rank found the next reduce already complete.

    After a change, the reduces that still carry an observation made at the old
    depth are ignored, so one latency episode is counted once: the one issued
    in the step of the change, plus, after a raise by W, the W issued in the
    steps whose consume the raise skips (they carry the same observation). So
    W + 1 after a raise, 1 after a lower. ``issued_step`` and ``now_step``
    count reduces issued, the same on every rank."""

    lo: int = 1
    hi: int = 8
    raise_after: int = 2
    lower_after: int = 16
    depth: int = 1
    # the waits (steps, 0: none) of the latest depth + 1 consumes since the last change
    _recent: deque[int] = field(default_factory=deque)
    _clean: int = 0
    _settled_after: int = 0  # reduces issued up to this step predate the last change
    # the latest changes, (step, from, to): for the log and the tests
    changes: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=64))

    def update(self, obs_max: int, issued_step: int, now_step: int) -> int:
        if issued_step <= self._settled_after:
            return self.depth
        waited, next_pending = obs_max >> 1, obs_max & 1
        self._recent.append(waited)
        if len(self._recent) > self.depth + 1:
            self._recent.popleft()
        waits = [w for w in self._recent if w]
        self._clean = self._clean + 1 if not waited and not next_pending else 0
        new = self.depth
        if len(waits) >= self.raise_after:
            new = min(self.hi, self.depth + min(waits))
        elif self._clean >= self.lower_after and self.depth > self.lo:
            new = self.depth - 1
        if new != self.depth:
            self.changes.append((now_step, self.depth, new))
            # the next issue carries this consume's observation; a raise by W
            # skips W consumes, whose issues carry it again
            self._settled_after = now_step + 1 + max(0, new - self.depth)
            self.depth, self._clean = new, 0
            self._recent.clear()
        return self.depth


class _Pending:
    """A reduce in flight and what it was issued over."""

    __slots__ = ("handle", "names", "ready", "x", "step")

    def __init__(self, handle: Handle, names, ready, x: int, step: int):
        self.handle = handle
        self.names: tuple[Hashable, ...] = names  # queue names, in tensor order
        self.ready: tuple[Sequence[object], ...] = ready  # entries ready at issue, per queue
        self.x = x  # the packed stamp this rank sent
        self.step = step


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
    """

    def __init__(
        self,
        collective: Collective,
        depth: int = 1,
        *,
        auto: Optional[AutoDepth] = None,
        hints: Optional[Mapping[str, str]] = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not 1 <= depth <= DEPTH_LIMIT:
            raise ValueError(f"depth must be from 1 to {DEPTH_LIMIT}, got {depth}")
        self.collective = collective
        self.depth = depth
        self.auto = auto
        if auto is not None:
            auto.depth = depth
        self.hints = dict(hints or {})
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
            raise HiCacheAckSyncError(
                f"HiCache ack sync already failed on this rank and will not retry: {self._failed}"
            ) from self._failed

    def stamp(self, digest: int) -> Stamp:
        return Stamp(PROTOCOL_VERSION, self.auto is not None, self.depth, digest, self._obs)

    def issue(self, ready: Mapping[Hashable, Sequence[object]], digest: int) -> None:
        """Start the MIN-reduce of the ready counts (plus the stamp as ``[x, -x]``).

        The core keeps the sequences in ``ready`` until the reduce is consumed:
        hand in fresh ones (slices of the queues), never the queues themselves."""
        if self._failed is not None:
            self._check_usable()
        names = tuple(ready)
        snap = tuple(ready.values())
        x = pack_stamp(PROTOCOL_VERSION, self.auto is not None, self.depth, digest, self._obs)
        values = [len(s) for s in snap]
        values += (x, -x)
        try:
            handle = self.collective(values)
        except Exception as exc:  # re-raised with context
            self._fail(exc, "issuing")
        self._step += 1
        self._pending.append(_Pending(handle, names, snap, x, self._step))

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

    def _wait(self, p: _Pending) -> Sequence[int]:
        try:
            reduced = p.handle.wait()
        except Exception as exc:  # re-raised with context
            self._fail(exc, f"waiting on this cache's reduce #{p.step}")
        if len(reduced) != len(p.names) + 2:
            self._fail(
                ValueError(f"reduced {len(reduced)} values, issued {len(p.names) + 2}"),
                "reading the reduced counts",
            )
        return reduced

    def greet(
        self,
        slots: int,
        digest: int,
        reduce: Optional[Callable[[list[int]], Sequence[int]]] = None,
    ) -> None:
        """The first exchange, before anything the blocking path would not do:
        ``slots`` zero counts then ``[x, -x]`` with this rank's stamp, MIN-reduced
        and checked at once. ``reduce`` is a blocking MIN-reduce in the blocking
        path's own shape, over its own groups (so a peer running that path pairs
        with it collective for collective, whatever the topology); by default,
        one reduce of our collective, waited on at once. Raises
        :class:`HiCacheAckSyncMismatch` on every rank of a group that disagrees,
        in this step, before any other collective runs. The counts are zero: the
        pipelined path pops nothing in its first step anyway."""
        self._check_usable()
        x = pack_stamp(PROTOCOL_VERSION, self.auto is not None, self.depth, digest, 0)
        values = [0] * slots + [x, -x]
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
        if lo_x >> OBS_BITS != x >> OBS_BITS or hi_x >> OBS_BITS != x >> OBS_BITS:
            self._mismatch("this cache's first exchange", x, lo_x, hi_x)

    def _mismatch(self, what: str, x: int, lo_x: int, hi_x: int) -> NoReturn:
        mine, lo, hi = Stamp.unpack(x), Stamp.unpack(lo_x), Stamp.unpack(hi_x)
        why = describe_mismatch(mine, lo, hi, self.hints)
        err = HiCacheAckSyncMismatch(
            f"HiCache ack sync: ranks disagree on {what}: {why} Nothing was popped; stopping."
        )
        self._pending.clear()
        self._failed = err
        raise err

    def _consume_oldest(self, head, out: Consumed) -> None:
        """Wait on the oldest reduce, check every rank agrees, and add what it
        lets pop to ``out`` (after what older reduces in ``out`` pop)."""
        p = self._pending.popleft()
        reduced = self._wait(p)
        lo_x, hi_x = reduced[-2], -reduced[-1]
        # Every agreed field sits above the observation: equal iff equal there.
        agreed_bits = p.x >> OBS_BITS
        if lo_x >> OBS_BITS != agreed_bits or hi_x >> OBS_BITS != agreed_bits:
            self._mismatch(f"this cache's reduce #{p.step}", p.x, lo_x, hi_x)
        pops, agreed = out.pops, out.agreed
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
        out.issued_step = p.step
        out.reduces += 1
        out.obs_max = hi_x & OBS_MAX

    def _fail(self, exc: BaseException, doing: str) -> NoReturn:
        self._pending.clear()
        self._failed = exc
        raise HiCacheAckSyncError(
            f"HiCache ack sync failed while {doing}: {exc}. A peer rank may have "
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
