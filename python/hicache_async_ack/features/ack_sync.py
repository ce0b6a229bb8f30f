"""The pipelined HiCache ack sync on SGLang's UnifiedRadixCache.

Everything here speaks SGLang's vocabulary (ack queues, storage control queues,
the tp / attn CP / attn TP groups) but does not know how it is attached to the
cache: whoever owns ``check_hicache_events`` and ``_sync_hicache_ready_counts``
routes them through :func:`pipelined_check_hicache_events` and
:func:`agreed_ready_counts`. Per-cache state lives in the cache's ``__dict__``.
"""

from __future__ import annotations

from typing import Hashable, Optional

from .. import __version__
from ..adapter import (
    Collectives,
    Decision,
    Feature,
    FeatureState,
    Hook,
    announce_path,
    blocking,
    group_decision,
    head_reader,
    hook,
    keep_state,
    logger,
    missing_attrs,
    no_span_reason,
    spanning_group,
    unhooked,
)
from ..core import AutoDepth, Consumed, PipelinedAckSync
from ..env import DEPTH_MAX, DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR, Settings, read_settings
from ..guard import CACHE_CLASS
from ..stamp import HiCacheAckSyncError, HiCacheAckSyncMismatch

ACK_QUEUES = ("ack_write_queue", "ack_load_queue")
STORAGE_QUEUES = (  # upstream's tensor order after the two ack counts
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)
# Instance attributes read per cache (checked when the cache is first seen).
REQUIRED_CACHE_ATTRS = (
    "cache_controller",
    "linker",
    "host_memory_mode",
    "pp_size",
    "tp_group",
    "tp_world_size",
    "attn_cp_group",
    "attn_tp_group",
    "enable_storage",
    "tree_core",
)
STATE_ATTR = "_hicache_ack_sync_state"
# What an operator should do when the ranks of a group disagree (core.Stamp fields).
MISMATCH_HINTS = {
    "depth": f"Set {DEPTH_VAR} identically on every node of the TP group.",
    "auto": f"Set {DEPTH_VAR} identically on every node of the TP group.",
    "protocol": "Run the same version of the pipelined HiCache ack sync on every node.",
    "stock": (
        "that rank does not pipeline: the pipelined ack sync is not there, "
        f"{ENABLE_VAR}=0 is set there, or its cache is not eligible (its log line says "
        "why). Give every node of the TP group the same install and the same settings."
    ),
}


# ------------------------------------------------------------------- queue views
def ready_entries(cache) -> tuple[dict[Hashable, list], int]:
    """Entries ready now at the head of each queue, in upstream's tensor order
    (fresh lists: the core keeps them until the reduce is consumed), and the
    write_back duplicate-reclaim digest."""
    cc = cache.cache_controller
    count = cache._count_ready_acks
    w, ld = cc.ack_write_queue, cc.ack_load_queue
    ready: dict[Hashable, list] = {ACK_QUEUES[0]: w[: count(w)], ACK_QUEUES[1]: ld[: count(ld)]}
    if cache.enable_storage:
        for name in STORAGE_QUEUES:
            q = getattr(cc, name)
            with q.mutex:  # every queued storage entry counts; size and refs at once
                ready[name] = list(q.queue)
        for pool, q in getattr(cc, "extra_host_mem_release_queues", {}).items():
            with q.mutex:
                ready[("extra", pool)] = list(q.queue)
    return ready, int(cache.tree_core.write_back_duplicate_reclaim_digest)


def upstream_counts(consumed: Optional[Consumed]):
    """A Consumed as upstream's _sync_hicache_ready_counts return value."""
    if consumed is None:
        return 0, 0, (), ()
    pops = consumed.pops
    if len(pops) == 2:  # storage off: the two ack queues only
        return pops["ack_write_queue"], pops["ack_load_queue"], (), ()
    storage = tuple(pops[n] for n in pops if n not in ACK_QUEUES)
    extra = tuple(n[1] for n in pops if isinstance(n, tuple))
    return pops["ack_write_queue"], pops["ack_load_queue"], storage, extra


def pop_agreed(cache, consumed: Consumed) -> None:
    """Pop a consumed agreement through upstream's own methods (stand-down path)."""
    write, load, storage, extra = upstream_counts(consumed)
    cache.writing_check(finish_count=write)
    cache.loading_check(finish_count=load)
    if cache.enable_storage and storage:
        cache._drain_storage_control_queues_impl(
            n_storage_hit=storage[0],
            n_ack_prefetch=storage[1],
            n_backup=storage[2],
            n_release=storage[3],
            extra_release_counts=dict(zip(extra, storage[4:])),
            log_metrics=True,
        )


