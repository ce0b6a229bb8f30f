"""Prometheus metrics for the syncs, through SGLang's own pipeline.

With ``--enable-metrics`` each scheduler's collectors write into SGLang's
``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` merges them. Ours are registered the way
SGLang's are (``sglang:`` names, multiprocess modes, SGLang's collector classes) with
the cache's metric labels. Without metrics nothing here is imported or created.

Each sync's series are one :class:`SyncSeries` subclass: its row (``sync``), its families
(``declared``); the ``sync`` key of :data:`FAMILIES` and :func:`series_for` come from the
row, so no sync is named here by hand.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Hashable, Iterable, Mapping, NamedTuple, Optional, Protocol, cast

from .names import (
    ACK_COUNTS,
    ACK_QUEUES,
    DECODE_OFFLOAD,
    LOGGER_NAME,
    OFFLOAD_QUEUES,
    PREFETCH_VOTES,
    STORAGE_QUEUES,
    QueueName,
    Sync,
    queue_label,
)
from .path_info import NAME as PATH_INFO  # noqa: F401 (the "why" series, re-exported)
from .path_info import (  # noqa: F401
    PATHS,
    Labelled,
    collector_classes,
    inert_hook,
    publish,
    reason_code,  # noqa: F401
)

logger = logging.getLogger(LOGGER_NAME)

# Waiting on the due reduce: ~0 when the reduce is hidden behind the forward.
WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5)
# Issuing the next reduce (count, snapshot, async all_reduce).
ISSUE_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)

# The `queue` label: the controller's attribute names (names.ExtraPool.label for pools).
QUEUES = ACK_QUEUES + STORAGE_QUEUES
FAILURE_REASONS = ("mismatch", "failure")  # the `reason` label of failures_total
GAUGE, COUNTER, HISTOGRAM = 1, 0, 2  # the index into collector_classes()


class Family(NamedTuple):
    """One family: the attribute it is reached by, its kind, name, help, extra label."""

    key: str
    kind: int
    name: str
    doc: str
    label: Optional[str] = None
    buckets: tuple[float, ...] = ()


# Every family, declared once, by the row's name: (key, kind, name, help, extra label,
# buckets); a SyncSeries subclass reads its own (``declared``).
FAMILIES: dict[str, tuple[Family, ...]] = {
    name: tuple(Family(*f) for f in families)
    for name, families in {
    ACK_COUNTS.name: (
        ("pipelined", GAUGE, "sglang:hicache_ack_sync_pipelined",
         "1 while this rank pipelines the HiCache ack-count all_reduce, 0 on the "
         "blocking path. Every rank of a group must show the same value.", None, ()),
        ("depth", GAUGE, "sglang:hicache_ack_sync_depth",
         "Reduces in flight: acks are popped this many steps late (0 on the "
         "blocking path). Identical on every rank of a group.", None, ()),
        ("group_size", GAUGE, "sglang:hicache_ack_sync_group_size",
         "Ranks in the group this rank's pipelined reduce spans (0 on the blocking "
         "path): a group that exports fewer pipelined series than this has ranks "
         "without the plugin's metrics.", None, ()),
        ("wait", HISTOGRAM, "sglang:hicache_ack_sync_wait_seconds",
         "Time a scheduler step waited on the due ack-count reduce, observed "
         "for steps that had one due (about 0 while the reduce is hidden behind "
         "the forward). rate(_sum) is the share of wall time spent waiting.", None,
         WAIT_BUCKETS),
        ("issue", HISTOGRAM, "sglang:hicache_ack_sync_issue_seconds",
         "Time a pipelined scheduler step spent counting ready entries and "
         "issuing the next ack-count reduce.", None, ISSUE_BUCKETS),
        ("popped", COUNTER, "sglang:hicache_ack_sync_popped_entries",
         "Acks and storage control entries popped on the group's agreement, per "
         "queue. Every TP rank reports the same logical count under its own rank "
         "labels; read one rank rather than summing ranks.", "queue", ()),
        ("failures", COUNTER, "sglang:hicache_ack_sync_failures",
         "Ack-count sync errors, by reason: ranks that disagree (mismatch) or "
         "a failed collective (failure). The scheduler stops after one.", "reason", ()),
    ),
    PREFETCH_VOTES.name: (
        ("pipelined", GAUGE, "sglang:hicache_prefetch_votes_pipelined",
         "1 while this rank decides storage prefetch deadlines with the votes riding "
         "one reduce per pass, 0 on SGLang's per-request blocking reduce.", None, ()),
        ("wait", HISTOGRAM, "sglang:hicache_prefetch_votes_wait_seconds",
         "Kept at 0: the votes ride the ack counts' reduce, whose wait is "
         "sglang:hicache_ack_sync_wait_seconds.", None, WAIT_BUCKETS),
        ("issue", HISTOGRAM, "sglang:hicache_prefetch_votes_issue_seconds",
         "Time a scheduling pass spent closing its walk into the votes' section.",
         None, ISSUE_BUCKETS),
        ("voted", COUNTER, "sglang:hicache_prefetch_votes_operations",
         "Storage prefetch reaches voted on: one per request the waiting-queue walk "
         "reached.", None, ()),
        ("fallback", COUNTER, "sglang:hicache_prefetch_votes_fallback_reaches",
         "Reaches past a section's 256 slots in one walk: voted in overflow exchanges "
         "where the section is read back (one blocking reduce per 256 of them).",
         None, ()),
        ("stopped", COUNTER, "sglang:hicache_prefetch_votes_stopped",
         "Storage prefetch operations stopped on the group's verdict (deadline, or "
         "best_effort's reach).", None, ()),
        ("failures", COUNTER, "sglang:hicache_prefetch_votes_failures",
         "Prefetch vote errors: ranks that disagree (mismatch) or a failed collective.",
         "reason", ()),
        ("held", COUNTER, "sglang:hicache_prefetch_votes_held_starts",
         "Storage prefetch starts held until the decisions stock had made when their "
         "request arrived had landed here: a read in flight from their anchor covered "
         "part of their remainder.", None, ()),
        ("read_once_waits", COUNTER, "sglang:hicache_prefetch_read_once_waits",
         "Requests that waited for a read in flight from their anchor to land instead of "
         "reading it again from L3 (SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_READ_ONCE=1).",
         None, ()),
        ("read_once_saved", COUNTER, "sglang:hicache_prefetch_read_once_saved_tokens",
         "Tokens those requests then found on the host instead of reading them from L3.",
         None, ()),
    ),
    DECODE_OFFLOAD.name: (
        ("pipelined", GAUGE, "sglang:hicache_decode_offload_sync_pipelined",
         "1 while PD decode offload progress is pipelined, 0 on SGLang's blocking reduce.",
         None, ()),
        ("wait", HISTOGRAM, "sglang:hicache_decode_offload_sync_wait_seconds",
         "Time a decode step waited on the previous step's offload reduce.", None,
         WAIT_BUCKETS),
        ("popped", COUNTER, "sglang:hicache_decode_offload_sync_popped_entries",
         "Offload acks and storage backups popped on the group's agreement.", "queue", ()),
        ("failures", COUNTER, "sglang:hicache_decode_offload_sync_failures",
         "Decode offload sync errors, by reason: ranks that disagree (mismatch) or a "
         "failed collective (failure). The scheduler stops after one.", "reason", ()),
    ),
    }.items()
}  # fmt: skip


class Gauge(Protocol):
    def set(self, value: float) -> None: ...


class Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


# (sync, label names) -> families; a second label set of one sync stays out of the
# default registry (the name is taken; multiprocess files reach /metrics anyway).
_families: dict[tuple[str, tuple[str, ...]], dict[str, Labelled]] = {}


class SyncSeries:
    """A sync's series under one label set, each at 0 from init on (``increase()`` over
    a series that appears at 1 reads 0); its state calls the ``on_*`` methods."""

    sync: ClassVar[Sync]
    declared: ClassVar[tuple[Family, ...]]
    by_sync: ClassVar[dict[str, type["SyncSeries"]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.declared = FAMILIES[cls.sync.name]
        SyncSeries.by_sync[cls.sync.name] = cls

    def __init__(self, labels: Mapping[str, object], metrics_collector: object = None):
        self.labels = {k: str(v) for k, v in labels.items()}
        self.families = fam = families(type(self), tuple(self.labels), metrics_collector)
        self._children: dict[tuple[str, str], object] = {}  # (family, label value) -> child
        for f in self.declared:
            if f.label is None:
                self._children[f.key, ""] = fam[f.key].labels(**self.labels)
        if "failures" in fam:
            for reason in FAILURE_REASONS:
                self.counter("failures", reason).inc(0)

    def gauge(self, key: str) -> Gauge:
        return cast(Gauge, self._children[key, ""])

    def histogram(self, key: str) -> Histogram:
        return cast(Histogram, self._children[key, ""])

    def counter(self, key: str, value: str = "") -> Counter:
        """``key``'s counter; ``value``: of its extra label, made once."""
        found = self._children.get((key, value))
        if found is None:
            label = next(f.label for f in self.declared if f.key == key)
            found = self.families[key].labels(**self.labels, **{str(label): value})
            self._children[key, value] = found
        return cast(Counter, found)

    def on_path(self, pipelined: bool) -> None:
        self.gauge("pipelined").set(1 if pipelined else 0)

    def on_step(
        self, wait_s: Optional[float], issue_s: float, pops: Mapping[Hashable, int]
    ) -> None:
        """One pipelined step; ``wait_s`` is None when no reduce was due."""
        if wait_s is not None:
            self.histogram("wait").observe(wait_s)
        if "issue" in self.families:
            self.histogram("issue").observe(issue_s)
        for name, n in pops.items():
            if n:
                self.counter("popped", self.queue_label(name)).inc(n)

    def on_failure(self, reason: str) -> None:
        """A sync error on this rank, by ``reason`` (FAILURE_REASONS)."""
        self.counter("failures", reason).inc()

    @staticmethod
    def queue_label(name: Hashable) -> str:
        """The ``queue`` label of a controller queue (names.QueueName)."""
        return queue_label(cast(QueueName, name))


