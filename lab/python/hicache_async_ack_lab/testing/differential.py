"""One differential scenario on real gloo ranks: SGLang's real UnifiedRadixCache
on the prefetch lifecycle of :mod:`hicache_async_ack_lab.sim.lifecycle`,
driven pass by pass as SGLang 0.5.23's scheduler drives it, with the plugin
registered or not, so stock's run and the plugin's can be compared
(:mod:`.diff_compare`, :mod:`.diff_checks`).

A rank target for :mod:`hicache_async_ack_lab.testing.spec_ranks`
(``run_differential``). Per pass p, in the scheduler's order: requests arrive
(``_prefetch_kvcache``: ``prefetch_from_storage``; on a PD decode node the
prealloc's ``query_storage_hit_length`` first, then the prefetch with its
hit end), waiting requests are aborted (``release_aborted_request``), this
rank's storage reports what its script says by now, running requests that
are done finish, then the boundary (``Scheduler._process_hicache_events``:
``check_hicache_events``) and the storage retries that are due
(``StoragePrefetchRetries.pop_ready`` over the waiting queue, each re-issued
through ``prefetch_from_storage``), then:

* prefill (``mode`` "prefill"): the waiting-queue walk of
  ``get_new_batch_prefill``: it breaks on a spent token budget
  (``budget_state``), a full batch (``get_num_allocatable_reqs``: the running
  requests count) and an ``add_one_req`` refusal (the request's extend does
  not fit the budget left: NO_TOKEN; the batch's first request is chunked),
  and on the arrival-based limits (a full pass, a cutoff by arrival); a
  request whose prefetch is done (``check_prefetch_progress``) has its span
  popped and is admitted through
  ``PrefillAdder._account_prefill_cache_admission``; with a limit on the
  running requests it runs ``decode`` passes, then finishes (its pages are
  the tree's again), else it runs to the end;
* decode (``mode`` "decode"): the transfer queue, as
  ``_try_hicache_queue_load_back``: ``check_prefetch_progress`` then
  ``pop_prefetch_loaded_tokens``, the load-back taking the pages.

After the last pass the run drains (no arrivals) until nothing is left or a
limit is reached. What is recorded per rank: the lifecycle events
(:class:`~hicache_async_ack_lab.sim.lifecycle.Record`), what limited the walk
(``limits``), each pass's collectives, the L3 queries and reads, the host locks
left, and the plugin's events (its reaches, verdicts, stops, pins).

The spec (JSON; :mod:`.diff_gen` draws them): name, mode, passes, policy,
host_memory_mode, host_pages, capacity, threshold, exposed, cold, env, skew
(per rank), limits ({full: [pass], cutoff: {pass: arrival}, running: N,
tokens: N}), retry ({interval, attempts}), requests ([{rid, arrive, tokens,
family: [id, shared] or None, budget: [per rank] or None, scripts: [{hit: {at:
[per rank], tokens} or None, progress, finish}], abort, requeue, decode}]).
"""

from __future__ import annotations

import os
import traceback
from collections import defaultdict
from types import SimpleNamespace

from hicache_async_ack import env as plugin_env
from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.plugin_env import EventLog, installed
from hicache_async_ack_lab.sim.buffer_stage import BufferStage
from hicache_async_ack_lab.sim.cache import build_cache
from hicache_async_ack_lab.sim.host_tree import HostTree
from hicache_async_ack_lab.sim.lifecycle import (
    LifecycleController,
    PassTimer,
    Record,
    Script,
    handle_key,
)
from hicache_async_ack_lab.sim.sched_shim import KVAllocator, server_config
from hicache_async_ack_lab.testing import diff_controls
from hicache_async_ack_lab.testing.diff_scheduler import Scheduler, family_tokens
from hicache_async_ack_lab.testing.spec_ranks import run_specs

# issue 52's read-once setting (its name from the plugin once it declares it)
READ_ONCE_VAR = getattr(
    plugin_env, "READ_ONCE_VAR", "SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_READ_ONCE"
)
VARS = (ENABLE_VAR, PREFETCH_VOTES_VAR, DEPTH_VAR, READ_ONCE_VAR)
DRAIN = 60  # passes after the last one, at most, for what is left to settle


def per_rank(value, rank: int):
    return value[rank] if isinstance(value, list) else value


