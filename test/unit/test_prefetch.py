"""Prefetch termination votes on the real UnifiedRadixCache (one process).

SGLang's own check_prefetch_progress / _can_terminate_prefetch / deadline timer
run on upstream's PrefetchOperation. The votes ride one of two carriers, both
faked here with a programmable peer standing for the other ranks:

* ``ack``: the ack sync pipelines; the section rides its async reduce (a
  one-rank MinHub);
* ``upstream``: the ack sync on SGLang's blocking path (here: turned off); the
  section rides upstream's own blocking ready-count reduce (``_all_reduce``,
  faked), after the votes' own first exchange.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hicache_async_ack import protocol as votes
from hicache_async_ack.env import ENABLE_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack.errors import HiCacheAckSyncMismatch, PrefetchVoteMismatch
from hicache_async_ack.guard import Judged, check_installed
from hicache_async_ack.names import BY_NAME, CACHE_SYNCS, LOGGER_NAME, PREFETCH_VOTES
from hicache_async_ack.protocol import (
    ADMIT,
    HEADER,
    LAYOUT,
    OVERFLOW_LAYOUT,
    SLOT,
    VOTES_FLAG,
    VOTES_SETTING_FLAG,
)
from hicache_async_ack.sglang_plugin import ACK_FEATURE, VOTES_FEATURE, init_cache, state_of
from hicache_async_ack_lab.plugin_env import EventLog
from hicache_async_ack_lab.sim.prefetch import add_prefetch

UPSTREAM = {ENABLE_VAR: "0"}  # the ack sync stands down (its hooks stay): upstream carries
COUNTS = 6  # upstream's ready counts with storage: 2 ack queues + 4 storage queues
ACK_SECTION = COUNTS + 2 + 2  # where the section starts in the ack sync's reduce
STAMP_MIN = 1 << 58  # a stamp, never upstream's bare digest


@pytest.fixture
def this_release(plugin, install):
    """The release the installed SGLang matches, as register() saw it (tests of the
    version guard call register() with other verdicts in the same process)."""
    install(judged=Judged(check_installed()))


@pytest.fixture
def make_prefetch(make_cache, hub, this_release, install):
    """A cache with storage and the prefetch path. ``carrier="upstream"``: the
    fake ``_all_reduce`` records upstream's per-request reduces (``ps.blocking``),
    the votes' first exchange (``ps.greets``), the ready-count reduces the
    section rides (``ps.rides``) and the overflow exchanges (``ps.overflows``),
    each MIN-ed with ``ps.peer`` if set; ``ps.log`` holds the votes' events;
    ``metrics``: the votes' metrics sink."""

    def make(carrier="upstream", policy="timeout", deadline=None, timeout_s=3600.0, env=None,
             metrics=None):  # fmt: skip
        env = {**(UPSTREAM if carrier == "upstream" else {}), **(env or {})}
        sim = make_cache(tp=2, storage=True, env=env)
        ps = add_prefetch(sim, policy=policy, timeout_s=timeout_s, deadline=deadline)
        ps.blocking, ps.greets, ps.rides, ps.overflows = [], [], [], []
        ps.peer = None

        def all_reduce(t, op):
            if t.numel() == 1:  # the per-request vote (a 0-d tensor)
                ps.blocking.append(t.item())
                return
            values = t.tolist()
            if len(values) == COUNTS + 2 and values[-2] >= STAMP_MIN:
                ps.greets.append(values)  # a first exchange (the ack sync's or the votes')
            elif len(values) == COUNTS + 2 + LAYOUT:
                ps.rides.append(values)  # upstream's ready counts with the section
            elif len(values) == OVERFLOW_LAYOUT:
                ps.overflows.append(values)
            if ps.peer is not None:
                peer = ps.peer(values)
                t.copy_(torch.tensor([min(a, b) for a, b in zip(values, peer)]))

        sim.cache.__dict__["_all_reduce"] = all_reduce
        ps.log = EventLog()
        install(events=ps.log, metrics=lambda key, labels, collector: (
            metrics if key == PREFETCH_VOTES else None))  # fmt: skip
        init_cache(sim.cache, SimpleNamespace(enable_metrics=metrics is not None))
        ps.state = state_of(VOTES_FEATURE, sim.cache)
        return ps

    return make


def run_pass(ps, handles=None):
    """One scheduling pass: check_hicache_events, then the walk over the waiting
    requests (those waiting when the pass began: one the boundary ended reads True)."""
    handles = list(ps.cache.ongoing_prefetch) if handles is None else handles
    ps.cache.check_hicache_events()
    return {(h.rid, h.attempt_id): ps.check(h) for h in handles}


