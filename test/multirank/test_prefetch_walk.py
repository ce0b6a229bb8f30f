"""The prefetch votes against stock SGLang, decision for decision, over real gloo
(TP=2, SGLang's real UnifiedRadixCache, the plugin reached only through
load_plugins()): the same scripted passes run once with the plugin and once on
stock (the plugin excluded by SGLANG_PLUGINS), and each test compares the two.

* A request reached once, then left behind a full batch while its read
  finishes after its deadline: stock lets the read finish (a deadline is only
  judged where the walk reaches the request); so must the plugin, admitting it
  in the same pass. Negative control: votes on every ongoing operation at the
  boundary (the votes before the fix) end it by deadline.
* A deadline the walk does see ends the prefetch by deadline on both, the
  plugin two passes later in cache mode (its reduce is consumed one pass late,
  and the walk's reaches ride the next one), one pass later in buffer_only.
* One all_reduce per pass carries the ack counts and every vote.
* Loop skew (SGLang #30760): ranks that admit different requests stop, every
  rank, within two passes, naming the pass, the first differing request and
  #30760; stock runs on with different batches. A request one rank reached
  and could not admit leaves the same batches: nothing stops.
* Each sync judged on its own: on an SGLang whose writing_check (a method only
  the ack sync relies on) gained a statement, the ack sync stands down and the
  votes ride upstream's blocking reduce, still one all_reduce per pass.
"""

from __future__ import annotations

import pytest

from hicache_async_ack.env import DEPTH_VAR, PLUGINS_VAR
from hicache_async_ack.tools import Job, RanksFailed
from hicache_async_ack_lab.fresh import run_fresh

WORLD = 2
GROUP_TIMEOUT = 20.0
TARGET = "hicache_async_ack_lab.testing.walk_scenarios:run_walk_specs"
STOCK = {r: {PLUGINS_VAR: "some_other_plugin"} for r in range(WORLD)}
# Reached in pass 0 (its wait starts), the batch full in passes 1-6, its deadline
# in pass 3 (3 passes after the first check), its read finished in pass 5.
SATURATED = dict(
    name="saturated",
    passes=10,
    requests=[dict(rid="r0", arrive=0, budget=3, finish=5)],
    full=[1, 2, 3, 4, 5, 6],
)
# Reached every pass, never finishing: its deadline, 2 passes after the first
# check on rank 0 and 3 on rank 1, must end it (any rank's deadline: MAX).
DEADLINE = dict(
    name="deadline",
    passes=10,
    requests=[dict(rid="r0", arrive=0, budget=[2, 3]), dict(rid="r1", arrive=1, budget=[9, 1])],
)
# Two finished prefetches; rank 1's walk stops one request earlier in pass 4.
SKEW = dict(
    name="skew",
    passes=10,
    requests=[dict(rid="r0", arrive=0, finish=1), dict(rid="r1", arrive=0, finish=1)],
    full=[0, 1, 2, 3],
    short={"1": [4]},
)
# Rank 0 reaches r1 and add_one_req rejects it; rank 1's walk stops before r1:
# both admit r0 only in pass 4 (the same batch), r1 in pass 5.
REJECTED = dict(
    name="rejected",
    passes=8,
    requests=[dict(rid="r0", arrive=0, finish=1), dict(rid="r1", arrive=0, finish=1)],
    full=[0, 1, 2, 3],
    short={"1": [4]},
    reject={"0": {"4": ["r1"]}},
)
# The same requests, but rank 1 admits r1 with a 2-token prefix (its match took
# another prefix); then the same with the lengths left out of the check (the
# negative control: keys only, as before); then a chunked request's next chunk
# taken with another prefix on rank 1.
PREFIX = dict(SKEW, name="prefix", short={}, prefix={"1": {"4": {"r1": 2}}})
PREFIX_KEYS_ONLY = dict(PREFIX, name="prefix_keys_only", control=["keys_only"])
CHUNKED = dict(
    SKEW, name="chunked", short={}, chunked={"6": {"rid": "r0", "prefix": [8, 6], "extend": 4}}
)
BUFFER_ONLY = dict(DEADLINE, name="deadline_buffer_only", host_memory_mode="buffer_only")
DEPTH_2 = dict(DEADLINE, name="deadline_depth_2", env={DEPTH_VAR: "2"})
SPECS = [SATURATED, DEADLINE, SKEW, REJECTED, BUFFER_ONLY, DEPTH_2, PREFIX, CHUNKED]
# attention CP=2 x TP=2 (world 4): the votes ride the ack sync's one reduce over
# the TP group, where stock runs two per request (CP group, then attention TP)
CP_TP = dict(
    name="deadline_cp_tp",
    passes=10,
    cp=2,
    requests=[
        dict(rid="r0", arrive=0, budget=[2, 3, 4, 3]),
        dict(rid="r1", arrive=1, budget=[9, 9, 9, 1]),
    ],
)
# 300 ongoing prefetches (their reads never finish, no deadline in reach), all
# reached each pass; in pass 2 rank 1's walk reaches 270 (its batch filled up),
# or visits positions 280 and 281 the other way round (its queue diverged):
# issue 47's finding 9, walks that diverge past the section's 256 slots.
CROWD = dict(
    name="crowd_short",
    passes=6,
    requests=[dict(rid=f"q{i:03d}", arrive=0, budget=99) for i in range(300)],
    reach={"1": {"2": 270}},
)
CROWD_SWAPPED = dict(CROWD, name="crowd_swapped", reach={}, swap={"1": {"2": [280, 281]}})
CROWD_FALLBACK = dict(CROWD, name="crowd_short_walk_fallback", control=["walk_fallback"])
CONTROL = [
    dict(SATURATED, name="saturated_unreached_votes", unreached_votes=True),
    PREFIX_KEYS_ONLY,
]


