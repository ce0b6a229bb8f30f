"""PD disaggregation on a CPU-only host: a prefill and a decode cpu-server as one.

``PDPair`` starts, in a private network namespace that has only ``lo`` (Mooncake's
transfer engine listens on every interface whatever it is told):

- a prefill server (``--disaggregation-mode prefill``, TP 1) with its bootstrap port;
- a decode server (``--disaggregation-mode decode``, TP ``decode_tp``, 2 by default)
  with KV offload to a ``file`` store in its own directory
  (``--disaggregation-decode-enable-offload-kvcache``), the path the plugin's decode
  offload sync pipelines; on one node or, with ``decode_nodes``, on several;
- SGLang's PD router (``sglang-router``, ``--pd-disaggregation``), which gives every
  request the prefill's bootstrap address and a room and sends it to both.

KV goes over Mooncake's TCP transport (``mooncake_tcp``, ``MOONCAKE_PROTOCOL=tcp``,
``SGLANG_HOST_IP=127.0.0.1``: cpu-server's PD defaults, settings.py) and the PD
stand-ins (pd_standins.py) are cpu-server's own, so any cpu-server started with
``--disaggregation-mode`` in such a namespace gets them. Every port is picked free
inside the namespace; everything stops as one, also when a start fails.
``hicache-async-ack-lab cpu-server --pd`` is the same from a shell.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hicache_async_ack_lab.cpu_server import (
    Managed,
    Server,
    ServerFailed,
    free_port,
    log_tail,
    stop_group,
)
from hicache_async_ack_lab.cpu_server.netns import NetNamespace

STORE_DIR_VAR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
OFFLOAD_ARGS = [
    "--disaggregation-decode-enable-offload-kvcache",
    "--hicache-storage-backend", "file",
]  # fmt: skip
ROUTER_START_TIMEOUT_S = 300.0
START_TIMEOUT_S = 900.0


class NsServer(Server):
    """A cpu-server born in ``ns``; its HTTP client reaches it from there too."""

    def __init__(self, ns: NetNamespace, args: Sequence[str], **kwargs):
        self.ns = ns
        port = kwargs.pop("port", None) or ns.call(free_port)
        super().__init__(args, port=port, **kwargs)

    def start(self) -> None:
        self.ns.call(super().start)

    def get(self, path: str, timeout: float = 60.0) -> bytes:
        return self.ns.call(super().get, path, timeout)

    def post(self, path: str, body: Optional[dict] = None, timeout: float = 120.0) -> bytes:
        return self.ns.call(super().post, path, body, timeout)


class RouterFailed(ServerFailed):
    """The PD router exited or did not answer in time; the message ends with its log."""


class PDPair(Managed):
    """A prefill and a decode cpu-server and the PD router, torn down as one.

    ``with PDPair(decode_env={...}) as pd:`` then ``pd.generate(text)`` (through the
    router), ``pd.decode`` / ``pd.prefill`` (``Server``s: ``log()``, ``get("/metrics")``),
    ``pd.store`` (the decode's offload store). ``common_args`` go to both servers,
    ``prefill_args`` / ``decode_args`` to one; ``skew``, ``latency_ms`` and
    ``break_copies`` are the decode's (cpu-server's devices). ``decode_nodes``: one
    environment per decode node (``--nnodes``, one scheduler process group each;
    node 0 serves HTTP).
    """

    def __init__(
        self,
        common_args: Sequence[str] = (),
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        *,
        decode_tp: int = 2,
        offload: bool = True,
        workdir: Optional[Path] = None,
        env: Optional[Mapping[str, str]] = None,
        prefill_env: Optional[Mapping[str, str]] = None,
        decode_env: Optional[Mapping[str, str]] = None,
        decode_nodes: Optional[Sequence[Mapping[str, str]]] = None,
        skew: Optional[str] = None,
        latency_ms: float = 0.0,
        break_copies: Optional[str] = None,
        weights: str = "seeded",
        start_timeout_s: float = START_TIMEOUT_S,
        router_port: Optional[int] = None,
    ):
        if decode_tp < 1:
            raise ValueError(f"decode_tp {decode_tp}: expected an integer >= 1")
        nodes = list(decode_nodes) if decode_nodes is not None else [{}]
        if not nodes or decode_tp % len(nodes):
            raise ValueError(
                f"decode_nodes: {len(nodes)} node(s) for decode TP {decode_tp}: expected "
                "between 1 and decode_tp nodes that divide it"
            )
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hicache-pd-"))
        self.store = self.workdir / "store"
        self.common_args = list(common_args)
        self.prefill_args = list(prefill_args)
        self.decode_args = list(decode_args)
        self.decode_tp = decode_tp
        self.offload = offload
        self.env = dict(env or {})
        self.prefill_env = dict(prefill_env or {})
        self.decode_env = dict(decode_env or {})
        self.node_envs = [dict(e) for e in nodes]
        self.skew, self.latency_ms, self.break_copies = skew, latency_ms, break_copies
        self.weights = weights
        self.start_timeout_s = start_timeout_s
        self.requested_router_port = router_port
        self.ns: Optional[NetNamespace] = None
        self.prefill: Optional[NsServer] = None
        self.decode_nodes: list[NsServer] = []
        self.router: Optional[subprocess.Popen] = None
        self.router_port = 0
        self.bootstrap_port = 0
        self.startup_s: Optional[float] = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def decode(self) -> NsServer:
        if not self.decode_nodes:
            raise RuntimeError("the PD pair is not started")
        return self.decode_nodes[0]

    def start(self, wait: bool = True) -> None:
        """Prefill, decode node(s), router. ``wait=False``: only launch the decode nodes
        (no prefill, no router; for a decode group expected to stop by itself)."""
        t0 = time.monotonic()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.store.mkdir(exist_ok=True)
            self.ns = NetNamespace()
            self.bootstrap_port = self.ns.call(free_port)
            if wait:
                self.prefill = self._prefill()
                self.prefill.start()
            self.decode_nodes = self._decode_nodes()
            for i, node in enumerate(self.decode_nodes):
                node.wait = wait and i == 0  # only node 0 serves HTTP
                node.start()
            if wait:
                self._start_router()
                self.startup_s = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise

    def restart_decode(self, decode_env: Optional[Mapping[str, str]] = None,
                       latency_ms: float = 0.0, name: str = "") -> None:  # fmt: skip
        """A fresh decode server (and router) beside the same prefill: the bench's arms
        differ on the decode side only. ``name`` tags its log."""
        if self.router is not None:
            stop_group(self.router, 15.0)
            self.router = None
        for node in self.decode_nodes:
            node.stop()
        self.decode_env = dict(decode_env or {})
        self.latency_ms = latency_ms
        t0 = time.monotonic()
        try:
            self.decode_nodes = self._decode_nodes(name)
            for node in self.decode_nodes:
                node.start()
            self._start_router()
            self.startup_s = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise

    def _server(self, name: str, args: list[str], env: dict, **kwargs) -> NsServer:
        assert self.ns is not None
        return NsServer(
            self.ns, [*self.common_args, *args], env={**self.env, **env},
            log_path=self.workdir / f"{name}.log", start_timeout_s=self.start_timeout_s,
            weights=self.weights, **kwargs,
        )  # fmt: skip

    def _prefill(self) -> NsServer:
        args = ["--disaggregation-mode", "prefill", "--tp", "1",
                "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                *self.prefill_args]  # fmt: skip
        return self._server("prefill", args, self.prefill_env)

    def _decode_nodes(self, tag: str = "") -> list[NsServer]:
        assert self.ns is not None
        base = ["--disaggregation-mode", "decode", "--tp", str(self.decode_tp)]
        if self.offload:
            base += OFFLOAD_ARGS
        env = {STORE_DIR_VAR: str(self.store), **self.decode_env}
        n = len(self.node_envs)
        dist = f"127.0.0.1:{self.ns.call(free_port)}"
        nodes = []
        for rank, node_env in enumerate(self.node_envs):
            multi = ["--nnodes", str(n), "--node-rank", str(rank), "--dist-init-addr", dist]
            name = ("decode" if n == 1 else f"decode-node{rank}") + (f"-{tag}" if tag else "")
            nodes.append(
                self._server(
                    name,
                    [*base, *(multi if n > 1 else []), *self.decode_args],
                    {**env, **node_env},
                    skew=self.skew,
                    latency_ms=self.latency_ms,
                    break_copies=self.break_copies,
                )  # fmt: skip
            )
        return nodes

    def router_command(self) -> list[str]:
        assert self.prefill is not None
        return [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", self.prefill.url, str(self.bootstrap_port),
            "--decode", self.decode.url,
            "--host", "127.0.0.1", "--port", str(self.router_port),
            "--worker-startup-timeout-secs", str(int(ROUTER_START_TIMEOUT_S)),
            "--log-level", "warn",
        ]  # fmt: skip

    def _start_router(self) -> None:
        assert self.ns is not None
        self.router_port = self.requested_router_port or self.ns.call(free_port)
        cmd = self.router_command()
        with open(self.router_log_path, "ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.router = self.ns.call(
                subprocess.Popen, cmd, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RouterFailed(f"the PD router exited with {self.router.returncode}\n"
                                   + log_tail(self.router_log_path, 40))  # fmt: skip
            try:
                # /health answers before the router has checked its workers; /readiness
                # only once a prefill and a decode are healthy (503 until then).
                self.get("/readiness", timeout=5)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
        raise RouterFailed(f"the PD router not ready in {ROUTER_START_TIMEOUT_S:.0f} s\n"
                           + log_tail(self.router_log_path, 40))  # fmt: skip

    @property
    def router_log_path(self) -> Path:
        return self.workdir / "router.log"

    def servers(self) -> list[NsServer]:
        return [*self.decode_nodes, *([self.prefill] if self.prefill else [])]

    def exited(self) -> list[str]:
        """Names of the processes that are gone (a PD pair serves only while none is)."""
        out = [Path(s.log_path).stem for s in self.servers() if s.exited()]
        if self.router is not None and self.router.poll() is not None:
            out.append("router")
        return out

    def stop(self, grace_s: float = 15.0) -> None:
        """Router, decode node(s), prefill (each its process group), then the namespace."""
        if self.router is not None:
            stop_group(self.router, grace_s)
        for server in self.servers():
            server.stop(grace_s)
        if self.ns is not None:
            self.ns.close()
            self.ns = None

    # -- HTTP, through the router --------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def get(self, path: str, timeout: float = 60.0) -> bytes:
        def get() -> bytes:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.read()

        return self._ns().call(get)

    def post(self, path: str, body: Optional[dict] = None, timeout: float = 120.0) -> bytes:
        def post() -> bytes:
            req = urllib.request.Request(
                self.url + path, data=json.dumps(body or {}).encode(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()

        return self._ns().call(post)

    def generate(self, text: str, max_new_tokens: int = 8, timeout: float = 300.0,
                 return_logprob: bool = False, **sampling) -> dict:  # fmt: skip
        """As ``Server.generate``: greedy unless ``sampling`` says otherwise."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}
        body: dict = {"text": text, "sampling_params": params}
        if return_logprob:
            body["return_logprob"] = True
        return json.loads(self.post("/generate", body, timeout=timeout))

    def run(self, cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd)`` in the namespace (a client such as bench_serving)."""
        return self._ns().call(subprocess.run, list(cmd), **kwargs)

    def _ns(self) -> NetNamespace:
        if self.ns is None:
            raise RuntimeError("the PD pair's namespace is gone")
        return self.ns
