"""The pipelined ack-count sync on SGLang's UnifiedRadixCache: an owner on the kit's
template (:mod:`..kit.owner`), its per-cache state and its hooks. Upstream's own
``check_hicache_events`` runs between consume and issue, its
``_sync_hicache_ready_counts`` answered from the consumed agreement, once.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, cast

from .. import __version__
from ..env import (
    DEPTH_MAX,
    DEPTH_VAR,
    ENABLE_VAR,
    PLUGINS_VAR,
    PREFETCH_VOTES_VAR,
    read_settings,
)
from ..errors import HiCacheAckSyncError
from ..guard import CACHE_CLASS
from ..kit.decision import Decision, blocking, missing_attrs, untested_release
from ..kit.environment import Environment
from ..kit.feature import Feature, feature_release
from ..kit.groups import group_decision, no_span_reason
from ..kit.hooks import Fn
from ..kit.owner import OwnerState, Pops
from ..kit.views import AckMetrics, Cache, Controller, SyncMetrics
from ..names import (
    ACK_COUNTS,
    ACK_QUEUES,
    EXTRA_POOL_QUEUES,
    LOGGER_NAME,
    STORAGE_QUEUES,
    ExtraPool,
)
from ..protocol.depth import AutoDepth
from ..protocol.reduce import Consumed
from ..protocol.stamp import PROTOCOL_VERSION, STORAGE_FLAG
from ..protocol.votes import VOTES_PROTOCOL
from ..wire import protocol_hint

logger = logging.getLogger(LOGGER_NAME)

REQUIRED_CACHE_ATTRS = ("cache_controller", "linker", "host_memory_mode", "pp_size", "tp_group",
                        "tp_world_size", "attn_cp_group", "attn_tp_group", "enable_storage",
                        "tree_core")  # fmt: skip
TAG = f"hicache-async-ack {__version__}, protocol {PROTOCOL_VERSION}"
MISMATCH_HINTS = {
    "depth": f"Set {DEPTH_VAR} identically on every node of the TP group.",
    "auto": f"Set {DEPTH_VAR} identically on every node of the TP group.",
    "protocol": protocol_hint(),
    # a peer whose ack counts keep SGLang's storage path greets with the votes' exchange
    f"protocol {VOTES_PROTOCOL}": (
        "a peer's ack counts keep SGLang's storage path and its prefetch votes ran their own "
        f"first exchange: {PREFETCH_VOTES_VAR} is off there (or the votes do not run on its "
        "SGLang) while it is on here. Set it identically on every node."
    ),
    "stock": (
        "that rank does not pipeline: hicache-async-ack is not installed or not loaded "
        f"there (e.g. {PLUGINS_VAR} excludes it), {ENABLE_VAR}=0 is set there, or its cache "
        "is not eligible (its log line says why). Give every node of the TP group the same "
        "install and the same settings."
    ),
}
ACK_FLAGS = {STORAGE_FLAG: "a storage backend attached (the four storage queue counts)"}
NO_CONTROLLER = blocking("HiCache controller not attached", "no_controller")
# A walk the votes do not decide runs stock's per-request reduce on the prefetches'
# progress: with completions popped depth steps late it would judge staler progress than
# stock's, and run more of those reduces. Stock's storage path, then.
STORAGE_WITHOUT_VOTES = blocking(
    "a storage backend is attached and the prefetch votes do not decide the waiting-queue "
    f"walk ({PREFETCH_VOTES_VAR}=0, or not hooked on this SGLang): SGLang's storage path",
    "storage_without_votes",
)
LINKER = blocking("external cache linker attached", "linker")


def static_decision(cache: Cache, release: Optional[str], env: Environment) -> Decision:
    """The part of eligibility fixed for the cache's lifetime (its groups)."""
    return (
        untested_release(release, "the ack sync's upstream methods")
        or missing_attrs(cache, REQUIRED_CACHE_ATTRS)
        or group_decision(cache, env.collectives.world_size)
    )


def queue_entries(q: Any) -> list[object]:
    """Every entry of a storage queue.Queue, under its mutex (size and refs at once)."""
    if q is None:
        return []
    with q.mutex:
        return list(q.queue)


