"""Engine-agnostic core: the pipelined MIN-reduce of HiCache ready counts.

No SGLang import here. The adapter hands in, per scheduler step, the entries that
are ready at the head of each queue (acks whose finish_event has fired, storage
control entries) and a collective that MIN-reduces a list of ints across the
ranks; this module keeps the reduces in flight and turns an agreed count back
into "how many to pop now".

Agreement by identity. A reduce agrees on a count c per queue: the first c
entries that were ready on every rank when the reduce was issued. Instead of
trusting the count alone when it is consumed one (or k) steps later, we keep
references to the entries that were ready at issue and pop only those of the
first c that are *still at the head* of the queue. Any other path that removed
entries in between (reset, write-back flush, storage drain, a blocking
loading_check) removed them from the head (the queues are FIFO), so the entries
it took are exactly a prefix of ours and are skipped by construction. All those
paths run symmetrically on every rank, so every rank pops the same entries.
docs/design.md has the full argument.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, NoReturn, Protocol, Sequence


class HiCacheAckSyncError(RuntimeError):
    """The HiCache ack sync cannot continue on this rank (peer died, timeout,
    divergence). Never retried: a retry would desynchronise the collectives."""


class Handle(Protocol):
    def wait(self) -> Sequence[int]:
        """Block until the MIN-reduce is complete; return the reduced values."""


# values -> Handle. Must be issued by every rank in the same order.
Collective = Callable[[list[int]], Handle]


@dataclass(frozen=True)
class _Pending:
    handle: Handle
    names: tuple[Hashable, ...]  # queue names, in tensor order
    ready: tuple[tuple[object, ...], ...]  # entries ready at issue, per queue
    digest: int
    step: int


@dataclass(frozen=True)
class Consumed:
    """Result of consuming one reduce: what to pop now, per queue name."""

    pops: dict[Hashable, int]
    agreed: dict[Hashable, int]
    issued_step: int


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
    """

    def __init__(self, collective: Collective, depth: int = 1):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.collective = collective
        self.depth = depth
        self._pending: deque[_Pending] = deque()
        self._failed: BaseException | None = None
        self._step = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise HiCacheAckSyncError(
                f"HiCache ack sync already failed on this rank and will not retry: {self._failed}"
            ) from self._failed

    def issue(
        self,
        ready: Mapping[Hashable, Sequence[object]],
        digest: int,
    ) -> None:
        """Start the MIN-reduce of the ready counts (plus ``[digest, -digest]``)."""
        self._check_usable()
        names = tuple(ready)
        snap = tuple(tuple(ready[n]) for n in names)
        values = [len(s) for s in snap] + [digest, -digest]
        try:
            handle = self.collective(values)
        except Exception as exc:  # re-raised with context
            self._fail(exc, "issuing")
        self._step += 1
        self._pending.append(_Pending(handle, names, snap, digest, self._step))

    def consume_due(self, head: Callable[[Hashable, int], Sequence[object]]) -> Consumed | None:
        """Consume the oldest reduce if ``depth`` are in flight, else None.

        ``head(name, n)`` returns (up to) the first ``n`` entries currently in
        the queue called ``name``, or () if that queue no longer exists.
        """
        self._check_usable()
        if len(self._pending) < self.depth:
            return None
        return self._consume_oldest(head)

    def drain(self, head, apply: Callable[[Consumed], None]) -> int:
        """Consume every reduce in flight, oldest first (when standing down to the
        blocking path). Each result is applied (popped) before the next one is
        reconciled, so the next sees the entries the previous one took."""
        n = 0
        while self._pending:
            self._check_usable()
            apply(self._consume_oldest(head))
            n += 1
        return n

    def _consume_oldest(self, head) -> Consumed:
        p = self._pending.popleft()
        try:
            reduced = [int(v) for v in p.handle.wait()]
        except Exception as exc:  # re-raised with context
            self._fail(exc, f"waiting on the reduce issued at step {p.step}")
        if len(reduced) != len(p.names) + 2:
            self._fail(
                ValueError(f"reduced {len(reduced)} values, issued {len(p.names) + 2}"),
                "reading the reduced counts",
            )
        lo, neg_hi = reduced[-2], reduced[-1]
        if not (lo == p.digest == -neg_hi):
            diverged = HiCacheAckSyncError(
                "HiCache ack sync: ranks diverged - the write_back duplicate-reclaim "
                f"digest differs across ranks (this rank {p.digest}, min {lo}, "
                f"max {-neg_hi}) for the reduce issued at step {p.step}"
            )
            self._failed = diverged
            raise diverged
        pops: dict[Hashable, int] = {}
        agreed: dict[Hashable, int] = {}
        for name, snap, count in zip(p.names, p.ready, reduced):
            if not 0 <= count <= len(snap):
                self._fail(
                    ValueError(f"agreed {count} for {name!r}, {len(snap)} were ready"),
                    "checking the reduced counts",
                )
            agreed[name] = count
            pops[name] = still_queued(snap[:count], head(name, count)) if count else 0
        return Consumed(pops=pops, agreed=agreed, issued_step=p.step)

    def _fail(self, exc: BaseException, doing: str) -> NoReturn:
        self._pending.clear()
        self._failed = exc
        raise HiCacheAckSyncError(
            f"HiCache ack sync failed while {doing}: {exc}. A peer rank may have "
            "died or the collective timed out; not retrying."
        ) from exc
