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

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")

# Waiting on the due reduce: ~0 when the reduce is hidden behind the forward.
WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5)
# Issuing the next reduce (count, snapshot, async all_reduce).
ISSUE_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)

# The `queue` label: the cache controller's own attribute names (the tensor
# order of upstream's ready-count sync); an extra host pool's release queue is
# EXTRA_QUEUE_LABEL.format(pool=...), after extra_host_mem_release_queues[pool].
QUEUES = (
    "ack_write_queue",
    "ack_load_queue",
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)
EXTRA_QUEUE_LABEL = "extra_host_mem_release_queues:{pool}"
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

# label names -> families; families for another label set (a second cache type
# with extra labels) stay out of the default registry: the name is taken there,
# and in multiprocess mode the values reach /metrics through the files anyway.
_families: dict[tuple[str, ...], dict[str, Any]] = {}


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


def _create_families(labelnames: tuple[str, ...], classes, registered: bool) -> dict[str, Any]:
    Counter, Gauge, Histogram = classes
    names = list(labelnames)
    extra: dict[str, Any] = {}
    if not registered:
        from prometheus_client import Counter as PromCounter

        if Counter is PromCounter:  # other backends take no registry
            extra = {"registry": None}
    return {
        "pipelined": Gauge(
            "sglang:hicache_ack_sync_pipelined",
            "1 while this rank pipelines the HiCache ack-count all_reduce, 0 on the "
            "blocking path. Every rank of a group must show the same value.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            **extra,
        ),
        "depth": Gauge(
            "sglang:hicache_ack_sync_depth",
            "Reduces in flight: acks are popped this many steps late (0 on the "
            "blocking path). Identical on every rank of a group.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            **extra,
        ),
        "group_size": Gauge(
            "sglang:hicache_ack_sync_group_size",
            "Ranks in the group this rank's pipelined reduce spans (0 on the blocking "
            "path): a group that exports fewer pipelined series than this has ranks "
            "without the plugin's metrics.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            **extra,
        ),
        "wait": Histogram(
            "sglang:hicache_ack_sync_wait_seconds",
            "Time a scheduler step waited on the due ack-count reduce, observed "
            "for steps that had one due (about 0 while the reduce is hidden behind "
            "the forward). rate(_sum) is the share of wall time spent waiting.",
            labelnames=names,
            buckets=WAIT_BUCKETS,
            **extra,
        ),
        "issue": Histogram(
            "sglang:hicache_ack_sync_issue_seconds",
            "Time a pipelined scheduler step spent counting ready entries and "
            "issuing the next ack-count reduce.",
            labelnames=names,
            buckets=ISSUE_BUCKETS,
            **extra,
        ),
        "popped": Counter(
            "sglang:hicache_ack_sync_popped_entries",
            "Acks and storage control entries popped on the group's agreement, per "
            "queue. Every TP rank reports the same logical count under its own rank "
            "labels; read one rank rather than summing ranks.",
            labelnames=[*names, "queue"],
            **extra,
        ),
        "failures": Counter(
            "sglang:hicache_ack_sync_failures",
            "HiCache ack sync errors, by reason: ranks that disagree (mismatch) or "
            "a failed collective (failure). The scheduler stops after one.",
            labelnames=[*names, "reason"],
            **extra,
        ),
    }


def metrics_for_labels(labels: Mapping[str, Any], metrics_collector: Any = None):
    """An :class:`AckSyncMetrics`, or None (logged) if they cannot be created:
    metrics never fail HiCache init."""
    try:
        return AckSyncMetrics(labels, metrics_collector)
    except Exception as exc:  # e.g. a collector backend that refuses the names
        logger.warning("HiCache ack sync: metrics not exported for %s: %r", dict(labels), exc)
        return None


class AckSyncMetrics:
    """One cache's series. Created by the plugin at HiCache init when the cache
    has metrics on; the pipelined step calls the ``on_*`` methods. Every series
    exists from init on, at 0 (``increase()`` over a series that appears at 1
    reads 0, and a failure stops the scheduler before the next scrape)."""

    def __init__(self, labels: Mapping[str, Any], metrics_collector: Any = None):
        self.labels = {k: str(v) for k, v in labels.items()}
        key = tuple(self.labels)
        fam = _families.get(key)
        if fam is None:
            classes = collector_classes(metrics_collector)
            fam = _families[key] = _create_families(key, classes, registered=not _families)
        self.pipelined = fam["pipelined"].labels(**self.labels)
        self.depth = fam["depth"].labels(**self.labels)
        self.group_size = fam["group_size"].labels(**self.labels)
        self.wait = fam["wait"].labels(**self.labels)
        self.issue = fam["issue"].labels(**self.labels)
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

    def on_path(self, pipelined: bool, depth: int, group_size: Optional[int] = None) -> None:
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
        fam = _families[tuple(self.labels)]
        return fam["failures"].labels(**self.labels, reason=reason)

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
# (kind, label names) -> families: as the ack sync's, one set per label names, the
# first registered, through the collector classes SGLang's own metrics use.
_other_families: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}


