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

import logging
import time
from typing import Any, Callable, Optional

from . import ack_sync
from .ack_sync import Decision
from .core import Stamp, describe_mismatch, pack_stamp
from .env import ENABLE_VAR, PREFETCH_VOTES_VAR
from .votes import (
    VOTE_SLOTS,
    VOTES_PROTOCOL,
    PipelinedVotes,
    PrefetchVoteError,
    PrefetchVoteMismatch,
    Verdicts,
)

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")

_STATE_ATTR = "_hicache_prefetch_votes_state"
TIMEOUT_POLICY = "timeout"
# The releases whose prefetch path was read and tested against these votes, and
# the predicate upstream's _can_terminate_prefetch reduces there (PP0's view of
# "the deadline passed"). Elsewhere the votes stand down (upstream's path).
VERIFIED_RELEASES = {"0.5.23": "_prefetch_deadline_expired"}
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


def release_blocker(release: Optional[str]) -> Optional[str]:
    """Why this SGLang's prefetch path is not one the votes were verified on."""
    if release in VERIFIED_RELEASES:
        return None
    return (
        f"SGLang's prefetch path here is that of {release or 'an untested release'}; the "
        f"votes were verified on {', '.join(VERIFIED_RELEASES)} only (older releases "
        "decide the deadline from operation.start_time, not the admission-poll timer)"
    )


class PrefetchVoteState:
    """What is kept per cache. ``blocker`` keeps it on upstream's path for the
    cache's lifetime (the caller knows why).

    Every rank whose plugin is on keeps this state, also with the votes off:
    at the first eligible pass after the first (when the ack sync has already
    checked that every peer runs the plugin), all of them take part in one
    blocking agreement on the setting, so a rank with the votes off stops every
    rank with an error naming it instead of pairing its per-request reduces
    with the others' vote reduces (gloo aborts on such a pairing)."""

    def __init__(self, cache, enabled: bool, release: Optional[str], blocker: Optional[str] = None):
        self.enabled = enabled
        self.release = release
        self.predicate_name = VERIFIED_RELEASES.get(release or "", "")
        missing = [a for a in REQUIRED_ATTRS if not hasattr(cache, a)]
        if blocker is None and missing:
            blocker = f"this SGLang's cache lacks {', '.join(missing)}"
        if blocker is None:
            blocker = release_blocker(release)
        if blocker is None and not hasattr(cache, self.predicate_name):
            blocker = f"this SGLang's cache lacks {self.predicate_name}"
        self.static = Decision(False, blocker) if blocker else ack_sync.static_decision(cache)
        if getattr(self.static, "span", None) is not None:
            # One MIN over the TP group equals upstream's CP-then-attn-TP pair only
            # where the ack sync's first step checked the span; not tied in here.
            self.static = Decision(False, f"{self.static.reason}: attention CP x TP")
        self.votes: Optional[PipelinedVotes] = None
        if self.static.pipelined:
            self.votes = PipelinedVotes(
                ack_sync.collective_factory(self.static.group), hints=MISMATCH_HINTS
            )
        self.passes = 0  # check_hicache_events calls seen (the same on every rank)
        self.agreed = False  # the group agreed on the setting (one blocking reduce, once)
        self.active = False  # this pass answers from verdicts, not the blocking reduce
        self.verdicts: Optional[Verdicts] = None
        self.metrics: Any = None  # on_path / on_pass / on_stop / on_failure
        self.stopped = 0  # operations stopped on a verdict (for tests and the bench)
        self.announced: Optional[tuple] = None

    def eligible(self, cache) -> Decision:
        """Whether the votes can replace upstream's reduce this pass (the
        setting aside): conditions every rank shares."""
        if not self.static.pipelined:
            return self.static
        if cache.cache_controller is None:
            return Decision(False, "HiCache controller not attached")
        if not cache.enable_storage:
            return Decision(False, "no storage backend attached (no prefetch to decide)")
        policy = cache.prefetch_stop_policy
        if policy != TIMEOUT_POLICY:
            return Decision(False, f"prefetch policy {policy!r} runs no collective")
        if cache.pp_size != 1:
            return Decision(False, f"pp_size={cache.pp_size} (PP0 decides, sent along PP)")
        return self.static

    def decide(self, cache) -> Decision:
        eligible = self.eligible(cache)
        if not eligible.pipelined:
            return eligible
        if not self.agreed:
            if self.passes < 2:
                return Decision(False, "the group agrees on the setting at the next pass")
            self.agree()
        if not self.enabled:
            return Decision(False, f"{PREFETCH_VOTES_VAR}=0")
        return eligible

    def agree(self) -> None:
        """One blocking MIN-reduce of ``[on, -on, x, -x]`` (x: the votes' stamp):
        every rank learns whether all have the same setting and protocol."""
        assert self.votes is not None
        on = int(self.enabled)
        x = pack_stamp(VOTES_PROTOCOL, False, 1, VOTE_SLOTS, 0)
        try:
            lo_on, hi_on, lo_x, hi_x = self.votes.collective([on, -on, x, -x]).wait()
        except Exception as exc:
            raise PrefetchVoteError(
                f"HiCache prefetch votes: the one-time agreement on {PREFETCH_VOTES_VAR} "
                f"failed ({exc}); a peer rank may have died or run another configuration"
            ) from exc
        hi_on, hi_x = -hi_on, -hi_x
        if lo_on != hi_on:
            raise PrefetchVoteMismatch(
                f"HiCache prefetch votes: {PREFETCH_VOTES_VAR} differs across the TP group: "
                f"this rank {on}, group min {lo_on}, max {hi_on}. Set it identically on "
                "every node. Stopping before any vote."
            )
        if lo_x != hi_x or lo_x != x:
            why = describe_mismatch(
                Stamp.unpack(x), Stamp.unpack(lo_x), Stamp.unpack(hi_x), MISMATCH_HINTS
            )
            raise PrefetchVoteMismatch(
                f"HiCache prefetch votes: the ranks speak different vote protocols: {why} "
                "Stopping before any vote."
            )
        self.agreed = True

    def announce(self, decision: Decision) -> None:
        ack_sync.announce_path(
            self,
            decision,
            "HiCache prefetch votes",
            "; one vote reduce per pass, deadlines decided one pass late",
            logger,
        )

    def vote(self, cache, operation) -> bool:
        """This rank's vote: PP0's deadline predicate, as upstream reduces it."""
        return bool(getattr(cache, self.predicate_name)(operation))


def state_of(cache) -> Optional[PrefetchVoteState]:
    return cache.__dict__.get(_STATE_ATTR)


def attach_state(
    cache, enabled: bool, release: Optional[str], blocker: Optional[str] = None
) -> PrefetchVoteState:
    state = PrefetchVoteState(cache, enabled, release, blocker)
    cache.__dict__[_STATE_ATTR] = state
    return state


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
    if state.metrics is not None:
        waited = verdicts.waited_s if verdicts is not None else 0.0
        state.metrics.on_pass(waited, time.perf_counter() - t0, len(ops))


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
