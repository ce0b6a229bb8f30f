"""Random differential scenarios for :mod:`.differential`, each drawn from its
own seeded generator (uniform draws, the same every time for a seed and an index).

What varies: the node (a prefill scheduler's walk, or a PD decode node's
prealloc and transfer queue), the TP size (2, sometimes 3 or 4), arrivals (a
few, a crowd of more than 256 ongoing prefetches, or the issue-52 workload: a
system prompt read by one request while others sharing it arrive), prompt
lengths against the prefetch threshold, prefixes shared by a family (they match
what another one's prefetch inserted, or a prefix resident on the device, backed
on the host or not), hit answers (none, short, slow: up to a dozen passes),
read progress and final acks, failed queries and reads, one script per
submission (a storage retry submits again), deadlines per rank, the queue order
(fcfs, lpm, dfs-weight, priority), aborts of waiting, prefetching and running
requests, retractions from decode, requeues, device pressure, the operator's
flush (idle, or paused with requests waiting), storage detach and attach between
bursts, the walk's limits (by arrival: full passes and cutoffs; or by what it
admitted: the running requests allowed, a prefill token budget), storage retries
(interval, attempts), the host pool and the prefetch budget (tight or not), cold
host prefixes to evict, the page size (1, 2, 4) and a sidecar pool, the depth
(1 to 8, auto), the votes' and read once's settings, every stop policy and both
host memory modes (buffer_only at page size 1).

What is held so stock's outcome is well defined on every rank: each rank's
storage reports in one order, the same on every rank (upstream's query and sync
threads reduce every answer and ack in submission order), a constant per-rank
delay apart; a requeued request's second attempt never competes for host pages
or budget and meets no walk limit or abort.
"""

from __future__ import annotations

from typing import Any

from hicache_async_ack.env import DEPTH_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.testing.diff_records import READ_ONCE_VAR

WORLD = 2
ACTIVE = 14  # passes with arrivals and walk events
MAX_OFFSET = 16  # the latest storage event after a submission
CROWD = (280, 360)  # requests of a crowd scenario (most of them ongoing at once)
GAP = 6  # passes after the active ones where the operator acts (then a second burst)
DEPTHS = ["1"] * 4 + ["2"] * 3 + ["3", "4", "5", "6", "7", "8", "auto", "auto"]
ORDERS = ["fcfs"] * 3 + ["lpm", "lpm", "dfs-weight", "dfs-weight", "priority", "priority"]


