"""How often a differential run exercised each path issue 52 (item 4) says the
model used to leave out, from the scenarios drawn and what the runs recorded
(rank 0; a stock event counts what stock did, a plugin event what the plugin
did). ``hicache-async-ack-lab differential`` prints them and warns on any at 0."""

from __future__ import annotations

import json
from typing import Callable, Iterable

from hicache_async_ack.env import DEPTH_VAR
from hicache_async_ack_lab.testing.diff_records import read_once, votes_off

# item -> how often a scenario exercised it: (spec, stock's record, the plugin's)
Counter = Callable[[dict, dict, dict], int]


def events(result: dict, kind: str, test: Callable[[list], bool] = lambda d: True) -> int:
    return sum(1 for e in result.get("events", []) if e[2] == kind and test(e[3]))


def plugin_events(result: dict, kind: str) -> int:
    return sum(1 for k, _ in result.get("plugin_events", []) if k == kind)


def spec_is(test: Callable[[dict], bool]) -> Counter:
    return lambda spec, s, p: int(test(spec))


def depth_is(depth: str) -> Counter:
    return spec_is(lambda x: x.get("env", {}).get(DEPTH_VAR, "1") == depth)


def in_flight(spec: dict, s: dict, p: dict) -> int:
    """Requests that arrived while another of their family still had its read in
    flight in stock's run (a system prompt shared by a burst: the issue's workload)."""
    start: dict = {}
    end: dict = {}
    for at, key, kind, _ in s.get("events", []):
        k = json.dumps(key)
        if kind == "query":
            start.setdefault(k, at)
        elif kind in ("admitted", "aborted", "finish", "revoked", "inserted") and k in start:
            end.setdefault(k, at)
    family = {r["rid"]: (r.get("family") or [None])[0] for r in spec["requests"]}
    arrived = {json.dumps(k): at for at, k, kind, _ in s.get("events", []) if kind == "arrived"}
    n = 0
    for k, at in arrived.items():
        rid, f = json.loads(k)[0], family.get(json.loads(k)[0])
        if f is None:
            continue
        n += any(family.get(json.loads(o)[0]) == f and json.loads(o)[0] != rid
                 and t <= at < end.get(o, 1 << 30) for o, t in start.items())  # fmt: skip
    return n


ITEMS: dict[str, Counter] = {
    "host match (admitted with host tokens)": lambda spec, s, p: events(s, "host_loaded"),
    "shared prefix in flight at arrival": in_flight,
    "prefix inserted under a match": lambda spec, s, p: events(s, "inserted", lambda d: d[1] > 0),
    "order fcfs": spec_is(lambda x: x.get("order", "fcfs") == "fcfs"),
    "order lpm": spec_is(lambda x: x.get("order") == "lpm"),
    "order dfs-weight": spec_is(lambda x: x.get("order") == "dfs-weight"),
    "order priority": spec_is(lambda x: x.get("order") == "priority"),
    "retraction from decode": lambda spec, s, p: events(s, "retracted"),
    "device eviction": lambda spec, s, p: events(s, "device_evicted"),
    "re-query after a device hit loss": lambda spec, s, p: events(s, "requery"),
    **{f"depth {d}": depth_is(d) for d in ("1", "2", "3", "4", "5", "6", "7", "8", "auto")},
    "flush (idle)": lambda spec, s, p: events(s, "flush"),
    "flush (paused, requests waiting)": lambda spec, s, p: events(s, "paused_flush"),
    "storage detach": lambda spec, s, p: events(s, "detach"),
    "storage attach": lambda spec, s, p: events(s, "attach"),
    "abort waiting": lambda spec, s, p: events(s, "aborted", lambda d: d[:1] == ["waiting"]),
    "abort prefetching": lambda spec, s, p: events(s, "aborted",
                                                   lambda d: d[:1] == ["prefetching"]),
    "abort running": lambda spec, s, p: events(s, "aborted", lambda d: d[:1] == ["running"]),
    "page size 1": spec_is(lambda x: x.get("page_size", 1) == 1),
    "page size > 1": spec_is(lambda x: x.get("page_size", 1) > 1),
    "sidecar pool": spec_is(lambda x: bool(x.get("sidecar"))),
    "failed query": lambda spec, s, p: errors(spec, s, "query"),
    "failed read": lambda spec, s, p: errors(spec, s, "read"),
    "TP=2": spec_is(lambda x: x.get("world", 2) == 2),
    "TP=3": spec_is(lambda x: x.get("world", 2) == 3),
    "TP=4": spec_is(lambda x: x.get("world", 2) == 4),
    "read once on": spec_is(read_once),
    "votes off": spec_is(votes_off),
    "held starts": lambda spec, s, p: plugin_events(p, "hold"),
    "released starts": lambda spec, s, p: plugin_events(p, "release"),
}  # fmt: skip


def errors(spec: dict, s: dict, kind: str) -> int:
    """Requests with a failing script that asked L3 at least once."""
    asked = {e[1][0] for e in s.get("events", []) if e[2] == "query"}
    return sum(1 for r in spec["requests"] if r["rid"] in asked
               and any(x.get("error") == kind for x in r["scripts"]))  # fmt: skip


def exercised(specs: Iterable[dict], stock: list, plugin: list) -> dict[str, int]:
    """Per item, how often the run exercised it (``ITEMS``' order)."""
    out = dict.fromkeys(ITEMS, 0)
    for spec in specs:
        s, p = stock[0][spec["name"]], plugin[0][spec["name"]]
        for item, count in ITEMS.items():
            out[item] += count(spec, s, p)
    return out


def never(seen: dict[str, int]) -> list[str]:
    return [item for item, n in seen.items() if n == 0]