def ready_entries(cache: Cache, storage: bool) -> tuple[dict[Hashable, list[object]], int]:
    """Entries ready now per queue, in upstream's tensor order (fresh lists), and the
    reclaim digest; with ``storage`` (the agreed layout) the storage queues too (empty
    while this rank's storage is off)."""
    cc = cast(Controller, cache.cache_controller)  # dynamic_blocker: attached
    count = cache._count_ready_acks
    w, ld = cc.ack_write_queue, cc.ack_load_queue
    ready: dict[Hashable, list[object]] = {
        ACK_QUEUES[0]: w[: count(w)],
        ACK_QUEUES[1]: ld[: count(ld)],
    }
    if storage:
        live = cache.enable_storage
        for name in STORAGE_QUEUES:
            ready[name] = queue_entries(getattr(cc, name, None) if live else None)
        for pool, q in getattr(cc, EXTRA_POOL_QUEUES, {}).items():
            ready[ExtraPool(pool)] = queue_entries(q if live else None)
    return ready, int(cache.tree_core.write_back_duplicate_reclaim_digest)


def upstream_counts(pops: Optional[Pops]) -> tuple[int, int, tuple[int, ...], tuple[str, ...]]:
    """An agreement's pops as upstream's _sync_hicache_ready_counts return value."""
    if pops is None:
        return 0, 0, (), ()
    storage = tuple(pops[n] for n in pops if n not in ACK_QUEUES)
    extra = tuple(n.pool for n in pops if isinstance(n, ExtraPool))
    return pops[ACK_QUEUES[0]], pops[ACK_QUEUES[1]], storage, extra


class AckCountsState(OwnerState[Cache]):
    """What is kept per UnifiedRadixCache (``blocker``: blocking for its lifetime; the
    settings are read when it is built)."""

    sync = ACK_COUNTS

    def __init__(self, cache: Cache, blocker: Optional[Decision], env: Environment) -> None:
        release = feature_release(self.sync.name)
        super().__init__(blocker or static_decision(cache, release, env), env)
        self.settings = settings = read_settings()
        if self.static.pipelined:
            self.core = self.core_class(
                env.collectives.async_min(self.static.group),
                settings.depth,
                auto=AutoDepth(hi=DEPTH_MAX) if settings.auto else None,
                hints=MISMATCH_HINTS,
                clock=env.clock,
                flag_names=ACK_FLAGS,
            )
        self.in_pipelined_step = False
        self.due: Optional[Pops] = None
        self.due_taken = False  # upstream asked for this step's counts already

    def decide(self, cache: Cache) -> Decision:
        if not self.settings.enabled:
            return blocking(f"{ENABLE_VAR}=0", "disabled_by_env")
        return super().decide(cache)

    def dynamic_blocker(self, cache: Cache) -> Optional[Decision]:
        """Per-step conditions forcing the blocking path (a linker first)."""
        if cache.linker is not None:
            return LINKER
        if cache.cache_controller is None:
            return NO_CONTROLLER
        if cache.host_memory_mode != "cache":
            return blocking(
                f"host memory mode {cache.host_memory_mode!r} (only 'cache' pipelines)",
                "host_memory_mode",
            )
        if cache.pp_size != 1:
            return blocking(f"pp_size={cache.pp_size}", "pp")
        if cache.enable_storage and not any(r.decides_walk(cache) for r in self.riders):
            return STORAGE_WITHOUT_VOTES
        cc = cache.cache_controller
        for name in ACK_QUEUES:  # twice a step: the list only where one is missing
            if not hasattr(cc, name):
                missing = ", ".join(a for a in ACK_QUEUES if not hasattr(cc, a))
                return blocking(f"this SGLang's cache controller lacks {missing}", "missing_attrs")
        return None

    def path_metrics(self, decision: Decision) -> None:
        now = self.core.depth if self.core else 0
        if self.metrics is not None:
            self.ack_metrics().on_path(decision.pipelined, now, decision.world_size)

    def ack_metrics(self) -> AckMetrics:
        """The metrics as the ack counts' own series (a test's sink takes the same calls)."""
        return cast(AckMetrics, self.metrics)

    def pipelined_details(self, decision: Decision) -> Sequence[str]:
        depth = f"auto from {self.settings.depth}" if self.settings.auto else self.settings.depth
        return (f"world size {decision.world_size}, depth {depth}", TAG)

    def blocking_details(self) -> Sequence[str]:
        return (TAG,)

    def depth_changed(self, before: int, after: int, pipelined: bool) -> None:
        """Auto depth moved (every rank, this step), also while standing down."""
        why = "a rank waited on the due reduce" if after > before else "reduces finish sooner"
        where = "" if pipelined else ", while standing down"
        logger.info("%s: auto depth %d -> %d (%s%s)", self.sync.title, before, after, why, where)
        if self.metrics is not None:
            self.ack_metrics().on_path(pipelined, after)

    def local_flags(self, cache: Cache) -> int:
        return int(bool(cache.enable_storage)) << STORAGE_FLAG | super().local_flags(cache)

    def first_exchange(self, cache: Cache) -> bool:
        """One blocking exchange of the stamp and flags in upstream's shape and groups
        (so a stock peer pairs with it and is named); then, with CP x TP, the span check."""
        assert self.core is not None
        ready, digest = ready_entries(cache, bool(cache.enable_storage))
        reduce = self.collectives.blocking_min(cache)
        flags = self.local_flags(cache)
        self.layout = self.core.first_exchange(len(ready), digest, reduce, flags)
        self.agreed = True
        span = self.static.span
        if span is not None and self.collectives.span(cache, *span) is None:
            self.static = blocking(no_span_reason(self.static.groups), "no_span")
            self.core = None
            return False
        return True

    def ready(self, cache: Cache) -> tuple[Mapping[Hashable, Sequence[object]], int]:
        return ready_entries(cache, bool(self.layout >> STORAGE_FLAG & 1))

    def pop(self, cache: Cache, pops: Pops) -> None:
        """Pop an agreement's counts through upstream's own methods."""
        write, load, storage, extra = upstream_counts(pops)
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

    def run(self, cache: Cache, original: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any], due: Optional[Consumed]) -> Any:  # fmt: skip
        """Upstream's check_hicache_events, its counts answered from ``due``."""
        self.due, self.due_taken = (None if due is None else due.pops), False
        self.in_pipelined_step = True
        try:
            return original(cache, *args, **kwargs)
        finally:
            self.in_pipelined_step, self.due = False, None

    def ready_counts(self, cache: Cache, original: Callable[[Cache], Any]) -> Any:
        """_sync_hicache_ready_counts: in a pipelined step the consumed agreement, once."""
        if not self.in_pipelined_step:
            return original(cache)
        if self.due_taken:
            # the same agreement twice would pop twice what the group agreed on
            raise HiCacheAckSyncError(
                f"{self.sync.title}: _sync_hicache_ready_counts was called twice in one "
                "check_hicache_events step; the pipelined step hands out one agreement "
                "per step. Nothing more was popped; this SGLang's check_hicache_events "
                "does not match what the sync was written for."
            )
        self.due_taken = True
        return upstream_counts(self.due)

    def cache_metrics(self, cache: object) -> Optional[SyncMetrics]:
        """The cache's series, the extra host pools' queues at 0 too."""
        metrics = super().cache_metrics(cache)
        pools = getattr(getattr(cache, "cache_controller", None), EXTRA_POOL_QUEUES, {})
        adds = getattr(metrics, "add_queues", None)  # a test's sink may have none
        if adds is not None and pools:
            adds(ExtraPool(pool) for pool in pools)
        return metrics


