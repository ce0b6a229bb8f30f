"""The pipelined HiCache ack sync on SGLang's UnifiedRadixCache.

Everything here speaks SGLang's vocabulary (ack queues, storage control queues,
the tp / attn CP / attn TP groups) but does not know how it is attached to the
cache: whoever owns ``check_hicache_events`` and ``_sync_hicache_ready_counts``
routes them through :func:`pipelined_check_hicache_events` and
:func:`agreed_ready_counts`. Per-cache state lives in the cache's ``__dict__``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

from .core import (
    DEPTH_LIMIT,
    AutoDepth,
    Consumed,
    HiCacheAckSyncError,
    HiCacheAckSyncMismatch,
    PipelinedAckSync,
)
from .env import DEPTH_MAX, DEPTH_VAR, ENABLE_VAR, Settings, read_settings

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")

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
_STATE_ATTR = "_hicache_ack_sync_state"
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


# ------------------------------------------------------------------ eligibility
@dataclass(frozen=True)
class Decision:
    pipelined: bool
    reason: str
    group: Any = None
    world_size: int = 1
    # attention CP x TP: the (CP, attn TP) groups whose union the first step
    # checks against ``group`` (spanning_group), after the first exchange
    span: Optional[tuple[Any, Any]] = None


def world_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group=group)


def collective_groups(cache) -> list[tuple[str, Any, int]]:
    """The groups upstream's _all_reduce_attn_groups reduces over, in order."""
    groups = [
        (label, g, world_size(g))
        for label, g in (("attn CP", cache.attn_cp_group), ("attn TP", cache.attn_tp_group))
        if g is not None and world_size(g) > 1
    ]
    if not groups and cache.tp_world_size > 1:
        groups = [("TP", cache.tp_group, cache.tp_world_size)]
    return groups


def static_decision(cache) -> Decision:
    """The part of eligibility fixed for the cache's lifetime (its groups)."""
    missing = [a for a in REQUIRED_CACHE_ATTRS if not hasattr(cache, a)]
    if missing:
        return Decision(False, f"this SGLang's cache lacks {', '.join(missing)}")
    groups = collective_groups(cache)
    if not groups:
        return Decision(False, "world size 1: upstream runs no collective, nothing to hide")
    if len(groups) > 1:
        names = " x ".join(f"{label}({ws})" for label, _, ws in groups)
        (_, cp, cp_ws), (_, attn_tp, attn_tp_ws) = groups
        if cache.tp_group is None or cp_ws * attn_tp_ws != cache.tp_world_size:
            return Decision(False, no_span_reason(names))
        # Whether the union of the two is exactly the TP group needs every
        # member's groups: gathered at the first step, after the first exchange
        # (a gather here would hang a rank without the plugin, which runs none).
        span = (cp, attn_tp)
        return Decision(
            True, f"TP group, equal to {names}", cache.tp_group, cache.tp_world_size, span
        )
    label, group, ws = groups[0]
    return Decision(True, f"one {label} group", group, ws)


def no_span_reason(names: str) -> str:
    return (
        f"{names}: two collectives per step and no existing group spans exactly "
        "their ranks (DP attention?)"
    )


def spanning_group(cache, cp_group, attn_tp_group):
    """The existing group over which one MIN equals upstream's MIN over the CP
    group followed by the MIN over the attn TP group, or None.

    After the two reduces rank r holds the MIN over the union of CP(t) for t in
    TP(r). One reduce over group G gives the same iff that union is G for every
    r in G. The candidate is the cache's TP group (it contains both); the check
    needs every member's CP and TP ranks, so it gathers them over that group
    once, in the first pipelined step right after the first exchange (which ran
    on the CP and attn TP groups, as upstream's reduce does, and showed that
    every rank it reached pipelines with the same settings); every member
    reaches the same verdict from the same data. No group is created: with DP
    attention the union is smaller than the TP group and the cache stays
    blocking (decided at init from the group sizes, without gathering).
    """
    import torch.distributed as dist

    tp = cache.tp_group
    if tp is None or cache.tp_world_size <= 1:
        return None
    mine = (
        dist.get_rank(),
        sorted(dist.get_process_group_ranks(cp_group)),
        sorted(dist.get_process_group_ranks(attn_tp_group)),
    )
    gathered: list = [None] * cache.tp_world_size
    dist.all_gather_object(gathered, mine, group=tp)
    members = set(dist.get_process_group_ranks(tp))
    cp_of = {rank: set(cp) for rank, cp, _ in gathered}
    for _, _, tp_ranks in gathered:
        if not set(tp_ranks) <= cp_of.keys():
            return None
        if set().union(*(cp_of[t] for t in tp_ranks)) != members:
            return None
    return tp


def dynamic_blocker(cache) -> Optional[str]:
    """Per-step conditions (cheap attribute reads) that force the blocking path."""
    if cache.cache_controller is None:
        return "HiCache controller not attached"
    if cache.linker is not None:
        return "external cache linker attached"
    if cache.host_memory_mode != "cache":
        return f"host memory mode {cache.host_memory_mode!r} (only 'cache' pipelines)"
    if cache.pp_size != 1:
        return f"pp_size={cache.pp_size}"
    cc = cache.cache_controller
    missing = [a for a in ACK_QUEUES if not hasattr(cc, a)]
    if missing:
        return f"this SGLang's cache controller lacks {', '.join(missing)}"
    return None


# ------------------------------------------------------------------- queue views
def _queue_by_name(cc, name: Hashable):
    if isinstance(name, tuple):  # ("extra", pool_name)
        return getattr(cc, "extra_host_mem_release_queues", {}).get(name[1])
    return getattr(cc, str(name), None)


def _queue_head(q, n: int) -> list:
    if q is None:
        return []
    if isinstance(q, list):
        return q[:n]
    with q.mutex:  # queue.Queue filled by storage threads
        return list(itertools.islice(q.queue, n))


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


def head_reader(cache) -> Callable[[Hashable, int], list]:
    """``head(name, n)``: the first n entries of a queue of the cache's controller
    (whichever controller the cache holds when called)."""

    def head(name: Hashable, n: int) -> list:
        cc = cache.cache_controller
        return [] if cc is None else _queue_head(_queue_by_name(cc, name), n)

    return head


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
class _TorchHandle:
    __slots__ = ("work", "tensor")

    def __init__(self, work, tensor):
        self.work = work
        self.tensor = tensor

    def wait(self) -> list[int]:
        self.work.wait()
        return self.tensor.tolist()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def torch_min_all_reduce(group) -> Callable[[list[int]], Any]:
    """An async MIN all_reduce over ``group``, through the public
    ``torch.distributed.all_reduce(..., async_op=True)`` as upstream's blocking
    one goes: whatever wraps or patches it (tracing, fault injection, tests)
    sees our collective too. Calling the ProcessGroup's ``allreduce`` directly
    skips the wrapper's Python checks: measured at TP=4 with the two forms
    alternated (docs/bench.md), about 0.04 ms of check p50 per step, 0.5 points
    of what the blocking reduce costs above the bound, and nothing steps/s can
    tell apart on a shared host; not worth a collective that tracing, fault
    injection and patched unit tests cannot see. Tensors are preallocated and
    reused round-robin, DEPTH_LIMIT + 1 per layout, so one is never refilled
    while a reduce on it can be in flight."""
    import torch
    import torch.distributed as dist

    op = dist.ReduceOp.MIN
    rings: dict[int, Any] = {}  # layout length -> cycle of (tensor, numpy view)

    def issue(values: list[int]) -> _TorchHandle:
        ring = rings.get(len(values))
        if ring is None:
            tensors = [torch.zeros(len(values), dtype=torch.int64) for _ in range(DEPTH_LIMIT + 1)]
            ring = rings[len(values)] = itertools.cycle([(t, t.numpy()) for t in tensors])
        tensor, view = next(ring)
        view[:] = values
        return _TorchHandle(dist.all_reduce(tensor, op=op, group=group, async_op=True), tensor)

    return issue


