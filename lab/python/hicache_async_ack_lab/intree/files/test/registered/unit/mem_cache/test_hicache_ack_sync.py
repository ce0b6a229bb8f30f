"""Unit tests for the pipelined HiCache ready-count all_reduce (HiCacheAckSync)."""

import unittest
from queue import Queue
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.unified_cache.hicache_ack_sync import HiCacheAckSync
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

STORAGE_QUEUES = (
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)


class _Group:
    """An async MIN all_reduce over this rank and a peer that sends `peer` when
    the reduce completes (None: the same values as this rank)."""

    def __init__(self):
        self.peer = None
        self.reduced = []

    def all_reduce(self, tensor, op, group, async_op):
        assert async_op and op == torch.distributed.ReduceOp.MIN
        self.reduced.append(tensor.tolist())
        return SimpleNamespace(wait=lambda: self._complete(tensor))

    def _complete(self, tensor):
        if self.peer is not None:
            torch.minimum(tensor, torch.tensor(self.peer), out=tensor)


def _ack(ready=True):
    return SimpleNamespace(finish_event=SimpleNamespace(query=lambda: ready))


def _make_cache(storage=False, pp_size=1, host_memory_mode="cache"):
    """A cache built the way test_hiradix_pp_sync_drain.py builds one, whose
    writing_check / loading_check / storage drain pop from the queues' heads
    and record what they popped."""
    cache = object.__new__(UnifiedRadixCache)
    cache.tree_core = SimpleNamespace(
        enable_storage=storage, write_back_duplicate_reclaim_digest=0
    )
    cache.pp_rank = 0
    cache.pp_size = pp_size
    cache.host_memory_mode = host_memory_mode
    cache.enable_storage_metrics = False
    cache.storage_metrics_collector = None
    cache.buffer_pipeline = None
    cache.linker = None
    cache.tp_group = "tp"
    cache.tp_world_size = 2
    cache.attn_cp_group = None
    cache.attn_tp_group = None
    cache._drain_async_work = MagicMock()
    cache._all_reduce = MagicMock()
    cache.cache_controller = SimpleNamespace(
        ack_write_queue=[],
        ack_load_queue=[],
        extra_host_mem_release_queues={},
        start_writing=MagicMock(),
    )
    for name in STORAGE_QUEUES:
        setattr(cache.cache_controller, name, Queue())
    cache.popped = []

    def pop(queue_name):
        def check(finish_count):
            queue = getattr(cache.cache_controller, queue_name)
            cache.popped += [queue.pop(0) for _ in range(finish_count)]

        return check

    def drain(**counts):
        for name, arg in zip(STORAGE_QUEUES, ("n_storage_hit", "n_ack_prefetch")):
            q = getattr(cache.cache_controller, name)
            cache.popped += [q.get_nowait() for _ in range(counts[arg])]

    cache.writing_check = MagicMock(side_effect=pop("ack_write_queue"))
    cache.loading_check = MagicMock(side_effect=pop("ack_load_queue"))
    cache._drain_storage_control_queues_impl = MagicMock(side_effect=drain)
    return cache


def _start(test, patcher):
    patcher.start()
    test.addCleanup(patcher.stop)


class TestHiCacheAckSyncCreate(CustomTestCase):
    def test_pipelines_over_the_tp_group_at_depth_1(self):
        sync = HiCacheAckSync.create(_make_cache(), "null")
        self.assertIsNotNone(sync)
        self.assertEqual((sync.group, sync.depth), ("tp", 1))

    def test_keeps_the_blocking_path_where_not_eligible(self):
        for name, cache in [
            ("pp", _make_cache(pp_size=2)),
            ("buffer_only", _make_cache(host_memory_mode="buffer_only")),
            ("single rank", _make_cache()),
        ]:
            if name == "single rank":
                cache.tp_world_size = 1
            with self.subTest(name):
                self.assertIsNone(HiCacheAckSync.create(cache, "null"))
        self.assertIsNone(HiCacheAckSync.create(_make_cache(), "decode"))

    def test_the_switch_restores_the_blocking_path(self):
        with envs.SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC.override(False):
            self.assertIsNone(HiCacheAckSync.create(_make_cache(), "null"))

    def test_a_depth_out_of_range_stops_start_up(self):
        for value in ("9", "0"):
            with self.subTest(value=value):
                with envs.SGLANG_HICACHE_ASYNC_ACK_DEPTH.override(value):
                    with self.assertRaisesRegex(ValueError, "from 1 to 8"):
                        HiCacheAckSync.create(_make_cache(), "null")


