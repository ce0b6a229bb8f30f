"""cpu-server's own settings: read by its CPU stand-ins (test support), never by the
plugin, whose settings are all in :mod:`hicache_async_ack.env`."""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, Sequence

# HICACHE_ASYNC_ACK_CPU_SKEW: comma-separated polls per global rank
# (rank i uses entry i mod len) before an ack's finish event reports done, e.g.
# "0,3"; on CPU every copy finishes at once, on a GPU host not on every rank alike.
CPU_SKEW_VAR = "HICACHE_ASYNC_ACK_CPU_SKEW"
# HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_MS: model a host whose gloo all_reduce is slow
# (the seed's B200 host: 3.2 ms): every blocking UnifiedRadixCache._all_reduce sleeps
# this long first; the plugin's async reduces complete no earlier than this after issue.
CPU_REDUCE_LATENCY_VAR = "HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_MS"
# HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_FILE: a file holding that latency in ms, re-read
# whenever it is replaced, instead of the fixed value above (a measurement device:
# bench-server --workload pd switches the latency between runs in one decode server,
# so a latency's ratio to 0 ms is paired within one process). Unset: the fixed value.
CPU_REDUCE_LATENCY_FILE_VAR = "HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_FILE"
# HICACHE_ASYNC_ACK_CPU_BREAK_COPIES: break the stand-ins' KV copies ON PURPOSE, the
# negative control of the end-to-end correctness checks (they must fail on it):
# "noop" copies nothing (device <-> host, so storage hits too), "swap" writes the
# right rows into the wrong buffers (K and V, and layers, swapped); "transfer" (a PD
# decode server) registers its KV buffers for the prefill's transfer in reverse order,
# so the KV a prefill sends lands in the wrong layers. Unset: real copies.
CPU_BREAK_COPIES_VAR = "HICACHE_ASYNC_ACK_CPU_BREAK_COPIES"
BREAK_MODES = ("noop", "swap", "transfer")


def parse_cpu_skew(raw: Optional[str]) -> tuple[int, ...]:
    """``"0,3"`` -> (0, 3); unset or empty -> (). Bad input names the accepted form."""
    if not raw:
        return ()
    try:
        polls = tuple(int(part) for part in raw.split(","))
    except ValueError:
        polls = (-1,)
    if any(p < 0 for p in polls):
        raise ValueError(
            f"{CPU_SKEW_VAR}={raw!r}: expected comma-separated non-negative poll counts, "
            "one per rank, e.g. '0,3'"
        )
    return polls


def parse_cpu_reduce_latency_ms(raw: Optional[str]) -> float:
    """``"3.2"`` -> 3.2; unset or empty -> 0. Bad input names the accepted form."""
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms >= 0 or ms == float("inf"):
        raise ValueError(
            f"{CPU_REDUCE_LATENCY_VAR}={raw!r}: expected a number of milliseconds >= 0"
        )
    return ms


class LatencyFile:
    """The latency a file says now, in seconds: re-read when the file is replaced
    (``write_latency_file``: a new inode) or rewritten, one ``stat`` per call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._key: tuple = ()
        self._seconds = 0.0

    def __call__(self) -> float:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._key:
                with open(self.path) as f:
                    raw = f.read().strip()
                self._seconds = parse_cpu_reduce_latency_ms(raw or "0") / 1000.0
                self._key = key
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{CPU_REDUCE_LATENCY_FILE_VAR}={self.path!r}: expected a readable file "
                f"holding a number of milliseconds >= 0 ({exc})"
            ) from exc
        return self._seconds


def reduce_latency(environ: Optional[Mapping[str, str]] = None) -> Optional[Callable[[], float]]:
    """The injected latency as a callable (seconds, read at each call), or None when
    none is injected. A latency file is read once here, so a bad one fails at start."""
    env = os.environ if environ is None else environ
    path = env.get(CPU_REDUCE_LATENCY_FILE_VAR)
    if path:
        latency = LatencyFile(path)
        latency()
        return latency
    seconds = parse_cpu_reduce_latency_ms(env.get(CPU_REDUCE_LATENCY_VAR)) / 1000.0
    return (lambda: seconds) if seconds else None


def latency_injected(environ: Mapping[str, str]) -> bool:
    """Whether either latency variable asks for one (a file saying 0 included)."""
    return bool(environ.get(CPU_REDUCE_LATENCY_FILE_VAR)) or bool(
        parse_cpu_reduce_latency_ms(environ.get(CPU_REDUCE_LATENCY_VAR))
    )


def write_latency_file(path, ms: float) -> None:
    """Replace the file at once (a new inode): a reader never sees half a number."""
    from pathlib import Path

    parse_cpu_reduce_latency_ms(str(ms))
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(f"{ms:g}\n")
    tmp.replace(target)


def parse_cpu_break_copies(raw: Optional[str]) -> str:
    """``"noop"`` / ``"swap"``; unset or empty -> "" (real copies). Bad input names both."""
    if not raw:
        return ""
    if raw not in BREAK_MODES:
        raise ValueError(
            f"{CPU_BREAK_COPIES_VAR}={raw!r}: expected one of {', '.join(BREAK_MODES)} "
            "(or unset for real copies)"
        )
    return raw


# --- the Mooncake backend --------------------------------------------------------


def _storage_backend(args: Sequence[str]) -> Optional[str]:
    value = None
    for i, a in enumerate(args):
        if a == "--hicache-storage-backend" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith("--hicache-storage-backend="):
            value = a.split("=", 1)[1]
    return value


def option(args: Sequence[str], name: str) -> Optional[str]:
    """The last value of ``--name VALUE`` / ``--name=VALUE`` in ``args`` (argparse's)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def server_env(args: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """What cpu-server sets for Mooncake, as L3 store or as PD transfer engine (never
    overriding the caller)."""
    wanted: dict[str, str] = {}
    if _storage_backend(args) == "mooncake":
        # A second, RDMA transfer engine TCP never uses would ask for a local IP.
        wanted.update(SGLANG_HICACHE_MOONCAKE_REUSE_TE="0", SGLANG_HOST_IP="127.0.0.1")
    if option(args, "--disaggregation-mode") in ("prefill", "decode"):
        # The transfer engine's TCP transport, its peers (bootstrap) on loopback.
        wanted.update(MOONCAKE_PROTOCOL="tcp", SGLANG_HOST_IP="127.0.0.1")
    return {k: v for k, v in wanted.items() if k not in env}
