"""Storage-prefetch decisions on SGLang's UnifiedRadixCache, riding the ack
counts' reduce: the feature, its per-cache state and its hooks (the pass:
:mod:`.vote_pass`; where the decisions land: :mod:`.vote_apply`).

Stock decides a prefetch's end in the scheduler's waiting-queue walk, each time
the walk reaches its request: under ``--hicache-storage-prefetch-policy
timeout`` (the default) with one blocking MAX all_reduce of "this rank's
deadline passed" per request reached, under ``best_effort`` at once. The rule
here: **every decision stock makes at pass p from agreed state, the plugin
makes at pass p + depth + 1 from the state as agreed at pass p.** In a walk
``_can_terminate_prefetch`` runs no collective: it notes the reach and this
rank's vote and answers "not yet"; the interval (the walk, and the aborts and
budget-bound prefetch starts the scheduler makes until the next boundary) rides,
as one section (:mod:`hicache_async_ack.protocol.votes`), the next reduce of the ack
counts; where that reduce is consumed, before its pops, the cache holds exactly
the agreed state stock's walk saw, and every decision runs there, in walk
order, through upstream's own code. The admitted requests (with their prefix
and extend lengths) ride along, so ranks whose walks admitted differently stop
by name (SGLang #30760).

Two carriers, one collective per pass either way:

* the ack sync pipelines (host memory mode ``cache``): the section rides its
  async reduce (a :class:`hicache_async_ack.kit.feature.Rider`), for the
  ``timeout`` and ``best_effort`` walks and, under ``wait_complete``, for the
  aborts and prefetch starts alone; decisions depth + 1 passes after the walk.
* the ack sync keeps upstream's blocking reduce (``buffer_only``, or the ack
  sync standing down on its own), under ``timeout`` only (nothing else lags
  there): after the votes' own first exchange, the section rides that reduce,
  inside ``_sync_hicache_ready_counts``; decisions one pass after the walk.
"""

from __future__ import annotations

import time
from typing import Mapping, Optional

from ..env import ENABLE_VAR, PREFETCH_VOTES_VAR, prefetch_votes_enabled
from ..guard import CACHE_CLASS, feature_release
from ..kit.collectives import Collectives
from ..kit.decision import Decision, blocking, missing_attrs, untested_release
from ..kit.feature import Feature, FeatureState
from ..kit.groups import group_decision
from ..kit.hooks import unhooked
from ..names import ACK, VOTES
from ..protocol.votes import PrefetchVoteError, PrefetchVoteMismatch, VoteBook
from . import ack_sync, vote_admission, vote_apply, vote_pass
from .vote_pass import BEST_EFFORT, RIDE_ACK, TIMEOUT_POLICY

# The predicate upstream's _can_terminate_prefetch reduces (PP0's view of "the
# deadline passed"); a guard target of this feature, so the votes run only where
# the guard's table has it (0.5.23; older releases decide the deadline from
# operation.start_time, not the admission-poll timer, and have no such method).
PREDICATE = vote_apply.PREDICATE
REQUIRED_ATTRS = ("ongoing_prefetch", "prefetch_stop_policy", "pp_rank", "enable_storage")
WAIT_COMPLETE = "wait_complete"
# Layout flags the votes own in the ack sync's reduce: their section rides it
# (this rank would vote), and their setting (agreed in the ack sync's first exchange).
VOTES_FLAG, SETTING_FLAG = 1, 2
FLAGS = {
    VOTES_FLAG: "the prefetch votes' section (a storage backend under a walk's stop policy)",
    SETTING_FLAG: PREFETCH_VOTES_VAR,
}
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
HOOKED = (
    "check_hicache_events",
    "_can_terminate_prefetch",
    "_sync_hicache_ready_counts",
    "finish_storage_prefetch_admission",
    "prefetch_from_storage",
    "release_aborted_request",
    "reset",
)


def static_decision(cache, release: Optional[str], blocker: Optional[Decision]) -> Decision:
    """The votes need a group that runs a collective (world size > 1: attention
    CP x TP where one TP group spans both, as for the ack sync); they never
    issue one of their own, so which group carries them is the carrier's."""
    return (
        blocker
        or untested_release(release, f"the votes' methods (UnifiedRadixCache.{PREDICATE} ...)")
        or missing_attrs(cache, REQUIRED_ATTRS)
        or missing_attrs(cache, (PREDICATE,))
        or group_decision(cache)
    )


