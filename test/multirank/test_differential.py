"""Stock SGLang against the plugin over real gloo (TP=2, some random scenarios at 3
or 4), SGLang 0.5.23's real UnifiedRadixCache driven through its own scheduling
code (Scheduler._add_request_to_queue / _prefetch_kvcache, _process_hicache_events
and the storage retries, calc_priority, a real PrefillAdder, real Req objects) on
the prefetch lifecycle of hicache_async_ack_lab.sim.lifecycle and the stand-in tree
core of sim.host_tree; the plugin reached only through load_plugins().

* The contract's hard clauses (testing.diff_checks) hold in every scenario:
  agreement, liveness, resources (no work where stock's rule says no; collectives,
  locks, L3 queries, reads and host allocations never more than stock's; pins one
  pass; budget and reads at most depth + 1 passes longer; nothing left once idle)
  and, with host matching, a request stock served from the host admitted with as
  many cached tokens at most depth + 1 passes later.
* Where the walk was not limited by what it admitted, every outcome is stock's.
* Issue 43's findings keep stock's outcome; issue 47's hold under the contract;
  issue 52's items 2 and 3 (which failed on the runtime of 7c82482) hold, read once
  reads a shared prefix once and serves a waiting request within its bound; a held
  start's request is admitted within its bound, a storage re-attach keeps the
  contract. Each check has a negative control.
* A seed set of random scenarios (testing.diff_gen); ``hicache-async-ack-lab
  differential --scenarios 2000`` runs more.

Walks that diverge past the slots (47's finding 9) and the admission check
(43's finding 5) are test_prefetch_walk.py's.
"""

from __future__ import annotations

import copy
import json
import time

import pytest

from hicache_async_ack_lab.testing import (
    diff_checks,
    diff_compare,
    diff_gen,
    diff_items,
    diff_records,
)
from hicache_async_ack_lab.testing.diff_findings import (
    CHAINED,
    FINDINGS,
    HELD_LATE,
    NO_WAIT,
    READ_ONCE,
    REATTACH,
    SHARED_PREFIX,
    UNDER_LOAD,
    VOTES_OFF_FINDINGS,
    WAIT_BOUND,
    controlled,
)
from hicache_async_ack_lab.testing.diff_records import depth_of

SEED, RANDOM = 52, 30
NEGATIVE = [s for s in FINDINGS + UNDER_LOAD if s["negative"]]
ISSUE_52 = (SHARED_PREFIX + READ_ONCE + WAIT_BOUND + NO_WAIT + VOTES_OFF_FINDINGS + HELD_LATE
            + CHAINED + REATTACH)  # fmt: skip
BY_NAME = {s["name"]: s for s in FINDINGS + UNDER_LOAD + ISSUE_52}


@pytest.fixture(scope="module")
def runs():
    random = diff_gen.draw_scenarios(RANDOM, SEED)
    specs = FINDINGS + UNDER_LOAD + [controlled(s) for s in NEGATIVE] + ISSUE_52 + random
    t0 = time.monotonic()
    stock, plugin = diff_compare.run_arms(specs, timeout_s=1200.0)
    print(f"differential: {len(specs)} scenarios ({RANDOM} random, seed {SEED}) in "
          f"{time.monotonic() - t0:.0f} s")  # fmt: skip
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


# Issue 52 ---------------------------------------------------------------------------


def newcomers(runs, spec) -> dict:
    """Per newcomer stock served from the cache: (stock's, the plugin's) admission
    as (pass, L3 tokens, cached prefix, host-loaded tokens), the plugin's None if
    it never admitted it."""
    s = diff_checks.admitted(arm(runs, "stock", spec["name"]))
    p = diff_checks.admitted(arm(runs, "plugin", spec["name"]))
    return {k: (v, p.get(k)) for k, v in s.items() if v[2] > 0 and json.loads(k)[0][0] == "B"}


