"""Unit tests on the real sglang UnifiedRadixCache with a fake MIN collective."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR
from hicache_async_ack.errors import HiCacheAckSyncError
from hicache_async_ack.protocol import (
    LAYOUT,
    PROTOCOL_VERSION,
    STORAGE_FLAG,
    VOTES_FLAG,
    VOTES_SETTING_FLAG,
    Consumed,
    PipelinedReduce,
    Stamp,
)
from hicache_async_ack.sglang_plugin import (
    ACK_FEATURE,
    AckCountsState,
    Collectives,
    init_cache,
    state_of,
)
from hicache_async_ack_lab.sim.collectives import FakeGroup
from hicache_async_ack_lab.testing.drift import runs_here


def with_span(span) -> Collectives:
    """The environment's collectives with another CP x TP span check."""
    from hicache_async_ack.sglang_plugin import environment

    return replace(environment().collectives, span=span)


def DONE():
    return True


def acks(sim, kind, n, done=DONE):
    return [sim.add_ack(kind, done) for _ in range(n)]


def stamp_slot(depth=1, digest=0):
    """The [x, -x] this release sends: its protocol, depth and the digest."""
    x = Stamp(PROTOCOL_VERSION, False, depth, digest).pack()
    return [x, -x]


# The layout flags these caches send ([f, -f] after the stamp): the votes'
# setting (on by default, sent where this SGLang has the votes at all; these
# caches have no prefetch policy, so no section), plus the storage bit where a
# backend is attached.
VOTES_HERE = "prefetch_votes" in runs_here()
VOTES_SETTING = int(VOTES_HERE) << VOTES_SETTING_FLAG
STORAGE = 1 << STORAGE_FLAG
# With a backend attached the ack counts pipeline only where the votes judge the walk
# (SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_VOTES on, a release the votes run on); the
# storage caches here carry SGLang's default policy, so their reduces carry a section.
STORAGE_PIPELINES = pytest.mark.skipif(
    not VOTES_HERE, reason="the prefetch votes do not run on this SGLang: storage is stock's"
)


def flags_slot(flags=VOTES_SETTING):
    return [flags, -flags]


def test_first_step_issues_one_reduce_and_pops_nothing(make_cache, hub):
    sim = make_cache(tp=2)
    acks(sim, "write", 2)
    sim.cache.check_hicache_events()
    assert sim.take_pops() == []
    assert hub.issued == [[2, 0, *stamp_slot(), *flags_slot()]]
    assert hub.handles and all(not h.waited for h in hub.handles)


def test_pops_previous_counts_then_reduces_the_remainder(make_cache, hub):
    sim = make_cache(tp=2)
    w = acks(sim, "write", 3)
    ld = acks(sim, "load", 1)
    sim.cache.check_hicache_events()  # issues [3, 1]
    w += acks(sim, "write", 2)  # finish between the steps
    sim.cache.check_hicache_events()  # pops the agreed 3 + 1, then counts 2
    assert sim.take_pops() == [("write", u) for u in w[:3]] + [("load", ld[0])]
    assert hub.issued[1][:2] == [2, 0]  # only what remained after popping
    sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", u) for u in w[3:]]


def test_waits_before_using_reduced_counts(make_cache, hub):
    sim = make_cache(tp=2)
    w = acks(sim, "write", 3)
    # The peer had only one ack ready; that is known only once wait() returns.
    hub.peer = lambda v: [1, 0] + v[2:]
    order = hub.events
    sim.cache.check_hicache_events()
    real_finish = sim.cache._finish_write_through_ack

    def finish(ack_id):
        order.append(("pop", ack_id))
        real_finish(ack_id)

    sim.cache.__dict__["_finish_write_through_ack"] = finish
    sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", w[0])]
    kinds = [e[0] for e in order]
    assert kinds == ["issue", "wait", "pop", "issue"]
    # The two acks the peer had not agreed on are still queued and counted again.
    assert hub.issued[-1][0] == 2


def test_never_pops_an_unfinished_ack(make_cache, hub):
    sim = make_cache(tp=2)
    state = {"done": False}
    ready = acks(sim, "write", 1)
    late = sim.add_ack("write", lambda: state["done"])
    for _ in range(3):
        sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", ready[0])]
    state["done"] = True
    sim.cache.check_hicache_events()  # counted now, popped next step
    assert sim.take_pops() == []
    sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", late)]
    assert sim.cc.violations == []


def test_digest_mismatch_raises_ranks_diverged(make_cache, hub):
    sim = make_cache(tp=2)
    sim.tree.write_back_duplicate_reclaim_digest = 7
    hub.peer = lambda v: v[:2] + stamp_slot(digest=5) + v[4:]
    sim.cache.check_hicache_events()
    with pytest.raises(HiCacheAckSyncError, match="ranks diverged"):
        sim.cache.check_hicache_events()