class RecordingRetries:
    """SGLang's StoragePrefetchRetries, recording the retries armed."""

    def __init__(self, record: Record):
        from sglang.srt.mem_cache.storage_prefetch import StoragePrefetchRetries

        self.inner = StoragePrefetchRetries()
        self.record = record

    def poll_miss(self, req_id, storage_hit_end=None):
        self.record.add(req_id, "retry", "poll_miss", storage_hit_end)
        self.inner.poll_miss(req_id, storage_hit_end)

    def refetch(self, req_id, storage_hit_end=None):
        self.record.add(req_id, "retry", "refetch", storage_hit_end)
        self.inner.refetch(req_id, storage_hit_end)

    def cancel(self, req_id):
        self.inner.cancel(req_id)

    def clear(self):
        self.inner.clear()

    def pop_ready(self, waiting, interval, attempts):
        return self.inner.pop_ready(waiting, interval, attempts)


class MetricsRecorder:
    """The storage metrics collector: totals per metric and reason."""

    def __init__(self):
        self.totals: dict = defaultdict(int)

    def __getattr__(self, name: str):
        if not name.startswith("log_"):
            raise AttributeError(name)

        def log(value=None, reason=None, *args, **kwargs):
            if isinstance(value, int):
                self.totals[f"{name}:{reason}" if reason else name] += value

        return log


def build(spec: dict, rank: int, world: int, group, clock, log: EventLog, plugin: bool):
    from sglang.srt.mem_cache.hicache_storage import PoolName, SidecarPoolSpec
    from sglang.srt.mem_cache.unified_cache.component_type import BASE_COMPONENT_TYPE
    from sglang.srt.session.streaming_session import StreamingSession

    mode = spec.get("host_memory_mode", "cache")
    ps = spec.get("page_size", 1)
    record = Record(clock)
    sidecar = PoolName.INDEXER if spec.get("sidecar") else None
    cc = LifecycleController(clock, record, spec["host_pages"] * ps, spec["capacity"], mode,
                             page_size=ps, sidecar=sidecar)  # fmt: skip
    tree = HostTree(record, page_size=ps, exposed=spec.get("exposed", False))
    sim = build_cache(tp_group=group, tp_world_size=world, storage=True,
                      host_memory_mode=mode, cc=cc, tree=tree)  # fmt: skip
    cache = sim.cache
    d = cache.__dict__
    # upstream's own accounting, host locks and lock paths here (the tree keeps the locks)
    for name in ("_account_prefetch_outcome", "dec_host_lock_ref", "dec_lock_ref"):
        d.pop(name)
    pool = cc.pool
    d.update(
        disable=False,
        session=StreamingSession(cache),
        session_refs=SimpleNamespace(reset=lambda: None),
        _components_tuple=(),
        is_mamba_enabled=False,
        is_swa_enabled=False,
        decoder_swa_bounded_replay=False,
        token_to_kv_pool_allocator=KVAllocator(ps),
        init_load_back=lambda params: load_back(tree, params),
        prefetch_stop_policy=spec.get("policy", "timeout"),
        prefetch_threshold=spec.get("threshold", 1),
        prefetch_timeout_base=0.0,
        prefetch_timeout_per_page=0.0,
        hicache_storage_pass_prefix_keys=False,
        _storage_prefetch_wait={},
        _storage_prefetch_hit_remaining_by_reqid={},
        prefetch_loaded_tokens_by_reqid={},
        prefetch_loaded_storage_start_by_reqid={},
        _prefetch_outcome_stats=defaultdict(int),
        storage_prefetch_retries=RecordingRetries(record),
        enable_storage_metrics=True,
        storage_metrics_collector=MetricsRecorder(),
        tree_components=(BASE_COMPONENT_TYPE,),
        components={
            BASE_COMPONENT_TYPE: SimpleNamespace(
                free_host_values=pool.free, build_hicache_transfers=lambda *a, **k: []
            )
        },
        sidecar_pool_specs=[] if sidecar is None else [SidecarPoolSpec(sidecar, PoolName.KV)],
        evict_host=lambda n, component_type=None: tree.evict(n, pool),
    )
    if mode == "buffer_only":
        d["buffer_pipeline"] = BufferStage(cache, record)
    for name, pages in spec.get("cold", []):
        held = pool.alloc(pages * ps)
        if held is not None:  # what does not fit was never cached
            tree.add_cold(name, held)
    for name, family, tokens, backed in spec.get("warm", []):
        host = pool.alloc(tokens) if backed else None  # written through, if it fits
        tree.add_warm(name, tuple(family_tokens(family, tokens)), host)
    budgets = {r["rid"]: per_rank(r.get("budget"), rank) for r in spec["requests"]}
    instrument(cache, record, clock, budgets, tree)
    if plugin:
        from hicache_async_ack.sglang_plugin import init_cache

        controls = diff_controls.substitutes(spec.get("control", []))
        with installed(log, controls):
            init_cache(cache, SimpleNamespace(enable_metrics=False))
    return sim, record


