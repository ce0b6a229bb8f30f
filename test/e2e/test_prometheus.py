"""A real Prometheus (Debian's 2.42) scraping real cpu-servers, the shipped rule
file loaded unchanged: every dashboard query and every alert expression,
through Prometheus's HTTP API, returns what it should for a pipelining plugin
server and a stock one, in both scrape protocols. Prometheus 2.42 always asks
for OpenMetrics first (scrape_protocols exists only from 2.49), so job ``om``
scrapes the servers directly (names stored as ``sglang_...``) and job ``text``
through a loopback proxy that asks for the plain-text format (``sglang:...``),
as a Prometheus configured for it would.

One plugin and one stock server for the module; Prometheus runs in its own
process group with its own storage directory, on a free loopback port, and is
stopped by its process group, also on failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from hicache_async_ack_lab.cpu_server import free_port

from support.e2e_servers import STOCK_ENV, prompts, start
from support.monitoring_capture import TEXT_ACCEPT, record, storage
from support.monitoring_cases import exposition, rules_by_alert

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "prometheus-alerts.yml"
DASHBOARD = ROOT / "monitoring" / "grafana-dashboard.json"
JOBS = ("om", "text")
RATE_WINDOW = "2m"  # for $__rate_interval: spans the traffic sent after the first scrape
READY_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 180.0


# ------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("e2e_prometheus")
    started = {}
    try:
        for name, env in (("plugin", {}), ("stock", STOCK_ENV)):
            args, senv = storage(tmp, name)
            started[name] = start(tmp, f"prom-{name}", args, {**senv, **env})
        yield started
    finally:
        for server in started.values():
            server.stop()


class _TextProxy(BaseHTTPRequestHandler):
    """GET /metrics of ``upstream`` asking for the plain-text format."""

    upstream = ""

    def do_GET(self):  # noqa: N802 (http.server's name)
        req = urllib.request.Request(self.upstream + self.path, headers={"Accept": TEXT_ACCEPT})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                body, ctype = r.read(), r.headers.get("Content-Type", "text/plain")
        except OSError:
            self.send_error(502)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def text_proxy(upstream: str) -> ThreadingHTTPServer:
    handler = type("Proxy", (_TextProxy,), {"upstream": upstream})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy


class Prometheus:
    """Debian's prometheus on a free loopback port, in its own process group."""

    def __init__(self, tmp: Path, targets: dict[str, list[str]]):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus missing: scripts/setup.sh installs Debian's prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],  # the shipped file, unchanged
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = tmp / "prometheus.log"
        self.cmd = [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("prometheus exited:\n" + self.log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("prometheus not ready:\n" + self.log_path.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def wait_for(self, expr: str, check, what: str) -> list[dict]:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            got = self.query(expr)
            if check(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {expr} -> {got}")
            time.sleep(1.0)


@pytest.fixture(scope="module")
def prom(servers, tmp_path_factory) -> Iterator[tuple[Prometheus, dict]]:
    tmp = tmp_path_factory.mktemp("prometheus")
    proxies = {name: text_proxy(s.url) for name, s in servers.items()}
    hosts = {name: f"127.0.0.1:{s.port}" for name, s in servers.items()}
    proxied = {name: f"127.0.0.1:{p.server_address[1]}" for name, p in proxies.items()}
    prometheus = Prometheus(tmp, {"om": list(hosts.values()), "text": list(proxied.values())})
    instances = {("om", n): h for n, h in hosts.items()}
    instances.update({("text", n): h for n, h in proxied.items()})
    try:
        prometheus.start()
        prometheus.wait_for("up == 1", lambda r: len(r) == 4, "every target scraped")
        # Traffic after the first scrapes: counters move inside the rate window.
        texts = prompts(12)
        for text in texts + texts[:4]:
            servers["plugin"].generate(text, max_new_tokens=4)
            servers["stock"].generate(text, max_new_tokens=4)
        time.sleep(5)  # a few scrapes of the last counts
        yield prometheus, instances
    finally:
        prometheus.stop()
        for p in proxies.values():
            p.shutdown()
            p.server_close()


# ------------------------------------------------------------------ helpers
def panel_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    assert out, "no panel query"
    return out


def for_job(expr: str, job: str) -> str:
    return expr.replace("$job", job).replace("$__rate_interval", RATE_WINDOW)


def at(result: list[dict], instance: str) -> list[dict]:
    return [r for r in result if r["metric"].get("instance") == instance]


# Panels that read the PD decode offload sync: no cpu-server runs PD decode.
NO_DATA_ON_CPU_SERVER = ("offload",)


def test_the_shipped_rule_file_is_loaded_unchanged_and_healthy(prom):
    prometheus, _ = prom
    groups = prometheus.api("rules")["groups"]
    assert [g["file"] for g in groups] == [str(RULES)], groups
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    shipped = rules_by_alert(RULES)
    assert set(loaded) == set(shipped), (set(loaded), set(shipped))
    for name, rule in shipped.items():
        assert loaded[name]["health"] == "ok", loaded[name]
        assert loaded[name].get("lastError", "") == "", loaded[name]
        assert loaded[name]["duration"] == _seconds(rule.get("for", "0s")), name


def _seconds(text: str) -> float:
    return float(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


@pytest.mark.parametrize("job", JOBS)
def test_every_panel_shows_the_plugin_server_and_nothing_of_the_stock_one(prom, job):
    prometheus, instances = prom
    plugin, stock = instances[(job, "plugin")], instances[(job, "stock")]
    for title, expr in panel_queries():
        result = prometheus.query(for_job(expr, job))
        per_instance = any("instance" in r["metric"] for r in result)
        if any(w in title.lower() for w in NO_DATA_ON_CPU_SERVER):
            assert result == [], (title, result)
            continue
        assert result, (job, title, expr)
        if per_instance:
            assert at(result, plugin), (job, title, result)
            assert not at(result, stock), (job, title, result)


@pytest.mark.parametrize("job", JOBS)
def test_the_panels_read_the_right_values(prom, job):
    prometheus, instances = prom
    plugin = instances[(job, "plugin")]
    q = {title: for_job(expr, job) for title, expr in panel_queries()}

    def values(title_part: str) -> dict:
        (title,) = [t for t in q if t.startswith(title_part)]
        got = at(prometheus.query(q[title]), plugin)
        return {r["metric"].get("tp_rank"): float(r["value"][1]) for r in got}

    assert values("Pipelined (1) or blocking (0)") == {"0": 1.0, "1": 1.0}
    assert values("Votes pipelined") == {"0": 1.0, "1": 1.0}
    assert values("Servers up") == {None: 1.0}
    (why,) = [t for t in q if t.startswith("Path and reason")]
    rows = {
        (r["metric"]["tp_rank"], r["metric"]["sync"], r["metric"]["path"], r["metric"]["reason"])
        for r in at(prometheus.query(q[why]), plugin)
    }
    assert rows == {
        (tp, sync, "pipelined", "pipelined")
        for tp in ("0", "1")
        for sync in ("ack_counts", "prefetch_votes")
    }, rows
    popped = prometheus.query(q["Entries popped per second, by queue (one rank per group)"])
    by_queue = {r["metric"]["queue"]: float(r["value"][1]) for r in popped}
    assert by_queue.get("ack_write_queue", 0) > 0, by_queue


def _inner(expr: str) -> str:
    """An alert's expression without its final threshold (``... > 0.02``)."""
    return re.sub(r"\)\s*>\s*[0-9.]+\s*$", ")", expr.strip())


@pytest.mark.parametrize("job", JOBS)
def test_every_alert_expression_answers_for_these_servers(prom, job):
    prometheus, instances = prom
    plugin, stock = instances[(job, "plugin")], instances[(job, "stock")]
    rules = rules_by_alert(RULES)
    for name, rule in rules.items():
        result = [r for r in prometheus.query(rule["expr"]) if r["metric"].get("job", job) == job]
        if name == "HiCacheAckSyncNotInstalled":  # the stock server, and only it
            assert [r["metric"]["instance"] for r in result] == [stock], (name, result)
        elif name.endswith("NotHidden"):
            inner = [
                r for r in prometheus.query(_inner(rule["expr"]))
                if r["metric"].get("instance") in (plugin, stock)
            ]  # fmt: skip
            if "DecodeOffload" in name:
                assert inner == [], (name, inner)
            else:  # the wait share is computed for each plugin rank, never stock's
                assert sorted(r["metric"]["tp_rank"] for r in at(inner, plugin)) == ["0", "1"]
                assert not at(inner, stock), (name, inner)
        else:
            assert result == [], (name, result)


def test_fixtures_match_a_fresh_capture(servers, tmp_path):
    """The recorded expositions (test/data/monitoring) still hold the series a
    real server exports now: re-captured here from the module's servers."""
    for name, server in servers.items():
        record(server.url, name, tmp_path)
        for fmt in ("txt", "om"):
            now = {s.key for s in exposition(name, fmt, tmp_path) if _ours(s)}
            then = {s.key for s in exposition(name, fmt) if _ours(s)}
            assert now == then, (name, fmt, now ^ then)
            assert (name == "stock") == (not now), (name, fmt)


def _ours(sample) -> bool:
    """The plugin's series; of the path info only the current path (at 1): a
    replaced one at 0 is history (the votes' one-time agreement is announced, or
    not, depending on when its first pass ran)."""
    if re.match(r"sglang[:_]hicache_sync_path_info", sample.name):
        return sample.value == 1
    return re.match(r"sglang[:_]hicache_(ack_sync|prefetch_votes)", sample.name) is not None


def readme_promql() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", text, re.S)
    queries = [q.strip() for b in blocks for q in b.split("\n\n") if q.strip()]
    assert queries, "no PromQL in the README"
    return queries


@pytest.mark.parametrize("job", JOBS)
def test_the_readme_promql_answers(prom, job):
    """The README's queries: the wait share has both plugin ranks, nothing of
    the stock server; the "why not pipelining" query is empty for a pipelining
    server."""
    prometheus, instances = prom
    plugin, stock = instances[(job, "plugin")], instances[(job, "stock")]
    wait_share, why_not = readme_promql()
    got = prometheus.query(wait_share)
    assert sorted(r["metric"]["tp_rank"] for r in at(got, plugin)) == ["0", "1"], got
    assert not at(got, stock), got
    assert at(prometheus.query(why_not), plugin) == []


def test_a_stopped_pipelining_server_raises_server_down(prom, servers):
    """Last: the plugin server goes down as a sync error takes it down; the
    ServerDown expression names it (in both jobs), and not the stock one."""
    prometheus, instances = prom
    servers["plugin"].stop()
    expr = rules_by_alert(RULES)["HiCacheSyncServerDown"]["expr"]
    want = {instances[(job, "plugin")] for job in JOBS}
    got = prometheus.wait_for(
        expr, lambda r: {x["metric"]["instance"] for x in r} == want, "server down seen"
    )
    assert {x["metric"]["job"] for x in got} == set(JOBS), got
