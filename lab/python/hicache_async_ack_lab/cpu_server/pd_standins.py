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
- ``HICACHE_ASYNC_ACK_CPU_PASS_TIMES_DIR``: every decode rank writes
  ``passes.<rank>.json``: how long ``check_offload_progress`` took per pass of the
  decode loop (stock's blocking reduce, or the plugin's wait, pops and issue), split by
  the latency injected at the time and by whether the pass began with a running batch
  (so launches a decode forward: the time that reaches the inter-token latency) or not;
- ``HICACHE_ASYNC_ACK_CPU_OFFLOAD_COUNT_DIR``: every decode rank writes
  ``offload.<rank>.json``: the offload acks and storage backups it popped, counted
  at upstream's two pop methods (which the plugin calls too), so stock and plugin
  are counted alike.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Callable, MutableMapping, Optional

from hicache_async_ack_lab.cpu_server.patching import (
    Patch,
    add_patches,
    dist_rank,
    read_rank_files,
    require_loopback,
    run_first,
    sleep_first,
    write_rank_file,
)

OFFLOAD_COUNT_DIR_VAR = "HICACHE_ASYNC_ACK_CPU_OFFLOAD_COUNT_DIR"
PASS_TIMES_DIR_VAR = "HICACHE_ASYNC_ACK_CPU_PASS_TIMES_DIR"
PASS_KINDS = ("running", "idle")  # the pass began with a running batch, or without
PASS_TIMES: dict = {}  # "times": this process's PassTimes, once installed

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
    where = (
        "the PD servers inside a private network namespace that has only lo "
        "(`hicache-async-ack-lab cpu-server --pd` makes one)"
    )
    run_first(module.MooncakeTransferEngine, "initialize", require_loopback(where))


def _patch_decode(module) -> None:
    """The negative control of the PD replies (settings.py, ``transfer``): the decode
    registers its KV buffers for the transfer in reverse order, so each layer's K from
    the prefill lands in another layer's V."""
    from hicache_async_ack_lab.cpu_server.settings import (
        CPU_BREAK_COPIES_VAR,
        parse_cpu_break_copies,
    )

    _time_offload_checks(module)
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
        write_rank_file(self.root, "offload", dist_rank(), self.values)


class PassTimes:
    """One decode rank's ``check_offload_progress`` time per loop pass:
    ``{latency ms: {kind: [passes, seconds, longest, popping]}}``, written to
    ``passes.<rank>.json`` at most every ``WRITE_EVERY_S`` (the idle loop spins, so
    the file trails the loop by about that much). ``popping``: the part spent in
    upstream's two pop methods, the same work on either path, so ``seconds -
    popping`` is what the sync itself put on the pass (stock's blocking reduce, or
    the plugin's wait, count and issue)."""

    WRITE_EVERY_S = 0.5

    def __init__(self, root: Path, latency: Optional[Callable[[], float]], rank: Callable[[], int]):
        self.root, self.latency, self.rank = root, latency, rank
        self.clock = time.perf_counter
        self.values: dict[str, dict[str, list]] = {}
        self.kind = "idle"  # the current pass's, set as it begins
        self.popping = 0.0  # this check's time in the pop methods so far
        self.written = 0.0

    def add(self, seconds: float) -> None:
        key = f"{self.latency() * 1000.0:g}" if self.latency is not None else "0"
        cell = self.values.setdefault(key, {k: [0, 0.0, 0.0, 0.0] for k in PASS_KINDS})[self.kind]
        cell[0] += 1
        cell[1] += seconds
        cell[2] = max(cell[2], seconds)
        cell[3] += self.popping
        now = time.monotonic()
        if now - self.written >= self.WRITE_EVERY_S:
            self.written = now
            self.write()

    def write(self) -> None:
        write_rank_file(self.root, "passes", self.rank(), self.values)

    def timed(self, check: Callable) -> Callable:
        def timed_check(*args, **kwargs):
            self.popping = 0.0
            t0 = self.clock()
            try:
                return check(*args, **kwargs)
            finally:
                self.add(self.clock() - t0)

        return timed_check

    def timed_pop(self, pop: Callable) -> Callable:
        @functools.wraps(pop)
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return pop(*args, **kwargs)
            finally:
                self.popping += self.clock() - t0

        return timed


def pass_times() -> Optional[PassTimes]:
    """This process's PassTimes, made at the first call, or None without the device."""
    root = os.environ.get(PASS_TIMES_DIR_VAR)
    if not root:
        return None
    if "times" not in PASS_TIMES:
        from hicache_async_ack_lab.cpu_server.settings import reduce_latency

        PASS_TIMES["times"] = PassTimes(Path(root), reduce_latency(), dist_rank)
    return PASS_TIMES["times"]


def _time_offload_checks(module) -> None:
    """With PASS_TIMES_DIR_VAR: each pass of the decode loop notes whether it begins
    with a running batch, and the manager's ``check_offload_progress`` is timed through
    an attribute of the instance, so the time includes whatever wraps the class's
    method (the plugin's hook, the injected latency)."""
    times = pass_times()
    if times is None:
        return

    def decode_pass(self, *args, **kwargs) -> None:
        manager = getattr(self, "decode_offload_manager", None)
        if manager is not None and "check_offload_progress" not in vars(manager):
            manager.check_offload_progress = times.timed(manager.check_offload_progress)
        running = getattr(self, "running_batch", None)
        times.kind = "running" if running is not None and not running.is_empty() else "idle"

    run_first(module.SchedulerDisaggregationDecodeMixin, "process_decode_queue", decode_pass)


def read_pass_times(root: Path) -> dict[str, dict]:
    """``{rank: {latency ms: {kind: [passes, seconds, longest]}}}`` from a directory."""
    return read_rank_files(root, "passes")


def read_offload_counts(root: Path) -> dict[str, dict]:
    """``{rank: {"offload": n, "backup": n}}`` from a count directory."""
    return read_rank_files(root, "offload")


def _patch_offload_manager(module) -> None:
    from hicache_async_ack_lab.cpu_server.settings import reduce_latency

    cls = module.DecodeKVCacheOffloadManager
    latency = reduce_latency()
    if latency is not None:  # with the plugin pipelining, this blocking path is not taken
        run_first(cls, "check_offload_progress", sleep_first(latency))
    times = pass_times()
    if times is not None:  # stock and the plugin pop through these two alike
        for name in ("_check_offload_progress", "_check_backup_progress"):
            setattr(cls, name, times.timed_pop(getattr(cls, name)))
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


PATCHES: dict[str, Patch] = {
    "sglang.srt.disaggregation.prefill": _patch_prefill,
    "sglang.srt.disaggregation.mooncake.conn": _patch_mooncake_conn,
    "sglang.srt.disaggregation.decode": _patch_decode,
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine": (
        _require_private_network
    ),
    "sglang.srt.disaggregation.decode_kvcache_offload_manager": _patch_offload_manager,
}


def register(patches: MutableMapping[str, Patch], standins: MutableMapping[str, str]) -> None:
    add_patches(patches, PATCHES.items())
    standins.update(STANDINS)
