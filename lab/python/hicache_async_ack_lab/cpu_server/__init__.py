"""SGLang's real ``launch_server`` on a CPU-only host: for tests, demos and the bench.

``command()`` builds the server command line (our CPU defaults first, the
caller's arguments after, so the caller's win: argparse keeps the last value);
``environment()`` the variables the CPU engine needs; ``Server`` starts one in
its own process group, waits until it serves, and always takes it down again.
The stand-ins (``standins.py``) reach the server's processes only through the
``boot/`` directory put first on their PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence, TypeVar

from hicache_async_ack_lab.cpu_server.model import ensure_model
from hicache_async_ack_lab.cpu_server.settings import (
    CPU_BREAK_COPIES_VAR,
    CPU_REDUCE_LATENCY_VAR,
    CPU_SKEW_VAR,
    option,
    parse_cpu_break_copies,
    parse_cpu_reduce_latency_ms,
    parse_cpu_skew,
    server_env,
)
from hicache_async_ack_lab.cpu_server.standins import STANDINS

BOOT_DIR = Path(__file__).resolve().parent / "boot"
# A path that does not exist: PyNccl then stays off instead of asking for CUDA.
NO_NCCL = "/nonexistent/hicache-async-ack/libnccl.so"
# The bundled model's weights: "seeded" (model.safetensors, outputs that depend on
# the cached KV) or SGLang's "dummy" (every logit ~0: replies that do not).
WEIGHTS = {"seeded": "safetensors", "dummy": "dummy"}


def load_format(weights: str) -> str:
    try:
        return WEIGHTS[weights]
    except KeyError:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHTS)}") from None


def default_args(model_path: Path, weights: str = "seeded") -> list[str]:
    return [
        "--model-path", str(model_path),
        "--device", "cpu",
        "--dtype", "float32",
        "--load-format", load_format(weights),
        "--attention-backend", "torch_native",
        "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "layer_first",
        "--disable-cuda-graph",
        "--disable-custom-all-reduce",
    ]  # fmt: skip


# A PD server (--disaggregation-mode prefill|decode), before the caller's arguments: KV
# over Mooncake's TCP transport, and a KV pool and batch bound of its own (a decode
# server otherwise sizes its pool at 95% of host RAM and is killed).
PD_DEFAULTS = [
    "--disaggregation-transfer-backend", "mooncake_tcp",
    "--max-total-tokens", "4096",
    "--max-running-requests", "16",
]  # fmt: skip


def pd_role(args: Sequence[str]) -> Optional[str]:
    role = option(args, "--disaggregation-mode")
    return role if role in ("prefill", "decode") else None


def _int_opt(args: Sequence[str], names: tuple[str, ...], default: int) -> int:
    value = default
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                value = int(args[i + 1])
            elif a.startswith(n + "="):
                value = int(a.split("=", 1)[1])
    return value


def local_ranks(args: Sequence[str]) -> int:
    """Scheduler processes this node starts (one OMP binding entry each)."""
    tp = _int_opt(args, ("--tp", "--tp-size", "--tensor-parallel-size"), 1)
    pp = _int_opt(args, ("--pp", "--pp-size", "--pipeline-parallel-size"), 1)
    dp = _int_opt(args, ("--dp", "--dp-size", "--data-parallel-size"), 1)
    nnodes = _int_opt(args, ("--nnodes",), 1)
    return max(1, tp * pp * dp // max(1, nnodes))


def environment(
    args: Sequence[str],
    base: Optional[Mapping[str, str]] = None,
    skew: Optional[str] = None,
    latency_ms: float = 0.0,
    break_copies: Optional[str] = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    cores = os.cpu_count() or 1
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_NCCL_SO_PATH=NO_NCCL,
        # One core list per rank, or SGLang asserts one NUMA node per rank.
        SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r % cores) for r in range(local_ranks(args))),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(BOOT_DIR), env.get("PYTHONPATH")) if p),
    )
    env.update(server_env(args, env))  # only with --hicache-storage-backend mooncake
    if skew is not None:
        parse_cpu_skew(skew)
        env[CPU_SKEW_VAR] = skew
    if latency_ms:
        parse_cpu_reduce_latency_ms(str(latency_ms))
        env[CPU_REDUCE_LATENCY_VAR] = str(latency_ms)
    if break_copies:
        parse_cpu_break_copies(break_copies)
        env[CPU_BREAK_COPIES_VAR] = break_copies
    return env


def command(
    args: Sequence[str], model_path: Optional[Path] = None, weights: str = "seeded"
) -> list[str]:
    load_format(weights)  # a bad name fails before the model is built
    model = ensure_model(model_path)
    pd = PD_DEFAULTS if pd_role(args) else []
    return [sys.executable, "-m", "sglang.launch_server", *default_args(model, weights), *pd, *args]


def describe_standins() -> str:
    return "\n".join(f"  - {name}: {what}" for name, what in STANDINS.items())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_IN_USE_MARK = "error while attempting to bind on address"  # uvicorn's, in the log
PORT_ATTEMPTS = 3


class ServerFailed(RuntimeError):
    """The server exited or did not come up in time; the message ends with its log."""


class PortInUse(ServerFailed):
    """The HTTP port was taken before the server bound it (start picks another)."""


_Self = TypeVar("_Self", bound="Managed")


class Managed:
    """``with x:`` starts ``x`` and always stops it again (servers, masters, PD pairs)."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def log_tail(path: Path, tail: Optional[int] = None) -> str:
    """The last ``tail`` lines of a log (all without ``tail``), "" before it exists."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-tail:] if tail else lines)


class Server(Managed):
    """One ``cpu-server`` in its own process group, torn down on exit.

    ``Server(["--tp", "2", "--enable-hierarchical-cache"], env={...})`` as a
    context manager; ``url``, ``generate()``, ``get()`` and ``log()`` for checks.
    """

    def __init__(
        self,
        args: Sequence[str],
        env: Optional[Mapping[str, str]] = None,
        log_path: Optional[Path] = None,
        port: Optional[int] = None,
        skew: Optional[str] = None,
        latency_ms: float = 0.0,
        start_timeout_s: float = 600.0,
        wait: bool = True,
        weights: str = "seeded",
        break_copies: Optional[str] = None,
    ):
        self.port = port or free_port()
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.weights = weights
        self.env = environment(
            self.args, {**os.environ, **(env or {})}, skew, latency_ms, break_copies
        )
        self.log_path = Path(log_path or f"/tmp/hicache-async-ack-server-{self.port}.log")
        self.start_timeout_s = start_timeout_s
        self.wait = wait
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # A free port can be taken between picking it and the server binding it (by one
        # of SGLang's own sockets, say): then the HTTP server is gone while the
        # schedulers run on, and /health never answers. Stop, pick another, start again.
        for _ in range(PORT_ATTEMPTS):
            self._launch()
            if not self.wait:
                return
            try:
                self.wait_ready()
                return
            except PortInUse:
                self.stop()
                self.port = free_port()
                self.args[-1] = str(self.port)
            except BaseException:
                self.stop()
                raise
        raise ServerFailed(f"port in use {PORT_ATTEMPTS} times\n{self.log(40)}")

    def _launch(self) -> None:
        cmd = command(self.args, weights=self.weights)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self) -> None:
        start = time.monotonic()
        deadline = start + self.start_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll() if self.proc is not None else None
            if code is not None:
                raise ServerFailed(f"server exited with {code}\n{self.log(80)}")
            try:
                self.get("/health", timeout=5)
                self.startup_s = time.monotonic() - start
                return
            except (OSError, urllib.error.URLError):
                if PORT_IN_USE_MARK in self.log(40):
                    raise PortInUse(f"port {self.port} in use\n{self.log(20)}") from None
                time.sleep(1.0)
        raise ServerFailed(f"server not ready in {self.start_timeout_s:.0f} s\n{self.log(80)}")

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def wait_exit(self, timeout_s: float) -> Optional[int]:
        """The exit code, or None if it is still running after timeout_s."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the whole process group (schedulers included)."""
        if self.proc is not None:
            stop_group(self.proc, grace_s)

    def log(self, tail: Optional[int] = None) -> str:
        return log_tail(self.log_path, tail)

    # -- HTTP --------------------------------------------------------------------

    def get(self, path: str, timeout: float = 60.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read()

    def post(self, path: str, body: Optional[dict] = None, timeout: float = 120.0) -> bytes:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def generate(
        self,
        text: str,
        max_new_tokens: int = 8,
        timeout: float = 300.0,
        return_logprob: bool = False,
        **sampling,
    ) -> dict:
        """Greedy unless ``sampling`` says otherwise. ``return_logprob``: the reply's
        ``meta_info["output_token_logprobs"]`` holds (logprob, token id, None) each."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}
        body: dict = {"text": text, "sampling_params": params}
        if return_logprob:
            body["return_logprob"] = True
        return json.loads(self.post("/generate", body, timeout=timeout))


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM ``proc``'s whole process group, then SIGKILL what is left of it
    after ``grace_s``: every member, not only the leader, is gone on return
    (or after another 10 s of SIGKILL)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait_s
        while time.monotonic() < end and _group_alive(proc.pid):
            proc.poll()
            time.sleep(0.2)
        if not _group_alive(proc.pid):
            break
    proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg; only a live member matters.
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False