def expire_slot(start, index):
    """A peer whose deadline passed for the operation in vote slot ``index`` (and
    reached it), for reduces that carry a section at ``start``."""

    def peer(values):
        out = list(values)
        if len(values) >= start + LAYOUT:
            out[start + HEADER + ADMIT + SLOT * index] = votes.REACHED_EXPIRED
        return out

    return peer


def test_upstream_carrier_one_reduce_per_pass_replaces_the_per_request_reduces(make_prefetch):
    ps = make_prefetch()
    hs = [ps.add(r) for r in ("b", "a", "c")]
    # pass 1: the votes' first exchange, then the section rides upstream's reduce
    assert run_pass(ps) == {(h.rid, 0): False for h in hs}
    assert ps.blocking == []  # no collective per request
    (greet,) = ps.greets  # upstream's shape: 2 ack + 4 storage counts, then [x, -x]
    assert greet[:2] == [1, -1] and greet[2:6] == [0] * 4
    (ride,) = ps.rides
    assert ride[COUNTS + 2 : COUNTS + 4] == [3, -3]  # the section: 3 operations
    ps.peer = expire_slot(COUNTS + 2, 0)  # slot order is walk order: b, a, c -> "b"
    out = run_pass(ps)  # pass 2: the walk of pass 1 (every request reached) is voted on
    assert out == {("b", 0): True, ("a", 0): False, ("c", 0): False}
    assert ps.ended == [(("b", 0), "deadline")]
    assert ps.blocking == [] and ps.log.counts.get("stop") == 1
    assert len(ps.rides) == 2 and len(ps.greets) == 1  # one reduce per pass, nothing else


def test_ack_carrier_rides_the_ack_reduce_with_no_exchange_of_its_own(make_prefetch, hub):
    ps = make_prefetch(carrier="ack")
    ps.add("a")
    run_pass(ps)
    (greet,) = ps.greets  # the ack sync's first exchange, carrying the votes' flags
    flags = 1 << VOTES_FLAG | 1 << VOTES_SETTING_FLAG | 1
    assert greet[:2] == [flags, -flags]
    (fused,) = hub.issued  # one async reduce: ack counts, stamp, flags, the section
    assert len(fused) == ACK_SECTION + LAYOUT and fused[COUNTS + 2 : COUNTS + 4] == [flags, -flags]
    hub.peer = expire_slot(ACK_SECTION, 0)
    assert run_pass(ps) == {("a", 0): False}  # the walk of pass 1 rides the reduce of pass 2
    assert run_pass(ps) == {("a", 0): True}  # ... consumed at pass 3
    assert ps.ended == [(("a", 0), "deadline")]
    assert ps.blocking == [] and len(hub.issued) == 3 and len(ps.greets) == 1


def test_a_deadline_ends_only_where_every_rank_reached_it(make_prefetch, hub):
    ps = make_prefetch(carrier="ack")
    ps.add("a")
    hub.peer = expire_slot(ACK_SECTION, 0)
    for _ in range(4):
        assert run_pass(ps, handles=[]) == {}  # the walk never reaches "a" here
    assert ps.ended == [] and ps.log.counts.get("stop", 0) == 0


def test_verdict_on_the_real_timer_one_pass_after_the_walk(make_prefetch):
    ps = make_prefetch(timeout_s=0.0)
    h = ps.add("r")
    assert run_pass(ps) == {("r", 0): False}  # first reach: upstream starts the timer
    assert run_pass(ps) == {("r", 0): False}  # reached expired; its section rides next
    assert run_pass(ps) == {("r", 0): True}  # the group's verdict, at this boundary
    assert ps.ended == [(("r", 0), "deadline")]
    assert ps.cache._storage_prefetch_wait[h].expired  # upstream's agreed-verdict mark


def test_verdicts_follow_operations_by_identity(make_prefetch):
    ps = make_prefetch()
    for _ in range(2):
        run_pass(ps)
    h = ps.add("x")
    run_pass(ps)  # "x" reached in this walk
    ps.peer = expire_slot(COUNTS + 2, 0)
    ps.revoke(h)  # aborted in between; a new attempt takes the same request id
    ps.add("x")
    out = run_pass(ps, handles=[])
    assert out == {} and ps.ended == [(("x", 0), "dropped")]  # the verdict was the revoked one's


