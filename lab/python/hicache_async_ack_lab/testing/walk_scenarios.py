"""Scripted scheduling passes on real gloo ranks: the waiting-queue walk as
SGLang 0.5.23's ``get_next_batch_to_run`` runs it, so the plugin and stock
SGLang can be compared decision for decision on the same inputs.

A rank target for :func:`hicache_async_ack.tools.run_ranks` (``run_walk_specs``).
Per pass: requests arrive (a storage prefetch starts for each), this rank's
transfer worker finishes the reads due (their final acks go on the ack queue),
``check_hicache_events`` runs (the ack sync; the votes' pass boundary), then
the walk: for each waiting request in queue order, stop if the batch is full
(before the check, as ``batch_is_full`` does), ``check_prefetch_progress``,
skip it if its prefetch is not done, stop if ``add_one_req`` rejects it, else
admit it (``finish_storage_prefetch_admission``, as the admission accounting
calls it). Each rank's deadline is upstream's admission-poll timer counted in
passes (:func:`hicache_async_ack_lab.sim.prefetch.poll_deadline`).

With the plugin excluded (``SGLANG_PLUGINS`` names another plugin), the same
script runs on stock SGLang: its per-request blocking reduces, its verdicts.

Spec keys: name, passes, requests (``{rid, arrive, budget, finish}``: budget
in passes after the first unfinished check, finish the pass the read
finishes; either an int or one per rank), capacity (requests admitted per
pass, default all), full ([pass, ...]: the batch is full before the walk, on
every rank), short ({rank: [pass, ...]}: that rank's walk stops one request
earlier, SGLang #30760), reject ({rank: {pass: [rid, ...]}}: ``add_one_req``
rejects it there), prefix ({rank: {pass: {rid: n}}}: the prefix length that
rank admits it with), chunked ({pass: {rid, prefix: [per rank], extend}}: a
chunked request's next chunk joins the batch first, through
``PrefillAdder.add_chunked_req``), host_memory_mode, cp (attention CP inside
the TP group, laid out as SGLang does), env / rank_env, unreached_votes (bool:
the negative control, every ongoing operation voted on at the boundary whether
the walk reached it or not, as before the fix), control (the plugin with one
guarantee taken out: :mod:`.diff_controls`), reach ({rank: {pass: n}}: that
rank's walk reaches at most n requests there, as one whose batch filled up
first), swap ({rank: {pass: [i, j]}}: that rank's walk visits positions i and
j in the other order, as one whose waiting queue diverged).
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.plugin_env import EventLog, installed
from hicache_async_ack_lab.sim.admission import SchedulerShim, adder_for, admit
from hicache_async_ack_lab.sim.cache import build_cache
from hicache_async_ack_lab.sim.prefetch import add_prefetch
from hicache_async_ack_lab.testing import diff_controls
from hicache_async_ack_lab.testing.spec_ranks import run_specs

VARS = (ENABLE_VAR, PREFETCH_VOTES_VAR, DEPTH_VAR)
GROUP_TIMEOUT_S = 20.0
ALL = 1 << 30


def per_rank(value, rank: int):
    return value[rank] if isinstance(value, list) else value


def plugin_loaded(cache) -> bool:
    from hicache_async_ack.sglang_plugin import is_hooked

    return is_hooked(type(cache).check_hicache_events)


def counting(calls: list):
    """Wrap an async MIN factory so each issue is counted in ``calls``."""

    def wrap(base):
        def factory(group):
            issue = base(group)

            def counted(values):
                calls[0] += 1
                return issue(values)

            return counted

        return factory

    return wrap


def build(spec: dict, rank: int, world: int, group, clock, calls: list, log: EventLog):
    from hicache_async_ack.sglang_plugin import environment, init_cache

    topology: dict = {}
    if spec.get("cp"):  # every rank creates every group, in the same order
        from hicache_async_ack_lab.sim.layout import attention_cp_layout, create_groups

        topology = create_groups(rank, attention_cp_layout(world, spec["cp"]), GROUP_TIMEOUT_S)
    sim = build_cache(
        tp_group=group,
        tp_world_size=world,
        storage=True,
        host_memory_mode=spec.get("host_memory_mode", "cache"),
        **topology,
    )
    ps = add_prefetch(sim, budget=lambda op: op.test_budget, clock=clock)
    cache = sim.cache
    real = cache._all_reduce

    def blocking(tensor, op):
        calls[1] += 1
        return real(tensor, op)

    cache.__dict__["_all_reduce"] = blocking
    if cache.host_memory_mode == "buffer_only":
        from collections import deque

        cache.__dict__["buffer_pipeline"] = SimpleNamespace(
            pending_hit_allocs=deque(),
            flush_pending_writes=lambda: None,
            ongoing_write_through={},
            finish_storage_write_ack=lambda *a, **k: None,
            stage_completed_prefetch=lambda *a, **k: None,
        )
    if plugin_loaded(cache):
        names = list(spec.get("control", []))
        if spec.get("unreached_votes"):
            names.append("unreached_votes")
        counted = counting(calls)(environment().collectives.async_min)
        with installed(log, diff_controls.substitutes(names), async_min=counted):
            init_cache(cache, SimpleNamespace(enable_metrics=False))
    return sim, ps


def walk(spec: dict, rank: int, p: int, cache, ps, handles: dict, waiting: list) -> list:
    """One waiting-queue walk; returns the rids admitted, in order."""
    cap = spec.get("capacity", ALL)
    if p in spec.get("full", ()):
        cap = 0
    if p in spec.get("short", {}).get(str(rank), ()):
        cap = max(0, min(cap, len(waiting)) - 1)
    rejected = set(spec.get("reject", {}).get(str(rank), {}).get(str(p), ()))
    admitted: list = []
    chunk = spec.get("chunked", {}).get(str(p))
    if chunk is not None and cap > 0:  # the chunked request's next chunk goes first
        continue_chunk(cache, chunk, rank, handles)
    order = list(waiting)
    swap = spec.get("swap", {}).get(str(rank), {}).get(str(p))
    if swap is not None:
        i, j = swap
        order[i], order[j] = order[j], order[i]
    reach = spec.get("reach", {}).get(str(rank), {}).get(str(p))
    for at, rid in enumerate(order):
        if len(admitted) >= cap or (reach is not None and at >= reach):
            break  # batch_is_full: before the check
        h = handles[rid]
        if not ps.check(h):
            continue  # its prefetch is not done: stays waiting
        if rid in rejected:
            break  # add_one_req said no: the walk stops
        admit(adder_for(cache), h, prefix(spec, rank, p, rid))
        admitted.append(rid)
        waiting.remove(rid)
    return admitted


def continue_chunk(cache, chunk: dict, rank: int, handles: dict) -> None:
    """``PrefillAdder.add_chunked_req`` (SGLang's own, returning early here: no
    memory budget to fit) for a request whose next chunk joins the batch with
    this rank's prefix length (``chunked``: {pass: {rid, prefix: [per rank],
    extend}})."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from hicache_async_ack_lab.sim.admission import AdmittedReq

    before = per_rank(chunk["prefix"], rank)
    req = AdmittedReq(handles[chunk["rid"]], before, None, before + chunk.get("extend", 4))
    budget = SimpleNamespace(available_chunk_tokens=lambda rem: None)
    adder = SimpleNamespace(tree_cache=cache, dllm_config=None, memory_budget=budget,
                            rem_chunk_tokens=None, can_run_list=[req])  # fmt: skip
    PrefillAdder.add_chunked_req(adder, req)


