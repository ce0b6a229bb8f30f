"""Issue 43's and issue 47's findings as differential scenarios
(:mod:`.differential`), each with what must hold and, where one exists, the
negative control that takes the guarantee out (:mod:`.diff_controls`).

``FINDINGS`` (issue 43): outcomes exactly stock's; with the control, they differ.
``UNDER_LOAD`` (issue 47): the contract's hard clauses hold (agreement,
liveness, resources); where the walk or the limiter was limited the outcome is
counted as moved, not required equal. The admission check (43's finding 5) and
walks that diverge past the slots (47's finding 9) are multi-rank tests of
their own.
"""

from __future__ import annotations

import json
from typing import Any

from hicache_async_ack.env import DEPTH_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.testing.diff_records import READ_ONCE_VAR

BASE = {"policy": "timeout", "host_pages": 64, "capacity": 1000, "threshold": 1, "passes": 16}


def req(rid: str, arrive: int, tokens: int, budget: Any, hit: Any = None, progress: Any = (),
        finish: Any = None, error: Any = None, **extra: Any) -> dict:  # fmt: skip
    """A request with one storage script (hit: {at, tokens} or None)."""
    script: dict[str, Any] = {"hit": hit, "progress": [list(x) for x in progress]}
    if finish is not None:
        script["finish"] = finish
    if error is not None:
        script["error"] = error
    return {"rid": rid, "arrive": arrive, "tokens": tokens, "budget": budget,
            "scripts": [script], **extra}  # fmt: skip


def one(name: str, negative: list, *requests: dict, **extra: Any) -> dict:
    return {**BASE, "name": name, "negative": negative, "requests": list(requests), **extra}


def controlled(spec: dict) -> dict:
    """``spec`` with its negative control applied to the plugin arm."""
    return {**spec, "name": spec["name"] + "_control", "control": spec["negative"]}


def crowd(n: int) -> dict:
    """43's finding 1: more ongoing prefetches than the section has slots, their
    queries never answered; the walk reaches them at their first pass, at their
    deadline, then from the pass the plugin's verdicts land: stock ends every
    one by deadline there and admits it."""
    reqs = [req(f"q{i:04d}", 0, 2, [3, 3]) for i in range(n)]
    return {**BASE, "name": f"f1_crowd_{n}", "negative": ["drop_overflow"], "requests": reqs,
            "limits": {"full": [1, 2, 4]}, "passes": 10, "capacity": 100_000}  # fmt: skip


HIT4 = {"at": [0, 0], "tokens": 4}
FINDINGS = [
    crowd(257),
    crowd(300),
    crowd(2000),
    # 2: the read finishes one pass after the deadline: stock keeps 2 of 4 tokens
    one("f2_finish_after_deadline", ["after_pops"],
        req("r0", 0, 4, [3, 3], HIT4, [[[1, 1], 1], [[2, 2], 2], [[4, 4], 4]], [4, 4])),
    # 2: progress 1, 2, then 3 after the deadline: stock keeps 2
    one("f2_progress_after_deadline", ["after_pops"],
        req("r0", 0, 4, [3, 3], HIT4, [[[1, 1], 1], [[2, 2], 2], [[4, 4], 3]])),
    # 2: all KV landed by the deadline pass (the final ack, a sidecar read, still
    # pending): stock's exemption lets the read finish
    one("f2_kv_landed_exemption", ["no_exemption"],
        req("r0", 0, 4, [2, 2], HIT4, [[[2, 2], 4]], [6, 6])),
    # 3: the hit answers after the deadline: stock allocates nothing for it
    one("f3_hit_after_deadline", ["after_pops"],
        req("r0", 0, 4, [2, 2], {"at": [3, 3], "tokens": 4}, [[[5, 5], 4]], [5, 5])),
    # 4: a stop inserts 2 pages; the next boundary's hit needs more host pages than
    # are free: stock's admission holds the stopped request's pages, so the hit
    # gets what is free (a partial allocation), evicting nothing of it
    one("f4_stop_pages_pinned", ["no_pins"],
        req("x", 0, 4, [2, 2], HIT4, [[[1, 1], 2]], [9, 9]),
        req("y", 1, 4, None, {"at": [2, 2], "tokens": 4}, [[[4, 4], 4]], [4, 4]),
        host_pages=6, exposed=True),
]  # fmt: skip


