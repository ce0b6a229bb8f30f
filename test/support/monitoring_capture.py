"""Real /metrics expositions of real cpu-servers, recorded as the fixtures the
alert-rule tests are built from (test/data/monitoring/).

``python test/support/monitoring_capture.py [config ...]`` re-captures them (all by
default; a few minutes per configuration on a loaded box). Each configuration
is scraped twice, as the two scrape protocols a Prometheus can negotiate: the
plain-text format (``<name>.txt``, names keep their ``sglang:`` colon) and
OpenMetrics, with the Accept header Prometheus 2.42 sends (``<name>.om``,
prometheus_client writes ``sglang_``). Only the HiCache families are kept (ours
and SGLang's own ``hicache_*``): the rest of the exposition is model and request
metrics no rule reads.

Configurations (TP=2, HiCache, metrics, the e2e tests' arguments, and a file
storage backend, so the prefetch votes run too):
- ``plugin-fresh``: the plugin, just started (no request served yet);
- ``plugin``: the same server after traffic (acks popped, waits observed);
- ``plugin-idle``: the same server IDLE_S later, no request in between;
- ``stock``: SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0 (SGLang's blocking path);
- ``inert``: the plugin installed, one fingerprinted SGLang method drifted
  (test/support/monitoring_boot/): the version guard keeps it inert;
- ``slow-fresh`` / ``slow``: the plugin with a 50 ms reduce (cpu-server's latency
  model), just started and after traffic: the waits are not hidden;
- ``decode-offload`` / ``decode-offload-slow``: a PD decode server (TP=2, KV
  offload to a file store, cpu-server's PD pair) with a 50 ms offload reduce, after
  one request and after traffic;
- ``mixed-node0`` / ``mixed-node1``: a two-node launch (one rank each), node 0
  with the plugin, node 1 with it disabled: the last exposition each node
  served before the group stopped (``.status`` says how it ended).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional

from hicache_async_ack.names import ACK_COUNTS, PREFETCH_VOTES

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: `support` importable
    sys.path.insert(0, str(HERE.parent))

DATA = HERE.parent / "data" / "monitoring"
DRIFT_BOOT = HERE / "monitoring_boot"
TEXT_ACCEPT = "text/plain;version=0.0.4"
# What Prometheus 2.42 asks for (scrape/scrape.go, scrapeAcceptHeader).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
FORMATS = {"txt": TEXT_ACCEPT, "om": PROMETHEUS_ACCEPT}
CONFIGS = ("plugin", "stock", "inert", "mixed", "slow", "decode-offload")
SLOW_REDUCE_MS = 50.0


def scrape(url: str, accept: str, timeout: float = 10.0) -> str:
    req = urllib.request.Request(url + "/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def keep_hicache(text: str) -> str:
    """The HiCache families of an exposition (HELP/TYPE/samples), in order; an
    OpenMetrics exposition keeps its ``# EOF``."""
    out = []
    for line in text.splitlines():
        if line == "# EOF":
            out.append(line)
            continue
        name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else line
        if "hicache_" in name.split("{")[0].split(" ")[0]:
            out.append(line)
    return "\n".join(out) + "\n"


def record(url: str, name: str, data: Path = DATA) -> dict[str, str]:
    """Scrape ``url`` in both formats into ``data/<name>.{txt,om}``; the time of
    the scrape goes to ``data/captured.json`` (counters' real rates between two
    captures of one server)."""
    data.mkdir(parents=True, exist_ok=True)
    got = {}
    at = time.time()
    for ext, accept in FORMATS.items():
        got[ext] = keep_hicache(scrape(url, accept))
        (data / f"{name}.{ext}").write_text(got[ext])
    _stamp(data, name, at)
    return got


PACE_S = 1.0  # between requests: a served request a second, not a burst
IDLE_S = 30.0  # plugin-idle: this long after the traffic, no request


