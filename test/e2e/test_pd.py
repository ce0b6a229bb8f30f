"""PD disaggregation end to end: the decode offload sync in SGLang's real server.

Each configuration is one `cpu-server` PD pair (cpu_server/pd.py: a prefill server at
TP 1, a decode server at TP 2 with KV offload to a file store, SGLang's PD router, KV
over Mooncake TCP, all in a private network namespace with only lo), started once per
module, driven with the same greedy requests through the router, then (plugin and
stock) one decode rank killed mid-offload; what the checks need is collected before
it is stopped (``Record``), so only one server set runs at a time on the 2 cores.
The decode ranks run with skewed acks (rank 1's finish events report done three
polls after rank 0's): the offload sync counts every queued entry, finished or not,
so skew must change no pop.

- plugin vs a plain server: equal greedy tokens and logprobs (the seeded model's
  replies depend on the whole prompt, and so on the KV the prefill sent);
- negative control: a decode whose transfer buffers are registered in the wrong
  order (``--cpu-break-copies transfer``) must make that same check fail;
- plugin vs stock on the decode side: the path line and the gauge on every rank,
  offload acks and storage backups popped equal on every rank and between the two
  (counted at upstream's pop methods by cpu-server), the same store contents;
- a decode TP rank SIGKILLed mid-offload takes the decode server down, plugin and
  stock alike: by the same mechanism, within the server's own watchdog.
The two-node decode with the plugin off on one node: test_pd_mixed_nodes.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hicache_async_ack_lab.cpu_server import Server
from hicache_async_ack_lab.cpu_server.pd import PDPair
from hicache_async_ack_lab.cpu_server.pd_standins import (
    OFFLOAD_COUNT_DIR_VAR,
    PASS_TIMES_DIR_VAR,
    read_offload_counts,
    read_pass_times,
)
from hicache_async_ack_lab.cpu_server.settings import CPU_SKEW_VAR

from support.e2e_servers import (
    START_TIMEOUT_S,
    STOCK_ENV,
    Reply,
    ask,
    assert_cache_dependent,
    compare,
    metric_samples,
    prompts,
)

pytestmark = pytest.mark.e2e

PROMPTS = prompts(6, words=30, seed=34)
MAX_NEW = 16  # decode steps per request: page size 1, so an offload (and backup) each
SKEW = "0,3"
# SGLang's own bound on a scheduler that stops stepping (--watchdog-timeout's default):
# a killed rank must take its server down well within it, plugin and stock alike.
WATCHDOG_S = 300.0
KILL_MARGIN_S = 90.0
OFFLOAD_METRIC = "sglang:hicache_decode_offload_sync_popped_entries_total"
GAUGE = "sglang:hicache_decode_offload_sync_pipelined"
PATH_LINE = "HiCache decode offload sync: pipelined over the TP group (world size 2, depth 1"


@dataclass
class Record:
    """What one PD configuration showed, collected before it was stopped."""

    replies: list[Reply]
    decode_log: str = ""
    counts: dict = field(default_factory=dict)  # {rank: {"offload": n, "backup": n}}
    gauge: dict = field(default_factory=dict)  # {tp_rank: value}
    popped: dict = field(default_factory=dict)  # {tp_rank: {queue: n}} (plugin metrics)
    store: dict = field(default_factory=dict)  # {relative path: (size, sha256)}
    kill: dict = field(default_factory=dict)  # the killed rank and how the server ended
    warmup: dict = field(default_factory=dict)  # the pop counts before our first request
    skew: str = ""  # the decode's skew setting, as its processes got it
    passes: dict = field(default_factory=dict)  # the bench's pass-times device, per rank


def settled_counts(root: Path, ranks: int = 2, settle_s: float = 120.0) -> dict:
    """The pop counts once every rank shows the same and they stopped moving for 3 s
    (the plugin's ranks pop a step late, each at its own step)."""
    last, since = None, time.monotonic()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        now = read_offload_counts(root)
        if now != last:
            last, since = now, time.monotonic()
        elif len(now) == ranks and len({str(v) for v in now.values()}) == 1:
            if time.monotonic() - since > 3.0:
                break
        time.sleep(0.5)
    return last or {}


def store_contents(root: Path) -> dict:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            out[str(path.relative_to(root))] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def by_rank(server: Server, name: str) -> dict:
    out: dict = {}
    for s in metric_samples(server, name):
        if s.name == name:
            tp = s.labels["tp_rank"]
            if "queue" in s.labels:
                out.setdefault(tp, {})[s.labels["queue"]] = s.value
            else:
                out[tp] = s.value
    return out


def scheduler_pids(server: Server) -> dict[int, int]:
    """{tp rank: pid} of the server's scheduler processes (SGLang's process titles)."""
    assert server.proc is not None
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getpgid(int(d.name)) != server.proc.pid:
                continue
            title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        except (OSError, ProcessLookupError):
            continue
        if title.startswith("sglang::scheduler_TP"):
            out[int(title.removeprefix("sglang::scheduler_TP").split("_")[0])] = int(d.name)
    return out


def kill_mid_offload(pd: PDPair, counts_dir: Path) -> dict:
    """Long requests in flight, offloads being popped: SIGKILL decode rank 1, then time
    the decode server's exit (from the kill)."""
    pids = scheduler_pids(pd.decode)
    assert sorted(pids) == [0, 1], pids
    errors: list = []

    def long_request(i: int) -> None:
        try:
            pd.generate(PROMPTS[i], max_new_tokens=400, timeout=WATCHDOG_S, ignore_eos=True)
        except Exception as exc:  # noqa: BLE001 - expected: the decode server goes down
            errors.append(exc)

    threads = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(3)]
    before = sum(c["offload"] for c in read_offload_counts(counts_dir).values())
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = sum(c["offload"] for c in read_offload_counts(counts_dir).values())
        if now >= before + 20:  # offloads of the long requests are being popped
            break
        time.sleep(0.2)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    code = pd.decode.wait_exit(WATCHDOG_S)
    down_s = time.monotonic() - t0
    # The requests still in flight end when the pair stops (the router goes): no wait.
    return {"exit_code": code, "down_s": down_s, "offloads_before_kill": now - before,
            "log": pd.decode.log()}  # fmt: skip


