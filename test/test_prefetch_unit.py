"""Prefetch termination votes on the real UnifiedRadixCache (one process).

SGLang's own check_prefetch_progress / _can_terminate_prefetch / deadline timer
run on upstream's PrefetchOperation; the vote reduce goes through a MinHub
(a programmable peer stands for the other ranks, or two caches share a hub).
"""

from __future__ import annotations

import pytest
import torch

from hicache_async_ack import adapter, guard, votes
from hicache_async_ack.env import ENABLE_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack.features import prefetch_votes
from hicache_async_ack.votes import HEADER, LAYOUT, PrefetchVoteMismatch
from hicache_async_ack_lab.sim.collectives import MinHub
from hicache_async_ack_lab.sim.prefetch import add_prefetch

NO_ACK_SYNC = {ENABLE_VAR: "0"}  # keep the ack reduce out of these hubs (hooks stay)


@pytest.fixture
def this_release(plugin, monkeypatch):
    """The release the installed SGLang matches, as register() saw it (tests of the
    version guard call register() with other verdicts in the same process)."""
    monkeypatch.setattr(guard, "JUDGED", guard.Judged(guard.check_installed(), False, True))


@pytest.fixture
def vote_hub(monkeypatch):
    return MinHub(world=1)


@pytest.fixture
def make_prefetch(make_cache, plugin, vote_hub, monkeypatch, this_release):
    """A cache with storage and the prefetch path; its votes go to ``vote_hub``
    (rank ``rank`` of it); upstream's blocking reduce is counted."""

    def make(rank=0, hub=None, policy="timeout", deadline=None, timeout_s=3600.0, env=None):
        sim = make_cache(tp=2, storage=True, env={**NO_ACK_SYNC, **(env or {})})
        ps = add_prefetch(sim, policy=policy, timeout_s=timeout_s, deadline=deadline)
        ps.blocking = []  # upstream's per-request reduces (world of one: a no-op)
        ps.greets = []  # the votes' first exchange (upstream's ack-count shape)
        ps.greet_peer = None  # a peer's values for it, MIN-ed in

        def all_reduce(t, op):
            if t.numel() == 1:  # the per-request vote (the ack reduce is longer)
                ps.blocking.append(t.item())
            elif t[-2].item() >= 1 << 58:  # a stamp, not upstream's digest: the greeting
                ps.greets.append(t.tolist())
                if ps.greet_peer is not None:
                    peer = ps.greet_peer(t.tolist())
                    t.copy_(torch.tensor([min(a, b) for a, b in zip(t.tolist(), peer)]))

        sim.cache.__dict__["_all_reduce"] = all_reduce
        h = hub or vote_hub
        monkeypatch.setattr(
            adapter.INSTALLED,
            "current",
            adapter.Collectives(async_min=lambda g: h.collective(rank)),
        )
        ps.state = prefetch_votes.attach(sim.cache)
        return ps

    return make


def run_pass(ps, handles=None):
    """One scheduling pass: check_hicache_events, then the waiting requests (those
    waiting when the pass began: one the pass boundary ended reads True)."""
    handles = list(ps.cache.ongoing_prefetch) if handles is None else handles
    ps.cache.check_hicache_events()
    return {(h.rid, h.attempt_id): ps.check(h) for h in handles}


def stop_slot(hub, index):
    """A peer that votes to stop the operation in slot ``index`` of vote reduces."""

    def peer(values):
        out = list(values)
        if len(values) == LAYOUT:
            out[HEADER + index] = 0
        return out

    hub.peer = peer


def test_one_vote_reduce_per_pass_replaces_the_per_request_reduces(make_prefetch, vote_hub):
    ps = make_prefetch()
    hs = [ps.add(r) for r in ("b", "a", "c")]
    # pass 1: the first exchange, then the first vote reduce; nothing voted yet
    assert run_pass(ps) == {(h.rid, 0): False for h in hs}
    assert ps.blocking == []  # no collective per request
    (greet,) = ps.greets  # upstream's shape: 2 ack + 4 storage counts, then [x, -x]
    assert len(greet) == 8 and greet[:2] == [1, -1] and greet[2:6] == [0] * 4
    (vote,) = vote_hub.issued
    assert len(vote) == LAYOUT and vote[:2] == [3, -3]
    stop_slot(vote_hub, 1)  # slot order is key order: a, b, c -> "b"
    out = run_pass(ps)  # pass 2: the verdicts of pass 1, applied at the pass boundary
    assert out == {("b", 0): True, ("a", 0): False, ("c", 0): False}
    assert ps.ended == [(("b", 0), "deadline")]
    assert ps.blocking == [] and ps.state.stopped == 1
    assert len(vote_hub.issued) == 2 and len(ps.greets) == 1  # one more vote, nothing else