def decode_cut(name: str, n: int, negative: list) -> dict:
    """47's finding 1: ``n`` PD decode prefetches cut by their deadline after 2
    of 4 pages landed; each stop inserts 2 pages, which the transfer queue
    loads back; the tree's pages are evictable afterwards (``final_evict``)."""
    reqs = [req(f"d{i}", 0, 4, [3, 3], HIT4, [[[1, 1], 2]]) for i in range(n)]
    return {**BASE, "name": name, "mode": "decode", "negative": negative, "requests": reqs,
            "exposed": True, "passes": 12, "final_evict": True}  # fmt: skip


UNDER_LOAD = [
    decode_cut("u1_decode_pins_released", 8, ["unbounded_pins"]),
    # 3: the budget is held by a prefetch stock ends at its deadline; ten
    # newcomers arrive: stock starts one (1 L3 query), the plugin none until
    # the stop lands (it never starts what its limiter refuses)
    one("u3_budget_held_newcomers", [],
        req("r0", 0, 4, [2, 2]),
        *[req(f"n{i}", 3, 4, [9, 9], {"at": [1, 1], "tokens": 4}, [[[2, 2], 4]], [2, 2])
          for i in range(10)],
        capacity=4, retry={"interval": 8, "attempts": 8}, passes=30),
    # 3: a slow query (12 passes) under a held budget, with upstream's default retries
    one("u3_slow_query_retries", [],
        req("r0", 0, 4, [2, 2]),
        req("r1", 2, 4, [30, 30], {"at": [12, 12], "tokens": 4}, [[[13, 13], 4]], [13, 13]),
        capacity=4, retry={"interval": 8, "attempts": 8}, passes=40),
    # 43's finding 3 at depth 1 and 2: a newcomer on a budget stock had freed
    one("f3_budget_freed", [],
        req("r0", 0, 4, [2, 2]),
        req("r1", 3, 4, [9, 9], {"at": [1, 1], "tokens": 4}, [[[2, 2], 4]], [2, 2]),
        capacity=4),
    one("f3_budget_depth_2", [],
        req("r0", 0, 4, [2, 3]),
        req("r1", 1, 3, [9, 9]),
        req("r2", 3, 4, [9, 9], {"at": [1, 1], "tokens": 4}, [[[2, 2], 4]], [2, 2]),
        capacity=5, env={DEPTH_VAR: "2"}),
    # 4: a PD decode probe while stops stock made are in flight: the held budget
    # answers 0 (no L3 query) until they land, then stock's answer
    one("u4_decode_probe_held_budget", [],
        req("d0", 0, 4, [2, 2], HIT4),
        req("d1", 3, 4, [9, 9], HIT4, [[[1, 1], 4]], [1, 1]),
        req("d2", 8, 4, [9, 9], HIT4, [[[1, 1], 4]], [1, 1]),
        mode="decode", capacity=4, passes=20),
    # 6: a prefetch holds the budget for the whole run; a newcomer arrives every
    # pass and is declined (admitted without one): nothing of them is kept
    one("u6_declined_every_pass", [],
        req("r0", 0, 4, None),
        *[req(f"n{i:03d}", 1 + i, 4, None, HIT4) for i in range(300)],
        capacity=4, passes=302, count_live=True),
    # 7: an abort of a waiting request whose reach is not yet decided: retired
    # in the abort's pass, as stock does
    one("u7_abort_at_once", [],
        req("r0", 0, 4, [9, 9], HIT4, [[[1, 1], 2]], abort=3),
        req("r1", 0, 4, [9, 9], HIT4, [[[1, 1], 4]], [1, 1])),
    # 8: a stop's pages, then refused admissions (the requests ahead of it take
    # the token budget, one a pass: NO_TOKEN for its extend); the pin goes at the
    # next boundary, where stock's pages were evictable from the refusal on
    one("u8_pin_refused_admission", ["unbounded_pins"],
        *[req(f"a{i}", 0, 4, None, {"at": [2 + i, 2 + i], "tokens": 0}) for i in range(6)],
        req("big", 1, 8, [2, 2], {"at": [0, 0], "tokens": 8}, [[[1, 1], 2]], [30, 30]),
        limits={"tokens": 6, "running": 8}, host_pages=24, exposed=True, passes=30),
]  # fmt: skip


