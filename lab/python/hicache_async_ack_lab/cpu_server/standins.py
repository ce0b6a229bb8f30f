"""CPU stand-ins that let SGLang's real server run on a host without a GPU.

Test support only: loaded by ``hicache-async-ack-lab cpu-server`` (through the
``sitecustomize`` in ``boot/``, at interpreter start of every server process),
never by the plugin. Each stand-in replaces one GPU-only piece on the HiCache
path with a plain CPU equivalent; none touches what the plugin hooks, so the
server's scheduler, cache, cache controller and host pool are SGLang's own.

Skew mode (``HICACHE_ASYNC_ACK_CPU_SKEW``, env.py): on CPU every copy completes at
once, so no rank ever sees an ack pending that is done on a peer. With skew,
each ack's finish event reports done only after a per-rank number of polls,
as a GPU host's streams do, so the MIN over ranks matters.

Broken copies (``HICACHE_ASYNC_ACK_CPU_BREAK_COPIES``, settings.py): the negative
control of the end-to-end correctness checks. Every KV copy between the device
and host pools (backups, load-backs, and so what storage hits reach the device
through) copies nothing (``noop``) or writes the right rows into the wrong buffers
(``swap``: K and V, and layers, in each other's place).
A server started so must answer re-sent prompts differently; the checks that
compare replies must say so.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Callable

from hicache_async_ack_lab.cpu_server import bound, mooncake_standins, pd_standins
from hicache_async_ack_lab.cpu_server.patching import dist_rank, run_first, sleep_first
from hicache_async_ack_lab.cpu_server.settings import (
    CPU_BREAK_COPIES_VAR,
    CPU_SKEW_VAR,
    parse_cpu_break_copies,
    parse_cpu_skew,
    reduce_latency,
)

logger = logging.getLogger("hicache_async_ack_lab.cpu_server")

# What each stand-in replaces, in the words of the start-up log.
STANDINS = {
    "sgl_kernel.load_utils": "native-library loader neutralised (no libcuda); "
    "sgl_kernel's Python wrappers import",
    "sgl_kernel ops": "torch.ops.sgl_kernel.assign_req_to_token_pool_cpu and "
    "transfer_kv_direct registered as CPU index copies",
    "host KV pool": "direct-I/O op bound on CPU; host memory allocated without "
    "cudaHostRegister and never page-locked (storage staging pages included)",
}


# --- sgl_kernel ---------------------------------------------------------------


def _no_native_ops():
    return None


def _neutralise_loader(module) -> None:
    module._load_architecture_specific_ops = _no_native_ops
    module._preload_cuda_library = lambda: None


def assign_req_to_token_pool(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """req_to_token[r, start:end] = the next (end - start) slots of out_cache_loc."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = e - s
        req_to_token[r, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    """dst[dst_indices] = src[src_indices], layer by layer (token indices)."""
    src_idx = src_indices.long().cpu()
    dst_idx = dst_indices.long().cpu()
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_idx.to(dst.device)] = src[src_idx.to(src.device)].to(dst.device)


