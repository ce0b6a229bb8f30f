"""The storage bench's L3 figures without a server: cpu-server's counts of the hit
queries sent to the store and the tokens the prefetches loaded (wrapped on fake
SGLang classes), and ``bench-server --storage``'s columns and records built from
them; and the shared-prompt workload's: its arrivals, the L3 work read from
mooncake_master's own counters (a round recorded from a real master,
test/data/mooncake/), and the issue's goal over made-up rounds."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from hicache_async_ack_lab.bench import shared_prompt, shared_prompt_report, storage
from hicache_async_ack_lab.bench.server_report import medians
from hicache_async_ack_lab.cpu_server import mooncake_metrics, mooncake_standins
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


# --- the shared-prompt workload: arrivals, the master's counters, the goal ----------

DATA = Path(__file__).resolve().parents[1] / "data" / "mooncake"
# mooncake_master's metrics around one burst of 6 requests sharing a 400-token prompt
# (stock, TP=2, page size 1: 4 keys a token), recorded by the e2e smoke run, trimmed to
# the series that moved and those read: the prompt read ~3 times (4,956 keys)
RECORDED_WORK = {"l3_queries": 30, "l3_keys_queried": 6420, "l3_keys_read": 4956,
                 "l3_bytes_read": 634368, "l3_keys_written": 984}  # fmt: skip


def test_arrivals_are_seeded_and_shaped_per_pattern():
    poisson = shared_prompt.arrival_offsets("poisson", 400, "7:0:poisson:0", 100.0, 15.0)
    assert poisson == shared_prompt.arrival_offsets("poisson", 400, "7:0:poisson:0", 100.0, 15.0)
    assert poisson != shared_prompt.arrival_offsets("poisson", 400, "7:1:poisson:0", 100.0, 15.0)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert len(gaps) == 399 and poisson[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.15)  # the 100 ms mean gap
    assert max(gaps) > 4 * min(gaps) + 0.05  # exponential, not even: not the dense pattern
    assert shared_prompt.arrival_offsets("dense", 4, "x", 100.0, 15.0) == pytest.approx(
        [0.0, 0.015, 0.030, 0.045]
    )
    assert shared_prompt.arrival_offsets("burst", 3, "x", 100.0, 15.0) == [0.0, 0.0, 0.0]
    assert shared_prompt.arrival_offsets("poisson", 3, "x", 0.0, 15.0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="expected one of poisson, dense, burst"):
        shared_prompt.arrival_offsets("trickle", 3, "x", 100.0, 15.0)


def test_the_system_prompt_is_as_long_as_the_bundled_tokenizer_counts():
    from tokenizers import Tokenizer

    from hicache_async_ack_lab.cpu_server.model import ensure_model

    tok = Tokenizer.from_file(str(ensure_model() / "tokenizer.json"))
    text, counted = shared_prompt.system_prompt(300, 0)
    assert counted == len(tok.encode(text).ids) and counted >= 300
    shorter = " ".join(text.split()[:-1])  # the fewest words that reach 300 tokens
    assert len(tok.encode(shorter).ids) < 300
    asks = shared_prompt.questions(32, 12, "0:0:burst:0")
    assert len(set(asks)) == 32 and all(q.startswith("\nQuestion ") for q in asks)
    # a question never changes the prompt's own tokens: every request shares its pages
    assert tok.encode(text + asks[0]).ids[:counted] == tok.encode(text).ids


def _recorded() -> tuple[dict, dict]:
    return tuple(  # type: ignore[return-value]
        mooncake_metrics.parse((DATA / f"shared-prompt-burst-{w}.prom").read_text())
        for w in ("before", "after")
    )


def test_the_masters_counters_of_a_recorded_round():
    before, after = _recorded()
    assert set(mooncake_metrics.REQUIRED) <= set(before)
    assert not any("{" in name for name in after)  # labelled series are not read
    assert mooncake_metrics.l3_work(before, after) == RECORDED_WORK


def test_a_missing_counter_or_a_restarted_master_is_refused():
    before, after = _recorded()
    with pytest.raises(mooncake_metrics.MetricsMissing, match="batch_exist_key_requests_total"):
        mooncake_metrics.l3_work(before, {k: v for k, v in after.items() if "exist_key" not in k})
    with pytest.raises(ValueError, match="went back"):
        mooncake_metrics.l3_work(after, before)


def test_round_figures_per_request_from_the_recorded_round():
    before, after = _recorded()
    replies = [{"ttft_s": 0.01 * (i + 1), "latency_s": 0.5,
                "meta": {"completion_tokens": 4, "cached_tokens_details": {"storage": 400}}}
               for i in range(6)]  # fmt: skip
    f = shared_prompt_report.round_figures(replies, 2.0, before, after,
                                           {"read_once_waits": 3.0,
                                            "read_once_saved_tokens": None})  # fmt: skip
    assert f["requests"] == 6 and f["output_throughput"] == pytest.approx(12.0)
    assert f["l3_keys_read"] == RECORDED_WORK["l3_keys_read"]
    assert f["l3_keys_read_per_request"] == pytest.approx(RECORDED_WORK["l3_keys_read"] / 6)
    assert f["l3_queries_per_request"] == pytest.approx(RECORDED_WORK["l3_queries"] / 6)
    assert f["median_ttft_ms"] == pytest.approx(35.0) and f["p99_ttft_ms"] == pytest.approx(60.0)
    assert f["read_once_waits"] == 3.0 and f["read_once_saved_tokens"] is None


def test_settled_waits_until_the_counters_stop_moving():
    before, after = (
        (DATA / f"shared-prompt-burst-{w}.prom").read_text() for w in ("before", "after")
    )
    texts = [before, before.replace(" ", " ", 1), after, after, after, after, after]
    seen = []

    def read() -> str:
        seen.append(texts[min(len(seen), len(texts) - 1)])
        return seen[-1]

    assert mooncake_metrics.settled(read, quiet_s=0.3, timeout_s=30) == after
    assert len(seen) >= 4  # read on past the last change
    # Negative control: counters that never stop still return, at the timeout.
    grow = iter(range(10**6))
    moving = mooncake_metrics.settled(
        lambda: f"master_batch_get_replica_list_items_total {next(grow)}\n",
        quiet_s=0.3, timeout_s=0.5,
    )  # fmt: skip
    assert float(moving.split()[1]) >= 1


def _shared_visit(arm: str, rnd: int, keys: float, ttft: float, waits=None) -> dict:
    run = {"l3_keys_read_per_request": keys, "l3_queries_per_request": 2.0,
           "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "output_throughput": 100.0,
           "read_once_waits": waits, "read_once_saved_tokens": None}  # fmt: skip
    return {"arm": arm, "latency_ms": 0.0, "round": rnd, "keys_stored": 1938,
            "patterns": {p: {"runs": [run], "median": medians([run])}
                         for p in shared_prompt.PATTERNS}}  # fmt: skip


STOCK_KEYS = (480.0, 520.0, 500.0, 470.0, 530.0)
CFG = {"patterns": list(shared_prompt.PATTERNS)}


def _rounds(read_once_keys, read_once_ttft=100.0, waits=None) -> list[dict]:
    out = []
    for r, (stock, ro) in enumerate(zip(STOCK_KEYS, read_once_keys)):
        ttft = 100.0 + 3 * r
        out += [_shared_visit("stock", r, stock, ttft),
                _shared_visit("read-once", r, ro, ttft * read_once_ttft / 100, waits)]  # fmt: skip
    return out


def test_the_goal_holds_where_read_once_reads_a_fraction_of_stock():
    visits = _rounds([100.0, 95.0, 110.0, 90.0, 105.0])
    clauses = shared_prompt_report.goal(CFG, visits, 0.0)
    assert len(clauses) == 9 and {c["verdict"] for c in clauses} == {"holds"}
    assert shared_prompt_report.overall(clauses) == "holds"


def test_the_goal_fails_where_read_once_reads_as_stock_does_or_is_slower():
    # Negative controls: read-once reading what stock reads, then read-once slower.
    same = shared_prompt_report.goal(CFG, _rounds([490.0, 510.0, 505.0, 480.0, 520.0]), 0.0)
    failed = {(c["pattern"], c["figure"]) for c in same if c["verdict"] == "fails"}
    assert failed == {("dense", "keys read/req"), ("burst", "keys read/req")}
    slow = shared_prompt_report.goal(CFG, _rounds([100.0, 95, 110, 90, 105], 150.0), 0.0)
    assert {c["figure"] for c in slow if c["verdict"] == "fails"} == {"TTFT p50", "TTFT p99"}
    assert shared_prompt_report.overall(slow) == "fails"
    one = shared_prompt_report.goal(CFG, _rounds([100.0]), 0.0)  # no interval from 1 round
    assert one and {c["verdict"] for c in one} == {"inconclusive"}


def test_the_tables_show_intervals_and_a_dash_for_absent_read_once_counts(capsys, tmp_path):
    visits = _rounds([100.0, 95.0, 110.0, 90.0, 105.0], waits=2.0)
    table = shared_prompt_report.arm_table(CFG, visits).splitlines()
    head = table[0]
    assert head.index("keys read/req") < head.index("TTFT p50 ms") < head.index("read-once waits")
    stock = [line for line in table if line.startswith("burst") and " stock " in line]
    ro = [line for line in table if line.startswith("burst") and " read-once " in line]
    assert len(stock) == len(ro) == 1
    assert stock[0].split()[-2:] == ["-", "-"]  # stock exports no read-once counters
    assert ro[0].split()[-4:] == ["2.0", "[2.0,", "2.0]", "-"]  # its waits; no saved count
    assert "500 [468, 532]" in stock[0]  # the mean of the rounds with its interval
    rc = shared_prompt_report.ratio_table(CFG, visits)
    assert "read-once / stock" in rc and "0.20 [" in rc
    cfg = CFG | {"tp": 2, "prompt_tokens": 1200, "requests": 32, "question_words": 12,
                 "poisson_gap_ms": 100.0, "dense_gap_ms": 15.0, "output_len": 16,
                 "max_total_tokens": 4096, "hicache_ratio": 25.0, "rounds": 5,
                 "runs": 1}  # fmt: skip
    record = shared_prompt_report.print_report(cfg, _rounds([100.0, 95, 110, 90, 105]))
    out = capsys.readouterr().out
    assert record["goal"]["0"]["verdict"] == "holds" and "goal at 0 ms" in out
    assert "exported no read-once counters" in out  # the arm ran without the mechanism
    png = tmp_path / "shared.png"
    shared_prompt_report.draw_png(png, cfg, visits)
    assert png.read_bytes()[:4] == b"\x89PNG"


class _DyingServer:
    """A server that crashed in SGLang's flush: its HTTP end gone, its log saying why."""

    log_path = "server.log"

    def post(self, path: str) -> bytes:
        raise ConnectionResetError("Remote end closed connection without response")

    def exited(self) -> bool:
        return True

    def log(self, tail: int) -> str:
        return "RuntimeError: Failed to stop HiCache storage threads cleanly.\nSIGQUIT received."


def test_a_server_that_dies_in_its_flush_is_named_and_its_visit_run_once_more(
    monkeypatch, tmp_path
):
    with pytest.raises(storage.ServerExited, match="Failed to stop HiCache storage threads"):
        storage.flush_cache(_DyingServer())
    calls = []

    def visit(cfg, conf, rnd, workdir, quiet):
        calls.append(workdir)
        if len(calls) <= failures:
            raise storage.ServerExited("the server exited during /flush_cache")
        return {"arm": conf[0]}

    monkeypatch.setattr(shared_prompt, "visit", visit)
    failures = 1
    rec = shared_prompt.visit_again_once({}, ("stock", 0.0, None), 0, tmp_path, True)
    assert rec == {"arm": "stock", "attempts": 2}
    assert calls == [tmp_path, tmp_path / "again-stock-r0"]  # the first one's logs stay
    # Negative control: a second death is the run's error, not a third try.
    calls.clear()
    failures = 2
    with pytest.raises(storage.ServerExited):
        shared_prompt.visit_again_once({}, ("stock", 0.0, None), 0, tmp_path, True)
    assert len(calls) == 2
