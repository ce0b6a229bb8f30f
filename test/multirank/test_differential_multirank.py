"""Stock SGLang against the plugin over real gloo (TP=2, SGLang's real
UnifiedRadixCache on the whole prefetch lifecycle of
hicache_async_ack_lab.sim.lifecycle, driven as the scheduler drives it; the
plugin reached only through load_plugins()).

* The contract's hard clauses (testing.diff_checks) hold in every scenario:
  agreement, liveness (every deadline judged at a reach decided within depth
  + 1 passes), resources (no work where stock's rule says no, collectives and
  locks never more than stock's, pins one pass, budget and reads at most
  depth + 1 passes longer, nothing left once idle).
* Where the walk was not limited by what it admitted, every outcome is
  stock's (admissions at most depth + 1 passes later); where it was, outcomes
  move as a timing shift moves them and are counted.
* Issue 43's findings keep stock's outcome; issue 47's hold under the
  contract; each with its negative control where one exists.
* A seed set of random scenarios (testing.diff_gen); ``hicache-async-ack-lab
  differential --scenarios 2000`` runs more.

Walks that diverge past the slots (47's finding 9) and the admission check
(43's finding 5) are test_prefetch_walk_multirank.py's.
"""

from __future__ import annotations

import copy
import json

import pytest

from hicache_async_ack_lab.testing import diff_checks, diff_compare, diff_gen
from hicache_async_ack_lab.testing.diff_findings import FINDINGS, UNDER_LOAD, controlled

SEED, RANDOM, CROWD_EVERY = 43, 120, 40
NEGATIVE = [s for s in FINDINGS + UNDER_LOAD if s["negative"]]
BY_NAME = {s["name"]: s for s in FINDINGS + UNDER_LOAD}


@pytest.fixture(scope="module")
def runs():
    random = diff_gen.draw_scenarios(RANDOM, SEED, CROWD_EVERY)
    specs = FINDINGS + UNDER_LOAD + [controlled(s) for s in NEGATIVE] + random
    stock, plugin = diff_compare.run_arms(specs, timeout_s=1200.0)
    return {"specs": specs, "random": random, "stock": stock, "plugin": plugin}


def differences(runs, spec) -> list[str]:
    return diff_compare.differences(spec, runs["stock"], runs["plugin"])


def arm(runs, which: str, name: str, rank: int = 0) -> dict:
    return runs[which][rank][name]


def limited(runs, name: str) -> list[str]:
    return diff_compare.limited_by(
        BY_NAME[name], arm(runs, "stock", name), arm(runs, "plugin", name)
    )


@pytest.mark.parametrize("spec", FINDINGS, ids=[s["name"] for s in FINDINGS])
def test_each_finding_of_issue_43_keeps_stocks_outcome(runs, spec):
    assert differences(runs, spec) == []
    assert limited(runs, spec["name"]) == []  # compared exactly
    assert arm(runs, "plugin", spec["name"])["plugin_events"]  # the votes ran


@pytest.mark.parametrize("spec", UNDER_LOAD, ids=[s["name"] for s in UNDER_LOAD])
def test_each_finding_of_issue_47_holds_under_the_contract(runs, spec):
    assert differences(runs, spec) == []


@pytest.mark.parametrize("spec", NEGATIVE, ids=[s["name"] for s in NEGATIVE])
def test_each_finding_fails_without_its_guarantee(runs, spec):
    """The negative controls: the checks catch the plugin as it was."""
    assert differences(runs, controlled(spec)) != []


def test_a_crowd_past_the_slots_ends_every_deadline_in_a_few_exchanges(runs):
    """43's finding 1 and 47's finding 5: 2000 ongoing, reached at their first
    pass and at their deadline: every one ends by deadline as in stock, the
    reaches past the slots decided in overflow exchanges (7 a walk), where stock
    runs one reduce per reach."""
    name = "f1_crowd_2000"
    p, s = arm(runs, "plugin", name), arm(runs, "stock", name)
    stops = [f for k, f in p["plugin_events"] if k == "stop"]
    assert len(stops) == 2000
    assert s["metrics"] == {} and not s["ongoing"] and not s["waiting"]
    assert sum(p["collectives"]) * 20 < sum(s["collectives"])


def test_pd_decode_stops_leave_no_lock_behind(runs):
    """47's finding 1: eight decode prefetches cut by their deadline; the pins
    go by the next boundary, so the final eviction frees what stock's frees."""
    name = "u1_decode_pins_released"
    p, s = arm(runs, "plugin", name), arm(runs, "stock", name)
    assert p["final_evict"] == s["final_evict"] == 16
    assert p["host_locks"] == 0 and sum(k == "pin" for k, _ in p["plugin_events"]) == 8
    control = arm(runs, "plugin", name + "_control")
    assert control["final_evict"] == 0 and control["host_locks"] == 8


def test_a_held_budget_starts_nothing_stock_would_not(runs):
    """47's finding 3: never a start, probe, read or allocation past stock's
    own rule on the state at hand; the newcomers a held budget declines cost
    no L3 query (stock 2, the plugin 1: one newcomer fewer started)."""
    for name in ("u3_budget_held_newcomers", "u3_slow_query_retries", "f3_budget_freed"):
        p, s = arm(runs, "plugin", name), arm(runs, "stock", name)
        assert p["bypassed"] == s["bypassed"] == {}
        assert p["l3_queries"] <= s["l3_queries"] and p["reads"] <= s["reads"]
    assert "declined_rate_limited" in limited(runs, "u3_budget_held_newcomers")


