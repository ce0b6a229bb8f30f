"""Storage-prefetch decisions on SGLang's UnifiedRadixCache, riding the ack
counts' reduce: the feature, its per-cache state and its hooks (where the
verdicts land: :mod:`.vote_landing`; the book: :mod:`..protocol.votes`).

Stock decides a prefetch's end in the scheduler's waiting-queue walk, each time
the walk reaches its request: under ``--hicache-storage-prefetch-policy
timeout`` (the default) with one blocking MAX all_reduce of "this rank's
deadline passed" per request reached, under ``best_effort`` at once. Here, in a
walk, ``_can_terminate_prefetch`` runs no collective: it notes the reach and
this rank's vote and answers "not yet". The walk (its reaches, and the requests
the batch admitted) rides the next reduce as one section; where that reduce is
read back, before its boundary's pops, the cache holds the agreed state
stock's walk saw, and every stop is made there through upstream's own code,
in walk order: **every decision stock makes at pass p from agreed state, the
plugin makes at pass p + depth + 1 from that state.** Nothing else is held:
aborts and prefetch starts run at once, as in stock (the limiter counts the
reads still running until their stops land; docs/design.md).

Two carriers, one collective per pass either way:

* the ack sync pipelines (host memory mode ``cache``): the section rides its
  async reduce (a :class:`~hicache_async_ack.kit.feature.Rider`), for the
  ``timeout`` and ``best_effort`` walks; decisions depth + 1 passes after the walk.
* the ack sync keeps upstream's blocking reduce (``buffer_only``, or the ack
  sync standing down on its own), under ``timeout`` only (nothing lags
  otherwise): after the votes' own first exchange, the section rides that
  reduce inside ``_sync_hicache_ready_counts``; decisions one pass after the walk.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from ..env import ENABLE_VAR, PREFETCH_VOTES_VAR, prefetch_votes_enabled
from ..errors import PrefetchVoteError, PrefetchVoteMismatch
from ..guard import feature_release
from ..kit.collectives import Collectives, upstream_count_slots
from ..kit.decision import Decision, blocking, missing_attrs, untested_release
from ..kit.environment import environment
from ..kit.feature import Feature, FeatureState
from ..kit.groups import group_decision
from ..kit.hooks import unhooked
from ..names import ACK, LOGGER_NAME, VOTES
from ..protocol.stamp import Stamp, describe_mismatch, pack_stamp, stamps_differ
from ..protocol.votes import VOTE_SLOTS, VOTES_PROTOCOL, Ballot, VoteBook
from . import ack_sync
from .vote_landing import PREDICATE, Landing, operation_key

logger = logging.getLogger(LOGGER_NAME)
REQUIRED_ATTRS = ("ongoing_prefetch", "prefetch_stop_policy", "pp_rank", "enable_storage")
RIDE_ACK, RIDE_UPSTREAM = "ack", "upstream"  # the carriers (PrefetchVoteState.mode)
TIMEOUT, BEST_EFFORT, WAIT_COMPLETE = "timeout", "best_effort", "wait_complete"
HELD = (TIMEOUT, BEST_EFFORT)  # the policies whose walks the votes hold
ALL_REDUCE = "_all_reduce"
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
    "release_aborted_request",
    "reset",
)
ADDER_CLASS = "sglang.srt.managers.schedule_policy.PrefillAdder"
SCHEDULER_CLASS = "sglang.srt.managers.scheduler.Scheduler"
ADMISSION_HOOKED = ("_account_prefill_cache_admission", "add_chunked_req")


def static_decision(cache: Any, release: Optional[str], blocker: Optional[Decision]) -> Decision:
    """The votes need a group that runs a collective (world size > 1; attention
    CP x TP where one TP group spans both, as for the ack sync)."""
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
    upstream's carrier the votes' own), so a peer without the plugin or with
    the votes off stops every plugin rank by name."""

    feature = VOTES
    flags: Mapping[int, str] = FLAGS
    layout_bit = VOTES_FLAG
    landing_class: type[Landing] = Landing

    def __init__(
        self,
        cache: Any,
        enabled: bool,
        release: Optional[str],
        blocker: Optional[Decision] = None,
        coll: Optional[Collectives] = None,
    ) -> None:
        super().__init__(static_decision(cache, release, blocker), coll)
        sink = environment().events
        self.emit: Callable[..., None] = (
            (lambda kind, **fields: None)
            if sink is None
            else (lambda kind, **fields: sink(kind, pass_no=self.passes, **fields))
        )
        self.enabled = enabled
        self.book = VoteBook(hints=MISMATCH_HINTS)
        self.landing = self.landing_class(self.emit)
        self.passes = 0  # check_hicache_events calls seen (the same on every rank)
        self.mode: Optional[str] = None  # this pass's carrier
        self.active = False  # this interval rides a section (its walk is held)
        self.closed_at = -1  # the pass whose boundary closed (or dropped) the interval
        self.label: Optional[str] = None  # how the scheduler numbers this pass
        self.interval_label: Optional[str] = None  # ... the pass whose interval is open
        self.said_overflow = False

    # ------------------------------------------------------------- the path
    def dynamic_blocker(self, cache: Any) -> Optional[Decision]:
        """Why no section holds this pass's walk (the setting aside): conditions
        every rank shares."""
        if cache.cache_controller is None:
            return blocking("HiCache controller not attached", "no_controller")
        if not cache.enable_storage:
            return blocking("no storage backend attached (no prefetch to decide)", "no_storage")
        if cache.pp_size != 1:
            return blocking(f"pp_size={cache.pp_size} (PP0 decides, sent along PP)", "pp")
        if getattr(cache, "linker", None) is not None:
            return blocking("external cache linker attached (no ack-count reduce)", "linker")
        policy = cache.prefetch_stop_policy
        if policy not in (TIMEOUT, BEST_EFFORT, WAIT_COMPLETE):
            return blocking(f"prefetch policy {policy!r} is not one the votes know", "policy")
        if policy != TIMEOUT and self.mode != RIDE_ACK:
            return blocking(
                f"prefetch policy {policy!r} runs no collective and the ack sync keeps "
                "upstream's path (nothing lags)",
                "policy_not_timeout",
            )
        return None

    def eligible(self, cache: Any) -> Decision:
        return super().decide(cache)

    def rides(self, cache: Any) -> bool:
        return self.enabled and self.eligible(cache).pipelined

    def decide(self, cache: Any) -> Decision:
        """This pass's path, once its boundary is done."""
        eligible = self.eligible(cache)
        if not eligible.pipelined:
            return eligible
        if not self.enabled:
            return blocking(f"{PREFETCH_VOTES_VAR}=0", "feature_disabled_by_env")
        if not self.active:
            return blocking("the group agrees on the votes' layout at a coming pass", "agreeing")
        return eligible

    def pipelined_details(self, decision: Decision) -> Sequence[str]:
        if self.mode == RIDE_ACK:
            how = "riding the ack counts' pipelined reduce; decisions depth + 1 passes late"
        else:
            how = "riding upstream's blocking ack-count reduce; decisions one pass late"
        return (f"world size {decision.world_size}", how, "no collective per request")

    def failed(self, exc: PrefetchVoteError) -> None:
        self.active = False
        if self.metrics is not None:
            reason = "mismatch" if isinstance(exc, PrefetchVoteMismatch) else "failure"
            self.metrics.on_failure(reason)

    # --------------------------------------------------------- the boundary
    def begin_pass(self, cache: Any, carrier: Any) -> None:
        """Before check_hicache_events: the last pass is over (its pins go);
        pick this pass's carrier; with upstream's, the votes' first exchange once."""
        self.passes += 1
        self.landing.pins.release_all(cache)
        pipelines = carrier.sync is not None and carrier.decide(cache).pipelined
        self.mode = RIDE_ACK if pipelines else RIDE_UPSTREAM
        if self.mode == RIDE_UPSTREAM and not self.agreed and self.eligible(cache).pipelined:
            try:
                self.first_exchange(cache)
            except PrefetchVoteError as exc:
                self.failed(exc)
                raise

    def end_pass(self, cache: Any) -> None:
        """After check_hicache_events: an interval no section carried is dropped
        (the next walk reaches its requests again, on the path the cache is then)."""
        if self.closed_at != self.passes:
            self.no_section(cache)
        self.announce(self.decide(cache))

    # ------------------------------------------------------------- the walk
    def reach(self, cache: Any, original: Callable[..., Any], operation: Any) -> bool:
        """_can_terminate_prefetch: while a stop is applied, yes for that
        operation; in a held walk, note the reach (this rank's vote: PP0's
        deadline predicate, as upstream reduces it) and answer "not yet"."""
        applying = self.landing.applying
        if applying is not None:
            return applying is operation
        policy = cache.prefetch_stop_policy
        if not self.active or policy not in HELD or cache.pp_size != 1:
            return bool(original(cache, operation))
        expired = policy == BEST_EFFORT or bool(getattr(cache, PREDICATE)(operation))
        key = operation_key(operation.handle)
        self.book.poll(key, operation, expired)
        self.emit("reach", key=key, expired=expired)
        return False

    def admit(self, req: Any, prefix_len: int) -> None:
        """A request joined the batch with ``prefix_len`` cached tokens."""
        if self.active:
            extend = int(getattr(req, "extend_end", prefix_len) or prefix_len) - int(prefix_len)
            self.book.admit(operation_key(req.cache_request_handle), prefix_len, extend)

    # ------------------------------------------------------ the rider's part
    def local_flags(self, cache: Any) -> int:
        return int(self.rides(cache)) << VOTES_FLAG | int(self.enabled) << SETTING_FLAG

    def take(self, cache: Any, token: object, reduced: Sequence[int]) -> None:
        """A section came back reduced (riding the ack sync's reduce)."""
        self.land(cache, token, reduced, carrier(cache).exchange)

    def land(self, cache: Any, token: object, reduced: Sequence[int], exchange: Any) -> None:
        """Check the agreement, then make the interval's stops here, before this
        boundary's pops; ``exchange`` runs the overflow exchanges past the slots."""
        assert isinstance(token, Ballot)
        try:
            verdicts = self.book.read(token, reduced, exchange)
        except PrefetchVoteError as exc:
            self.failed(exc)
            raise
        stopped = self.landing.apply(cache, verdicts)
        if self.metrics is not None and stopped:
            self.metrics.on_stop(stopped)

    def after_pops(self, cache: Any) -> None:
        """Nothing: every decision lands before the pops."""

    def section(self, cache: Any) -> tuple[list[int], object]:
        """Close this interval into the section the next reduce carries."""
        t0 = time.perf_counter()
        reaches = len(self.book.reaches)
        values, ballot = self.book.close(
            len(cache.ongoing_prefetch), cache.prefetch_stop_policy, self.pass_label()
        )
        self.active = True
        self.closed_at = self.passes
        self.interval_label = self.label
        past = max(0, reaches - VOTE_SLOTS)
        self.emit("section", reaches=reaches, overflow=past)
        if past and not self.said_overflow:
            self.said_overflow = True
            logger.warning(
                "HiCache prefetch votes: the waiting-queue walk of scheduling pass %s reached "
                "%d requests with an ongoing storage prefetch; the %d past the section's %d "
                "slots are voted in overflow exchanges where the section is read back (one "
                "blocking reduce per %d of them; counted in "
                "sglang:hicache_prefetch_votes_fallback_reaches_total; said once per cache)",
                ballot.label, reaches, past, VOTE_SLOTS, VOTE_SLOTS,
            )  # fmt: skip
        if self.metrics is not None:
            self.metrics.on_pass(None, time.perf_counter() - t0, reaches, past)
        return values, ballot

    def no_section(self, cache: Any) -> None:
        self.book.discard()
        self.active = False
        self.closed_at = self.passes
        self.interval_label = self.label

    def pass_label(self) -> str:
        """The interval being closed, as the scheduler numbers its pass."""
        walk = self.book.walks
        return self.interval_label or f"#{walk} (this cache's check_hicache_events #{walk})"

    # -------------------------------------------------- upstream's carrier
    def first_exchange(self, cache: Any) -> None:
        """The votes' own first exchange (upstream's carrier), once, before
        anything the blocking path would not run: one blocking reduce through
        the cache's own ``_all_reduce`` in upstream's ack-count shape (``[on,
        -on, 0, ...]`` where upstream sends counts, ``[x, -x]`` with the votes'
        stamp where it sends its digest). A peer on SGLang's path pairs it with
        its own ack-count reduce, fails upstream's digest check there, and every
        plugin rank names it; a peer with the votes off is named too."""
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
        if stamps_differ(x, lo_x, hi_x):
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

    def ride_upstream(self, cache: Any, original: Callable[..., Any]) -> Any:
        """_sync_hicache_ready_counts with upstream's carrier: the section rides
        its blocking reduce, and the interval's stops land before upstream pops."""
        if (
            self.mode != RIDE_UPSTREAM
            or not self.agreed
            or not self.rides(cache)
            or self.closed_at == self.passes
        ):
            return original(cache)
        values, ballot = self.section(cache)
        try:
            result, reduced = ride_ready_counts(cache, original, values)
        except PrefetchVoteError as exc:
            self.failed(exc)
            raise
        self.land(cache, ballot, reduced, self.collectives.blocking_min(cache))
        return result


