"""Pipelined storage-prefetch termination votes on SGLang's UnifiedRadixCache.

Under ``--hicache-storage-prefetch-policy timeout`` (the default), the
scheduler asks ``check_prefetch_progress`` about every waiting request with an
ongoing storage prefetch, and each call runs ``_can_terminate_prefetch``: one
blocking MAX all_reduce of "this rank's deadline passed" per request. Here the
pass boundary (the end of ``check_hicache_events``, which the scheduler runs
once per pass before it walks the waiting queue) consumes the votes issued at
the previous pass and issues one vote reduce covering every ongoing operation
(:mod:`hicache_async_ack.votes`); ``_can_terminate_prefetch`` answers from the
consumed verdicts, with no collective. A deadline verdict therefore comes one
pass late. Per-cache state lives in the cache's ``__dict__``.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ..adapter import (
    Collectives,
    Decision,
    Feature,
    FeatureState,
    Hook,
    announce_path,
    blocking,
    group_decision,
    hook,
    keep_state,
    missing_attrs,
    unhooked,
    upstream_count_slots,
)
from ..env import ENABLE_VAR, PREFETCH_VOTES_VAR, prefetch_votes_enabled
from ..guard import CACHE_CLASS, feature_release
from ..stamp import OBS_BITS, Stamp, describe_mismatch, pack_stamp
from ..votes import (
    VOTE_SLOTS,
    VOTES_PROTOCOL,
    PipelinedVotes,
    PrefetchVoteError,
    PrefetchVoteMismatch,
    Verdicts,
)

STATE_ATTR = "_hicache_prefetch_votes_state"
TIMEOUT_POLICY = "timeout"
# The predicate upstream's _can_terminate_prefetch reduces (PP0's view of "the
# deadline passed"); a guard target of this feature, so the votes run only where
# the guard's table has it (0.5.23; older releases decide the deadline from
# operation.start_time, not the admission-poll timer, and have no such method).
PREDICATE = "_prefetch_deadline_expired"
REQUIRED_ATTRS = ("ongoing_prefetch", "prefetch_stop_policy", "pp_rank", "enable_storage")
MISMATCH_HINTS = {
    "protocol": (
        "Run the same hicache-async-ack version, with the same "
        f"{PREFETCH_VOTES_VAR}, on every node of the TP group."
    ),
    "stock": (
        "that rank runs SGLang's blocking path: give every node of the TP group the same "
        f"install and the same {ENABLE_VAR} / {PREFETCH_VOTES_VAR}."
    ),
}


def release_blocker(release: Optional[str]) -> Optional[Decision]:
    """Why the guard does not let the votes run on this SGLang."""
    if release is not None:
        return None
    return blocking(
        "the guard matched no tested release for the votes' upstream methods "
        f"(UnifiedRadixCache.{PREDICATE} and the prefetch path; tested where they "
        "exist: docs/versions.md)",
        "untested_release",
    )


def static_decision(cache, release: Optional[str], blocker: Optional[Decision]) -> Decision:
    decision = (
        blocker
        or missing_attrs(cache, REQUIRED_ATTRS)
        or release_blocker(release)
        or missing_attrs(cache, (PREDICATE,))
        or group_decision(cache)
    )
    if decision.span is not None:
        # One MIN over the TP group equals upstream's CP-then-attn-TP pair only
        # where the ack sync's first step checked the span; not tied in here.
        return blocking(f"{decision.reason}: attention CP x TP", "attn_cp_tp")
    return decision


class PrefetchVoteState(FeatureState):
    """What is kept per cache. ``blocker`` keeps it on upstream's path for the
    cache's lifetime (the caller knows why).

    Every rank whose plugin is on keeps this state, also with the votes off:
    at the start of the first eligible pass all of them run the votes' own first
    exchange (:meth:`greet`, in upstream's ack-count shape), so a peer without
    the plugin, or with the votes off, stops every plugin rank with an error
    naming it instead of pairing its per-request reduces with the others' vote
    reduces (gloo aborts on such a pairing)."""

    feature = "prefetch_votes"

    def __init__(
        self,
        cache,
        enabled: bool,
        release: Optional[str],
        blocker: Optional[Decision] = None,
        coll: Optional[Collectives] = None,
    ):
        super().__init__(static_decision(cache, release, blocker), coll)
        self.enabled = enabled
        self.release = release
        self.votes: Optional[PipelinedVotes] = None
        if self.static.pipelined:
            self.votes = PipelinedVotes(
                self.collectives.async_min(self.static.group), hints=MISMATCH_HINTS
            )
        self.passes = 0  # check_hicache_events calls seen (the same on every rank)
        self.agreed = False  # the group agreed on the setting (one blocking reduce, once)
        self.active = False  # this pass answers from verdicts, not the blocking reduce
        self.verdicts: Optional[Verdicts] = None
        self.stopped = 0  # operations stopped on a verdict (for tests and the bench)

    def eligible(self, cache) -> Decision:
        """Whether the votes can replace upstream's reduce this pass (the
        setting aside): conditions every rank shares."""
        if not self.static.pipelined:
            return self.static
        if cache.cache_controller is None:
            return blocking("HiCache controller not attached", "no_controller")
        if not cache.enable_storage:
            return blocking("no storage backend attached (no prefetch to decide)", "no_storage")
        policy = cache.prefetch_stop_policy
        if policy != TIMEOUT_POLICY:
            return blocking(f"prefetch policy {policy!r} runs no collective", "policy_not_timeout")
        if cache.pp_size != 1:
            return blocking(f"pp_size={cache.pp_size} (PP0 decides, sent along PP)", "pp")
        return self.static

    def decide(self, cache) -> Decision:
        eligible = self.eligible(cache)
        if not eligible.pipelined:
            return eligible
        if not self.agreed:  # eligible only since this pass began: greeted at the next
            return blocking("the group agrees on the setting at the next pass", "agreeing")
        if not self.enabled:
            return blocking(f"{PREFETCH_VOTES_VAR}=0", "feature_disabled_by_env")
        return eligible

    def greet(self, cache) -> None:
        """The votes' own first exchange, once, at the start of the first eligible
        pass, before anything the blocking path would not run: one blocking
        reduce through the cache's own ``_all_reduce``, in upstream's ack-count
        shape (``[on, -on, 0, ...]`` where upstream sends its counts, then
        ``[x, -x]`` with the votes' stamp where it sends its digest). A peer on
        SGLang's path pairs it with its own ack-count reduce, whatever the host
        memory mode (in buffer_only the ack sync's exchange never runs), fails
        upstream's digest check there, and every plugin rank names it; a plugin
        peer with the votes off or another protocol is named too."""
        on = int(self.enabled)
        x = pack_stamp(VOTES_PROTOCOL, False, 1, VOTE_SLOTS, 0)
        values = [on, -on] + [0] * (upstream_count_slots(cache) - 2) + [x, -x]
        try:
            reduced = self.collectives.blocking_min(cache)(values)
        except Exception as exc:
            raise PrefetchVoteError(
                f"HiCache prefetch votes: the first exchange failed ({exc}); a peer rank "
                "may have died or run another configuration"
            ) from exc
        lo_x, hi_x = reduced[-2], -reduced[-1]
        if lo_x >> OBS_BITS != x >> OBS_BITS or hi_x >> OBS_BITS != x >> OBS_BITS:
            why = describe_mismatch(
                Stamp.unpack(x), Stamp.unpack(lo_x), Stamp.unpack(hi_x), MISMATCH_HINTS
            )
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
        self.agreed = True

    def path_line(self, decision: Decision) -> str:
        line = super().path_line(decision)
        if decision.pipelined:
            line = line[:-1] + "; one vote reduce per pass, deadlines decided one pass late)"
        return line

    def announce(self, decision: Decision) -> None:
        announce_path(self, decision)

    def vote(self, cache, operation) -> bool:
        """This rank's vote: PP0's deadline predicate, as upstream reduces it."""
        return bool(getattr(cache, PREDICATE)(operation))


def state_of(cache) -> Optional[PrefetchVoteState]:
    return cache.__dict__.get(STATE_ATTR)


def attach_state(
    cache, enabled: bool, release: Optional[str], blocker: Optional[Decision] = None
) -> PrefetchVoteState:
    return keep_state(cache, STATE_ATTR, PrefetchVoteState(cache, enabled, release, blocker))


# ----------------------------------------------------------------- the pass
def on_pass(state: PrefetchVoteState, cache) -> None:
    """At the end of check_hicache_events: consume the previous pass's votes,
    then vote on every ongoing operation (after the drain removed completed ones)."""
    state.passes += 1
    try:
        decision = state.decide(cache)
    except PrefetchVoteError as exc:
        _failed(state, exc)
        raise
    state.announce(decision)
    votes = state.votes
    if not decision.pipelined:
        state.active = False
        state.verdicts = None
        if votes is not None and votes.pending:
            votes.drain()  # every rank stands down at the same pass
        return
    assert votes is not None
    try:
        state.verdicts = verdicts = votes.consume()
        state.active = True
        if verdicts is not None and len(verdicts):
            apply_verdicts(state, cache, verdicts)
        t0 = time.perf_counter()
        ops = [
            ((handle.rid, handle.attempt_id), info.operation, state.vote(cache, info.operation))
            for handle, info in cache.ongoing_prefetch.items()
        ]
        votes.issue(ops)
    except PrefetchVoteError as exc:
        _failed(state, exc)
        raise
    state.active = True
    if state.metrics is not None:  # the wait only for passes that had a reduce due
        waited = verdicts.waited_s if verdicts is not None else None
        state.metrics.on_pass(waited, time.perf_counter() - t0, min(len(ops), VOTE_SLOTS))


def apply_verdicts(state: PrefetchVoteState, cache, verdicts: Verdicts) -> None:
    """End, here at the pass boundary, every ongoing operation the group voted
    to stop, in key order, through upstream's own check_prefetch_progress (its
    _can_terminate_prefetch answers from the verdicts): every rank ends the
    same operations the same way in the same pass, however far its
    waiting-queue loop gets this pass (SGLang #30760: a rank whose batch fills
    up earlier visits fewer requests; upstream's fix, #33029, likewise computes
    progress once per pass for the whole queue). The loop then finds them
    done."""
    due = [h for h, info in cache.ongoing_prefetch.items() if verdicts(info.operation)]
    for handle in sorted(due, key=lambda h: (h.rid, h.attempt_id)):
        cache.check_prefetch_progress(handle)


def _failed(state: PrefetchVoteState, exc: PrefetchVoteError) -> None:
    state.active = False
    if state.metrics is not None:
        state.metrics.on_failure("mismatch" if isinstance(exc, PrefetchVoteMismatch) else "failure")


def verdict(state: Optional[PrefetchVoteState], cache, original: Callable, operation, *a, **kw):
    """_can_terminate_prefetch: in a pipelined pass, the group's verdict on this
    operation from the previous pass (False until it was voted on); anywhere
    else, upstream's."""
    if (
        state is None
        or not state.active
        or cache.prefetch_stop_policy != TIMEOUT_POLICY
        or cache.pp_size != 1
    ):
        return original(cache, operation, *a, **kw)
    stop = state.verdicts is not None and state.verdicts(operation)
    if stop:
        state.stopped += 1
        if state.metrics is not None:
            state.metrics.on_stop()
    return stop


# ------------------------------------------------------------------------ hooks
# Target: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.
# Upstream: sglang #33029 (prefetch progress computed once per pass) is the open
# fix for the per-request collective; removable when upstream decides deadlines
# without a collective per waiting request.
HOOKED = ("check_hicache_events", "_can_terminate_prefetch")


def attach(cache) -> PrefetchVoteState:
    """The cache's prefetch-vote state (the setting read now, as for the ack sync)."""
    problem = unhooked(type(cache), HOOKED)
    blocker = blocking(problem, "hooks_missing") if problem else None
    release = feature_release("prefetch_votes")
    return attach_state(cache, prefetch_votes_enabled(), release, blocker)


@hook
def after_init_hicache(result, cache, *args, **kwargs):
    """init_hicache, AFTER.
    Why: the per-cache vote state (and its metrics) needs what init builds.
    How: builds it; the decision is made and logged at the first pass.
    Stands down: never fails init."""
    state = attach(cache)
    params = kwargs.get("params", args[1] if len(args) > 1 else None)
    if getattr(params, "enable_metrics", False):
        state.metrics = metrics_for(cache)
    return result


def metrics_for(cache):
    """The votes' metrics, labelled and created as the ack sync's (the cache's
    collector classes); None (logged) if they cannot be made."""
    from ..metrics import PrefetchVoteMetrics, never_raising

    collector = getattr(cache, "metrics_collector", None)
    labels = getattr(collector, "labels", None) or {"cache_type": type(cache).__name__}
    return never_raising(
        lambda: PrefetchVoteMetrics(labels, collector), "HiCache prefetch votes", labels
    )


@hook
def after_check_hicache_events(result, cache, *args, **kwargs):
    """check_hicache_events, AFTER.
    Why: the scheduler runs it once per pass, before it walks the waiting queue
    and asks check_prefetch_progress per request: the pass boundary.
    How: consumes the vote reduce issued at the previous pass, ends every
    operation it stopped (apply_verdicts), then issues one covering every
    ongoing prefetch operation, async.
    Stands down: no storage backend, a policy other than `timeout`, PP, world
    size 1, the setting off, or a release the guard has no votes for: the
    reduce in flight is drained and upstream's per-request path runs."""
    state = state_of(cache)
    if state is None:
        state = attach(cache)
    on_pass(state, cache)
    return result


@hook
def before_check_hicache_events(cache, *args, **kwargs):
    """check_hicache_events, BEFORE.
    Why: the votes need their own first exchange, paired with what a peer on
    SGLang's path runs first in a pass: its blocking ack-count reduce, inside
    this method (the ack sync's own exchange does not run in buffer_only).
    How: at the first pass the votes are eligible, one blocking exchange in
    upstream's shape through the cache's _all_reduce (PrefetchVoteState.greet).
    Stands down: when the votes are not eligible (nothing to agree on yet)."""
    state = state_of(cache)
    if state is None:
        state = attach(cache)
    if not state.agreed and state.static.pipelined and state.eligible(cache).pipelined:
        try:
            state.greet(cache)
        except PrefetchVoteError as exc:
            _failed(state, exc)
            raise
    return None


@hook
def around_can_terminate_prefetch(original, cache, operation, *args, **kwargs):
    """_can_terminate_prefetch, AROUND.
    Why: it runs one blocking MAX all_reduce per waiting request.
    How: inside a pipelined pass, returns the group's verdict on this operation
    (by identity; False until voted on), no collective.
    Stands down: calls the original outside a pipelined pass or policy."""
    return verdict(state_of(cache), cache, original, operation, *args, **kwargs)


FEATURE = Feature(
    "prefetch_votes",
    (
        Hook(CACHE_CLASS, "init_hicache", "AFTER", after_init_hicache),
        Hook(CACHE_CLASS, "check_hicache_events", "AFTER", after_check_hicache_events),
        Hook(CACHE_CLASS, "check_hicache_events", "BEFORE", before_check_hicache_events),
        Hook(CACHE_CLASS, "_can_terminate_prefetch", "AROUND", around_can_terminate_prefetch),
    ),
    order=(
        "after the ack sync's: the AFTER and BEFORE hooks on check_hicache_events must "
        "wrap the ack sync's AROUND, so the pass boundary comes after the ack pops and "
        "the votes' first exchange before the ack sync's (and before upstream's reduce)"
    ),
)
