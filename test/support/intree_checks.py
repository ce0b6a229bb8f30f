"""Checks on a patched SGLang tree (``hicache-async-ack-lab upstream-patch``), with
the plugin not loaded. Not collected by the suite (the file name does not
match ``test_*.py``): test_upstream_patch.py runs it with ``python -m pytest``
in a fresh interpreter whose PYTHONPATH puts the patched tree first and whose
SGLANG_PLUGINS excludes the plugin. Run elsewhere, the first check fails.

What SGLang's own unit test checks about ``check_hicache_events`` in the PP
and buffer modes (test_hiradix_pp_sync_drain.py), checked here on the patched
class with caches built as that test builds them: ``object.__new__`` and
exactly the fields it sets, ``ack_sync`` not among them (the class default keeps
them on the blocking path, issue 35), and with complete caches through
init_hicache's decision: a PP leader makes one blocking reduce of its counts, a
PP follower sends placeholders and pops PP0's counts, a buffer_only follower
reduces over the attention groups and pops its own counts.
test_upstream_patch.py also runs the ``fixture`` cases on the patch without the
class default (the patch before issue 35), where they must fail.
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
from hicache_async_ack_lab.intree.edits import STORAGE_QUEUES
from hicache_async_ack_lab.sim.cache import build_cache
from hicache_async_ack_lab.sim.collectives import FakeGroup
from hicache_async_ack_lab.testing.scenarios import attach_in_tree

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
    # Caches built without __init__ find the blocking path's None on the class.
    assert "ack_sync" in vars(UnifiedRadixCache) and UnifiedRadixCache.ack_sync is None


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


def pp_cache(kind: str, pp_rank: int, writes, loads, buffer_only=False):
    """A PP-stage cache with the blocking path's collaborators recorded.

    ``fixture``: as SGLang's test_hiradix_pp_sync_drain.py builds one:
    object.__new__, then the fields that test sets and no other (a field set
    here that it does not set would hide a read of it), so no ack_sync, no
    groups, no init_hicache. ``full``: every attribute a real cache has, in a
    TP group of 2 (eligible but for PP)."""
    recorded = ["_drain_async_work", "_all_reduce", "writing_check", "loading_check"]
    if kind == "fixture":
        cache = object.__new__(UnifiedRadixCache)
        cache.__dict__.update(
            tree_core=SimpleNamespace(
                enable_storage=buffer_only, write_back_duplicate_reclaim_digest=DIGEST
            ),
            linker=None,
            buffer_pipeline=None,
            enable_storage_metrics=False,
            storage_metrics_collector=None,
            cache_controller=SimpleNamespace(start_writing=Recorder()),
        )
    else:
        cache = build_cache(tp_group=FakeGroup(2), tp_world_size=2, pp_size=2).cache
        cache.tree_core.enable_storage = buffer_only
        cache.cache_controller.extra_host_mem_release_queues = {}
    cc = cache.cache_controller
    cc.ack_write_queue = [Ack(d) for d in writes]
    cc.ack_load_queue = [Ack(d) for d in loads]
    if buffer_only or kind == "full":  # the fixture's buffer case sets these too
        for size, name in enumerate(STORAGE_QUEUES, start=1):
            q: Queue = Queue()
            for _ in range(size):
                q.put(object())
            setattr(cc, name, q)
        recorded += ["_all_reduce_attn_groups", "_drain_storage_control_queues_impl"]
    mode = "buffer_only" if buffer_only else "cache"
    cache.__dict__.update(pp_rank=pp_rank, pp_size=2, host_memory_mode=mode)
    for name in recorded:
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
    buffer_only); a fixture's has the class default."""
    if kind == "full":
        attach_in_tree(cache)
    else:
        assert "ack_sync" not in vars(cache)  # what the fixture case is about
    assert cache.ack_sync is None


KINDS = ["fixture", "full"]


