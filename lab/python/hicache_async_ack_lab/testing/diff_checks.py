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
  the run). With host matching (issue 52), per scenario where the walk was not
  limited: L3 queries, reads and host allocations (and their pages) never above
  stock's; read once on, the L3 keys read never above stock's either
  (:func:`spending`; where it was limited they move with the timing and are
  counted, :func:`overspent`).
* **Host-served** (issue 52): where the walk was not limited, a request stock
  served from the host (cached tokens from the host, or their device copy another
  request loaded back, and no L3 read of its own) is admitted with at least as many
  cached tokens, at most depth + 1 passes after stock (:func:`host_served`). A
  request with an L3 read of its own is bound by the read's decisions instead
  (liveness), depth more where its start was held.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from hicache_async_ack_lab.testing.diff_records import (
    READ_ONCE,
    depth_of,
    ends,
    held_starts,
    lateness,
    lifecycle,
    limited_by,
    most_late,
    passes_of,
    ranks_of,
    read_once,
)


def agreement(spec: dict, arms: dict) -> list[str]:
    name, out = spec["name"], []
    expected = spec.get("expect_error")
    for arm, ranks in arms.items():
        for rank, res in enumerate(ranks_of(ranks, name)):
            err = res.get("error")
            if err and not (expected and arm == "plugin" and expected in err):
                out.append(f"agreement: {arm} rank {rank} failed at pass "
                           f"{res['error_pass']}: {err}")  # fmt: skip
            if expected and arm == "plugin" and not err:
                out.append(f"agreement: plugin rank {rank} did not stop with {expected!r}")
    if out or expected:
        return out
    for arm, ranks in arms.items():
        records = ranks_of(ranks, name)
        first = lifecycle(records[0])
        for rank in range(1, len(records)):
            if lifecycle(records[rank]) != first:
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


def leaked(result: dict) -> int:
    """Host locks left at the end that no ongoing prefetch holds as its anchor."""
    return result["host_locks"] - result.get("anchored", 0)


def resources(spec: dict, s: dict, p: dict, rank: int) -> list[str]:
    out = [
        f"resources: rank {rank}: {arm}: {what} ({n})"
        for arm, r in (("plugin", p), ("stock", s))
        for what, n in r["bypassed"].items()
    ]
    left_s, left_p = leaked(s), leaked(p)
    if left_p > left_s:
        out.append(f"resources: rank {rank}: host locks left: plugin {left_p} > "
                   f"stock {left_s}")  # fmt: skip
    # the plugin's one-time first exchanges (the group agreeing on the protocol: the
    # ack counts' once, the votes' own where they ride upstream's reduce) aside
    once = 1 + sum(1 for kind, _ in p.get("plugin_events", []) if kind == "agreed")
    cs, cp = cumulative(s["collectives"]), [c - once for c in cumulative(p["collectives"])]
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


SPENT = ("l3_queries", "reads", "allocations", "pages")


def spent(result: dict) -> dict[str, int]:
    """What a run asked of L3 and the host pool: L3 queries, reads (and the keys
    they read), host allocations and their pages."""
    n, pages = allocations(result)
    return {"l3_queries": result["l3_queries"], "reads": result["reads"],
            "keys_read": result.get("keys_read", 0), "allocations": n, "pages": pages}  # fmt: skip


def spending(spec: dict, s: dict, p: dict, rank: int) -> list[str]:
    """Where the walk was not limited: L3 queries, reads, host allocations and
    pages never above stock's in the scenario (read once: the keys read too).
    Where it was, they move with the timing (:func:`overspent` counts them): a
    decision depth + 1 passes later keeps a batch full longer, and a request the
    walk reaches later may have its hit answered in between (a read stock never
    started, whose operation it had already ended)."""
    if limited_by(spec, s, p):
        return []
    return overspent(spec, s, p, rank)