def test_failed_wait_surfaces_and_is_not_retried(make_cache, hub):
    sim = make_cache(tp=2)
    acks(sim, "write", 1)
    sim.cache.check_hicache_events()
    hub.fail_on_wait = RuntimeError("Connection closed by peer")
    with pytest.raises(HiCacheAckSyncError, match="HiCache ack sync: failed"):
        sim.cache.check_hicache_events()
    hub.fail_on_wait = None
    issued = len(hub.issued)
    with pytest.raises(HiCacheAckSyncError, match="will not retry"):
        sim.cache.check_hicache_events()
    assert len(hub.issued) == issued  # no new collective after a failure


@STORAGE_PIPELINES
def test_storage_counts_use_upstream_layout_and_drain(make_cache, hub):
    sim = make_cache(tp=2, storage=True, extra_pools=("mamba",))
    e_hit = sim.cc.put_storage("prefetch_hit_queue")
    e_bak = [sim.cc.put_storage("ack_backup_queue") for _ in range(2)]
    e_rel = sim.cc.put_storage("host_mem_release_queue")
    e_ext = sim.cc.put_storage(("extra", "mamba"))
    w = acks(sim, "write", 1)
    sim.cache.check_hicache_events()
    section = 1 << VOTES_FLAG  # the votes' section rides after the flags
    assert hub.issued[0][:11] == [
        1,
        0,
        1,
        0,
        2,
        1,
        1,
        *stamp_slot(),
        *flags_slot(VOTES_SETTING | STORAGE | section),
    ]
    assert len(hub.issued[0]) == 11 + LAYOUT
    # the peer has one backup ack fewer
    sim.cc.put_storage("ack_backup_queue")
    hub.peer = lambda v: [v[0], v[1], v[2], v[3], v[4] - 1] + v[5:]
    sim.cache.check_hicache_events()
    pops = sim.take_pops()
    assert ("write", w[0]) in pops
    assert ("prefetch_hit_queue", e_hit) in pops
    assert [p for p in pops if p[0] == "ack_backup_queue"] == [("ack_backup_queue", e_bak[0])]
    assert ("host_mem_release_queue", e_rel) in pops
    assert (("extra", "mamba"), e_ext) in pops
    assert hub.issued[1][:7] == [0, 0, 0, 0, 2, 0, 0]


@pytest.mark.parametrize("votes", ["0", "1"])
def test_storage_pipelines_only_where_the_votes_judge_the_walk(make_cache, hub, votes):
    """Issue 52 item 3: a walk the votes do not decide runs upstream's per-request reduce
    on the prefetches' progress; popped depth steps late, that progress would be staler
    than stock's. So with a backend attached the ack counts keep SGLang's storage path
    unless the votes ride (their setting on, on a release they run on); detached, they
    pipeline again."""
    from hicache_async_ack.env import PREFETCH_VOTES_VAR

    sim = make_cache(tp=2, storage=True, env={PREFETCH_VOTES_VAR: votes})
    state = state_of(ACK_FEATURE, sim.cache)
    decision = state.decide(sim.cache)
    rides = votes == "1" and VOTES_HERE
    assert decision.pipelined is rides
    if not rides:
        assert decision.code == "storage_without_votes"
        sim.cache.check_hicache_events()
        assert hub.issued == []  # stock's blocking reduce, no pipelined one
    sim.detach_storage()
    assert state.decide(sim.cache).pipelined


def test_tp1_applies_local_counts_at_once(make_cache, hub):
    sim = make_cache(tp=1, tp_group=None, tp_world_size=1)
    w = acks(sim, "write", 2)
    sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", u) for u in w]  # same step, no lag
    assert hub.issued == []


def _fake_blocking_reduce(sim, log):
    """Stand in for upstream's blocking _all_reduce on a fake group."""

    def all_reduce(tensor, op):
        log.append(("blocking", tensor.tolist()))

    sim.cache.__dict__["_all_reduce"] = all_reduce


def test_switch_to_blocking_consumes_pending_first(make_cache, hub):
    sim = make_cache(tp=2)
    log = hub.events
    _fake_blocking_reduce(sim, log)
    w = acks(sim, "write", 2)
    sim.cache.check_hicache_events()
    w += acks(sim, "write", 1)
    sim.cache.host_memory_mode = "buffer_only"  # the cache stops being eligible
    sim.cache.check_hicache_events()
    # the first step's stamped exchange, then the pipelined reduce, drained
    assert [e[0] for e in log] == ["blocking", "issue", "wait", "blocking"]
    # the pending agreement popped 2, the blocking sync counted the 3rd
    assert log[-1][1][:2] == [1, 0]
    assert sim.take_pops() == [("write", u) for u in w]
    assert state_of(ACK_FEATURE, sim.cache).core.pending == 0