def test_reset_and_detach_between_walk_and_verdict(make_prefetch):
    ps = make_prefetch()
    for _ in range(2):
        run_pass(ps)
    ps.add("a"), ps.add("b")
    run_pass(ps)
    ps.peer = expire_slot(COUNTS + 2, 0)
    ps.reset()
    assert run_pass(ps) == {}  # nothing left to ask about; no error, no stop
    ps.add("c")
    run_pass(ps)
    ps.detach()  # storage detached mid-prefetch: no section rides, nothing stops
    rides = len(ps.rides)
    assert run_pass(ps) == {}
    assert not ps.state.active and len(ps.rides) == rides
    assert [k for k, _ in ps.ended] == [("a", 0), ("b", 0), ("c", 0)]
    assert all(reason == "dropped" for _, reason in ps.ended)


def test_ranks_that_disagree_on_the_set_stop_before_any_verdict(make_prefetch):
    ps = make_prefetch()
    ps.add("a")
    run_pass(ps)
    at = COUNTS + 2
    ps.peer = lambda v: v[:at] + [2, -2] + v[at + 2 :] if len(v) == at + LAYOUT else v
    with pytest.raises(PrefetchVoteMismatch, match="number of ongoing storage prefetch"):
        run_pass(ps)
    assert ps.ended == []


def test_a_peer_whose_walk_reached_another_request_is_a_mismatch(make_prefetch):
    ps = make_prefetch()
    ps.add("a")
    run_pass(ps)
    other = votes.key_hash(("z", 0))
    at = COUNTS + 2 + HEADER + ADMIT + 1  # slot 0's [h, -h]

    def peer(v):
        if len(v) != COUNTS + 2 + LAYOUT:
            return v
        return v[:at] + [min(v[at], other), min(v[at + 1], -other)] + v[at + 2 :]

    ps.peer = peer
    with pytest.raises(PrefetchVoteMismatch, match="reached different requests at position 1"):
        run_pass(ps)
    assert ps.ended == []


def test_a_peer_with_the_votes_off_stops_at_the_agreement(make_prefetch):
    ps = make_prefetch()
    ps.peer = lambda v: [0, 0, *v[2:]] if v in ps.greets else v
    with pytest.raises(PrefetchVoteMismatch, match=f"{PREFETCH_VOTES_VAR} differs"):
        run_pass(ps)
    assert len(ps.greets) == 1 and ps.rides == []  # the first exchange only


def test_a_peer_with_the_votes_off_stops_the_ack_carriers_first_exchange(make_prefetch):
    ps = make_prefetch(carrier="ack")
    ps.peer = lambda v: [1, -1, *v[2:]] if v in ps.greets else v  # storage only, votes off
    with pytest.raises(HiCacheAckSyncMismatch, match=PREFETCH_VOTES_VAR) as err:
        run_pass(ps)
    assert "this rank 1" in str(err.value)


def test_a_stock_peer_is_named_at_the_votes_first_exchange(make_prefetch):
    ps = make_prefetch()
    ps.peer = lambda v: [0] * (len(v) - 2) + [12345, -12345] if v in ps.greets else v
    with pytest.raises(PrefetchVoteMismatch, match="this node pipelines, a peer does not"):
        run_pass(ps)
    assert ps.rides == []


def test_votes_off_keeps_upstreams_reduce_after_agreeing(make_prefetch):
    ps = make_prefetch(env={PREFETCH_VOTES_VAR: "0"})
    ps.add("a")
    for _ in range(3):
        run_pass(ps)
    assert len(ps.blocking) == 3 and ps.rides == []
    assert len(ps.greets) == 1 and ps.greets[0][:2] == [0, 0]


@pytest.mark.parametrize("policy, result", [("best_effort", True), ("wait_complete", False)])
def test_other_policies_stay_upstreams(make_prefetch, policy, result):
    ps = make_prefetch(policy=policy)
    ps.add("a")
    outs = [run_pass(ps) for _ in range(3)]
    assert outs[0] == {("a", 0): result}
    assert ps.rides == [] and ps.blocking == []
    assert "runs no collective" in ps.state.decide(ps.cache).reason