# Broken on purpose (the negative control; see the module docstring).
def transfer_kv_noop(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    """Copies nothing: dst keeps whatever its slots held."""


def transfer_kv_swapped(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    """Right rows, wrong buffers: the copy's buffer list reversed (K into V and V into K,
    layer into layer). Rows permuted within one prefix would not do: attention over a
    set of (K, V) pairs is the same in any order, RoPE being already in K."""
    transfer_kv_direct(src_layers, list(dst_layers)[::-1], src_indices, dst_indices, page_size)


TRANSFERS = {"": transfer_kv_direct, "noop": transfer_kv_noop, "swap": transfer_kv_swapped}


_LIBRARY = None


def _register_ops(_module=None) -> None:
    global _LIBRARY
    if _LIBRARY is not None:
        return
    import torch

    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define(
        "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, "
        "Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
    )
    lib.impl("assign_req_to_token_pool_cpu", assign_req_to_token_pool, "CPU")
    lib.define(
        "transfer_kv_direct(Tensor[] src_layers, Tensor(a!)[] dst_layers, Tensor src_indices, "
        "Tensor dst_indices, int page_size) -> ()"
    )
    mode = parse_cpu_break_copies(os.environ.get(CPU_BREAK_COPIES_VAR))
    lib.impl("transfer_kv_direct", TRANSFERS.get(mode, transfer_kv_direct), "CPU")
    if mode:
        logger.warning("cpu-server: KV copies BROKEN ON PURPOSE (%s=%s)", CPU_BREAK_COPIES_VAR,
                       mode)  # fmt: skip
    _LIBRARY = lib


# --- host KV pool -------------------------------------------------------------


def _alloc_plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    # No page-locking on a CPU-only host: the "device" pool is host memory too.
    import torch

    return torch.empty(dims, dtype=dtype, device=device)


def _patch_host_pool_common(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain


def _patch_host_pool_mha(module) -> None:
    if getattr(module, "transfer_kv_direct", None) is None:
        module.transfer_kv_direct = _call_registered_direct
    # Page-locked tensors need a CUDA driver: the storage path's staging pages
    # (get_dummy_flat_data_page) would ask for them; ours are plain host memory.
    for cls in list(vars(module).values()):
        if isinstance(cls, type) and "__init__" in vars(cls):
            if hasattr(cls, "get_dummy_flat_data_page"):
                _unpin_after_init(cls)


def _unpin_after_init(cls) -> None:
    real_init = cls.__init__

    def __init__(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if str(getattr(self, "device", "cpu")) == "cpu":
            self.pin_memory = False

    cls.__init__ = __init__


def _call_registered_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    import torch

    torch.ops.sgl_kernel.transfer_kv_direct.default(
        src_layers, dst_layers, src_indices, dst_indices, page_size
    )


# --- skew ---------------------------------------------------------------------


class SkewedEvent:
    """Wraps a finish event: query() is False for the first ``polls`` calls."""

    __slots__ = ("_event", "_left")

    def __init__(self, event, polls: int):
        self._event = event
        self._left = polls

    def query(self) -> bool:
        if self._left > 0:
            self._left -= 1
            return False
        return self._event.query()

    def synchronize(self) -> None:  # a blocking wait sees the copy finish
        self._left = 0
        self._event.synchronize()

    def __getattr__(self, name):
        return getattr(self._event, name)


def _rank_polls(polls: tuple[int, ...]) -> int:
    return polls[dist_rank() % len(polls)]


def _patch_cache_controller(module) -> None:
    polls = parse_cpu_skew(os.environ.get(CPU_SKEW_VAR))
    if not polls:
        return
    real_ack = module.HiCacheAck

    def skewed_ack(*args, **kwargs):
        ack = real_ack(*args, **kwargs)
        n = _rank_polls(polls)
        return ack._replace(finish_event=SkewedEvent(ack.finish_event, n)) if n else ack

    module.HiCacheAck = skewed_ack
    logger.info("cpu-server skew: acks report done after %s polls per rank", list(polls))


# --- injected collective latency ---------------------------------------------------


def _delay_stock_all_reduce(module) -> None:
    latency = reduce_latency()
    if latency is not None:
        run_first(module.UnifiedRadixCache, "_all_reduce", sleep_first(latency))


def _delay_plugin_reduces(module) -> None:
    from hicache_async_ack_lab.plugin_env import wrap_async_min

    latency = reduce_latency()
    if latency is None:
        return
    from hicache_async_ack_lab.sim.collectives import delayed

    wrap_async_min(lambda base: lambda group: delayed(base(group), latency))


# --- post-import patching ---------------------------------------------------------

PATCHES: dict[str, Callable] = {
    "sgl_kernel.load_utils": _neutralise_loader,
    "sgl_kernel": _register_ops,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_pool_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_host_pool_mha,
    "sglang.srt.managers.cache_controller": _patch_cache_controller,
    "sglang.srt.mem_cache.unified_radix_cache": _delay_stock_all_reduce,
    "hicache_async_ack.sglang_plugin": _delay_plugin_reduces,
}
mooncake_standins.register(PATCHES, STANDINS)  # the Mooncake backend's two direct ops
pd_standins.register(PATCHES, STANDINS)  # PD disaggregation's KV sender and early send
bound.register(PATCHES, STANDINS)  # the zero-sync bound, only with --cpu-bound


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Runs PATCHES[name] right after module ``name`` executes."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    """Install the stand-ins in this process (idempotent)."""
    if any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
        return
    parse_cpu_skew(os.environ.get(CPU_SKEW_VAR))  # fail at start, not at the first ack
    reduce_latency()  # a bad value or latency file fails here, not at the first reduce
    parse_cpu_break_copies(os.environ.get(CPU_BREAK_COPIES_VAR))
    if "sgl_kernel" in sys.modules:
        raise RuntimeError("cpu-server stand-ins must be installed before sgl_kernel is imported")
    sys.meta_path.insert(0, _PatchingFinder())
