"""End to end on SGLang's real server: the other configurations an operator runs.

One server per class (torn down when the class is done, so idle schedulers do
not compete for the two cores): write-back with the normal (non-overlap)
scheduler loop, the plugin excluded by SGLANG_PLUGINS, and TP=4. In each, the
prompts re-sent once their prefixes were evicted to host give the first answers,
tokens and logprobs (e2e_servers.compare, the check the negative control fails).
"""

from __future__ import annotations

import pytest

from hicache_async_ack.env import PLUGINS_VAR

from support.e2e_servers import (
    ask,
    ask_together,
    assert_same,
    metric_samples,
    popped_by_rank,
    prompts,
    serve,
)

pytestmark = pytest.mark.e2e

PROMPTS = prompts(10, seed=1)


def resend_hits(server) -> list[int]:
    """Overflow the device pool, then re-send the first prompts: host-hit tokens per
    re-sent prompt, once their answers were checked against the first ones."""
    first = [ask(server, p, max_new_tokens=4) for p in PROMPTS]
    again = [ask(server, p, max_new_tokens=4) for p in PROMPTS[:4]]
    assert_same(first[:4], again)
    return [r.host for r in again]


def assert_pipelined(server, ranks: int) -> None:
    log = server.log()
    for rank in range(ranks):
        assert f"TP{rank}] HiCache ack sync: pipelined" in log
    gauges = metric_samples(server, "sglang:hicache_ack_sync_pipelined")
    assert sorted(s.labels["tp_rank"] for s in gauges) == [str(r) for r in range(ranks)]
    assert all(s.value == 1.0 for s in gauges)


class TestWriteBackNormalLoop:
    @pytest.fixture(scope="class")
    def server(self, tmp_path_factory):
        args = ["--hicache-write-policy", "write_back", "--disable-overlap-schedule"]
        yield from serve(tmp_path_factory.mktemp("wb"), "write-back", args, skew="2,0")

    def test_pipelines_and_loads_back_from_host(self, server):
        assert_pipelined(server, 2)
        hits = resend_hits(server)
        assert any(h > 0 for h in hits), hits
        popped = popped_by_rank(server, 2)
        assert popped["0"] == popped["1"]  # the same entries on every rank
        assert sum(v for q, v in popped["0"].items() if "load" in q) > 0, popped

    def test_concurrent_requests_and_flush(self, server):
        burst = prompts(8, seed=3)
        replies = ask_together(server, burst, max_new_tokens=12)
        assert b"Cache flushed" in server.post("/flush_cache?timeout=30")
        # Alone and recomputed (nothing left to restore): the batch's answers.
        again = [ask(server, text, max_new_tokens=12) for text in burst[:2]]
        assert_same(replies[:2], again, restored=False)
        assert not server.exited()


class TestPluginExcludedBySglangPlugins:
    @pytest.fixture(scope="class")
    def server(self, tmp_path_factory):
        tmp = tmp_path_factory.mktemp("excluded")
        yield from serve(tmp, "excluded", env={PLUGINS_VAR: "some_other_plugin"})

    def test_stock_behaviour(self, server):
        hits = resend_hits(server)
        assert any(h > 0 for h in hits), hits  # HiCache itself works
        assert "HiCache ack sync" not in server.log()  # the plugin never loaded
        assert metric_samples(server, "sglang:hicache_ack_sync_pipelined") == []


class TestTP4:
    @pytest.fixture(scope="class")
    def server(self, tmp_path_factory):
        yield from serve(tmp_path_factory.mktemp("tp4"), "tp4", ["--tp", "4"], skew="0,1,2,3")

    def test_pipelines_on_four_ranks(self, server):
        assert_pipelined(server, 4)
        hits = resend_hits(server)
        assert any(h > 0 for h in hits), hits
        popped = popped_by_rank(server, 4)
        assert sorted(popped) == ["0", "1", "2", "3"]
        assert all(popped[r] == popped["0"] for r in popped)