def prefix(spec: dict, rank: int, p: int, rid: str) -> int:
    """The prefix length this rank admits ``rid`` with at pass ``p`` (``prefix``:
    {rank: {pass: {rid: n}}}, a rank whose match took another prefix)."""
    return int(spec.get("prefix", {}).get(str(rank), {}).get(str(p), {}).get(rid, 0))


def run_walk(spec: dict, rank: int, world: int, group) -> dict:
    clock = SimpleNamespace(now=-1)
    calls = [0, 0]  # async issues, blocking _all_reduce calls
    log = EventLog()
    sim, ps = build(spec, rank, world, group, clock, calls, log)
    cache = sim.cache
    scheduler = SchedulerShim(cache)
    handles: dict = {}
    waiting: list = []
    reads: list = []  # (pass, operation, queue)
    per_pass: list = []
    out: dict = {"plugin": plugin_loaded(cache)}
    p = 0
    try:
        for p in range(spec["passes"]):
            clock.now = p
            before, mark = len(ps.ended), list(calls)
            for r in spec["requests"]:
                if r["arrive"] == p:
                    h = handles[r["rid"]] = ps.add(r["rid"])
                    op = cache.ongoing_prefetch[h].operation
                    op.test_budget = per_rank(r.get("budget", ALL), rank)
                    finish = per_rank(r.get("finish"), rank)
                    if finish is not None:
                        reads.append((finish, op, ps.read_queue()))
                    waiting.append(r["rid"])
            for due in [x for x in reads if x[0] <= p]:
                reads.remove(due)
                ps.complete(due[1], due[2])
            scheduler.boundary()  # check_hicache_events, through the scheduler's method
            admitted = walk(spec, rank, p, cache, ps, handles, waiting)
            scheduler.forward_ct += bool(admitted)  # a batch ran
            per_pass.append(
                {
                    "ended": [[list(k), why] for k, why in ps.ended[before:]],
                    "admitted": admitted,
                    "async": calls[0] - mark[0],
                    "blocking": calls[1] - mark[1],
                    "waiting": len(waiting),
                }
            )
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["error_pass"] = p
    state = None
    if out["plugin"]:
        from hicache_async_ack.sglang_plugin import VOTES_FEATURE, state_of

        state = state_of(VOTES_FEATURE, cache)
    out.update(
        per_pass=per_pass,
        left=sorted(h.rid for h in cache.ongoing_prefetch),
        stopped_on_verdict=log.counts.get("stop", 0),
        sections=log.counts.get("section", 0),
        mode=state.mode if state else None,
    )
    return out


def run_walk_specs(ctx, payload: dict) -> dict:
    """Rank target: SGLang's load_plugins(), then each spec on a fresh TP group.
    ``payload["drift"]`` ("method:transform" of lab.testing.drift): an SGLang
    whose cache method does something else, made before the plugins load."""
    if payload.get("drift"):
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        from hicache_async_ack_lab.testing import drift

        name, _, how = payload["drift"].partition(":")
        drift.drift_method(UnifiedRadixCache, name, getattr(drift, how))
    return run_specs(ctx, payload, VARS, run_walk)
