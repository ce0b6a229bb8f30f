"""The contract's hard clauses, checked per differential scenario on the
records of both arms (:mod:`.differential`): none may fail, whatever the walk
was limited by.

* **Agreement**: no rank failed; every rank of an arm did the same thing to
  every request (the plugin's decisions are the group's).
* **Liveness**: every reach the plugin's walk noted got the group's verdict
  within depth + 1 passes (by the plugin's own pass count).
* **Resources**, never more than stock, decision by decision: no work
  started where stock's own rule says no on the state at hand (a prefetch or
  an L3 probe past the limiter, a read or a host allocation for an operation
  already ended); collectives cumulative, pass by pass over the passes both
  arms ran, never more than stock's (the plugin's one-time first exchange
  aside); host locks left at the end never more;
  a pin held one pass at most; where the walk was not limited, every prefetch
  kept its budget and its read at most depth + 1 passes longer than stock's
  (where it was, liveness bounds each decision from the plugin's own reach);
  and the plugin's own state empty once the run is idle (nothing grows with
  the run). Run totals (L3 queries, reads, allocations) are equal where the
  walk was not limited (an exact outcome); where it was, they move with the
  timing like the outcomes and are reported, both directions (:func:`totals`).
"""

from __future__ import annotations

import json
from typing import Any

from hicache_async_ack_lab.testing.diff_records import depth_of, ends, lifecycle, limited_by


def agreement(spec: dict, arms: dict) -> list[str]:
    name, out = spec["name"], []
    expected = spec.get("expect_error")
    for arm, ranks in arms.items():
        for rank, res in enumerate(ranks):
            err = res[name].get("error")
            if err and not (expected and arm == "plugin" and expected in err):
                out.append(f"agreement: {arm} rank {rank} failed at pass "
                           f"{res[name]['error_pass']}: {err}")  # fmt: skip
            if expected and arm == "plugin" and not err:
                out.append(f"agreement: plugin rank {rank} did not stop with {expected!r}")
    if out or expected:
        return out
    for arm, ranks in arms.items():
        first = lifecycle(ranks[0][name])
        for rank in range(1, len(ranks)):
            if lifecycle(ranks[rank][name]) != first:
                out.append(f"agreement: {arm} rank {rank}'s lifecycle differs from rank 0's")
    return out


def liveness(spec: dict, res: dict, rank: int) -> list[str]:
    """Match every reach with its verdict (both in walk order, intervals in order)."""
    most = depth_of(spec) + 1
    reaches = [f for k, f in res["plugin_events"] if k == "reach"]
    verdicts = [f for k, f in res["plugin_events"] if k == "verdict"]
    out = []
    for i, r in enumerate(reaches):
        if i >= len(verdicts):
            if r["pass_no"] + most <= res["last_pass"] and "error" not in res:
                out.append(f"liveness: rank {rank}: the reach of {r['key']} at pass "
                           f"{r['pass_no']} got no verdict by pass {res['last_pass']}")  # fmt: skip
            break
        v = verdicts[i]
        if v["key"] != r["key"]:
            out.append(f"liveness: rank {rank}: verdict #{i} is for {v['key']}, reach {r['key']}")
            break
        if v["pass_no"] - r["pass_no"] > most:
            out.append(
                f"liveness: rank {rank}: {r['key']} reached at pass {r['pass_no']}, "
                f"decided at {v['pass_no']} (more than depth + 1 = {most} later)"
            )
    return out


def allocations(res: dict) -> tuple[int, int]:
    """(allocations that got pages, pages allocated)."""
    got = [e[3] for e in res["events"] if e[2] == "alloc" and e[3][1] is not None]
    return len(got), sum(d[1] for d in got)