@pytest.mark.parametrize("spec", SHARED_PREFIX, ids=[s["name"] for s in SHARED_PREFIX])
def test_a_shared_prefix_costs_no_more_than_stock(runs, spec):
    """Item 2: A's read lands depth + 1 passes after stock's (a deadline cut, or the
    ack sync's late pop of its completion); newcomers sharing its first 4 tokens
    arrive in between. Stock matches those 4 on the host and asks L3 for nothing
    more; the plugin must not ask more (before the fix: L3 queries 1 -> 2, host
    pages 8 -> 14 with one newcomer, 1 -> 7 and 8 -> 44 with six; on a 16-page
    pool five lose their allocation into storage retries), and each newcomer is
    admitted with stock's cached tokens at most depth + 1 passes after stock."""
    s, p = (diff_checks.spent(arm(runs, a, spec["name"])) for a in ("stock", "plugin"))
    served = newcomers(runs, spec)
    assert served, "stock served the newcomers from the host"
    for what in diff_checks.SPENT:
        assert p[what] <= s[what], (what, s, p)
    most = depth_of(spec) + 1
    for key, (a, b) in served.items():
        assert b is not None and b[2] >= a[2] and b[0] - a[0] <= most, (key, a, b)
    assert differences(runs, spec) == []


@pytest.mark.parametrize("spec", READ_ONCE, ids=[s["name"] for s in READ_ONCE])
def test_read_once_reads_a_shared_prefix_once(runs, spec):
    """Read once: the newcomers arrive while A's read is in flight in stock too,
    so stock reads the shared prefix again for each; read once waits for A's read
    to land, then matches it on the host: fewer L3 keys than stock (fewer queries
    where the rest is too short to ask for), and the resource clauses."""
    s, p = (diff_checks.spent(arm(runs, a, spec["name"])) for a in ("stock", "plugin"))
    assert p["keys_read"] < s["keys_read"], (s, p)
    if spec["threshold"] > 2:  # the newcomers' 2 own tokens are not asked for
        assert p["l3_queries"] < s["l3_queries"], (s, p)
    assert diff_checks.overspent(spec, arm(runs, "stock", spec["name"]),
                                 arm(runs, "plugin", spec["name"])) == []  # fmt: skip


@pytest.mark.parametrize("spec", READ_ONCE, ids=[s["name"] for s in READ_ONCE])
def test_read_once_serves_a_newcomer_as_stock_does(runs, spec):
    """The host-served clause under read once: each newcomer stock served from the
    cache is admitted with at least stock's cached tokens, at most depth + 1 passes
    after stock (every hard clause holds)."""
    assert diff_checks.hard_violations(spec, runs["stock"], runs["plugin"]) == []


# The bound: the waiting request's start runs again at most one pass after the read it
# waited on left the plugin's run (landed, cut, aborted or failed); from there it is
# admitted within its own read's script (at most 4 passes here), depth + 1 passes for
# the decisions on it, and the passes its walk was blocked (full).
OWN_READ = 4


@pytest.mark.parametrize("spec", WAIT_BOUND, ids=[s["name"] for s in WAIT_BOUND])
def test_a_request_waiting_on_a_read_is_served_within_the_bound(runs, spec):
    name = spec["name"]
    p = arm(runs, "plugin", name)
    holds = [(k, f) for k, f in p["plugin_events"] if k in ("hold", "release")]
    assert [k for k, _ in holds] == ["hold", "release"], holds
    hold, release = holds[0][1], holds[1][1]
    assert hold["why"] == "read_once" and hold["awaits"] == ["A", 0]
    awaited = p["ops"]['["A", 0]'][0]
    assert release["at"] <= awaited["released"] + 1, (release, awaited)
    admitted = diff_checks.admitted(p)
    assert '["B", 0]' in admitted, "B was served"
    limits = spec.get("limits", {})
    cutoff = {int(q): a for q, a in limits.get("cutoff", {}).items()}
    arrived = next(r["arrive"] for r in spec["requests"] if r["rid"] == "B")
    blocked = sum(1 for q in range(release["at"], p["last_pass"] + 1)
                  if q in limits.get("full", ()) or cutoff.get(q, 1 << 30) <= arrived)  # fmt: skip
    bound = release["at"] + OWN_READ + depth_of(spec) + 1 + blocked
    assert admitted['["B", 0]'][0] <= bound, (admitted['["B", 0]'], bound)
    s = arm(runs, "stock", name)
    assert diff_checks.overspent(spec, s, p) == [] or diff_compare.limited_by(spec, s, p)


