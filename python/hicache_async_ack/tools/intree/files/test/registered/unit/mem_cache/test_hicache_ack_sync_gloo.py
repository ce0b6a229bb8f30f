"""The pipelined HiCache ready-count all_reduce on two gloo ranks (CPU)."""

import multiprocessing as mp
import os
import socket
import traceback
import unittest
from datetime import timedelta
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import torch
import torch.distributed as dist

from sglang.srt.mem_cache import hicache_ack_sync
from sglang.srt.mem_cache.hicache_ack_sync import HiCacheAckSync
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

STEPS = 24
TIMEOUT_S = 60


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
        disagg = SimpleNamespace(disaggregation_mode="null")
        with (
            patch.dict(os.environ, env),
            patch.object(hicache_ack_sync, "get_disagg", return_value=disagg),
        ):
            cache = _make_cache(group)
            cache.ack_sync = HiCacheAckSync.create(cache)
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


def _run_rank(rank, world, port, results):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    agree = _play(rank, dist.group.WORLD, {})
    # A fresh group: rank 1 runs the blocking all_reduce.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    off = {"SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC": "false"} if rank == 1 else {}
    switch_off = _play(rank, group, off)
    results.put((rank, {"agree": agree, "switch_off": switch_off}))
    results.close()
    results.join_thread()
    # Skip the interpreter's teardown of the gloo groups (one was left mid-step).
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TestHiCacheAckSyncGloo(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Forked: the ranks reuse this process's imports (CPU only, no CUDA).
        ctx = mp.get_context("fork")
        results = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(target=_run_rank, args=(rank, 2, port, results))
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        try:
            out = dict(results.get(timeout=4 * TIMEOUT_S) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=TIMEOUT_S)
                if p.is_alive():
                    p.kill()
        cls.results = [out[rank] for rank in range(2)]

    def test_ranks_pop_the_same_acks_at_the_same_step_once_all_finished(self):
        runs = [r["agree"] for r in self.results]
        for pipelined, _, error in runs:
            self.assertIsNone(error, error)
            self.assertTrue(pipelined)
        self.assertEqual(runs[0][1], runs[1][1])
        popped = runs[0][1]
        self.assertEqual([uid for _, uid in popped], list(range(STEPS // 2)))
        for step, uid in popped:
            # Finished on both ranks by the step the reduce was issued.
            last_done = max(uid + (uid * (r + 1)) % 3 for r in range(2))
            self.assertGreater(step, last_done)

    def test_a_rank_with_the_switch_off_stops_both_before_any_pop(self):
        (_, popped0, error0), (_, popped1, error1) = [
            r["switch_off"] for r in self.results
        ]
        self.assertIn("ran the blocking all_reduce", error0)
        self.assertIn("duplicate-reclaim victims diverged", error1)
        self.assertEqual(popped0 + popped1, [])


if __name__ == "__main__":
    unittest.main()