def cumulative(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        total += c
        out.append(total)
    return out


def pins(res: dict) -> list[str]:
    """Every pin released by the next pass boundary (or the run ended first)."""
    held: dict = {}
    out = []
    for kind, f in res["plugin_events"]:
        key = json.dumps(f.get("key"))
        if kind == "pin":
            held[key] = f["pass_no"]
        elif kind == "unpin" and key in held:
            taken = held.pop(key)
            if f["pass_no"] - taken > 1:
                out.append(f"a pin on {key} taken at pass {taken} held to {f['pass_no']}")
    return out + [f"a pin on {k} taken at pass {p} never released" for k, p in held.items()
                  if p < res["last_pass"]]  # fmt: skip


def lags(spec: dict, s: dict, p: dict, rank: int) -> list[str]:
    """Budget and read held at most depth + 1 passes past stock, per operation
    that started at the same pass and ended the same way in both arms, where
    the walk was not limited (where it was, the plugin's walk may reach a
    request at another pass than stock's: liveness bounds its decision from
    that reach)."""
    if limited_by(spec, s, p):
        return []
    end_s, end_p = ends(s), ends(p)
    most = depth_of(spec) + 1
    out = []
    for key, s_ops in s["ops"].items():
        p_ops = p["ops"].get(key, [])
        if end_s.get(key) != end_p.get(key):
            continue
        for a, b in zip(s_ops, p_ops):
            if a["started"] != b["started"]:
                break
            for what in ("released", "terminated"):
                if what in a and b.get(what, p["last_pass"] + 1) - a[what] > most:
                    out.append(
                        f"resources: rank {rank}: {key}'s prefetch {what} at pass "
                        f"{b.get(what)}, stock at {a[what]} (more than {most} later)"
                    )
    return out


def resources(spec: dict, s: dict, p: dict, rank: int) -> list[str]:
    out = [
        f"resources: rank {rank}: {arm}: {what} ({n})"
        for arm, r in (("plugin", p), ("stock", s))
        for what, n in r["bypassed"].items()
    ]
    if p["host_locks"] > s["host_locks"]:
        out.append(f"resources: rank {rank}: host locks left: plugin {p['host_locks']} > "
                   f"stock {s['host_locks']}")  # fmt: skip
    # the plugin's one-time first exchange (the group agreeing on the protocol) aside
    cs, cp = cumulative(s["collectives"]), [c - 1 for c in cumulative(p["collectives"])]
    over = [i for i in range(min(len(cs), len(cp))) if cp[i] > cs[i]]
    if over:
        i = over[0]
        out.append(f"resources: rank {rank}: collectives by pass {i}: plugin {cp[i]} > "
                   f"stock {cs[i]}")  # fmt: skip
    out += [f"resources: rank {rank}: {m}" for m in pins(p)]
    out += lags(spec, s, p, rank)
    if "live_operations" in p:  # what a walk's ballot keeps until it is read
        most = s["live_operations"] + depth_of(spec) + 2
        if p["live_operations"] > most:
            out.append(f"resources: rank {rank}: memory: {p['live_operations']} prefetch "
                       f"operations alive, stock {s['live_operations']}")  # fmt: skip
    state = p.get("state") or {}
    if p.get("idle") and any(state.values()):
        out.append(f"resources: rank {rank}: the plugin still holds {state} once idle")
    return out


def hard_violations(spec: dict, stock: list, plugin: list) -> list[str]:
    """Every hard clause that fails for ``spec`` ([] if none)."""
    name = spec["name"]
    found = agreement(spec, {"stock": stock, "plugin": plugin})
    if found or spec.get("expect_error"):
        return found
    if not all(r[name]["plugin"] for r in plugin) or any(r[name]["plugin"] for r in stock):
        return ["the arms did not run as labelled (plugin loaded where it should not be)"]
    for rank in range(len(stock)):
        s, p = stock[rank][name], plugin[rank][name]
        found += liveness(spec, p, rank)
        found += resources(spec, s, p, rank)
    return found


def totals(specs: list, stock: list, plugin: list) -> dict[str, Any]:
    """Rank 0's resource totals over ``specs``, per arm."""
    out: dict[str, Any] = {}
    for arm, ranks in (("stock", stock), ("plugin", plugin)):
        t = {"L3 queries": 0, "reads": 0, "allocations": 0, "pages": 0, "collectives": 0,
             "locks left": 0}  # fmt: skip
        for spec in specs:
            r = ranks[0][spec["name"]]
            if "error" in r:
                continue
            n, pages = allocations(r)
            t["L3 queries"] += r["l3_queries"]
            t["reads"] += r["reads"]
            t["allocations"] += n
            t["pages"] += pages
            t["collectives"] += sum(r["collectives"])
            t["locks left"] += r["host_locks"]
        out[arm] = t
    return out
