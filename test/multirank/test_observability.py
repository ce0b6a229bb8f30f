"""Operators see it work: Prometheus metrics written by real gloo ranks into a
real multiprocess directory (as SGLang's --enable-metrics sets it up), read back
through prometheus_client's multiprocess collector in the exposition format;
the shipped dashboard and alert rules name only series found there; and auto
depth following a reduce latency that changes over time, in model time (the
latency model, not the wall clock of a busy box, decides what the rule sees)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from hicache_async_ack import metrics as ack_metrics
from hicache_async_ack.env import DEPTH_VAR
from hicache_async_ack_lab.testing.scenarios import ACK_KINDS

from support.checks import assert_symmetric_and_complete
from support.gloo_ranks import run_fresh, scenario_job

WORLD = 2
LABELS = ("cache_type", "tp_rank", "pp_rank", "dp_rank")
BASE = dict(max_delay=2, skew=True, storage=True, extra_pools=["mamba"])
# A slow collective for a while: 4 ms steps, then a 14 ms reduce, then fast again.
STEP_MS = 4
LATENCY = [[0, 0.0], [80, 14.0], [180, 0.0]]
MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
EXTRA = "extra_host_mem_release_queues:mamba"


@pytest.fixture(scope="module")
def metrics_run(tmp_path_factory):
    prom_dir = tmp_path_factory.mktemp("prometheus_multiproc")
    specs = [
        dict(BASE, name="no_metrics", seed=1, steps=30),
        dict(BASE, name="pipelined", seed=2, steps=100, metrics=True),
        dict(
            BASE,
            name="auto",
            seed=3,
            steps=360,
            metrics="auto",
            step_ms=STEP_MS,
            latency_ms=LATENCY,
            event_p=0.05,
            events=["write_back_flush", "reset", "detach", "attach", "loading_check"],
            env={DEPTH_VAR: "auto"},
        ),
        dict(
            BASE,
            name="mismatch",
            seed=4,
            steps=20,
            metrics="mismatch",
            rank_env={"1": {DEPTH_VAR: "2"}},
            fresh_group=True,
            expect_error=True,
        ),
    ]
    import os

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom_dir))
    (out,) = run_fresh([scenario_job(WORLD, specs, timeout=600)], env=env)
    if isinstance(out, Exception):
        raise AssertionError(str(out))
    return out, scrape(prom_dir)


def scrape(prom_dir) -> dict:
    """What /metrics would serve: the multiprocess collector over the directory,
    rendered in the exposition format and parsed back."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(prom_dir))
    text = generate_latest(registry).decode()
    samples: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def series(samples, name, **match):
    return [
        (labels, value)
        for labels, value in samples.get(name, [])
        if all(labels.get(k) == str(v) for k, v in match.items())
    ]


def value(samples, name, **match) -> float:
    (found,) = series(samples, name, **match)
    return found[1]


def test_no_metrics_means_nothing_created(metrics_run):
    results, _ = metrics_run
    for r in results:
        assert not r["no_metrics"]["metrics_on"]
        assert not r["no_metrics"]["metrics_module_loaded"]  # not even imported
        assert r["pipelined"]["metrics_on"]


def test_every_series_carries_the_cache_labels(metrics_run):
    _, samples = metrics_run
    names = [n for n in samples if n.startswith("sglang:hicache_ack_sync_")]
    for family in ack_metrics.SERIES:
        assert any(n.startswith(family) for n in names), (family, names)
    for name in names:
        for labels, _ in samples[name]:
            assert set(LABELS) <= set(labels), (name, labels)


def test_pipelined_gauge_depth_and_step_histograms_per_rank(metrics_run):
    results, samples = metrics_run
    for rank, r in enumerate(results):
        match = dict(cache_type="UnifiedRadixCache", tp_rank=rank)
        assert value(samples, "sglang:hicache_ack_sync_pipelined", **match) == 1
        assert value(samples, "sglang:hicache_ack_sync_depth", **match) == 1
        assert value(samples, "sglang:hicache_ack_sync_group_size", **match) == WORLD
        steps = r["pipelined"]["steps_run"]
        # the wait: only steps that had a reduce due (at depth 1, all but the first)
        assert value(samples, "sglang:hicache_ack_sync_wait_seconds_count", **match) == steps - 1
        assert value(samples, "sglang:hicache_ack_sync_issue_seconds_count", **match) == steps
        assert value(samples, "sglang:hicache_ack_sync_issue_seconds_sum", **match) > 0


def test_popped_counters_match_what_the_rank_popped(metrics_run):
    results, samples = metrics_run
    for rank, r in enumerate(results):
        popped: dict[str, int] = {}
        for _, post in r["pipelined"]["pops"]:
            for queue, _ in post:
                if queue in ACK_KINDS:  # the controller's own queue names
                    label = f"ack_{queue}_queue"
                elif isinstance(queue, list):  # ("extra", pool)
                    label = f"extra_host_mem_release_queues:{queue[1]}"
                else:
                    label = queue
                popped[label] = popped.get(label, 0) + 1
        assert popped.get("ack_write_queue") and popped.get("ack_load_queue"), popped
        got = {
            labels["queue"]: v
            for labels, v in series(
                samples,
                "sglang:hicache_ack_sync_popped_entries_total",
                cache_type="UnifiedRadixCache",
                tp_rank=rank,
            )
        }
        assert {q: v for q, v in got.items() if v} == popped