# ----------------------------------------------------------------- per-cache state
def static_decision(cache) -> Decision:
    """The part of eligibility fixed for the cache's lifetime (its groups)."""
    return missing_attrs(cache, REQUIRED_CACHE_ATTRS) or group_decision(cache)


def dynamic_blocker(cache) -> Optional[Decision]:
    """Per-step conditions (cheap attribute reads) that force the blocking path."""
    if cache.cache_controller is None:
        return blocking("HiCache controller not attached", "no_controller")
    if cache.linker is not None:
        return blocking("external cache linker attached", "linker")
    if cache.host_memory_mode != "cache":
        return blocking(
            f"host memory mode {cache.host_memory_mode!r} (only 'cache' pipelines)",
            "host_memory_mode",
        )
    if cache.pp_size != 1:
        return blocking(f"pp_size={cache.pp_size}", "pp")
    cc = cache.cache_controller
    missing = [a for a in ACK_QUEUES if not hasattr(cc, a)]
    if missing:
        return blocking(
            f"this SGLang's cache controller lacks {', '.join(missing)}", "missing_attrs"
        )
    return None


class CacheState(FeatureState):
    """What is kept per UnifiedRadixCache.

    ``blocker``, when given, keeps this cache on the blocking path for its
    lifetime (the caller knows why); ``tag`` ends the log line (who pipelines,
    and which version); ``hints`` override :data:`MISMATCH_HINTS`."""

    feature = "ack_counts"

    def __init__(
        self,
        cache,
        settings: Settings,
        blocker: Optional[Decision] = None,
        tag: str = "",
        hints: Optional[dict[str, str]] = None,
        coll: Optional[Collectives] = None,
    ):
        super().__init__(blocker or static_decision(cache), coll)
        self.settings = settings
        self.tag = tag
        self.sync: Optional[PipelinedAckSync] = None
        if self.static.pipelined:
            self.sync = PipelinedAckSync(
                self.collectives.async_min(self.static.group),
                settings.depth,
                auto=AutoDepth(hi=DEPTH_MAX) if settings.auto else None,
                hints={**MISMATCH_HINTS, **(hints or {})},
            )
        self.head = head_reader(cache)
        self.greeted = False  # the first exchange ran (first pipelined step)
        self.in_pipelined_step = False
        self.due: Optional[Consumed] = None
        self.due_taken = False  # upstream asked for this step's counts already
        self._last: Optional[Decision] = None

    def decide(self, cache) -> Decision:
        if not self.settings.enabled:
            return blocking(f"{ENABLE_VAR}=0", "disabled_by_env")
        if not self.static.pipelined:
            return self.static
        return dynamic_blocker(cache) or self.static

    def path_metrics(self, decision: Decision) -> None:
        now = self.sync.depth if self.sync else 0
        self.metrics.on_path(decision.pipelined, now, decision.world_size)

    def path_line(self, decision: Decision) -> str:
        tag = f"; {self.tag}" if self.tag else ""
        depth = f"auto from {self.settings.depth}" if self.settings.auto else self.settings.depth
        if decision.pipelined:
            return (
                f"HiCache ack sync: pipelined over the {decision.reason} "
                f"(world size {decision.world_size}, depth {depth}{tag})"
            )
        return f"HiCache ack sync: blocking (upstream path) because {decision.reason}" + (
            f" ({self.tag})" if self.tag else ""
        )

    def announce(self, decision: Decision) -> None:
        """Called every step: the static decision, step after step, costs one test."""
        if decision is self._last:
            return
        self._last = decision
        announce_path(self, decision)

    def depth_changed(self, before: int, after: int, pipelined: bool = True) -> None:
        """Auto depth moved (on every rank at this step): say so once, also when
        it moved on the reduces drained while standing down (the gauge then
        stays 0, as on the blocking path, and shows the depth on the way back)."""
        why = "a rank waited on the due reduce" if after > before else "reduces finish sooner"
        where = "" if pipelined else ", while standing down"
        logger.info("HiCache ack sync: auto depth %d -> %d (%s%s)", before, after, why, where)
        if self.metrics is not None:
            self.metrics.on_path(pipelined, after)


def state_of(cache) -> Optional[CacheState]:
    return cache.__dict__.get(STATE_ATTR)


def attach_state(
    cache,
    blocker: Optional[Decision] = None,
    tag: str = "",
    settings: Optional[Settings] = None,
    hints: Optional[dict[str, str]] = None,
) -> CacheState:
    """Create the cache's state (``settings`` default to the environment's)."""
    settings = read_settings() if settings is None else settings
    return keep_state(cache, STATE_ATTR, CacheState(cache, settings, blocker, tag, hints))