@pytest.fixture(scope="module")
def results():
    def job(label, specs, rank_env=None):
        return Job(
            target=TARGET,
            world_size=WORLD,
            payload={"specs": specs, "group_timeout_s": GROUP_TIMEOUT},
            timeout_s=300,
            label=label,
            group_timeout_s=GROUP_TIMEOUT,
            rank_env=rank_env or {},
        )

    drifted = job("walk, ack-only drift", [DEADLINE])
    drifted.payload["drift"] = "writing_check:no_op_first"
    cp_plugin, cp_stock = job("walk, CP x TP", [CP_TP]), job("walk, CP x TP, stock", [CP_TP])
    for j in (cp_plugin, cp_stock):
        j.world_size = 4
    cp_stock.rank_env = {r: {PLUGINS_VAR: "some_other_plugin"} for r in range(4)}
    out = run_fresh(
        [
            job("walk, plugin", SPECS + CONTROL + [CROWD, CROWD_SWAPPED]),
            job("walk, stock", SPECS, STOCK),
            drifted,
            cp_plugin,
            cp_stock,
            job("walk, the old fallback past the slots", [CROWD_FALLBACK]),
        ]
    )
    names = ("plugin", "stock", "ack_off", "cp_plugin", "cp_stock", "fallback")
    for name, ranks in zip(names, out):
        if isinstance(ranks, RanksFailed) and name != "fallback":
            raise AssertionError(str(ranks))
    return dict(zip(names, out))


def runs(results, arm: str, name: str, world: int = WORLD) -> list[dict]:
    per = [r[name] for r in results[arm]]
    assert len(per) == world
    assert all(r["plugin"] == ("plugin" in arm) for r in per), "the arm ran the other code"
    return per


def endings(r: dict) -> dict:
    """rid -> (pass, how it ended)."""
    return {k[0]: (p, why) for p, x in enumerate(r["per_pass"]) for k, why in x["ended"]}


def admissions(r: dict) -> dict:
    """rid -> the pass it was admitted in."""
    return {rid: p for p, x in enumerate(r["per_pass"]) for rid in x["admitted"]}


def clean(per: list[dict]) -> None:
    for rank, r in enumerate(per):
        assert "error" not in r, (rank, r.get("traceback"))


def test_a_request_left_behind_a_full_batch_finishes_its_read_as_in_stock(results):
    stock, plugin = runs(results, "stock", "saturated"), runs(results, "plugin", "saturated")
    clean(stock + plugin)
    for s, p in zip(stock, plugin):
        assert endings(s) == {"r0": (5, "completed")}  # stock: the ack drain, pass 5
        assert endings(p) == {"r0": (6, "completed")}  # one pass later, as the drain is
        assert admissions(s) == admissions(p) == {"r0": 7}  # the same pass
        assert p["stopped_on_verdict"] == 0 and p["sections"] > 5


