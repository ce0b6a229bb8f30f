"""The PD bench's two measurement devices without a server: the latency file that
switches the injected latency inside one decode server, and the per-pass timing of
``check_offload_progress`` (pd_standins.PassTimes), on stand-in modules."""

from __future__ import annotations

import time
import types

import pytest

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack_lab.cpu_server import bound, pd_standins
from hicache_async_ack_lab.cpu_server.settings import (
    CPU_REDUCE_LATENCY_FILE_VAR,
    CPU_REDUCE_LATENCY_VAR,
    reduce_latency,
    write_latency_file,
)
from hicache_async_ack_lab.sim.collectives import EchoHandle, delayed


def test_no_latency_asked_for_injects_none_and_the_fixed_one_stays():
    assert reduce_latency({}) is None
    assert reduce_latency({CPU_REDUCE_LATENCY_VAR: "0"}) is None
    fixed = reduce_latency({CPU_REDUCE_LATENCY_VAR: "3.2"})
    assert fixed is not None and fixed() == pytest.approx(0.0032)


def test_the_latency_file_is_read_again_each_time_it_is_replaced(tmp_path):
    path = tmp_path / "latency_ms"
    write_latency_file(path, 3.2)
    # the file wins over the fixed value
    latency = reduce_latency({CPU_REDUCE_LATENCY_FILE_VAR: str(path), CPU_REDUCE_LATENCY_VAR: "9"})
    assert latency is not None
    seen = [latency()]
    for ms in (0, 3.2, 25):
        write_latency_file(path, ms)
        seen.append(latency())
    assert seen == pytest.approx([0.0032, 0.0, 0.0032, 0.025])


@pytest.mark.parametrize("content", ["fast", "-1"])
def test_a_bad_or_missing_latency_file_fails_at_start_naming_the_accepted_form(tmp_path, content):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"{CPU_REDUCE_LATENCY_FILE_VAR}.*milliseconds >= 0"):
        reduce_latency({CPU_REDUCE_LATENCY_FILE_VAR: str(missing)})
    bad = tmp_path / "bad"
    bad.write_text(content)
    with pytest.raises(ValueError, match="milliseconds >= 0"):
        reduce_latency({CPU_REDUCE_LATENCY_FILE_VAR: str(bad)})
    with pytest.raises(ValueError, match="milliseconds >= 0"):
        write_latency_file(bad, -1.0)


def test_the_bound_refuses_a_latency_file_even_one_saying_zero(tmp_path):
    path = tmp_path / "latency_ms"
    write_latency_file(path, 0)
    env = {bound.CPU_BOUND_VAR: "1", ENABLE_VAR: "0", CPU_REDUCE_LATENCY_FILE_VAR: str(path)}
    with pytest.raises(ValueError, match=CPU_REDUCE_LATENCY_FILE_VAR):
        bound.check(env)


class Manager:
    """A DecodeKVCacheOffloadManager: its check and the two pop methods."""

    def __init__(self, clock=None):
        self.clock, self.checks = clock, 0

    def check_offload_progress(self):
        self.checks += 1

    def _check_offload_progress(self, n):
        pass

    def _check_backup_progress(self, n):
        pass


def test_stocks_blocking_check_sleeps_what_the_file_says_at_each_call(tmp_path, monkeypatch):
    path = tmp_path / "latency_ms"
    write_latency_file(path, 3.2)
    monkeypatch.setenv(CPU_REDUCE_LATENCY_FILE_VAR, str(path))
    monkeypatch.delenv(pd_standins.OFFLOAD_COUNT_DIR_VAR, raising=False)
    module = types.SimpleNamespace(DecodeKVCacheOffloadManager=type("M", (Manager,), {}))
    pd_standins._patch_offload_manager(module)
    slept: list[float] = []
    monkeypatch.setattr(pd_standins.time, "sleep", slept.append)
    manager = module.DecodeKVCacheOffloadManager()
    manager.check_offload_progress()
    write_latency_file(path, 0)
    manager.check_offload_progress()
    write_latency_file(path, 3.2)
    manager.check_offload_progress()
    assert manager.checks == 3
    assert slept == pytest.approx([0.0032, 0.0032])  # none at 0 ms


