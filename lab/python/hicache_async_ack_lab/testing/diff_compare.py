"""Stock's outcome against the plugin's, request by request, for the scenarios
of :mod:`.differential`; and the runs themselves (both arms over real gloo).

A request's outcome is everything its prefetch lifecycle did, in order, without
the passes: how it arrived, its host allocation (requested, kept), whether its
read started, what was inserted into the tree, how its accounting closed (the
end reason), whether it was revoked or retired, the retries armed, whether its
pages were evicted, its admission and the tokens it was admitted with. Beside
them, the whole run's: upstream's prefetch-outcome counters, the storage
metrics, every storage entry popped, the free host pages, the occupancy, and
what is left waiting or ongoing. The plugin may move a request's admission
later, by at most depth + 1 passes, and nothing else.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional

from hicache_async_ack.env import DEPTH_VAR, PLUGINS_VAR

TARGET = "hicache_async_ack_lab.testing.differential:run_differential"
WORLD = 2
GROUP_TIMEOUT_S = 20.0
# Timer starts are not outcomes: the plugin's walk reaches a request whose read
# stock had already seen complete (its acks are drained a pass later).
NOT_OUTCOMES = ("polled",)
# The scheduler's side of a request's end: an abort that reaches the plugin's run
# while the request still waits for its (later) admission is not a difference.
SCHEDULER_ENDS = ("aborted", "admitted", "admission")
SCHEDULER_EVENTS = ("arrived", "aborted")
# Not the pops: a provisional start the plugin revoked still had its query
# answered (upstream's query thread answers a terminated operation too).
RUN_KEYS = ("stats", "metrics", "free_pages", "occupied", "waiting", "ongoing")


def lifecycle(result: dict) -> dict:
    """Per request (rid, attempt): its events without passes, in order; the
    scheduler's own (arrived, aborted) first: they happen at the same pass in
    both runs, where the cache's lag behind them in the plugin's."""
    out: dict = {}
    for _, key, kind, detail in result["events"]:
        if kind in NOT_OUTCOMES:
            continue
        out.setdefault(json.dumps(key), []).append([kind, detail])
    return {k: sorted(v, key=lambda e: e[0] not in SCHEDULER_EVENTS) for k, v in out.items()}


def passes_of(result: dict, kind: str) -> dict:
    return {json.dumps(k): at for at, k, what, _ in result["events"] if what == kind}


def admissions(result: dict) -> dict:
    return passes_of(result, "admitted")


def raced(stock: dict, plugin: dict, late_ok) -> set:
    """Requests stock admitted that the plugin's run saw aborted while they still
    waited for an admission it may make later (``late_ok``): the abort raced it."""
    admitted, aborted = admissions(stock), passes_of(plugin, "aborted")
    stock_aborted = passes_of(stock, "aborted")
    return {
        k for k, at in aborted.items()
        if k in admitted and k not in stock_aborted and late_ok(k, admitted[k], at)
    }  # fmt: skip


def depth_of(spec: dict) -> int:
    return int(spec.get("env", {}).get(DEPTH_VAR, "1"))


def differences(spec: dict, stock: list, plugin: list) -> list[str]:
    """What differs between the arms (every rank of each), in words; [] if none."""
    name = spec["name"]
    found: list[str] = []
    for arm, ranks in (("stock", stock), ("plugin", plugin)):
        for rank, res in enumerate(ranks):
            if "error" in res[name]:
                found.append(
                    f"{arm} rank {rank} failed at pass {res[name]['error_pass']}: "
                    f"{res[name]['error']}"
                )
    if found:
        return found
    if not all(r[name]["plugin"] for r in plugin) or any(r[name]["plugin"] for r in stock):
        return ["the arms did not run as labelled (plugin loaded where it should not be)"]
    most = depth_of(spec) + 1
    for rank in range(len(stock)):
        s, p = stock[rank][name], plugin[rank][name]
        ls, lp = lifecycle(s), lifecycle(p)
        late_ok = lateness(spec, s, p, most)
        for key in raced(s, p, late_ok):
            ls[key] = [e for e in ls[key] if e[0] not in SCHEDULER_ENDS]
            lp[key] = [e for e in lp[key] if e[0] not in SCHEDULER_ENDS]
        found += compare_requests(rank, ls, lp)
        for key in RUN_KEYS:
            if s[key] != p[key]:
                found.append(f"rank {rank}: {key}: stock {s[key]} != plugin {p[key]}")
        found += compare_shifts(rank, admissions(s), admissions(p), late_ok)
    for arm, ranks in (("stock", stock), ("plugin", plugin)):
        first = lifecycle(ranks[0][name])
        for rank in range(1, len(ranks)):
            if lifecycle(ranks[rank][name]) != first:
                found.append(f"{arm}: rank {rank}'s lifecycle differs from rank 0's (diverged)")
    return found


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


def lateness(spec: dict, stock: dict, plugin: dict, most: int):
    """``late_ok(key, stock_pass, plugin_pass)``: whether the plugin's run may do at
    ``plugin_pass`` what stock did at ``stock_pass`` for that request: counted from
    the request's arrival in each run (a requeued attempt arrives later in the
    plugin's), at most ``most`` passes later, or later where the walk could not
    reach it in the passes between (a full batch, or a cutoff at or before its
    arrival)."""
    s_arr, p_arr = passes_of(stock, "arrived"), passes_of(plugin, "arrived")
    full = set(spec.get("full", ()))
    cutoff = {int(q): a for q, a in spec.get("cutoff", {}).items()}

    def blocked(key: str, q: int) -> bool:
        return q in full or (q in cutoff and p_arr.get(key, -1) >= cutoff[q])

    def late_ok(key: str, s_at: int, p_at: int) -> bool:
        expected = p_arr.get(key, 0) + s_at - s_arr.get(key, 0)
        return p_at >= expected and all(blocked(key, q) for q in range(expected + most, p_at))

    return late_ok


def compare_shifts(rank: int, s: dict, p: dict, late_ok) -> list[str]:
    """The plugin admits at most depth + 1 passes after stock, and later only
    where its walk could not reach the request in the passes between."""
    return [
        f"rank {rank}: request {k} admitted at pass {p[k]}, stock at {s[k]} "
        "(allowed: depth + 1 later, or later where the walk could not reach it)"
        for k in sorted(set(s) & set(p))
        if not late_ok(k, s[k], p[k])
    ]


def jobs(specs: list[dict], timeout_s: float = 600.0) -> list:
    from hicache_async_ack.tools.ranks import Job

    def job(label: str, rank_env: dict) -> Job:
        return Job(
            target=TARGET,
            world_size=WORLD,
            payload={"specs": specs, "group_timeout_s": GROUP_TIMEOUT_S},
            timeout_s=timeout_s,
            label=label,
            group_timeout_s=GROUP_TIMEOUT_S,
            rank_env=rank_env,
        )

    stock_env = {r: {PLUGINS_VAR: "hicache_async_ack_stock_arm"} for r in range(WORLD)}
    return [job("differential, plugin", {}), job("differential, stock", stock_env)]


def run_arms(specs: list[dict], timeout_s: float = 600.0) -> tuple[list, list]:
    """Both arms over real gloo (TP=2); (stock ranks, plugin ranks)."""
    from hicache_async_ack.tools.ranks import RanksFailed, run_fresh

    plugin, stock = run_fresh(jobs(specs, timeout_s))
    for ranks in (plugin, stock):
        if isinstance(ranks, RanksFailed):
            raise ranks
    return stock, plugin


def judge(specs: Iterable[dict], stock: list, plugin: list) -> list[tuple[dict, list[str]]]:
    """(spec, differences) for every scenario that differs."""
    return [(spec, d) for spec in specs if (d := differences(spec, stock, plugin))]


def coverage(specs: Iterable[dict], stock: list, plugin: list) -> dict:
    """What the scenarios exercised (rank 0): the plugin's held decisions, and
    stock's lifecycle events, summed."""
    out: dict = {}
    for spec in specs:
        p, s = plugin[0][spec["name"]], stock[0][spec["name"]]
        for k, v in p.get("votes", {}).items():
            out[k] = out.get(k, 0) + v
        for _, _, kind, detail in s.get("events", []):
            partial = kind == "alloc" and detail[1] not in (None, detail[0])
            key = "partial alloc" if partial else kind
            if key in ("evicted", "partial alloc", "aborted", "retry", "admitted", "inserted"):
                out[key] = out.get(key, 0) + 1
            if kind == "finish" and detail[1]:
                out[f"end {detail[1]}"] = out.get(f"end {detail[1]}", 0) + 1
    return dict(sorted(out.items()))


def replay_text(spec: dict, diffs: list[str], limit: Optional[int] = 6) -> str:
    shown = diffs if limit is None else diffs[:limit]
    more = "" if limit is None or len(diffs) <= limit else f"\n  ... {len(diffs) - limit} more"
    return (
        f"scenario {spec['name']}:\n  " + "\n  ".join(shown) + more + "\n"
        "replay it: hicache-async-ack-lab differential --replay FILE, with FILE holding:\n"
        + json.dumps(spec)
    )
