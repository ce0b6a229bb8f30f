"""Ranks that disagree stop loudly, over real gloo at TP=4.

Every node of a TP group sets its own environment. A rank at another lag depth,
a rank whose plugin is off (disabled, or excluded by SGLANG_PLUGINS: it runs
SGLang's blocking path) and a rank on another protocol version must each stop
every rank with the agreement's error naming what differs (never a gloo
timeout), and no rank may pop anything from a reduce the ranks disagree on.
Settings that differ from the start are named in the first step, by its
stamped exchange, before any other collective runs.
"""

from __future__ import annotations

import pytest

from hicache_async_ack import __version__
from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR
from hicache_async_ack.protocol import PROTOCOL_VERSION

from support.checks import assert_symmetric_and_complete
from support.gloo_ranks import run_fresh, scenario_job

WORLD = 4
GROUP_TIMEOUT = 30.0  # the held-out check's; what is asserted is the error, not a time
BASE = dict(steps=60, max_delay=2, skew=True, fresh_group=True, expect_error=True)
# Upstream's own digest check, tripped on the rank that runs the blocking path.
UPSTREAM_ASSERT = "AssertionError: write_back duplicate-reclaim victims diverged"
TIMEOUT_WORDS = ("Timed out", "timeout", "timed out")


@pytest.fixture(scope="module")
def runs():
    """One launcher, three rank sets: settings that differ per scenario, then a
    peer without the plugin (excluded), then a peer with it disabled."""
    in_process = [
        dict(BASE, name="control", seed=1, expect_error=False),
        dict(BASE, name="other_depth", seed=2, rank_env={"1": {DEPTH_VAR: "2"}}),
        dict(BASE, name="other_protocol", seed=3, protocol_at=20),
        dict(BASE, name="control_after", seed=4, expect_error=False),
    ]
    stock = [dict(BASE, name="stock_peer", seed=5)]
    jobs = [
        scenario_job(WORLD, in_process, group_timeout=GROUP_TIMEOUT, timeout=300),
        scenario_job(
            WORLD,
            stock,
            group_timeout=GROUP_TIMEOUT,
            timeout=300,
            rank_env={2: {PLUGINS_VAR: "some_other_plugin"}},
        ),
        scenario_job(
            WORLD, stock, group_timeout=GROUP_TIMEOUT, timeout=300, rank_env={3: {ENABLE_VAR: "0"}}
        ),
    ]
    out = run_fresh(jobs)
    for r in out:
        if isinstance(r, Exception):
            raise AssertionError(str(r))
    return {"settings": out[0], "excluded": out[1], "disabled": out[2]}


def _popped_from_step(r: dict, first: int) -> list:
    return [p for pre, post in r["pops"][first:] for p in pre + post] + r.get(
        "popped_in_failed_step", []
    )


@pytest.mark.parametrize("name", ["control", "control_after"])
def test_identical_settings_still_pipeline_with_symmetric_pops(runs, name):
    r0 = assert_symmetric_and_complete(runs["settings"], name)
    assert r0["pipelined"]
    assert sum(len(post) for _, post in r0["pops"]) > 0


def test_other_depth_on_one_rank_stops_every_rank_before_any_pop(runs):
    for rank, per in enumerate(runs["settings"]):
        r = per["other_depth"]
        err = r.get("error", "")
        assert "HiCacheAckSyncMismatch" in err and "the lag depth differs" in err, (rank, err)
        assert "group min 1, max 2" in err and DEPTH_VAR in err, err
        assert "Nothing was popped" in err
        mine = "2" if rank == 1 else "1"
        assert f"this rank {mine}," in err
        assert "first exchange" in err and r["steps_run"] == 0, (rank, r["steps_run"])
        assert not any(w in err for w in TIMEOUT_WORDS), err
        assert _popped_from_step(r, 0) == [], rank
        assert r["seconds"] < GROUP_TIMEOUT


def test_other_protocol_from_step_20_stops_before_popping_its_reduce(runs):
    """Rank 1 speaks another protocol from step 20 on: the reduce issued then is
    consumed at step 21, and nothing is popped from it or after it."""
    for rank, per in enumerate(runs["settings"]):
        r = per["other_protocol"]
        err = r.get("error", "")
        assert "protocol version differs" in err, (rank, err)
        # the error names this node's release and protocol, and what each release speaks
        assert f"hicache-async-ack {__version__}, protocol {PROTOCOL_VERSION}" in err, err
        assert "protocols by release: 1, 2, 3, 4: hicache-async-ack 0.1.0" in err, err
        assert r["steps_run"] == 21, (rank, r["steps_run"])
        assert _popped_from_step(r, 21) == []
        assert sum(len(post) for _, post in r["pops"]) > 0  # pipelined until then
        assert r["seconds"] < GROUP_TIMEOUT


@pytest.mark.parametrize("case, stock_rank", [("excluded", 2), ("disabled", 3)])
def test_a_stock_peer_trips_upstreams_check_and_stops_the_pipelining_ranks(runs, case, stock_rank):
    for rank, per in enumerate(runs[case]):
        r = per["stock_peer"]
        err = r.get("error", "")
        if rank == stock_rank:
            # the blocking path: upstream's own assertion, on the same reduce
            assert not r["pipelined"]
            assert UPSTREAM_ASSERT in err, err
            assert r["steps_run"] == 0
        else:
            assert "HiCacheAckSyncMismatch" in err, (rank, err)
            assert "this node pipelines, a peer does not" in err
            assert "ran SGLang's blocking ack sync" in err, (rank, err)
            assert PLUGINS_VAR in err and ENABLE_VAR in err
            # the first step's exchange names it, before any other collective
            assert r["steps_run"] == 0 and "first exchange" in err
        assert not any(w in err for w in TIMEOUT_WORDS), err
        assert _popped_from_step(r, 0) == [], (case, rank)
        assert r["seconds"] < GROUP_TIMEOUT
