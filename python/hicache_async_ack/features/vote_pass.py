"""The prefetch votes' scheduling pass on SGLang's UnifiedRadixCache: the
boundary (pick the carrier, run the votes' own first exchange where upstream
carries them, run what an interval no section carried held back), the walk's
answer in ``_can_terminate_prefetch``, and the section riding upstream's
blocking reduce.

Riding upstream's blocking reduce: with the ack sync on SGLang's path (host
memory mode ``buffer_only``), ``_sync_hicache_ready_counts`` still runs one
blocking MIN all_reduce per pass through the cache's ``_all_reduce``. For the
length of that call, ``_all_reduce`` is shadowed on the instance, and its first
MIN of a 1-D int64 tensor (the ready counts: the only reduce that method runs
at pp_size 1) is reduced with the section appended; upstream gets its own
values back in place and never sees the rest. The verdicts are applied right
there, before upstream pops. Only after every rank's first exchange has shown
that every rank runs the plugin: a stock peer's reduce would pair with a
longer one, and gloo aborts on that.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..kit.collectives import upstream_count_slots
from ..protocol.stamp import Stamp, describe_mismatch, pack_stamp, stamps_differ
from ..protocol.votes import VOTE_SLOTS, VOTES_PROTOCOL, PrefetchVoteError, PrefetchVoteMismatch
from . import vote_apply
from .vote_apply import operation_key

RIDE_ACK, RIDE_UPSTREAM = "ack", "upstream"  # the carriers (PrefetchVoteState.mode)
TIMEOUT_POLICY, BEST_EFFORT = "timeout", "best_effort"
ALL_REDUCE = "_all_reduce"


# ----------------------------------------------------------------- the boundary
def begin_pass(state, cache, carrier) -> None:
    """Before check_hicache_events: pick this pass's carrier (the ack sync when
    it pipelines this step); with upstream's, run the votes' own first exchange
    once they could ride it."""
    state.passes += 1
    pipelines = carrier.sync is not None and carrier.decide(cache).pipelined
    state.mode = RIDE_ACK if pipelines else RIDE_UPSTREAM
    if state.mode == RIDE_UPSTREAM and not state.agreed and state.eligible(cache).pipelined:
        try:
            state.first_exchange(cache)
        except PrefetchVoteError as exc:
            state.failed(exc)
            raise


def end_pass(state, cache) -> None:
    """After check_hicache_events: an interval no section carried runs what it
    held back now (its reaches were not voted on: the next walk reaches those
    requests again, on whichever path the cache is then)."""
    if state.closed_at != state.passes:
        state.no_section(cache)
    state.announce(state.decide(cache))


def verdict(state, cache, original: Callable, operation, *a, **kw):
    """_can_terminate_prefetch: while the boundary applies a stop, yes for that
    operation; in a walk whose interval a section will carry, note the reach
    (this rank's vote) and answer "not yet"; anywhere else, upstream's."""
    if state is not None and state.applying is not None:
        return state.applying is operation
    policy = cache.prefetch_stop_policy
    if (
        state is None
        or not state.active
        or policy not in (TIMEOUT_POLICY, BEST_EFFORT)
        or cache.pp_size != 1
    ):
        return original(cache, operation, *a, **kw)
    expired = True if policy == BEST_EFFORT else state.vote(cache, operation)
    key = operation_key(operation.handle)
    if not state.book.poll(key, operation, expired):
        # Past the section's slots: SGLang's own per-request reduce decides it
        # here (every rank reaches the same requests in the same order), and the
        # answer is applied with the others, in walk order.
        decided = bool(original(cache, operation, *a, **kw))
        state.book.poll(key, operation, expired, decided=decided)
        state.fallbacks += 1
        if state.metrics is not None:
            state.metrics.on_fallback()
        if state.fallbacks == 1:
            say_fallback(state)
    return False


def say_fallback(state) -> None:
    """Once per cache: a walk reached more requests than a section carries."""
    import logging

    from ..names import LOGGER_NAME

    logging.getLogger(LOGGER_NAME).warning(
        "HiCache prefetch votes: the waiting-queue walk of scheduling pass %s reached "
        "more than %d requests with an ongoing storage prefetch; the reaches past the "
        "section's %d slots are decided on SGLang's own per-request all_reduce, at the "
        "walk, and applied with the others in walk order (counted in "
        "sglang:hicache_prefetch_votes_fallback_reaches_total; said once per cache)",
        state.label or f"#{state.book.walks}",
        VOTE_SLOTS,
        VOTE_SLOTS,
    )


# ------------------------------------------------------- upstream's carrier
def first_exchange(state, cache, hints) -> None:
    """The votes' own first exchange (upstream's carrier), once, before anything
    the blocking path would not run: one blocking reduce through the cache's
    own ``_all_reduce``, in upstream's ack-count shape (``[on, -on, 0, ...]``
    where upstream sends its counts, then ``[x, -x]`` with the votes' stamp
    where it sends its digest). A peer on SGLang's path pairs it with its own
    ack-count reduce, fails upstream's digest check there, and every plugin
    rank names it; a plugin peer with the votes off or another protocol is
    named too."""
    from ..env import PREFETCH_VOTES_VAR

    on = int(state.enabled)
    x = pack_stamp(VOTES_PROTOCOL, False, 1, VOTE_SLOTS, 0)
    values = [on, -on] + [0] * (upstream_count_slots(cache) - 2) + [x, -x]
    try:
        reduced = state.collectives.blocking_min(cache)(values)
    except Exception as exc:
        raise PrefetchVoteError(
            f"HiCache prefetch votes: the first exchange failed ({exc}); a peer rank "
            "may have died or run another configuration"
        ) from exc
    lo_x, hi_x = reduced[-2], -reduced[-1]
    if stamps_differ(x, lo_x, hi_x):
        why = describe_mismatch(Stamp.unpack(x), Stamp.unpack(lo_x), Stamp.unpack(hi_x), hints)
        raise PrefetchVoteMismatch(
            f"HiCache prefetch votes: ranks disagree on the first exchange: {why} "
            "Stopping before any vote."
        )
    lo_on, hi_on = reduced[0], -reduced[1]
    if lo_on != hi_on:
        raise PrefetchVoteMismatch(
            f"HiCache prefetch votes: {PREFETCH_VOTES_VAR} differs across the TP group: "
            f"this rank {on}, group min {lo_on}, max {hi_on}. Set it identically on "
            "every node. Stopping before any vote."
        )
    state.agreed = True


def ride_upstream(state, cache, original: Callable, *a, **kw):
    """_sync_hicache_ready_counts with upstream's carrier: the section rides its
    blocking reduce, and the interval's decisions land before upstream pops."""
    if (
        state is None
        or state.mode != RIDE_UPSTREAM
        or not state.agreed
        or not state.rides(cache)
        or state.closed_at == state.passes
    ):
        return original(cache, *a, **kw)
    values, ballot = state.section(cache)
    try:
        result, reduced = ride_ready_counts(cache, original, values, *a, **kw)
    except PrefetchVoteError as exc:
        state.failed(exc)
        raise
    state.take(cache, ballot, reduced)
    return result


