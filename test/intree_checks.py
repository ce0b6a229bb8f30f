"""Checks on a patched SGLang tree (``hicache-async-ack upstream-patch``), with
the plugin not loaded. Not collected by the suite (the file name does not
match ``test_*.py``): test_upstream_patch.py runs it with ``python -m pytest``
in a fresh interpreter whose PYTHONPATH puts the patched tree first and whose
SGLANG_PLUGINS excludes the plugin. Run elsewhere, the first check fails.

What SGLang's own unit test checks about ``check_hicache_events`` in the PP
and buffer modes (test_hiradix_pp_sync_drain.py), checked here on the patched
class with caches built as that test builds them (no init_hicache, so no
HiCacheAckSync: the blocking path): a PP leader makes one blocking reduce of its
counts, a PP follower sends placeholders and pops PP0's counts, a buffer_only
follower reduces over the attention groups and pops its own counts.
"""

from __future__ import annotations

import importlib
import inspect
import os
from queue import Queue
from types import SimpleNamespace

import pytest
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from hicache_async_ack.env import PLUGINS_VAR
from hicache_async_ack.features.ack_sync import STORAGE_QUEUES
from hicache_async_ack.sim.cache import build_cache
from hicache_async_ack.sim.collectives import FakeGroup
from hicache_async_ack.testing.scenarios import attach_in_tree

MODULE = "sglang.srt.mem_cache.unified_cache.hicache_ack_sync"
intree = importlib.import_module(MODULE)  # ImportError: not a patched tree
DIGEST = 0


def test_the_patched_tree_is_the_one_in_use_and_the_plugin_is_not_loaded():
    from sglang.srt.plugins import load_plugins

    from hicache_async_ack.sglang_plugin import is_hooked

    assert "hicache_async_ack" not in os.environ.get(PLUGINS_VAR, "hicache_async_ack")
    load_plugins()
    for name in ("init_hicache", "check_hicache_events", "_sync_hicache_ready_counts"):
        assert not is_hooked(getattr(UnifiedRadixCache, name)), name
    assert "site-packages" not in intree.__file__
    # No class attribute: __init__ defaults it, as it does the other collaborators
    assert not hasattr(UnifiedRadixCache, "ack_sync")


# ------------------------------------------------------------- PP and buffer
class Ack:
    """An ack whose finish_event records whether anyone asked it."""

    def __init__(self, done: bool):
        self.finish_event = self
        self.done = done
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.done


class Recorder:
    """Stands in for one cache method: records its calls, optionally acts."""

    def __init__(self, act=None):
        self.calls: list[tuple[tuple, dict]] = []
        self.act = act

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.act is not None:
            self.act(*args, **kwargs)


def pp_cache(kind: str, pp_rank: int, writes, loads, host_memory_mode="cache", storage=False):
    """A PP-stage cache with the blocking path's collaborators recorded.

    ``bare``: object.__new__ with only what check_hicache_events reads (as
    SGLang's unit tests build one; no groups, no init_hicache). ``full``: every
    attribute a real cache has, in a TP group of 2 (eligible but for PP)."""
    if kind == "bare":
        cache = object.__new__(UnifiedRadixCache)
        cache.__dict__.update(
            tree_core=SimpleNamespace(
                enable_storage=storage, write_back_duplicate_reclaim_digest=0
            ),
            linker=None,
            ack_sync=None,  # what the patch adds to SGLang's own test's cache
            buffer_pipeline=None,
            enable_storage_metrics=False,
            storage_metrics_collector=None,
            cache_controller=SimpleNamespace(start_writing=lambda: None),
        )
    else:
        cache = build_cache(tp_group=FakeGroup(2), tp_world_size=2, pp_size=2).cache
        cache.__dict__["ack_sync"] = None  # as the patched __init__ leaves it
        cache.tree_core.enable_storage = storage
    cc = cache.cache_controller
    cc.ack_write_queue = [Ack(d) for d in writes]
    cc.ack_load_queue = [Ack(d) for d in loads]
    cc.extra_host_mem_release_queues = {}
    for size, name in enumerate(STORAGE_QUEUES, start=1):
        q: Queue = Queue()
        for _ in range(size):
            q.put(object())
        setattr(cc, name, q)
    cache.__dict__.update(pp_rank=pp_rank, pp_size=2, host_memory_mode=host_memory_mode)
    for name in (
        "_drain_async_work",
        "_all_reduce",
        "_all_reduce_attn_groups",
        "writing_check",
        "loading_check",
        "_drain_storage_control_queues_impl",
    ):
        cache.__dict__[name] = Recorder()
    return cache