def traffic(server) -> None:
    """Enough requests that acks are popped, waits observed and prefixes loaded
    back from host (the e2e tests' prompts), one about every PACE_S."""
    from support.e2e_servers import prompts

    texts = prompts(12)
    for text in texts + texts[:4]:
        server.generate(text, max_new_tokens=4)
        time.sleep(PACE_S)


def _settle(server, ranks: int = 2) -> None:
    from support.e2e_servers import popped_by_rank

    popped_by_rank(server, ranks)


def storage(tmp: Path, name: str) -> tuple[list[str], dict[str, str]]:
    """(args, env) for a file storage backend under ``tmp``: the votes run."""
    return (
        ["--hicache-storage-backend", "file"],
        {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp / f"{name}-storage")},
    )


def capture_plugin(tmp: Path, data: Path = DATA) -> None:
    from support.e2e_servers import start

    args, env = storage(tmp, "plugin")
    server = start(tmp, "capture-plugin", args, env)
    try:
        record(server.url, "plugin-fresh", data)
        traffic(server)
        _settle(server)
        record(server.url, "plugin", data)
        time.sleep(IDLE_S)  # no request: the idle scheduler's passes
        record(server.url, "plugin-idle", data)
    finally:
        server.stop()


def capture_stock(tmp: Path, data: Path = DATA) -> None:
    from support.e2e_servers import STOCK_ENV, start

    args, env = storage(tmp, "stock")
    server = start(tmp, "capture-stock", args, {**env, **STOCK_ENV})
    try:
        traffic(server)
        record(server.url, "stock", data)
    finally:
        server.stop()


def capture_slow(tmp: Path, data: Path = DATA) -> None:
    """The plugin on a host whose reduce takes SLOW_REDUCE_MS (the cpu-server's
    latency model): longer than a step, so the waits are not hidden."""
    from support.e2e_servers import start

    args, env = storage(tmp, "slow")
    server = start(tmp, "capture-slow", args, env, latency_ms=SLOW_REDUCE_MS)
    try:
        record(server.url, "slow-fresh", data)
        traffic(server)
        _settle(server)
        record(server.url, "slow", data)
    finally:
        server.stop()


def inert_server(tmp: Path, name: str = "capture-inert"):
    """A plugin server whose version guard keeps the plugin inert (not started)."""
    from hicache_async_ack_lab.cpu_server import Server

    from support.e2e_servers import BASE_ARGS, START_TIMEOUT_S

    args, env = storage(tmp, name)
    server = Server(
        [*BASE_ARGS, *args], env=env, log_path=tmp / f"{name}.log", start_timeout_s=START_TIMEOUT_S
    )
    # First on the path: our sitecustomize runs the stand-ins, then drifts.
    server.env["PYTHONPATH"] = f"{DRIFT_BOOT}:{server.env['PYTHONPATH']}"
    return server


def capture_inert(tmp: Path, data: Path = DATA) -> None:
    server = inert_server(tmp)
    try:
        server.start()
        traffic(server)
        log = server.log()
        stood_down = [t for t in (ACK_COUNTS.title, PREFETCH_VOTES.title) if f"{t} (" in log]
        if len(stood_down) != 2 or "Not hooked" not in log:
            raise RuntimeError("the guard did not keep both cache syncs off:\n" + log[-3000:])
        record(server.url, "inert", data)
    finally:
        server.stop()