class PrefetchVoteState(FeatureState):
    """What is kept per cache, and the ack sync's rider.

    Every rank whose plugin is on keeps this state, also with the votes off:
    their setting is agreed in the first exchange (the ack sync's, or with
    upstream's carrier the votes' own), so a peer without the plugin, or with
    the votes off, stops every plugin rank with an error naming it instead of
    pairing its per-request reduces with the others' (gloo aborts on that)."""

    feature = VOTES
    flags: Mapping[int, str] = FLAGS
    layout_bit = VOTES_FLAG

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
        self.book = VoteBook(hints=MISMATCH_HINTS)
        self.passes = 0  # check_hicache_events calls seen (the same on every rank)
        self.mode: Optional[str] = None  # this pass's carrier (vote_pass.RIDE_*)
        self.active = False  # this interval rides a section (its decisions are held)
        self.applying: object = None  # the operation a stop is being applied to
        self.rolling_back: object = None  # the handle a provisional start is undone for
        self.closed_at = -1  # the pass whose boundary closed (or dropped) the interval
        self.label: Optional[str] = None  # how the scheduler numbers this pass
        self.interval_label: Optional[str] = None  # ... the pass whose interval is open
        self.pins = vote_apply.Pins()
        self.creations: list = []  # (order, op, span): starts a confirmation weighs
        self.unconfirmed = 0  # provisional starts in flight
        # for tests and the bench
        self.sections = self.stopped = self.fallbacks = self.provisional = self.declined = 0

    def dynamic_blocker(self, cache) -> Optional[Decision]:
        """Why no section holds this pass's decisions (the setting aside):
        conditions every rank shares."""
        if cache.cache_controller is None:
            return blocking("HiCache controller not attached", "no_controller")
        if not cache.enable_storage:
            return blocking("no storage backend attached (no prefetch to decide)", "no_storage")
        if cache.pp_size != 1:
            return blocking(f"pp_size={cache.pp_size} (PP0 decides, sent along PP)", "pp")
        if getattr(cache, "linker", None) is not None:
            return blocking("external cache linker attached (no ack-count reduce)", "linker")
        policy = cache.prefetch_stop_policy
        if policy not in (TIMEOUT_POLICY, BEST_EFFORT, WAIT_COMPLETE):
            return blocking(f"prefetch policy {policy!r} is not one the votes know", "policy")
        if policy != TIMEOUT_POLICY and self.mode != RIDE_ACK:
            return blocking(
                f"prefetch policy {policy!r} runs no collective and the ack sync keeps "
                "upstream's path (nothing lags)",
                "policy_not_timeout",
            )
        return None

    def eligible(self, cache) -> Decision:
        return super().decide(cache)

    def rides(self, cache) -> bool:
        return self.enabled and self.eligible(cache).pipelined

    def decide(self, cache) -> Decision:
        """This pass's path, once its boundary is done."""
        eligible = self.eligible(cache)
        if not eligible.pipelined:
            return eligible
        if not self.enabled:
            return blocking(f"{PREFETCH_VOTES_VAR}=0", "feature_disabled_by_env")
        if not self.active:
            return blocking("the group agrees on the votes' layout at a coming pass", "agreeing")
        return eligible

    def pipelined_details(self, decision: Decision):
        if self.mode == RIDE_ACK:
            how = "riding the ack counts' pipelined reduce; decisions depth + 1 passes late"
        else:
            how = "riding upstream's blocking ack-count reduce; decisions one pass late"
        return (f"world size {decision.world_size}", how, "no collective per request")

    def first_exchange(self, cache) -> None:
        vote_pass.first_exchange(self, cache, MISMATCH_HINTS)

    def failed(self, exc: PrefetchVoteError) -> None:
        self.active = False
        if self.metrics is not None:
            reason = "mismatch" if isinstance(exc, PrefetchVoteMismatch) else "failure"
            self.metrics.on_failure(reason)

    def vote(self, cache, operation) -> bool:
        """This rank's vote: PP0's deadline predicate, as upstream reduces it."""
        return bool(getattr(cache, PREDICATE)(operation))

    # ------------------------------------------------------- the rider's part
    def local_flags(self, cache) -> int:
        return int(self.rides(cache)) << VOTES_FLAG | int(self.enabled) << SETTING_FLAG

    def take(self, cache, token, reduced) -> None:
        """A section came back reduced: check the agreement, then make the
        interval's decisions here, before this boundary's pops."""
        try:
            verdicts = self.book.read(token, reduced)
        except PrefetchVoteError as exc:
            self.failed(exc)
            raise
        vote_apply.apply(self, cache, verdicts)

    def after_pops(self, cache) -> None:
        """Nothing: every decision lands before the pops (vote_apply)."""

    def section(self, cache) -> tuple[list[int], object]:
        """Close this interval into the section the next reduce carries."""
        t0 = time.perf_counter()
        carried = sum(r.decided is None for r in self.book.reaches)
        values, ballot = self.book.close(
            len(cache.ongoing_prefetch), cache.prefetch_stop_policy, self.pass_label()
        )
        self.active = True
        self.closed_at = self.passes
        self.interval_label = self.label
        self.sections += 1
        if self.metrics is not None:
            self.metrics.on_pass(None, time.perf_counter() - t0, carried)
        return values, ballot

    def no_section(self, cache) -> None:
        held = self.book.discard()
        self.active = False
        self.closed_at = self.passes
        self.interval_label = self.label
        vote_pass.run_held(self, cache, held)

    def pass_label(self) -> str:
        """The interval being closed, as the scheduler numbers its pass."""
        walk = self.book.walks
        return self.interval_label or f"#{walk} (this cache's check_hicache_events #{walk})"


