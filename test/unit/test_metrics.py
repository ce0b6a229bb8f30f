"""The ack sync's metrics in one process: created through the collector
classes SGLang's own cache metrics use (what RayEngine replaces), a second cache
with another label set never fails init, and every series starts at 0.
Each case runs in a fresh interpreter: prometheus_client's registry is global."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str, env_extra: dict | None = None) -> None:
    import os

    env = dict(os.environ, **(env_extra or {}))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_second_label_set_in_one_process_does_not_raise(tmp_path):
    """Two caches in one process, the second with an extra label (SGLang's
    extra_metric_labels): both export, neither raises inside init."""
    _run(
        f"""
        from types import SimpleNamespace
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        from prometheus_client.parser import text_string_to_metric_families
        from hicache_async_ack.metrics import series_for
        from hicache_async_ack.names import ACK_COUNTS

        def metrics_for(cache):  # what each cache's state makes at init_hicache
            c = cache.metrics_collector
            return series_for(ACK_COUNTS, c.labels, c)

        a = SimpleNamespace(metrics_collector=SimpleNamespace(
            labels=dict(cache_type="A", tp_rank=0, pp_rank=0, dp_rank=0)))
        b = SimpleNamespace(metrics_collector=SimpleNamespace(
            labels=dict(cache_type="B", tp_rank=0, pp_rank=0, dp_rank=0, model="m")))
        ma, mb = metrics_for(a), metrics_for(b)
        assert ma is not None and mb is not None
        ma.on_path(True, 1, 2); mb.on_path(True, 2, 2); mb.on_failure("mismatch")
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path={str(tmp_path)!r})
        seen = {{}}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                seen.setdefault(s.name, []).append((s.labels, s.value))
        depth = {{l["cache_type"]: v for l, v in seen["sglang:hicache_ack_sync_depth"]}}
        assert depth == {{"A": 1, "B": 2}}, depth
        fails = {{(l["cache_type"], l["reason"]): v
                 for l, v in seen["sglang:hicache_ack_sync_failures_total"]}}
        assert fails == {{("A", "mismatch"): 0, ("A", "failure"): 0,
                         ("B", "mismatch"): 1, ("B", "failure"): 0}}, fails
        """,
        {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )


def test_series_are_created_through_the_caches_collector_classes():
    """A deployment that plugs other collectors in (RayEngine: Ray-backed
    classes on the cache's collector class) gets the ack sync's series through
    them; the gauge comes from the scheduler role's class when the cache's has none."""
    _run(
        """
        from types import SimpleNamespace
        from hicache_async_ack.metrics import collector_classes, AckSyncMetrics

        made = []

        class Rec:
            def __init__(self, name, documentation="", labelnames=None, **kw):
                made.append((type(self).__name__, name, tuple(labelnames or ())))
                self.values = {}
            def labels(self, **kw):
                return self
            def inc(self, v=1.0): pass
            def set(self, v): pass
            def observe(self, v): pass

        class C(Rec): pass
        class H(Rec): pass
        class G(Rec): pass

        class RayLikeCacheCollector:  # as RayRadixCacheMetricsCollector: no gauge
            _counter_cls = C
            _histogram_cls = H

        from prometheus_client import Counter, Gauge, Histogram
        assert collector_classes(SimpleNamespace()) == (Counter, Gauge, Histogram)

        import sglang.srt.observability.metrics_collector as mc
        class RayLikeScheduler(mc.SchedulerMetricsCollector):
            _gauge_cls = G
        mc.resolve_collector_class = lambda role, default: (
            RayLikeScheduler if role == mc.STAT_LOGGER_ROLE_SCHEDULER else default)

        collector = RayLikeCacheCollector()
        collector.labels = dict(cache_type="X", tp_rank=0)
        assert collector_classes(collector) == (C, G, H)
        AckSyncMetrics(collector.labels, collector)
        kinds = {name: kind for kind, name, _ in made}
        assert kinds["sglang:hicache_ack_sync_pipelined"] == "G"
        assert kinds["sglang:hicache_ack_sync_wait_seconds"] == "H"
        assert kinds["sglang:hicache_ack_sync_popped_entries"] == "C"
        assert kinds["sglang:hicache_ack_sync_failures"] == "C"
        """
    )


def test_vote_and_offload_series_are_created_through_the_collector_classes():
    """The README's RayEngine claim for all three syncs: the prefetch votes' and the
    decode offload sync's series come from the collector classes too."""
    _run(
        """
        from hicache_async_ack.metrics import PrefetchVoteMetrics, OffloadSyncMetrics

        made = []

        class Rec:
            def __init__(self, name, documentation="", labelnames=None, **kw):
                made.append((type(self).__name__, name))
            def labels(self, **kw):
                return self
            def inc(self, v=1.0): pass
            def set(self, v): pass
            def observe(self, v): pass

        class C(Rec): pass
        class H(Rec): pass
        class G(Rec): pass

        class Collector:
            _counter_cls, _histogram_cls, _gauge_cls = C, H, G

        collector = Collector()
        PrefetchVoteMetrics(dict(cache_type="X", tp_rank=0), collector)
        OffloadSyncMetrics(dict(tp_rank=0), collector)
        kinds = dict((name, kind) for kind, name in made)
        assert kinds["sglang:hicache_prefetch_votes_pipelined"] == "G", kinds
        assert kinds["sglang:hicache_prefetch_votes_wait_seconds"] == "H", kinds
        assert kinds["sglang:hicache_prefetch_votes_operations"] == "C", kinds
        assert kinds["sglang:hicache_decode_offload_sync_pipelined"] == "G", kinds
        assert kinds["sglang:hicache_decode_offload_sync_popped_entries"] == "C", kinds
        """
    )


def test_a_second_vote_label_set_in_one_process_does_not_raise(tmp_path):
    """Two caches, the second with an extra label: the votes' metrics, as the ack
    sync's, never raise inside init_hicache."""
    _run(
        """
        from types import SimpleNamespace
        from hicache_async_ack.metrics import series_for
        from hicache_async_ack.names import PREFETCH_VOTES

        def metrics_for(cache):
            c = cache.metrics_collector
            return series_for(PREFETCH_VOTES, c.labels, c)

        a = SimpleNamespace(metrics_collector=SimpleNamespace(labels=dict(cache_type="A")))
        b = SimpleNamespace(metrics_collector=SimpleNamespace(labels=dict(cache_type="B", m="x")))
        ma, mb = metrics_for(a), metrics_for(b)
        assert ma is not None and mb is not None
        ma.on_path(True); mb.on_path(True); mb.on_failure("mismatch")
        """,
        {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )
