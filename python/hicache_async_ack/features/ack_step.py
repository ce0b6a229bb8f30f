"""The ack sync's pipelined step on SGLang's UnifiedRadixCache, and the views
of the cache it needs (ready entries, upstream's return value, its pops).

``check_hicache_events`` runs in five parts: 2 (consume) and 5 (issue) are the
ack sync's; 1, 3 and 4 are the cache's own code: it reaps PP work, flushes
backups, calls ``_sync_hicache_ready_counts`` (answered by
:func:`agreed_ready_counts`), pops through ``writing_check`` / ``loading_check``
/ the storage drain and flushes buffers. Riders (the prefetch votes) read their
sections after part 2 and add the next ones in part 5.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable, Optional

from ..kit.decision import blocking
from ..kit.groups import no_span_reason, spanning_group
from ..names import ACK_QUEUES, EXTRA_POOL_QUEUES, STORAGE_QUEUES
from ..protocol.reduce import Consumed
from ..protocol.stamp import HiCacheAckSyncError

# The layout flag the ack sync owns in its reduce ([f, -f] after the stamp);
# riders (kit.feature.Rider) add theirs.
STORAGE_FLAG = 0
ACK_FLAGS = {STORAGE_FLAG: "a storage backend attached (the four storage queue counts)"}


# ------------------------------------------------------------------- queue views
def ready_entries(cache, storage: Optional[bool] = None) -> tuple[dict[Hashable, list], int]:
    """Entries ready now at the head of each queue, in upstream's tensor order
    (fresh lists: the core keeps them until the reduce is consumed), and the
    write_back duplicate-reclaim digest. ``storage``: whether the reduce counts
    the storage queues (the group's agreed layout; default: this rank's
    ``enable_storage``, upstream's own shape). Counted while this rank's storage
    is off, they are empty; left out while the group has not agreed on them,
    their entries wait (they only accumulate)."""
    cc = cache.cache_controller
    count = cache._count_ready_acks
    w, ld = cc.ack_write_queue, cc.ack_load_queue
    ready: dict[Hashable, list] = {ACK_QUEUES[0]: w[: count(w)], ACK_QUEUES[1]: ld[: count(ld)]}
    if cache.enable_storage if storage is None else storage:
        live = cache.enable_storage
        for name in STORAGE_QUEUES:
            ready[name] = queue_entries(getattr(cc, name, None) if live else None)
        for pool, q in getattr(cc, EXTRA_POOL_QUEUES, {}).items():
            ready[("extra", pool)] = queue_entries(q if live else None)
    return ready, int(cache.tree_core.write_back_duplicate_reclaim_digest)


def queue_entries(q) -> list:
    """Every entry of a storage queue.Queue, under its mutex (size and refs at once)."""
    if q is None:
        return []
    with q.mutex:
        return list(q.queue)


def upstream_counts(consumed: Optional[Consumed]):
    """A Consumed as upstream's _sync_hicache_ready_counts return value."""
    if consumed is None:
        return 0, 0, (), ()
    pops = consumed.pops
    if len(pops) == len(ACK_QUEUES):  # storage off: the two ack queues only
        return pops[ACK_QUEUES[0]], pops[ACK_QUEUES[1]], (), ()
    storage = tuple(pops[n] for n in pops if n not in ACK_QUEUES)
    extra = tuple(n[1] for n in pops if isinstance(n, tuple))
    return pops[ACK_QUEUES[0]], pops[ACK_QUEUES[1]], storage, extra


def pop_agreed(cache, pops: dict) -> None:
    """Pop an agreement's counts through upstream's own methods (the stand-down
    path, and the older reduces of a step that consumes several)."""
    write, load, storage, extra = upstream_counts(Consumed(pops, {}, 0))
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


# ----------------------------------------------------------------- the step
def check_hicache_events(state, cache, original, *args, **kwargs):
    """One scheduler step: consume the due reduce, run upstream's
    check_hicache_events with the agreed counts, then issue the next reduce."""
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
                adopt_layout(state, drained)
                for pops, tails in drained.parts:  # each reduce's sections, then its pops
                    take_sections(state, cache, tails)
                    pop_agreed(cache, pops)
                for rider in state.riders:
                    rider.after_pops(cache)
        return original(cache, *args, **kwargs)
    assert sync is not None  # a pipelined decision always has a sync
    try:
        if not state.agreed and not first_exchange(state, cache):
            return original(cache, *args, **kwargs)  # the layout check said blocking
        return pipelined_step(state, cache, original, *args, **kwargs)
    except HiCacheAckSyncError as exc:
        state.failed(exc)
        raise


def first_exchange(state, cache) -> bool:
    """The first pipelined step starts with one blocking exchange carrying the
    stamp, in upstream's shape and on upstream's groups, before this rank runs
    any collective the blocking path would not: a peer that does not pipeline
    (or pipelines with other settings) pairs with it collective for collective
    and every rank names the disagreement now, not at a later consume (by then
    a stock peer has died on upstream's digest assert and the next collective
    fails on a closed connection, or with CP x TP the ranks wait on different
    groups until the group timeout). It goes through upstream's own
    _all_reduce, which picks the groups as the blocking path does (attention CP
    then attention TP, or the TP group). It also carries the layout flags (this
    rank's storage and every rider's settings), so the first pipelined reduce
    is laid out as the group agreed. With CP x TP, the check that the TP group
    spans both follows. False when that check keeps the cache blocking (the
    same verdict on every rank)."""
    ready, digest = ready_entries(cache)
    span = state.static.span
    reduce = state.collectives.blocking_min(cache)
    state.layout = state.sync.first_exchange(len(ready), digest, reduce, state.local_flags(cache))
    state.agreed = True
    if span is not None and spanning_group(cache, *span) is None:
        names = state.static.reason.removeprefix("TP group, equal to ")
        state.static = blocking(no_span_reason(names), "no_span")
        state.sync = None
        state.announce(state.decide(cache))
        return False
    return True


def pipelined_step(state, cache, original, *args, **kwargs):
    sync = state.sync
    metrics = state.metrics  # None: nothing is timed or recorded
    clock = sync.clock  # time.perf_counter, or a test's model clock
    t0 = clock() if metrics is not None else 0.0
    # Part 2: wait on the due reduce (normally long complete) and reconcile it;
    # the riders read their sections first (a disagreement stops before any pop).
    state.due = due = sync.consume_due(state.head)
    t1 = clock() if metrics is not None else 0.0
    if due is not None:
        if due.depth_change is not None:
            state.depth_changed(*due.depth_change)
        adopt_layout(state, due)
        # Several reduces when the depth was lowered: each one's sections are read
        # (and their decisions made) before its own pops, as stock ordered them.
        for pops, tails in due.parts[:-1]:
            take_sections(state, cache, tails)
            pop_agreed(cache, pops)
        newest, tails = due.parts[-1]
        take_sections(state, cache, tails)
        if len(due.parts) > 1:
            state.due = replace(due, pops=newest)  # upstream pops the newest's alone
    state.due_taken = False
    state.in_pipelined_step = True
    try:
        result = original(cache, *args, **kwargs)
    finally:
        state.in_pipelined_step = False
        state.due = None
    for rider in state.riders:
        rider.after_pops(cache)
    # Part 5, after the pops: count what is ready now and put it in flight, in
    # the layout the group agreed on, with the riders' sections.
    t2 = clock() if metrics is not None else 0.0
    ready, digest = ready_entries(cache, bool(state.layout >> STORAGE_FLAG & 1))
    tail: list[int] = []
    tokens = []
    for rider in state.riders:
        if state.layout >> rider.layout_bit & 1:
            values, token = rider.section(cache)
            tail += values
            tokens.append((rider, token, len(values)))
        else:
            rider.no_section(cache)
    sync.issue(ready, digest, state.local_flags(cache), tail, tokens)
    if metrics is not None:  # the wait only for steps that had a reduce due
        waited = None if due is None else t1 - t0
        metrics.on_step(waited, clock() - t2, due.pops if due else {})
    return result


def adopt_layout(state, consumed: Consumed) -> None:
    """The newest agreed layout (every rank consumes the same reduces at the
    same step, so every rank switches layout at the same step)."""
    if consumed.flags is not None:
        state.layout = consumed.flags


def take_sections(state, cache, tails: list) -> None:
    """Hand each rider its reduced sections of one reduce (before its pops: a
    rider may raise, or make decisions that belong before them)."""
    for tokens, reduced in tails:
        at = 0
        for rider, token, width in tokens:
            rider.take(cache, token, reduced[at : at + width])
            at += width


def agreed_ready_counts(state, cache, original, *args, **kwargs):
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
