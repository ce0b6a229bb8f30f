"""Prometheus metrics for the three syncs, through SGLang's own pipeline.

With ``--enable-metrics`` each scheduler's collectors write into SGLang's
``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` merges them. Ours are registered the way
SGLang's are (``sglang:`` names, multiprocess modes, SGLang's collector classes) with
the cache's metric labels. Without metrics nothing here is imported or created.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional

from .names import ACK_QUEUES, LOGGER_NAME, OFFLOAD_QUEUES, STORAGE_QUEUES, QueueName, queue_label
from .path_info import NAME as PATH_INFO  # noqa: F401 (the "why" series, re-exported)
from .path_info import PATHS, collector_classes, inert_hook, publish, reason_code  # noqa: F401

logger = logging.getLogger(LOGGER_NAME)

# Waiting on the due reduce: ~0 when the reduce is hidden behind the forward.
WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5)
# Issuing the next reduce (count, snapshot, async all_reduce).
ISSUE_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)

# The `queue` label: the controller's attribute names (names.ExtraPool.label for pools).
QUEUES = ACK_QUEUES + STORAGE_QUEUES
FAILURE_REASONS = ("mismatch", "failure")  # the `reason` label of failures_total

# Every series exported (counters with their _total); monitoring/ names no other.
SERIES = (
    "sglang:hicache_ack_sync_pipelined",
    "sglang:hicache_ack_sync_depth",
    "sglang:hicache_ack_sync_group_size",
    "sglang:hicache_ack_sync_wait_seconds",
    "sglang:hicache_ack_sync_issue_seconds",
    "sglang:hicache_ack_sync_popped_entries_total",
    "sglang:hicache_ack_sync_failures_total",
)

# (sync, label names) -> families; a second label set of one sync stays out of the
# default registry (the name is taken; multiprocess files reach /metrics anyway).
_families: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}


# Every family, declared once: sync -> (key, kind, name, help, extra label, buckets).
GAUGE, COUNTER, HISTOGRAM = 1, 0, 2  # the index into collector_classes()
FAMILIES: dict[str, tuple[tuple[str, int, str, str, Optional[str], tuple], ...]] = {
    "ack": (
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
    "votes": (
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
    "offload": (
        ("pipelined", GAUGE, "sglang:hicache_decode_offload_sync_pipelined",
         "1 while PD decode offload progress is pipelined, 0 on SGLang's blocking reduce.",
         None, ()),
        ("wait", HISTOGRAM, "sglang:hicache_decode_offload_sync_wait_seconds",
         "Time a decode step waited on the previous step's offload reduce.", None,
         WAIT_BUCKETS),
        ("popped", COUNTER, "sglang:hicache_decode_offload_sync_popped_entries",
         "Offload acks and storage backups popped on the group's agreement.", "queue", ()),
    ),
}  # fmt: skip


def families(sync: str, labelnames: tuple[str, ...], metrics_collector: Any = None) -> dict:
    """``sync``'s families for this label set, created once, through SGLang's classes."""
    key = (sync, labelnames)
    fam = _families.get(key)
    if fam is not None:
        return fam
    classes = collector_classes(metrics_collector)
    extra: dict[str, Any] = {}
    if any(k == sync for k, _ in _families):
        from prometheus_client import Counter as PromCounter

        if classes[COUNTER] is PromCounter:  # other backends take no registry
            extra = {"registry": None}
    fam = _families[key] = {}
    for name, kind, metric, doc, label, buckets in FAMILIES[sync]:
        kw: dict[str, Any] = dict(extra, labelnames=[*labelnames, *([label] if label else [])])
        if kind == GAUGE:
            kw["multiprocess_mode"] = "mostrecent"
        if kind == HISTOGRAM:
            kw["buckets"] = buckets
        fam[name] = classes[kind](metric, doc, **kw)
    return fam


class SyncSeries:
    """A sync's series under one label set: label-free families as attributes."""

    sync = ""
    pipelined: Any
    wait: Any
    issue: Any

    def __init__(self, labels: Mapping[str, Any], metrics_collector: Any = None):
        self.labels = {k: str(v) for k, v in labels.items()}
        self.families = fam = families(self.sync, tuple(self.labels), metrics_collector)
        self._children: dict[tuple[str, str], Any] = {}  # (family, label value) -> child
        for key, _, _, _, label, _ in FAMILIES[self.sync]:
            if label is None:
                setattr(self, key, fam[key].labels(**self.labels))

    def on_path(self, pipelined: bool) -> None:
        self.pipelined.set(1 if pipelined else 0)

    def on_step(
        self, wait_s: Optional[float], issue_s: float, pops: Mapping[QueueName, int]
    ) -> None:
        """One pipelined step; ``wait_s`` is None when no reduce was due."""
        if wait_s is not None:
            self.wait.observe(wait_s)
        if "issue" in self.families:
            self.issue.observe(issue_s)
        for name, n in pops.items():
            if n:
                self.child("popped", "queue", self.queue_label(name)).inc(n)

    queue_label = staticmethod(queue_label)  # the `queue` label of a controller queue

    def child(self, family: str, label: str, value: str) -> Any:
        """``family``'s child for ``label=value`` under this label set, made once."""
        found = self._children.get((family, value))
        if found is None:
            found = self.families[family].labels(**self.labels, **{label: value})
            self._children[family, value] = found
        return found