@pytest.mark.parametrize("spec", NO_WAIT, ids=[s["name"] for s in NO_WAIT])
def test_read_once_never_waits_on_a_read_that_may_never_end(runs, spec):
    """Under wait_complete a read ends only when it completes: A's never does. B does
    not wait on it (a pass hold at most) and is served as stock's B, its own read."""
    name = spec["name"]
    p, s = arm(runs, "plugin", name), arm(runs, "stock", name)
    holds = [f for k, f in p["plugin_events"] if k == "hold"]
    assert holds, "B's start met A's read in flight"
    assert [f["why"] for f in holds] == ["pass"], holds
    admitted_s, admitted_p = diff_checks.admitted(s), diff_checks.admitted(p)
    assert '["B", 0]' in admitted_s
    assert admitted_p.get('["B", 0]', (None,))[1:3] == admitted_s['["B", 0]'][1:3]
    assert diff_checks.hard_violations(spec, runs["stock"], runs["plugin"]) == []


@pytest.mark.parametrize("spec", CHAINED, ids=[s["name"] for s in CHAINED])
def test_a_hold_behind_a_late_read_still_matches_what_stock_matched(runs, spec):
    """A's start was held, so its read lands two passes after stock's; B, arriving
    after stock's landing, is held that much longer and matches A's pages as stock's
    B did: no L3 read of its own, every hard clause holds."""
    name = spec["name"]
    p = arm(runs, "plugin", name)
    hold = next(f for k, f in p["plugin_events"] if k == "hold" and f["key"] == ["B", 0])
    assert hold["longer"] == 2, hold
    assert diff_checks.admitted(p)['["B", 0]'][1:3] == (0, 4)  # nothing from L3, 4 cached
    assert diff_checks.hard_violations(spec, runs["stock"], runs["plugin"]) == []


@pytest.mark.parametrize("spec", VOTES_OFF_FINDINGS, ids=[s["name"] for s in VOTES_OFF_FINDINGS])
def test_the_votes_off_are_stocks_storage_path(runs, spec):
    """Item 3: SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_VOTES=0 keeps upstream's
    per-request reduce in the walk; the ack sync must not pop the completions
    depth passes late under it: collectives never above stock's, pass by pass
    (before the fix: a reach more per pass for each completion popped late), and
    no deadline judged on staler progress (before the fix, at depth 2, a request
    stock keeps with 4 tokens is admitted with 0): outcomes exactly stock's."""
    assert limited(runs, spec["name"]) == []
    assert differences(runs, spec) == []


def test_the_issue_52_findings_are_what_the_issue_says(runs):
    """The scenarios reach the paths they name, whatever the plugin does: stock
    serves the newcomers from the host with A's 4 tokens, reads the prefix again
    when they arrive during A's read, and keeps r0's 4 tokens at depth 2."""
    for spec in SHARED_PREFIX:
        served = newcomers(runs, spec)
        assert served and all(a[2] == 4 for a, _ in served.values()), served
        assert diff_checks.spent(arm(runs, "stock", spec["name"]))["l3_queries"] == 1
    for spec in READ_ONCE:
        assert diff_checks.spent(arm(runs, "stock", spec["name"]))["l3_queries"] > 1
    kept = diff_checks.admitted(arm(runs, "stock", "v_deadline_on_stale_progress"))
    assert kept['["r0", 0]'][1] == 4


@pytest.mark.parametrize("spec", HELD_LATE, ids=[s["name"] for s in HELD_LATE])
def test_a_held_start_is_admitted_within_its_bound(runs, spec):
    """B's remainder is covered by A's read in flight from the same anchor: its start
    is held until its interval's decisions land (at most depth passes), then its own
    read's deadline is judged and lands depth + 1 passes after its reach. Stock cuts B
    at pass 4 with 2 tokens: the plugin cuts it with as many, admitted at most
    2 depth + 1 passes later (docs/design.md, "The bound on a held start")."""
    p = arm(runs, "plugin", spec["name"])
    assert any(k == "hold" for k, _ in p["plugin_events"])  # the path it names
    assert differences(runs, spec) == []


@pytest.mark.parametrize("spec", REATTACH, ids=[s["name"] for s in REATTACH])
def test_a_storage_reattach_keeps_the_contract(runs, spec):
    """The operator detaches the storage backend and attaches it again (SGLang does it
    only while idle); the requests that arrive after it are reached by every walk.
    Every reach gets its verdict within depth + 1 passes, collectives stay at or below
    stock's pass by pass, and the outcomes are stock's."""
    assert diff_records.operator(arm(runs, "plugin", spec["name"]))  # it ran
    assert differences(runs, spec) == []


