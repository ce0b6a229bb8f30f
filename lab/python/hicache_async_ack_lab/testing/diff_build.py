"""How a differential scenario's rank is built (:mod:`.differential`): SGLang's real
``UnifiedRadixCache`` on the lifecycle's controller
(:class:`~hicache_async_ack_lab.sim.lifecycle.LifecycleController`) and tree core
(:class:`~hicache_async_ack_lab.sim.host_tree.HostTree`), what upstream's methods
read of it, the recorders around upstream's exits (instance attributes: the
plugin's hooks sit on the class), each rank's storage scripts, and the plugin
registered on it with the scenario's controls."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

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
from hicache_async_ack_lab.sim.sched_shim import KVAllocator
from hicache_async_ack_lab.testing import diff_controls

FAMILY_BASE = 900_000_000  # a family's shared prefix tokens from (f + 1) * FAMILY_BASE


def family_tokens(family: int, n: int) -> list[int]:
    """The first ``n`` tokens of family ``family``'s shared prefix (a system prompt)."""
    base = (family + 1) * FAMILY_BASE
    return list(range(base, base + n))


class StampedLog(EventLog):
    """The plugin's events, each with the driver's pass (``at``) beside its own."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def __call__(self, kind: str, /, **fields: object) -> None:
        super().__call__(kind, at=self.clock.now, **fields)


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
    from sglang.srt.mem_cache.unified_radix_cache import StorageExistenceCache
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
        storage_existence_cache=StorageExistenceCache(),
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
        # the scenario's pass clock: auto depth sees no wall-clock wait, so it moves the
        # same way on every run (a wait in passes is 0 within a pass)
        with installed(log, controls, clock=lambda: float(clock.now)):
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