# ----------------------------------------------------------------- the step
def pipelined_check_hicache_events(state: CacheState, cache, original, *args, **kwargs):
    """One scheduler step: consume the due reduce, run upstream's
    check_hicache_events with the agreed counts, then issue the next reduce.

    In five parts: 2 (consume) and 5 (issue) are the ack sync's; 1, 3 and 4 are
    the cache's own code: it reaps PP work, flushes backups, calls
    _sync_hicache_ready_counts (answered by :func:`agreed_ready_counts`), pops
    through writing_check / loading_check / the storage drain and flushes
    buffers."""
    decision = state.decide(cache)
    state.announce(decision)
    sync = state.sync
    if not decision.pipelined:
        if sync is not None and sync.pending:
            # Consume what is in flight first so every rank leaves the pipelined
            # path with the same pops; the blocking path then syncs the rest.
            drained = sync.drain(state.head)
            if drained is not None:
                if drained.depth_change is not None:  # moved while standing down
                    state.depth_changed(*drained.depth_change, pipelined=False)
                pop_agreed(cache, drained)
        return original(cache, *args, **kwargs)
    assert sync is not None  # a pipelined decision always has a sync
    try:
        if not state.greeted and not first_exchange(state, sync, cache):
            return original(cache, *args, **kwargs)  # the layout check said blocking
        return _step(state, sync, cache, original, *args, **kwargs)
    except HiCacheAckSyncError as exc:
        if state.metrics is not None:
            reason = "mismatch" if isinstance(exc, HiCacheAckSyncMismatch) else "failure"
            state.metrics.on_failure(reason)
        # said here too: the scheduler may die on the next collective's error
        logger.error("%s", exc)
        raise


def first_exchange(state: CacheState, sync: PipelinedAckSync, cache) -> bool:
    """The first pipelined step starts with one blocking exchange carrying the
    stamp, in upstream's shape and on upstream's groups, before this rank runs
    any collective the blocking path would not: a peer that does not pipeline
    (or pipelines with other settings) pairs with it collective for collective
    and every rank names the disagreement now, not at a later consume (by then
    a stock peer has died on upstream's digest assert and the next collective
    fails on a closed connection, or with CP x TP the ranks wait on different
    groups until the group timeout). It goes through upstream's own
    _all_reduce, which picks the groups as the blocking path does (attention CP
    then attention TP, or the TP group). With CP x TP, the check that the TP
    group spans both follows. False when that check keeps the cache blocking
    (the same verdict on every rank)."""
    ready, digest = ready_entries(cache)
    span = state.static.span
    sync.greet(len(ready), digest, state.collectives.blocking_min(cache))
    state.greeted = True
    if span is not None and spanning_group(cache, *span) is None:
        names = state.static.reason.removeprefix("TP group, equal to ")
        state.static = blocking(no_span_reason(names), "no_span")
        state.sync = None
        state.announce(state.decide(cache))
        return False
    return True


def _step(state: CacheState, sync: PipelinedAckSync, cache, original, *args, **kwargs):
    metrics = state.metrics  # None: nothing is timed or recorded
    clock = sync.clock  # time.perf_counter, or a test's model clock
    t0 = clock() if metrics is not None else 0.0
    # Step 2: wait on the due reduce (normally long complete) and reconcile it.
    state.due = due = sync.consume_due(state.head)
    t1 = clock() if metrics is not None else 0.0
    if due is not None and due.depth_change is not None:
        state.depth_changed(*due.depth_change)
    state.due_taken = False
    state.in_pipelined_step = True
    try:
        result = original(cache, *args, **kwargs)
    finally:
        state.in_pipelined_step = False
        state.due = None
    # Step 5, after the pops: count what is ready now and put it in flight.
    t2 = clock() if metrics is not None else 0.0
    ready, digest = ready_entries(cache)
    sync.issue(ready, digest)
    if metrics is not None:  # the wait only for steps that had a reduce due
        waited = None if due is None else t1 - t0
        metrics.on_step(waited, clock() - t2, due.pops if due else {})
    return result


def agreed_ready_counts(state: Optional[CacheState], cache, original, *args, **kwargs):
    """_sync_hicache_ready_counts: inside a pipelined step, the agreement
    consumed at the top of the step instead of the blocking all_reduce;
    anywhere else, upstream's."""
    if state is None or not state.in_pipelined_step:
        return original(cache, *args, **kwargs)
    if state.due_taken:
        # Handing out the same agreement twice would pop twice as many entries
        # as the group agreed on. Stop before upstream pops anything more.
        raise HiCacheAckSyncError(
            "HiCache ack sync: _sync_hicache_ready_counts was called twice in one "
            "check_hicache_events step; the pipelined step hands out one agreement "
            "per step. Nothing more was popped; this SGLang's check_hicache_events "
            "does not match what the ack sync was written for."
        )
    state.due_taken = True
    return upstream_counts(state.due)


