"""What one arm's record of a differential scenario says (:mod:`.differential`):
each request's lifecycle, its admission, how its accounting closed, and what
made the walk depend on what it admitted or on timing the plugin moves."""

from __future__ import annotations

import json
from typing import Optional

from hicache_async_ack import env as plugin_env
from hicache_async_ack.env import DEPTH_AUTO, DEPTH_MAX, DEPTH_VAR, PREFETCH_VOTES_VAR

# issue 52's read-once setting (the plugin's name for it once it declares it)
READ_ONCE_VAR = getattr(
    plugin_env, "READ_ONCE_VAR", "SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_READ_ONCE"
)

WALK_LIMITS = ("token_budget", "batch_full", "refused")
# Timer starts are not outcomes: the plugin's walk reaches a request whose read
# stock had already seen complete (its acks are drained a pass later).
# Nor is which tier a cached page came from: another request's load-back may have
# put it on the device first (``host_loaded``; the cached tokens are an outcome).
# What device and host held of a prompt at its arrival moves with the timing of
# others' reads and load-backs (``matched``).
NOT_OUTCOMES = ("polled", "finished", "host_loaded", "matched")
# The scheduler's side of a request's end: an abort that reaches the plugin's run
# while the request still waits for an admission stock already made is a race.
SCHEDULER_ENDS = ("aborted", "admitted", "admission")
SCHEDULER_EVENTS = ("arrived", "aborted")


def ranks_of(arm: list, name: str) -> list[dict]:
    """Every rank's record of scenario ``name`` (scenarios run at TP=2, 3 or 4)."""
    return [r[name] for r in arm if name in r]


def depth_of(spec: dict) -> int:
    """The lag depth; under auto, the largest auto may take."""
    raw = spec.get("env", {}).get(DEPTH_VAR, "1")
    return DEPTH_MAX if raw == DEPTH_AUTO else int(raw)


def read_once(spec: dict) -> bool:
    return spec.get("env", {}).get(READ_ONCE_VAR) == "1"


def votes_off(spec: dict) -> bool:
    return spec.get("env", {}).get(PREFETCH_VOTES_VAR) == "0"


def lifecycle(result: dict) -> dict:
    """Per request (rid, attempt): its events without passes, in order; the
    scheduler's own (arrived, aborted) first."""
    out: dict = {}
    for _, key, kind, detail in result["events"]:
        if kind in NOT_OUTCOMES:
            continue
        out.setdefault(json.dumps(key), []).append([kind, detail])
    return {k: sorted(v, key=lambda e: e[0] not in SCHEDULER_EVENTS) for k, v in out.items()}


def passes_of(result: dict, kind: str) -> dict:
    return {json.dumps(k): at for at, k, what, _ in result["events"] if what == kind}


def lateness(spec: dict, stock: dict, plugin: dict, most: int, earlier: bool = False,
             since: Optional[dict] = None):  # fmt: skip
    """``late_ok(key, stock_pass, plugin_pass)``: the plugin may admit at most
    ``most`` passes later (from the request's arrival in each run, or in the
    plugin's from ``since[key]``: where read once held its start), or later
    where its walk could not reach the request (a full pass, a cutoff); never
    earlier, unless ``earlier``."""
    s_arr, p_arr = passes_of(stock, "arrived"), passes_of(plugin, "arrived")
    p_from = {**p_arr, **(since or {})}
    limits = spec.get("limits", {})
    full = set(limits.get("full", ()))
    cutoff = {int(q): a for q, a in limits.get("cutoff", {}).items()}

    def blocked(key: str, q: int) -> bool:
        return q in full or (q in cutoff and p_arr.get(key, -1) >= cutoff[q])

    def late_ok(key: str, s_at: int, p_at: int) -> bool:
        expected = p_from.get(key, 0) + s_at - s_arr.get(key, 0)
        if p_at < expected:
            return earlier
        return all(blocked(key, q) for q in range(expected + most, p_at))

    return late_ok


READ_ONCE = "read_once"  # a hold's ``why`` where read once held the start


def held_starts(result: dict) -> dict[str, int]:
    """The requests whose prefetch start the plugin held until their pass's decisions
    landed (its ``hold`` events, ``pass``): their own read starts up to depth passes
    later, so its decisions land up to depth passes later too; and as many passes more
    as the hold lasted longer behind a read that itself started late (``longer``)."""
    return {json.dumps(f["key"]): f.get("longer", 0) for kind, f in result.get(
        "plugin_events", []) if kind == "hold" and f.get("why") == "pass"}  # fmt: skip


def most_late(spec: dict, result: dict, key: str) -> int:
    """How many passes after stock the plugin may admit ``key``: depth + 1, and depth
    more where its start was held (docs/design.md, "The bound on a held start"), and
    as many more as that hold waited behind a late read."""
    depth, held = depth_of(spec), held_starts(result)
    return depth + 1 + (depth + held[key] if key in held else 0)


def admissions(result: dict) -> dict:
    return passes_of(result, "admitted")


def ends(result: dict) -> dict:
    """Per request, how its prefetch accounting closed: the last finish
    (tokens, reason), or its admission's."""
    out: dict = {}
    for _, k, kind, d in result["events"]:
        if kind in ("finish", "admission"):
            out[json.dumps(k)] = d
    return out