def test_every_series_exists_at_zero_from_init(metrics_run):
    """increase() over a series that appears at 1 reads 0: the counters exist
    from HiCache init on, at 0, for every queue and failure reason."""
    _, samples = metrics_run
    for rank in range(WORLD):
        match = dict(cache_type="UnifiedRadixCache", tp_rank=rank)
        failures = series(samples, "sglang:hicache_ack_sync_failures_total", **match)
        assert {labels["reason"]: v for labels, v in failures} == {"mismatch": 0, "failure": 0}
        queues = {
            labels["queue"]
            for labels, _ in series(
                samples, "sglang:hicache_ack_sync_popped_entries_total", **match
            )
        }
        assert queues == {*ack_metrics.QUEUES, EXTRA}


def _named_series(text: str) -> set[str]:
    # The kit matches both spellings by regex (sglang[:_]...; docs/monitoring.md).
    found = re.findall(r"sglang(?::|\[:_\])(hicache_ack_sync_[a-z_]+)", text)
    return {f"sglang:{name}" for name in found}


@pytest.mark.parametrize("path", ["prometheus-alerts.yml", "grafana-dashboard.json"])
def test_shipped_monitoring_names_only_series_of_a_real_exposition(metrics_run, path):
    _, samples = metrics_run
    text = (MONITORING / path).read_text()
    if path.endswith(".json"):
        exprs = [t["expr"] for p in json.loads(text)["panels"] for t in p.get("targets", [])]
        text = "\n".join(exprs)
    else:
        import yaml

        rules = [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
        assert {r["alert"] for r in rules} >= {
            "HiCacheSyncStoodDown",
            "HiCacheSyncServerDown",
            "HiCacheAckSyncSeriesMissing",
            "HiCacheAckSyncNotHidden",
        }
        text = "\n".join(r["expr"] for r in rules)
    named = _named_series(text)
    assert named, path
    missing = sorted(n for n in named if n not in samples)
    assert not missing, (path, missing)


def test_wait_histogram_shows_the_latency_the_auto_depth_then_hides(metrics_run):
    """In model time: at depth 1 a 14 ms reduce behind 4 ms steps makes the
    step wait 10 ms; the rule raises the depth once, to 4, and nothing waits
    again. Only the consumes before that raise waited."""
    results, samples = metrics_run
    for rank in range(WORLD):
        waited = series(
            samples, "sglang:hicache_ack_sync_wait_seconds_bucket", cache_type="auto", tp_rank=rank
        )
        total = value(
            samples, "sglang:hicache_ack_sync_wait_seconds_count", cache_type="auto", tp_rank=rank
        )
        under_1ms = next(v for labels, v in waited if labels["le"] == "0.001")
        under_20ms = next(v for labels, v in waited if labels["le"] == "0.02")
        # before the raise: the raise_after (2) waits that raise it, plus at most
        # one consume of a reduce issued before the raise took effect
        assert 1 <= total - under_1ms <= 3, (total, under_1ms)
        assert under_20ms == total  # never more than the modelled 10 ms


def test_failures_counter_counts_the_mismatch(metrics_run):
    results, samples = metrics_run
    for rank, r in enumerate(results):
        assert "the lag depth differs" in r["mismatch"]["error"]
        got = value(
            samples,
            "sglang:hicache_ack_sync_failures_total",
            cache_type="mismatch",
            tp_rank=rank,
            reason="mismatch",
        )
        assert got == 1


def test_auto_depth_rises_with_latency_and_falls_back_with_symmetric_pops(metrics_run):
    results, _ = metrics_run
    _drop_detach_storage_pops(results, "auto")
    r0 = assert_symmetric_and_complete(results, "auto")
    assert r0["pipelined"]
    depths = [r["auto"]["depths"] for r in results]
    assert len(depths) > 1 and all(d == depths[0] for d in depths)  # moved at the same step
    d = depths[0]
    # model time: the depths are exact, whatever the load on the box
    hiding = math.ceil(14.0 / STEP_MS)  # a 14 ms reduce behind 4 ms steps
    assert d[:81] == [1] * 81
    assert max(d) == hiding and hiding in d[80:90]  # reached at once, no overshoot
    rise = d.index(hiding)
    assert d[rise:181] == [hiding] * (181 - rise)  # held while the latency lasts
    assert d[-1] == 1  # lowered one by one once the reduce is fast again
    assert all(b - a in (0, -1) for a, b in zip(d[180:], d[181:]))
    assert r0["counts"]["events"], "lifecycle events ran"


def _drop_detach_storage_pops(results, name):
    for r in results:
        for step, ev in zip(r[name]["pops"], r[name]["events"]):
            if ev == "detach":
                step[0] = [p for p in step[0] if p[0] in ACK_KINDS]