def test_a_policy_the_votes_do_not_know_stays_upstreams_and_says_so(make_prefetch, caplog):
    """A stop policy outside SGLang's three (a newer SGLang's): the votes keep
    upstream's path with the reason code "policy", said once; nothing rides."""
    ps = make_prefetch(policy="eager")
    with caplog.at_level("INFO", logger=LOGGER_NAME):
        ps.cache.check_hicache_events()
        ps.cache.check_hicache_events()
    decision = ps.state.decide(ps.cache)
    assert not decision.pipelined and decision.code == "policy"
    said = [r.getMessage() for r in caplog.records if "'eager' is not one" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(PREFETCH_VOTES.title), said
    assert ps.rides == [] and ps.blocking == []


def test_pp_and_untested_releases_stand_down(make_prefetch, install):
    ps = make_prefetch()
    ps.cache.__dict__["pp_size"] = 2
    assert "pp_size=2" in ps.state.decide(ps.cache).reason
    install(judged=Judged(None))  # no release matched: register() hooks nothing
    for sync in CACHE_SYNCS:
        ps.cache.__dict__.pop(BY_NAME[sync].state_attr, None)
    init_cache(ps.cache)  # as register() would: no state for a sync it does not hook
    features = (ACK_FEATURE, VOTES_FEATURE)
    assert all(state_of(f, ps.cache) is None for f in features)
    # A hook that still runs (hooked before the verdict changed) builds a standing-down state.
    ps.cache.check_hicache_events()
    state = state_of(VOTES_FEATURE, ps.cache)
    assert state is not None
    assert not state.static.pipelined and state.static.code == "untested_release"


def test_reaches_past_the_slots_are_decided_in_an_overflow_exchange_where_they_land(
    make_prefetch, caplog
):
    """Past the section's slots the walk runs no collective either (47's
    findings 5 and 9); where the section is read back, one overflow exchange per
    VOTE_SLOTS reaches decides them (said once in the log), and a deadline past
    the slots ends where stock would end it, in walk order."""
    ps = make_prefetch()
    n = votes.VOTE_SLOTS + 5
    hs = [ps.add(f"r{i:04d}") for i in range(n)]
    with caplog.at_level("WARNING", logger=LOGGER_NAME):
        run_pass(ps)  # the first exchange; this walk is the first one voted on
        assert ps.blocking == [] and ps.overflows == []
        late = hs[-1]
        at = 4 + SLOT * 4  # the late request's slot in the first overflow exchange

        def peer(values):  # the last request's deadline passed on the peer
            if len(values) != OVERFLOW_LAYOUT:
                return values
            return values[:at] + [votes.REACHED_EXPIRED] + values[at + 1 :]

        ps.peer = peer
        out = run_pass(ps)  # the walk of pass 1 lands here: one overflow exchange
    assert out[(late.rid, 0)] is True and len(ps.overflows) == 1
    assert ps.blocking == [] and ps.ended == [((late.rid, 0), "deadline")]
    said = [r.getMessage() for r in caplog.records if "past the section's" in r.getMessage()]
    assert len(said) == 1 and "fallback_reaches_total" in said[0], said


def test_attention_cp_x_tp_rides_where_one_tp_group_spans_both(make_cache, plugin, this_release):
    from hicache_async_ack_lab.sim.collectives import FakeGroup

    def votes_of(cp: int, atp: int, tp: int):
        sim = make_cache(
            tp=tp, storage=True, attn_cp_group=FakeGroup(cp, "cp"), attn_tp_group=FakeGroup(atp)
        )
        add_prefetch(sim)
        init_cache(sim.cache)
        return state_of(VOTES_FEATURE, sim.cache).static

    spans = votes_of(2, 2, 4)
    assert spans.pipelined and spans.span is not None  # the TP group, checked at the first step
    dp_attention = votes_of(2, 2, 8)
    assert not dp_attention.pipelined and dp_attention.code == "no_span"


class Sink:
    """A metrics sink recording what the votes report."""

    def __init__(self):
        self.passes: list = []

    def on_path(self, pipelined):
        pass

    def on_pass(self, wait_s, issue_s, voted, overflow=0):
        self.passes.append((wait_s, voted))
        self.fallbacks += overflow

    def on_stop(self, n=1):
        pass

    fallbacks = 0

    def on_failure(self, reason):
        pass


def test_metrics_count_the_voted_operations(make_prefetch):
    """operations_total counts the reaches a walk made, fallback_total those
    past the section's slots; the wait is the carrier's (the votes add no
    collective to wait on)."""
    ps = make_prefetch(metrics=(sink := Sink()))
    for i in range(votes.VOTE_SLOTS + 44):
        ps.add(f"r{i:04d}")
    for _ in range(4):
        run_pass(ps)
    assert len(sink.passes) == 4
    # the first pass closes the walk before the votes ran (none carried)
    assert [voted for _, voted in sink.passes] == [0] + [votes.VOTE_SLOTS + 44] * 3
    assert sink.passes and all(wait is None for wait, _ in sink.passes)
    assert sink.fallbacks == 44 * 3
