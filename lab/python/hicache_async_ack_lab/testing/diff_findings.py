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

from typing import Any

from hicache_async_ack.env import DEPTH_VAR

BASE = {"policy": "timeout", "host_pages": 64, "capacity": 1000, "threshold": 1, "passes": 16}


def req(rid: str, arrive: int, tokens: int, budget: Any, hit: Any = None, progress: Any = (),
        finish: Any = None, **extra: Any) -> dict:  # fmt: skip
    """A request with one storage script (hit: {at, tokens} or None)."""
    script: dict[str, Any] = {"hit": hit, "progress": [list(x) for x in progress]}
    if finish is not None:
        script["finish"] = finish
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