def build(cache) -> PrefetchVoteState:
    """The cache's vote state (the setting read now, as for the ack sync),
    joined to the ack sync's state as a rider."""
    problem = unhooked(type(cache), HOOKED, VOTES) or vote_admission.hooks_missing()
    blocker = blocking(problem, "hooks_missing") if problem else None
    state = PrefetchVoteState(cache, prefetch_votes_enabled(), feature_release(VOTES), blocker)
    carrier(cache).add_rider(state)
    return state


def carrier(cache):
    """The ack sync's state: it carries the votes where it pipelines."""
    return ack_sync.FEATURE.ensure(cache)


FEATURE = Feature(VOTES, "_hicache_prefetch_votes_state", build, after=(ACK,))
vote_admission.declare(FEATURE)  # the scheduler's side: admissions, its pass numbers


def metrics_for(cache):
    """The votes' metrics, labelled and created as the ack sync's (the cache's
    collector classes); None (logged) if they cannot be made."""
    from ..metrics import PrefetchVoteMetrics, never_raising

    collector = getattr(cache, "metrics_collector", None)
    labels = getattr(collector, "labels", None) or {"cache_type": type(cache).__name__}
    return never_raising(
        lambda: PrefetchVoteMetrics(labels, collector), "HiCache prefetch votes", labels
    )


def deferring(state) -> bool:
    """Whether a call the scheduler makes now is held to its interval's point."""
    return state is not None and state.active and state.applying is None


# ------------------------------------------------------------------------ hooks
# Target: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.
# Upstream: sglang #33029 (prefetch progress computed once per pass) is the open
# fix for the per-request collective; #30760 the loop skew the admission check
# names. Removable when upstream decides deadlines without a collective per
# request the walk reaches.


@FEATURE.hook(CACHE_CLASS, "init_hicache", "AFTER")
def after_init_hicache(result, cache, *args, **kwargs):
    """init_hicache, AFTER (after the ack sync's: its state is the carrier).
    Why: the per-cache vote state (and its metrics) needs what init builds.
    How: builds it and joins the ack sync's reduce as a rider; the path is
    decided and logged at the first pass.
    Stands down: never fails init."""
    state = FEATURE.attach(cache)
    if ack_sync.metrics_wanted(args, kwargs):
        state.metrics = metrics_for(cache)
    return result


@FEATURE.hook(CACHE_CLASS, "check_hicache_events", "BEFORE")
def before_check_hicache_events(cache, *args, **kwargs):
    """check_hicache_events, BEFORE (outside the ack sync's AROUND).
    Why: the pass boundary starts here; with upstream's carrier the votes need
    their own first exchange, paired with what a peer on SGLang's path runs
    first in a pass (its blocking ack-count reduce, inside this method).
    How: picks the carrier; once, the votes' first exchange.
    Stands down: not eligible, or the ack sync carries them (its exchange agrees)."""
    vote_pass.begin_pass(FEATURE.ensure(cache), cache, carrier(cache))
    return None


