"""End to end on Mooncake, the L3 store operators run with HiCache: plugin and
stock side by side at TP=2 on SGLang's real server (cpu-server).

Each arm has its own ``mooncake_master`` (a store outlives ``/flush_cache``, so the
arms never share one), in a private network namespace with only ``lo``, as its
servers and their HTTP clients (tools/cpu_server/mooncake.py). Servers start once
per class: write-through to Mooncake in ``cache`` host memory mode, with a fresh
second server started beside the first (cross-instance reuse: Mooncake keeps
objects in the segments its clients mount, so the first must stay up); then fresh
servers in ``buffer_only`` mode (host memory only a staging buffer) against the
same masters, and the faults on them. Findings (hit ratios, the fault table) are
printed and written to ``mooncake-findings.json`` in the module's temp dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import urllib.error
import uuid
from pathlib import Path

import pytest

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack_lab.cpu_server import free_port
from hicache_async_ack_lab.cpu_server.mooncake import Mooncake, MooncakeServer
from hicache_async_ack_lab.cpu_server.mooncake_standins import COUNT_DIR_VAR, read_counts
from hicache_async_ack_lab.cpu_server.netns import only_loopback

from support.e2e_servers import (
    BASE_ARGS,
    START_TIMEOUT_S,
    STOCK_ENV,
    Reply,
    ask,
    ask_together,
    assert_cache_dependent,
    assert_same,
    compare,
    metric_samples,
    popped_by_rank,
    prompts,
    settled,
)

pytestmark = pytest.mark.e2e

MOONCAKE_ARGS = [
    "--hicache-write-policy", "write_through",
    "--hicache-storage-backend", "mooncake",
    # ~110-token prompts: below upstream's 256-token default no prefetch starts.
    # The prefetch timeout stays at its default (the hit ratios are about it).
    "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 16}',
]  # fmt: skip
BUFFER_ONLY = ["--hicache-host-memory-mode", "buffer_only"]
# What the log shows when the store's clients lost their master: Mooncake named, a
# Mooncake client's own glog error (E1206 04:53:42.152038 3188 master_client.cpp:406] ...),
# or SGLang's count of pages that failed to reach the store.
STORE_TROUBLE = re.compile(r"ooncake|^E\d{4} [\d:.]+ +\d+ \w+\.cpp:\d+\]|pages failed", re.M)

ARMS = {"plugin": {ENABLE_VAR: "1"}, "stock": STOCK_ENV}
PROMPTS = prompts(10, seed=23)
BURST = prompts(8, seed=230)  # new prompts: write-backs while old ones prefetch
REQUEST_TIMEOUT_S = 300.0

# What the module learned, for the report (and the closing note).
FINDINGS: dict = {"hit_ratio": {}, "faults": [], "startup_s": {}}
# The cache-mode servers' first-pass replies (computed, no cache): the fault-free
# reference of every later check, tokens and logprobs (e2e_servers.compare).
REFERENCE: dict[str, list[Reply]] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mooncake")
    yield path
    (path / "mooncake-findings.json").write_text(json.dumps(FINDINGS, indent=1) + "\n")
    print("\nMooncake findings:\n" + json.dumps(FINDINGS, indent=1))


@pytest.fixture(scope="module")
def masters(workdir):
    with contextlib.ExitStack() as stack:
        yield {arm: stack.enter_context(Mooncake(workdir / f"master-{arm}")) for arm in ARMS}


def start_arms(masters, workdir: Path, name: str, extra=()) -> dict[str, MooncakeServer]:
    """Both arms' servers, started at once (each waits on its own imports)."""
    servers = {}
    for arm, env in ARMS.items():
        counts = workdir / f"counts-{name}-{arm}"
        counts.mkdir()
        servers[arm] = MooncakeServer(
            masters[arm],
            [*BASE_ARGS, *MOONCAKE_ARGS, *extra],
            env={**env, COUNT_DIR_VAR: str(counts)},
            log_path=workdir / f"{name}-{arm}.log",
            start_timeout_s=START_TIMEOUT_S,
            wait=False,
        )
        servers[arm].counts_dir = counts  # type: ignore[attr-defined]
    t0 = time.monotonic()
    try:
        for s in servers.values():
            s.start()
        for arm, s in servers.items():
            s._ns().call(s.wait_ready)
            # Both started at once: ready by then (the second waited on the first's check).
            FINDINGS["startup_s"][f"{name}-{arm}"] = round(time.monotonic() - t0, 1)
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


