"""cpu-server stand-ins for PD disaggregation on a CPU-only host (test support).

A prefill server (``--disaggregation-mode prefill``) sends its KV to a decode server
over Mooncake's transfer engine (``--disaggregation-transfer-backend mooncake_tcp``).
Two of the prefill's steps assume a GPU:

- ``MooncakeKVSender.supports_host_tensor_indices``: the first KV send copies the page
  indices into page-locked host memory and records a ``torch.cuda.Event`` for the
  transfer worker to wait on. On CPU the indices are host tensors already: the sender
  says it has no such path, and the prefill takes its plain one.
- ``maybe_send_cached_prefix_chunk`` (a prefix-cache hit on the prefill, with the
  overlap loop on) records a ``torch.cuda.Event`` on the forward stream so the
  transfer waits for the previous forward's KV writes. On CPU that forward ran to
  its end before the scheduler got here: the prefill module's ``torch.cuda.Event``
  is an event that is complete when recorded.

Mooncake's transfer engine listens on every interface whatever it is told, so a
server process refuses to start one outside a network namespace that has only
``lo`` (``hicache-async-ack-lab cpu-server --pd`` makes one).

Measurement and test devices of the decode offload sync (``--disaggregation-decode-
enable-offload-kvcache``), read by these stand-ins only:

- injected latency (``HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_MS``): stock's blocking
  ``check_offload_progress`` reduce sleeps that long first, as the ack sync's does;
- ``HICACHE_ASYNC_ACK_CPU_OFFLOAD_COUNT_DIR``: every decode rank writes
  ``offload.<rank>.json``: the offload acks and storage backups it popped, counted
  at upstream's two pop methods (which the plugin calls too), so stock and plugin
  are counted alike.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Callable, MutableMapping

OFFLOAD_COUNT_DIR_VAR = "HICACHE_ASYNC_ACK_CPU_OFFLOAD_COUNT_DIR"

STANDINS = {
    "pd kv sender": "MooncakeKVSender without the page-locked index copy and its CUDA "
    "event (supports_host_tensor_indices off: the indices are host tensors already)",
    "pd early send": "the prefill's early prefix send records a CPU event that is "
    "complete at once (the previous forward ran to its end on CPU)",
    "pd network": "Mooncake's transfer engine starts only in a network namespace with just lo",
}


class DoneEvent:
    """A ``torch.cuda.Event`` for work that ran to its end when it was launched."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Forward:
    """Forwards every attribute to ``real`` except the ones set on the instance."""

    def __init__(self, real, **own) -> None:
        self._real = real
        self.__dict__.update(own)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _patch_prefill(module) -> None:
    # Only this module's torch: every other CUDA call of the server stays as it is.
    import torch

    module.torch = _Forward(torch, cuda=_Forward(torch.cuda, Event=DoneEvent))


def _patch_mooncake_conn(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _require_private_network(module) -> None:
    cls = module.MooncakeTransferEngine
    real = cls.initialize

    @functools.wraps(real)
    def initialize(self, *args, **kwargs):
        from hicache_async_ack_lab.cpu_server.netns import only_loopback

        if not only_loopback():
            raise RuntimeError(
                "cpu-server: Mooncake's transfer engine listens on every interface; run "
                "the PD servers inside a private network namespace that has only lo "
                "(`hicache-async-ack-lab cpu-server --pd` makes one)"
            )
        return real(self, *args, **kwargs)

    cls.initialize = initialize


def _patch_decode(module) -> None:
    """The negative control of the PD replies (settings.py, ``transfer``): the decode
    registers its KV buffers for the transfer in reverse order, so each layer's K from
    the prefill lands in another layer's V."""
    from hicache_async_ack_lab.cpu_server.settings import (
        CPU_BREAK_COPIES_VAR,
        parse_cpu_break_copies,
    )

    if parse_cpu_break_copies(os.environ.get(CPU_BREAK_COPIES_VAR)) != "transfer":
        return
    real = module.get_kv_transfer_buf_infos

    @functools.wraps(real)
    def reversed_buf_infos(pool):
        return tuple(list(x)[::-1] for x in real(pool))

    module.get_kv_transfer_buf_infos = reversed_buf_infos


# --- the decode offload sync's devices ---------------------------------------------


class _OffloadCounts:
    """One decode rank's pops, written at every pop that popped something."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.values = {"offload": 0, "backup": 0}

    def add(self, key: str, n: int) -> None:
        if n:
            self.values[key] += n
            self.write()

    def write(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".offload.{rank}.json.{os.getpid()}"
        tmp.write_text(json.dumps(self.values))
        tmp.replace(self.root / f"offload.{rank}.json")


def read_offload_counts(root: Path) -> dict[str, dict]:
    """``{rank: {"offload": n, "backup": n}}`` from a count directory."""
    out = {}
    for path in sorted(Path(root).glob("offload.*.json")):
        out[path.name.split(".")[1]] = json.loads(path.read_text())
    return out


def _patch_offload_manager(module) -> None:
    from hicache_async_ack_lab.cpu_server.settings import (
        CPU_REDUCE_LATENCY_VAR,
        parse_cpu_reduce_latency_ms,
    )

    cls = module.DecodeKVCacheOffloadManager
    latency = parse_cpu_reduce_latency_ms(os.environ.get(CPU_REDUCE_LATENCY_VAR)) / 1000.0
    if latency:
        real_check = cls.check_offload_progress

        # wraps(): the plugin's guard fingerprints the method (unwrapped); with the
        # plugin pipelining, this blocking path is not taken.
        @functools.wraps(real_check)
        def slow_check_offload_progress(self, *args, **kwargs):
            time.sleep(latency)
            return real_check(self, *args, **kwargs)

        cls.check_offload_progress = slow_check_offload_progress
    root = os.environ.get(OFFLOAD_COUNT_DIR_VAR)
    if not root:
        return
    counts = _OffloadCounts(Path(root))
    for name, key in (("_check_offload_progress", "offload"), ("_check_backup_progress", "backup")):
        setattr(cls, name, _counting(getattr(cls, name), counts, key))


def _counting(real: Callable, counts: _OffloadCounts, key: str) -> Callable:
    @functools.wraps(real)
    def counted(self, finish_count, *args, **kwargs):
        out = real(self, finish_count, *args, **kwargs)
        counts.add(key, int(finish_count))
        return out

    return counted


PATCHES: dict[str, Callable] = {
    "sglang.srt.disaggregation.prefill": _patch_prefill,
    "sglang.srt.disaggregation.mooncake.conn": _patch_mooncake_conn,
    "sglang.srt.disaggregation.decode": _patch_decode,
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine": (
        _require_private_network
    ),
    "sglang.srt.disaggregation.decode_kvcache_offload_manager": _patch_offload_manager,
}


def register(patches: MutableMapping[str, Callable], standins: MutableMapping[str, str]) -> None:
    for name, patch in PATCHES.items():
        first = patches.get(name)
        patches[name] = patch if first is None else _both(first, patch)
    standins.update(STANDINS)


def _both(first: Callable, then: Callable) -> Callable:
    def both(module) -> None:
        first(module)
        then(module)

    return both