def raced(stock: dict, plugin: dict) -> set:
    """Aborted requests whose lifecycle differs between the arms: an abort needs
    no verdict, so it meets the plugin's cache as it is (its pops depth passes
    behind stock's), or a request stock had already admitted."""
    ls, lp = lifecycle(stock), lifecycle(plugin)
    aborted = set(passes_of(stock, "aborted")) | set(passes_of(plugin, "aborted"))
    return {k for k in aborted if ls.get(k) != lp.get(k)}


def reissued(result: dict) -> dict:
    out: dict = {}
    for _, k, kind, _ in result["events"]:
        if kind == "reissued":
            out[json.dumps(k)] = out.get(json.dumps(k), 0) + 1
    return out


def limited_by(spec: dict, stock: dict, plugin: dict) -> list[str]:
    """What made this scenario's walk depend on what it admitted, or on timing
    the plugin moves ([] if nothing: its outcomes are compared exactly)."""
    why = sorted({lim[1] for r in (stock, plugin) for lim in r["limits"]
                  if lim[1] in WALK_LIMITS})  # fmt: skip
    for kind in ("declined_rate_limited", "probe_rate_limited"):
        counts = [sorted(str(x[2]) for x in r["limits"] if x[1] == kind) for r in (stock, plugin)]
        if counts[0] != counts[1]:
            why.append(kind)
    if raced(stock, plugin):
        why.append("abort_race")
    if reissued(stock) != reissued(plugin):
        # a retry comes due some passes after it was armed: armed at a stop the
        # plugin makes depth + 1 passes later, it meets the request in another state
        why.append("retry_race")
    # scheduler events keyed by pass that met a request (or the scheduler) in
    # another state: a retraction of a request running in one run only, the
    # operator's flush / detach / attach done once idle, device pressure on a
    # tree whose locks follow the running requests
    for kind, race in (("retracted", "retract_race"), ("device_evicted", "device_race")):
        if events_of(stock, kind) != events_of(plugin, kind):
            why.append(race)
    # a cutoff (the batch full from an arrival on) that broke the walk at another
    # request, or in one run only: it met the queue in another state
    if cutoffs(stock) != cutoffs(plugin):
        why.append("cutoff_race")
    if operator(stock) != operator(plugin):
        why.append("operator_race")
    if start_raced(spec, stock, plugin):
        why.append("start_race")
    if full_raced(spec, stock, plugin):
        why.append("full_race")
    return why


def in_flight(result: dict, at: int) -> set[str]:
    """The requests whose prefetch was ongoing at pass ``at``."""
    return {k for k, ops in result.get("ops", {}).items()
            if any(e["started"] <= at < e.get("released", at + 1) for e in ops)}  # fmt: skip


def held_at(result: dict, at: int) -> set[str]:
    """The requests whose start the plugin held over pass ``at``."""
    since: dict[str, int] = {}
    out: set[str] = set()
    for kind, f in result.get("plugin_events", []):
        key = json.dumps(f.get("key"))
        if kind == "hold":
            since[key] = f["at"]
        elif kind == "release" and key in since:
            if since.pop(key) <= at < f["at"]:
                out.add(key)
    return out | {k for k, t in since.items() if t <= at}


def full_raced(spec: dict, stock: dict, plugin: dict) -> bool:
    """A full pass (no walk) over a request whose read stock had started and the
    plugin held: the deadline check the pass skipped, or the first blocked poll that
    starts its timer, falls at another point of its read: limited, as any full batch
    (``start_race`` is the other way round)."""
    return any(in_flight(stock, q) & held_at(plugin, q)
               for q in spec.get("limits", {}).get("full", ()))  # fmt: skip


def start_raced(spec: dict, stock: dict, plugin: dict) -> bool:
    """A start the plugin moved (held) into a pass that ran no walk (a full batch): its
    prefetch's timer starts at its first blocked poll, more passes after its read
    started than in stock, so its deadline meets the read at another point. Stock's
    outcomes depend on that as on any full batch: limited."""
    full = set(spec.get("limits", {}).get("full", ()))
    s_q, p_q = first_passes(stock, "query"), first_passes(plugin, "query")
    s_p, p_p = first_passes(stock, "polled"), first_passes(plugin, "polled")
    for key, polled in p_p.items():
        if key in p_q and key in s_q and key in s_p:
            skipped = range(p_q[key], polled)
            if polled - p_q[key] > s_p[key] - s_q[key] and all(q in full for q in skipped):
                return True
    return False


def first_passes(result: dict, kind: str) -> dict:
    """Per request, the first pass with an event ``kind``."""
    out: dict = {}
    for at, k, what, _ in result["events"]:
        if what == kind:
            out.setdefault(json.dumps(k), at)
    return out


def cutoffs(result: dict) -> list:
    return sorted(json.dumps([lim[0], lim[2]]) for lim in result["limits"] if lim[1] == "cutoff")


def events_of(result: dict, kind: str) -> list:
    return sorted(json.dumps([e[1], e[3]]) for e in result["events"] if e[2] == kind)


RUN_KEYS = ("stats", "metrics", "free_pages", "occupied", "waiting", "ongoing", "l3_queries",
            "reads")  # fmt: skip


def operator(result: dict) -> list:
    """The operator's flushes, detaches and attaches: (pass done, what, and for a
    paused engine's flush the prefetches it dropped)."""
    return [(e[0], e[2], e[3][1:]) for e in result["events"] if e[1] == "operator"]
