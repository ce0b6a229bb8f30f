"""One differential scenario on real gloo ranks: SGLang's real UnifiedRadixCache
on the prefetch lifecycle of :mod:`hicache_async_ack_lab.sim.lifecycle`, driven
pass by pass as SGLang 0.5.23's scheduler drives it, with the plugin loaded or
not (SGLANG_PLUGINS), so stock's outcome and the plugin's can be compared
request by request (:mod:`.diff_compare`).

A rank target for :mod:`hicache_async_ack.tools.ranks` (``run_differential``).
Per pass p, in the scheduler's order: requests arrive (``_prefetch_kvcache``:
``prefetch_from_storage``), requests are aborted (``release_aborted_request``),
this rank's storage reports what its script says by now, then
``check_hicache_events``, then the waiting-queue walk: nothing on a full pass;
else every waiting request in arrival order, up to the first that arrived at
or after the pass's cutoff (the batch filling up, by arrival: the same
requests on every rank and in both arms), ``check_prefetch_progress``, and
for a request whose prefetch is done its admission: ``pop_prefetch_loaded_span``
and the admission accounting through ``PrefillAdder._account_prefill_cache_
admission`` (which calls ``finish_storage_prefetch_admission``). A requeue
brings an admitted request back as its next attempt, some passes after its
admission (a retraction).

The scenario spec (JSON; :mod:`.diff_gen` draws them): name, passes, policy,
host_memory_mode, host_pages, capacity (prefetch_capacity_limit, tokens),
threshold, exposed, cold ([[name, pages]]), full ([pass]), cutoff ({pass:
arrival pass}), env, skew ([per rank]: how late each rank's storage reports,
for the reads a parked hit starts), requests ([{rid, arrive, tokens, budget: [per rank, None:
never], hit: {at: [per rank], tokens} or None, progress: [[[at per rank],
tokens]], finish: [per rank] or None, abort: pass or None, requeue: passes
after admission or None}]); ``at`` counts passes after the prefetch's
submission.
"""

from __future__ import annotations

import os
import traceback
from collections import defaultdict
from types import SimpleNamespace

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.sim.admission import SchedulerShim, adder_for, admit
from hicache_async_ack_lab.sim.buffer_stage import BufferStage
from hicache_async_ack_lab.sim.cache import build_cache
from hicache_async_ack_lab.sim.lifecycle import (
    LifecycleController,
    LifecycleTree,
    PassTimer,
    Record,
    Script,
    handle_key,
)
from hicache_async_ack_lab.testing import diff_controls
from hicache_async_ack_lab.testing.spec_ranks import run_specs

VARS = (ENABLE_VAR, PREFETCH_VOTES_VAR, DEPTH_VAR)
TOKEN_BASE = 1_000_000  # request i attempt a prompts tokens from (i * 64 + a) * TOKEN_BASE


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


def build(spec: dict, rank: int, world: int, group, clock):
    from sglang.srt.mem_cache.unified_cache.component_type import BASE_COMPONENT_TYPE

    mode = spec.get("host_memory_mode", "cache")
    record = Record(clock)
    cc = LifecycleController(clock, record, spec["host_pages"], spec["capacity"], mode)
    tree = LifecycleTree(record, exposed=spec.get("exposed", False))
    sim = build_cache(
        tp_group=group,
        tp_world_size=world,
        storage=True,
        host_memory_mode=mode,
        cc=cc,
        tree=tree,
    )
    cache = sim.cache
    d = cache.__dict__
    # upstream's own accounting and host locks here (the tree keeps the locks)
    d.pop("_account_prefetch_outcome")
    d.pop("dec_host_lock_ref")
    pool = cc.pool
    d.update(
        disable=False,
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
        sidecar_pool_specs=[],
        evict_host=lambda n, component_type=None: tree.evict(n, pool),
    )
    if mode == "buffer_only":
        d["buffer_pipeline"] = BufferStage(cache, record)
    for name, pages in spec.get("cold", []):
        held = pool.alloc(pages)
        if held is not None:  # what does not fit was never cached
            tree.add_cold(name, held)
    budgets = {r["rid"]: per_rank(r.get("budget"), rank) for r in spec["requests"]}
    instrument(cache, record, clock, budgets)
    if plugin_loaded(cache):
        from hicache_async_ack.features import ack_sync, prefetch_votes

        params = SimpleNamespace(enable_metrics=False)
        ack_sync.after_init_hicache(None, cache, None, params)
        prefetch_votes.after_init_hicache(None, cache, None, params)
    return sim, record