def overspent(spec: dict, s: dict, p: dict, rank: int = 0) -> list[str]:
    a, b = spent(s), spent(p)
    kinds = SPENT + (("keys_read",) if read_once(spec) else ())
    return [f"resources: rank {rank}: {k}: plugin {b[k]} > stock {a[k]}" for k in kinds
            if b[k] > a[k]]  # fmt: skip


def admitted(result: dict) -> dict:
    """Per request: (pass, L3 tokens, cached prefix, host-loaded tokens) of its admission."""
    host = {json.dumps(k): d[0] for _, k, kind, d in result["events"] if kind == "host_loaded"}
    return {json.dumps(k): (at, *(d + [0])[:2], host.get(json.dumps(k), 0))
            for at, k, kind, d in result["events"] if kind == "admitted"}  # fmt: skip


def held(result: dict) -> dict[str, tuple[dict, Optional[dict]]]:
    """Per request the plugin held for read once: (its hold, its release or None)."""
    out: dict[str, tuple[dict, Optional[dict]]] = {}
    for kind, f in result.get("plugin_events", []):
        key = json.dumps(f.get("key"))
        if kind == "hold" and f.get("why") == READ_ONCE:
            out[key] = (f, None)
        elif kind == "release" and f.get("why") == READ_ONCE and key in out:
            out[key] = (out[key][0], f)
    return out


GONE = ("retired", "aborted")  # a prefetch's events once it left the cache


def ends_in(result: dict, key: object) -> bool:
    """Whether a prefetch of request ``key`` left the cache in this run."""
    return any("released" in e for e in result.get("ops", {}).get(json.dumps(key), ()))


def waits(spec: dict, p: dict, rank: int) -> list[str]:
    """Read once's bound on a wait: a request waiting on a read in flight starts
    within a pass of that read's operation leaving (landed, cut, failed, aborted,
    evicted), whatever the walk was limited by; one still held at the end waits on
    an operation still there, or was aborted."""
    out = []
    ops, aborted = p.get("ops", {}), passes_of(p, "aborted")
    for key, (hold, release) in held(p).items():
        awaited = json.dumps(hold["awaits"])
        gone = [e["released"] for e in ops.get(awaited, ())
                if e["started"] <= hold["at"] and "released" in e]  # fmt: skip
        # a read retired in the pass it started (its request aborted at arrival) is
        # never seen ongoing at a pass's end: its events say when it went
        gone += [at for at, k, kind, _ in p["events"]
                 if json.dumps(k) == awaited and kind in GONE]  # fmt: skip
        left = min((g for g in gone if g >= hold["at"]), default=None)
        if release is None:
            if left is not None and key not in aborted:
                out.append(f"liveness: rank {rank}: {key} waits on {awaited}'s read, gone "
                           f"at pass {left}, and was never released")  # fmt: skip
        elif left is None or release["at"] > left + 1:
            out.append(f"liveness: rank {rank}: {key} released at pass {release['at']}, "
                       f"{awaited}'s read gone at pass {left} (at most a pass before)")  # fmt: skip
    return out


