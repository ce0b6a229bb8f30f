"""Random differential scenarios (hypothesis strategies) for
:mod:`.differential`, and how to draw a batch of them reproducibly.

What varies: arrivals (a few, or a crowd of more than 256 ongoing prefetches
whose walks reach past the section's slots), prompt lengths against the
prefetch threshold, hit answers (none, short of the threshold, late after a
deadline), read progress and final acks, deadlines per rank, aborts,
requeues, full batches and cutoffs of the walk (by arrival), the host pool
and the prefetch budget (tight or not), cold host prefixes to evict, the
depth (1, 2), every stop policy and both host memory modes.

What is held so stock's outcome is well defined on every rank: each rank's
storage reports in one order, the same on every rank (upstream's query and
sync threads reduce every answer and ack in submission order), a constant
per-rank delay apart; a walk's reach does not depend on what the batch
admitted (full passes and cutoffs by arrival pass, the same in both arms);
a requeued request's second attempt, which arrives a few passes after its
admission (and so later in the plugin's run), never competes for host pages
or budget, and meets no walk limit or abort (docs/design.md, "What the differential
run compares").
"""

from __future__ import annotations

from typing import Any

from hicache_async_ack.env import DEPTH_VAR

WORLD = 2
ACTIVE = 14  # passes with arrivals and walk events
MAX_OFFSET = 12  # the latest storage event after a submission
CROWD = (257, 320)  # ongoing prefetches of a crowd scenario


def st():
    from hypothesis import strategies

    return strategies


def request(draw, i: int, skew: list[int], arrive_max: int) -> dict:
    s = st()
    tokens = draw(s.integers(1, 8))
    arrive = draw(s.integers(0, arrive_max))
    r: dict[str, Any] = {"rid": f"r{i}", "arrive": arrive, "tokens": tokens}
    if draw(s.integers(0, 5)) == 0:
        r["budget"] = None  # no deadline
    else:
        base = draw(s.integers(1, 6))
        r["budget"] = [base + draw(s.integers(0, 2)) for _ in range(WORLD)]
    if draw(s.integers(0, 4)) == 0:
        r["hit"] = None  # the query never returns
        return r
    hit_at = draw(s.integers(0, 5))
    hit = draw(s.integers(0, tokens))
    r["hit"] = {"at": [hit_at + d for d in skew], "tokens": hit}
    at = hit_at
    progress = []
    done = 0
    for _ in range(draw(s.integers(0, 3))):
        at += draw(s.integers(0, 3))
        done = min(hit, done + draw(s.integers(1, max(1, hit))))
        progress.append([[at + d for d in skew], done])
    r["progress"] = progress
    if draw(s.integers(0, 3)):
        end = at + draw(s.integers(0, 3))
        r["finish"] = [min(end, MAX_OFFSET) + d for d in skew]
    if draw(s.integers(0, 6)) == 0:
        r["abort"] = arrive + draw(s.integers(0, 6))
    return r


def scenario_strategy(crowd: bool = False):
    s = st()

    @s.composite
    def scenario(draw) -> dict:
        mode = draw(s.sampled_from(["cache"] * 4 + ["buffer_only"]))
        policy = draw(s.sampled_from(["timeout"] * 5 + ["best_effort", "wait_complete"]))
        depth = draw(s.sampled_from([1, 2]))
        skew = [draw(s.integers(0, 2)) for _ in range(WORLD)]
        n = draw(s.integers(*CROWD)) if crowd else draw(s.integers(1, 6))
        reqs = [request(draw, i, skew, 3 if crowd else ACTIVE - 2) for i in range(n)]
        tight = draw(s.booleans())
        spec: dict[str, Any] = {
            "policy": policy,
            "host_memory_mode": mode,
            "env": {DEPTH_VAR: str(depth)},
            "host_pages": draw(s.integers(6, 24)) if tight else 4096,
            "capacity": draw(s.integers(3, 16)) if tight else 100_000,
            "threshold": draw(s.integers(1, 3)),
            "cold": [[f"cold{j}", draw(s.integers(1, 4))] for j in range(draw(s.integers(0, 3)))],
            "full": sorted(draw(s.sets(s.integers(0, ACTIVE), max_size=4))),
            "cutoff": {},
            "requests": reqs,
            "skew": skew,
        }
        for p in sorted(draw(s.sets(s.integers(0, ACTIVE), max_size=3))):
            spec["cutoff"][str(p)] = draw(s.integers(0, ACTIVE))
        if not tight and draw(s.integers(0, 3)) == 0:
            # requeues only where nothing competes and no walk limit falls on a
            # later attempt at another pass than in stock (module docstring)
            spec["full"], spec["cutoff"] = [], {}
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
    collect(scenario_strategy(), n - crowds, seed)
    if crowds:
        collect(scenario_strategy(crowd=True), crowds, seed + 1)
    for i, spec in enumerate(out):
        spec["name"] = f"seed{seed}-{i}"
    return out[:n]