# Issue 52: shared prefixes. A holds 8 tokens in L3; its read gets 4 of them by
# pass 1 and its deadline cuts it at pass 3 (stock inserts those 4 pages there,
# in the walk); B is A's first 4 tokens and 2 of its own (threshold 3: stock,
# matching A's 4 on the host, leaves a remainder too short to ask L3 for).
SYS = [0, 4]  # family 0, 4 shared tokens: the system prompt
A8 = {"at": [0, 0], "tokens": 8}
B6 = {"at": [1, 1], "tokens": 6}


def newcomer(rid: str, arrive: int, **extra: Any) -> dict:
    return req(rid, arrive, 6, None, B6, [[[2, 2], 6]], [4, 4], family=SYS, **extra)


def shared(name: str, *requests: dict, **extra: Any) -> dict:
    return one(name, [], *requests, threshold=3, **extra)


A_CUT = req("A", 0, 8, [3, 3], A8, [[[1, 1], 4]], family=[0, 8])
A_DONE = req("A", 0, 8, None, A8, [[[1, 1], 8]], [2, 2], family=[0, 8])
SHARED_PREFIX = [
    # item 2: one newcomer between stock's cut (pass 3) and the plugin's landing
    # (pass 5): L3 queries 1 -> 2, host pages 8 -> 14 today
    shared("i2_cut_one_newcomer", A_CUT, newcomer("B", 4)),
    # six of them: queries 1 -> 7, pages 8 -> 44 today
    shared("i2_cut_six_newcomers", A_CUT, *[newcomer(f"B{i}", 4) for i in range(6)]),
    # the same on a 16-page host pool: the newcomers' reads take the pages they
    # cannot all have; those that lose their allocation go into storage retries
    shared("i2_cut_six_newcomers_16_pages", A_CUT,
           *[newcomer(f"B{i}", 4) for i in range(6)],
           host_pages=16, retry={"interval": 2, "attempts": 4}, passes=24),
    # the ack sync's own late pop: A completes (its final ack at pass 2, popped
    # there by stock, a pass later by the plugin); B arrives at pass 3
    shared("i2_done_one_newcomer", A_DONE, newcomer("B", 3)),
]  # fmt: skip

READ_ONCE_ON = {READ_ONCE_VAR: "1"}
# Read once: the newcomers arrive while A's read is in flight in stock too (stock
# reads the shared prefix again for each; read once waits for A's read to land).
READ_ONCE = [
    shared("r1_in_flight_one_newcomer", A_CUT, newcomer("B", 1), env=READ_ONCE_ON),
    shared("r1_in_flight_six_newcomers", A_CUT, *[newcomer(f"B{i}", 1) for i in range(6)],
           env=READ_ONCE_ON),
    shared("r1_in_flight_six_newcomers_16_pages", A_CUT,
           *[newcomer(f"B{i}", 1) for i in range(6)],
           host_pages=16, retry={"interval": 2, "attempts": 4}, passes=24, env=READ_ONCE_ON),
    shared("r1_done_in_flight", A_DONE, newcomer("B", 1), env=READ_ONCE_ON),
    # threshold 1: the newcomer's own 2 tokens are asked for too (a query each, as
    # stock's), but the shared 4 are read once
    one("r1_in_flight_low_threshold", [], A_CUT, newcomer("B", 1), threshold=1,
        env=READ_ONCE_ON),
]  # fmt: skip

