"""Stock's run against the plugin's, for the scenarios of :mod:`.differential`; and
the runs themselves (both arms over real gloo).

Every scenario must pass the contract's hard clauses (:mod:`.diff_checks`).
Outcomes are then compared exactly where the walk was not limited by what the
batch admitted (and read once is off: it changes the reads by design): a
request's outcome is everything its prefetch lifecycle did, in order, without
the passes (arrival, L3 query, host allocation, read, insert, end reason and
tokens, revoke, retire, retries, eviction, admission and its tokens), and beside
them the run's counters, pops, free host pages, occupancy and what is left; the
plugin may move an admission later by at most depth + 1 passes, or later where
the walk could not reach the request (arrival-based limits). Where the walk
*was* limited (a token budget, a full batch, a refusal, the prefetch limiter
answering otherwise), or a scheduler event met the request in another state (an
abort, which needs no verdict and meets the cache as it is; a storage retry
coming due after a stop made depth + 1 passes later), outcomes move the way any
timing shift moves them: they are counted (:func:`outcome_moves`), not required
equal."""

from __future__ import annotations

import json
from typing import Iterable, Optional

from hicache_async_ack.env import PLUGINS_VAR
from hicache_async_ack_lab.testing.diff_checks import hard_violations
from hicache_async_ack_lab.testing.diff_records import (  # noqa: F401 (re-exported)
    RUN_KEYS,
    admissions,
    ends,
    lateness,
    lifecycle,
    limited_by,
    most_late,
    ranks_of,
    read_once,
)

TARGET = "hicache_async_ack_lab.testing.differential:run_differential"
WORLD = 2
GROUP_TIMEOUT_S = 20.0
# what the driver runs of SGLang besides the cache, imported once before the ranks fork
PRELOAD = (
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.schedule_policy",
    "sglang.srt.session.streaming_session",
    "hicache_async_ack_lab.testing.differential",
)


def compare_requests(rank: int, s: dict, p: dict) -> list[str]:
    out = []
    for key in sorted(set(s) | set(p)):
        a, b = s.get(key, []), p.get(key, [])
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(
                f"rank {rank}: request {key}: event #{at}: stock {a[at : at + 2]} != plugin "
                f"{b[at : at + 2]} (stock {a}, plugin {b})"
            )
    return out


def exact_differences(spec: dict, stock: list, plugin: list) -> list[str]:
    """Where the walk was not limited: every outcome stock's, admissions at
    most depth + 1 passes later (depth more where its start was held)."""
    name, found = spec["name"], []
    for rank, (s, p) in enumerate(zip(ranks_of(stock, name), ranks_of(plugin, name))):
        found += compare_requests(rank, lifecycle(s), lifecycle(p))
        for key in RUN_KEYS:
            if s[key] != p[key]:
                found.append(f"rank {rank}: {key}: stock {s[key]} != plugin {p[key]}")
        a_s, a_p = admissions(s), admissions(p)
        found += [
            f"rank {rank}: request {k} admitted at pass {a_p[k]}, stock at {a_s[k]} "
            "(allowed: depth + 1 later, depth more where its start was held, or later "
            "where the walk could not reach it)"
            for k in sorted(set(a_s) & set(a_p))
            if not lateness(spec, s, p, most_late(spec, p, k))(k, a_s[k], a_p[k])
        ]
    return found


def differences(spec: dict, stock: list, plugin: list) -> list[str]:
    """What fails for ``spec``: a hard clause anywhere, an outcome where the walk
    was not limited ([] if none)."""
    hard = hard_violations(spec, stock, plugin)
    if hard or spec.get("expect_error") or read_once(spec):
        return hard
    name = spec["name"]
    if limited_by(spec, stock[0][name], plugin[0][name]):
        return []
    return exact_differences(spec, stock, plugin)


def outcome_moves(specs: Iterable[dict], stock: list, plugin: list) -> dict:
    """Where the walk was limited: how requests' outcomes moved (rank 0), both
    directions: end reason, tokens admitted with, admission pass."""
    out = {"limited scenarios": 0, "requests": 0, "same": 0, "end reason": 0,
           "more tokens": 0, "fewer tokens": 0, "admitted earlier": 0,
           "admitted later": 0, "only stock admitted": 0, "only plugin admitted": 0}  # fmt: skip
    for spec in specs:
        s, p = stock[0][spec["name"]], plugin[0][spec["name"]]
        if "error" in s or "error" in p or not limited_by(spec, s, p):
            continue
        out["limited scenarios"] += 1
        end_s, end_p = ends(s), ends(p)
        tok_s = {json.dumps(k): d[0] for _, k, kind, d in s["events"] if kind == "admitted"}
        tok_p = {json.dumps(k): d[0] for _, k, kind, d in p["events"] if kind == "admitted"}
        a_s, a_p = admissions(s), admissions(p)
        for key in sorted(set(lifecycle(s)) | set(lifecycle(p))):
            out["requests"] += 1
            moved = False
            if end_s.get(key) != end_p.get(key):
                out["end reason"] += 1
                moved = True
            if key in tok_s and key in tok_p and tok_s[key] != tok_p[key]:
                out["more tokens" if tok_p[key] > tok_s[key] else "fewer tokens"] += 1
                moved = True
            if key in a_s and key in a_p and a_s[key] != a_p[key]:
                out["admitted later" if a_p[key] > a_s[key] else "admitted earlier"] += 1
                moved = True
            elif (key in a_s) != (key in a_p):
                out["only stock admitted" if key in a_s else "only plugin admitted"] += 1
                moved = True
            out["same"] += not moved
    return out


