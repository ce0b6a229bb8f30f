"""cpu-server's Mooncake pieces without a server: the private network namespace,
the mooncake_master launcher (context manager and command), the two direct copy
ops of the page_first_direct host layout, the settings, and the storage bench's
arithmetic. Needs root for the namespace (as CI has) and the Mooncake wheel."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import types
import urllib.request
from pathlib import Path

import pytest
import torch

from hicache_async_ack_lab.cpu_server import mooncake, mooncake_standins
from hicache_async_ack_lab.cpu_server.mooncake import CONFIG_PATH_VAR, Mooncake
from hicache_async_ack_lab.cpu_server.netns import NetNamespace, interfaces, only_loopback
from hicache_async_ack_lab.cpu_server.settings import server_env

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace needs root")


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _listening_ports(net: str) -> set[int]:
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(net, table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# --- the namespace -----------------------------------------------------------------


@needs_root
def test_namespace_has_only_loopback_up_and_this_process_stays_out():
    ns = NetNamespace()
    try:
        assert ns.call(interfaces) == ["lo"] and ns.call(only_loopback)
        inside = ns.call(os.readlink, "/proc/thread-self/ns/net")
        assert inside != os.readlink("/proc/thread-self/ns/net")
        assert os.readlink(ns.path) == inside

        # The same loopback port, taken here and inside: two separate stacks.
        host = socket.socket()
        host.bind(("127.0.0.1", 0))
        host.listen()
        port = host.getsockname()[1]

        def serve() -> socket.socket:
            s = socket.socket()
            s.bind(("127.0.0.1", port))  # EADDRINUSE if this were the host's stack
            s.listen()
            return s

        inner = ns.call(serve)
        try:
            for sock, connect in ((inner, lambda: ns.call(_connect, port)),
                                  (host, lambda: _connect(port))):  # fmt: skip
                other = host if sock is inner else inner
                client = connect()
                sock.settimeout(10)
                sock.accept()[0].close()  # the connection reached this side's listener
                other.settimeout(0.2)
                with pytest.raises(socket.timeout):
                    other.accept()
                client.close()
        finally:
            inner.close()
            host.close()
        # A child forked from inside is born in the namespace.
        out = ns.call(subprocess.run, ["cat", "/proc/self/net/dev"], capture_output=True,
                      text=True, timeout=30)  # fmt: skip
        names = [line.split(":")[0].strip() for line in out.stdout.splitlines()[2:]]
        assert names == ["lo"]
    finally:
        ns.close()
    with pytest.raises(RuntimeError, match="closed"):
        ns.call(interfaces)


# --- the master ----------------------------------------------------------------------


@needs_root
def test_master_up_in_the_namespace_only_and_stopped_with_everything(tmp_path):
    with Mooncake(tmp_path / "mc") as mc:
        assert mc.alive() and mc.proc is not None and mc.ns is not None
        pid = mc.proc.pid
        assert "master_key_count" in mc.metrics()
        assert os.readlink(f"/proc/{pid}/ns/net") == mc.ns.call(
            os.readlink, "/proc/thread-self/ns/net"
        )
        # Its listeners are in the namespace's table (the host's has its own ports).
        assert {mc.metrics_port, mc.rpc_port} <= _listening_ports(f"/proc/{pid}/net")
        config = json.loads(mc.config_path.read_text())
        assert config == mc.config()
        assert config["master_server_address"] == f"127.0.0.1:{mc.rpc_port}"
        assert config["protocol"] == "tcp" and config["check_server"] is False
        assert isinstance(config["global_segment_size"], int)  # SGLang parses only "gb"
        assert mc.env() == {CONFIG_PATH_VAR: str(mc.config_path)}
    assert not _alive(pid) and mc.ns is None


@needs_root
def test_master_kill_and_restart_on_the_same_address(tmp_path):
    with Mooncake(tmp_path / "mc") as mc:
        first = mc.proc.pid if mc.proc else 0
        mc.kill()
        assert not mc.alive() and not _alive(first)
        with pytest.raises(OSError):
            mc.metrics(timeout=1.0)
        port = mc.rpc_port
        mc.restart()
        assert mc.alive() and mc.rpc_port == port and mc.starts == 2
        assert "master_key_count 0" in mc.metrics()
        second = mc.proc.pid if mc.proc else 0
    assert not _alive(second)


@needs_root
def test_master_that_cannot_start_is_reported_and_nothing_is_left(tmp_path, monkeypatch):
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho 'no luck' >&2\nexit 7\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mooncake, "master_binary", lambda: fake)
    mc = Mooncake(tmp_path / "mc", start_timeout_s=10)
    with pytest.raises(mooncake.MasterFailed, match="exited with 7"):
        mc.start()
    assert mc.ns is None and "no luck" in mc.log()


@needs_root
def test_command_runs_inside_with_the_config_and_returns_its_code(tmp_path):
    script = (
        "import json, os\n"
        "names = [l.split(':')[0].strip() for l in open('/proc/self/net/dev').readlines()[2:]]\n"
        f"cfg = json.load(open(os.environ['{CONFIG_PATH_VAR}']))\n"
        "print(json.dumps({'names': names, 'master': cfg['master_server_address']}))\n"
        "raise SystemExit(3)\n"
    )
    p = argparse.ArgumentParser()
    mooncake.add_parser(p.add_subparsers())
    args, rest = p.parse_known_args(
        ["mooncake-master", "--workdir", str(tmp_path), "--", sys.executable, "-c", script]
    )
    args.rest = rest
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            rc = _in_thread(args.func, args)  # the command enters the namespace for good
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    assert rc == 3
    seen = json.loads(out.read_text())
    assert seen["names"] == ["lo"] and seen["master"].startswith("127.0.0.1:")


def _in_thread(fn, *args):
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(rc=fn(*args)))
    t.start()
    t.join(120)
    return box.get("rc")


# --- settings and guard -------------------------------------------------------------------


def test_server_env_only_for_mooncake_and_never_over_the_caller():
    assert server_env(["--hicache-storage-backend", "file"], {}) == {}
    assert server_env([], {}) == {}
    got = server_env(["--hicache-storage-backend=mooncake"], {})
    assert got == {"SGLANG_HICACHE_MOONCAKE_REUSE_TE": "0", "SGLANG_HOST_IP": "127.0.0.1"}
    assert server_env(["--hicache-storage-backend", "mooncake"], {"SGLANG_HOST_IP": "x"}) == {
        "SGLANG_HICACHE_MOONCAKE_REUSE_TE": "0"
    }


@needs_root
def test_the_store_is_refused_outside_a_loopback_only_namespace():
    created = []

    class MooncakeStore:
        def __init__(self, *args):
            created.append(args)

    module = types.SimpleNamespace(MooncakeStore=MooncakeStore)
    mooncake_standins._require_private_network(module)
    if only_loopback():
        pytest.skip("this host's own namespace has only lo")
    with pytest.raises(RuntimeError, match="private network namespace"):
        module.MooncakeStore(1)
    assert not created
    ns = NetNamespace()
    try:
        ns.call(module.MooncakeStore, 2)
    finally:
        ns.close()
    assert created == [(2,)]


# --- the two direct copy ops of page_first_direct -----------------------------------------


def _pools(layers=3, tokens=12, heads=2, dim=4, page=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev_k = [torch.randn(tokens, heads, dim, generator=g) for _ in range(layers)]
    dev_v = [torch.randn(tokens, heads, dim, generator=g) for _ in range(layers)]
    pages = tokens // page + 1
    host = [torch.zeros(pages, layers, page, heads, dim) for _ in range(2)]
    return dev_k, dev_v, host


@pytest.mark.parametrize("page", [1, 4])
def test_direct_ops_copy_rows_between_token_and_page_first_layouts(page):
    dev_k, dev_v, host = _pools(page=page)
    layers = len(dev_k)
    src = torch.tensor([1, 2, 3, 4, 8, 9, 10, 11])
    dst = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])
    mooncake_standins.transfer_kv_all_layer_direct_lf_pf(dev_k + dev_v, host, src, dst, page)
    for j, dev in enumerate((dev_k, dev_v)):
        for layer in range(layers):
            for s, d in zip(src.tolist(), dst.tolist()):
                assert torch.equal(host[j][d // page, layer, d % page], dev[layer][s])
    assert host[0].abs().sum() > 0
    # Back, one layer at a time, into fresh device rows.
    back_k = [torch.zeros_like(t) for t in dev_k]
    back_v = [torch.zeros_like(t) for t in dev_v]
    for layer in range(layers):
        mooncake_standins.transfer_kv_per_layer_direct_pf_lf(
            host, [back_k[layer], back_v[layer]], dst, src, layer, page
        )
    for layer in range(layers):
        assert torch.equal(back_k[layer][src], dev_k[layer][src])
        assert torch.equal(back_v[layer][src], dev_v[layer][src])
        untouched = torch.tensor([0, 5, 6, 7])
        assert back_k[layer][untouched].abs().sum() == 0


@pytest.mark.parametrize("mode", ["noop", "swap"])
def test_broken_direct_ops_do_not_round_trip(mode):
    # The negative control's versions must break a trip to the host and back, or the
    # e2e checks that compare tokens after a Mooncake round trip prove nothing.
    dev_k, dev_v, host = _pools(page=4)
    src = torch.arange(8)
    put = mooncake_standins._broken(mooncake_standins.transfer_kv_all_layer_direct_lf_pf, mode)
    get = mooncake_standins._broken(mooncake_standins.transfer_kv_per_layer_direct_pf_lf, mode)
    put(dev_k + dev_v, host, src, src, 4)
    for layer in range(len(dev_k)):
        back_k, back_v = torch.zeros_like(dev_k[layer]), torch.zeros_like(dev_v[layer])
        get(host, [back_k, back_v], src, src, layer, 4)
        assert not torch.equal(back_k[src], dev_k[layer][src])
        assert not torch.equal(back_v[src], dev_v[layer][src])


def test_ops_bound_into_the_host_pool_module_only_where_missing(monkeypatch):
    monkeypatch.delenv("HICACHE_ASYNC_ACK_CPU_BREAK_COPIES", raising=False)
    module = types.SimpleNamespace(transfer_kv_all_layer_direct_lf_pf=len)
    mooncake_standins._bind_direct_ops(module)
    assert module.transfer_kv_all_layer_direct_lf_pf is len  # a real one stays
    assert (
        module.transfer_kv_per_layer_direct_pf_lf
        is mooncake_standins.transfer_kv_per_layer_direct_pf_lf
    )


def test_registered_with_cpu_servers_patches():
    from hicache_async_ack_lab.cpu_server import standins

    assert "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store" in standins.PATCHES
    assert "mooncake host layout" in standins.STANDINS
    assert "sglang.srt.mem_cache.pool_host.mha" in standins.PATCHES


def test_counts_written_per_rank_and_read_back(tmp_path, monkeypatch):
    counts = mooncake_standins._Counts(tmp_path)
    # a blocking reduce in a pass with nothing to decide, then one blocking and
    # one async in a deciding pass: only the last two count as deciding
    for in_flight, collectives in ((0, [True]), (3, [True, False]), (5, []), (0, [])):
        counts.pass_seen(in_flight)
        for blocking in collectives:
            counts.collective_seen(blocking)
    counts.write()
    got = mooncake_standins.read_counts(tmp_path)
    assert got == {"0": {"passes": 4, "blocking": 2, "prefetch_passes": 2,
                         "prefetches_voted": 8, "prefetch_max": 5,
                         "deciding_all_reduces": 2, "l3_queries": 0,
                         "l3_queries_assumed": 0, "l3_tokens_loaded": 0}}  # fmt: skip
    # SGLang's own outcome counters, where the release keeps them: the latest snapshot
    counts.outcomes_seen({"issued": 3, "declined_rate_limited": 1, "attempts": 9})
    counts.outcomes_seen({"issued": 7, "declined_rate_limited": 4, "attempts": 12})
    counts.write()
    got = mooncake_standins.read_counts(tmp_path)["0"]
    assert (got["issued"], got["declined_rate_limited"]) == (7, 4)
    assert "attempts" not in got and "declined_too_short" not in got


# --- the storage bench's arithmetic -----------------------------------------------------


def test_storage_round_figures_and_headline():
    from hicache_async_ack_lab.bench import storage

    replies = [
        {"ttft_s": 0.1 * (i + 1), "latency_s": 1.0,
         "meta": {"completion_tokens": 4, "cached_tokens_details": {"storage": 10 * (i % 2)}}}
        for i in range(4)
    ]  # fmt: skip
    f = storage.round_figures(replies, 2.0, {"passes": 10, "blocking": 25, "prefetches_voted": 30})
    assert f["prefetches_issued"] is None  # a release without SGLang's outcome counters
    f = storage.round_figures(replies, 2.0, {"passes": 10, "blocking": 25, "prefetches_voted": 30,
                                             "issued": 6, "declined_rate_limited": 2})  # fmt: skip
    assert (f["prefetches_issued"], f["declined_rate_limited"]) == (6, 2)
    assert f["output_throughput"] == pytest.approx(8.0)
    assert f["storage_hit_share"] == pytest.approx(0.5)
    assert f["blocking_per_pass"] == pytest.approx(2.5)
    assert f["prefetches_per_pass"] == pytest.approx(3.0)
    assert f["all_reduce_per_deciding_pass"] is None  # no pass had a prefetch to decide
    f = storage.round_figures(replies, 2.0, {"passes": 10, "prefetch_passes": 4,
                                             "deciding_all_reduces": 6})  # fmt: skip
    assert f["all_reduce_per_deciding_pass"] == pytest.approx(1.5)
    assert f["median_ttft_ms"] == pytest.approx(250.0)
    row = {"ratio": "plugin / own 0 ms", "low": 0.96, "high": 1.02, "claim": ">= 0.98"}
    rows = storage.with_headline([row])
    assert [r["claim"] for r in rows] == [">= 0.98", ">= 0.95"]
    assert rows[1]["verdict"] == "holds"
    assert storage.with_headline([row | {"low": 0.90, "high": 0.94}])[1]["verdict"] == "fails"
    assert storage.with_headline([row | {"low": 0.90}])[1]["verdict"] == "inconclusive"


def test_the_counts_attribute_every_all_reduce_to_its_pass(tmp_path):
    """Blocking and async all_reduces count toward the deciding passes only
    while the pass they run in has a prefetch in flight."""
    from hicache_async_ack_lab.cpu_server.mooncake_standins import _Counts

    c = _Counts(tmp_path)
    c.pass_seen(0)
    c.collective_seen()  # an idle pass's ack reduce
    c.pass_seen(3)
    c.collective_seen(blocking=False)  # the plugin's one async reduce
    c.pass_seen(2)
    c.collective_seen()
    c.collective_seen()  # stock: the ack reduce and one per request
    v = c.values
    assert (v["passes"], v["prefetch_passes"], v["blocking"]) == (3, 2, 3)
    assert v["deciding_all_reduces"] == 3


def test_storage_mode_is_a_bench_server_option():
    from hicache_async_ack_lab.cli import build_parser

    args = build_parser().parse_args(["bench-server", "--storage", "mooncake"])
    assert args.storage == "mooncake" and args.storage_prompts > 1


@needs_root
def test_metrics_not_reachable_from_the_host_namespace(tmp_path):
    with Mooncake(tmp_path / "mc") as mc:
        assert "master_key_count" in mc.metrics()  # from inside it answers
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{mc.metrics_port}/metrics", timeout=2
            ) as r:
                body = r.read().decode(errors="replace")
        except OSError:
            body = ""  # refused: nothing there on the host
        assert "master_key_count" not in body  # whatever answers there, it is not the master
