"""Prometheus metrics for the HiCache ack sync, through SGLang's own pipeline.

With ``--enable-metrics`` SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` before the
schedulers start, each scheduler's collectors write into it, and the HTTP
server's ``/metrics`` merges them. We register ours the way SGLang's collectors
do (``sglang:`` names, multiprocess modes, prometheus_client imported only once
the multiproc dir is set) with the label set of the cache's other metrics
(``cache.metrics_collector.labels``: cache_type, tp_rank, pp_rank, dp_rank and
any extra labels). Without metrics nothing here is imported or created, and the
pipelined step pays one ``is None`` test.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Optional

# Waiting on the due reduce: ~0 when the reduce is hidden behind the forward.
WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5)
# Issuing the next reduce (count, snapshot, async all_reduce).
ISSUE_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)

# Queue names as they appear in the `queue` label.
QUEUE_LABELS = {"ack_write_queue": "write", "ack_load_queue": "load"}

_families: Optional[dict[str, Any]] = None  # one set per process, shared by its caches


def _create_families(labelnames: tuple[str, ...]) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    names = list(labelnames)
    return {
        "pipelined": Gauge(
            "sglang:hicache_ack_sync_pipelined",
            "1 while this rank pipelines the HiCache ack-count all_reduce, 0 on the blocking path.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        ),
        "depth": Gauge(
            "sglang:hicache_ack_sync_depth",
            "Reduces in flight: acks are popped this many steps late.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        ),
        "wait": Histogram(
            "sglang:hicache_ack_sync_wait_seconds",
            "Time a scheduler step waited on the due ack-count reduce (about 0 while "
            "the reduce is hidden behind the forward).",
            labelnames=names,
            buckets=WAIT_BUCKETS,
        ),
        "issue": Histogram(
            "sglang:hicache_ack_sync_issue_seconds",
            "Time a scheduler step spent counting ready entries and issuing the next "
            "ack-count reduce.",
            labelnames=names,
            buckets=ISSUE_BUCKETS,
        ),
        "popped": Counter(
            "sglang:hicache_ack_sync_popped_entries",
            "Acks and storage control entries popped on the group's agreement, per queue.",
            labelnames=[*names, "queue"],
        ),
        "failures": Counter(
            "sglang:hicache_ack_sync_failures",
            "HiCache ack sync errors: ranks that disagree (mismatch) or a failed "
            "collective (failure).",
            labelnames=[*names, "reason"],
        ),
    }


class AckSyncMetrics:
    """One cache's series. Created by the plugin at HiCache init when the cache
    has metrics on; the pipelined step calls the ``on_*`` methods."""

    def __init__(self, labels: Mapping[str, Any]):
        global _families
        self.labels = {k: str(v) for k, v in labels.items()}
        if _families is None:
            _families = _create_families(tuple(self.labels))
        fam = _families
        self.pipelined = fam["pipelined"].labels(**self.labels)
        self.depth = fam["depth"].labels(**self.labels)
        self.wait = fam["wait"].labels(**self.labels)
        self.issue = fam["issue"].labels(**self.labels)
        self._popped = fam["popped"]
        self._failures = fam["failures"]
        self._popped_by_queue: dict[Hashable, Any] = {}

    def on_path(self, pipelined: bool, depth: int) -> None:
        self.pipelined.set(1 if pipelined else 0)
        self.depth.set(depth if pipelined else 0)

    def on_step(self, wait_s: float, issue_s: float, pops: Mapping[Hashable, int]) -> None:
        self.wait.observe(wait_s)
        self.issue.observe(issue_s)
        for name, n in pops.items():
            if n:
                self._popped_child(name).inc(n)

    def on_failure(self, reason: str) -> None:
        self._failures.labels(**self.labels, reason=reason).inc()

    def _popped_child(self, name: Hashable):
        child = self._popped_by_queue.get(name)
        if child is None:
            if isinstance(name, tuple):  # ("extra", pool)
                label = f"extra_{name[1]}"
            else:
                label = QUEUE_LABELS.get(str(name), str(name).removesuffix("_queue"))
            child = self._popped.labels(**self.labels, queue=label)
            self._popped_by_queue[name] = child
        return child


# --------------------------------------------------- prefetch termination votes
_vote_families: Optional[dict[str, Any]] = None


def _create_vote_families(labelnames: tuple[str, ...]) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    names = list(labelnames)
    return {
        "pipelined": Gauge(
            "sglang:hicache_prefetch_votes_pipelined",
            "1 while this rank decides storage prefetch deadlines with the pipelined "
            "vote reduce, 0 on SGLang's per-request blocking reduce.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        ),
        "wait": Histogram(
            "sglang:hicache_prefetch_votes_wait_seconds",
            "Time a scheduling pass waited on the previous pass's vote reduce.",
            labelnames=names,
            buckets=WAIT_BUCKETS,
        ),
        "issue": Histogram(
            "sglang:hicache_prefetch_votes_issue_seconds",
            "Time a scheduling pass spent voting on every ongoing prefetch and issuing the reduce.",
            labelnames=names,
            buckets=ISSUE_BUCKETS,
        ),
        "voted": Counter(
            "sglang:hicache_prefetch_votes_operations",
            "Ongoing storage prefetch operations voted on (one per operation per pass).",
            labelnames=names,
        ),
        "stopped": Counter(
            "sglang:hicache_prefetch_votes_stopped",
            "Storage prefetch operations stopped on the group's deadline verdict.",
            labelnames=names,
        ),
        "failures": Counter(
            "sglang:hicache_prefetch_votes_failures",
            "Prefetch vote errors: ranks that disagree (mismatch) or a failed collective.",
            labelnames=[*names, "reason"],
        ),
    }


class PrefetchVoteMetrics:
    """One cache's prefetch-vote series (created with --enable-metrics)."""

    def __init__(self, labels: Mapping[str, Any]):
        global _vote_families
        self.labels = {k: str(v) for k, v in labels.items()}
        if _vote_families is None:
            _vote_families = _create_vote_families(tuple(self.labels))
        fam = _vote_families
        self.pipelined = fam["pipelined"].labels(**self.labels)
        self.wait = fam["wait"].labels(**self.labels)
        self.issue = fam["issue"].labels(**self.labels)
        self.voted = fam["voted"].labels(**self.labels)
        self.stopped = fam["stopped"].labels(**self.labels)
        self._failures = fam["failures"]

    def on_path(self, pipelined: bool) -> None:
        self.pipelined.set(1 if pipelined else 0)

    def on_pass(self, wait_s: float, issue_s: float, voted: int) -> None:
        self.wait.observe(wait_s)
        self.issue.observe(issue_s)
        if voted:
            self.voted.inc(voted)

    def on_stop(self) -> None:
        self.stopped.inc()

    def on_failure(self, reason: str) -> None:
        self._failures.labels(**self.labels, reason=reason).inc()