def capture_mixed(tmp: Path, data: Path = DATA, limit_s: float = 900.0) -> None:
    """Two nodes, node 1 with the plugin disabled: scrape both every half second
    until both have exited; the last HiCache exposition of each is recorded."""
    from hicache_async_ack_lab.cpu_server import Server, free_port

    from support.e2e_servers import BASE_ARGS, STOCK_ENV

    dist = f"127.0.0.1:{free_port()}"
    nodes = []
    for rank, env in ((0, {}), (1, STOCK_ENV)):
        args = [*BASE_ARGS, "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist]
        nodes.append(Server(args, env=env, log_path=tmp / f"mixed{rank}.log", wait=False))
    last: list[Optional[dict]] = [None, None]
    scrapes = [0, 0]
    try:
        for node in nodes:
            node.start()
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not all(n.exited() for n in nodes):
            for i, node in enumerate(nodes):
                if node.exited():
                    continue
                try:
                    got = {ext: scrape(node.url, a, 5) for ext, a in FORMATS.items()}
                except (OSError, urllib.error.URLError):
                    continue
                scrapes[i] += 1
                if "hicache_" in got["txt"]:
                    last[i] = got
            time.sleep(0.5)
        status = {
            "exited": [n.exited() for n in nodes],
            "scrapes": scrapes,
            "with_hicache_series": [x is not None for x in last],
            "mismatch_named_on_node0": "HiCacheAckSyncMismatch" in nodes[0].log(),
        }
    finally:
        for node in nodes:
            node.stop()
    data.mkdir(parents=True, exist_ok=True)
    for i, got in enumerate(last):
        if got is not None:
            for ext, text in got.items():
                (data / f"mixed-node{i}.{ext}").write_text(keep_hicache(text))
    (data / "mixed.status").write_text(json.dumps(status, indent=1) + "\n")


def capture_decode_offload(tmp: Path, data: Path = DATA) -> None:
    """A real PD decode server (cpu_server/pd.py: prefill TP 1, decode TP 2 with KV
    offload to a file store, the plugin pipelining its offload progress) whose offload
    reduce takes SLOW_REDUCE_MS (cpu-server's latency model, on the decode ranks):
    ``decode-offload`` after one request, ``decode-offload-slow`` after the traffic."""
    from hicache_async_ack_lab.cpu_server.pd import PDPair

    from support.e2e_servers import START_TIMEOUT_S, prompts

    pd = PDPair(["--enable-metrics"], workdir=tmp / "decode-offload",
                latency_ms=SLOW_REDUCE_MS, start_timeout_s=START_TIMEOUT_S)  # fmt: skip
    with pd:
        texts = prompts(8, seed=34)
        pd.generate(texts[0], max_new_tokens=4)
        record_with(pd.decode, "decode-offload", data)
        for text in texts:
            pd.generate(text, max_new_tokens=16, ignore_eos=True)
            time.sleep(PACE_S)
        record_with(pd.decode, "decode-offload-slow", data)


def record_with(server, name: str, data: Path) -> None:
    """``record`` through the server's own client (a PD server lives in a namespace)."""
    data.mkdir(parents=True, exist_ok=True)
    at = time.time()
    for ext, accept in FORMATS.items():
        text = server.ns.call(scrape, server.url, accept)
        (data / f"{name}.{ext}").write_text(keep_hicache(text))
    _stamp(data, name, at)


def _stamp(data: Path, name: str, at: float) -> None:
    stamps = data / "captured.json"
    times = json.loads(stamps.read_text()) if stamps.exists() else {}
    times[name] = round(at, 3)
    stamps.write_text(json.dumps(dict(sorted(times.items())), indent=1) + "\n")


CAPTURES: dict[str, Callable[..., None]] = {
    "plugin": capture_plugin,
    "stock": capture_stock,
    "inert": capture_inert,
    "mixed": capture_mixed,
    "slow": capture_slow,
    "decode-offload": capture_decode_offload,
}


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("sglang", "prometheus_client")}


def main(argv: list[str]) -> int:
    import tempfile

    which = argv or list(CONFIGS)
    unknown = set(which) - set(CONFIGS)
    if unknown:
        print(f"unknown configurations {sorted(unknown)}; known: {CONFIGS}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="hicache-monitoring-capture-"))
    for name in which:
        t0 = time.monotonic()
        CAPTURES[name](tmp)
        print(f"captured {name} in {time.monotonic() - t0:.0f} s (logs in {tmp})", flush=True)
    (DATA / "versions.json").write_text(json.dumps(versions(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