def send_all(server, texts, rids=None) -> dict:
    """Every text at once (their prefetches in flight together): {i: Reply, raw reply
    dict (with ``rids``: those can be aborted) or the exception}."""
    out: dict = {}

    def send(i: int) -> None:
        try:
            out[i] = _generate(server, texts[i], rids[i]) if rids else ask(server, texts[i])
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            out[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    return out


def _generate(server, text: str, rid: str) -> dict:
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    body = {"text": text, "rid": rid, "sampling_params": params}
    return json.loads(server.post("/generate", body, timeout=REQUEST_TIMEOUT_S))


def hit_ratio(replies: list[Reply]) -> dict:
    hits = [r.storage for r in replies]
    return {
        "prompts_with_storage_hit": sum(h > 0 for h in hits),
        "prompts": len(hits),
        "storage_tokens": sum(hits),
        "cached_tokens": sum(r.cached for r in replies),
    }


def keys_settled(mc: Mooncake, timeout_s: float = 60.0) -> int:
    """The master's key count once write-backs stop adding to it."""
    assert mc.key_count() is not None, "mooncake_master exposes no master_key_count"
    return mc.settled_keys(timeout_s)


def _listening() -> dict[int, int]:
    """Listening TCP sockets of the calling thread's network namespace: inode -> port."""
    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/thread-self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def group_sockets(pgid: int) -> set[int]:
    """Inodes of the sockets every process of process group ``pgid`` holds."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != pgid:
                continue
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
        except OSError:  # gone meanwhile
            continue
    return inodes


def flush(server) -> None:
    """Device and host emptied (the store stays); retried while requests drain."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if b"Cache flushed" in server.post("/flush_cache?timeout=30"):
                return
        except urllib.error.HTTPError:
            pass
        assert time.monotonic() < deadline, "flush_cache refused for a minute"
        time.sleep(1.0)


def by_rank(server, name: str) -> dict:
    return settled(lambda: {s.labels["tp_rank"]: s.value for s in metric_samples(server, name)
                            if not s.name.endswith("_created")}, 2)  # fmt: skip


def plugin_failures(server) -> float:
    names = (
        "sglang:hicache_ack_sync_failures_total",
        "sglang:hicache_prefetch_votes_failures_total",
    )
    return sum(s.value for n in names for s in metric_samples(server, n) if s.name == n)


# --- cache mode: write-through to Mooncake, flushed prefixes come back -------------


class TestCacheMode:
    @pytest.fixture(scope="class")
    def servers(self, masters, workdir):
        servers = start_arms(masters, workdir, "cache")
        try:
            yield servers
        finally:
            for s in servers.values():
                s.stop()

    @pytest.fixture(scope="class")
    def first_pass(self, servers):
        for arm, s in servers.items():
            REFERENCE[arm] = [ask(s, p) for p in PROMPTS]
        return REFERENCE

    def test_servers_live_in_the_private_namespace_and_listen_on_no_host_interface(
        self, servers, masters
    ):
        owned = set()  # the sockets of the servers' and masters' process groups
        for arm, s in servers.items():
            ns = masters[arm].ns
            assert ns is not None and ns.call(only_loopback)
            private = ns.call(os.readlink, "/proc/thread-self/ns/net")
            assert private != os.readlink("/proc/thread-self/ns/net")  # this process stays out
            assert s.proc is not None
            assert os.readlink(f"/proc/{s.proc.pid}/ns/net") == private
            inside = ns.call(_listening)
            assert {s.port, masters[arm].rpc_port} <= set(inside.values()), inside
            assert masters[arm].proc is not None
            mine = group_sockets(s.proc.pid) | group_sockets(masters[arm].proc.pid)
            assert set(inside) & mine  # they do listen, inside
            owned |= mine
        # Nothing of theirs (HTTP, master, transfer engines) listens on the host: none
        # of their sockets is in the host's table (ports alone could be anyone's).
        assert owned and not set(_listening()) & owned

    def test_each_rank_logs_its_path(self, servers):
        log = servers["plugin"].log()
        for rank in (0, 1):
            assert f"TP{rank}] HiCache ack sync: pipelined" in log
            assert f"TP{rank}] HiCache prefetch votes: pipelined" in log
        assert "MooncakeStore" in log or "Mooncake" in log
        assert "HiCache ack sync: pipelined" not in servers["stock"].log()

    def test_first_pass_same_tokens_plugin_and_stock(self, first_pass):
        assert_cache_dependent(REFERENCE["plugin"])
        assert_same(REFERENCE["stock"], REFERENCE["plugin"], restored=False)

    def test_flushed_prefixes_come_back_from_mooncake(self, servers, masters, first_pass):
        for arm, s in servers.items():
            assert keys_settled(masters[arm]) > 0, f"{arm}: nothing reached the store"
            flush(s)
            # All ten at once: many storage prefetches in flight together.
            replies = ask_together(s, PROMPTS)
            assert_same(REFERENCE[arm], replies)  # restored: some from Mooncake
            assert any(r.storage > 0 for r in replies), arm
            FINDINGS["hit_ratio"][f"cache-{arm}"] = hit_ratio(replies)

    def test_votes_pipelined_equal_on_both_ranks_with_many_in_flight(self, servers):
        s = servers["plugin"]
        voted = by_rank(s, "sglang:hicache_prefetch_votes_operations_total")
        assert set(voted) == {"0", "1"} and voted["0"] == voted["1"] > 0, voted
        assert plugin_failures(s) == 0
        # Several prefetches in flight in one pass (SGLang's own ongoing_prefetch,
        # counted by cpu-server at each scheduling pass), on every rank.
        counts = {arm: read_counts(x.counts_dir) for arm, x in servers.items()}
        for arm, by in counts.items():
            assert set(by) == {"0", "1"}, (arm, by)
            assert all(c["prefetch_max"] > 1 for c in by.values()), (arm, by)
        FINDINGS["votes"] = {"operations_voted": voted["0"], "counts": counts}
        FINDINGS["collectives_per_pass"] = {
            arm: round(by["0"]["blocking"] / max(1, by["0"]["passes"]), 3)
            for arm, by in counts.items()
        }

    def test_storage_queue_entries_popped_equal_on_every_rank(self, servers):
        popped = popped_by_rank(servers["plugin"], 2)
        assert set(popped) == {"0", "1"}
        assert popped["0"] == popped["1"], popped
        storage = {q: v for q, v in popped["0"].items() if "prefetch" in q or "backup" in q}
        assert storage and all(v > 0 for v in storage.values()), popped["0"]

    # soak: a third server start; Mooncake's sharing, not the plugin's
    @pytest.mark.soak
    def test_cross_instance_reuse_a_fresh_server_hits_what_the_first_stored(
        self, servers, masters, workdir, first_pass
    ):
        # The first server stays up: Mooncake keeps objects in the segments its
        # clients (the first server's ranks) mount. The second waits for its reads:
        # its first ones open transfer-engine connections to the first server's
        # segments, which on a busy box can outlast the default 1 s prefetch
        # timeout (then nothing is restored and the check below sees a recompute).
        second = MooncakeServer(
            masters["plugin"],
            [*BASE_ARGS, *MOONCAKE_ARGS, "--hicache-storage-prefetch-policy", "wait_complete"],
            env=ARMS["plugin"],
            log_path=workdir / "second-plugin.log", start_timeout_s=START_TIMEOUT_S,
        )  # fmt: skip
        t0 = time.monotonic()
        with second:
            FINDINGS["startup_s"]["second-plugin"] = round(time.monotonic() - t0, 1)
            replies = ask_together(second, PROMPTS)
        assert_same(REFERENCE["plugin"], replies)
        assert any(r.storage > 0 for r in replies)
        FINDINGS["hit_ratio"]["second-server-plugin"] = hit_ratio(replies)

    def test_stock_pipelines_nothing(self, servers):
        # Stock exports no series of the plugin at all (so "all zero" would pass on
        # nothing); the plugin server beside it exports one per rank.
        for name in (
            "sglang:hicache_ack_sync_pipelined",
            "sglang:hicache_prefetch_votes_pipelined",
        ):
            assert len(metric_samples(servers["plugin"], name)) == 2, name
            assert metric_samples(servers["stock"], name) == [], name


# --- buffer_only: everything cached in the store; a fresh server reuses it ------------


class TestBufferOnly:
    @pytest.fixture(scope="class")
    def servers(self, masters, workdir):
        servers = start_arms(masters, workdir, "buffer_only", BUFFER_ONLY)
        try:
            yield servers
        finally:
            for s in servers.values():
                s.stop()

    @pytest.fixture(scope="class")
    def stored(self, servers):
        if len(REFERENCE) < 2:
            pytest.skip("needs TestCacheMode's fault-free reference texts")
        # Fresh servers: a store's objects live in the segments its servers' ranks
        # mount, so what the cache-mode servers stored left with them.
        return {arm: ask_together(s, PROMPTS) for arm, s in servers.items()}

    def test_paths_and_mode(self, servers):
        # The prefetch votes pipeline in buffer_only too; the ack sync names its
        # path and why on every rank (it pipelines only in 'cache' mode).
        log = servers["plugin"].log()
        paths = {}
        for rank in (0, 1):
            assert f"TP{rank}] HiCache prefetch votes: pipelined" in log
            lines = [x for x in log.splitlines() if f"TP{rank}] HiCache ack sync: " in x]
            assert lines, f"rank {rank} logs no ack sync path"
            paths[rank] = lines[-1].split("HiCache ack sync: ", 1)[1]
        assert paths[0] == paths[1], paths
        FINDINGS["buffer_only_ack_sync_path"] = paths[0]

    def test_first_pass_same_tokens_as_cache_mode(self, stored):
        for arm, replies in stored.items():
            assert_same(REFERENCE[arm], replies, restored=False)

    def test_buffer_only_new_prefixes_come_back_from_the_store(self, servers, masters, stored):
        for arm, s in servers.items():
            first = [ask(s, p) for p in BURST]
            keys_settled(masters[arm])
            flush(s)
            again = ask_together(s, BURST)
            assert_same(first, again)
            assert any(r.storage > 0 for r in again), arm
            assert all(r.host == 0 for r in again), arm  # host memory only stages
            FINDINGS["hit_ratio"][f"buffer_only-{arm}"] = hit_ratio(again)
            REFERENCE[f"burst-{arm}"] = first
        assert_same(REFERENCE["burst-stock"], REFERENCE["burst-plugin"], restored=False)

    def test_votes_and_pops_equal_on_every_rank(self, servers, stored):
        s = servers["plugin"]
        voted = by_rank(s, "sglang:hicache_prefetch_votes_operations_total")
        assert set(voted) == {"0", "1"} and voted["0"] == voted["1"] > 0, voted
        popped = popped_by_rank(s, 2)
        if popped:  # only where the ack sync pipelines
            assert set(popped) == {"0", "1"} and popped["0"] == popped["1"], popped
        assert plugin_failures(s) == 0

    # --- faults, on these servers, after the fault-free checks above ------------------

    def _record(self, fault: str, arm: str, replies: dict, expected: list, server, note=""):
        """One row of the fault table: lost requests, wrong tokens (raw replies: text)."""
        lost = [i for i, r in replies.items() if isinstance(r, Exception)]
        got = {i: r for i, r in replies.items() if not isinstance(r, Exception)}
        wrong: list = []
        pairs = [(expected[i], r) for i, r in sorted(got.items()) if isinstance(r, Reply)]
        if pairs:
            c = compare([a for a, _ in pairs], [b for _, b in pairs])
            wrong += list(c.mismatches)
        wrong += [
            i for i, r in got.items() if isinstance(r, dict) and r["text"] != expected[i].text
        ]
        storage = [r.storage for r in got.values() if isinstance(r, Reply)]
        FINDINGS["faults"].append({
            "fault": fault, "arm": arm, "requests": len(replies), "lost": len(lost),
            "wrong_tokens": len(wrong), "errors": [repr(replies[i])[:200] for i in lost],
            "storage_hits": storage, "alive": not server.exited(), "note": note,
        })  # fmt: skip
        return lost, wrong

    @pytest.mark.parametrize("arm", ARMS)
    def test_fault_abort_during_prefetches(self, arm, servers):
        s = servers[arm]
        flush(s)
        rids = [f"abort-{uuid.uuid4().hex}" for _ in PROMPTS]
        aborted = set(range(0, len(PROMPTS), 3))
        replies: dict = {}
        sender = threading.Thread(target=lambda: replies.update(send_all(s, PROMPTS, rids=rids)))
        sender.start()
        time.sleep(0.2)
        for i in sorted(aborted):
            s.post("/abort_request", {"rid": rids[i]})
        sender.join(REQUEST_TIMEOUT_S + 60)
        assert sorted(replies) == list(range(len(PROMPTS)))
        # An aborted request ends (abort finish reason, or done first); the rest
        # complete with the fault-free tokens.
        kept = {i: r for i, r in replies.items() if i not in aborted}
        lost, wrong = self._record("abort during prefetches", arm, kept,
                                   REFERENCE[arm], s)  # fmt: skip
        FINDINGS["faults"][-1]["aborted"] = [
            (r["meta_info"].get("finish_reason") or {}).get("type")
            if isinstance(r, dict) else repr(r)[:80]
            for i, r in sorted(replies.items()) if i in aborted
        ]  # fmt: skip
        assert not lost and not wrong, FINDINGS["faults"][-1]
        assert_same(REFERENCE[arm], ask_together(s, PROMPTS), restored=False)

    @pytest.mark.parametrize("arm", ARMS)
    def test_fault_flush_during_prefetches(self, arm, servers):
        s = servers[arm]
        flush(s)
        replies: dict = {}
        sender = threading.Thread(target=lambda: replies.update(send_all(s, PROMPTS)))
        sender.start()
        for _ in range(5):  # refused while busy, or done: never a hang
            with contextlib.suppress(urllib.error.HTTPError):
                s.post("/flush_cache?timeout=2")
            time.sleep(0.1)
        sender.join(REQUEST_TIMEOUT_S + 60)
        lost, wrong = self._record("flush_cache during prefetches", arm, replies,
                                   REFERENCE[arm], s)  # fmt: skip
        assert not lost and not wrong, FINDINGS["faults"][-1]

    @pytest.mark.parametrize("arm", ARMS)
    def test_fault_master_killed_with_prefetches_and_writes_in_flight(self, arm, servers, masters):
        s, mc = servers[arm], masters[arm]
        flush(s)
        # Old prompts prefetch from the store, new ones write back to it.
        fresh = prompts(6, seed=2300 + len(arm))
        texts = PROMPTS + fresh
        replies: dict = {}
        sender = threading.Thread(target=lambda: replies.update(send_all(s, texts)))
        sender.start()
        time.sleep(0.3)
        mc.kill()
        sender.join(REQUEST_TIMEOUT_S + 60)
        # The fault-free tokens of the new prompts: this server's own once the
        # store is gone (recomputed).
        after = [ask(s, t) for t in texts]
        expected = REFERENCE[arm] + after[len(PROMPTS) :]
        lost, wrong = self._record("mooncake_master killed, prefetches and write-backs in flight",
                                   arm, replies, expected, s)  # fmt: skip
        c = compare(REFERENCE[arm], after[: len(PROMPTS)])
        FINDINGS["faults"][-1]["after_kill_same_tokens"] = not c.mismatches
        assert not lost and not wrong, FINDINGS["faults"][-1]
        assert not c.mismatches, str(c)
        if arm == "plugin":
            assert plugin_failures(s) == 0
            # Still on the path it started on (in buffer_only the ack sync stands down
            # from the start; the votes pipeline): a fault changes neither.
            votes = metric_samples(s, "sglang:hicache_prefetch_votes_pipelined")
            assert sorted(x.value for x in votes) == [1.0, 1.0], votes

    @pytest.mark.parametrize("arm", ARMS)
    def test_fault_master_restarted(self, arm, servers, masters):
        s, mc = servers[arm], masters[arm]
        if mc.alive():
            mc.kill()
        mc.restart()  # an empty store on the same address
        texts = prompts(6, seed=2400 + len(arm))
        first = [ask(s, t) for t in texts]
        keys = keys_settled(mc, timeout_s=30)
        flush(s)
        again = send_all(s, texts)
        hits = [r.storage for r in again.values() if isinstance(r, Reply)]
        lost, wrong = self._record("mooncake_master restarted (empty), new prefixes", arm,
                                   again, first, s,
                                   note=f"keys in the new master: {keys}")  # fmt: skip
        FINDINGS["faults"][-1]["storage_hits_resumed"] = any(h > 0 for h in hits)
        assert not lost and not wrong, FINDINGS["faults"][-1]
        if not any(h > 0 for h in hits):
            # Not resumed: the log must say why (the store's clients lost the master).
            said = STORE_TROUBLE.search(s.log(400))
            assert said, "no storage hit after the restart, and no word why"


# --- two nodes, buffer_only, the plugin disabled on one: both stop ---------------------


# soak: two more nodes; test_mixed_nodes.py stops a mixed pair in CI
@pytest.mark.soak
def test_two_nodes_buffer_only_plugin_disabled_on_one_stop_both(masters, workdir):
    mc = masters["plugin"]
    if not mc.alive():
        mc.restart()
    assert mc.ns is not None
    dist = f"127.0.0.1:{mc.ns.call(free_port)}"
    nodes = []
    for rank, env in ((0, ARMS["plugin"]), (1, STOCK_ENV)):
        args = [*BASE_ARGS, *MOONCAKE_ARGS, *BUFFER_ONLY,
                "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist]  # fmt: skip
        nodes.append(MooncakeServer(mc, args, env=env, log_path=workdir / f"node{rank}.log",
                                    wait=False))  # fmt: skip
    try:
        for node in nodes:
            node.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not all(n.exited() for n in nodes):
            if not nodes[0].exited():
                with contextlib.suppress(OSError):
                    reply = _generate(nodes[0], PROMPTS[0], 4)
                    pytest.fail(f"the mixed group served a request: {reply}")
            time.sleep(2.0)
        logs = [n.log() for n in nodes]
        assert all(n.exited() for n in nodes), "a node still runs:\n" + logs[0][-3000:]
        # Node 0 knows why: in buffer_only its ack sync stands down, so it is the
        # prefetch votes' (or the ack sync's) agreement that names the peer.
        named = [m for m in ("PrefetchVoteMismatch", "HiCacheAckSyncMismatch") if m in logs[0]]
        FINDINGS["two_node_buffer_only"] = {"named": named, "exits": [n.proc.returncode
                                            for n in nodes if n.proc]}  # fmt: skip
        assert named, logs[0][-4000:]
    finally:
        for node in nodes:
            node.stop()


# --- the negative control: the same checks must fail on broken copies ------------------


def test_negative_control_broken_copies_fail_the_mooncake_comparison(workdir):
    """A server whose page_first_direct copies are broken on purpose (K and V swapped
    on the way to host, so in what Mooncake stores): the comparison the tests above
    pass must report mismatches here, or it could not see a wrong restore."""
    from hicache_async_ack_lab.cpu_server.settings import CPU_BREAK_COPIES_VAR

    with Mooncake(workdir / "master-broken") as mc:
        server = MooncakeServer(
            mc, [*BASE_ARGS, *MOONCAKE_ARGS], env={**STOCK_ENV, CPU_BREAK_COPIES_VAR: "swap"},
            log_path=workdir / "broken.log", start_timeout_s=START_TIMEOUT_S,
        )  # fmt: skip
        with server:
            first = [ask(server, p) for p in PROMPTS]  # computed: right
            keys_settled(mc)
            flush(server)
            again = ask_together(server, PROMPTS)
    c = compare(first, again)
    FINDINGS["negative_control"] = str(c)
    assert c.restored > 0, f"nothing came back from Mooncake: {c}"
    assert c.mismatches, f"broken copies went unnoticed: {c}"


# --- the storage bench: a whole burst waits on its prefetches ---------------------------


def _storage_bench(tmp_path: Path, *argv: str) -> dict:
    import subprocess
    import sys

    out = tmp_path / "storage.jsonl"
    cmd = [sys.executable, "-m", "hicache_async_ack_lab", "bench-server", "--storage", "mooncake",
           "--arms", "plugin", "--latency-ms", "0", "--rounds", "1", "--runs", "1", *argv,
           "--out", str(out), "--png", str(tmp_path / "storage.png"),
           "--workdir", str(tmp_path / "work"), "--quiet"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (visit,) = json.loads(out.read_text().splitlines()[-1])["visits"]
    (run,) = visit["runs"]
    return run


# soak: two bench runs on Mooncake; test_bench_server.py runs the shared-prompt one in CI
@pytest.mark.soak
def test_the_storage_bench_keeps_a_whole_burst_waiting_on_its_prefetches(tmp_path):
    # The default host pool takes the burst: every prompt's prefetch is issued, none is
    # declined for want of host memory, and many are decided on in the same pass.
    run = _storage_bench(tmp_path / "default")
    assert run["prefetches_issued"] >= 24 and run["declined_rate_limited"] == 0, run
    assert run["prefetch_max"] > 1 and run["storage_tokens"] > 0, run
    # Negative control: at 4x the device pool (the bench's first default) SGLang's
    # prefetch budget, half the host pool, is full before the burst is, and it declines.
    small = _storage_bench(tmp_path / "small", "--hicache-ratio", "4")
    assert small["declined_rate_limited"] > 0, small