def families(cls: type[SyncSeries], labelnames: tuple[str, ...],
             metrics_collector: object = None) -> dict[str, Labelled]:  # fmt: skip
    """``cls``'s families for this label set, created once, through SGLang's classes."""
    key = (cls.sync.name, labelnames)
    fam = _families.get(key)
    if fam is not None:
        return fam
    classes = collector_classes(metrics_collector)
    extra: dict[str, Any] = {}
    if any(k == key[0] for k, _ in _families):
        from prometheus_client import Counter as PromCounter

        if classes[COUNTER] is cast(object, PromCounter):  # other backends take no registry
            extra = {"registry": None}
    fam = _families[key] = {}
    for f in cls.declared:
        kw: dict[str, Any] = dict(extra, labelnames=[*labelnames, *([f.label] if f.label else [])])
        if f.kind == GAUGE:
            kw["multiprocess_mode"] = "mostrecent"
        if f.kind == HISTOGRAM:
            kw["buckets"] = f.buckets
        fam[f.key] = classes[f.kind](f.name, f.doc, **kw)
    return fam


class AckSyncMetrics(SyncSeries):
    """One cache's ack-count series."""

    sync = ACK_COUNTS

    def __init__(self, labels: Mapping[str, object], metrics_collector: object = None):
        super().__init__(labels, metrics_collector)
        self.add_queues(QUEUES)

    def on_path(self, pipelined: bool, depth: int = 0, group_size: Optional[int] = None) -> None:
        self.gauge("pipelined").set(1 if pipelined else 0)
        self.gauge("depth").set(depth if pipelined else 0)
        if group_size is not None:
            self.gauge("group_size").set(group_size if pipelined else 0)

    def add_queues(self, names: Iterable[QueueName]) -> None:
        """Create the popped series of these queues at 0 (extra host pools)."""
        for name in names:
            self.counter("popped", queue_label(name)).inc(0)