class Draws:
    """The draws a scenario makes, from ``random.Random(seed)``."""

    def __init__(self, seed: int):
        import random

        self.rng = random.Random(seed)

    def integers(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def booleans(self) -> bool:
        return self.rng.random() < 0.5

    def sampled_from(self, values: list) -> Any:
        return self.rng.choice(values)

    def sets(self, lo: int, hi: int, max_size: int, min_size: int = 0) -> set:
        k = min(self.integers(min_size, max_size), hi - lo + 1)
        return set(self.rng.sample(range(lo, hi + 1), k))


def script(draw: Draws, tokens: int, skew: list[int], slow: bool, ps: int = 1) -> dict:
    if draw.integers(0, 4) == 0:
        return {"hit": None}  # the query never returns
    hit_at = draw.integers(0, 12 if slow else 5)
    hit = draw.integers(0, tokens // ps) * ps
    out: dict[str, Any] = {"hit": {"at": [hit_at + d for d in skew], "tokens": hit}}
    error = draw.sampled_from([None] * 8 + ["query", "read"])
    cap = hit if error != "read" else draw.integers(0, max(0, hit - 1))
    at, done, progress = hit_at, 0, []
    for _ in range(0 if error == "query" else draw.integers(0, 3)):
        at += draw.integers(0, 3)
        done = min(cap, done + draw.integers(1, max(1, hit)))
        progress.append([[at + d for d in skew], done])
    out["progress"] = progress
    if error == "read" or draw.integers(0, 3):
        end = at + draw.integers(0, 3)
        out["finish"] = [min(end, MAX_OFFSET) + d for d in skew]
    if error is not None:
        out["error"] = error
    return out


def request(draw: Draws, i: int, skew: list[int], arrive_max: int, families: int, ps: int = 1,
            arrive_min: int = 0, family: Any = None) -> dict:  # fmt: skip
    pages = draw.integers(1, 8)
    tokens = pages * ps + (draw.integers(0, ps - 1) if ps > 1 else 0)
    arrive = draw.integers(arrive_min, arrive_max)
    r: dict[str, Any] = {"rid": f"r{i}", "arrive": arrive, "tokens": tokens,
                         "decode": draw.integers(0, 4)}  # fmt: skip
    if family is not None:
        r["family"] = family
        r["tokens"] = max(tokens, family[1])
    elif families and draw.booleans():
        r["family"] = [draw.integers(0, families - 1), draw.integers(1, pages) * ps]
    if draw.integers(0, 5) == 0:
        r["budget"] = None  # no deadline
    else:
        base = draw.integers(1, 6)
        r["budget"] = [base + draw.integers(0, 2) for _ in skew]
    slow = draw.integers(0, 3) == 0
    r["scripts"] = [script(draw, r["tokens"], skew, slow, ps)
                    for _ in range(draw.integers(1, 2))]  # fmt: skip
    if draw.integers(0, 6) == 0:
        r["abort"] = arrive + draw.integers(0, 8)
    if draw.integers(0, 7) == 0:
        r["retract"] = arrive + draw.integers(1, 8)
    return r


def burst(draw: Draws, first: int, skew: list[int], ps: int, family: int, at: int) -> list[dict]:
    """Issue 52's workload: a leader reads a system prompt from L3; requests
    sharing it arrive while that read is in flight (or just after it landed)."""
    shared = draw.integers(1, 6) * ps
    out = [request(draw, first, skew, at, 0, ps, arrive_min=at, family=[family, shared])]
    lead = out[0]
    lead["scripts"][0] = script(draw, lead["tokens"], skew, False, ps)
    for j in range(draw.integers(1, 6)):
        r = request(draw, first + 1 + j, skew, at + 5, 0, ps, arrive_min=at + 1,
                    family=[family, shared])  # fmt: skip
        out.append(r)
    return out


def crowd_requests(seed: int, n: int, skew: list[int]) -> list[dict]:
    """A crowd's requests, from their own seeded generator: the same kinds as
    :func:`request`, every one arriving in the first passes."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = rng.randint(1, 8)
        r: dict[str, Any] = {"rid": f"r{i}", "arrive": rng.randint(0, 3), "tokens": tokens,
                             "decode": rng.randint(0, 4)}  # fmt: skip
        r["budget"] = None if rng.randint(0, 5) == 0 else [rng.randint(2, 8)] * WORLD
        if rng.randint(0, 3):  # a slow store: most of the crowd waits on its query
            r["scripts"] = [{"hit": None}]
        else:
            at, hit = rng.randint(0, 5), rng.randint(0, tokens)
            done = rng.randint(0, hit)
            r["scripts"] = [{"hit": {"at": [at + d for d in skew], "tokens": hit},
                             "progress": [[[at + 1 + d for d in skew], done]],
                             "finish": [at + 2 + d for d in skew]}]  # fmt: skip
        if rng.randint(0, 6) == 0:
            r["abort"] = r["arrive"] + rng.randint(0, 6)
        out.append(r)
    return out


def limits(draw: Draws, style: str, ps: int = 1) -> dict:
    if style == "arrival":
        out: dict[str, Any] = {"full": sorted(draw.sets(0, ACTIVE, max_size=4))}
        at = sorted(draw.sets(0, ACTIVE, max_size=3))
        out["cutoff"] = {str(p): draw.integers(0, ACTIVE) for p in at}
        return out
    if style == "admission":
        return {"running": draw.integers(1, 4), "tokens": draw.integers(2, 16) * ps}
    return {}


def operator(draw: Draws, reqs: list[dict], skew: list[int], ps: int, families: int) -> list:
    """The operator's flush / detach / attach between two bursts (SGLang runs them
    once the scheduler is idle), or a flush of a paused engine (requests waiting)."""
    what = draw.sampled_from(["flush", "detach", "paused_flush"])
    at = ACTIVE + GAP
    if what == "paused_flush":
        return [[draw.integers(2, ACTIVE), "paused_flush"]]
    n = len(reqs)
    for j in range(draw.integers(1, 4)):
        reqs.append(request(draw, n + j, skew, at + 8, families, ps, arrive_min=at + 3))
    return [[at, "flush"]] if what == "flush" else [[at, "detach"], [at + 2, "attach"]]


def scenario(draw: Draws, crowd: bool = False) -> dict:
    """One scenario's spec (a crowd: more than 256 ongoing prefetches)."""
    decode = not crowd and draw.integers(0, 11) == 0
    world = WORLD if crowd else draw.sampled_from([WORLD] * 6 + [3, 4])
    ps = 1 if crowd or decode else draw.sampled_from([1, 1, 1, 2, 4])
    buffer = not decode and ps == 1 and draw.integers(0, 4) == 0
    policy = draw.sampled_from(["timeout"] * 5 + ["best_effort", "wait_complete"])
    depth = "1" if crowd else draw.sampled_from(DEPTHS)
    env = {DEPTH_VAR: depth}
    if not crowd and draw.integers(0, 5) == 0:
        env[PREFETCH_VOTES_VAR] = "0"
    if not crowd and draw.integers(0, 3) == 0:
        env[READ_ONCE_VAR] = "1"
    skew = [draw.integers(0, 2) for _ in range(world)]
    families = 0
    if crowd:
        reqs = crowd_requests(draw.integers(0, 1 << 30), draw.integers(*CROWD), skew)
    else:
        families = draw.integers(0, 2)
        reqs = []
        if not decode and draw.booleans():
            reqs = burst(draw, 0, skew, ps, families, draw.integers(0, ACTIVE - 8))
            families += 1
        for i in range(len(reqs), len(reqs) + draw.integers(0 if reqs else 1, 6)):
            reqs.append(request(draw, i, skew, ACTIVE - 2, families, ps))
    tight = draw.booleans()
    style = "none" if decode else draw.sampled_from(["arrival", "admission", "none"])
    spec: dict[str, Any] = {
        "mode": "decode" if decode else "prefill",
        "world": world,
        "policy": policy,
        "host_memory_mode": "buffer_only" if buffer else "cache",
        "env": env,
        "page_size": ps,
        "host_pages": draw.integers(6, 24) if tight else 4096,
        "capacity": draw.integers(3, 16) * ps if tight else 100_000,
        "threshold": draw.integers(1, 3) * (ps if draw.booleans() else 1),
        "cold": [[f"cold{j}", draw.integers(1, 4)] for j in range(draw.integers(0, 3))],
        "limits": limits(draw, style, ps),
        "requests": reqs,
        "skew": skew,
        "exposed": draw.booleans(),
    }
    if not crowd and not decode:
        spec["order"] = draw.sampled_from(ORDERS)
        if spec["order"] == "priority":
            for r in reqs:
                r["priority"] = draw.integers(0, 3)
        if ps > 1 and draw.booleans():
            spec["sidecar"] = True
        if families and draw.integers(0, 2) == 0:
            spec["warm"] = [[f"warm{f}", f, draw.integers(1, 4) * ps, draw.booleans()]
                            for f in range(families)]  # fmt: skip
        if draw.integers(0, 3) == 0:
            at = sorted(draw.sets(1, ACTIVE, max_size=3, min_size=1))
            spec["evict_device"] = {str(p): draw.integers(1, 8) * ps for p in at}
    if decode:
        for r in reqs:
            r.pop("retract", None)
    if draw.booleans():
        spec["retry"] = {"interval": draw.sampled_from([0, 1, 1, 2, 2, 4, 8]),
                         "attempts": draw.integers(1, 8)}  # fmt: skip
    if not crowd and not decode and draw.integers(0, 4) == 0:
        spec["admin"] = operator(draw, reqs, skew, ps, families)
    elif not tight and not decode and style != "admission" and draw.integers(0, 3) == 0:
        # requeues only where nothing competes and no walk limit falls on a
        # later attempt at another pass than in stock (module docstring)
        spec["limits"] = {}
        for r in reqs:
            r.pop("abort", None)  # an abort at a fixed pass would meet another attempt
            r.pop("retract", None)
            if draw.booleans():
                r["requeue"] = draw.integers(0, 3)
    d = 2 if depth == "auto" else int(depth)
    extra = ACTIVE + GAP if spec.get("admin") else 0
    spec["passes"] = ACTIVE + MAX_OFFSET + 3 * (d + 2) + max(skew) + 8 + extra
    return spec


def draw_scenarios(n: int, seed: int, crowd_every: int = 0) -> list[dict]:
    """``n`` scenarios, the i-th drawn from its own generator seeded by ``seed``
    and i (the same every time); every ``crowd_every``-th one a crowd (more than
    256 ongoing)."""
    out = []
    for i in range(n):
        crowd = bool(crowd_every) and i % crowd_every == crowd_every - 1
        spec = scenario(Draws(seed * 1_000_003 + i), crowd)
        spec["name"] = f"seed{seed}-{i}"
        out.append(spec)
    return out