def test_verdict_is_one_pass_late_on_the_real_timer(make_prefetch):
    ps = make_prefetch(timeout_s=0.0)
    h = ps.add("r")
    run_pass(ps)  # blocking pass: not expired yet, upstream starts the timer
    assert "r" not in [k[0] for k, _ in ps.ended]
    assert run_pass(ps) == {("r", 0): False}  # votes "expired" now, no verdict yet
    assert run_pass(ps) == {("r", 0): True}  # the group's verdict, one pass later
    assert ps.ended == [(("r", 0), "deadline")]
    assert ps.cache._storage_prefetch_wait[h].expired  # upstream's agreed-verdict mark


def test_verdicts_follow_operations_by_identity(make_prefetch, vote_hub):
    ps = make_prefetch()
    for _ in range(2):
        run_pass(ps)
    h = ps.add("x")
    run_pass(ps, handles=[])  # "x" is voted on at this pass
    stop_slot(vote_hub, 0)
    ps.revoke(h)  # aborted in between; a new attempt takes the same request id
    ps.add("x")
    vote_hub.peer = None
    out = run_pass(ps)
    assert out == {("x", 0): False}  # the verdict was for the revoked operation
    assert ps.ended == [(("x", 0), "dropped")]


def test_reset_and_detach_between_issue_and_consume(make_prefetch, vote_hub):
    ps = make_prefetch()
    for _ in range(2):
        run_pass(ps)
    ps.add("a"), ps.add("b")
    run_pass(ps, handles=[])
    stop_slot(vote_hub, 0)
    ps.reset()
    assert run_pass(ps) == {}  # nothing left to ask about; no error, no stop
    ps.add("c")
    run_pass(ps, handles=[])
    ps.detach()  # storage detached mid-prefetch: the vote in flight is drained
    issued = len(vote_hub.issued)
    assert run_pass(ps) == {}
    assert len(vote_hub.issued) == issued and not ps.state.active
    assert vote_hub.handles[-1].waited
    assert [k for k, _ in ps.ended] == [("a", 0), ("b", 0), ("c", 0)]
    assert all(reason == "dropped" for _, reason in ps.ended)


def test_same_verdicts_whatever_order_requests_arrive_in(make_prefetch):
    hub = MinHub(world=2)
    expired = {0: {"m"}, 1: {"q"}}  # each rank's own clock
    ranks = [
        make_prefetch(rank=r, hub=hub, deadline=lambda op, r=r: op.request_id in expired[r])
        for r in (0, 1)
    ]
    for ps in ranks:
        # one thread runs both "ranks": the blocking agreement cannot pair here
        # (the gloo tests run it); start them agreed
        ps.state.agreed = True
        run_pass(ps, handles=[])
    for ps, order in zip(ranks, ("mqz", "zqm")):
        for rid in order:
            ps.add(rid)
    for ps in ranks:
        run_pass(ps, handles=[])
    outs = [run_pass(ps) for ps in ranks]
    assert outs[0] == outs[1] == {("m", 0): True, ("q", 0): True, ("z", 0): False}
    assert sorted(ranks[0].ended) == sorted(ranks[1].ended)


def test_ranks_that_disagree_on_the_set_stop_before_any_verdict(make_prefetch, vote_hub):
    ps = make_prefetch()
    for _ in range(2):
        run_pass(ps)
    ps.add("a")
    run_pass(ps, handles=[])
    vote_hub.peer = lambda v: [2, -2, *v[2:]] if len(v) == LAYOUT else v
    with pytest.raises(PrefetchVoteMismatch, match="number of ongoing storage prefetch"):
        run_pass(ps)
    assert ps.ended == []


def test_same_count_other_requests_is_a_mismatch(make_prefetch, vote_hub):
    ps = make_prefetch()
    for _ in range(2):
        run_pass(ps)
    ps.add("a")
    run_pass(ps, handles=[])
    other = votes.pack_stamp(votes.VOTES_PROTOCOL, False, 1, votes.set_digest([("z", 0)]), 0)

    def peer(v):
        if len(v) != LAYOUT:
            return v
        return [v[0], v[1], min(v[2], other), min(v[3], -other), *v[4:]]

    vote_hub.peer = peer
    with pytest.raises(PrefetchVoteMismatch, match="not the same requests"):
        run_pass(ps)