class PrefetchVoteMetrics(SyncSeries):
    """One cache's prefetch-vote series."""

    sync = PREFETCH_VOTES

    def on_pass(
        self, wait_s: Optional[float], issue_s: float, voted: int, overflow: int = 0
    ) -> None:
        """``wait_s``: None when none was due; ``overflow``: reaches past the slots."""
        if wait_s is not None:
            self.histogram("wait").observe(wait_s)
        self.histogram("issue").observe(issue_s)
        if voted:
            self.counter("voted").inc(voted)
        if overflow:
            self.counter("fallback").inc(overflow)

    def on_stop(self, n: int = 1) -> None:
        self.counter("stopped").inc(n)

    def on_hold(self, why: str) -> None:
        """A prefetch start held (vote_starts: ``pass`` or ``read_once``)."""
        self.counter("read_once_waits" if why == "read_once" else "held").inc()

    def on_read_once(self, saved_tokens: int) -> None:
        """A read-once wait ended; ``saved_tokens`` found on the host instead of L3."""
        if saved_tokens:
            self.counter("read_once_saved").inc(saved_tokens)


class OffloadSyncMetrics(SyncSeries):
    """The decode offload sync's series (created when SGLang's metrics are on)."""

    sync = DECODE_OFFLOAD

    @staticmethod
    def queue_label(name: Hashable) -> str:
        return "offload" if name == OFFLOAD_QUEUES[0] else "backup"


def series_for(
    sync: Sync, labels: Mapping[str, object], metrics_collector: object = None
) -> SyncSeries:
    """``sync``'s series for a label set."""
    return SyncSeries.by_sync[sync.name](labels, metrics_collector)


def exported(cls: type[SyncSeries]) -> tuple[str, ...]:
    """The names ``cls``'s families export (counters with their ``_total``)."""
    return tuple(f.name + ("_total" if f.kind == COUNTER else "") for f in cls.declared)


# The ack counts' series, in declaration order (monitoring/ reads these).
SERIES = exported(AckSyncMetrics)

__all__ = ["COUNTER", "FAILURE_REASONS", "FAMILIES", "GAUGE", "HISTOGRAM", "PATHS", "PATH_INFO",
    "QUEUES", "SERIES", "AckSyncMetrics", "Family", "OffloadSyncMetrics", "PrefetchVoteMetrics",
    "SyncSeries", "collector_classes", "exported", "inert_hook", "publish", "reason_code",
    "series_for"]  # fmt: skip
