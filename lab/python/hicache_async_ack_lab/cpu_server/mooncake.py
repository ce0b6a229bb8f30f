"""Mooncake, the L3 store operators run with HiCache, for cpu-server (test support).

Mooncake's transfer engine listens on every interface whatever it is told (its
handshake port on 0.0.0.0, its TCP data port on ``[::]``). So ``mooncake_master``,
every server that uses it and their clients run inside a network namespace of
their own that has only ``lo``: nothing listens on an interface of the host.

The namespace is made with the system calls of ``unshare -n`` and ``nsenter``
(unshare(2), setns(2); root, as CI is), each on a short-lived thread, so this
process itself stays in the host's namespace: a child forked from a thread
inside the namespace is born in it, and a socket made there belongs to it
whichever thread uses it. An open descriptor keeps the namespace alive between
calls (no holder process, no ``ip`` command: ``lo`` is brought up by ioctl).

- ``Mooncake()``: a context manager: the namespace, ``mooncake_master`` on free
  loopback ports in it (ready when its metrics endpoint answers), the SGLang
  config file pointing at it; ``kill()`` and ``restart()`` for fault tests;
  always stops every process it started (its process group), also on failure.
- ``MooncakeServer``: a cpu-server ``Server`` (tests, bench) run in that
  namespace, its HTTP client too.
- ``settings.server_env()``: what cpu-server adds for ``--hicache-storage-backend mooncake``.
- ``hicache-async-ack-lab mooncake-master [-- COMMAND ...]``: the same from a shell.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence, TypeVar

from hicache_async_ack_lab.cpu_server import Managed, Server, free_port, log_tail, stop_group
from hicache_async_ack_lab.cpu_server.netns import NetNamespace

T = TypeVar("T")


CONFIG_PATH_VAR = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
# The whole store, split evenly over a server's ranks by SGLang. A plain byte
# count: SGLang parses only a "gb" suffix ("256mb" fails).
DEFAULT_SEGMENT_BYTES = 256 * 1024 * 1024
MASTER_START_TIMEOUT_S = 60.0


# --- the master -------------------------------------------------------------------


def master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "Mooncake is not installed: pip install 'hicache-async-ack[test]' (or [bench]) "
            "installs mooncake-transfer-engine-non-cuda; scripts/setup.sh also installs "
            "its system libraries"
        )
    return Path(spec.origin).parent / "mooncake_master"


class MasterFailed(RuntimeError):
    """mooncake_master exited or its metrics endpoint did not answer in time."""


class Mooncake(Managed):
    """``mooncake_master`` in a private network namespace, torn down on exit.

    ``with Mooncake() as mc:`` then ``MooncakeServer(mc, args)``; ``mc.env()`` is
    what a server needs to find the master (the SGLang config file's path).
    """

    def __init__(
        self,
        workdir: Optional[Path] = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        start_timeout_s: float = MASTER_START_TIMEOUT_S,
    ):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hicache-mooncake-"))
        self.segment_bytes = segment_bytes
        self.start_timeout_s = start_timeout_s
        self.ns: Optional[NetNamespace] = None
        self.proc: Optional[subprocess.Popen] = None
        self.rpc_port = 0
        self.metrics_port = 0
        self.starts = 0
        self.startup_s: Optional[float] = None

    def key_count(self) -> Optional[int]:
        """The master's stored key count (its metrics endpoint), None if not exposed."""
        for line in self.metrics().splitlines():
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
        return None

    def settled_keys(self, timeout_s: float = 60.0) -> int:
        """The key count once write-backs stop adding to it (unchanged, and > 0, for
        2 s), or the last count seen when ``timeout_s`` runs out."""
        last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = self.key_count() or 0
            if n != last:
                last, since = n, time.monotonic()
            elif n > 0 and time.monotonic() - since > 2.0:
                break
            time.sleep(0.5)
        return last

    # lifecycle

    def start(self) -> None:
        try:
            if self.ns is None:
                self.workdir.mkdir(parents=True, exist_ok=True)
                self.ns = NetNamespace()
                self.rpc_port = self.ns.call(free_port)
                self.metrics_port = self.ns.call(free_port)
                self.config_path.write_text(json.dumps(self.config(), indent=1) + "\n")
            self._start_master()
        except BaseException:
            self.stop()
            raise

    def _start_master(self) -> None:
        assert self.ns is not None
        cmd = [
            str(master_binary()),
            "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}",
            "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
        ]  # fmt: skip
        self.starts += 1
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}  # start {self.starts}\n".encode())
            log.flush()
            self.proc = self.ns.call(
                subprocess.Popen, cmd, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = t0 + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MasterFailed(f"mooncake_master exited with {self.proc.returncode}\n"
                                   + self.log(30))  # fmt: skip
            try:
                self.metrics()
                self.startup_s = time.monotonic() - t0
                return
            except OSError:
                time.sleep(0.1)
        raise MasterFailed(f"mooncake_master not ready in {self.start_timeout_s:.0f} s\n"
                           + self.log(30))  # fmt: skip

    def kill(self) -> None:
        """SIGKILL the master (a fault); the namespace and its servers stay."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def restart(self) -> None:
        """A fresh master (empty store) on the same ports, in the same namespace."""
        self.kill()
        for attempt in range(3):
            try:
                return self._start_master()
            except MasterFailed:
                # Its old sockets may hold the ports a moment (TIME_WAIT).
                if attempt == 2:
                    raise
                time.sleep(2.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s)
        if self.ns is not None:
            self.ns.close()
            self.ns = None

    # what servers need

    @property
    def config_path(self) -> Path:
        return self.workdir / "mooncake.json"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mooncake_master.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def config(self) -> dict:
        """SGLang's Mooncake config (read from the file named by CONFIG_PATH_VAR)."""
        return {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",  # peers exchange metadata directly
            "global_segment_size": self.segment_bytes,
            "protocol": "tcp",
            "device_name": "",
            "master_server_address": self.address,
            "master_metrics_port": self.metrics_port,
            "check_server": False,
        }

    def env(self) -> dict[str, str]:
        return {CONFIG_PATH_VAR: str(self.config_path)}

    def metrics(self, timeout: float = 5.0) -> str:
        """The master's Prometheus text (raises OSError when it does not answer)."""
        assert self.ns is not None
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"

        def get() -> bytes:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.read()

        return self.ns.call(get).decode(errors="replace")

    def log(self, tail: Optional[int] = None) -> str:
        return log_tail(self.log_path, tail)


class MooncakeServer(Server):
    """A cpu-server in the master's namespace; ``get``/``post``/``generate`` reach it
    from there. Pass the cpu-server arguments with ``--hicache-storage-backend mooncake``."""

    def __init__(self, mooncake: Mooncake, args: Sequence[str], env=None, **kwargs):
        if mooncake.ns is None:
            raise RuntimeError("start the Mooncake master first")
        self.mooncake = mooncake
        port = kwargs.pop("port", None) or mooncake.ns.call(free_port)
        super().__init__(args, env={**mooncake.env(), **(env or {})}, port=port, **kwargs)

    def _ns(self) -> NetNamespace:
        if self.mooncake.ns is None:
            raise RuntimeError("the Mooncake namespace is gone")
        return self.mooncake.ns

    def start(self) -> None:
        self._ns().call(super().start)  # its processes are born in the namespace

    def get(self, path: str, timeout: float = 60.0) -> bytes:
        return self._ns().call(super().get, path, timeout)

    def post(self, path: str, body: Optional[dict] = None, timeout: float = 120.0) -> bytes:
        return self._ns().call(super().post, path, body, timeout)

    def run(self, cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd)`` in the namespace (a client such as bench_serving)."""
        return self._ns().call(subprocess.run, list(cmd), **kwargs)


# --- hicache-async-ack-lab mooncake-master --------------------------------------------

SUMMARY = "run mooncake_master in a private network namespace (for cpu-server with Mooncake)"
DESCRIPTION = """\
Start mooncake_master on free loopback ports inside a new network namespace that
has only lo (needs root), write SGLang's Mooncake config for it, and either run
COMMAND in that namespace with SGLANG_HICACHE_MOONCAKE_CONFIG_PATH set (then stop
the master), or keep the master up until interrupted and print how to enter the
namespace. Mooncake's transfer engine listens on every interface, so the servers
using it and their clients must run in the namespace too.

  hicache-async-ack-lab mooncake-master -- hicache-async-ack-lab cpu-server --tp 2 \\
      --enable-hierarchical-cache --hicache-storage-backend mooncake --port 30000
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("mooncake-master", help=SUMMARY, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--segment-bytes", type=int, default=DEFAULT_SEGMENT_BYTES,
                   help=f"the store's size, split over a server's ranks "
                   f"(default {DEFAULT_SEGMENT_BYTES})")  # fmt: skip
    p.add_argument("--workdir", help="config file and master log (default: a temp dir)")
    p.add_argument("--info", metavar="FILE.json",
                   help="write the master's address, config and namespace path here")  # fmt: skip
    p.set_defaults(func=run, passthrough=True)
    return p


def run(args) -> int:
    rest = list(args.rest)
    command = rest[1:] if rest[:1] == ["--"] else rest

    def say(msg: str) -> None:
        print(f"hicache-async-ack-lab mooncake-master: {msg}", file=sys.stderr, flush=True)

    with Mooncake(Path(args.workdir) if args.workdir else None, args.segment_bytes) as mc:
        assert mc.ns is not None and mc.proc is not None
        mc.ns.enter()  # this process's main thread: /proc/PID/ns/net names the namespace
        netns = f"/proc/{os.getpid()}/ns/net"
        say(
            f"master {mc.address} (metrics 127.0.0.1:{mc.metrics_port}) up in "
            f"{mc.startup_s:.2f} s in a private network namespace (only lo); log {mc.log_path}"
        )
        say(f"{CONFIG_PATH_VAR}={mc.config_path}")
        if args.info:
            info = {"pid": os.getpid(), "netns": netns, "master": mc.address,
                    "metrics_port": mc.metrics_port, "config_path": str(mc.config_path),
                    "config": mc.config()}  # fmt: skip
            Path(args.info).write_text(json.dumps(info, indent=1) + "\n")
        if not command:
            say(
                f"enter it: {CONFIG_PATH_VAR}={mc.config_path} nsenter --net={netns} "
                "hicache-async-ack-lab cpu-server ... --hicache-storage-backend mooncake"
            )
            say(f"clients too: nsenter --net={netns} curl http://127.0.0.1:PORT/health")
            while mc.alive():
                time.sleep(0.5)
            say(f"mooncake_master exited with {mc.proc.returncode}; see {mc.log_path}")
            return 1
        child = subprocess.Popen(command, env={**os.environ, **mc.env()}, start_new_session=True)
        try:
            return child.wait()
        finally:
            stop_group(child, 30.0)
