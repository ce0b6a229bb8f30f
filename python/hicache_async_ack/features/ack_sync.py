"""The pipelined HiCache ack sync on SGLang's UnifiedRadixCache: its feature,
its per-cache state and its hooks (the step itself: :mod:`.ack_step`).

Everything here speaks SGLang's vocabulary (ack queues, storage control queues,
the tp / attn CP / attn TP groups). Per-cache state lives in the cache's
``__dict__`` (:data:`FEATURE`'s ``state_attr``).
"""

from __future__ import annotations

import logging
from typing import Optional

from .. import __version__
from ..env import DEPTH_MAX, DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR, Settings, read_settings
from ..guard import CACHE_CLASS, feature_release
from ..kit.collectives import Collectives
from ..kit.decision import Decision, blocking, missing_attrs, untested_release
from ..kit.feature import Feature, FeatureState, Rider
from ..kit.groups import group_decision
from ..kit.hooks import unhooked
from ..kit.queues import head_reader
from ..names import ACK, ACK_QUEUES, EXTRA_POOL_QUEUES, LOGGER_NAME
from ..protocol.reduce import AutoDepth, Consumed, PipelinedAckSync
from . import ack_step
from .ack_step import ACK_FLAGS, STORAGE_FLAG

logger = logging.getLogger(LOGGER_NAME)

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
TAG = f"hicache-async-ack {__version__}"
# What an operator should do when the ranks of a group disagree (core.Stamp fields).
MISMATCH_HINTS = {
    "depth": f"Set {DEPTH_VAR} identically on every node of the TP group.",
    "auto": f"Set {DEPTH_VAR} identically on every node of the TP group.",
    "protocol": "Run the same version of the pipelined HiCache ack sync on every node.",
    "stock": (
        "that rank does not pipeline: hicache-async-ack is not installed or not loaded "
        f"there (e.g. {PLUGINS_VAR} excludes it), {ENABLE_VAR}=0 is set there, or its cache "
        "is not eligible (its log line says why). Give every node of the TP group the same "
        "install and the same settings."
    ),
}
# Hooked here; a cache whose class does not run them (a subclass override) stays blocking.
HOOKED = ("check_hicache_events", "_sync_hicache_ready_counts")


def static_decision(cache, release: Optional[str]) -> Decision:
    """The part of eligibility fixed for the cache's lifetime (its groups)."""
    return (
        untested_release(release, "the ack sync's upstream methods")
        or missing_attrs(cache, REQUIRED_CACHE_ATTRS)
        or group_decision(cache)
    )


class AckSyncState(FeatureState):
    """What is kept per UnifiedRadixCache.

    ``blocker``, when given, keeps this cache on the blocking path for its
    lifetime (the caller knows why)."""

    feature = ACK

    def __init__(
        self,
        cache,
        settings: Settings,
        release: Optional[str] = None,
        blocker: Optional[Decision] = None,
        coll: Optional[Collectives] = None,
    ):
        super().__init__(blocker or static_decision(cache, release), coll)
        self.settings = settings
        self.sync: Optional[PipelinedAckSync] = None
        if self.static.pipelined:
            self.sync = PipelinedAckSync(
                self.collectives.async_min(self.static.group),
                settings.depth,
                auto=AutoDepth(hi=DEPTH_MAX) if settings.auto else None,
                hints=MISMATCH_HINTS,
                flag_names=ACK_FLAGS,
            )
        self.riders: list[Rider] = []
        self.layout = 0  # the group's agreed layout flags (the first exchange, each consume)
        self.head = head_reader(cache)
        self.in_pipelined_step = False
        self.due: Optional[Consumed] = None
        self.due_taken = False  # upstream asked for this step's counts already

    def add_rider(self, rider: Rider) -> None:
        """``rider``'s section rides every pipelined reduce whose layout has its bit."""
        self.riders.append(rider)
        if self.sync is not None and self.sync.flag_names is not None:
            self.sync.flag_names.update(rider.flags)

    def exchange(self, values: list[int]) -> list[int]:
        """A blocking MIN over this cache's reduce group, in the collective
        sequence every rank runs alike (a rider's overflow exchange)."""
        assert self.sync is not None
        return [int(v) for v in self.sync.collective(values).wait()]

    def local_flags(self, cache) -> int:
        flags = int(bool(cache.enable_storage)) << STORAGE_FLAG
        for rider in self.riders:
            flags |= rider.local_flags(cache)
        return flags

    def decide(self, cache) -> Decision:
        if not self.settings.enabled:
            return blocking(f"{ENABLE_VAR}=0", "disabled_by_env")
        return super().decide(cache)

    def dynamic_blocker(self, cache) -> Optional[Decision]:
        """Per-step conditions (cheap attribute reads) that force the blocking path."""
        if cache.cache_controller is None:
            return blocking("HiCache controller not attached", "no_controller")
        if cache.linker is not None:
            return blocking("external cache linker attached", "linker")
        if cache.host_memory_mode != "cache":
            return blocking(
                f"host memory mode {cache.host_memory_mode!r} (only 'cache' pipelines)",
                "host_memory_mode",
            )
        if cache.pp_size != 1:
            return blocking(f"pp_size={cache.pp_size}", "pp")
        cc = cache.cache_controller
        missing = [a for a in ACK_QUEUES if not hasattr(cc, a)]
        if missing:
            return blocking(
                f"this SGLang's cache controller lacks {', '.join(missing)}", "missing_attrs"
            )
        return None

    def path_metrics(self, decision: Decision) -> None:
        now = self.sync.depth if self.sync else 0
        self.metrics.on_path(decision.pipelined, now, decision.world_size)

    def pipelined_details(self, decision: Decision):
        depth = f"auto from {self.settings.depth}" if self.settings.auto else self.settings.depth
        return (f"world size {decision.world_size}, depth {depth}", TAG)

    def blocking_details(self):
        return (TAG,)

    def failed(self, exc: Exception) -> None:
        """A sync error on this rank: counted, and said here too (the scheduler
        may die on the next collective's error first)."""
        from ..protocol.stamp import HiCacheAckSyncMismatch

        if self.metrics is not None:
            reason = "mismatch" if isinstance(exc, HiCacheAckSyncMismatch) else "failure"
            self.metrics.on_failure(reason)
        logger.error("%s", exc)

    def depth_changed(self, before: int, after: int, pipelined: bool = True) -> None:
        """Auto depth moved (on every rank at this step): say so once, also when
        it moved on the reduces drained while standing down (the gauge then
        stays 0, as on the blocking path, and shows the depth on the way back)."""
        why = "a rank waited on the due reduce" if after > before else "reduces finish sooner"
        where = "" if pipelined else ", while standing down"
        logger.info("HiCache ack sync: auto depth %d -> %d (%s%s)", before, after, why, where)
        if self.metrics is not None:
            self.metrics.on_path(pipelined, after)


