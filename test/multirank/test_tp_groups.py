"""The real class over real gloo on 127.0.0.1, 2 and 4 ranks, acks finishing at
rank-specific times: symmetric pops, no unfinished ack popped, nothing left -
for both the pipelined and the blocking path, with and without write-back flushes.
Part of the per-release subset: scripts/test.sh runs it on every tested SGLang."""

from __future__ import annotations

import pytest

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR
from hicache_async_ack_lab.testing.drift import runs_here

from support.checks import assert_lagged_equal, assert_symmetric_and_complete
from support.gloo_ranks import run_scenarios

# With a storage backend the ack counts pipeline only where the prefetch votes judge the
# walk (docs/design.md, "The off switch is stock's storage path"): a release without them
# keeps SGLang's storage path, and "pipelined_storage" runs it there.
STORAGE_PIPELINES = "prefetch_votes" in runs_here()

OFF = {ENABLE_VAR: "0"}
FLUSHES = dict(events=["write_back_flush"], event_p=0.1)  # writing_check(write_back=True)


def _specs(steps: int) -> list[dict]:
    base = dict(steps=steps, max_delay=3, skew=True)
    return [
        dict(base, name="pipelined", seed=11),
        dict(base, name="blocking", seed=11, env=OFF),
        dict(base, name="pipelined_storage", seed=12, storage=True, extra_pools=["mamba"]),
        dict(base, name="blocking_storage", seed=12, storage=True, extra_pools=["mamba"], env=OFF),
        dict(base, name="pipelined_no_skew", seed=13, skew=False),
        dict(base, name="blocking_no_skew", seed=13, skew=False, env=OFF),
        dict(base, name="pipelined_depth2", seed=11, env={DEPTH_VAR: "2"}),
        dict(base, name="pipelined_depth3", seed=11, env={DEPTH_VAR: "3"}),
        dict(base, name="pipelined_flush", seed=14, **FLUSHES),
        dict(base, name="blocking_flush", seed=14, env=OFF, **FLUSHES),
    ]


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request):
    world = request.param
    return world, run_scenarios(world, _specs(steps=300 if world == 2 else 200))


@pytest.mark.parametrize(
    "name",
    [
        "pipelined",
        "blocking",
        "pipelined_storage",
        "blocking_storage",
        "pipelined_no_skew",
        "blocking_no_skew",
        "pipelined_depth2",
        "pipelined_depth3",
        "pipelined_flush",
        "blocking_flush",
    ],
)
def test_symmetric_pops_nothing_unfinished_nothing_left(ranks, name):
    world, results = ranks
    r0 = assert_symmetric_and_complete(results, name)
    expected = name.startswith("pipelined") and (STORAGE_PIPELINES or "storage" not in name)
    assert r0["pipelined"] is expected
    popped = sum(len(pre) + len(post) for pre, post in r0["pops"])
    assert popped >= r0["counts"]["enqueued"]  # acks, plus storage entries


@pytest.mark.parametrize(
    "pipelined, blocking, k",
    [
        ("pipelined", "blocking", 1),
        ("pipelined_storage", "blocking_storage", 1),
        ("pipelined_no_skew", "blocking_no_skew", 1),
        ("pipelined_depth2", "blocking", 2),
        ("pipelined_depth3", "blocking", 3),
    ],
)
def test_pipelined_pops_what_blocking_popped_k_steps_earlier(ranks, pipelined, blocking, k):
    _, results = ranks
    mine, stock = results[0][pipelined]["pops"], results[0][blocking]["pops"]
    if "storage" in pipelined and not STORAGE_PIPELINES:  # both on SGLang's storage path
        assert any(post for _, post in stock) and mine == stock
        return
    assert_lagged_equal(mine, stock, k)


@pytest.mark.parametrize("name", ["pipelined_flush", "blocking_flush"])
def test_write_back_flushes_ran_and_popped(ranks, name):
    """The flush scenarios did flush, with acks queued: not a vacuous pass."""
    _, results = ranks
    r0 = results[0][name]
    assert r0["counts"]["events"].get("write_back_flush", 0) >= 5
    flushed = [pre for pre, _ in r0["pops"] if pre]
    assert flushed and all(kind == "write" for pre in flushed for kind, _ in pre)
