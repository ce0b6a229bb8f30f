"""PD decode offload progress over real gloo at TP=4.

Offloads queued the same on every rank, backups acked at rank-specific steps,
retractions at random (shared) steps. Checked: every rank pops the same entries
in the same step; nothing is lost; the pipelined run pops at step s+1 exactly
what stock SGLang pops at step s; a rank with the setting off, or without the
plugin, stops the plugin's ranks with an error naming it in the first step.
"""

from __future__ import annotations

import pytest

from hicache_async_ack.env import OFFLOAD_SYNC_VAR, PLUGINS_VAR
from hicache_async_ack.tools import Job, RanksFailed
from hicache_async_ack_lab.fresh import run_fresh

WORLD = 4
GROUP_TIMEOUT = 15.0
TARGET = "hicache_async_ack_lab.testing.offload_scenarios:run_offload_specs"
OFF = {OFFLOAD_SYNC_VAR: "0"}
SPECS = [
    dict(name="stock", seed=4, steps=150, env=OFF),
    dict(name="pipelined", seed=4, steps=150),
    dict(name="retractions", seed=8, steps=300, retract=0.05),
    dict(name="one_rank_off", seed=2, steps=20, rank_env={"1": OFF}),
    # issue 53 items 1 and 2, with SGLang's metrics on (PROMETHEUS_MULTIPROC_DIR)
    dict(name="mismatch_metrics", seed=2, steps=20, rank_env={"1": OFF}, metrics=True),
    dict(name="fifo_metrics", seed=5, steps=60, reorder_from=5, metrics=True),
]


def job(specs, **kw) -> Job:
    return Job(
        target=TARGET,
        world_size=WORLD,
        payload={"specs": specs, "group_timeout_s": GROUP_TIMEOUT},
        timeout_s=600,
        label="offload ranks",
        group_timeout_s=GROUP_TIMEOUT,
        **kw,
    )


@pytest.fixture(scope="module")
def results():
    stock_peer = [dict(name="stock_peer", seed=3, steps=20)]
    out = run_fresh([job(SPECS), job(stock_peer, rank_env={3: {PLUGINS_VAR: "other"}})])
    for r in out:
        if isinstance(r, RanksFailed):
            raise AssertionError(str(r))
    return out


def pops(r):
    return [[tuple(p) for p in step] for step in r["per_step"]]


@pytest.mark.parametrize("name", ["stock", "pipelined", "retractions"])
def test_same_pops_in_the_same_step_and_nothing_lost(results, name):
    runs = results[0]
    r0 = runs[0][name]
    for rank, per in enumerate(runs):
        r = per[name]
        assert "error" not in r, (rank, r.get("traceback"))
        assert pops(r) == pops(r0), f"rank {rank} popped differently"
        assert r["left"] == 0 and r["violations"] == []
        flat = [p for step in pops(r) for p in step]
        assert len(flat) == len(set(flat)) == sum(r["added"].values())
    if name == "retractions":
        assert r0["retractions"] > 0


def test_pipelined_pops_one_step_after_stock(results):
    for per in results[0]:
        stock, piped = pops(per["stock"]), pops(per["pipelined"])
        assert per["pipelined"]["pipelined"] and not per["stock"]["pipelined"]
        assert piped[0] == []
        n = min(len(stock), len(piped) - 1)
        assert [piped[s + 1] for s in range(n)] == stock[:n]
        assert sum(len(s) for s in stock) > 100


def test_a_rank_with_the_setting_off_stops_every_rank_first_step(results):
    for rank, per in enumerate(results[0]):
        r = per["one_rank_off"]
        err = r.get("error", "")
        assert f"{OFFLOAD_SYNC_VAR} differs" in err, (rank, err)
        assert f"this rank {0 if rank == 1 else 1}, group min 0, max 1" in err
        assert r["error_step"] == 0 and r["per_step"] == []


def test_a_rank_without_the_plugin_is_named_by_the_others(results):
    for rank, per in enumerate(results[1]):
        r = per["stock_peer"]
        if rank == 3:
            continue  # stock: its next reduce finds no partner (group timeout)
        assert "a peer does not" in r.get("error", ""), (rank, r.get("error"))
        assert r["error_step"] == 0 and r["per_step"] == []
        assert r["seconds"] < GROUP_TIMEOUT


TITLE = "HiCache decode offload sync:"


def test_a_mismatch_with_metrics_on_is_counted_logged_and_titled(results):
    """Issue 53 item 1: OffloadSyncMetrics had no on_failure, so a mismatch with metrics
    on died with AttributeError and the named mismatch was never logged."""
    for rank, per in enumerate(results[0]):
        r = per["mismatch_metrics"]
        err = r.get("error", "")
        assert err.startswith(f"OffloadSyncMismatch: {TITLE}"), (rank, err)
        assert f"{OFFLOAD_SYNC_VAR} differs" in err
        assert r["failures"] == {"mismatch": 1, "failure": 0}, (rank, r["failures"])
        assert r["logged_errors"], rank
        assert all(line.startswith(TITLE) for line in r["logged_errors"]), r["logged_errors"]


def test_a_fifo_violation_is_the_offload_syncs_error_counted_logged_and_titled(results):
    """Issue 53 item 2: the protocol raised the ack sync's error for every sync, so the
    offload sync's FIFO violation was neither counted nor logged nor titled as its own."""
    for rank, per in enumerate(results[0]):
        r = per["fifo_metrics"]
        assert "reordered" in r, "the scenario never reordered: it would prove nothing"
        err = r.get("error", "")
        assert err.startswith(f"OffloadSyncError: {TITLE}") and "FIFO" in err, (rank, err)
        assert r["error_step"] == r["reordered"]
        assert r["failures"] == {"mismatch": 0, "failure": 1}, (rank, r["failures"])
        assert len(r["logged_errors"]) == 1 and "FIFO" in r["logged_errors"][0]