class TestPipelinedCheckHiCacheEvents(CustomTestCase):
    def setUp(self):
        self.group = _Group()
        _start(
            self, patch.object(torch.distributed, "all_reduce", self.group.all_reduce)
        )

    def _pipelined(self, depth=1, **kwargs):
        cache = _make_cache(**kwargs)
        with envs.SGLANG_HICACHE_ASYNC_ACK_DEPTH.override(depth):
            cache.ack_sync = HiCacheAckSync.create(cache, "null")
        return cache

    def _step(self, cache):
        cache.popped = []
        cache.check_hicache_events()
        return cache.popped

    def test_pops_what_was_agreed_one_step_later(self):
        cache = self._pipelined()
        acks = [_ack(), _ack(), _ack(ready=False)]
        cache.cache_controller.ack_write_queue += acks
        self.assertEqual(self._step(cache), [])
        self.assertEqual(self.group.reduced[-1][:2], [2, 0])
        self.assertEqual(self._step(cache), acks[:2])
        cache._all_reduce.assert_not_called()

    def test_pops_depth_steps_later(self):
        cache = self._pipelined(depth=2)
        acks = [_ack(), _ack()]
        cache.cache_controller.ack_load_queue += acks
        self.assertEqual(self._step(cache), [])
        self.assertEqual(self._step(cache), [])
        self.assertEqual(self._step(cache), acks)
        self.assertEqual(self._step(cache), [])  # counted again, popped once

    def test_pops_the_minimum_over_ranks(self):
        cache = self._pipelined()
        acks = [_ack(), _ack(), _ack()]
        cache.cache_controller.ack_write_queue += acks
        self._step(cache)
        x = self.group.reduced[-1][-2]
        self.group.peer = [1, 0, x, -x]
        self.assertEqual(self._step(cache), acks[:1])

    def test_entries_popped_elsewhere_in_between_are_not_popped_again(self):
        cache = self._pipelined()
        queue = cache.cache_controller.ack_write_queue
        acks = [_ack(), _ack(), _ack()]
        queue += acks
        self._step(cache)
        queue.pop(0)  # e.g. a blocking loading_check, on every rank
        self.assertEqual(self._step(cache), acks[1:])
        self._step(cache)
        later = [_ack()]
        queue[:] = later  # a reset, then new acks: none was agreed on
        self.assertEqual(self._step(cache), [])
        self.assertEqual(self._step(cache), later)

    def test_storage_queues_are_counted_and_drained(self):
        cache = self._pipelined(storage=True)
        hit = cache.cache_controller.prefetch_hit_queue
        entries = [object(), object()]
        for entry in entries:
            hit.put(entry)
        self.assertEqual(self._step(cache), [])
        self.assertEqual(self.group.reduced[-1][:6], [0, 0, 2, 0, 0, 0])
        self.assertEqual(self._step(cache), entries)
        self.assertTrue(hit.empty())

    def test_counts_with_the_blocking_paths_local_counts(self):
        cache = self._pipelined(storage=True)
        cc = cache.cache_controller
        cc.ack_write_queue += [_ack(), _ack(ready=False), _ack()]
        cc.ack_load_queue += [_ack()]
        for size, name in enumerate(STORAGE_QUEUES, start=1):
            for _ in range(size):
                getattr(cc, name).put(object())
        write, load, sizes, _ = cache._local_hicache_ready_counts()
        cache.ack_sync.issue()
        self.assertEqual(self.group.reduced[-1][:-2], [write, load, *sizes])
        self.assertEqual(self.group.reduced[-1][:-2], [1, 1, 1, 2, 3, 4])

    def test_a_blocking_peer_stops_every_rank_before_any_pop(self):
        cache = self._pipelined()
        cache.cache_controller.ack_write_queue += [_ack()]
        self._step(cache)
        self.group.peer = [1, 0, 0, 0]  # [digest, -digest] of the blocking path
        with self.assertRaisesRegex(RuntimeError, "ran the blocking all_reduce"):
            self._step(cache)
        self.assertEqual(cache.popped, [])

    def test_a_peer_at_another_depth_stops_every_rank_before_any_pop(self):
        cache = self._pipelined()
        cache.cache_controller.ack_write_queue += [_ack()]
        self._step(cache)
        x = self.group.reduced[-1][-2]
        self.group.peer = [1, 0, x, -2 * x]  # a peer at depth 2
        with self.assertRaisesRegex(RuntimeError, "ASYNC_ACK_DEPTH differs"):
            self._step(cache)
        self.assertEqual(cache.popped, [])

    def test_a_peer_with_an_out_of_tree_stamp_stops_every_rank_before_any_pop(self):
        cache = self._pipelined()
        cache.cache_controller.ack_write_queue += [_ack()]
        self._step(cache)
        x = self.group.reduced[-1][-2]
        self.group.peer = [1, 0, x, -(1 << 58)]  # a stamp SGLang never sends
        with self.assertRaisesRegex(RuntimeError, "SGLANG_PLUGINS"):
            self._step(cache)
        self.assertEqual(cache.popped, [])


class TestBlockingPathUnchanged(CustomTestCase):
    def test_a_cache_built_without_init_reduces_and_pops_in_the_same_step(self):
        # No ack_sync set: the class default keeps such caches blocking.
        cache = _make_cache()
        self.assertNotIn("ack_sync", vars(cache))
        ack = _ack()
        cache.cache_controller.ack_write_queue.append(ack)

        def reduce_to_min(counts, _):
            counts.copy_(torch.tensor([1, 0, 0, 0], dtype=torch.int64))

        cache._all_reduce.side_effect = reduce_to_min
        self.assertIsNone(cache.ack_sync)
        cache.check_hicache_events()
        cache._all_reduce.assert_called_once()
        self.assertEqual(cache.popped, [ack])


if __name__ == "__main__":
    unittest.main()
