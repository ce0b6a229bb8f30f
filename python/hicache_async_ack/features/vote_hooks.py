"""The prefetch votes' hooks, each with its notes, on UnifiedRadixCache and the
scheduler's side; each hands the call to :class:`~.prefetch_votes.PrefetchVoteState`."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence, cast

from ..guard import CACHE_CLASS
from ..kit.hooks import Fn
from ..kit.views import Adder, Cache, Operation, Request, Scheduler
from .prefetch_votes import ADDER_CLASS, FEATURE, SCHEDULER_CLASS, PrefetchVoteState, votes_of
from .vote_starts import Remainder

# Target: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.
# Upstream PR: sglang #33029 (prefetch progress once per pass); #30760: the loop skew.
# Removal: when upstream decides deadlines without a collective per request reached.


@FEATURE.hook(CACHE_CLASS, "init_hicache", "AFTER")
def after_init_hicache(result: object, cache: Cache, *args: object, **kwargs: object) -> Any:
    """init_hicache, AFTER (after the ack sync's: its state is the carrier).
    Why: the per-cache vote state (and its metrics) needs what init builds.
    How: builds it as a rider of the ack sync's reduce; path logged at the first pass.
    Stands down: never fails init."""
    FEATURE.attach(cache, args, **kwargs)
    return result


@FEATURE.hook(CACHE_CLASS, "check_hicache_events", "BEFORE")
def before_check_hicache_events(cache: Cache, *args: object, **kwargs: object) -> None:
    """check_hicache_events, BEFORE (outside the ack sync's AROUND).
    Why: the pass boundary; upstream's carrier needs the votes' own first exchange.
    How: releases the last pass's pins; picks the carrier; once, that first exchange.
    Stands down: not eligible, or the ack sync carries them (its exchange agrees)."""
    FEATURE.ensure(cache).begin_pass(cache, FEATURE.carrier_of(cache))


@FEATURE.hook(CACHE_CLASS, "check_hicache_events", "AFTER")
def after_check_hicache_events(
    result: object, cache: Cache, *args: object, **kwargs: object
) -> Any:
    """check_hicache_events, AFTER.
    Why: the scheduler runs it once per pass, before its walk: the boundary.
    How: an interval no section carried is dropped; logs the path on a change.
    Stands down: no storage, policy, PP, world size 1, linker, setting off, guard."""
    FEATURE.ensure(cache).end_pass(cache)
    return result


@FEATURE.hook(CACHE_CLASS, "_sync_hicache_ready_counts", "AROUND")
def around_sync_hicache_ready_counts(
    original: Fn, cache: Cache, *args: object, **kwargs: object
) -> Any:
    """_sync_hicache_ready_counts, AROUND (nested outside the ack sync's, kit.hooks).
    Why: with the ack sync blocking (buffer_only) its reduce is the pass's collective.
    How: the votes' section rides that reduce, its stops made before upstream pops.
    Stands down: whenever the ack sync carries the votes or they are off."""
    state = votes_of(cache)
    if state is None:
        return original(cache, *args, **kwargs)
    return state.ride_upstream(cache, original)


@FEATURE.hook(CACHE_CLASS, "_can_terminate_prefetch", "AROUND")
def around_can_terminate_prefetch(
    original: Fn, cache: Cache, op: Operation, *a: object, **k: object
) -> Any:
    """_can_terminate_prefetch, AROUND.
    Why: stock ends a prefetch here (timeout: one blocking MAX per request reached).
    How: in a held walk notes the reach and vote, answers no; yes for a verdict's stop.
    Stands down: calls the original outside a held walk or policy."""
    state = votes_of(cache)
    if state is None:
        return original(cache, op, *a, **k)
    return state.reach(cache, original, op)


@FEATURE.hook(CACHE_CLASS, "prefetch_from_storage", "AROUND")
def around_prefetch_from_storage(
    original: Fn,
    cache: Cache,
    request: Hashable,
    anchor: object,
    tokens: Sequence[int],
    *a: object,
    **k: object,
) -> Any:
    """prefetch_from_storage, AROUND.
    Why: a read in flight from this anchor may bring the remainder's first pages to the
    host, and lands here depth + 1 passes after stock's walk landed it (issue 52).
    How: such a start is held (vote_starts) and runs again, through the scheduler's
    _prefetch_kvcache, where its pass's decisions land (read once: where that read lands).
    Stands down: no held walk, buffer_only, a start not from _prefetch_kvcache."""
    state = votes_of(cache)
    if state is None:
        return original(cache, request, anchor, tokens, *a, **k)
    # upstream passes these by keyword; positionally they follow last_hash, prefix_keys,
    # matched_prefix_tokens (the guard checks the parameters)
    extra_key = k["extra_key"] if "extra_key" in k else (a[3] if len(a) > 3 else None)
    cache_salt = k["cache_salt"] if "cache_salt" in k else (a[4] if len(a) > 4 else None)
    want = Remainder(
        anchor, tokens, cast(Optional[str], extra_key), cast(Optional[str], cache_salt)
    )
    return state.start(cache, lambda: original(cache, request, anchor, tokens, *a, **k),
                       request, want)  # fmt: skip


@FEATURE.hook(CACHE_CLASS, "check_prefetch_progress", "AROUND")
def around_check_prefetch_progress(
    original: Fn, cache: Cache, request: Hashable, *a: object, **k: object
) -> Any:
    """check_prefetch_progress, AROUND.
    Why: the walk admits a request whose prefetch is done or absent, a held start's too.
    How: a held start's request is not ready; a read that lands here runs the starts
    waiting on it at once (nothing can evict its pages in between).
    Stands down: nothing held and nothing awaited: the original, unchanged."""
    state = votes_of(cache)
    if state is None:
        return original(cache, request, *a, **k)
    return state.progress(cache, lambda c, r: original(c, r, *a, **k), request)


@FEATURE.hook(CACHE_CLASS, "release_aborted_request", "BEFORE")
def before_release_aborted_request(
    cache: Cache, request: Hashable, *args: object, **kwargs: object
) -> None:
    """release_aborted_request, BEFORE.
    Why: an abort needs no verdict: upstream releases the prefetch right after this.
    How: drops the host lock a stop put on the pages it inserted.
    Stands down: never holds anything."""
    unpin(cache, request, "abort")


@FEATURE.hook(CACHE_CLASS, "release_aborted_request", "AFTER")
def after_release_aborted_request(
    result: object, cache: Cache, request: Hashable, *args: object, **kwargs: object
) -> Any:
    """release_aborted_request, AFTER.
    Why: an aborted request's held start never runs; an aborted read ends a wait on it.
    How: drops the request's held start; runs the starts waiting on its read.
    Stands down: nothing held: nothing to do."""
    with_votes(cache, lambda state: state.aborted(cache, request))
    return result


@FEATURE.hook(CACHE_CLASS, "finish_storage_prefetch_admission", "AFTER")
def after_finish_storage_prefetch_admission(
    result: object, cache: Cache, request: Hashable, *args: object, **kwargs: object
) -> Any:
    """finish_storage_prefetch_admission, AFTER.
    Why: the scheduler calls it for every request it admits to the batch.
    How: drops the host lock a stop put on its pages (the load-back holds them now).
    Stands down: never holds anything."""
    unpin(cache, request, "admission")
    with_votes(cache, lambda state: state.starts.admitted(request))
    return result


def unpin(cache: Cache, request: Hashable, why: str) -> None:
    with_votes(cache, lambda state: state.landing.pins.release(cache, request, why))


def with_votes(cache: Optional[Cache], act: Callable[[PrefetchVoteState], object]) -> None:
    """``act`` on the cache's vote state, where it has one."""
    state = votes_of(cache)
    if state is not None:
        act(state)


@FEATURE.hook(CACHE_CLASS, "reset", "AFTER")
def after_reset(result: object, cache: Cache, *args: object, **kwargs: object) -> Any:
    """reset, AFTER (flush_cache).
    Why: the tree and every prefetch are gone; so are the pins' nodes.
    How: forgets the pins (verdicts find operations by identity).
    Stands down: never holds anything."""
    with_votes(cache, PrefetchVoteState.forget)
    return result


# Target: the scheduler's side (admissions, pass numbers): the admission check (#30760).


@FEATURE.hook(ADDER_CLASS, "_account_prefill_cache_admission", "AFTER")
def after_account_prefill_cache_admission(
    result: object, adder: Adder, req: Request, prefix_len: int, *a: object, **kw: object
) -> Any:
    """PrefillAdder._account_prefill_cache_admission, AFTER.
    Why: the adder calls it for every request it admits, in order.
    How: notes (request, prefix length, extend length) for the section.
    Stands down: outside a held interval."""
    with_votes(adder.tree_cache, lambda state: state.admit(req, prefix_len))
    return result


@FEATURE.hook(ADDER_CLASS, "add_chunked_req", "AFTER")
def after_add_chunked_req(
    result: object, adder: Adder, req: Request, *a: object, **kw: object
) -> Any:
    """PrefillAdder.add_chunked_req, AFTER.
    Why: a chunked request's next chunk joins the batch here, without the accounting.
    How: notes it as above when it joined (it is the adder's last request).
    Stands down: outside a held interval, or when the chunk did not fit."""
    admitted = adder.can_run_list or ()
    state = votes_of(adder.tree_cache)
    if state is not None and admitted and admitted[-1] is req:
        state.admit(req, int(req.prefix_len))
    return result


@FEATURE.hook(SCHEDULER_CLASS, "_prefetch_kvcache", "AROUND")
def around_prefetch_kvcache(
    original: Fn, scheduler: Scheduler, req: Any, *a: object, **kw: object
) -> Any:
    """Scheduler._prefetch_kvcache, AROUND.
    Why: stock's start of a request's storage prefetch (arrival, retry, a device hit
    lost); held, it must run again as a whole: match the trees, then read the rest.
    How: keeps (scheduler, request, storage_hit_end) for prefetch_from_storage's hook.
    Stands down: never changes anything itself."""
    state = votes_of(scheduler.tree_cache)
    if state is None:
        return original(scheduler, req, *a, **kw)
    end = cast(
        Optional[int], kw["storage_hit_end"] if "storage_hit_end" in kw else (a[0] if a else None)
    )
    return state.starts.starting(scheduler, req, end, lambda: original(scheduler, req, *a, **kw))


@FEATURE.hook(SCHEDULER_CLASS, "_process_hicache_events", "BEFORE")
def before_process_hicache_events(scheduler: Scheduler, *a: object, **kw: object) -> None:
    """Scheduler._process_hicache_events, BEFORE.
    Why: the pass boundary; the scheduler numbers the pass by its forwards.
    How: keeps that number for the pass's messages.
    Stands down: never changes anything."""
    state = votes_of(scheduler.tree_cache)
    if state is not None:
        ct = getattr(scheduler, "forward_ct", None)
        # the walk after a boundary builds the batch of the scheduler's next forward
        state.label = (
            None
            if ct is None
            else f"of forward {int(ct) + 1} (the scheduler's forward_ct, batch.forward_iter)"
        )
