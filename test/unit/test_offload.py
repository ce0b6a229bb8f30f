"""PD decode offload progress on the real DecodeKVCacheOffloadManager (one process):
SGLang's own check_offload_progress / pop methods, the reduce through a MinHub."""

from __future__ import annotations

import pytest
import torch.distributed

from hicache_async_ack.env import OFFLOAD_SYNC_VAR
from hicache_async_ack.errors import OffloadSyncMismatch
from hicache_async_ack.guard import Judged, check_installed
from hicache_async_ack.protocol import OFFLOAD_CODE
from hicache_async_ack.sglang_plugin import OFFLOAD_FEATURE, environment, state_of
from hicache_async_ack_lab.sim.collectives import FakeGroup
from hicache_async_ack_lab.sim.offload import build_manager


@pytest.fixture
def this_release(plugin, install):
    """The release the installed SGLang matches, as register() saw it (tests of the
    version guard call register() with other verdicts in the same process)."""
    install(judged=Judged(check_installed()))


@pytest.fixture
def agreement(hub, install):
    """The one-time agreement as a world of one, plus an optional peer row."""
    box = {"peer": None, "calls": 0}

    def reduce(group, values):
        box["calls"] += 1
        rows = [values] + ([box["peer"]] if box["peer"] is not None else [])
        return [min(col) for col in zip(*rows)]

    from dataclasses import replace

    install(collectives=replace(environment().collectives, int32_min=reduce))
    return box


@pytest.fixture
def make(plugin, hub, agreement, monkeypatch, this_release):
    def build(env=None, world=2):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        return build_manager(FakeGroup(world) if world > 1 else None, world)

    # upstream's own blocking reduce (stand-down paths) as a world of one
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    return build


def test_pops_one_step_late_by_identity(make, hub, agreement):
    om = make()
    m = om.manager
    a = [om.add_offload() for _ in range(2)]
    b = om.add_backup()
    m.check_offload_progress()  # agreement, then the first reduce: no pops
    assert agreement["calls"] == 1 and om.take_pops() == []
    assert hub.issued[-1][:2] == [2, 1]
    c = om.add_offload()
    m.check_offload_progress()
    assert om.take_pops() == [("offload", a[0]), ("offload", a[1]), ("ack_backup_queue", b)]
    assert hub.issued[-1][:2] == [1, 0]  # counted after the pops
    m.check_offload_progress()
    assert om.take_pops() == [("offload", c)]
    assert agreement["calls"] == 1 and not m.ongoing_offload and not m.ongoing_backup


def test_a_peer_with_fewer_entries_holds_the_rest_back(make, hub):
    om = make()
    a = [om.add_offload() for _ in range(3)]
    hub.peer = lambda v: [1, 0, *v[2:]]
    om.manager.check_offload_progress()
    om.manager.check_offload_progress()
    assert om.take_pops() == [("offload", a[0])]
    assert len(om.cc.ack_write_queue) == 2


def test_drain_before_retraction_pops_everything_now(make, hub):
    om = make()
    m = om.manager
    a = [om.add_offload() for _ in range(2)]
    m.check_offload_progress()  # reduce over a in flight
    late = om.add_offload()
    m.drain_before_retraction()  # must not refuse: nothing may be left behind
    assert om.take_pops() == [("offload", u) for u in (*a, late)]
    assert not m.ongoing_offload and not m.offload_inflight
    m.check_offload_progress()  # back to the pipelined path, nothing to pop
    assert om.take_pops() == []


def test_a_stock_peer_is_named_at_the_first_step(make, agreement):
    agreement["peer"] = [3, 0]  # a stock rank's two queue sizes
    om = make()
    om.add_offload()
    with pytest.raises(OffloadSyncMismatch, match="a peer does not"):
        om.manager.check_offload_progress()
    assert om.take_pops() == []


def test_a_peer_with_the_setting_off_is_named(make, agreement):
    off = OFFLOAD_CODE
    agreement["peer"] = [off, -off]
    om = make()
    with pytest.raises(OffloadSyncMismatch, match=f"{OFFLOAD_SYNC_VAR} differs"):
        om.manager.check_offload_progress()


def test_setting_off_keeps_upstreams_reduce(make, hub, agreement):
    om = make(env={OFFLOAD_SYNC_VAR: "0"})
    a = om.add_offload()
    om.manager.check_offload_progress()
    assert om.take_pops() == [("offload", a)]  # upstream pops in the same step
    assert hub.issued == [] and agreement["calls"] == 1


def test_stands_down_at_world_size_one(make):
    om = make(world=1)
    om.manager.check_offload_progress()
    assert "world size 1" in state_of(OFFLOAD_FEATURE, om.manager).static.reason


def test_stands_down_on_an_unverified_release(make, install):
    install(judged=Judged(None))  # no release matched
    om = make()
    om.manager.check_offload_progress()
    assert state_of(OFFLOAD_FEATURE, om.manager).static.code == "untested_release"


def test_the_live_methods_are_the_verified_ones_under_our_hooks(plugin):
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager as M,
    )

    assert plugin.is_hooked(M.check_offload_progress)  # the fingerprint reads through it
    from hicache_async_ack.guard import check_installed

    verdict = check_installed()  # the manager's methods are guard targets, read through hooks
    assert verdict.feature_release("decode_offload") == verdict.feature_release("ack_counts")


def test_metrics_count_what_the_sync_does():
    from prometheus_client import REGISTRY

    from hicache_async_ack.metrics import OffloadSyncMetrics, PrefetchVoteMetrics

    m = OffloadSyncMetrics({"tp_rank": "7"})
    m.on_path(True)
    m.on_step(0.001, 0.0, {"ack_write_queue": 3, "ack_backup_queue": 0})
    get = REGISTRY.get_sample_value
    assert get("sglang:hicache_decode_offload_sync_pipelined", {"tp_rank": "7"}) == 1
    popped = "sglang:hicache_decode_offload_sync_popped_entries_total"
    assert get(popped, {"tp_rank": "7", "queue": "offload"}) == 3
    assert get(popped, {"tp_rank": "7", "queue": "backup"}) is None
    v = PrefetchVoteMetrics({"cache_type": "T", "tp_rank": "7"})
    v.on_pass(0.0, 0.0, 5)
    v.on_stop()
    labels = {"cache_type": "T", "tp_rank": "7"}
    assert get("sglang:hicache_prefetch_votes_operations_total", labels) == 5
    assert get("sglang:hicache_prefetch_votes_stopped_total", labels) == 1