def test_votes_on_unreached_operations_end_it_by_deadline(results):
    """Negative control: the votes before the fix (every ongoing operation
    voted on at the boundary) cut the read at its deadline."""
    per = runs(results, "plugin", "saturated_unreached_votes")
    clean(per)
    for r in per:
        assert endings(r) == {"r0": (4, "deadline")}
        assert r["stopped_on_verdict"] == 1


@pytest.mark.parametrize(
    "name, late", [("deadline", 2), ("deadline_buffer_only", 1), ("deadline_depth_2", 3)]
)
def test_a_deadline_the_walk_sees_ends_it_as_in_stock_later(results, name, late):
    stock, plugin = runs(results, "stock", name), runs(results, "plugin", name)
    clean(stock + plugin)
    s0 = endings(stock[0])
    # stock: r0 by rank 0's deadline (pass 2), r1 by rank 1's (first check pass 1 + 1)
    assert s0 == {"r0": (2, "deadline"), "r1": (2, "deadline")}
    for s, p in zip(stock, plugin):
        assert endings(s) == s0
        assert endings(p) == {rid: (at + late, why) for rid, (at, why) in s0.items()}
        # ended at the boundary, admitted in that pass's walk (stock: in the walk itself)
        assert admissions(p) == {rid: at for rid, (at, _) in endings(p).items()}
        assert admissions(s) == {rid: at for rid, (at, _) in s0.items()}
        assert p["stopped_on_verdict"] == 2


@pytest.mark.parametrize("name", ["deadline", "deadline_buffer_only"])
def test_one_all_reduce_per_pass_carries_acks_and_votes(results, name):
    for r in runs(results, "plugin", name):
        clean([r])
        steady = r["per_pass"][1:]
        assert steady and all(x["async"] + x["blocking"] == 1 for x in steady), steady
        assert sum(x["waiting"] for x in steady) > 0  # passes that had prefetches to decide
    for r in runs(results, "stock", name):  # stock: the ack reduce plus one per reach
        assert max(x["blocking"] for x in r["per_pass"]) >= 3


def test_ranks_that_admit_differently_stop_by_name_within_two_passes(results):
    per = runs(results, "plugin", "skew")
    for rank, r in enumerate(per):
        err = r.get("error", "")
        assert "AdmissionMismatch" in err, (rank, r.get("traceback"))
        assert r["error_pass"] - 4 <= 2, r["error_pass"]  # the walk of pass 4
        # the walk of pass 4 (passes 0-3 full: no forward ran) builds forward 1's batch
        assert "scheduling pass of forward 1 (the scheduler's forward_ct" in err, err
        assert "SGLang #30760" in err
        mine = "rid='r1' (attempt 0)" if rank == 0 else "nothing"
        assert f"request #2 of the batch, where this rank admitted {mine}" in err, err
    # stock runs on, its ranks admitting r1 in different passes: different batches
    stock = runs(results, "stock", "skew")
    clean(stock)
    assert admissions(stock[0]) == {"r0": 4, "r1": 4}
    assert admissions(stock[1]) == {"r0": 4, "r1": 5}


R0, R1 = "rid='r0' (attempt 0)", "rid='r1' (attempt 0)"


@pytest.mark.parametrize(
    "name, at, mine",
    [
        ("prefix", 4, (f"{R1} with prefix 0", f"{R1} with prefix 2")),
        ("chunked", 6, (f"{R0} with prefix 8", f"{R0} with prefix 6")),
    ],
)  # fmt: skip
def test_the_same_requests_with_other_lengths_stop_by_name(results, name, at, mine):
    """The admission check compares (request, prefix, extend): ranks that admit the
    same requests but take another prefix (or a chunked request's next chunk
    with another one) stop within depth + 1 passes, naming the request and both
    lengths; stock runs on."""
    for rank, r in enumerate(runs(results, "plugin", name)):
        err = r.get("error", "")
        assert "AdmissionMismatch" in err, (rank, r.get("traceback"))
        assert 0 <= r["error_pass"] - at <= 2, r["error_pass"]
        assert f"where this rank admitted {mine[rank]}" in err, err
    clean(runs(results, "stock", name))


