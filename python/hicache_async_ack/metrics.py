"""Prometheus metrics for the HiCache ack sync, through SGLang's own pipeline.

With ``--enable-metrics`` SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` before the
schedulers start, each scheduler's collectors write into it, and the HTTP
server's ``/metrics`` merges them. We register ours the way SGLang's collectors
do (``sglang:`` names, multiprocess modes, prometheus_client imported only once
the multiproc dir is set, the collector classes SGLang's own cache metrics use)
with the label set of the cache's other metrics (``cache.metrics_collector.labels``:
cache_type, tp_rank, pp_rank, dp_rank and any extra labels). Without metrics
nothing here is imported or created, and the pipelined step pays one ``is None``
test.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Mapping, Optional

from .names import ACK_QUEUES, EXTRA_POOL_QUEUES, LOGGER_NAME, OFFLOAD_QUEUES, STORAGE_QUEUES

logger = logging.getLogger(LOGGER_NAME)

# Waiting on the due reduce: ~0 when the reduce is hidden behind the forward.
WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5)
# Issuing the next reduce (count, snapshot, async all_reduce).
ISSUE_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)

# The `queue` label: the cache controller's own attribute names (the tensor
# order of upstream's ready-count sync); an extra host pool's release queue is
# EXTRA_QUEUE_LABEL.format(pool=...), after extra_host_mem_release_queues[pool].
QUEUES = ACK_QUEUES + STORAGE_QUEUES
EXTRA_QUEUE_LABEL = EXTRA_POOL_QUEUES + ":{pool}"
FAILURE_REASONS = ("mismatch", "failure")  # the `reason` label of failures_total

# Every series this module exports (names as in the exposition, counters with
# their _total); monitoring/ names no other.
SERIES = (
    "sglang:hicache_ack_sync_pipelined",
    "sglang:hicache_ack_sync_depth",
    "sglang:hicache_ack_sync_group_size",
    "sglang:hicache_ack_sync_wait_seconds",
    "sglang:hicache_ack_sync_issue_seconds",
    "sglang:hicache_ack_sync_popped_entries_total",
    "sglang:hicache_ack_sync_failures_total",
)

# (sync, label names) -> families; a second label set of one sync's families (a
# second cache type with extra labels) stays out of the default registry: the
# name is taken there, and in multiprocess mode the values reach /metrics
# through the files anyway.
_families: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}


def collector_classes(metrics_collector: Any = None) -> tuple[Any, Any, Any]:
    """(Counter, Gauge, Histogram): the classes SGLang's own cache metrics use,
    so deployments that plug in other collectors (RayEngine's Ray-backed ones,
    via ServerArgs.stat_loggers) get ours through them too. SGLang's collectors
    carry them as ``_counter_cls`` / ``_gauge_cls`` / ``_histogram_cls`` (None:
    prometheus_client's); the cache's collector has no gauge, so the gauge
    comes from the scheduler role's collector class. prometheus_client's where
    this SGLang has none of that."""
    from prometheus_client import Counter, Gauge, Histogram

    cache_cls = type(metrics_collector) if metrics_collector is not None else None
    counter = getattr(cache_cls, "_counter_cls", None)
    histogram = getattr(cache_cls, "_histogram_cls", None)
    gauge = getattr(cache_cls, "_gauge_cls", None)
    if gauge is None or cache_cls is None:  # no collector at all: the scheduler role's
        scheduler_cls = _scheduler_collector_class()
        gauge = gauge or getattr(scheduler_cls, "_gauge_cls", None)
        if cache_cls is None:
            counter = getattr(scheduler_cls, "_counter_cls", None)
            histogram = getattr(scheduler_cls, "_histogram_cls", None)
    return counter or Counter, gauge or Gauge, histogram or Histogram


def _scheduler_collector_class() -> Any:
    try:
        from sglang.srt.observability.metrics_collector import (
            STAT_LOGGER_ROLE_SCHEDULER,
            SchedulerMetricsCollector,
            resolve_collector_class,
        )

        return resolve_collector_class(STAT_LOGGER_ROLE_SCHEDULER, SchedulerMetricsCollector)
    except Exception:  # an SGLang without pluggable collectors
        return None


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
         "HiCache ack sync errors, by reason: ranks that disagree (mismatch) or "
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
    """``sync``'s families for this label set, created once, through the
    collector classes SGLang's own metrics use (the first set registered)."""
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


def metrics_for_labels(labels: Mapping[str, Any], metrics_collector: Any = None):
    """An :class:`AckSyncMetrics`, or None (logged) if they cannot be created:
    metrics never fail HiCache init."""
    try:
        return AckSyncMetrics(labels, metrics_collector)
    except Exception as exc:  # e.g. a collector backend that refuses the names
        logger.warning("HiCache ack sync: metrics not exported for %s: %r", dict(labels), exc)
        return None


class SyncSeries:
    """A sync's series under one label set: each family without a label of its
    own as an attribute (``self.pipelined``, ...), the others as families."""

    sync = ""
    # the label-free children (the families FAMILIES[sync] declares without one)
    pipelined: Any
    wait: Any
    issue: Any

    def __init__(self, labels: Mapping[str, Any], metrics_collector: Any = None):
        self.labels = {k: str(v) for k, v in labels.items()}
        self.families = fam = families(self.sync, tuple(self.labels), metrics_collector)
        for key, _, _, _, label, _ in FAMILIES[self.sync]:
            if label is None:
                setattr(self, key, fam[key].labels(**self.labels))

    def on_path(self, pipelined: bool) -> None:
        self.pipelined.set(1 if pipelined else 0)


class AckSyncMetrics(SyncSeries):
    """One cache's series. Created by the plugin at HiCache init when the cache
    has metrics on; the pipelined step calls the ``on_*`` methods. Every series
    exists from init on, at 0 (``increase()`` over a series that appears at 1
    reads 0, and a failure stops the scheduler before the next scrape)."""

    sync = "ack"
    depth: Any
    group_size: Any

    def __init__(self, labels: Mapping[str, Any], metrics_collector: Any = None):
        super().__init__(labels, metrics_collector)
        fam = self.families
        self._popped = fam["popped"]
        self._failures = {
            reason: fam["failures"].labels(**self.labels, reason=reason)
            for reason in FAILURE_REASONS
        }
        for reason in FAILURE_REASONS:
            self._failures[reason].inc(0)
        self._popped_by_queue: dict[Hashable, Any] = {}
        for name in QUEUES:
            self._popped_child(name).inc(0)

    def on_path(self, pipelined: bool, depth: int = 0, group_size: Optional[int] = None) -> None:
        self.pipelined.set(1 if pipelined else 0)
        self.depth.set(depth if pipelined else 0)
        if group_size is not None:
            self.group_size.set(group_size if pipelined else 0)

    def on_step(
        self, wait_s: Optional[float], issue_s: float, pops: Mapping[Hashable, int]
    ) -> None:
        """One pipelined step; ``wait_s`` is None when no reduce was due (the
        first steps, and those a raise of the depth skips)."""
        if wait_s is not None:
            self.wait.observe(wait_s)
        self.issue.observe(issue_s)
        for name, n in pops.items():
            if n:
                self._popped_child(name).inc(n)

    def on_failure(self, reason: str) -> None:
        child = self._failures.get(reason)
        if child is None:
            child = self._failures[reason] = self._failures_family_child(reason)
        child.inc()

    def _failures_family_child(self, reason: str):
        return self.families["failures"].labels(**self.labels, reason=reason)

    def add_queues(self, names) -> None:
        """Create the popped series of these queues at 0 (extra host pools)."""
        for name in names:
            self._popped_child(name).inc(0)

    def _popped_child(self, name: Hashable):
        child = self._popped_by_queue.get(name)
        if child is None:
            if isinstance(name, tuple):  # ("extra", pool)
                label = EXTRA_QUEUE_LABEL.format(pool=name[1])
            else:
                label = str(name)
            child = self._popped.labels(**self.labels, queue=label)
            self._popped_by_queue[name] = child
        return child


# --------------------------------------------------- prefetch termination votes
class PrefetchVoteMetrics(SyncSeries):
    """One cache's prefetch-vote series (created with --enable-metrics)."""

    sync = "votes"
    voted: Any
    fallback: Any
    stopped: Any

    def on_pass(
        self, wait_s: Optional[float], issue_s: float, voted: int, overflow: int = 0
    ) -> None:
        """``wait_s`` is None when no vote reduce was due (the first pass);
        ``overflow``: the reaches past the section's slots."""
        if wait_s is not None:
            self.wait.observe(wait_s)
        self.issue.observe(issue_s)
        if voted:
            self.voted.inc(voted)
        if overflow:
            self.fallback.inc(overflow)

    def on_stop(self, n: int = 1) -> None:
        self.stopped.inc(n)

    def on_failure(self, reason: str) -> None:
        self.families["failures"].labels(**self.labels, reason=reason).inc()


# ------------------------------------------------------ PD decode offload sync
class OffloadSyncMetrics(SyncSeries):
    """The decode offload sync's series (created when SGLang's metrics are on)."""

    sync = "offload"

    def on_step(self, wait_s: float, pops: Mapping[Hashable, int]) -> None:
        self.wait.observe(wait_s)
        for name, n in pops.items():
            if n:
                queue = "offload" if name == OFFLOAD_QUEUES[0] else "backup"
                self.families["popped"].labels(**self.labels, queue=queue).inc(n)


def never_raising(make, what: str, labels: Mapping[str, Any]):
    """``make()``, or None (logged): metrics never fail HiCache init."""
    try:
        return make()
    except Exception as exc:  # e.g. a collector backend that refuses the names
        logger.warning("%s: metrics not exported for %s: %r", what, dict(labels), exc)
        return None
