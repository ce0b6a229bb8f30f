"""Random differential scenarios (hypothesis strategies) for
:mod:`.differential`, and how to draw a batch of them reproducibly.

What varies: the node (a prefill scheduler's walk, or a PD decode node's
prealloc and transfer queue), arrivals (a few, or a crowd of more than 256
ongoing prefetches), prompt lengths against the prefetch threshold, prefixes
shared by a family of requests, hit answers (none, short, slow: up to a dozen
passes, as a busy query thread answers), read progress and final acks, one
script per submission (a storage retry submits again), deadlines per rank,
aborts, requeues, the walk's limits (by arrival: full passes and cutoffs; or
by what it admitted: the running requests allowed, a token budget that a
request's extend may not fit), storage retries (interval, attempts), the host
pool and the prefetch budget (tight or not), cold host prefixes to evict, the
depth (1, 2), every stop policy and both host memory modes.

What is held so stock's outcome is well defined on every rank: each rank's
storage reports in one order, the same on every rank (upstream's query and
sync threads reduce every answer and ack in submission order), a constant
per-rank delay apart; a requeued request's second attempt never competes for
host pages or budget and meets no walk limit or abort.
"""

from __future__ import annotations

from typing import Any

from hicache_async_ack.env import DEPTH_VAR

WORLD = 2
ACTIVE = 14  # passes with arrivals and walk events
MAX_OFFSET = 16  # the latest storage event after a submission
CROWD = (280, 360)  # requests of a crowd scenario (most of them ongoing at once)


def st():
    from hypothesis import strategies

    return strategies


def script(draw, tokens: int, skew: list[int], slow: bool) -> dict:
    s = st()
    if draw(s.integers(0, 4)) == 0:
        return {"hit": None}  # the query never returns
    hit_at = draw(s.integers(0, 12 if slow else 5))
    hit = draw(s.integers(0, tokens))
    out: dict[str, Any] = {"hit": {"at": [hit_at + d for d in skew], "tokens": hit}}
    at, done, progress = hit_at, 0, []
    for _ in range(draw(s.integers(0, 3))):
        at += draw(s.integers(0, 3))
        done = min(hit, done + draw(s.integers(1, max(1, hit))))
        progress.append([[at + d for d in skew], done])
    out["progress"] = progress
    if draw(s.integers(0, 3)):
        end = at + draw(s.integers(0, 3))
        out["finish"] = [min(end, MAX_OFFSET) + d for d in skew]
    return out


def request(draw, i: int, skew: list[int], arrive_max: int, families: int) -> dict:
    s = st()
    tokens = draw(s.integers(1, 8))
    arrive = draw(s.integers(0, arrive_max))
    r: dict[str, Any] = {"rid": f"r{i}", "arrive": arrive, "tokens": tokens,
                         "decode": draw(s.integers(0, 4))}  # fmt: skip
    if families and draw(s.booleans()):
        r["family"] = [draw(s.integers(0, families - 1)), draw(s.integers(1, tokens))]
    if draw(s.integers(0, 5)) == 0:
        r["budget"] = None  # no deadline
    else:
        base = draw(s.integers(1, 6))
        r["budget"] = [base + draw(s.integers(0, 2)) for _ in range(WORLD)]
    slow = draw(s.integers(0, 3)) == 0
    r["scripts"] = [script(draw, tokens, skew, slow) for _ in range(draw(s.integers(1, 2)))]
    if draw(s.integers(0, 6)) == 0:
        r["abort"] = arrive + draw(s.integers(0, 6))
    return r


def crowd_requests(seed: int, n: int, skew: list[int]) -> list[dict]:
    """A crowd's requests, from a seeded generator (drawing hundreds of requests
    through hypothesis overruns its buffer): the same kinds as :func:`request`,
    every one arriving in the first passes."""
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


