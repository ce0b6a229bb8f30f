"""Storage-prefetch decisions on SGLang's UnifiedRadixCache, riding the ack counts'
reduce: the feature, its per-cache state (hooks: :mod:`.vote_hooks`; landing:
:mod:`.vote_landing`; the book: :mod:`..protocol.votes`; docs/design.md).

Stock decides a prefetch's end in the waiting-queue walk: under ``timeout`` with one
blocking MAX all_reduce per request reached, under ``best_effort`` at once. Here the walk
runs no collective: it notes the reach and this rank's vote and answers "not yet"; the
walk rides the next reduce as one section, and every stop is made where it is read
back, through upstream's code, in walk order. Carriers, one collective per pass either
way: the ack sync's async reduce (host memory mode ``cache``: ``timeout`` and
``best_effort``; depth + 1 passes late), or, with the ack sync on upstream's blocking
reduce, that reduce (``timeout`` only, after the votes' own first exchange; one pass late).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, cast

from ..env import ENABLE_VAR, PREFETCH_VOTES_VAR, READ_ONCE_VAR, read_once_enabled
from ..errors import PrefetchVoteError, PrefetchVoteMismatch
from ..guard import CACHE_CLASS
from ..kit.collectives import ride_ready_counts, upstream_count_slots
from ..kit.decision import Decision, blocking, missing_attrs, untested_release
from ..kit.environment import Environment
from ..kit.feature import Carrier, Feature, FeatureState, feature_release, state_of
from ..kit.groups import group_decision
from ..kit.views import Cache, Operation, Request, VoteMetrics
from ..names import ACK, BEST_EFFORT, LOGGER_NAME, PREFETCH_VOTES, STOP_POLICIES, TIMEOUT
from ..protocol.errors import ProtocolError
from ..protocol.stamp import (
    PROTOCOL_VERSION,
    READ_ONCE_FLAG,
    VOTES_FLAG,
    VOTES_SETTING_FLAG,
    Stamp,
    describe_mismatch,
    pack_stamp,
    stamps_differ,
)
from ..protocol.votes import VOTE_SLOTS, VOTES_PROTOCOL, Ballot, Exchange, VoteBook
from ..wire import protocol_hint
from .vote_landing import PREDICATE, Landing, operation_key
from .vote_starts import READ_ONCE, Remainder, Start, Starts

logger = logging.getLogger(LOGGER_NAME)
REQUIRED_ATTRS = ("ongoing_prefetch", "prefetch_stop_policy", "pp_rank", "enable_storage")
RIDE_ACK, RIDE_UPSTREAM = "ack", "upstream"  # the carriers (PrefetchVoteState.mode)
HELD = (TIMEOUT, BEST_EFFORT)  # the policies whose walks the votes hold
# The votes' layout flags in the ack sync's reduce: their section rides it; their setting.
FLAGS = {
    VOTES_FLAG: "the prefetch votes' section (a storage backend under a walk's stop policy)",
    VOTES_SETTING_FLAG: PREFETCH_VOTES_VAR,
    READ_ONCE_FLAG: READ_ONCE_VAR,
}
MISMATCH_HINTS = {
    "protocol": f"{protocol_hint()} Set {PREFETCH_VOTES_VAR} identically on every node.",
    # a peer whose ack counts pipeline (the votes on there) greets with the ack sync's
    f"protocol {PROTOCOL_VERSION}": (
        "a peer's ack counts pipeline and carry the prefetch votes while this rank's keep "
        f"SGLang's storage path: {PREFETCH_VOTES_VAR} is on there and off here (or the votes "
        "do not run on this SGLang). Set it identically on every node."
    ),
    "stock": (
        "that rank runs SGLang's blocking path: give every node of the TP group the same "
        f"install and the same {ENABLE_VAR} / {PREFETCH_VOTES_VAR}."
    ),
}
ADDER_CLASS = "sglang.srt.managers.schedule_policy.PrefillAdder"
SCHEDULER_CLASS = "sglang.srt.managers.scheduler.Scheduler"
# dynamic_blocker's answers that name no value: built once (asked twice a pass)
LINKER = blocking("external cache linker attached (no ack-count reduce)", "linker")
NO_CONTROLLER = blocking("HiCache controller not attached", "no_controller")
NO_STORAGE = blocking("no storage backend attached (no prefetch to decide)", "no_storage")


def static_decision(
    cache: Cache, release: Optional[str], blocker: Optional[Decision], env: Environment
) -> Decision:
    """The votes need a group that runs a collective (as for the ack counts)."""
    return (
        blocker
        or untested_release(release, f"the votes' methods (UnifiedRadixCache.{PREDICATE} ...)")
        or missing_attrs(cache, REQUIRED_ATTRS)
        or missing_attrs(cache, (PREDICATE,))
        or group_decision(cache, env.collectives.world_size)
    )


class PrefetchVoteState(FeatureState):
    """What is kept per cache, and the ack sync's rider; kept with the votes off too, as
    their setting is agreed in a first exchange (a peer that differs is named)."""

    sync = PREFETCH_VOTES
    flags: Mapping[int, str] = FLAGS
    layout_bit = VOTES_FLAG
    landing_class: type[Landing] = Landing

    def __init__(self, cache: Cache, blocker: Optional[Decision], env: Environment) -> None:
        release = feature_release(self.sync.name)
        super().__init__(static_decision(cache, release, blocker, env), env)
        sink = env.events
        self.emit: Callable[..., None] = (
            (lambda kind, **fields: None)
            if sink is None
            else (lambda kind, **fields: sink(kind, pass_no=self.passes, **fields))
        )
        self.enabled = self.sync.setting.read()
        # the votes off, nothing of theirs runs (their read-once setting is not read)
        self.read_once = self.enabled and read_once_enabled()
        self.book = VoteBook(hints=MISMATCH_HINTS)
        self.landing = self.landing_class(self.emit)
        self.starts = Starts(self.emit)
        self.passes = 0  # pass boundaries seen (the same on every rank): the one counter
        self.mode: Optional[str] = None  # this pass's carrier
        self.active = False  # this interval rides a section (its walk is held)
        self.closed_at = -1  # the pass whose boundary closed (or dropped) the interval
        self.label: Optional[str] = None  # how the scheduler numbers this pass
        self.interval_label: Optional[str] = None  # ... the pass whose interval is open
        self.said_overflow = False

    def dynamic_blocker(self, cache: Cache) -> Optional[Decision]:
        """Why no section holds this pass's walk (the setting aside; shared by all ranks)."""
        if getattr(cache, "linker", None) is not None:  # first: it takes the controller's place
            return LINKER
        if cache.cache_controller is None:
            return NO_CONTROLLER
        if not cache.enable_storage:
            return NO_STORAGE
        if cache.pp_size != 1:
            return blocking(f"pp_size={cache.pp_size} (PP0 decides, sent along PP)", "pp")
        policy = cache.prefetch_stop_policy
        if policy not in STOP_POLICIES:
            return blocking(f"prefetch policy {policy!r} is not one the votes know", "policy")
        if policy != TIMEOUT and self.mode != RIDE_ACK:
            return blocking(
                f"prefetch policy {policy!r} runs no collective and the ack sync keeps "
                "upstream's path (nothing lags)",
                "policy_not_timeout",
            )
        return None

    def rides(self, cache: Cache) -> bool:
        """Whether this pass's section rides (its setting on, nothing blocking it)."""
        return self.enabled and super().decide(cache).pipelined

    def decides_walk(self, cache: Cache) -> bool:
        """Whether the votes, not upstream's per-request reduce, judge this cache's walks
        wherever its carrier pipelines (the ack counts pipeline storage only then)."""
        return self.enabled and self.static.pipelined

    def decide(self, cache: Cache) -> Decision:
        """This pass's path, once its boundary is done."""
        eligible = super().decide(cache)
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

    def launch_decision(self, cache: Cache, carrier_pipelines: bool) -> Decision:
        """The path once the group agreed on a carrier that pipelines or not (doctor: a
        launch judged before it runs)."""
        self.mode = carrier_mode(carrier_pipelines)
        return super().decide(cache) if self.enabled else self.decide(cache)

    def failed(self, exc: Exception) -> None:
        self.active = False
        super().failed(cast(PrefetchVoteError, exc))

    def vote_metrics(self) -> Optional[VoteMetrics]:
        """The metrics as the votes' own series (a test's sink takes the same calls)."""
        return cast(Optional[VoteMetrics], self.metrics)

    def begin_pass(self, cache: Cache, carrier: Carrier) -> None:
        """Before check_hicache_events: release the last pass's pins, pick the carrier
        (with upstream's, the votes' first exchange once)."""
        self.passes += 1
        self.landing.pins.release_all(cache)
        if not cache.enable_storage:
            # nothing to decide (dynamic_blocker): what a detach left held runs; the
            # carrier is picked only where it matters, on a pass with storage attached
            self.run_starts(cache, self.starts.every())
            return
        self.run_starts(cache, self.starts.landed(cache))
        self.mode = carrier_mode(carrier.pipelines(cache))
        if self.mode == RIDE_UPSTREAM and not self.agreed and super().decide(cache).pipelined:
            try:
                self.first_exchange(cache)
            except PrefetchVoteError as exc:
                self.failed(exc)
                raise

    def end_pass(self, cache: Cache) -> None:
        """After check_hicache_events: drop an interval no section carried."""
        if self.closed_at != self.passes:
            self.no_section(cache)
        self.run_starts(cache, self.starts.landed(cache))  # reads retired in the pops
        self.announce(self.decide(cache))

    def reach(self, cache: Cache, original: Callable[..., Any], operation: Operation) -> bool:
        """_can_terminate_prefetch: while a stop is applied, yes for that operation; in a
        held walk, note the reach and this rank's vote and answer "not yet"."""
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

    def admit(self, req: Request, prefix_len: int) -> None:
        """A request joined the batch with ``prefix_len`` cached tokens."""
        if self.active:
            extend = int(getattr(req, "extend_end", prefix_len) or prefix_len) - int(prefix_len)
            self.book.admit(operation_key(req.cache_request_handle), prefix_len, extend)

    def start(self, cache: Cache, run: Callable[[], Any], handle: Hashable, want: Remainder) -> Any:
        """prefetch_from_storage: runs now, or is held (:mod:`.vote_starts`)."""
        starts = self.starts
        if starts.rerun is not None and starts.rerun == handle:  # a held start runs now
            starts.rerun_tokens = len(want.tokens) - len(want.tokens) % cache.page_size
            return run()
        if not self.active or cache.host_memory_mode != "cache" or handle in cache.ongoing_prefetch:
            return run()  # no section carries this interval, no read lands in the tree, or
            # its own read is in flight (upstream returns at once)
        # a start outside a boundary is of the interval the next boundary closes
        held = starts.choose(cache, handle, want, self.read_once, self.passes, self.passes + 1)
        if held is None:
            return run()
        starts.hold(held)
        metrics = self.vote_metrics()
        if metrics is not None:
            metrics.on_hold(held.why)
        return None

    def progress(self, cache: Cache, original: Callable[[Cache, Hashable], bool],
                 handle: Hashable) -> bool:  # fmt: skip
        """check_prefetch_progress: a held start's request is not ready; a read that
        lands here releases the starts waiting on it, before anything can evict it."""
        if self.starts.is_held(handle):
            return False
        awaited = self.starts.awaited(handle)
        done = bool(original(cache, handle))
        if awaited and handle not in cache.ongoing_prefetch:
            self.run_starts(cache, self.starts.landed(cache))
        return done

    def forget(self) -> None:
        """The tree was reset (flush_cache): pins and held starts go with it."""
        self.landing.pins.forget()
        self.starts.forget()

    def aborted(self, cache: Cache, handle: Hashable) -> None:
        """release_aborted_request ran: a held start is dropped, a read's waiters run."""
        self.starts.drop(handle)
        self.run_starts(cache, self.starts.landed(cache))

    def run_starts(self, cache: Cache, due: Sequence[Start]) -> None:
        """Run released starts in the order they were held, on the state as it is."""
        if not due:
            return
        metrics = self.vote_metrics()
        for start in due:
            asked = self.starts.run(start, self.passes)
            if metrics is not None and start.why == READ_ONCE:
                metrics.on_read_once(0 if asked is None else max(0, start.tokens - asked))

    def local_flags(self, cache: Cache) -> int:
        return (int(self.rides(cache)) << VOTES_FLAG | int(self.enabled) << VOTES_SETTING_FLAG
                | int(self.read_once) << READ_ONCE_FLAG)  # fmt: skip

    def take(self, cache: Cache, token: object, reduced: Sequence[int], carrier: Carrier) -> None:
        """A section came back reduced (riding the ack counts' reduce)."""
        self.land(cache, token, reduced, carrier.exchange)

    def land(self, cache: Cache, token: object, reduced: Sequence[int], exchange: Exchange) -> None:
        """Check the agreement and make the stops, before this boundary's pops
        (``exchange``: the overflow exchanges)."""
        assert isinstance(token, Ballot)
        verdicts = self.book.read(token, reduced, exchange)  # its carrier titles its errors
        stopped = self.landing.apply(cache, verdicts)
        metrics = self.vote_metrics()
        if metrics is not None and stopped:
            metrics.on_stop(stopped)
        self.run_starts(cache, self.starts.due(token.pass_no))

    def holds_walk(self, cache: Cache) -> bool:
        return self.active

    def section(self, cache: Cache, last: bool = False) -> tuple[list[int], object]:
        """Close this interval into the section the next reduce carries (``last``: its
        carrier's layout dropped the votes' bit; the next walk is stock's)."""
        t0 = time.perf_counter()
        reaches = len(self.book.reaches)
        values, ballot = self.book.close(
            self.passes, len(cache.ongoing_prefetch), cache.prefetch_stop_policy, self.pass_label()
        )
        self.active = not last
        self.closed_at = self.passes
        self.interval_label = self.label
        past = max(0, reaches - VOTE_SLOTS)
        self.emit("section", reaches=reaches, overflow=past)
        if past and not self.said_overflow:
            self.said_overflow = True
            logger.warning(
                "%s: the waiting-queue walk of scheduling pass %s reached "
                "%d requests with an ongoing storage prefetch; the %d past the section's %d "
                "slots are voted in overflow exchanges where the section is read back (one "
                "blocking reduce per %d of them; counted in "
                "sglang:hicache_prefetch_votes_fallback_reaches_total; said once per cache)",
                self.sync.title, ballot.label, reaches, past, VOTE_SLOTS, VOTE_SLOTS,
            )  # fmt: skip
        metrics = self.vote_metrics()
        if metrics is not None:
            metrics.on_pass(None, time.perf_counter() - t0, reaches, past)
        return values, ballot

    def no_section(self, cache: Cache) -> None:
        self.book.discard()
        self.run_starts(cache, self.starts.due(self.passes))
        self.active = False
        self.closed_at = self.passes
        self.interval_label = self.label

    def pass_label(self) -> str:
        """The interval being closed, as the scheduler numbers its pass."""
        n = self.passes
        return self.interval_label or f"#{n} (this cache's check_hicache_events #{n})"

    def first_exchange(self, cache: Cache) -> None:
        """The votes' own first exchange (upstream's carrier), once: a blocking reduce in
        upstream's ack-count shape (``[on, -on, 0, ...]``, then the stamp where upstream
        sends its digest), so a stock peer or one with the votes off is named."""
        on = int(self.enabled) | int(self.read_once) << 1  # both settings, agreed
        x = pack_stamp(VOTES_PROTOCOL, False, 1, VOTE_SLOTS, 0)
        self.emit("agreed")
        values = [on, -on] + [0] * (upstream_count_slots(cache) - 2) + [x, -x]
        try:
            reduced = self.collectives.blocking_min(cache)(values)
        except Exception as exc:
            raise PrefetchVoteError(
                f"{self.sync.title}: the first exchange failed ({exc}); a peer rank "
                "may have died or run another configuration"
            ) from exc
        lo_x, hi_x = reduced[-2], -reduced[-1]
        if stamps_differ(x, lo_x, hi_x):
            why = describe_mismatch(
                Stamp.unpack(x), Stamp.unpack(lo_x), Stamp.unpack(hi_x), MISMATCH_HINTS
            )
            raise PrefetchVoteMismatch(
                f"{self.sync.title}: ranks disagree on the first exchange: {why} "
                "Stopping before any vote."
            )
        lo_on, hi_on = reduced[0], -reduced[1]
        if lo_on != hi_on:
            var = PREFETCH_VOTES_VAR if (lo_on ^ hi_on) & 1 else READ_ONCE_VAR
            bit = 0 if var == PREFETCH_VOTES_VAR else 1
            raise PrefetchVoteMismatch(
                f"{self.sync.title}: {var} differs across the TP group: this rank "
                f"{on >> bit & 1}, group min {lo_on >> bit & 1}, max {hi_on >> bit & 1}. Set "
                "it identically on every node. Stopping before any vote."
            )
        self.agreed = True

    def ride_upstream(self, cache: Cache, original: Callable[[Cache], Any]) -> Any:
        """_sync_hicache_ready_counts with upstream's carrier: the section rides its
        blocking reduce; the stops land before upstream pops."""
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
            if reduced is None:
                raise PrefetchVoteError(
                    f"{self.sync.title}: upstream's _sync_hicache_ready_counts ran no reduce "
                    "the votes could ride (this SGLang does not do what they were written "
                    "for); stopping before any verdict"
                )
        except PrefetchVoteError as exc:
            self.failed(exc)
            raise
        try:
            self.land(cache, ballot, reduced, self.collectives.blocking_min(cache))
        except ProtocolError as exc:  # no owner's step around this one: titled here
            raise self.fail(exc) from exc
        return result


def carrier_mode(carrier_pipelines: bool) -> str:
    """The votes' carrier: the ack counts' pipelined reduce, or upstream's blocking one."""
    return RIDE_ACK if carrier_pipelines else RIDE_UPSTREAM


FEATURE = Feature(PREFETCH_VOTES, PrefetchVoteState, CACHE_CLASS, rides=ACK, after=(ACK,))


def votes_of(cache: Optional[Cache]) -> Optional[PrefetchVoteState]:
    """The cache's vote state, if built (a hook's object may carry none)."""
    return state_of(FEATURE, cache)
