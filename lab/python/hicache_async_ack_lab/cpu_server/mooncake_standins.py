"""cpu-server stand-ins for SGLang's Mooncake storage backend on a CPU-only host.

For Mooncake SGLang switches the host KV layout to ``page_first_direct``, whose
two direct copy ops ``pool_host/mha.py`` binds only on CUDA/HIP/XPU: on CPU the
first write-back or load raises NameError in every scheduler. Here they are plain
index copies. Mooncake's transfer engine also listens on every interface whatever
it is told, so a server process that loads the backend outside a network
namespace with only ``lo`` (``hicache-async-ack-lab mooncake-master``) refuses to
create the store.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Callable, MutableMapping, Optional

from hicache_async_ack_lab.cpu_server import patching
from hicache_async_ack_lab.cpu_server.patching import Patch, run_first

# HICACHE_ASYNC_ACK_CPU_COUNT_DIR (storage bench and tests only): a directory where
# each scheduler writes counts.<rank>.json: its scheduling passes, the blocking cache
# collectives (UnifiedRadixCache._all_reduce_attn_groups) it ran, and the storage
# prefetches in flight at each pass (SGLang's own ongoing_prefetch), so stock and
# plugin are counted alike; and its L3 traffic: the hit queries its cache controller
# sent to the store (HybridCacheController._storage_hit_query, which the prefetch
# thread and UnifiedRadixCache.query_storage_hit_length both call) and the tokens its
# prefetches brought into host memory (UnifiedRadixCache._handle_prefetch_result's
# operation.completed_tokens, what SGLang's log_prefetched_tokens counts).
COUNT_DIR_VAR = "HICACHE_ASYNC_ACK_CPU_COUNT_DIR"

STANDINS = {
    "mooncake host layout": "transfer_kv_per_layer_direct_pf_lf and "
    "transfer_kv_all_layer_direct_lf_pf (page_first_direct) bound as CPU index copies",
    "mooncake network": "the store is created only in a network namespace with just lo",
    "host memory reserve": "1 GiB instead of SGLang's 10 GiB kept free beside the host pool "
    "(the tiny model's pools are KBs; a shared box with servers, masters and their store "
    "segments has less than 10 GiB free)",
}
# What SGLang keeps free beside a host pool on this host (its own: 10 GiB).
HOST_MEMORY_RESERVE_BYTES = 1 << 30


def _pages(indices, page_size: int):
    idx = indices.long().cpu()
    return idx // page_size, idx % page_size


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
) -> None:
    """Host (page, layer, offset) rows of one layer -> device token rows."""
    page, offset = _pages(src_indices, page_size)
    dst_idx = dst_indices.long().cpu()
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_idx.to(dst.device)] = src[page, layer_id, offset].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
) -> None:
    """Device token rows of every layer -> host (page, layer, offset) rows.

    ``src_ptrs`` is all K layers then all V layers; ``dst_ptrs`` the host K and V."""
    layers = len(src_ptrs) // len(dst_ptrs)
    page, offset = _pages(dst_indices, page_size)
    src_idx = src_indices.long().cpu()
    for j, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            dst[page, layer, offset] = src[src_idx.to(src.device)].to(dst.device)


def _bind_direct_ops(module) -> None:
    from hicache_async_ack_lab.cpu_server.settings import (
        CPU_BREAK_COPIES_VAR,
        parse_cpu_break_copies,
    )

    # The negative control (settings.py) breaks these copies as it does the others.
    mode = parse_cpu_break_copies(os.environ.get(CPU_BREAK_COPIES_VAR))
    mode = "" if mode == "transfer" else mode  # the PD transfer's, not these copies
    for op in (transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
        if getattr(module, op.__name__, None) is None:
            setattr(module, op.__name__, _broken(op, mode) if mode else op)


def _broken(op: Callable, mode: str) -> Callable:
    """``noop``: copies nothing. ``swap``: K and V in each other's place, on the way to
    the host only (swapped both ways, a round trip through the host would cancel)."""
    if mode == "swap" and op is transfer_kv_per_layer_direct_pf_lf:
        return op

    @functools.wraps(op)
    def broken(*args, **kwargs) -> None:  # SGLang passes them by keyword
        if mode == "swap":
            if "dst_ptrs" in kwargs:
                kwargs["dst_ptrs"] = list(kwargs["dst_ptrs"])[::-1]
            else:
                args = (args[0], list(args[1])[::-1], *args[2:])
            op(*args, **kwargs)

    return broken


def _require_private_network(module) -> None:
    # At the store's construction, not the module's import: SGLang imports the
    # module for any HiCache server (its L3 layout report).
    where = (
        "the server inside the master's private network namespace (see "
        "`hicache-async-ack-lab mooncake-master --help`)"
    )
    run_first(module.MooncakeStore, "__init__", patching.require_loopback(where))


class _Counts:
    """Per-process counts, written at most every 0.2 s (and so soon after a pass)."""

    FIELDS = (
        "passes",
        "blocking",
        "prefetch_passes",
        "prefetches_voted",
        "prefetch_max",
        # every all_reduce (the cache's blocking ones and the plugin's async ones)
        # run in the passes that had a prefetch to decide
        "deciding_all_reduces",
        # hit queries sent to the L3 store (batch_exists / batch_exists_v2), and those
        # _storage_hit_query answered without one (operation.assume_stored)
        "l3_queries",
        "l3_queries_assumed",
        "l3_tokens_loaded",  # completed_tokens of every prefetch result handled
    )
    # SGLang's own cumulative prefetch outcomes (0.5.23's UnifiedRadixCache keeps
    # them): why a request did or did not wait on its L3 prefetch
    OUTCOMES = ("issued", "declined_rate_limited", "declined_too_short", "declined_device_covered")

    def __init__(self, root: Path):
        self.root = root
        self.values = dict.fromkeys(self.FIELDS, 0)
        self._written = 0.0
        self._deciding = False  # the pass now running has a prefetch in flight
        # the prefetch thread queries while the scheduler's thread passes
        self._lock = threading.Lock()

    def pass_seen(self, in_flight: int) -> None:
        v = self.values
        v["passes"] += 1
        self._deciding = bool(in_flight)
        if in_flight:
            v["prefetch_passes"] += 1
            v["prefetches_voted"] += in_flight
            v["prefetch_max"] = max(v["prefetch_max"], in_flight)
        self._maybe_write()

    def outcomes_seen(self, stats: dict) -> None:
        with self._lock:
            for key in self.OUTCOMES:
                if key in stats:
                    self.values[key] = int(stats[key])

    def l3_query_seen(self, assumed: bool = False) -> None:
        self._add("l3_queries_assumed" if assumed else "l3_queries", 1)

    def l3_loaded(self, tokens: int) -> None:
        self._add("l3_tokens_loaded", tokens)

    def _add(self, key: str, n: int) -> None:
        with self._lock:
            self.values[key] += n
        self._maybe_write()

    def collective_seen(self, blocking: bool = True) -> None:
        if blocking:
            self.values["blocking"] += 1
        if self._deciding:
            self.values["deciding_all_reduces"] += 1
        self._maybe_write()

    def _maybe_write(self) -> None:
        now = time.monotonic()
        if now - self._written >= 0.2:
            self._written = now
            self.write()

    def write(self) -> None:
        rank = patching.dist_rank()
        with self._lock:
            patching.write_rank_file(self.root, "counts", rank, self.values)


_COUNTS: list[_Counts] = []


def _counts() -> Optional[_Counts]:
    root = os.environ.get(COUNT_DIR_VAR)
    if not root:
        return None
    if not _COUNTS:
        _COUNTS.append(_Counts(Path(root)))
    return _COUNTS[0]


def _count_collectives(module) -> None:
    counts = _counts()
    if counts is not None:
        run_first(
            module.UnifiedRadixCache,
            "_all_reduce_attn_groups",
            lambda self, *args, **kwargs: counts.collective_seen(),
        )


def _count_l3_queries(module) -> None:
    counts = _counts()
    if counts is None:
        return

    def query(self, operation, *args, **kwargs) -> None:
        counts.l3_query_seen(assumed=bool(getattr(operation, "assume_stored", False)))

    run_first(module.HybridCacheController, "_storage_hit_query", query)


def _count_l3_loads(module) -> None:
    counts = _counts()
    if counts is None:
        return

    def result(self, operation, *args, **kwargs) -> None:
        counts.l3_loaded(int(getattr(operation, "completed_tokens", 0) or 0))

    run_first(module.UnifiedRadixCache, "_handle_prefetch_result", result)


def _count_plugin_reduces(module) -> None:
    """The plugin's async all_reduces (the environment's async MIN), counted
    as they are issued."""
    from hicache_async_ack_lab.plugin_env import wrap_async_min

    counts = _counts()
    if counts is None:
        return

    def counting(base):
        def factory(group):
            issue = base(group)

            def counted(values):
                counts.collective_seen(blocking=False)
                return issue(values)

            return counted

        return factory

    wrap_async_min(counting)


def _count_passes(module) -> None:
    counts = _counts()
    if counts is None:
        return

    def scheduling_pass(self, *args, **kwargs) -> None:
        cache = getattr(self, "tree_cache", None)
        ongoing = getattr(cache, "ongoing_prefetch", None)
        snapshot = getattr(cache, "prefetch_outcome_stats_snapshot", None)
        if snapshot is not None:  # before pass_seen, which may write the counts
            counts.outcomes_seen(snapshot())
        counts.pass_seen(len(ongoing) if ongoing else 0)

    run_first(module.Scheduler, "get_next_batch_to_run", scheduling_pass)


def read_counts(root: Path) -> dict[str, dict[str, int]]:
    """{rank: counts} as the schedulers last wrote them under ``root``."""
    return patching.read_rank_files(root, "counts")


def _lower_host_memory_reserve(module) -> None:
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = min(
        HOST_MEMORY_RESERVE_BYTES, module.HICACHE_HOST_MEMORY_RESERVE_BYTES
    )


PATCHES: tuple[tuple[str, Patch], ...] = (
    ("sglang.srt.mem_cache.pool_host.mha", _bind_direct_ops),
    ("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store", _require_private_network),
    ("sglang.srt.mem_cache.unified_radix_cache", _count_collectives),
    ("sglang.srt.mem_cache.unified_radix_cache", _count_l3_loads),
    ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", _count_l3_queries),
    ("sglang.srt.managers.scheduler", _count_passes),
    ("hicache_async_ack.sglang_plugin", _count_plugin_reduces),
    ("sglang.srt.mem_cache.pool_host.base", _lower_host_memory_reserve),
)


def register(patches: MutableMapping[str, Patch], standins: MutableMapping[str, str]) -> None:
    """Add these to cpu-server's post-import patches and its start-up description."""
    patching.add_patches(patches, PATCHES)
    standins.update(STANDINS)