def load_back(tree: HostTree, params):
    """``init_load_back`` (cache mode): the host hit on the device, its path locked
    by the admission (upstream's ``load_back`` copies it through the controller)."""
    if params.host_hit_length <= 0:
        return 0, params.req.last_node
    tree.load_back(params.best_match_node)
    return params.host_hit_length, params.best_match_node


def instrument(cache, record: Record, clock, budgets: dict, tree: HostTree) -> None:
    """Record the lifecycle's exits and the deadline's start, around upstream's
    own methods (instance attributes: the plugin's hooks sit on the class)."""
    d = cache.__dict__

    def wrap(name, kind, detail):
        real = getattr(cache, name)

        def recorded(request, *a, **kw):
            what = "admission" if record.admitting and kind == "finish" else kind
            record.add(handle_key(request), what, *detail(cache, request, *a, **kw))
            return real(request, *a, **kw)

        d[name] = recorded

    def op_state(c, request, *a, **kw):
        info = c.ongoing_prefetch.get(request)
        op = info.operation if info is not None else None
        return [op is not None and op.deadline_expired, op is not None and op.is_terminated()]

    def finish(c, r, *a, **kw):
        n = kw.get("fulfilled_tokens", a[0] if a else None)
        return [n, kw.get("reason", a[1] if len(a) > 1 else None)]

    wrap("_finish_storage_prefetch", "finish", finish)
    wrap("revoke_pending_prefetch", "revoked", op_state)
    wrap("_retire_ongoing_prefetch", "retired", lambda c, r, h, x: [None if h is None else len(h)])
    start = cache._start_storage_prefetch_wait  # upstream's, bound
    handle_result = cache._handle_prefetch_result

    def start_wait(operation):
        started = operation.handle in cache._storage_prefetch_wait
        start(operation)
        wait = cache._storage_prefetch_wait.get(operation.handle)
        if not started and wait is not None:
            budget = budgets.get(operation.handle.rid)
            wait.timer = PassTimer(clock)
            wait.timeout_s = float("inf") if budget is None else budget - 0.5
            record.add(handle_key(operation.handle), "polled")

    def handled(operation):
        tree.owner = handle_key(operation.handle)  # whose pages an insert holds
        return handle_result(operation)

    d["_start_storage_prefetch_wait"] = start_wait
    d["_handle_prefetch_result"] = handled


def scripts_of(spec: dict, rank: int) -> dict:
    out = {}
    for r in spec["requests"]:
        out[r["rid"]] = [
            Script(
                hit_at=None if s.get("hit") is None else per_rank(s["hit"]["at"], rank),
                hit_tokens=0 if s.get("hit") is None else s["hit"]["tokens"],
                progress=[(per_rank(at, rank), tokens) for at, tokens in s.get("progress", [])],
                finish_at=per_rank(s.get("finish"), rank),
                error=s.get("error"),
            )
            for s in r["scripts"]
        ]
    return out


def count_collectives():
    """Count every torch.distributed.all_reduce this process runs, per pass."""
    import torch.distributed as dist

    counts: list[int] = []
    real = dist.all_reduce

    def counted(*a, **kw):
        counts[-1] += 1
        return real(*a, **kw)

    dist.all_reduce = counted
    return counts, lambda: setattr(dist, "all_reduce", real)


def track_ops(cache, p: int, seen: dict) -> None:
    """Per prefetch operation (its request's key and its number among that
    request's operations): the pass it was first seen ongoing, its read
    stopped (terminated), and its budget and locks released (gone)."""
    live = {}
    for h, info in cache.ongoing_prefetch.items():
        k = handle_key(h)
        ops = seen.setdefault(k, [])
        entry = next((e for e in ops if e["op"] is info.operation), None)
        if entry is None:
            entry = {"started": p, "op": info.operation}
            ops.append(entry)
        live[id(info.operation)] = True
        if info.operation.is_terminated():
            entry.setdefault("terminated", p)
    for ops in seen.values():
        for e in ops:
            if "released" not in e and id(e["op"]) not in live:
                e["released"] = p
                e.setdefault("terminated", p)