# Read once's wait bound: B waits on A's read, which then ends otherwise.
WAIT_BOUND = [
    # A is aborted while B waits: B reads from L3 itself
    shared("w_awaited_aborted", req("A", 0, 8, None, A8, [[[1, 1], 4]], abort=2, family=[0, 8]),
           newcomer("B", 1), env=READ_ONCE_ON),
    # A's deadline cuts it: B matches the 4 pages it landed
    shared("w_awaited_cut", A_CUT, newcomer("B", 1), env=READ_ONCE_ON),
    # A's read fails (its final ack with nothing read): B reads from L3 itself
    shared("w_awaited_failed",
           req("A", 0, 8, None, A8, [], [2, 2], family=[0, 8], error="read"),
           newcomer("B", 1), env=READ_ONCE_ON),
    # A lands and B matches its 4 pages (the rest too short to read), then waits
    # behind full batches (a cutoff by arrival); A finishes, device pressure leaves
    # its pages on the host only and C's hit evicts them (a 14-page pool): B's match
    # shrank, so upstream re-queries L3 for it (the device-hit-loss path)
    shared("w_awaited_evicted", {**A_DONE, "decode": 0}, newcomer("B", 1),
           req("C", 5, 8, None, {"at": [0, 0], "tokens": 8}, [[[1, 1], 8]], [1, 1]),
           host_pages=14, exposed=True, evict_device={"5": 8},
           limits={"cutoff": {str(q): 1 for q in range(3, 8)}},
           retry={"interval": 1, "attempts": 4}, env=READ_ONCE_ON),
]  # fmt: skip

# Read once waits only behind a read that ends for sure: under wait_complete a read
# ends only when it completes. A's never does; B reads its own, as stock's B.
NO_WAIT = [
    shared("w_no_wait_under_wait_complete",
           req("A", 0, 8, None, A8, [[[1, 1], 4]], family=[0, 8]),
           newcomer("B", 1), policy="wait_complete", env=READ_ONCE_ON),
]  # fmt: skip

# A held start behind a read that itself started late (read once off, depth 1): X's
# read never ends; A arrives at pass 1 covered by it, so its start is held two passes
# and its read lands two passes after stock's (at pass 3). B arrives at pass 4, where
# stock's B matches A's 4 pages (its own 2 too short to read). B's hold lasts those two
# passes longer, so it still matches them instead of reading them again from L3.
CHAINED = [
    shared("h_behind_a_late_read",
           req("X", 0, 8, None, A8, [[[1, 1], 2]], family=[0, 8]),
           req("A", 1, 8, None, A8, [[[1, 1], 8]], [2, 2], family=[0, 8]),
           newcomer("B", 4), passes=24),
]  # fmt: skip

# Item 3: the votes off (upstream's per-request reduce in the walk) while the ack sync
# pipelines, so completions are popped depth passes late.
VOTES_OFF = {PREFETCH_VOTES_VAR: "0"}
VOTES_OFF_FINDINGS = [
    # three reads complete at passes 2-4; the plugin's walk still reaches each a pass
    # (two at depth 2) after stock's saw it done: one collective more per reach
    one("v_completions_reached_late", [],
        *[req(f"r{i}", 0, 4, [30, 30], HIT4, [[[1 + i, 1 + i], 4]], [2 + i, 2 + i])
          for i in range(3)], env=VOTES_OFF),
    one("v_completions_reached_late_depth_2", [],
        *[req(f"r{i}", 0, 4, [30, 30], HIT4, [[[1 + i, 1 + i], 4]], [2 + i, 2 + i])
          for i in range(3)], env={**VOTES_OFF, DEPTH_VAR: "2"}),
    # depth 2: all 4 tokens landed by pass 1 (stock's KV-landed exemption keeps the read
    # past its deadline, admitted with 4); the plugin pops that progress at pass 3, so
    # its walk judges the deadline at pass 2 on nothing read: admitted with 0
    one("v_deadline_on_stale_progress", [],
        req("r0", 0, 4, [2, 2], HIT4, [[[1, 1], 4]], [5, 5]),
        env={**VOTES_OFF, DEPTH_VAR: "2"}),
]  # fmt: skip

# A held start adds its own depth + 1 passes: B's remainder is covered by A's read in
# flight from the same anchor, so its start waits for its interval's decisions; its own
# deadline is then judged from that later start and lands depth + 1 passes after the
# walk that reached it. Stock cuts B at pass 4 with 2 tokens; the plugin admits it about
# 2 (depth + 1) passes after that (the contract allows depth + 1).
HELD_LATE = [
    one("h_held_then_cut", [],
        req("A", 0, 8, None, A8, [[[1, 1], 2]], [12, 12], family=[0, 8]),
        req("B", 2, 8, [2, 2], A8, [[[1, 1], 2]], family=[0, 4])),
]  # fmt: skip