def ride_ready_counts(
    cache: Any, original: Callable[..., Any], values: Sequence[int]
) -> tuple[Any, list[int]]:
    """Run ``original`` (``_sync_hicache_ready_counts``) with ``values`` riding
    its reduce: for the length of that call ``_all_reduce`` is shadowed on the
    instance, and its first MIN of a 1-D int64 tensor (the ready counts: the
    only reduce that method runs at pp_size 1) is reduced with ``values``
    appended; upstream gets its own values back in place. Returns its result
    and the reduced ``values``."""
    import torch

    inst = cache.__dict__
    shadowed = ALL_REDUCE in inst
    before = inst.get(ALL_REDUCE)
    base = getattr(cache, ALL_REDUCE)  # whatever upstream would call (a test's wrapper too)
    reduced: list[list[int]] = []

    def all_reduce(tensor: Any, op: Any, *a: Any, **kw: Any) -> Any:
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
        result = original(cache)
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


def build(cache: Any) -> PrefetchVoteState:
    """The cache's vote state (the setting read now), joined to the ack sync's
    state as a rider."""
    problem = unhooked(type(cache), HOOKED, VOTES) or admission_hooks_missing()
    blocker = blocking(problem, "hooks_missing") if problem else None
    cls = environment().state_class(VOTES, PrefetchVoteState)
    state = cls(cache, prefetch_votes_enabled(), feature_release(VOTES), blocker)
    carrier(cache).add_rider(state)
    return state


def carrier(cache: Any) -> Any:
    """The ack sync's state: it carries the votes where it pipelines."""
    return ack_sync.FEATURE.ensure(cache)


FEATURE = Feature(VOTES, "_hicache_prefetch_votes_state", build, after=(ACK,))


def state_of(cache: Any) -> Optional[PrefetchVoteState]:
    return FEATURE.state_of(cache) if cache is not None else None


def admission_hooks_missing() -> Optional[str]:
    """Why the admission hooks are not in place, or None."""
    try:
        from sglang.srt.managers.schedule_policy import PrefillAdder
    except Exception as exc:  # no scheduler module: nothing admits here
        return f"sglang.srt.managers.schedule_policy cannot be imported ({exc!r})"
    return unhooked(PrefillAdder, ADMISSION_HOOKED, VOTES)