def run_passes(spec: dict, sim, sched: Scheduler, clock, counts: list, seen: dict) -> int:
    trace = os.environ.get("HICACHE_ASYNC_ACK_DIFF_TRACE")  # a folder: per-rank traces
    cache = sim.cache
    p = 0
    for p in range(spec["passes"] + DRAIN):
        if p >= spec["passes"] and sched.idle():
            break
        clock.now = p
        counts.append(0)
        sched.step(p, arriving=p < spec["passes"])
        track_ops(cache, p, seen)
        if trace:
            with open(f"{trace}/{spec['name']}-{sched.rank}.txt", "a") as f:
                ongoing = sorted(h.rid for h in cache.ongoing_prefetch)
                f.write(f"{p} {ongoing} {[r.rid for r in sched.waiting]} {counts[-1]}\n")
                f.write("".join(f"   {e}\n" for e in sched.record.events if e[0] == p))
    return p


def plugin_loaded() -> bool:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from hicache_async_ack.sglang_plugin import is_hooked

    return is_hooked(UnifiedRadixCache.check_hicache_events)


def run_scenario(spec: dict, rank: int, world: int, group) -> dict:
    with server_config(spec):
        return run_configured(spec, rank, world, group)


def run_configured(spec: dict, rank: int, world: int, group) -> dict:
    plugin = plugin_loaded()
    clock = SimpleNamespace(now=-1)
    log = EventLog()
    sim, record = build(spec, rank, world, group, clock, log, plugin)
    sim.cc.scripts = scripts_of(spec, rank)
    sim.cc.delay = per_rank(spec.get("skew", 0), rank)
    sched = Scheduler(spec, rank, sim, record)
    out: dict = {"plugin": plugin}
    counts, restore = count_collectives()
    seen: dict = {}
    last = 0
    try:
        last = run_passes(spec, sim, sched, clock, counts, seen)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["error_pass"] = clock.now
    finally:
        restore()
    cc, cache = sim.cc, sim.cache
    if spec.get("count_live"):
        out["live_operations"] = live_operations()
    if spec.get("final_evict"):
        out["final_evict"] = sim.tree.evict(1 << 30, cc.pool)
    out.update(
        events=[
            [at, list(k) if isinstance(k, tuple) else k, kind, det]
            for at, k, kind, det in record.events
        ],  # fmt: skip
        stats={k: v for k, v in sorted(cache._prefetch_outcome_stats.items()) if v},
        metrics=dict(sorted(cache.storage_metrics_collector.totals.items())),
        pops=sorted([str(n), u] for n, u in cc.pops),
        free_pages=len(cc.pool.free_pages),
        occupied=cc.prefetch_tokens_occupied,
        waiting=sorted(r.rid for r in list(sched.waiting) + sched.transfer),
        ongoing=sorted(h.rid for h in cache.ongoing_prefetch),
        limits=[
            [at, kind, list(k) if isinstance(k, tuple) else k] for at, kind, k in sched.limits
        ],  # fmt: skip
        collectives=counts,
        l3_queries=cc.l3_queries,
        reads=cc.reads,
        keys_read=cc.keys_read,
        bypassed=dict(sorted(cc.bypassed.items())),
        host_locks=sim.tree.host_locks(),
        last_pass=last,
        ops={
            json_key(k): [{n: v for n, v in e.items() if n != "op"} for e in ops]
            for k, ops in seen.items()
        },  # fmt: skip
        plugin_events=[
            [kind, {k: json_value(v) for k, v in f.items()}] for kind, f in log.events
        ],  # fmt: skip
        idle=sched.idle(),
        state=plugin_state(cache) if plugin else {},
    )
    return out


def live_operations() -> int:
    """PrefetchOperation objects still alive in this process (what the run kept)."""
    import gc

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, PrefetchOperation))


def plugin_state(cache) -> dict:
    """What the plugin's vote state holds (0 each once the run is idle)."""
    from hicache_async_ack.sglang_plugin import PrefetchVoteState, state_of

    state = state_of(cache, "prefetch_votes")
    if not isinstance(state, PrefetchVoteState):
        return {}
    return {"reaches": len(state.book.reaches), "admitted": len(state.book.admitted),
            "pins": len(state.landing.pins.held)}  # fmt: skip


def json_key(key) -> str:
    import json

    return json.dumps(list(key) if isinstance(key, tuple) else key)


def json_value(v):
    return list(v) if isinstance(v, tuple) else v


def run_differential(ctx, payload: dict) -> dict:
    """Rank target: SGLang's load_plugins() (stock's arm excludes the plugin
    through SGLANG_PLUGINS), then each scenario on a fresh TP group."""
    return run_specs(ctx, payload, VARS, run_scenario)