def host_served(spec: dict, s: dict, p: dict, rank: int) -> list[str]:
    """Where the walk was not limited: every request stock served from the host is
    admitted with at least the cached tokens it was served from the host, at most
    depth + 1 passes later (from its arrival in each run; later where the walk could
    not reach it: a full pass, a cutoff).

    Served from the host, in stock: no L3 read of its own, and cached tokens that
    device and host already held at its arrival (``matched``; the device's copies
    are of host pages). Tokens another request's L3 read or load-back put there
    while it waited are that read's outcome: they move with its decisions, which
    liveness bounds. A request with a hit query of its own is admitted on that
    query's verdict (or a start held for one): depth more where its start was held for
    its pass's decisions (:func:`most_late`), and counted from its release where read
    once held it (:func:`waits` bounds that)."""
    if limited_by(spec, s, p):
        return []
    a_s, a_p = admitted(s), admitted(p)
    at_arrival = {json.dumps(k): d[0] for _, k, kind, d in s["events"] if kind == "matched"}
    queried = {json.dumps(k) for _, k, kind, _ in s["events"] if kind == "query"}
    waiting = held(p)
    released = {k: r["at"] for k, (_, r) in waiting.items() if r is not None}
    # a read that never ends in either run (no deadline, never complete) holds the
    # requests waiting on it as long as it holds its own (``waits`` checks the rest)
    endless = {k for k, (h, r) in waiting.items() if r is None
               and not ends_in(s, h["awaits"]) and not ends_in(p, h["awaits"])}  # fmt: skip
    own = queried | set(held_starts(p))  # a query of its own, or a start held for one
    most = {k: most_late(spec, p, k) if k in own else depth_of(spec) + 1 for k in a_s}
    out = []
    for key, (at, from_l3, cached, host) in sorted(a_s.items()):
        served = min(cached, at_arrival.get(key, cached))
        if served <= 0 or from_l3 > 0 or key in endless:  # not served from the host alone
            continue
        got = a_p.get(key)
        if got is None:
            out.append(f"host-served: rank {rank}: {key} served from the host by stock "
                       f"(pass {at}, {served} cached) was not admitted")  # fmt: skip
            continue
        late_ok = lateness(spec, s, p, most[key], earlier=True, since=released)
        if got[2] < served or not late_ok(key, at, got[0]):
            out.append(f"host-served: rank {rank}: {key}: stock admitted it at pass {at} "
                       f"with {served} cached at arrival ({host} loaded from the host), the "
                       f"plugin at pass {got[0]} with {got[2]} (at most {most[key]} "
                       "passes later, or later where the walk could not reach it; at least "
                       "as many)")  # fmt: skip
    return out


def hard_violations(spec: dict, stock: list, plugin: list) -> list[str]:
    """Every hard clause that fails for ``spec`` ([] if none)."""
    name = spec["name"]
    found = agreement(spec, {"stock": stock, "plugin": plugin})
    if found or spec.get("expect_error"):
        return found
    s_ranks, p_ranks = ranks_of(stock, name), ranks_of(plugin, name)
    if not all(r["plugin"] for r in p_ranks) or any(r["plugin"] for r in s_ranks):
        return ["the arms did not run as labelled (plugin loaded where it should not be)"]
    for rank, (s, p) in enumerate(zip(s_ranks, p_ranks)):
        found += liveness(spec, p, rank)
        found += resources(spec, s, p, rank)
        found += spending(spec, s, p, rank)
        found += host_served(spec, s, p, rank)
        found += waits(spec, p, rank)
    return found


def totals(specs: list, stock: list, plugin: list) -> dict[str, Any]:
    """Rank 0's resource totals over ``specs``, per arm."""
    out: dict[str, Any] = {}
    for arm, ranks in (("stock", stock), ("plugin", plugin)):
        t = {"L3 queries": 0, "reads": 0, "keys read": 0, "allocations": 0, "pages": 0,
             "collectives": 0, "locks left": 0}  # fmt: skip
        for spec in specs:
            r = ranks[0][spec["name"]]
            if "error" in r:
                continue
            used = spent(r)
            t["L3 queries"] += used["l3_queries"]
            t["reads"] += used["reads"]
            t["keys read"] += used["keys_read"]
            t["allocations"] += used["allocations"]
            t["pages"] += used["pages"]
            t["collectives"] += sum(r["collectives"])
            t["locks left"] += r["host_locks"]
        out[arm] = t
    return out


def limited_overspent(specs: list, stock: list, plugin: list) -> int:
    """Scenarios whose walk was limited and whose plugin run spent more than
    stock's on some count (rank 0): the timing's moves, reported, not failed."""
    n = 0
    for spec in specs:
        s, p = stock[0][spec["name"]], plugin[0][spec["name"]]
        if "error" in s or "error" in p:
            continue
        n += bool(limited_by(spec, s, p) and overspent(spec, s, p))
    return n
