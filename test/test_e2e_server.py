"""End to end on SGLang's real server: plugin and stock side by side at TP=2.

Both servers run `hicache-async-ack cpu-server` (SGLang's launch_server, real
scheduler loop, cache controller, host pool and HTTP API) with write-through,
the overlap loop, a file storage backend and skewed acks (rank 1's finish
events report done three polls after rank 0's, as on a GPU host), and are
driven with the same requests over HTTP.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from e2e_servers import (
    STOCK_ENV,
    host_tokens,
    metric_samples,
    popped_by_rank,
    prompts,
    serve,
    settled,
)

pytestmark = pytest.mark.e2e

STORAGE_DIR: dict[str, Path] = {}

STORAGE_ARGS = [
    "--hicache-write-policy", "write_through",
    "--hicache-storage-backend", "file",
    # Our prompts are ~110 tokens: below upstream's 256-token default no
    # prefetch would start.
    "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 16}',
]  # fmt: skip


def storage_env(tmp: Path, name: str) -> dict:
    STORAGE_DIR[name] = tmp / "storage"
    STORAGE_DIR[name].mkdir()
    return {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(STORAGE_DIR[name])}


@pytest.fixture(scope="module")
def plugin_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    yield from serve(tmp, "plugin", STORAGE_ARGS, env=storage_env(tmp, "plugin"), skew="0,3")


@pytest.fixture(scope="module")
def stock_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stock")
    env = {**STOCK_ENV, **storage_env(tmp, "stock")}
    yield from serve(tmp, "stock", STORAGE_ARGS, env=env, skew="0,3")


PROMPTS = prompts(10)


def run_sequence(server) -> list[tuple[str, int]]:
    """Ten prompts (overflowing the device pool), then the first four again."""
    out = []
    for p in PROMPTS + PROMPTS[:4]:
        r = server.generate(p, max_new_tokens=8)
        out.append((r["text"], r["meta_info"]["cached_tokens"], host_tokens(r)))
    return out


@pytest.fixture(scope="module")
def sequences(plugin_server, stock_server):
    return {"plugin": run_sequence(plugin_server), "stock": run_sequence(stock_server)}


def test_each_rank_logs_its_path(plugin_server, stock_server):
    log = plugin_server.log()
    for rank in (0, 1):
        assert f"TP{rank}] HiCache ack sync: pipelined over the one attn TP group" in log
    stock = stock_server.log()
    assert "HiCache ack sync: pipelined" not in stock


def test_greedy_outputs_identical(sequences):
    # Same weights, same requests: the same tokens, whether a prefix was
    # computed, kept on device, or loaded back from host or storage. (Which of
    # those happens depends on copy and prefetch timing, on either server.)
    plugin, stock = sequences["plugin"], sequences["stock"]
    assert [t for t, _, _ in plugin] == [t for t, _, _ in stock]
    assert len({t for t, _, _ in plugin}) > 1  # the prompts do lead to different outputs


def test_resent_prefixes_come_back_from_host(sequences):
    for name, seq in sequences.items():
        resent = seq[len(PROMPTS) :]
        assert any(h > 0 for _, _, h in resent), f"{name}: no host hit in {resent}"


def test_metrics_pipelined_on_every_rank_and_entries_popped(plugin_server, sequences):
    pipelined = metric_samples(plugin_server, "sglang:hicache_ack_sync_pipelined")
    assert sorted(s.labels["tp_rank"] for s in pipelined) == ["0", "1"]
    assert all(s.value == 1.0 for s in pipelined)
    by_rank = popped_by_rank(plugin_server, 2)
    assert set(by_rank) == {"0", "1"}
    # The group's agreement pops the same entries on every rank.
    assert by_rank["0"] == by_rank["1"]
    writes = sum(v for q, v in by_rank["0"].items() if "write" in q)
    loads = sum(v for q, v in by_rank["0"].items() if "load" in q)
    assert writes > 0 and loads > 0, by_rank
    failures = metric_samples(plugin_server, "sglang:hicache_ack_sync_failures_total")
    assert all(s.value == 0 for s in failures if s.name.endswith("_total"))


def test_stock_exposes_no_pipelined_rank(stock_server, sequences):
    pipelined = metric_samples(stock_server, "sglang:hicache_ack_sync_pipelined")
    assert all(s.value == 0.0 for s in pipelined)


def _wait_storage_settled(name: str, timeout_s: float = 60.0) -> int:
    """Files in the storage dir once their count stops moving."""
    root = Path(STORAGE_DIR[name])
    last, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = sum(len(files) for _, _, files in os.walk(root))
        if n != last:
            last, stable_since = n, time.monotonic()
        elif n > 0 and time.monotonic() - stable_since > 2.0:
            return n
        time.sleep(0.5)
    return last


@pytest.mark.parametrize("name", ["plugin", "stock"])
def test_flushed_prefix_comes_back_from_storage(name, plugin_server, stock_server, sequences):
    server = {"plugin": plugin_server, "stock": stock_server}[name]
    assert _wait_storage_settled(name) > 0, "nothing was written to the file backend"
    server.post("/flush_cache?timeout=30")  # device and host emptied; storage stays
    # Several at once: their storage prefetches are in flight together, so the
    # prefetch termination decisions cover more than one operation per pass.
    replies: dict = {}

    def send(i: int) -> None:
        replies[i] = server.generate(PROMPTS[i], max_new_tokens=8)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(replies) == [0, 1, 2, 3]
    first_texts = [t for t, _, _ in sequences[name][:4]]
    assert [replies[i]["text"] for i in range(4)] == first_texts
    from_storage = [host_tokens(replies[i], "storage") for i in range(4)]
    assert any(n > 0 for n in from_storage), from_storage


def test_prefetch_votes_pipelined_and_voted_on_the_storage_prefetches(plugin_server):
    # After the storage test: several prefetches were in flight under the default
    # timeout policy, decided by one vote reduce per pass instead of one blocking
    # reduce per waiting request.
    log = plugin_server.log()
    for rank in (0, 1):
        assert f"TP{rank}] HiCache prefetch votes: pipelined" in log
    name = "sglang:hicache_prefetch_votes_operations_total"
    voted = settled(
        lambda: {s.labels["tp_rank"]: s.value for s in metric_samples(plugin_server, name)}, 2
    )
    assert set(voted) == {"0", "1"} and voted["0"] == voted["1"] > 0, voted


@pytest.mark.parametrize("name", ["plugin", "stock"])
def test_flush_cache_over_http_while_requests_in_flight(name, plugin_server, stock_server):
    server = {"plugin": plugin_server, "stock": stock_server}[name]
    burst = prompts(12, seed=7)
    replies: dict = {}
    errors: list = []

    def send(i: int) -> None:
        try:
            replies[i] = server.generate(burst[i], max_new_tokens=16)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(burst))]
    for t in threads:
        t.start()
    flushes = []
    for _ in range(3):  # refused while busy, or done: both are fine, never a hang
        try:
            flushes.append(server.post("/flush_cache?timeout=5"))
        except Exception as exc:  # noqa: BLE001 - HTTP 400 means "not performed"
            flushes.append(exc)
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert sorted(replies) == list(range(len(burst)))
    assert all(r["meta_info"]["completion_tokens"] == 16 for r in replies.values())
    # Still serving, and a quiet flush now succeeds.
    assert server.generate(burst[0], max_new_tokens=4)["meta_info"]["completion_tokens"] == 4
    assert b"Cache flushed" in server.post("/flush_cache?timeout=30")
    assert not server.exited()