def test_opt_out_env_keeps_blocking_path(make_cache, hub):
    sim = make_cache(tp=2, env={ENABLE_VAR: "0"})
    log = []
    _fake_blocking_reduce(sim, log)
    acks(sim, "write", 1)
    sim.cache.check_hicache_events()
    assert hub.issued == []
    assert log and log[0][0] == "blocking"


def test_depth_two_consumes_the_reduce_issued_two_steps_ago(make_cache, hub):
    sim = make_cache(tp=2, env={DEPTH_VAR: "2"})
    w = acks(sim, "write", 1)
    sim.cache.check_hicache_events()
    w += acks(sim, "write", 1)
    sim.cache.check_hicache_events()
    assert sim.take_pops() == []
    assert [h.waited for h in hub.handles] == [False, False]
    sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", w[0])]
    # the second reduce also covered w[0]; it must not be popped twice
    sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", w[1])]


@pytest.mark.parametrize(
    "kwargs, changes, pipelined, reason",
    [
        (dict(tp=4), {}, True, "one TP group"),
        (dict(attn_cp_group=FakeGroup(2, "cp")), {}, True, "one attn CP group"),
        (dict(attn_tp_group=FakeGroup(4, "atp")), {}, True, "one attn TP group"),
        (
            dict(attn_cp_group=FakeGroup(2, "cp"), attn_tp_group=FakeGroup(2, "atp")),
            {},
            False,
            "no existing group spans",
        ),
        (dict(tp=1, tp_group=None, tp_world_size=1), {}, False, "world size 1"),
        (dict(tp=2, pp_size=2), {}, False, "pp_size=2"),
        (dict(tp=2, host_memory_mode="buffer_only"), {}, False, "host memory mode"),
        (dict(tp=2), {"linker": object()}, False, "linker"),
        # an external linker takes the controller's place: the log names the linker
        (dict(tp=2), {"linker": object(), "cache_controller": None}, False, "linker"),
        (dict(tp=2), {"cache_controller": None}, False, "controller not attached"),
    ],
)
def test_eligibility_rules(make_cache, install, kwargs, changes, pipelined, reason):
    # CP x TP: whether a group spans both is decided over real gloo (multirank tests)
    install(collectives=with_span(lambda cache, cp, tp: None))
    sim = make_cache(**kwargs)
    sim.cache.__dict__.update(changes)
    decision = state_of(ACK_FEATURE, sim.cache).decide(sim.cache)
    assert decision.pipelined is pipelined
    assert reason in decision.reason


def test_subclass_overriding_check_hicache_events_stays_blocking(plugin, hub):
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from hicache_async_ack_lab.sim.cache import build_cache

    class Custom(UnifiedRadixCache):
        def check_hicache_events(self):
            return super().check_hicache_events()

    sim = build_cache(tp_group=FakeGroup(2), tp_world_size=2)
    sim.cache.__class__ = Custom
    init_cache(sim.cache)
    decision = state_of(ACK_FEATURE, sim.cache).decide(sim.cache)
    assert not decision.pipelined and "overridden" in decision.reason


def test_announces_once_per_rank(make_cache, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="sglang.srt.mem_cache.hicache_async_ack")
    sim = make_cache(tp=4)
    for _ in range(3):
        sim.cache.check_hicache_events()
    lines = [r.getMessage() for r in caplog.records if "HiCache ack sync" in r.getMessage()]
    assert len(lines) == 1
    assert "pipelined over the one TP group (world size 4, depth 1" in lines[0]


def test_cp_x_tp_pipelines_over_the_spanning_group(make_cache, install):
    spans = []

    def spanning(cache, cp, tp):
        spans.append((cp.name, tp.name))
        return cache.tp_group

    install(collectives=with_span(spanning))
    sim = make_cache(tp=4, attn_cp_group=FakeGroup(2, "cp"), attn_tp_group=FakeGroup(2, "atp"))
    assert spans == []  # nothing gathered at init: a stock peer would not take part
    sim.cache.check_hicache_events()  # the first exchange, then the layout check
    decision = state_of(ACK_FEATURE, sim.cache).decide(sim.cache)
    assert spans == [("cp", "atp")]
    assert decision.pipelined and decision.group is sim.cache.tp_group
    assert decision.reason == "TP group, equal to attn CP(2) x attn TP(2)"