def test_without_the_lengths_the_check_misses_another_prefix(results):
    """Negative control: the check over keys only (as before) lets ranks run
    batches that take different prefixes."""
    per = runs(results, "plugin", "prefix_keys_only")
    clean(per)
    assert len(per) == 2 and all(admissions(r) == {"r0": 4, "r1": 4} for r in per)


def test_a_request_reached_and_rejected_on_one_rank_only_stops_nothing(results):
    plugin, stock = runs(results, "plugin", "rejected"), runs(results, "stock", "rejected")
    clean(plugin + stock)
    for r in plugin + stock:
        assert admissions(r) == {"r0": 4, "r1": 5}
    assert all(r["sections"] >= 7 for r in plugin)  # the votes ran through every pass


def test_an_ack_only_change_leaves_the_votes_riding_upstreams_reduce(results):
    """The votes judged on their own methods: with the ack sync standing down
    (its writing_check changed), they ride upstream's blocking ack-count reduce,
    one pass after the walk, with one all_reduce per pass."""
    stock = runs(results, "stock", "deadline")
    per = [r["deadline"] for r in results["ack_off"]]
    assert len(per) == WORLD
    clean(per)
    s0 = endings(stock[0])
    assert s0
    for r in per:
        assert r["plugin"] and r["mode"] == "upstream" and r["sections"] > 5
        assert endings(r) == {rid: (at + 1, why) for rid, (at, why) in s0.items()}
        steady = r["per_pass"][1:]
        assert all(x["async"] == 0 and x["blocking"] == 1 for x in steady), steady


def test_attention_cp_x_tp_rides_the_ack_reduce_over_the_tp_group(results):
    """CP=2 x TP=2: stock reduces each reach over the CP group then the attention
    TP group; the votes ride the ack sync's one reduce over the TP group (the
    same MAX, by the span argument), two passes later, one all_reduce per pass."""
    stock = runs(results, "cp_stock", "deadline_cp_tp", world=4)
    plugin = runs(results, "cp_plugin", "deadline_cp_tp", world=4)
    clean(stock + plugin)
    s0 = endings(stock[0])
    # r0 by rank 0's deadline (pass 2), r1 by rank 3's (first check pass 1 + 1)
    assert s0 == {"r0": (2, "deadline"), "r1": (2, "deadline")}
    for s, p in zip(stock, plugin):
        assert endings(s) == s0
        assert endings(p) == {rid: (at + 2, why) for rid, (at, why) in s0.items()}
        assert p["mode"] == "ack" and p["stopped_on_verdict"] == 2
        steady = p["per_pass"][1:]
        assert steady and all(x["async"] == 1 and x["blocking"] == 0 for x in steady), steady


def test_a_walk_cut_short_past_the_slots_vetoes_the_rest_and_runs_on(results):
    """47's finding 9: a rank whose walk reaches 270 of 300 ongoing prefetches
    (past the section's 256 slots) is tolerated as below them: the positions it
    did not reach are vetoed, no collective pairs with another, and every rank
    runs on with the same verdicts."""
    per = runs(results, "plugin", "crowd_short")
    clean(per)
    assert per[0]["per_pass"] == per[1]["per_pass"]
    assert all(x["blocking"] == 0 for r in per for x in r["per_pass"][1:])


def test_walks_that_reach_another_request_past_the_slots_stop_by_name(results):
    """47's finding 9: positions past the slots are checked too: every rank
    stops, naming the position, before any verdict of that walk is used."""
    for rank, r in enumerate(runs(results, "plugin", "crowd_swapped")):
        err = r.get("error", "")
        assert "PrefetchVoteMismatch" in err and "at position 281" in err, (rank, err)
        assert "SGLang #30760" in err


def test_the_old_fallback_past_the_slots_dies_in_gloo(results):
    """Negative control: upstream's per-request reduce at the walk past the
    slots (as before): the longer walk's reduce pairs with the peer's next pass
    reduce, and the ranks die without a name."""
    fallback = results["fallback"]
    assert isinstance(fallback, RanksFailed), fallback
    assert "PrefetchVoteMismatch" not in str(fallback)