class AckSyncMetrics(SyncSeries):
    """One cache's series, each at 0 from init on (``increase()`` over a series that
    appears at 1 reads 0); the pipelined step calls the ``on_*`` methods."""

    sync = "ack"
    depth: Any
    group_size: Any

    def __init__(self, labels: Mapping[str, Any], metrics_collector: Any = None):
        super().__init__(labels, metrics_collector)
        for reason in FAILURE_REASONS:
            self.child("failures", "reason", reason).inc(0)
        self.add_queues(QUEUES)

    def on_path(self, pipelined: bool, depth: int = 0, group_size: Optional[int] = None) -> None:
        self.pipelined.set(1 if pipelined else 0)
        self.depth.set(depth if pipelined else 0)
        if group_size is not None:
            self.group_size.set(group_size if pipelined else 0)

    def on_failure(self, reason: str) -> None:
        self.child("failures", "reason", reason).inc()

    def add_queues(self, names: Iterable[QueueName]) -> None:
        """Create the popped series of these queues at 0 (extra host pools)."""
        for name in names:
            self.child("popped", "queue", queue_label(name)).inc(0)


class PrefetchVoteMetrics(SyncSeries):
    """One cache's prefetch-vote series (created with --enable-metrics)."""

    sync = "votes"
    voted: Any
    fallback: Any
    stopped: Any
    held: Any
    read_once_waits: Any
    read_once_saved: Any

    def on_pass(
        self, wait_s: Optional[float], issue_s: float, voted: int, overflow: int = 0
    ) -> None:
        """``wait_s``: None when none was due; ``overflow``: reaches past the slots."""
        if wait_s is not None:
            self.wait.observe(wait_s)
        self.issue.observe(issue_s)
        if voted:
            self.voted.inc(voted)
        if overflow:
            self.fallback.inc(overflow)

    def on_stop(self, n: int = 1) -> None:
        self.stopped.inc(n)

    def on_hold(self, why: str) -> None:
        """A prefetch start held (vote_starts: ``pass`` or ``read_once``)."""
        (self.read_once_waits if why == "read_once" else self.held).inc()

    def on_read_once(self, saved_tokens: int) -> None:
        """A read-once wait ended; ``saved_tokens`` found on the host instead of L3."""
        if saved_tokens:
            self.read_once_saved.inc(saved_tokens)

    def on_failure(self, reason: str) -> None:
        self.child("failures", "reason", reason).inc()


class OffloadSyncMetrics(SyncSeries):
    """The decode offload sync's series (created when SGLang's metrics are on)."""

    sync = "offload"

    @staticmethod
    def queue_label(name: QueueName) -> str:
        return "offload" if name == OFFLOAD_QUEUES[0] else "backup"


def series_for(key: str, labels: Mapping[str, Any], metrics_collector: Any = None) -> SyncSeries:
    """A sync's series for a label set, by its metrics key (names.Sync.metrics_key)."""
    cls = {c.sync: c for c in (AckSyncMetrics, PrefetchVoteMetrics, OffloadSyncMetrics)}[key]
    return cls(labels, metrics_collector)


__all__ = ["FAILURE_REASONS", "FAMILIES", "PATHS", "PATH_INFO", "QUEUES", "SERIES",
    "AckSyncMetrics", "OffloadSyncMetrics", "PrefetchVoteMetrics", "collector_classes",
    "inert_hook", "publish", "reason_code", "series_for"]  # fmt: skip
