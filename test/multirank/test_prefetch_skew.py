"""The prefetch votes over real gloo at TP=4 where ranks are not alike.

* SGLang #30760's loop skew: a rank whose waiting-queue loop stops earlier (its
  batch fills up first) visits fewer requests. A deadline verdict needs every
  rank to have reached the request in that walk (a rank that did not vetoes,
  as stock's per-request collective would have needed it there too), and the
  verdicts are applied at the pass boundary, so every rank still ends the same
  operations the same way in the same pass, whatever each loop visited.
* buffer_only (the ack sync stays blocking, so its first exchange never runs)
  with a peer without the plugin: the votes run their own first exchange in
  upstream's shape, so every plugin rank stops with the agreement's error,
  never a gloo abort or a closed connection.
"""

from __future__ import annotations

import pytest

from hicache_async_ack.env import PLUGINS_VAR
from hicache_async_ack.tools import Job, RanksFailed
from hicache_async_ack_lab.fresh import run_fresh

WORLD = 4
GROUP_TIMEOUT = 20.0
TARGET = "hicache_async_ack_lab.testing.prefetch_scenarios:run_prefetch_specs"
SKEW = [
    # deadlines that come due while the skewed rank's loop misses requests
    dict(name="skew_rank1", seed=21, passes=150, skew={"1": 10}),
    dict(name="skew_two_ranks", seed=22, passes=150, skew={"1": 5, "3": 40}),
    dict(name="skew_with_events", seed=23, passes=200, events=True, skew={"2": 0}),
    # variant (c): storage reads also finish, some in the pass their deadline passed
    dict(name="skew_with_completions", seed=24, passes=200, completions=True, skew={"1": 10}),
    dict(
        name="skew_completions_events",
        seed=25,
        passes=200,
        completions=True,
        events=True,
        skew={"1": 5, "2": 30},
    ),
]
# The negative control: verdicts applied only where a rank's loop visits a
# request (before the fix); the same scenarios must then diverge.
CONTROL = [
    dict(s, name=s["name"] + "_loop_only", loop_only_verdicts=True) for s in SKEW[:1] + SKEW[3:4]
]
STOCK_PEER = [
    dict(
        name="buffer_only_stock_peer",
        seed=7,
        passes=30,
        host_memory_mode="buffer_only",
        expect_error=True,
    )
]
STOCK_RANK = 2
SPECS = {s["name"]: s for s in SKEW + CONTROL}


@pytest.fixture(scope="module")
def results():
    jobs = [
        Job(
            target=TARGET,
            world_size=WORLD,
            payload={"specs": SKEW + CONTROL, "group_timeout_s": GROUP_TIMEOUT},
            timeout_s=900,
            label="prefetch vote ranks, loop skew",
            group_timeout_s=GROUP_TIMEOUT,
        ),
        Job(
            target=TARGET,
            world_size=WORLD,
            payload={"specs": STOCK_PEER, "group_timeout_s": GROUP_TIMEOUT},
            timeout_s=300,
            label="prefetch vote ranks, buffer_only with a stock peer",
            group_timeout_s=GROUP_TIMEOUT,
            rank_env={STOCK_RANK: {PLUGINS_VAR: "some_other_plugin"}},
            allow_exit=(STOCK_RANK,),
        ),
    ]
    out = run_fresh(jobs)
    return {"skew": out[0], "stock": out[1]}


@pytest.mark.parametrize("name", [s["name"] for s in SKEW])
def test_loop_skew_ends_the_same_operations_the_same_way_in_the_same_pass(results, name):
    runs = results["skew"]
    assert not isinstance(runs, RanksFailed), str(runs)
    per = [r[name] for r in runs]
    assert len(per) == WORLD
    for rank, r in enumerate(per):
        assert "error" not in r, (rank, r.get("traceback"))
    ended = [r["per_pass"] for r in per]
    assert sum(map(len, ended[0])) > 20, "too few prefetches ended: the scenario is broken"
    assert any(k and reason == "deadline" for p in ended[0] for k, reason in p)
    for rank in range(1, WORLD):
        assert ended[rank] == ended[0], rank  # same operations, same reason, same pass
    assert all(r["left"] == 0 for r in per)
    if SPECS[name].get("completions"):
        reasons = {reason for p in ended[0] for _, reason in p}
        assert {"deadline", "completed"} <= reasons, reasons
        assert sum(r["raced"] for r in per) > 0, "no read finished in its deadline's pass"


@pytest.mark.parametrize("name", [s["name"] for s in CONTROL])
def test_loop_only_verdicts_diverge_under_the_same_skew(results, name):
    """Negative control: without the pass-boundary application the scenarios
    above must fail, by different endings or the votes' mismatch error."""
    runs = results["skew"]
    assert not isinstance(runs, RanksFailed), str(runs)
    per = [r[name] for r in runs]
    assert len(per) == WORLD
    errors = [r.get("error", "") for r in per]
    if any(errors):
        assert any("PrefetchVoteMismatch" in e for e in errors), errors
        return
    ended = [r["per_pass"] for r in per]
    assert any(ended[rank] != ended[0] for rank in range(1, WORLD))


def test_buffer_only_with_a_stock_peer_stops_with_the_agreements_error(results):
    runs = results["stock"]
    assert not isinstance(runs, RanksFailed), str(runs)
    plugin_ranks = [r for rank, r in enumerate(runs) if rank != STOCK_RANK]
    assert len(plugin_ranks) == WORLD - 1
    for r in plugin_ranks:
        r = r["buffer_only_stock_peer"]
        err = r.get("error", "")
        assert "this node pipelines, a peer does not" in err, err
        assert "Connection reset" not in err and "imed out" not in err
        assert r["seconds"] < GROUP_TIMEOUT
