"""The pipelined HiCache ready-count all_reduce on two gloo ranks (CPU)."""

import os
import traceback
import unittest
from datetime import timedelta
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import torch.distributed as dist
import torch.multiprocessing as mp

from sglang.srt.mem_cache.unified_cache.hicache_ack_sync import HiCacheAckSync
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

WORLD_SIZE = 2
STEPS = 24
# Bounds the rendezvous too: a rank may import for a while on a busy CI runner.
TIMEOUT = timedelta(seconds=300)


class _Event:
    def __init__(self, clock, step):
        self.clock, self.step = clock, step

    def query(self):
        return self.clock[0] >= self.step

    def synchronize(self):
        assert self.query(), "popped an ack before it finished"


def _make_cache(group):
    cache = object.__new__(UnifiedRadixCache)
    cache.tree_core = SimpleNamespace(
        enable_storage=False, write_back_duplicate_reclaim_digest=12345
    )
    cache.pp_rank, cache.pp_size, cache.pp_group = 0, 1, None
    cache.host_memory_mode = "cache"
    cache.enable_storage_metrics = False
    cache.storage_metrics_collector = None
    cache.buffer_pipeline = None
    cache.linker = None
    cache.work_list = []
    cache.tp_group = group
    cache.tp_world_size = dist.get_world_size(group)
    cache.attn_cp_group = None
    cache.attn_tp_group = None
    cache.cache_controller = SimpleNamespace(
        ack_write_queue=[], ack_load_queue=[], start_writing=MagicMock()
    )
    cache.clock = [0]
    cache.popped = []

    def check(finish_count):
        for _ in range(finish_count):
            ack = cache.cache_controller.ack_write_queue.pop(0)
            ack.finish_event.synchronize()
            cache.popped.append((cache.clock[0], ack.uid))

    cache.writing_check = check
    cache.loading_check = lambda finish_count: None
    return cache


def _play(rank, group, env):
    """STEPS scheduler steps on one rank: (pipelined, popped, error)."""
    cache = None
    try:
        with patch.dict(os.environ, env):
            cache = _make_cache(group)
            cache.ack_sync = HiCacheAckSync.create(cache, "null")
        queue = cache.cache_controller.ack_write_queue
        for step in range(STEPS):
            cache.clock[0] = step
            if step < STEPS // 2:
                # Ack `step` finishes at a step that differs per rank.
                done = step + (step * (rank + 1)) % 3
                event = _Event(cache.clock, done)
                queue.append(SimpleNamespace(uid=step, finish_event=event))
            cache.check_hicache_events()
        return cache.ack_sync is not None, cache.popped, None
    except Exception:
        return None, [] if cache is None else cache.popped, traceback.format_exc()


def _run_rank(rank, port, output_writer):
    results = None
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, WORLD_SIZE, is_master=False, timeout=TIMEOUT
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT
        )
        agree = _play(rank, dist.group.WORLD, {})
        # A fresh group: rank 1 runs the blocking all_reduce.
        group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        off = {"SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC": "false"} if rank == 1 else {}
        results = {"agree": agree, "switch_off": _play(rank, group, off)}
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
    output_writer.send((rank, results))
    output_writer.close()


class TestHiCacheAckSyncGloo(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        # The store binds a free port itself; the ranks connect to it.
        store = dist.TCPStore(
            "127.0.0.1", 0, WORLD_SIZE + 1, is_master=True, wait_for_workers=False
        )
        ctx = mp.get_context("spawn")
        output_reader, output_writer = ctx.Pipe(duplex=False)
        processes = [
            ctx.Process(target=_run_rank, args=(rank, store.port, output_writer))
            for rank in range(WORLD_SIZE)
        ]
        for p in processes:
            p.start()
        out = {}
        try:
            for _ in processes:
                if not output_reader.poll(2 * TIMEOUT.total_seconds()):
                    break
                rank, results = output_reader.recv()
                out[rank] = results
        finally:
            for p in processes:
                p.join(timeout=TIMEOUT.total_seconds())
                if p.is_alive():
                    p.kill()
        cls.results = [out.get(rank) for rank in range(WORLD_SIZE)]

    def test_every_rank_reported(self):
        self.assertNotIn(None, self.results, "a rank failed, see its log above")

    def test_ranks_pop_the_same_acks_at_the_same_step_once_all_finished(self):
        self.assertNotIn(None, self.results)
        runs = [r["agree"] for r in self.results]
        for pipelined, _, error in runs:
            self.assertIsNone(error, error)
            self.assertTrue(pipelined)
        self.assertEqual(runs[0][1], runs[1][1])
        popped = runs[0][1]
        self.assertEqual([uid for _, uid in popped], list(range(STEPS // 2)))
        for step, uid in popped:
            # Finished on both ranks by the step the reduce was issued.
            last_done = max(uid + (uid * (r + 1)) % 3 for r in range(WORLD_SIZE))
            self.assertGreater(step, last_done)

    def test_a_rank_with_the_switch_off_stops_both_before_any_pop(self):
        self.assertNotIn(None, self.results)
        (_, popped0, error0), (_, popped1, error1) = [
            r["switch_off"] for r in self.results
        ]
        self.assertIn("ran the blocking all_reduce", error0)
        self.assertIn("duplicate-reclaim victims diverged", error1)
        self.assertEqual(popped0 + popped1, [])


if __name__ == "__main__":
    unittest.main()
