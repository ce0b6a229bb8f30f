"""Issue 43's findings as differential scenarios (:mod:`.differential`), each
with the negative control that puts the plugin back the way it was before
(:mod:`.diff_controls`): with it, the scenario differs from stock; without it,
it must not. The admission check (finding 5) is a walk scenario
(:mod:`.walk_scenarios`), in test_differential_multirank.py."""

from __future__ import annotations

from hicache_async_ack.env import DEPTH_VAR

BASE = {"policy": "timeout", "host_pages": 64, "capacity": 1000, "threshold": 1, "passes": 16}


def one(name: str, negative: list, *requests: dict, **extra) -> dict:
    return {**BASE, "name": name, "negative": negative, "requests": list(requests), **extra}


def controlled(spec: dict) -> dict:
    """``spec`` with its negative control applied to the plugin arm."""
    return {**spec, "name": spec["name"] + "_control", "control": spec["negative"]}


def crowd(n: int) -> dict:
    """Finding 1: more ongoing prefetches than the section has slots, their
    queries never answered; the walk reaches them at their first pass, at their
    deadline, then from the pass the plugin's verdicts land: stock ends every
    one by deadline there and admits it."""
    reqs = [
        {"rid": f"q{i:04d}", "arrive": 0, "tokens": 2, "budget": [3, 3], "hit": None}
        for i in range(n)
    ]
    return {**BASE, "name": f"f1_crowd_{n}", "negative": ["drop_overflow"], "requests": reqs,
            "full": [1, 2, 4], "passes": 10, "capacity": 100_000}  # fmt: skip


FINDINGS = [
    crowd(257),
    crowd(300),
    crowd(2000),
    # 2: the read finishes one pass after the deadline: stock keeps 2 of 4 tokens
    one("f2_finish_after_deadline", ["after_pops"],
        {"rid": "r0", "arrive": 0, "tokens": 4, "budget": [3, 3],
         "hit": {"at": [0, 0], "tokens": 4},
         "progress": [[[1, 1], 1], [[2, 2], 2], [[4, 4], 4]], "finish": [4, 4]}),
    # 2: progress 1, 2, then 3 after the deadline: stock keeps 2
    one("f2_progress_after_deadline", ["after_pops"],
        {"rid": "r0", "arrive": 0, "tokens": 4, "budget": [3, 3],
         "hit": {"at": [0, 0], "tokens": 4},
         "progress": [[[1, 1], 1], [[2, 2], 2], [[4, 4], 3]]}),
    # 2: all KV landed by the deadline pass (the final ack, a sidecar read, still
    # pending): stock's exemption lets the read finish
    one("f2_kv_landed_exemption", ["no_exemption"],
        {"rid": "r0", "arrive": 0, "tokens": 4, "budget": [2, 2],
         "hit": {"at": [0, 0], "tokens": 4}, "progress": [[[2, 2], 4]], "finish": [6, 6]}),
    # 3: the hit answers after the deadline: stock allocates nothing for it
    one("f3_hit_after_deadline", ["after_pops"],
        {"rid": "r0", "arrive": 0, "tokens": 4, "budget": [2, 2],
         "hit": {"at": [3, 3], "tokens": 4}, "progress": [[[5, 5], 4]], "finish": [5, 5]}),
    # 3: the budget an ended prefetch held is free for a newcomer at once in stock
    one("f3_budget_freed", ["no_provisional"],
        {"rid": "r0", "arrive": 0, "tokens": 4, "budget": [2, 2], "hit": None},
        {"rid": "r1", "arrive": 3, "tokens": 4, "budget": [9, 9],
         "hit": {"at": [1, 1], "tokens": 4}, "progress": [[[2, 2], 4]], "finish": [2, 2]},
        capacity=4),
    # 3 at depth 2, and a budget stock still refuses (the decline replayed)
    one("f3_budget_depth_2", ["no_provisional"],
        {"rid": "r0", "arrive": 0, "tokens": 4, "budget": [2, 3], "hit": None},
        {"rid": "r1", "arrive": 1, "tokens": 3, "budget": [9, 9], "hit": None},
        {"rid": "r2", "arrive": 3, "tokens": 4, "budget": [9, 9],
         "hit": {"at": [1, 1], "tokens": 4}, "progress": [[[2, 2], 4]], "finish": [2, 2]},
        capacity=5, env={DEPTH_VAR: "2"}),
    # 4: a stop inserts 2 pages; the next boundary's hit needs more host pages than
    # are free: stock's admission holds the stopped request's pages, so the hit
    # gets what is free (a partial allocation), evicting nothing of it
    one("f4_stop_pages_pinned", ["no_pins"],
        {"rid": "x", "arrive": 0, "tokens": 4, "budget": [2, 2],
         "hit": {"at": [0, 0], "tokens": 4}, "progress": [[[1, 1], 2]], "finish": [9, 9]},
        {"rid": "y", "arrive": 1, "tokens": 4, "budget": None,
         "hit": {"at": [2, 2], "tokens": 4}, "progress": [[[4, 4], 4]], "finish": [4, 4]},
        host_pages=6, exposed=True),
]  # fmt: skip