@STORAGE_PIPELINES
def test_first_step_starts_with_a_stamped_exchange_in_upstreams_shape(make_cache, hub):
    """Before any collective the blocking path would not run: upstream's own
    _all_reduce with zero counts and the stamp where upstream sends its digest."""
    sim = make_cache(tp=2, storage=True, extra_pools=("mamba",))
    sim.tree.write_back_duplicate_reclaim_digest = 5
    log = []
    _fake_blocking_reduce(sim, log)
    acks(sim, "write", 2)
    sim.cache.check_hicache_events()
    # the flags ride in the first two count slots (after the stamp check)
    flags = VOTES_SETTING | STORAGE | 1 << VOTES_FLAG
    assert log == [("blocking", flags_slot(flags) + [0] * 5 + stamp_slot(digest=5))]
    assert len(hub.issued) == 1  # then the first pipelined reduce
    sim.cache.check_hicache_events()
    assert len(log) == 1  # once per cache


@pytest.mark.parametrize(
    "peer, why",
    [
        (lambda x: [5, -5], "this node pipelines, a peer does not"),
        (lambda x: stamp_slot(depth=2, digest=5), "the lag depth differs"),
    ],
)
def test_first_exchange_names_a_disagreeing_peer_before_issuing(make_cache, hub, peer, why):
    sim = make_cache(tp=2)
    sim.tree.write_back_duplicate_reclaim_digest = 5

    def all_reduce(tensor, op):  # a MIN with one peer that sent ``peer``'s slot
        mine = tensor.tolist()
        theirs = mine[:-2] + peer(mine[-2])
        tensor.copy_(tensor.new_tensor([min(a, b) for a, b in zip(mine, theirs)]))

    sim.cache.__dict__["_all_reduce"] = all_reduce
    acks(sim, "write", 1)
    with pytest.raises(HiCacheAckSyncError, match=why):
        sim.cache.check_hicache_events()
    assert hub.issued == [] and sim.take_pops() == []


def test_second_sync_in_one_step_raises_before_popping_again(make_cache, hub):
    """An upstream that asked for the ready counts twice per step would pop the
    same agreement twice; the second call raises instead, before any pop."""
    sim = make_cache(tp=2)
    w = acks(sim, "write", 2)
    sim.cache.check_hicache_events()  # issues [2, 0]
    acks(sim, "write", 2)  # ready, but not agreed on by anyone yet

    def asks_twice(cache):
        write, load, storage, extra = cache._sync_hicache_ready_counts()
        cache.writing_check(finish_count=write)
        write, load, storage, extra = cache._sync_hicache_ready_counts()
        cache.writing_check(finish_count=write)

    state = state_of(ACK_FEATURE, sim.cache)
    with pytest.raises(HiCacheAckSyncError, match="called twice in one check_hicache_events"):
        state.step(sim.cache, asks_twice)
    assert sim.take_pops() == [("write", u) for u in w]  # the agreed two, once


def test_once_per_step_resets_every_step(make_cache, hub):
    sim = make_cache(tp=2)
    w = acks(sim, "write", 1)
    for _ in range(3):
        sim.cache.check_hicache_events()
    assert sim.take_pops() == [("write", w[0])]


def test_a_depth_change_while_standing_down_is_logged_and_exported(make_cache, install, caplog):
    """The reduces drained when a cache leaves the pipelined path can move auto
    depth: that change is said and exported like any other."""
    import logging
    from types import SimpleNamespace

    drained = Consumed({"ack_write_queue": 0, "ack_load_queue": 0}, {}, 1, depth_change=(1, 2))

    class DepthMovesOnDrain(PipelinedReduce):
        def drain(self, head):
            super().drain(head)
            return drained

    class Control(AckCountsState):
        core_class = DepthMovesOnDrain

    calls = []

    class Sink:
        def on_path(self, *a):
            calls.append(a)

        def on_step(self, *a):
            pass

    install(substitutes={"ack_counts": Control}, metrics=lambda key, labels, collector: Sink())
    sim = make_cache(env={DEPTH_VAR: "auto"}, params=SimpleNamespace(enable_metrics=True))
    state = state_of(ACK_FEATURE, sim.cache)
    sim.cache.check_hicache_events()
    sim.cache.check_hicache_events()
    assert state.core is not None and state.core.pending
    sim.cache.__dict__["host_memory_mode"] = "buffer_only"  # stand down
    caplog.set_level(logging.INFO, logger="sglang.srt.mem_cache.hicache_async_ack")
    sim.cache.check_hicache_events()
    assert "auto depth 1 -> 2" in caplog.text and "while standing down" in caplog.text
    assert (False, 2) in calls