def reduced(recorder: Recorder) -> list[list[int]]:
    return [args[0].tolist() for args, _ in recorder.calls]


def finish_counts(cache) -> tuple:
    return tuple(
        [kw["finish_count"] for _, kw in getattr(cache, name).calls]
        for name in ("writing_check", "loading_check")
    )


@pytest.fixture
def async_reduces(monkeypatch) -> list:
    """Every async all_reduce issued (there must be none)."""
    issued: list = []
    monkeypatch.setattr(intree.torch.distributed, "all_reduce", lambda *a, **k: issued.append(a))
    return issued


def stays_blocking(cache, kind: str) -> None:
    """A complete cache gets no HiCacheAckSync from init_hicache (PP or
    buffer_only); a bare one has none at all."""
    if kind == "full":
        attach_in_tree(cache)
    assert cache.ack_sync is None


@pytest.mark.parametrize("kind", ["bare", "full"])
def test_pp_leader_reduces_its_counts_once_and_stays_blocking(async_reduces, kind):
    cache = pp_cache(kind, 0, writes=[True, False], loads=[True, True])
    cache.check_hicache_events()
    assert reduced(cache._all_reduce) == [[1, 2, DIGEST, -DIGEST]]
    assert finish_counts(cache) == ([1], [2])
    assert cache._all_reduce_attn_groups.calls == []
    assert async_reduces == []
    stays_blocking(cache, kind)


@pytest.mark.parametrize("kind", ["bare", "full"])
def test_pp_follower_sends_placeholders_and_pops_the_leaders_counts(async_reduces, kind):
    cache = pp_cache(kind, 1, writes=[True], loads=[True])

    def from_the_leader(tensor, op):  # what _pp_sync receives from PP0
        tensor.copy_(tensor.new_tensor([1, 1, DIGEST, -DIGEST]))

    cache.__dict__["_all_reduce"] = Recorder(from_the_leader)
    cache.check_hicache_events()
    assert [args[0].tolist() for args, _ in cache._all_reduce.calls] == [[1, 1, 0, 0]]
    assert finish_counts(cache) == ([1], [1])
    acks = cache.cache_controller.ack_write_queue + cache.cache_controller.ack_load_queue
    assert all(ack.asked == 0 for ack in acks)  # placeholders: nothing was counted
    assert async_reduces == []
    stays_blocking(cache, kind)


@pytest.mark.skipif(
    "buffer_only" not in inspect.getsource(UnifiedRadixCache._sync_hicache_ready_counts),
    reason="this release reduces a buffer_only PP follower like any other PP stage",
)
@pytest.mark.parametrize("kind", ["bare", "full"])
def test_buffer_only_follower_reduces_over_the_attention_groups_with_local_counts(
    async_reduces, kind
):
    cache = pp_cache(
        kind,
        1,
        writes=[True, False],
        loads=[True, True],
        host_memory_mode="buffer_only",
        storage=True,
    )
    cache.check_hicache_events()
    assert cache._all_reduce.calls == []
    assert reduced(cache._all_reduce_attn_groups) == [[1, 2, 1, 2, 3, 4, DIGEST, -DIGEST]]
    assert finish_counts(cache) == ([1], [2])
    assert cache._drain_storage_control_queues_impl.calls == [
        (
            (),
            dict(
                n_storage_hit=1,
                n_ack_prefetch=2,
                n_backup=3,
                n_release=4,
                extra_release_counts={},
                log_metrics=True,
            ),
        )
    ]
    assert async_reduces == []
    stays_blocking(cache, kind)