def instrument(cache, record: Record, clock, budgets: dict) -> None:
    """Record the lifecycle's exits and the deadline's start, around upstream's
    own methods (instance attributes: the plugin's hooks sit on the class)."""
    d = cache.__dict__

    def wrap(name, kind, detail):
        real = getattr(cache, name)

        def recorded(request, *a, **kw):
            if rolling_back(cache) != request:  # the plugin undoing its own start
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

    def start_wait(operation):
        started = operation.handle in cache._storage_prefetch_wait
        start(operation)
        wait = cache._storage_prefetch_wait.get(operation.handle)
        if not started and wait is not None:
            budget = budgets.get(operation.handle.rid)
            wait.timer = PassTimer(clock)
            wait.timeout_s = float("inf") if budget is None else budget - 0.5
            record.add(handle_key(operation.handle), "polled")

    d["_start_storage_prefetch_wait"] = start_wait


def rolling_back(cache):
    """The request whose provisional start the plugin is undoing now, if any."""
    if not plugin_loaded(cache):
        return None
    from hicache_async_ack.features.prefetch_votes import FEATURE

    state = FEATURE.state_of(cache)
    return None if state is None else state.rolling_back


def plugin_loaded(cache) -> bool:
    from hicache_async_ack.kit.hooks import is_hooked

    return is_hooked(type(cache).check_hicache_events)


def scripts_of(spec: dict, rank: int) -> dict:
    out = {}
    for r in spec["requests"]:
        hit = r.get("hit")
        out[r["rid"]] = Script(
            hit_at=None if hit is None else per_rank(hit["at"], rank),
            hit_tokens=0 if hit is None else hit["tokens"],
            progress=[(per_rank(at, rank), tokens) for at, tokens in r.get("progress", [])],
            finish_at=per_rank(r.get("finish"), rank),
        )
    return out


class Scheduler:
    """The scheduler's side of the scenario on one rank."""

    def __init__(self, spec: dict, rank: int, sim, record: Record):
        self.spec, self.rank, self.sim, self.record = spec, rank, sim, record
        self.cache = sim.cache
        self.requests = {r["rid"]: r for r in spec["requests"]}
        self.index = {r["rid"]: i for i, r in enumerate(spec["requests"])}
        self.attempt: dict = {}
        self.waiting: list = []  # rids, in arrival order
        self.arrived: dict = {}  # rid -> the pass its current attempt arrived
        self.requeue_at: dict = {}  # pass -> [rid]
        self.admitted_at: dict = {}  # rid -> the pass it was last admitted
        self.adder = adder_for(self.cache)
        self.scheduler = SchedulerShim(self.cache)

    def handle(self, rid):
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        return CacheRequestHandle(rid=rid, attempt_id=self.attempt[rid])

    def arrive(self, rid: str, p: int) -> None:
        self.attempt[rid] = self.attempt.get(rid, -1) + 1
        r = self.requests[rid]
        first = (self.index[rid] * 64 + self.attempt[rid]) * TOKEN_BASE
        tokens = list(range(first, first + r["tokens"]))
        self.sim.tree.owners[first] = (rid, self.attempt[rid])
        self.record.add((rid, self.attempt[rid]), "arrived")
        self.cache.prefetch_from_storage(
            self.handle(rid),
            0,
            tokens,
            None,
            None,
            matched_prefix_tokens=[],
            extra_key=None,
            cache_salt=None,
            storage_hit_end=None,
        )
        self.waiting.append(rid)
        self.arrived[rid] = p

    def step(self, p: int) -> list:
        cache, spec = self.cache, self.spec
        for rid in self.requeue_at.pop(p, []):
            self.arrive(rid, p)
        for r in spec["requests"]:
            if r["arrive"] == p:
                self.arrive(r["rid"], p)
        for r in spec["requests"]:
            if r.get("abort") == p and r["rid"] in self.waiting:
                self.record.add((r["rid"], self.attempt[r["rid"]]), "aborted")
                cache.release_aborted_request(self.handle(r["rid"]))
                self.waiting.remove(r["rid"])
        self.sim.cc.deliver()
        self.scheduler.boundary()
        admitted = self.walk(p)
        if admitted or self.running(p):
            self.scheduler.forward_ct += 1  # the pass ran a forward
        return admitted

    def running(self, p: int) -> bool:
        """A request admitted in the last few passes is still decoding."""
        return any(at > p - 3 for at in self.admitted_at.values())

    def walk(self, p: int) -> list:
        spec, cache = self.spec, self.cache
        if p in spec.get("full", ()):
            return []
        cutoff = spec.get("cutoff", {}).get(str(p))
        admitted = []
        for rid in list(self.waiting):
            if cutoff is not None and self.arrived[rid] >= cutoff:
                break  # the batch is full from here on
            h = self.handle(rid)
            if not cache.check_prefetch_progress(h):
                continue
            loaded, start = cache.pop_prefetch_loaded_span(h)
            self.record.admitting = True  # its accounting's exit is the admission's
            try:
                admit(self.adder, h, loaded, self.requests[rid]["tokens"], start)
            finally:
                self.record.admitting = False
            key = handle_key(h)
            self.sim.tree.admit(key)
            if cache.buffer_pipeline is not None:
                cache.buffer_pipeline.consume(h)
            self.record.add(key, "admitted", loaded)
            self.waiting.remove(rid)
            admitted.append(rid)
            self.admitted_at[rid] = p
            requeue = self.requests[rid].get("requeue")
            if requeue is not None and self.attempt[rid] == 0:
                self.requeue_at.setdefault(p + 1 + requeue, []).append(rid)
        return admitted