def run_pd(tmp: Path, name: str, decode_env: dict, kill: bool = True, **kw) -> Record:
    counts_dir, passes_dir = tmp / "counts", tmp / "passes"
    pd = PDPair(
        ["--enable-metrics"], workdir=tmp / name,
        decode_env={**decode_env, OFFLOAD_COUNT_DIR_VAR: str(counts_dir),
                    PASS_TIMES_DIR_VAR: str(passes_dir)},
        start_timeout_s=START_TIMEOUT_S, **kw,
    )  # fmt: skip
    with pd:
        # SGLang's start-up warmup request (random tokens) is offloaded and stored too:
        # its pages are left out of the comparison, everything after it is ours.
        warmup = settled_counts(counts_dir) if pd.offload else {}
        warm_files = set(store_contents(pd.store))
        rec = Record([ask(pd, p, max_new_tokens=MAX_NEW) for p in PROMPTS])  # type: ignore[arg-type]
        rec.warmup = warmup
        rec.counts = settled_counts(counts_dir) if pd.offload else {}
        rec.gauge = by_rank(pd.decode, GAUGE)
        rec.popped = by_rank(pd.decode, OFFLOAD_METRIC)
        rec.store = {k: v for k, v in store_contents(pd.store).items() if k not in warm_files}
        rec.decode_log = pd.decode.log()
        rec.skew = pd.decode.env.get(CPU_SKEW_VAR, "")
        rec.passes = read_pass_times(passes_dir) if pd.offload else {}
        if kill:
            rec.kill = kill_mid_offload(pd, counts_dir)
    return rec


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[Reply]:
    tmp = tmp_path_factory.mktemp("plain")
    # A bounded pool: SGLang sizes an unbounded one at 95% of host RAM.
    args = ["--max-total-tokens", "4096", "--max-running-requests", "16"]
    server = Server(args, log_path=tmp / "plain.log", start_timeout_s=START_TIMEOUT_S)
    with server:
        return [ask(server, p, max_new_tokens=MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory, plain) -> Record:
    return run_pd(tmp_path_factory.mktemp("pd-plugin"), "plugin", {}, skew=SKEW)


@pytest.fixture(scope="module")
def stock(tmp_path_factory, plugin) -> Record:
    return run_pd(tmp_path_factory.mktemp("pd-stock"), "stock", dict(STOCK_ENV), skew=SKEW)


@pytest.fixture(scope="module")
def broken(tmp_path_factory, stock) -> Record:
    # The negative control needs only the replies: one decode rank, no offload, no kill.
    tmp = tmp_path_factory.mktemp("pd-broken")
    return run_pd(tmp, "broken", {}, kill=False, decode_tp=1, offload=False,
                  break_copies="transfer")  # fmt: skip


def test_pd_replies_equal_a_plain_servers(plain, plugin, stock):
    assert_cache_dependent(plain)
    for rec in (plugin, stock):
        c = compare(plain, rec.replies)
        print(f"compare: {c}")
        assert not c.mismatches, str(c)


def test_negative_control_the_replies_check_fails_on_a_broken_transfer(plain, broken):
    c = compare(plain, broken.replies)
    print(f"negative control: {c}")
    assert c.mismatches, f"a decode with its transfer buffers swapped passed: {c}"


def test_each_decode_rank_logs_its_path(plugin, stock):
    for rank in (0, 1):
        assert f"TP{rank}] {PATH_LINE}" in plugin.decode_log, plugin.decode_log[-3000:]
    assert plugin.skew == stock.skew == SKEW, (plugin.skew, stock.skew)
    assert "Enable offload kv cache for decode side" in stock.decode_log  # its own log
    assert "HiCache decode offload sync: pipelined" not in stock.decode_log


def test_the_gauge_reads_pipelined_on_every_rank(plugin, stock):
    assert plugin.gauge == {"0": 1.0, "1": 1.0}, plugin.gauge
    assert stock.gauge == {}, stock.gauge


def test_equal_offload_and_backup_pops_on_every_rank_plugin_and_stock(plugin, stock):
    for rec in (plugin, stock):
        assert sorted(rec.counts) == ["0", "1"], rec.counts
        assert rec.counts["0"] == rec.counts["1"], rec.counts
        assert rec.counts["0"]["offload"] > 0 and rec.counts["0"]["backup"] > 0, rec.counts
    assert plugin.counts == stock.counts, (plugin.counts, stock.counts)
    # The plugin's own metrics say the same as upstream's pop methods.
    for tp, c in plugin.counts.items():
        assert plugin.popped[tp] == {"offload": c["offload"], "backup": c["backup"]}, (
            plugin.popped,
            plugin.counts,
        )


def test_the_store_holds_the_same_pages(plugin, stock):
    assert plugin.store, "the decode offload stored nothing"
    assert plugin.store.keys() == stock.store.keys()
    sizes = {k: v[0] for k, v in plugin.store.items()}
    assert sizes == {k: v[0] for k, v in stock.store.items()}
    assert plugin.store == stock.store  # bytes too: the same requests, one at a time


def test_the_bench_times_every_decode_pass_on_every_rank_plugin_and_stock(plugin, stock):
    """The device bench-server --workload pd reads (pd_standins.PassTimes), on the real
    decode loop: both ranks, passes with a running batch and without, pops inside the
    checks; TP ranks run the same batches, so they count the same running passes."""
    for rec in (plugin, stock):
        assert sorted(rec.passes) == ["0", "1"], rec.passes
        running = []
        for rank in ("0", "1"):
            cells = rec.passes[rank]["0"]  # no latency injected here
            assert cells["running"][0] > 0 and cells["idle"][0] > 0, cells
            assert cells["running"][3] > 0, cells  # offloads popped while decoding
            assert cells["running"][1] >= cells["running"][3], cells  # pops inside checks
            running.append(cells["running"][0])
        # once per decode step of each request at least (16 new tokens, some batched)
        assert running[0] == running[1] >= MAX_NEW, rec.passes


# How a decode server goes down when one of its ranks is killed: a gloo collective on
# the surviving rank fails with its peer gone (which collective depends on where that
# rank was: the forward's, the offload's), its scheduler raises, and the SIGQUIT it
# sends takes the server down.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Connection refused")
SCHEDULER_RAISED = "Scheduler hit an exception"
SIGQUIT = "SIGQUIT received"


def _mechanism(log: str) -> dict[str, bool]:
    return {
        "peer gone": any(m in log for m in PEER_GONE),
        "scheduler raised": SCHEDULER_RAISED in log,
        "sigquit": SIGQUIT in log,
    }


def test_a_decode_rank_killed_mid_offload_takes_the_server_down_as_stock(plugin, stock):
    for rec in (plugin, stock):
        k = rec.kill
        print({key: v for key, v in k.items() if key != "log"})
        assert k["offloads_before_kill"] > 0, "the kill came before any offload was popped"
        assert k["exit_code"] is not None, "the decode server still ran after the watchdog"
        how = _mechanism(k["log"])
        assert all(how.values()), (how, k["log"][-3000:])
        # within SGLang's own bound on a scheduler that stops (its watchdog), not a
        # timeout of ours: the kill took it down, not a hang cut short
        assert k["down_s"] < WATCHDOG_S, k["down_s"]
    # As fast as stock: the same mechanism (above), and not slower by more than a wide
    # margin measured in the same run (the teardown is SGLang's, seconds either way).
    assert plugin.kill["down_s"] <= stock.kill["down_s"] + KILL_MARGIN_S, (
        plugin.kill["down_s"],
        stock.kill["down_s"],
    )