def limits(draw, style: str) -> dict:
    s = st()
    if style == "arrival":
        out: dict[str, Any] = {"full": sorted(draw(s.sets(s.integers(0, ACTIVE), max_size=4)))}
        at = sorted(draw(s.sets(s.integers(0, ACTIVE), max_size=3)))
        out["cutoff"] = {str(p): draw(s.integers(0, ACTIVE)) for p in at}
        return out
    if style == "admission":
        return {"running": draw(s.integers(1, 4)), "tokens": draw(s.integers(2, 16))}
    return {}


def scenario_strategy(crowd: bool = False):
    s = st()

    @s.composite
    def scenario(draw) -> dict:
        decode = not crowd and draw(s.integers(0, 9)) == 0
        mode = "cache" if decode else draw(s.sampled_from(["cache"] * 4 + ["buffer_only"]))
        policy = draw(s.sampled_from(["timeout"] * 5 + ["best_effort", "wait_complete"]))
        depth = draw(s.sampled_from([1, 2]))
        skew = [draw(s.integers(0, 2)) for _ in range(WORLD)]
        if crowd:
            reqs = crowd_requests(draw(s.integers(0, 1 << 30)), draw(s.integers(*CROWD)), skew)
        else:
            families = draw(s.integers(0, 2))
            n = draw(s.integers(1, 8))
            reqs = [request(draw, i, skew, ACTIVE - 2, families) for i in range(n)]
        tight = draw(s.booleans())
        style = "none" if decode else draw(s.sampled_from(["arrival", "admission", "none"]))
        spec: dict[str, Any] = {
            "mode": "decode" if decode else "prefill",
            "policy": policy,
            "host_memory_mode": mode,
            "env": {DEPTH_VAR: str(depth)},
            "host_pages": draw(s.integers(6, 24)) if tight else 4096,
            "capacity": draw(s.integers(3, 16)) if tight else 100_000,
            "threshold": draw(s.integers(1, 3)),
            "cold": [[f"cold{j}", draw(s.integers(1, 4))] for j in range(draw(s.integers(0, 3)))],
            "limits": limits(draw, style),
            "requests": reqs,
            "skew": skew,
            "exposed": draw(s.booleans()),
        }
        if draw(s.booleans()):
            spec["retry"] = {"interval": draw(s.sampled_from([0, 1, 1, 2, 2, 4, 8])),
                             "attempts": draw(s.integers(1, 8))}  # fmt: skip
        if not tight and not decode and style != "admission" and draw(s.integers(0, 3)) == 0:
            # requeues only where nothing competes and no walk limit falls on a
            # later attempt at another pass than in stock (module docstring)
            spec["limits"] = {}
            for r in reqs:
                r.pop("abort", None)  # an abort at a fixed pass would meet another attempt
                if draw(s.booleans()):
                    r["requeue"] = draw(s.integers(0, 3))
        spec["passes"] = ACTIVE + MAX_OFFSET + 3 * (depth + 2) + max(skew) + 8
        return spec

    return scenario()


def draw_scenarios(n: int, seed: int, crowd_every: int = 0) -> list[dict]:
    """``n`` scenarios drawn by hypothesis from ``seed`` (the same every time);
    every ``crowd_every``-th one a crowd (more than 256 ongoing)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    out: list[dict] = []

    def collect(strategy, count: int, at: int) -> None:
        @settings(
            max_examples=count,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            deadline=None,
        )
        @seeded(at)
        @given(strategy)
        def take(spec):
            out.append(spec)

        take()

    crowds = n // crowd_every if crowd_every else 0
    for crowd, want, first in ((False, n - crowds, seed), (True, n, seed + 1)):
        rounds = 0
        while len(out) < want:  # hypothesis may stop a round short: draw on
            collect(scenario_strategy(crowd), want - len(out), first + 2 * rounds)
            rounds += 1
        del out[want:]
    for i, spec in enumerate(out):
        spec["name"] = f"seed{seed}-{i}"
    return out[:n]
