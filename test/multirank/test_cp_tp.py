"""Attention CP=2 x TP=2 over real gloo (4 processes, groups laid out as SGLang's
initialize_model_parallel does): one collective over the TP group pops exactly
what upstream's two dependent reduces (CP, then TP) pop, k steps later."""

from __future__ import annotations

import pytest

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR
from hicache_async_ack_lab.sim.layout import attention_cp_layout

from support.checks import assert_lagged_equal, assert_symmetric_and_complete
from support.gloo_ranks import run_scenarios

OFF = {ENABLE_VAR: "0"}
BASE = dict(steps=250, max_delay=3, skew=True, cp_x_tp="grid")
# CP=2 x TP=2 as SGLang lays it out, plus "odd_cp": CP groups equal to the attn
# TP groups, a layout no single group matches (the plugin must keep it blocking).
LAYOUT = dict(attention_cp_layout(4, 2), odd_cp=[[0, 1], [2, 3]])


@pytest.fixture(scope="module")
def results():
    specs = [
        dict(BASE, name="cp_tp_pipelined", seed=31),
        dict(BASE, name="cp_tp_blocking", seed=31, env=OFF),
        dict(BASE, name="cp_tp_depth2", seed=31, env={DEPTH_VAR: "2"}),
        dict(BASE, name="cp_tp_storage_pipelined", seed=32, storage=True),
        dict(BASE, name="cp_tp_storage_blocking", seed=32, storage=True, env=OFF),
        dict(BASE, name="odd_layout", seed=33, cp_x_tp="odd", steps=60),
    ]
    return run_scenarios(4, specs, layout=LAYOUT)


@pytest.mark.parametrize(
    "name",
    ["cp_tp_pipelined", "cp_tp_depth2", "cp_tp_storage_pipelined"],
)
def test_cp_tp_pipelines_over_the_spanning_tp_group(results, name):
    r0 = assert_symmetric_and_complete(results, name)
    assert r0["pipelined"], r0["reason"]
    assert "TP group, equal to attn CP(2) x attn TP(2)" in r0["reason"]


@pytest.mark.parametrize(
    "pipelined, blocking, k",
    [
        ("cp_tp_pipelined", "cp_tp_blocking", 1),
        ("cp_tp_depth2", "cp_tp_blocking", 2),
        ("cp_tp_storage_pipelined", "cp_tp_storage_blocking", 1),
    ],
)
def test_cp_tp_pops_what_two_blocking_reduces_popped(results, pipelined, blocking, k):
    for name in (pipelined, blocking):
        assert_symmetric_and_complete(results, name)
    for rank in range(4):
        assert_lagged_equal(results[rank][pipelined]["pops"], results[rank][blocking]["pops"], k)


def test_layout_no_group_spans_stays_blocking(results):
    """Upstream agrees within each {CP, TP} block here, not across the TP group,
    so no single existing group is equivalent: blocking, and it says why."""
    for per_rank in results:
        r = per_rank["odd_layout"]
        assert "error" not in r, r.get("traceback")
        assert not r["pipelined"] and r["pending"] == 0
        assert "no existing group spans exactly their ranks" in r["reason"]
        assert r["violations"] == [] and r["left"] and not any(r["left"].values())
    blocks = [[0, 1], [2, 3]]
    for a, b in blocks:
        assert results[a]["odd_layout"]["pops"] == results[b]["odd_layout"]["pops"]