@pytest.mark.parametrize("kind", KINDS)
def test_pp_leader_reduces_its_counts_once_and_stays_blocking(async_reduces, kind):
    cache = pp_cache(kind, 0, writes=[True, False], loads=[True, True])
    cache.check_hicache_events()
    assert reduced(cache._all_reduce) == [[1, 2, DIGEST, -DIGEST]]
    assert finish_counts(cache) == ([1], [2])
    # (a fixture's cache has no groups: reducing over them would raise)
    assert getattr(cache._all_reduce_attn_groups, "calls", []) == []
    assert async_reduces == []
    stays_blocking(cache, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_pp_follower_sends_placeholders_and_pops_the_leaders_counts(async_reduces, kind):
    cache = pp_cache(kind, 1, writes=[True], loads=[True])

    def from_the_leader(tensor, op):  # what _pp_sync receives from PP0
        tensor.copy_(tensor.new_tensor([1, 1, DIGEST, -DIGEST]))

    cache.__dict__["_all_reduce"] = Recorder(from_the_leader)
    cache.check_hicache_events()
    assert [args[0].tolist() for args, _ in cache._all_reduce.calls] == [[1, 1, 0, 0]]
    assert finish_counts(cache) == ([1], [1])
    acks = cache.cache_controller.ack_write_queue + cache.cache_controller.ack_load_queue
    # placeholders: nothing was counted
    assert len(acks) == 2 and all(ack.asked == 0 for ack in acks)
    assert async_reduces == []
    stays_blocking(cache, kind)


@pytest.mark.skipif(
    "buffer_only" not in inspect.getsource(UnifiedRadixCache._sync_hicache_ready_counts),
    reason="this release reduces a buffer_only PP follower like any other PP stage",
)
@pytest.mark.parametrize("kind", KINDS)
def test_buffer_only_follower_reduces_over_the_attention_groups_with_local_counts(
    async_reduces, kind
):
    cache = pp_cache(kind, 1, writes=[True, False], loads=[True, True], buffer_only=True)
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


# ------------------------------------------------- next to a plugin rank (gloo)
def _mixed_rank(rank: int, port: int, out) -> None:
    """Rank 0: this patched tree's pipelined step. Rank 1: what a rank running
    the plugin sends on the same reduce, its stamp made by the plugin's own
    stamp code (>= 2**58). Sends (rank, error text, popped)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hicache_async_ack.protocol import PROTOCOL_VERSION, pack_stamp

    timeout = timedelta(seconds=300)
    error, popped = "", []
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        if rank == 0:
            sim = build_cache(tp_group=dist.group.WORLD, tp_world_size=2)
            attach_in_tree(sim.cache)
            assert sim.cache.ack_sync is not None, "the in-tree rank must pipeline"
            for kind in ("write", "load"):
                sim.add_ack(kind, lambda: True)  # ready everywhere: popped if agreed
            try:
                for _ in range(3):
                    sim.cache.check_hicache_events()
            finally:
                popped = sim.take_pops()
        else:
            x = pack_stamp(PROTOCOL_VERSION, False, 1, 0, 0)
            tensor = torch.tensor([0, 0, x, -x], dtype=torch.int64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        dist.destroy_process_group()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    out.put((rank, error, popped))


def test_next_to_a_plugin_rank_the_in_tree_rank_names_the_plugin_before_any_pop():
    """Issue 22 point 5, the in-tree side, over real gloo on 127.0.0.1."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from hicache_async_ack.protocol import IN_TREE_LIMIT, PROTOCOL_VERSION, pack_stamp

    assert pack_stamp(PROTOCOL_VERSION, False, 1, 0, 0) >= IN_TREE_LIMIT  # the contract
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_mixed_rank, args=(r, store.port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {r: (e, popped) for r, e, popped in (out.get(timeout=900) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    error, popped = results[0]
    assert "a peer runs the hicache-async-ack plugin" in error, results
    assert "SGLANG_PLUGINS" in error and popped == []
    assert results[1][0] == "", results  # the stand-in sent its reduce and left