FEATURE = Feature(ACK_COUNTS, AckCountsState, CACHE_CLASS)


# ------------------------------------------------------------------------ hooks
# Target: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.
# Upstream PR: sglang #39903 (pipeline the HiCache ack-count all_reduce).
# Removal: once upstream merges an equivalent (`upstream-patch`; stands down on it).


@FEATURE.hook(CACHE_CLASS, "init_hicache", "AFTER")
def after_init_hicache(result: object, cache: Cache, *args: object, **kwargs: object) -> Any:
    """init_hicache, AFTER.
    Why: the per-cache decision needs the controller and groups init builds.
    How: builds the state from local facts (no collective), metrics; the path is logged
    at the first step, once the riders (the votes, their init hook next) have joined.
    Stands down: never fails init; an ineligible cache just decides blocking."""
    FEATURE.attach(cache, args, **kwargs)
    return result


@FEATURE.hook(CACHE_CLASS, "check_hicache_events", "AROUND")
def around_check_hicache_events(original: Fn, cache: Cache, *args: object, **kwargs: object) -> Any:
    """check_hicache_events, AROUND.
    Why: the blocking all_reduce inside it sits right before the next forward.
    How: the owner template's step: first exchange once; consume, upstream, issue.
    Stands down: the original when blocking (after draining the reduces in flight)."""
    return FEATURE.ensure(cache).step(cache, original, *args, **kwargs)


@FEATURE.hook(CACHE_CLASS, "_sync_hicache_ready_counts", "AROUND")
def around_sync_hicache_ready_counts(
    original: Fn, cache: Cache, *args: object, **kwargs: object
) -> Any:
    """_sync_hicache_ready_counts, AROUND.
    Why: upstream's check takes its counts from here: the blocking reduce runs here.
    How: in a pipelined step returns the consumed agreement, once (twice raises).
    Stands down: everywhere else (loading_check's callers, blocking caches)."""
    state = FEATURE.state_of(cache)
    if state is None:
        return original(cache, *args, **kwargs)
    return state.ready_counts(cache, lambda c: original(c, *args, **kwargs))