def test_nothing_grows_with_a_run_of_declined_newcomers(runs):
    """47's finding 6: 300 passes, each declining a newcomer on a budget held
    all along: the plugin keeps no operation of theirs (it used to keep every
    refused start it had made provisionally)."""
    name = "u6_declined_every_pass"
    p, s = arm(runs, "plugin", name), arm(runs, "stock", name)
    assert p["stats"]["declined_rate_limited"] == s["stats"]["declined_rate_limited"] == 300
    assert p["live_operations"] <= s["live_operations"] + 2
    assert p["state"]["pins"] == 0 and p["state"]["reaches"] <= 1  # r0, reached each walk


def test_a_decode_probe_on_a_held_budget_answers_stocks_answer_once_the_stops_land(runs):
    """47's finding 4: while stops stock made are in flight the plugin's limiter
    still counts their reads and the probe answers 0 (no L3 query); a probe
    after they landed answers what stock's does."""
    name = "u4_decode_probe_held_budget"
    probes = {
        a: {json.dumps(e[1]): e[3][0] for e in arm(runs, a, name)["events"] if e[2] == "probe"}
        for a in ("stock", "plugin")
    }
    assert probes["stock"]['["d1", 0]'] == 4 and probes["plugin"]['["d1", 0]'] == 0
    assert probes["stock"]['["d2", 0]'] == probes["plugin"]['["d2", 0]'] == 4
    assert "probe_rate_limited" in limited(runs, name)


def test_an_abort_releases_its_prefetch_in_the_abort_pass(runs):
    """47's finding 7: an abort needs no verdict: the aborted request's prefetch
    is terminated and its budget released in the pass of the abort, as in stock."""
    name = "u7_abort_at_once"
    ops = {a: arm(runs, a, name)["ops"]['["r0", 0]'][0] for a in ("stock", "plugin")}
    assert ops["stock"]["released"] == ops["plugin"]["released"] == 3
    assert ops["plugin"]["terminated"] == 3


def test_a_refused_admission_keeps_no_pin_past_its_pass(runs):
    """47's finding 8: a pin goes at the next boundary even while the request
    is refused; its outcome moves as the refusal moved it (limited)."""
    name = "u8_pin_refused_admission"
    p = arm(runs, "plugin", name)
    assert any(k == "unpin" and f["why"] == "pass" for k, f in p["plugin_events"])
    assert "refused" in limited(runs, name)


def test_random_scenarios_hold_the_contract_and_exercise_every_path(runs):
    random = runs["random"]
    assert len(random) == RANDOM
    bad = diff_compare.judge(random, runs["stock"], runs["plugin"])
    assert bad == [], diff_compare.replay_text(*bad[0])
    seen = diff_compare.coverage(random, runs["stock"], runs["plugin"])
    for what in ("stop", "pin", "overflow reaches", "aborted", "end deadline", "probe",
                 "limit batch_full", "limit token_budget", "limit refused",
                 "limit declined_rate_limited", "retry"):  # fmt: skip
        assert seen.get(what, 0) > 0, (what, seen)
    # the PD decode transfer queue, evictions and partial allocations: the findings
    findings = diff_compare.coverage(FINDINGS + UNDER_LOAD, runs["stock"], runs["plugin"])
    for what in ("loaded_back", "evicted", "partial alloc", "inserted"):
        assert findings.get(what, 0) > 0, (what, findings)
    moves = diff_compare.outcome_moves(random, runs["stock"], runs["plugin"])
    assert moves["limited scenarios"] > 0 and moves["same"] > 0
    exact = [s for s in random if not diff_compare.limited_by(
        s, runs["stock"][0][s["name"]], runs["plugin"][0][s["name"]])]  # fmt: skip
    assert len(exact) > RANDOM // 3  # most are compared exactly


def test_the_comparison_sees_a_difference_in_one_request(runs):
    """Negative control of the exact comparison: one event of one request
    changed in the plugin's record is named."""
    spec = FINDINGS[3]
    plugin = copy.deepcopy(runs["plugin"])
    for rank in (0, 1):  # alike on both ranks (else agreement names it first)
        events = plugin[rank][spec["name"]]["events"]
        at = next(i for i, e in enumerate(events) if e[2] == "inserted")
        events[at][3] = [events[at][3][0] + 1, 0]
    found = diff_compare.differences(spec, runs["stock"], plugin)
    assert any("rank 1: request" in d and "inserted" in d for d in found), found


PAST = {"a prefetch started past the limiter": 1}


@pytest.mark.parametrize("tamper, said", [
    (lambda r: r["bypassed"].update(PAST), "past the limiter"),
    (lambda r: r["plugin_events"].__setitem__(slice(None), [e for e in r["plugin_events"]
                                                            if e[0] != "verdict"]), "no verdict"),
    (lambda r: r["collectives"].__setitem__(0, 10 ** 6), "collectives by pass"),
    (lambda r: r.update(host_locks=r["host_locks"] + 1), "host locks left"),
    (lambda r: r["state"].update(pins=1), "still holds"),
])  # fmt: skip
def test_the_hard_checks_see_each_violation(runs, tamper, said):
    """Negative controls of the hard checks: each clause, broken in the
    plugin's record of one scenario, is named."""
    spec = FINDINGS[3]
    plugin = copy.deepcopy(runs["plugin"])
    tamper(plugin[0][spec["name"]])
    found = diff_checks.hard_violations(spec, runs["stock"], plugin)
    assert any(said in d for d in found), found
