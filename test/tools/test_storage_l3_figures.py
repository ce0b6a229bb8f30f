"""The storage bench's L3 figures without a server: cpu-server's counts of the hit
queries sent to the store and the tokens the prefetches loaded (wrapped on fake
SGLang classes), and ``bench-server --storage``'s columns and records built from
them."""

from __future__ import annotations

import types

import pytest

from hicache_async_ack_lab.bench import storage
from hicache_async_ack_lab.bench.server_report import medians
from hicache_async_ack_lab.cpu_server import mooncake_standins
from hicache_async_ack_lab.cpu_server.mooncake_standins import COUNT_DIR_VAR, read_counts

CONTROLLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
CACHE = "sglang.srt.mem_cache.unified_radix_cache"


def _fake_modules():
    calls: list = []

    class HybridCacheController:
        def _storage_hit_query(self, operation):
            """SGLang's: batch_exists unless the span is known stored."""
            calls.append(("query", operation.assume_stored))
            return [], 0

    class UnifiedRadixCache:
        def _all_reduce_attn_groups(self, tensor, op):
            calls.append("attn")

        def _handle_prefetch_result(self, operation):
            calls.append(("result", operation.completed_tokens))

    return (
        types.SimpleNamespace(HybridCacheController=HybridCacheController),
        types.SimpleNamespace(UnifiedRadixCache=UnifiedRadixCache),
        calls,
    )


@pytest.fixture
def counting(tmp_path, monkeypatch):
    """The count directory set, and a fresh per-process counter."""
    monkeypatch.setenv(COUNT_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(mooncake_standins, "_COUNTS", [])
    return tmp_path


def test_hit_queries_and_loaded_tokens_are_counted_around_sglangs_own(counting):
    controller_mod, cache_mod, calls = _fake_modules()
    patches: dict = {}
    mooncake_standins.register(patches, {})
    patches[CONTROLLER](controller_mod)
    patches[CACHE](cache_mod)
    controller, cache = controller_mod.HybridCacheController(), cache_mod.UnifiedRadixCache()
    op = types.SimpleNamespace
    for assumed in (False, False, True):  # two sent to the store, one answered without
        assert controller._storage_hit_query(op(assume_stored=assumed)) == ([], 0)
    for tokens in (64, 0, 32):
        cache._handle_prefetch_result(op(completed_tokens=tokens))
    cache._all_reduce_attn_groups(None, None)
    # SGLang's own methods still run, and stay reachable for the plugin's fingerprints
    assert calls == [("query", False), ("query", False), ("query", True),
                     ("result", 64), ("result", 0), ("result", 32), "attn"]  # fmt: skip
    cls = controller_mod.HybridCacheController
    assert cls._storage_hit_query.__wrapped__.__name__ == "_storage_hit_query"
    assert cache_mod.UnifiedRadixCache._handle_prefetch_result.__wrapped__.__name__ == (
        "_handle_prefetch_result"
    )
    mooncake_standins._COUNTS[0].write()
    got = read_counts(counting)["0"]
    assert (got["l3_queries"], got["l3_queries_assumed"], got["l3_tokens_loaded"]) == (2, 1, 96)
    assert got["blocking"] == 1


def test_without_the_count_directory_nothing_is_wrapped(monkeypatch):
    monkeypatch.delenv(COUNT_DIR_VAR, raising=False)
    monkeypatch.setattr(mooncake_standins, "_COUNTS", [])
    controller_mod, cache_mod, _ = _fake_modules()
    real = controller_mod.HybridCacheController._storage_hit_query
    patches: dict = {}
    mooncake_standins.register(patches, {})
    patches[CONTROLLER](controller_mod)
    patches[CACHE](cache_mod)
    assert controller_mod.HybridCacheController._storage_hit_query is real
    assert not hasattr(cache_mod.UnifiedRadixCache._handle_prefetch_result, "__wrapped__")


REPLIES = [
    {"ttft_s": 0.1, "latency_s": 1.0,
     "meta": {"completion_tokens": 4, "cached_tokens_details": {"storage": 128}}}
    for _ in range(8)
]  # fmt: skip


def test_round_figures_per_request_queries_and_loaded_tokens():
    before = {"passes": 3, "l3_queries": 24, "l3_tokens_loaded": 512, "prefetch_max": 2}
    after = {"passes": 9, "l3_queries": 36, "l3_tokens_loaded": 1536, "prefetch_max": 5}
    f = storage.round_figures(REPLIES, 2.0, storage._delta(after, before))
    assert f["l3_queries"] == 12 and f["l3_queries_per_request"] == pytest.approx(1.5)
    assert f["tokens_from_l3"] == 1024
    old = storage.round_figures(REPLIES, 2.0, {"passes": 9})  # counts from before these
    assert old["l3_queries_per_request"] is None and old["tokens_from_l3"] is None


def _visit(arm: str, rnd: int, queries: int, tokens: int) -> dict:
    run = storage.round_figures(REPLIES, 2.0, {"passes": 10, "l3_queries": queries,
                                               "l3_tokens_loaded": tokens})  # fmt: skip
    return {"arm": arm, "latency_ms": 0.0, "lanes": None, "round": rnd, "startup_s": 30.0,
            "loadavg_start": (1.0, 0, 0), "loadavg_end": (2.0, 0, 0),
            "output_throughput": run["output_throughput"],
            "median": medians([run]), "runs": [run]}  # fmt: skip


def test_the_table_shows_both_figures_beside_throughput_per_arm():
    visits = [_visit("stock", 0, 8, 1024), _visit("plugin", 0, 12, 960),
              _visit("stock", 1, 8, 1000), _visit("plugin", 1, 12, 960)]  # fmt: skip
    assert [v["median"]["l3_queries_per_request"] for v in visits] == [1.0, 1.5, 1.0, 1.5]
    lines = storage.arm_table(visits).splitlines()
    head = lines[0]
    assert head.index("out tok/s") < head.index("L3 queries/req") < head.index("tokens from L3")
    assert head.index("tokens from L3") < head.index("TTFT p50 ms")
    # arm, injected ("0 ms"), rounds, out tok/s median, range, then the two figures
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["stock"][6:8] == ["1.00", "1012"]  # the median of 1024 and 1000 tokens
    assert rows["plugin"][6:8] == ["1.50", "960"]