def build(cache, settings: Optional[Settings] = None) -> AckSyncState:
    """The cache's state (``settings`` default to the environment's); a cache
    whose hooks are not in place stays blocking."""
    problem = unhooked(type(cache), HOOKED, ACK)
    blocker = blocking(problem, "hooks_missing") if problem else None
    settings = read_settings() if settings is None else settings
    return AckSyncState(cache, settings, feature_release(ACK), blocker)


FEATURE = Feature(ACK, "_hicache_ack_sync_state", build)


def metrics_for(cache):
    """The sync's metrics, labelled like the cache's other metrics and created
    through the same collector classes; None (logged) if they cannot be made."""
    from ..metrics import metrics_for_labels

    collector = getattr(cache, "metrics_collector", None)
    labels = getattr(collector, "labels", None)
    metrics = metrics_for_labels(labels or {"cache_type": type(cache).__name__}, collector)
    pools = getattr(getattr(cache, "cache_controller", None), EXTRA_POOL_QUEUES, {})
    if metrics is not None and pools:
        metrics.add_queues(("extra", pool) for pool in pools)
    return metrics


def metrics_wanted(args, kwargs) -> bool:
    """Whether init_hicache(server_args, params) was called with --enable-metrics."""
    params = kwargs.get("params", args[1] if len(args) > 1 else None)
    return bool(getattr(params, "enable_metrics", False))


# ------------------------------------------------------------------------ hooks
# Target: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.
# Upstream PR: sglang #39903 (pipeline the HiCache ack-count all_reduce).
# Removable when upstream merges an equivalent (`hicache-async-ack-lab upstream-patch`
# writes this feature as such a patch); the guard already stands down on a tree
# that carries it.


@FEATURE.hook(CACHE_CLASS, "init_hicache", "AFTER")
def after_init_hicache(result, cache, *args, **kwargs):
    """init_hicache, AFTER.
    Why: the per-cache decision needs the controller and groups init builds.
    How: builds the cache's state (eligibility from local facts only: no
    collective here, a peer without the plugin would run none; metrics with
    --enable-metrics, never raising) and logs one line: pipelined or blocking,
    and why.
    Stands down: never fails init; an ineligible cache (PP, buffer_only, a
    linker, world size 1, DP attention CP x TP) just decides blocking."""
    state = FEATURE.attach(cache)
    if metrics_wanted(args, kwargs):
        state.metrics = metrics_for(cache)
    state.announce(state.decide(cache))
    return result


@FEATURE.hook(CACHE_CLASS, "check_hicache_events", "AROUND")
def around_check_hicache_events(original, cache, *args, **kwargs):
    """check_hicache_events, AROUND.
    Why: the blocking all_reduce inside it sits right before the next forward.
    How: the first pipelined step starts with one blocking exchange through the
    cache's own _all_reduce (upstream's shape and groups) carrying the stamp
    and the layout flags, so ranks that disagree stop there (then, for CP x TP,
    the layout check). Every step: consume the reduce issued k steps ago, run
    upstream's own method (its pops go through writing_check / loading_check /
    the storage drain), then count what is ready and issue the next reduce,
    async, with the riders' sections.
    Stands down: calls the original when the cache decides blocking (drains the
    reduces in flight first, so every rank leaves with the same pops)."""
    state = FEATURE.ensure(cache)  # init_hicache's hook missing: a cache built another way
    return ack_step.check_hicache_events(state, cache, original, *args, **kwargs)


@FEATURE.hook(CACHE_CLASS, "_sync_hicache_ready_counts", "AROUND")
def around_sync_hicache_ready_counts(original, cache, *args, **kwargs):
    """_sync_hicache_ready_counts, AROUND.
    Why: upstream's check takes its counts from here; that is where the
    blocking reduce runs.
    How: inside a pipelined step, returns the consumed agreement, once per step
    (a second call raises before anything more is popped).
    Stands down: everywhere else (loading_check's callers, blocking caches)."""
    state = FEATURE.state_of(cache)
    return ack_step.agreed_ready_counts(state, cache, original, *args, **kwargs)