def upstream_reduce(cache) -> Callable[[list[int]], list[int]]:
    """A blocking MIN-reduce through the cache's own ``_all_reduce``: upstream's
    shape on upstream's groups (attn CP then attn TP, as its ready-count sync)."""
    import torch

    def reduce(values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        cache._all_reduce(tensor, torch.distributed.ReduceOp.MIN)
        return [int(v) for v in tensor.tolist()]

    return reduce


# group -> Collective; tests and the bench swap in their own collective here.
collective_factory: Callable[[Any], Callable[[list[int]], Any]] = torch_min_all_reduce


class CacheState:
    """What is kept per UnifiedRadixCache.

    ``blocker``, when given, keeps this cache on the blocking path for its
    lifetime (the caller knows why); ``tag`` ends the log line (who pipelines,
    and which version); ``hints`` override :data:`MISMATCH_HINTS`."""

    def __init__(
        self,
        cache,
        settings: Settings,
        blocker: Optional[str] = None,
        tag: str = "",
        hints: Optional[dict[str, str]] = None,
    ):
        self.settings = settings
        self.tag = tag
        # Metrics sink (on_path / on_step / on_failure); None costs the step nothing.
        self.metrics: Any = None
        self.static = Decision(False, blocker) if blocker else static_decision(cache)
        self.sync: Optional[PipelinedAckSync] = None
        if self.static.pipelined:
            self.sync = PipelinedAckSync(
                collective_factory(self.static.group),
                settings.depth,
                auto=AutoDepth(hi=DEPTH_MAX) if settings.auto else None,
                hints={**MISMATCH_HINTS, **(hints or {})},
            )
        self.head = head_reader(cache)
        self.greeted = False  # the first exchange ran (first pipelined step)
        self.in_pipelined_step = False
        self.due: Optional[Consumed] = None
        self.due_taken = False  # upstream asked for this step's counts already
        self._announced: Optional[tuple] = None
        self._last: Optional[Decision] = None

    def decide(self, cache) -> Decision:
        if not self.settings.enabled:
            return Decision(False, f"{ENABLE_VAR}=0")
        if not self.static.pipelined:
            return self.static
        blocker = dynamic_blocker(cache)
        if blocker:
            return Decision(False, blocker)
        return self.static

    def announce(self, decision: Decision) -> None:
        """One line per rank (and one more on each change of path). Called every
        step, so it compares before it formats."""
        if decision is self._last:  # the static decision, step after step
            return
        self._last = decision
        key = (decision.pipelined, decision.reason)
        if key == self._announced:
            return
        self._announced = key
        if self.metrics is not None:
            now = self.sync.depth if self.sync else 0
            self.metrics.on_path(decision.pipelined, now, decision.world_size)
        tag = f"; {self.tag}" if self.tag else ""
        depth = f"auto from {self.settings.depth}" if self.settings.auto else self.settings.depth
        line = (
            f"HiCache ack sync: pipelined over the {decision.reason} "
            f"(world size {decision.world_size}, depth {depth}{tag})"
            if decision.pipelined
            else f"HiCache ack sync: blocking (upstream path) because {decision.reason}"
            + (f" ({self.tag})" if self.tag else "")
        )
        logger.info(line)

    def depth_changed(self, before: int, after: int) -> None:
        """Auto depth moved (on every rank at this step): say so once."""
        why = "a rank waited on the due reduce" if after > before else "reduces finish sooner"
        logger.info("HiCache ack sync: auto depth %d -> %d (%s)", before, after, why)
        if self.metrics is not None:
            self.metrics.on_path(True, after)


def announce_path(state, decision: Decision, what: str, detail: str, log) -> None:
    """The prefetch votes' and the decode offload sync's path line: once per rank,
    again on each change of path, with their ``pipelined`` gauge set alike."""
    key = (decision.pipelined, decision.reason)
    if key == state.announced:
        return
    state.announced = key
    if state.metrics is not None:
        state.metrics.on_path(decision.pipelined)
    if decision.pipelined:
        log.info(
            "%s: pipelined over the %s (world size %d%s)",
            what, decision.reason, decision.world_size, detail,
        )  # fmt: skip
    else:
        log.info("%s: blocking (upstream path) because %s", what, decision.reason)


def state_of(cache) -> Optional[CacheState]:
    return cache.__dict__.get(_STATE_ATTR)


def attach_state(
    cache,
    blocker: Optional[str] = None,
    tag: str = "",
    settings: Optional[Settings] = None,
    hints: Optional[dict[str, str]] = None,
) -> CacheState:
    """Create the cache's state (``settings`` default to the environment's)."""
    settings = read_settings() if settings is None else settings
    state = CacheState(cache, settings, blocker, tag, hints)
    cache.__dict__[_STATE_ATTR] = state
    return state


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
    sync.greet(len(ready), digest, upstream_reduce(cache))
    state.greeted = True
    if span is not None and spanning_group(cache, *span) is None:
        names = state.static.reason.removeprefix("TP group, equal to ")
        state.static = Decision(False, no_span_reason(names))
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
