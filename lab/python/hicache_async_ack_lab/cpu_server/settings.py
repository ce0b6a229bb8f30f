"""cpu-server's own settings: read by its CPU stand-ins (test support), never by the
plugin, whose settings are all in :mod:`hicache_async_ack.env`."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

# HICACHE_ASYNC_ACK_CPU_SKEW: comma-separated polls per global rank
# (rank i uses entry i mod len) before an ack's finish event reports done, e.g.
# "0,3"; on CPU every copy finishes at once, on a GPU host not on every rank alike.
CPU_SKEW_VAR = "HICACHE_ASYNC_ACK_CPU_SKEW"
# HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_MS: model a host whose gloo all_reduce is slow
# (the seed's B200 host: 3.2 ms): every blocking UnifiedRadixCache._all_reduce sleeps
# this long first; the plugin's async reduces complete no earlier than this after issue.
CPU_REDUCE_LATENCY_VAR = "HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_MS"
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