def ride_ready_counts(cache, original: Callable, values: Sequence[int], *args, **kwargs):
    """Run ``original`` (``_sync_hicache_ready_counts``) with ``values`` riding
    its reduce; returns its result and the reduced ``values``."""
    import torch

    inst = cache.__dict__
    shadowed = ALL_REDUCE in inst
    before = inst.get(ALL_REDUCE)
    base = getattr(cache, ALL_REDUCE)  # whatever upstream would call (a test's wrapper too)
    reduced: list[list[int]] = []

    def all_reduce(tensor, op, *a, **kw):
        if reduced or tensor.dim() != 1 or tensor.dtype != torch.int64:
            return base(tensor, op, *a, **kw)
        n = tensor.numel()
        fused = torch.cat([tensor, torch.tensor(list(values), dtype=torch.int64)])
        out = base(fused, op, *a, **kw)
        tensor.copy_(fused[:n])
        reduced.append([int(v) for v in fused[n:].tolist()])
        return out

    inst[ALL_REDUCE] = all_reduce
    try:
        result = original(cache, *args, **kwargs)
    finally:
        if shadowed:
            inst[ALL_REDUCE] = before
        else:
            inst.pop(ALL_REDUCE, None)
    if not reduced:
        raise PrefetchVoteError(
            "HiCache prefetch votes: upstream's _sync_hicache_ready_counts ran no reduce "
            "the votes could ride (this SGLang does not do what they were written for); "
            "stopping before any verdict"
        )
    return result, reduced[0]


def run_held(state, cache, deferred) -> None:
    """Run an interval's held-back calls now (no section carried it)."""
    from ..protocol.votes import Verdicts

    vote_apply.apply(state, cache, Verdicts(0, [(d.seq, "deferred", d.what) for d in deferred]))
