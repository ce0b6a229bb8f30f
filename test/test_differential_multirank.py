"""Stock SGLang against the plugin, request by request, over real gloo (TP=2,
SGLang's real UnifiedRadixCache on the whole prefetch lifecycle of
hicache_async_ack_lab.sim.lifecycle, the plugin reached only through
load_plugins()): every request's outcome (end reason, tokens kept, pages
inserted, host allocations, evictions, retries, outcome counters, admission)
must be stock's, its admission at most depth + 1 passes later.

* Issue 43's findings, each as a scenario (testing.diff_findings): stock's
  outcome holds; with the guarantee that fixes it taken out (its negative
  control, testing.diff_controls) the same scenario differs.
* A seed set of random scenarios (testing.diff_gen, hypothesis): none differs,
  and together they exercise every path the plugin holds (stops, reaches past
  the slots, provisional starts and replayed declines, aborts, evictions).
  ``hicache-async-ack-lab differential --scenarios 2000`` runs more.

The admission check (finding 5) is test_prefetch_walk_multirank.py's.
"""

from __future__ import annotations

import pytest

from hicache_async_ack_lab.testing import diff_compare, diff_gen
from hicache_async_ack_lab.testing.diff_findings import FINDINGS, controlled

SEED, RANDOM, CROWD_EVERY = 43, 60, 30


@pytest.fixture(scope="module")
def runs():
    random = diff_gen.draw_scenarios(RANDOM, SEED, CROWD_EVERY)
    specs = FINDINGS + [controlled(s) for s in FINDINGS] + random
    stock, plugin = diff_compare.run_arms(specs, timeout_s=900.0)
    return {"specs": specs, "random": random, "stock": stock, "plugin": plugin}


def differences(runs, spec) -> list[str]:
    return diff_compare.differences(spec, runs["stock"], runs["plugin"])


@pytest.mark.parametrize("spec", FINDINGS, ids=[s["name"] for s in FINDINGS])
def test_each_finding_holds_as_stocks_outcome(runs, spec):
    assert differences(runs, spec) == []
    assert runs["plugin"][0][spec["name"]]["votes"]["sections"] > 5  # the votes ran


@pytest.mark.parametrize("spec", FINDINGS, ids=[s["name"] for s in FINDINGS])
def test_each_finding_differs_without_its_guarantee(runs, spec):
    """The negative controls: the comparison catches the plugin as it was."""
    assert differences(runs, controlled(spec)) != []


def test_a_crowd_past_the_slots_ends_every_deadline_as_stock(runs):
    """Finding 1: 2000 ongoing, reached at their first pass and at their deadline
    only: every one ends by deadline, as in stock (the reaches past the 256 slots
    on SGLang's own per-request reduce, counted)."""
    name = "f1_crowd_2000"
    votes = runs["plugin"][0][name]["votes"]
    assert votes["stopped"] == 2000 and votes["fallbacks"] == 2 * (2000 - 256)
    stock = runs["stock"][0][name]
    assert stock["metrics"] == {} and not stock["ongoing"] and not stock["waiting"]


def test_random_scenarios_match_stock_and_exercise_every_held_path(runs):
    random = runs["random"]
    assert len(random) == RANDOM
    bad = diff_compare.judge(random, runs["stock"], runs["plugin"])
    assert bad == [], diff_compare.replay_text(*bad[0])
    seen = diff_compare.coverage(random, runs["stock"], runs["plugin"])
    for what in ("stopped", "fallbacks", "provisional", "declined", "aborted", "end deadline"):
        assert seen.get(what, 0) > 0, (what, seen)


def test_the_comparison_sees_a_difference_in_one_request(runs):
    """Negative control of the comparison itself: one event of one request
    changed in the plugin's record is named."""
    import copy

    spec = FINDINGS[3]
    plugin = copy.deepcopy(runs["plugin"])
    events = plugin[1][spec["name"]]["events"]
    at = next(i for i, e in enumerate(events) if e[2] == "inserted")
    events[at][3] = [events[at][3][0] + 1]
    found = diff_compare.differences(spec, runs["stock"], plugin)
    assert any("rank 1: request" in d and "inserted" in d for d in found), found