@FEATURE.hook(CACHE_CLASS, "check_hicache_events", "AFTER")
def after_check_hicache_events(result, cache, *args, **kwargs):
    """check_hicache_events, AFTER.
    Why: the scheduler runs it once per pass, before its walk: the boundary.
    How: an interval no section carried runs what it held back; logs the path
    on a change.
    Stands down: no storage backend, a policy the votes do not hold, PP, world
    size 1, a linker, the setting off, or a release the guard has no votes
    for: upstream's per-request path runs."""
    vote_pass.end_pass(FEATURE.ensure(cache), cache)
    return result


@FEATURE.hook(CACHE_CLASS, "_sync_hicache_ready_counts", "AROUND")
def around_sync_hicache_ready_counts(original, cache, *args, **kwargs):
    """_sync_hicache_ready_counts, AROUND (nested outside the ack sync's: one
    registered hook, kit.hooks).
    Why: with the ack sync on upstream's blocking path (buffer_only) its reduce
    is the one collective the pass already runs.
    How: the votes' section rides that reduce (vote_pass.ride_upstream), its
    decisions made before upstream pops.
    Stands down: whenever the ack sync carries the votes or they are off."""
    return vote_pass.ride_upstream(FEATURE.state_of(cache), cache, original, *args, **kwargs)


@FEATURE.hook(CACHE_CLASS, "_can_terminate_prefetch", "AROUND")
def around_can_terminate_prefetch(original, cache, operation, *args, **kwargs):
    """_can_terminate_prefetch, AROUND.
    Why: stock ends a prefetch here, in the walk, on the walk's agreed state
    (timeout: after one blocking MAX all_reduce per request reached).
    How: while the interval is held, notes the reach and this rank's vote and
    answers no; where the section is read back, yes for the operation a
    verdict ends; past the section's slots, upstream's own reduce decides.
    Stands down: calls the original outside a held interval or policy."""
    state = FEATURE.state_of(cache)
    return vote_pass.verdict(state, cache, original, operation, *args, **kwargs)


@FEATURE.hook(CACHE_CLASS, "prefetch_from_storage", "AROUND")
def around_prefetch_from_storage(original, cache, request, *args, **kwargs):
    """prefetch_from_storage, AROUND.
    Why: stock judges a new prefetch's budget (prefetch_rate_limited) on the
    occupancy its walk left; here operations stock ended are still held until
    their decisions land, so this rank's budget can say no where stock's said yes.
    How: where the budget is spent, starts it anyway and confirms it where
    stock decided it (vote_apply.confirm: revoked, and upstream's own decline
    replayed, where stock would have declined).
    Stands down: outside a held interval, or with the budget free (stock's
    was too)."""
    state = FEATURE.state_of(cache)
    if not deferring(state):
        return original(cache, request, *args, **kwargs)
    return vote_apply.start(state, cache, original, request, args, kwargs)


@FEATURE.hook(CACHE_CLASS, "release_aborted_request", "AROUND")
def around_release_aborted_request(original, cache, request, *args, **kwargs):
    """release_aborted_request, AROUND.
    Why: stock releases an aborted request's prefetch on the state its walk
    left; here that state is still ahead of the decisions in flight.
    How: inside a held interval, the release runs where the interval's
    decisions land, in its order (and drops a pin a stop took).
    Stands down: outside a held interval: upstream's, at once."""
    state = FEATURE.state_of(cache)
    if state is None or not deferring(state):
        if state is not None:
            state.pins.release(cache, request)
        return original(cache, request, *args, **kwargs)
    state.book.defer(vote_apply.Abort(original, request, args, kwargs))
    return None


@FEATURE.hook(CACHE_CLASS, "finish_storage_prefetch_admission", "AFTER")
def after_finish_storage_prefetch_admission(result, cache, request, *args, **kwargs):
    """finish_storage_prefetch_admission, AFTER.
    Why: the scheduler calls it for every request it admits to the batch.
    How: drops the host lock a stop put on the pages it inserted (the
    admission's load-back holds them from here, as in stock).
    Stands down: never holds anything."""
    state = FEATURE.state_of(cache)
    if state is not None:
        state.pins.release(cache, request)
    return result


@FEATURE.hook(CACHE_CLASS, "reset", "AFTER")
def after_reset(result, cache, *args, **kwargs):
    """reset, AFTER (flush_cache).
    Why: the tree and every prefetch are gone; so are the pins' nodes.
    How: forgets the pins (verdicts are by identity: none applies to what reset
    dropped).
    Stands down: never holds anything."""
    state = FEATURE.state_of(cache)
    if state is not None:
        state.pins.forget()
    return result