def test_a_peer_with_the_votes_off_stops_at_the_agreement(make_prefetch, vote_hub):
    ps = make_prefetch()
    ps.greet_peer = lambda v: [0, 0, *v[2:]]
    with pytest.raises(PrefetchVoteMismatch, match=f"{PREFETCH_VOTES_VAR} differs"):
        run_pass(ps)
    assert len(ps.greets) == 1 and vote_hub.issued == []  # the first exchange only


def test_a_stock_peer_is_named_at_the_votes_first_exchange(make_prefetch, vote_hub):
    ps = make_prefetch()
    ps.greet_peer = lambda v: [0] * (len(v) - 2) + [12345, -12345]  # a bare digest
    with pytest.raises(PrefetchVoteMismatch, match="this node pipelines, a peer does not"):
        run_pass(ps)
    assert vote_hub.issued == []


def test_votes_off_keeps_upstreams_reduce_after_agreeing(make_prefetch, vote_hub):
    ps = make_prefetch(env={PREFETCH_VOTES_VAR: "0"})
    ps.add("a")
    for _ in range(3):
        run_pass(ps)
    assert len(ps.blocking) == 3 and vote_hub.issued == []
    assert len(ps.greets) == 1 and ps.greets[0][:2] == [0, 0]


@pytest.mark.parametrize("policy, result", [("best_effort", True), ("wait_complete", False)])
def test_other_policies_stay_upstreams(make_prefetch, vote_hub, policy, result):
    ps = make_prefetch(policy=policy)
    ps.add("a")
    outs = [run_pass(ps) for _ in range(3)]
    assert outs[0] == {("a", 0): result}
    assert vote_hub.issued == [] and ps.blocking == []
    assert "runs no collective" in ps.state.decide(ps.cache).reason


def test_pp_and_untested_releases_stand_down(make_prefetch, plugin, monkeypatch):
    ps = make_prefetch()
    ps.cache.__dict__["pp_size"] = 2
    assert "pp_size=2" in ps.state.eligible(ps.cache).reason
    monkeypatch.setattr(guard, "JUDGED", guard.Judged(None, False, True))  # no release matched
    state = prefetch_votes.attach(ps.cache)
    assert not state.static.pipelined and state.static.code == "untested_release"


def test_the_setting_names_its_accepted_values():
    from hicache_async_ack.env import prefetch_votes_enabled

    assert prefetch_votes_enabled({}) is True
    assert prefetch_votes_enabled({PREFETCH_VOTES_VAR: "No"}) is False
    with pytest.raises(ValueError, match=f"{PREFETCH_VOTES_VAR}='maybe'.*accepted values"):
        prefetch_votes_enabled({PREFETCH_VOTES_VAR: "maybe"})


def test_window_covers_every_operation_when_there_are_more_than_slots():
    n = votes.VOTE_SLOTS * 2 + 7
    keys = list(range(n))
    last: dict = {}
    seen = set()
    for p in range(3):  # ceil(n / slots) passes cover all of them
        w = list(votes.window(keys, last))
        assert len(w) == votes.VOTE_SLOTS == len(set(w))
        seen.update(w)
        last.update({keys[i]: p for i in w})
    assert seen == set(range(n))


def test_attention_cp_x_tp_stands_down(make_cache, plugin, this_release):
    from hicache_async_ack_lab.sim.collectives import FakeGroup

    sim = make_cache(
        tp=4, storage=True, attn_cp_group=FakeGroup(2, "cp"), attn_tp_group=FakeGroup(2, "atp")
    )
    add_prefetch(sim)
    state = prefetch_votes.attach(sim.cache)
    assert not state.static.pipelined and "attention CP x TP" in state.static.reason


class Sink:
    """A metrics sink recording what the votes report."""

    def __init__(self):
        self.passes: list = []

    def on_path(self, pipelined):
        pass

    def on_pass(self, wait_s, issue_s, voted):
        self.passes.append((wait_s, voted))

    def on_stop(self):
        pass

    def on_failure(self, reason):
        pass


def test_metrics_count_the_voted_and_time_only_due_reduces(make_prefetch):
    """operations_total counts the operations voted on (at most the slots per
    pass), and the wait histogram only sees passes that had a reduce due."""
    ps = make_prefetch()
    for i in range(votes.VOTE_SLOTS + 44):
        ps.add(f"r{i:04d}")
    ps.state.metrics = sink = Sink()
    for _ in range(4):
        run_pass(ps)
    assert len(sink.passes) >= 2  # the pipelined passes (the first runs upstream's path)
    assert all(voted == votes.VOTE_SLOTS for _, voted in sink.passes)
    assert sink.passes[0][0] is None  # nothing was due at the first pipelined pass
    assert all(w is not None for w, _ in sink.passes[1:])