def world_of(spec: dict) -> int:
    return int(spec.get("world", WORLD))


def jobs(specs: list[dict], timeout_s: float = 600.0) -> list:
    """Per TP size the scenarios draw: the plugin's arm, then stock's."""
    from hicache_async_ack.tools import Job

    def job(label: str, world: int, part: list, rank_env: dict) -> Job:
        return Job(
            target=TARGET,
            world_size=world,
            payload={"specs": part, "group_timeout_s": GROUP_TIMEOUT_S},
            timeout_s=timeout_s * len(part) / max(1, len(specs)) + 60.0,
            label=f"{label}, TP={world}",
            group_timeout_s=GROUP_TIMEOUT_S,
            rank_env=rank_env,
        )

    out = []
    for world in sorted({world_of(s) for s in specs}):
        part = [s for s in specs if world_of(s) == world]
        stock_env = {r: {PLUGINS_VAR: "hicache_async_ack_stock_arm"} for r in range(world)}
        out += [job("differential, plugin", world, part, {}),
                job("differential, stock", world, part, stock_env)]  # fmt: skip
    return out


def run_arms(specs: list[dict], timeout_s: float = 600.0) -> tuple[list, list]:
    """Both arms over real gloo (TP=2, or the scenario's 3 or 4); (stock ranks,
    plugin ranks): per rank, its record of every scenario it took part in."""
    from hicache_async_ack.tools import RanksFailed
    from hicache_async_ack_lab.fresh import SGLANG_PRELOAD, run_fresh

    results = run_fresh(jobs(specs, timeout_s), preload=SGLANG_PRELOAD + PRELOAD)
    stock: list = []
    plugin: list = []
    for i, ranks in enumerate(results):
        if isinstance(ranks, RanksFailed):
            raise ranks
        into = plugin if i % 2 == 0 else stock
        for rank, res in enumerate(ranks):
            while len(into) <= rank:
                into.append({})
            into[rank].update(res)
    return stock, plugin


def judge(specs: Iterable[dict], stock: list, plugin: list) -> list[tuple[dict, list[str]]]:
    """(spec, differences) for every scenario that fails."""
    return [(spec, d) for spec in specs if (d := differences(spec, stock, plugin))]


def coverage(specs: Iterable[dict], stock: list, plugin: list) -> dict:
    """What the scenarios exercised (rank 0): the plugin's events, stock's
    lifecycle events and the walks' limits, summed."""
    out: dict = {}

    def add(key: str, n: int = 1) -> None:
        out[key] = out.get(key, 0) + n

    for spec in specs:
        p, s = plugin[0][spec["name"]], stock[0][spec["name"]]
        for kind, f in p.get("plugin_events", []):
            if kind in ("stop", "pin", "reach"):
                add(kind)
            if kind == "section" and f.get("overflow"):
                add("overflow reaches", f["overflow"])
        for _, _, kind, detail in s.get("events", []):
            partial = kind == "alloc" and detail[1] not in (None, detail[0])
            key = "partial alloc" if partial else kind
            if key in ("evicted", "partial alloc", "aborted", "retry", "admitted", "inserted",
                       "reissued", "probe", "loaded_back"):  # fmt: skip
                add(key)
            if kind == "inserted" and detail[1]:
                add("shared prefix")
            if kind == "finish" and detail[1]:
                add(f"end {detail[1]}")
        for lim in s.get("limits", []) + p.get("limits", []):
            add(f"limit {lim[1]}")
    return dict(sorted(out.items()))


def replay_text(spec: dict, diffs: list[str], limit: Optional[int] = 6) -> str:
    shown = diffs if limit is None else diffs[:limit]
    more = "" if limit is None or len(diffs) <= limit else f"\n  ... {len(diffs) - limit} more"
    return (
        f"scenario {spec['name']}:\n  " + "\n  ".join(shown) + more + "\n"
        "replay it: hicache-async-ack-lab differential --replay FILE, with FILE holding:\n"
        + json.dumps(spec)
    )