def run_passes(spec: dict, rank: int, sim, sched, record: Record, clock) -> None:
    trace = os.environ.get("HICACHE_ASYNC_ACK_DIFF_TRACE")  # a folder: per-rank traces
    for p in range(spec["passes"]):
        clock.now = p
        sched.step(p)
        if trace:
            with open(f"{trace}/{spec['name']}-{rank}.txt", "a") as f:
                ongoing = sorted(h.rid for h in sim.cache.ongoing_prefetch)
                f.write(f"{p} {ongoing} {len(sim.cc.pops)} {sched.waiting}\n")
                f.write("".join(f"   {e}\n" for e in record.events if e[0] == p))


def run_scenario(spec: dict, rank: int, world: int, group) -> dict:
    clock = SimpleNamespace(now=-1)
    sim, record = build(spec, rank, world, group, clock)
    sim.cc.scripts = scripts_of(spec, rank)
    sim.cc.delay = per_rank(spec.get("skew", 0), rank)
    sched = Scheduler(spec, rank, sim, record)
    cache = sim.cache
    out: dict = {"plugin": plugin_loaded(cache)}
    controls = spec.get("control", []) if out["plugin"] else []
    try:
        with diff_controls.controls(controls, cache):
            run_passes(spec, rank, sim, sched, record, clock)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["error_pass"] = clock.now
    cc = sim.cc
    out.update(
        events=[
            [at, list(k) if isinstance(k, tuple) else k, kind, det]
            for at, k, kind, det in record.events
        ],
        stats={k: v for k, v in sorted(cache._prefetch_outcome_stats.items()) if v},
        metrics=dict(sorted(cache.storage_metrics_collector.totals.items())),
        pops=sorted([str(n), u] for n, u in cc.pops),
        free_pages=len(cc.pool.free_pages),
        occupied=cc.prefetch_tokens_occupied,
        waiting=sorted(sched.waiting),
        ongoing=sorted(h.rid for h in cache.ongoing_prefetch),
        votes=vote_counts(cache) if out["plugin"] else {},
    )
    return out


def vote_counts(cache) -> dict:
    from hicache_async_ack.features.prefetch_votes import FEATURE

    state = FEATURE.state_of(cache)
    if state is None:
        return {}
    names = ("sections", "stopped", "fallbacks", "provisional", "declined")
    return {k: getattr(state, k) for k in names if hasattr(state, k)}


def run_differential(ctx, payload: dict) -> dict:
    """Rank target: SGLang's load_plugins(), then each scenario on a fresh TP group."""
    return run_specs(ctx, payload, VARS, run_scenario)