def _families_for(kind: str, labelnames: tuple[str, ...], metrics_collector: Any, create):
    key = (kind, labelnames)
    fam = _other_families.get(key)
    if fam is None:
        Counter, Gauge, Histogram = collector_classes(metrics_collector)
        extra: dict[str, Any] = {}
        first = not any(k == kind for k, _ in _other_families)
        from prometheus_client import Counter as PromCounter

        if not first and Counter is PromCounter:  # other backends take no registry
            extra = {"registry": None}
        fam = _other_families[key] = create(list(labelnames), Counter, Gauge, Histogram, extra)
    return fam


def _create_vote_families(names: list[str], Counter, Gauge, Histogram, extra) -> dict[str, Any]:
    return {
        "pipelined": Gauge(
            "sglang:hicache_prefetch_votes_pipelined",
            "1 while this rank decides storage prefetch deadlines with the pipelined "
            "vote reduce, 0 on SGLang's per-request blocking reduce.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            **extra,
        ),
        "wait": Histogram(
            "sglang:hicache_prefetch_votes_wait_seconds",
            "Time a scheduling pass waited on the previous pass's vote reduce, observed "
            "for passes that had one due.",
            labelnames=names,
            buckets=WAIT_BUCKETS,
            **extra,
        ),
        "issue": Histogram(
            "sglang:hicache_prefetch_votes_issue_seconds",
            "Time a scheduling pass spent voting on every ongoing prefetch and issuing the reduce.",
            labelnames=names,
            buckets=ISSUE_BUCKETS,
            **extra,
        ),
        "voted": Counter(
            "sglang:hicache_prefetch_votes_operations",
            "Storage prefetch operations voted on: one per operation in a pass's vote "
            "reduce (at most its 256 slots per pass).",
            labelnames=names,
            **extra,
        ),
        "stopped": Counter(
            "sglang:hicache_prefetch_votes_stopped",
            "Storage prefetch operations stopped on the group's deadline verdict.",
            labelnames=names,
            **extra,
        ),
        "failures": Counter(
            "sglang:hicache_prefetch_votes_failures",
            "Prefetch vote errors: ranks that disagree (mismatch) or a failed collective.",
            labelnames=[*names, "reason"],
            **extra,
        ),
    }


class PrefetchVoteMetrics:
    """One cache's prefetch-vote series (created with --enable-metrics)."""

    def __init__(self, labels: Mapping[str, Any], metrics_collector: Any = None):
        self.labels = {k: str(v) for k, v in labels.items()}
        fam = _families_for("votes", tuple(self.labels), metrics_collector, _create_vote_families)
        self.pipelined = fam["pipelined"].labels(**self.labels)
        self.wait = fam["wait"].labels(**self.labels)
        self.issue = fam["issue"].labels(**self.labels)
        self.voted = fam["voted"].labels(**self.labels)
        self.stopped = fam["stopped"].labels(**self.labels)
        self._failures = fam["failures"]

    def on_path(self, pipelined: bool) -> None:
        self.pipelined.set(1 if pipelined else 0)

    def on_pass(self, wait_s: Optional[float], issue_s: float, voted: int) -> None:
        """``wait_s`` is None when no vote reduce was due (the first pass)."""
        if wait_s is not None:
            self.wait.observe(wait_s)
        self.issue.observe(issue_s)
        if voted:
            self.voted.inc(voted)

    def on_stop(self) -> None:
        self.stopped.inc()

    def on_failure(self, reason: str) -> None:
        self._failures.labels(**self.labels, reason=reason).inc()


# ------------------------------------------------------ PD decode offload sync
def _create_offload_families(names: list[str], Counter, Gauge, Histogram, extra) -> dict[str, Any]:
    return {
        "pipelined": Gauge(
            "sglang:hicache_decode_offload_sync_pipelined",
            "1 while PD decode offload progress is pipelined, 0 on SGLang's blocking reduce.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            **extra,
        ),
        "wait": Histogram(
            "sglang:hicache_decode_offload_sync_wait_seconds",
            "Time a decode step waited on the previous step's offload reduce.",
            labelnames=names,
            buckets=WAIT_BUCKETS,
            **extra,
        ),
        "popped": Counter(
            "sglang:hicache_decode_offload_sync_popped_entries",
            "Offload acks and storage backups popped on the group's agreement.",
            labelnames=[*names, "queue"],
            **extra,
        ),
    }


class OffloadSyncMetrics:
    """The decode offload sync's series (created when SGLang's metrics are on)."""

    def __init__(self, labels: Mapping[str, Any], metrics_collector: Any = None):
        self.labels = {k: str(v) for k, v in labels.items()}
        fam = _families_for(
            "offload", tuple(self.labels), metrics_collector, _create_offload_families
        )
        self.pipelined = fam["pipelined"].labels(**self.labels)
        self.wait = fam["wait"].labels(**self.labels)
        self._popped = fam["popped"]

    def on_path(self, pipelined: bool) -> None:
        self.pipelined.set(1 if pipelined else 0)

    def on_step(self, wait_s: float, pops: Mapping[Hashable, int]) -> None:
        self.wait.observe(wait_s)
        for name, n in pops.items():
            if n:
                queue = "offload" if name == "ack_write_queue" else "backup"
                self._popped.labels(**self.labels, queue=queue).inc(n)


def never_raising(make, what: str, labels: Mapping[str, Any]):
    """``make()``, or None (logged): metrics never fail HiCache init."""
    try:
        return make()
    except Exception as exc:  # e.g. a collector backend that refuses the names
        logger.warning("%s: metrics not exported for %s: %r", what, dict(labels), exc)
        return None