# ------------------------------------------------------------------------ hooks
# Target: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.
# Upstream PR: sglang #39903 (pipeline the HiCache ack-count all_reduce).
# Removable when upstream merges an equivalent (`hicache-async-ack-lab upstream-patch`
# writes this feature as such a patch); the guard already stands down on a tree
# that carries it.
TAG = f"hicache-async-ack {__version__}"
STOCK_HINT = (
    "that rank does not pipeline: hicache-async-ack is not installed or not loaded "
    f"there (e.g. {PLUGINS_VAR} excludes it), {ENABLE_VAR}=0 is set there, or its cache "
    "is not eligible (its log line says why). Give every node of the TP group the same "
    "install and the same settings."
)
HOOKED = ("check_hicache_events", "_sync_hicache_ready_counts")


def attach(cache) -> CacheState:
    """Build the cache's state; a cache whose hooks are not in place stays blocking."""
    problem = unhooked(type(cache), HOOKED)
    blocker = blocking(problem, "hooks_missing") if problem else None
    return attach_state(cache, blocker, TAG, hints={"stock": STOCK_HINT})


def metrics_for(cache):
    """The sync's metrics, labelled like the cache's other metrics and created
    through the same collector classes; None (logged) if they cannot be made."""
    from ..metrics import metrics_for_labels

    collector = getattr(cache, "metrics_collector", None)
    labels = getattr(collector, "labels", None)
    metrics = metrics_for_labels(labels or {"cache_type": type(cache).__name__}, collector)
    pools = getattr(getattr(cache, "cache_controller", None), "extra_host_mem_release_queues", {})
    if metrics is not None and pools:
        metrics.add_queues(("extra", pool) for pool in pools)
    return metrics


def metrics_wanted(args, kwargs) -> bool:
    """Whether init_hicache(server_args, params) was called with --enable-metrics."""
    params = kwargs.get("params", args[1] if len(args) > 1 else None)
    return bool(getattr(params, "enable_metrics", False))


@hook
def after_init_hicache(result, cache, *args, **kwargs):
    """init_hicache, AFTER.
    Why: the per-cache decision needs the controller and groups init builds.
    How: builds the cache's state (eligibility from local facts only: no
    collective here, a peer without the plugin would run none; metrics with
    --enable-metrics, never raising) and logs one line: pipelined or blocking,
    and why.
    Stands down: never fails init; an ineligible cache (PP, buffer_only, a
    linker, world size 1, DP attention CP x TP) just decides blocking."""
    state = attach(cache)
    if metrics_wanted(args, kwargs):
        state.metrics = metrics_for(cache)
    state.announce(state.decide(cache))
    return result


@hook
def around_check_hicache_events(original, cache, *args, **kwargs):
    """check_hicache_events, AROUND.
    Why: the blocking all_reduce inside it sits right before the next forward.
    How: the first pipelined step starts with one blocking exchange through the
    cache's own _all_reduce (upstream's shape and groups) carrying the stamp,
    so ranks that disagree stop there (then, for CP x TP, the layout check).
    Every step: consume the reduce issued k steps ago, run upstream's own
    method (its pops go through writing_check / loading_check / the storage
    drain), then count what is ready and issue the next reduce, async.
    Stands down: calls the original when the cache decides blocking (drains the
    reduces in flight first, so every rank leaves with the same pops)."""
    state = state_of(cache)
    if state is None:  # init_hicache hook missing (or a cache built another way)
        state = attach(cache)
    return pipelined_check_hicache_events(state, cache, original, *args, **kwargs)


@hook
def around_sync_hicache_ready_counts(original, cache, *args, **kwargs):
    """_sync_hicache_ready_counts, AROUND.
    Why: upstream's check takes its counts from here; that is where the
    blocking reduce runs.
    How: inside a pipelined step, returns the consumed agreement, once per step
    (a second call raises before anything more is popped).
    Stands down: everywhere else (loading_check's callers, blocking caches)."""
    return agreed_ready_counts(state_of(cache), cache, original, *args, **kwargs)


FEATURE = Feature(
    "ack_counts",
    (
        Hook(CACHE_CLASS, "init_hicache", "AFTER", after_init_hicache),
        Hook(CACHE_CLASS, "check_hicache_events", "AROUND", around_check_hicache_events),
        Hook(CACHE_CLASS, "_sync_hicache_ready_counts", "AROUND", around_sync_hicache_ready_counts),
    ),
    order=(
        "registered first: its check_hicache_events AROUND is then the innermost "
        "wrapper, so the prefetch votes' AFTER hook sees the pass after the ack "
        "pops (completed prefetches already drained)"
    ),
)