# The random seed set --------------------------------------------------------------


def test_random_scenarios_hold_the_contract(runs):
    random = runs["random"]
    assert len(random) == RANDOM
    bad = diff_compare.judge(random, runs["stock"], runs["plugin"])
    assert bad == [], diff_compare.replay_text(*bad[0])


CORE_ITEMS = (
    "host match (admitted with host tokens)", "shared prefix in flight at arrival",
    "order lpm", "order dfs-weight", "order priority", "retraction from decode",
    "abort prefetching", "abort running", "page size > 1", "failed query", "failed read",
    "TP=3", "TP=4", "read once on", "votes off",
)  # fmt: skip


def test_random_scenarios_exercise_every_path(runs):
    random = runs["random"]
    seen = diff_compare.coverage(random, runs["stock"], runs["plugin"])
    for what in ("stop", "pin", "aborted", "end deadline", "probe", "limit batch_full",
                 "limit token_budget", "limit declined_rate_limited", "retry"):  # fmt: skip
        assert seen.get(what, 0) > 0, (what, seen)
    items = diff_items.exercised(random, runs["stock"], runs["plugin"])
    assert [i for i in CORE_ITEMS if items[i] == 0] == [], items
    # the PD decode transfer queue, evictions and partial allocations: the findings
    findings = diff_compare.coverage(FINDINGS + UNDER_LOAD, runs["stock"], runs["plugin"])
    for what in ("loaded_back", "evicted", "partial alloc", "inserted"):
        assert findings.get(what, 0) > 0, (what, findings)
    moves = diff_compare.outcome_moves(random, runs["stock"], runs["plugin"])
    assert moves["limited scenarios"] > 0 and moves["same"] > 0


# Negative controls of the checks ------------------------------------------------------


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


def later(r: dict) -> None:
    """The plugin's admission of the newcomer stock served from the host (B: A's 4
    pages, its own 2 too short to read), five passes later."""
    at = next(i for i, e in enumerate(r["events"]) if e[2] == "admitted" and e[1][0] == "B")
    r["events"][at][0] += 5


PAST = {"a prefetch started past the limiter": 1}


@pytest.mark.parametrize("name, tamper, said", [
    ("f2_finish_after_deadline", lambda r: r["bypassed"].update(PAST), "past the limiter"),
    ("f2_finish_after_deadline", lambda r: r["plugin_events"].__setitem__(
        slice(None), [e for e in r["plugin_events"] if e[0] != "verdict"]), "no verdict"),
    ("f2_finish_after_deadline", lambda r: r["collectives"].__setitem__(0, 10 ** 6),
     "collectives by pass"),
    ("f2_finish_after_deadline", lambda r: r.update(host_locks=r["host_locks"] + 1),
     "host locks left"),
    ("f2_finish_after_deadline", lambda r: r["state"].update(pins=1), "still holds"),
    ("f2_finish_after_deadline", lambda r: r.update(l3_queries=r["l3_queries"] + 1),
     "l3_queries: plugin 2 > stock 1"),
    ("f2_finish_after_deadline", lambda r: r.update(reads=r["reads"] + 1), "reads: plugin"),
    ("f4_stop_pages_pinned", lambda r: r["events"].append(
        [9, ["z", 0], "alloc", [4, 4]]), "pages: plugin"),
    ("i2_cut_one_newcomer", later, "host-served"),
    ("r1_in_flight_one_newcomer", lambda r: r.update(keys_read=10 ** 6), "keys_read"),
    ("w_awaited_cut", lambda r: [f.update(at=f["at"] + 3) for k, f in r["plugin_events"]
                                 if k == "release"], "released at pass"),
])  # fmt: skip
def test_the_hard_checks_see_each_violation(runs, name, tamper, said):
    """Negative controls of the hard checks: each clause, broken in the plugin's
    record of one scenario (on every rank, so agreement holds), is named."""
    spec = BY_NAME[name]
    plugin = copy.deepcopy(runs["plugin"])
    for rank in (0, 1):
        tamper(plugin[rank][name])
    found = diff_checks.hard_violations(spec, runs["stock"], plugin)
    assert any(said in d for d in found), found