def test_the_plugins_reduce_completes_what_the_file_said_at_issue(tmp_path):
    path = tmp_path / "latency_ms"
    write_latency_file(path, 25)
    latency = reduce_latency({CPU_REDUCE_LATENCY_FILE_VAR: str(path)})
    assert latency is not None
    issue = delayed(EchoHandle, latency)
    t0 = time.perf_counter()
    slow = issue([1, 2])
    write_latency_file(path, 0)
    fast = issue([3, 4])
    assert slow.ready_at >= t0 + 0.025
    assert fast.ready_at <= time.perf_counter()  # due at once
    assert fast.wait() == [3, 4] and slow.wait() == [1, 2]


class Batch:
    def __init__(self, reqs: int):
        self.reqs = reqs

    def is_empty(self) -> bool:
        return self.reqs == 0


def decode_module():
    """sglang.srt.disaggregation.decode's mixin: a pass calls the manager's check."""

    class Mixin:
        def process_decode_queue(self):
            self.decode_offload_manager.check_offload_progress()

    return types.SimpleNamespace(SchedulerDisaggregationDecodeMixin=Mixin)


def test_each_check_is_timed_by_the_latency_then_and_the_passs_kind(tmp_path, monkeypatch):
    path = tmp_path / "latency_ms"
    write_latency_file(path, 3.2)
    monkeypatch.setenv(CPU_REDUCE_LATENCY_FILE_VAR, str(path))
    monkeypatch.setenv(pd_standins.PASS_TIMES_DIR_VAR, str(tmp_path / "passes"))
    monkeypatch.delenv(pd_standins.OFFLOAD_COUNT_DIR_VAR, raising=False)
    monkeypatch.setattr(pd_standins.PassTimes, "WRITE_EVERY_S", 0.0)
    monkeypatch.setattr(pd_standins, "dist_rank", lambda: 1)
    monkeypatch.setattr(pd_standins, "PASS_TIMES", {})
    now = [0.0]

    class Clocked(Manager):
        """A check that syncs for ``cost`` and pops for ``pop`` (the test's clock)."""

        def check_offload_progress(self):
            now[0] += self.cost
            self._check_offload_progress(1)

        def _check_offload_progress(self, n):
            now[0] += self.pop

    managers = types.SimpleNamespace(DecodeKVCacheOffloadManager=Clocked)
    pd_standins._patch_offload_manager(managers)  # the pops, timed at the class
    module = decode_module()
    pd_standins._time_offload_checks(module)  # the check, timed per instance
    times = pd_standins.PASS_TIMES["times"]
    times.clock = lambda: now[0]
    manager = Clocked()
    sched = module.SchedulerDisaggregationDecodeMixin()
    sched.decode_offload_manager = manager
    passes = ((3, 0.010, 0.001, 3.2), (0, 0.002, 0.0, 3.2), (2, 0.001, 0.002, 0),
              (2, 0.003, 0.0, 0))  # fmt: skip
    for reqs, cost, pop, ms in passes:
        write_latency_file(path, ms)
        sched.running_batch = Batch(reqs)
        manager.cost, manager.pop = cost, pop
        sched.process_decode_queue()
    got = pd_standins.read_pass_times(tmp_path / "passes")
    assert set(got) == {"1"}
    # [passes, seconds, longest, of which popping]
    assert got["1"]["3.2"]["running"] == pytest.approx([1, 0.011, 0.011, 0.001])
    assert got["1"]["3.2"]["idle"] == pytest.approx([1, 0.002, 0.002, 0.0])
    assert got["1"]["0"]["running"] == pytest.approx([2, 0.006, 0.003, 0.002])
    assert got["1"]["0"]["idle"] == [0, 0.0, 0.0, 0.0]


def test_pass_times_need_no_latency_and_leave_a_module_without_the_dir_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(pd_standins.PASS_TIMES_DIR_VAR, raising=False)
    monkeypatch.setattr(pd_standins, "PASS_TIMES", {})
    module = decode_module()
    real = module.SchedulerDisaggregationDecodeMixin.process_decode_queue
    pd_standins._time_offload_checks(module)
    assert module.SchedulerDisaggregationDecodeMixin.process_decode_queue is real
    assert pd_standins.pass_times() is None
    times = pd_standins.PassTimes(tmp_path, None, lambda: 0)
    times.add(0.5)
    times.write()
    cells = {"running": [0, 0.0, 0.0, 0.0], "idle": [1, 0.5, 0.5, 0.0]}
    assert pd_standins.read_pass_times(tmp_path) == {"0": {"0": cells}}