# The operator detaches the storage backend and attaches it again while the scheduler is
# idle (SGLang refuses either otherwise); B then waits on a query that never answers and
# is reached by every walk: every reach must get its verdict within depth + 1 passes,
# and (votes off) the switch costs no collective above stock's.
REATTACH = [
    # drawn (differential --scenarios 400, the 29th): depth 7, requests arriving after
    # the attach and reached by every walk; the reaches of a pass a few passes after the
    # attach get no verdict (the sections of the next two passes are not built)
    json.loads(
        '{"mode": "prefill", "world": 2, "policy": "timeout", "host_memory_mode": "cache", "e'
        'nv": {"SGLANG_HICACHE_ASYNC_ACK_DEPTH": "7"}, "page_size": 4, "host_pages": 17, "cap'
        'acity": 52, "threshold": 3, "cold": [["cold0", 1], ["cold1", 4], ["cold2", 2]], "lim'
        'its": {"running": 4, "tokens": 40}, "requests": [{"rid": "r0", "arrive": 6, "tokens"'
        ': 17, "decode": 1, "budget": [5, 5], "scripts": [{"hit": {"at": [1, 3], "tokens": 0}'
        ', "progress": [[[2, 4], 0], [[4, 6], 0]], "finish": [5, 7]}, {"hit": {"at": [0, 2], '
        '"tokens": 8}, "progress": [], "finish": [0, 2]}], "priority": 3}, {"rid": "r1", "arr'
        'ive": 5, "tokens": 13, "decode": 0, "family": [0, 8], "budget": [5, 5], "scripts": ['
        '{"hit": {"at": [2, 4], "tokens": 4}, "progress": [], "finish": [2, 4], "error": "que'
        'ry"}], "priority": 1}, {"rid": "r2", "arrive": 24, "tokens": 23, "decode": 4, "budge'
        't": null, "scripts": [{"hit": {"at": [0, 2], "tokens": 4}, "progress": [[[0, 2], 2]]'
        '}, {"hit": {"at": [4, 6], "tokens": 16}, "progress": [], "finish": [5, 7]}]}, {"rid"'
        ': "r3", "arrive": 27, "tokens": 34, "decode": 3, "budget": [5, 5], "scripts": [{"hit'
        '": {"at": [12, 14], "tokens": 32}, "progress": [[[12, 14], 22], [[12, 14], 32]], "fi'
        'nish": [15, 17]}, {"hit": {"at": [2, 4], "tokens": 4}, "progress": [[[2, 4], 2]], "f'
        'inish": [5, 7]}]}, {"rid": "r4", "arrive": 27, "tokens": 5, "decode": 4, "family": ['
        '0, 4], "budget": null, "scripts": [{"hit": null}], "retract": 28}, {"rid": "r5", "ar'
        'rive": 25, "tokens": 23, "decode": 2, "family": [0, 4], "budget": [8, 6], "scripts":'
        ' [{"hit": {"at": [1, 3], "tokens": 0}, "progress": []}, {"hit": {"at": [3, 5], "toke'
        'ns": 16}, "progress": [[[6, 8], 13], [[9, 11], 16]], "finish": [11, 13]}]}], "skew":'
        ' [0, 2], "exposed": true, "order": "priority", "warm": [["warm0", 0, 16, false]], "r'
        'etry": {"interval": 1, "attempts": 1}, "admin": [[20, "detach"], [22, "attach"]], "p'
        'asses": 87, "name": "d_reattach_reaches", "negative": []}'
    ),
    one("d_reattach_votes_off", [],
        req("A", 0, 4, [2, 2], HIT4, [[[1, 1], 4]], [1, 1]),
        req("B", 11, 4, [3, 3]),
        admin=[[8, "detach"], [10, "attach"]], env={DEPTH_VAR: "2", **VOTES_OFF}, passes=30),
]  # fmt: skip
