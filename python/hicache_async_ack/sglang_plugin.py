"""The SGLang plugin: hooks and registration (the version guard is
:mod:`hicache_async_ack.upstream`).

Entry point ``hicache_async_ack = hicache_async_ack.sglang_plugin:register`` in
the group ``sglang.srt.plugins`` (a public contract: operators' SGLANG_PLUGINS
lists name it). SGLang's ``load_plugins()`` calls :func:`register` in every
process, then applies the hooks. The pipelined step itself lives in
:mod:`hicache_async_ack.ack_sync`; this module only attaches it.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from . import __version__, offload_sync, prefetch_sync
from .ack_sync import (
    CacheState,
    agreed_ready_counts,
    attach_state,
    pipelined_check_hicache_events,
    state_of,
)
from .env import (
    ALLOW_UNTESTED_VAR,
    ENABLE_VAR,
    PLUGINS_VAR,
    allow_untested,
    offload_sync_enabled,
    prefetch_votes_enabled,
    read_settings,
)
from .upstream import CACHE_CLASS, check_installed

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")

TAG = f"hicache-async-ack {__version__}"
_MARK = "_hicache_async_ack_hook"  # set on our hook functions, found via __wrapped__


# ------------------------------------------------------------------------ hooks
def _hook(fn):
    setattr(fn, _MARK, True)
    return fn


def is_hooked(fn) -> bool:
    """Whether one of our hooks sits in ``fn``'s wrapper chain. HookRegistry's
    wrappers keep the hook in a closure cell and the original in __wrapped__."""
    while fn is not None:
        cells = getattr(fn, "__closure__", None) or ()
        if getattr(fn, _MARK, False) or any(getattr(_cell_value(c), _MARK, False) for c in cells):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def hook_problem(cache) -> Optional[str]:
    """Why this cache's class does not run our hooks, or None."""
    for name in ("check_hicache_events", "_sync_hicache_ready_counts"):
        if not is_hooked(getattr(type(cache), name)):
            return (
                f"{type(cache).__name__}.{name} is not our hook (overridden by a "
                "subclass, or the hook failed to apply)"
            )
    return None


STOCK_HINT = (
    "that rank does not pipeline: hicache-async-ack is not installed or not loaded "
    f"there (e.g. {PLUGINS_VAR} excludes it), {ENABLE_VAR}=0 is set there, or its cache "
    "is not eligible (its log line says why). Give every node of the TP group the same "
    "install and the same settings."
)


def attach(cache) -> CacheState:
    """Build the cache's state; a cache whose hooks are not in place stays blocking."""
    return attach_state(cache, hook_problem(cache), TAG, hints={"stock": STOCK_HINT})


@_hook
def after_init_hicache(result, cache, *args, **kwargs):
    """AFTER UnifiedRadixCache.init_hicache(server_args, params): decide once,
    say it once per rank; with --enable-metrics, export the sync's metrics."""
    state = attach(cache)
    params = kwargs.get("params", args[1] if len(args) > 1 else None)
    if getattr(params, "enable_metrics", False):
        state.metrics = metrics_for(cache)
    state.announce(state.decide(cache))
    return result


def metrics_for(cache):
    """The sync's metrics, labelled like the cache's other metrics and created
    through the same collector classes; None (logged) if they cannot be made."""
    from .metrics import metrics_for_labels

    collector = getattr(cache, "metrics_collector", None)
    labels = getattr(collector, "labels", None)
    metrics = metrics_for_labels(labels or {"cache_type": type(cache).__name__}, collector)
    pools = getattr(getattr(cache, "cache_controller", None), "extra_host_mem_release_queues", {})
    if metrics is not None and pools:
        metrics.add_queues(("extra", pool) for pool in pools)
    return metrics


@_hook
def around_check_hicache_events(original, cache, *args, **kwargs):
    """AROUND UnifiedRadixCache.check_hicache_events: the pipelined step."""
    state = state_of(cache)
    if state is None:  # init_hicache hook missing (or a cache built another way)
        state = attach(cache)
    return pipelined_check_hicache_events(state, cache, original, *args, **kwargs)


@_hook
def around_sync_hicache_ready_counts(original, cache, *args, **kwargs):
    """AROUND UnifiedRadixCache._sync_hicache_ready_counts: the consumed
    agreement inside a pipelined step, upstream's blocking reduce elsewhere."""
    return agreed_ready_counts(state_of(cache), cache, original, *args, **kwargs)


# ------------------------------------------------------- prefetch termination votes
_release: Optional[str] = None  # the tested release this SGLang matches (set by the guard)
_release_known = False


def matched_release() -> Optional[str]:
    """The tested release this SGLang behaves like, method for method (None if none)."""
    global _release, _release_known
    if not _release_known:
        try:
            _release = check_installed().release
        except Exception:  # a broken table: the votes stand down
            _release = None
        _release_known = True
    return _release


def attach_prefetch(cache) -> prefetch_sync.PrefetchVoteState:
    """The cache's prefetch-vote state (the setting read now, as for the ack sync)."""
    blocker = None
    for name in ("check_hicache_events", "_can_terminate_prefetch"):
        fn = getattr(type(cache), name, None)
        if fn is None or not is_hooked(fn):
            blocker = f"{type(cache).__name__}.{name} is not our hook"
    return prefetch_sync.attach_state(cache, prefetch_votes_enabled(), matched_release(), blocker)


@_hook
def after_init_hicache_prefetch(result, cache, *args, **kwargs):
    """AFTER UnifiedRadixCache.init_hicache: the prefetch votes' state (and, with
    --enable-metrics, their metrics); decided and logged at the first pass."""
    state = attach_prefetch(cache)
    params = kwargs.get("params", args[1] if len(args) > 1 else None)
    if getattr(params, "enable_metrics", False):
        from .metrics import PrefetchVoteMetrics

        labels = getattr(getattr(cache, "metrics_collector", None), "labels", None)
        state.metrics = PrefetchVoteMetrics(labels or {"cache_type": type(cache).__name__})
    return result


@_hook
def after_check_hicache_events(result, cache, *args, **kwargs):
    """AFTER UnifiedRadixCache.check_hicache_events: the votes' pass boundary."""
    state = prefetch_sync.state_of(cache)
    if state is None:
        state = attach_prefetch(cache)
    prefetch_sync.on_pass(state, cache)
    return result


@_hook
def around_can_terminate_prefetch(original, cache, operation, *args, **kwargs):
    """AROUND UnifiedRadixCache._can_terminate_prefetch: the group's verdict."""
    state = prefetch_sync.state_of(cache)
    return prefetch_sync.verdict(state, cache, original, operation, *args, **kwargs)


# ------------------------------------------------------- PD decode offload progress
@_hook
def around_check_offload_progress(original, manager, *args, **kwargs):
    """AROUND DecodeKVCacheOffloadManager.check_offload_progress: pipelined."""
    state = offload_sync.state_of(manager)
    if state is None:  # the setting is read at the manager's first step
        state = offload_sync.attach_state(manager, offload_sync_enabled(), matched_release())
    return offload_sync.check_offload_progress(state, manager, original, *args, **kwargs)


@_hook
def around_drain_before_retraction(original, manager, *args, **kwargs):
    """AROUND DecodeKVCacheOffloadManager.drain_before_retraction: upstream's
    blocking check inside it (everything popped before a retraction)."""
    state = offload_sync.state_of(manager)
    return offload_sync.drain_before_retraction(state, manager, original, *args, **kwargs)


OFFLOAD_HOOKS: tuple[tuple[str, str, Callable], ...] = (
    ("check_offload_progress", "AROUND", around_check_offload_progress),
    ("drain_before_retraction", "AROUND", around_drain_before_retraction),
)


def config_error_hook(error: ValueError):
    """A BEFORE init_hicache hook that raises ``error``: load_plugins() swallows
    what register() raises, so a bad setting stops the server here instead."""

    @_hook
    def before_init_hicache(cache, *args, **kwargs):
        raise error

    return before_init_hicache


# Patch notes. Every hook targets sglang.srt.mem_cache.unified_radix_cache.
# UnifiedRadixCache; all three are registered together, only on an SGLang whose
# hooked and relied-on methods match a tested release (0.5.20-0.5.23, upstream.py;
# or on opt-in, SGLANG_HICACHE_ASYNC_ACK_ALLOW_UNTESTED=1), never on a tree that
# carries the sync itself, and not at all with SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0.
# Upstream reference: sglang PR #39903 (pipeline the HiCache ack-count all_reduce).
# Removable when upstream merges an equivalent (`hicache-async-ack upstream-patch`
# writes ours as such a patch).
#
# 1. init_hicache, AFTER.
#    Why: the per-cache decision needs the controller and groups init builds.
#    How: builds the cache's state (eligibility from local facts only: no
#    collective here, a peer without the plugin would run none; metrics with
#    --enable-metrics, never raising) and logs one line: pipelined or blocking,
#    and why.
#    Stands down: never fails init; an ineligible cache (PP, buffer_only, a
#    linker, world size 1, DP attention CP x TP) just decides blocking.
# 2. check_hicache_events, AROUND.
#    Why: the blocking all_reduce inside it sits right before the next forward.
#    How: the first pipelined step starts with one blocking exchange through
#    the cache's own _all_reduce (upstream's shape and groups) carrying the
#    stamp, so ranks that disagree stop there (then, for CP x TP, the layout
#    check). Every step: consume the reduce issued k steps ago, run upstream's
#    own method (its pops go through writing_check / loading_check / the
#    storage drain), then count what is ready and issue the next reduce, async,
#    through torch.distributed.all_reduce.
#    Stands down: calls the original when the cache decides blocking (drains the
#    reduces in flight first, so every rank leaves with the same pops).
# 3. _sync_hicache_ready_counts, AROUND.
#    Why: upstream's check takes its counts from here; that is where the
#    blocking reduce runs.
#    How: inside a pipelined step, returns the consumed agreement, once per step
#    (a second call raises before anything more is popped).
#    Stands down: everywhere else (loading_check's callers, blocking caches) it
#    calls the original.
#
# Storage prefetch termination votes (prefetch_sync.py; upstream checked:
# 0.5.20-0.5.23, pipelined on 0.5.23 only, whose deadline is the admission-poll
# timer). Registered with the three above; the votes' own setting,
# SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_VOTES, is read per cache at init (a rank
# with it off still takes part in the one-time agreement on it).
# 4. init_hicache, AFTER.
#    Why: the per-cache vote state (and its metrics) needs what init builds.
#    How: builds it; the decision is made and logged at the first pass.
#    Stands down: never fails init.
# 5. check_hicache_events, AFTER.
#    Why: the scheduler runs it once per pass, before it walks the waiting queue
#    and asks check_prefetch_progress per request: the pass boundary.
#    How: consumes the vote reduce issued at the previous pass, then issues one
#    covering every ongoing prefetch operation, async (at the second eligible
#    pass, once, a blocking agreement on the setting comes first).
#    Stands down: no storage backend, a policy other than `timeout`, PP, world
#    size 1, the setting off, or a release other than 0.5.23: the reduce in
#    flight is drained and upstream's per-request path runs, with the reason logged.
# 6. _can_terminate_prefetch, AROUND.
#    Why: it runs one blocking MAX all_reduce per waiting request.
#    How: inside a pipelined pass, returns the group's verdict on this operation
#    (by identity; False until voted on), no collective.
#    Stands down: calls the original outside a pipelined pass or policy.
#
# PD decode offload progress (offload_sync.py; upstream checked 0.5.20-0.5.23,
# registered on 0.5.21-0.5.23, whose four methods below are identical; 0.5.20
# has no drain_before_retraction). Target: sglang.srt.disaggregation.
# decode_kvcache_offload_manager.DecodeKVCacheOffloadManager.
# 7. check_offload_progress, AROUND.
#    Why: a blocking MIN all_reduce of the two queue sizes every decode step.
#    How: at the first call, one blocking agreement in upstream's own layout
#    (a stock peer or one with the setting off is named); then consume the
#    reduce issued the step before, pop through upstream's _check_offload_progress
#    / _check_backup_progress by identity, count every queued entry, issue async.
#    Stands down: world size 1, missing queues, the setting off: upstream's
#    method (after draining what is in flight), reason logged.
# 8. drain_before_retraction, AROUND.
#    Why: a retraction must find every offload popped, as upstream leaves it.
#    How: its check_offload_progress runs upstream's blocking path (after
#    popping the reduce in flight); no log line.
#    Stands down: never needed; it only marks the call.
HOOKS: tuple[tuple[str, str, Callable], ...] = (
    ("init_hicache", "AFTER", after_init_hicache),
    ("check_hicache_events", "AROUND", around_check_hicache_events),
    ("_sync_hicache_ready_counts", "AROUND", around_sync_hicache_ready_counts),
    ("init_hicache", "AFTER", after_init_hicache_prefetch),
    ("check_hicache_events", "AFTER", after_check_hicache_events),
    ("_can_terminate_prefetch", "AROUND", around_can_terminate_prefetch),
)


def register() -> None:
    """Entry point called by SGLang's load_plugins() in every process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        settings = read_settings()
        untested_ok = allow_untested()
        prefetch_votes_enabled()  # validated here; read per cache at init
        offload_sync_enabled()  # validated here; read at the manager's first step
    except ValueError as error:
        # load_plugins() swallows exceptions from plugins; raise from a hook at
        # HiCache init instead so the server refuses to start with a bad value.
        logger.error("hicache-async-ack: %s", error)
        HookRegistry.register(
            f"{CACHE_CLASS}.init_hicache", config_error_hook(error), HookType.BEFORE
        )
        return
    if not settings.enabled:
        logger.info("HiCache ack sync: blocking (upstream path) because %s=0", ENABLE_VAR)
        return
    if carries_the_sync_itself():
        logger.info(
            "%s: this SGLang carries the pipelined ack sync itself (%s); registering no hooks",
            TAG,
            IN_TREE_MODULE,
        )
        return
    if not guard_allows(untested_ok):
        return
    for attr, kind, hook in HOOKS:
        HookRegistry.register(f"{CACHE_CLASS}.{attr}", hook, getattr(HookType, kind))
    if matched_release() in offload_sync.VERIFIED_RELEASES:  # 0.5.20 lacks a target
        for attr, kind, hook in OFFLOAD_HOOKS:
            target = f"{offload_sync.MANAGER_CLASS}.{attr}"
            HookRegistry.register(target, hook, getattr(HookType, kind))
    logger.debug("hicache-async-ack: registered %d hooks on %s", len(HOOKS), CACHE_CLASS)


IN_TREE_MODULE = "sglang.srt.mem_cache.hicache_ack_sync"  # upstream-patch adds it


def carries_the_sync_itself() -> bool:
    """Whether this SGLang was patched with the in-tree form: hooking it again
    would pipeline the pipelined step."""
    import importlib.util

    try:
        return importlib.util.find_spec(IN_TREE_MODULE) is not None
    except ImportError:
        return False


def guard_allows(untested_ok: bool) -> bool:
    """The version guard's verdict on this SGLang, logged once per process."""
    try:
        verdict = check_installed()
    except Exception as exc:  # e.g. the table missing from a broken install
        logger.error("%s: cannot judge this SGLang (%r); registering no hooks", TAG, exc)
        return False
    global _release, _release_known
    _release, _release_known = verdict.release, True  # for the prefetch votes
    if verdict.status == "tested":
        logger.info("%s: %s; pipelining allowed", TAG, verdict.summary())
        return True
    if verdict.status == "incompatible":
        logger.warning(
            "%s: %s. Registering no hooks, stock behaviour kept (%s cannot override "
            "this: the hooks need these methods, called with these parameters).",
            TAG,
            verdict.summary(),
            ALLOW_UNTESTED_VAR,
        )
        return False
    if not untested_ok:
        logger.warning(
            "%s: %s. Registering no hooks, stock behaviour kept. Tested: %s. To run "
            "anyway after reading what changed, set %s=1 on every node.",
            TAG,
            verdict.summary(),
            ", ".join(verdict.tested),
            ALLOW_UNTESTED_VAR,
        )
        return False
    logger.warning(
        "%s: RUNNING ON AN UNTESTED SGLANG because %s=1. %s. The pipelined ack sync "
        "was not tested against these methods: if they changed what they return or "
        "pop, the server can fail or the ranks can pop different entries. Tested: %s.",
        TAG,
        ALLOW_UNTESTED_VAR,
        verdict.summary(),
        ", ".join(verdict.tested),
    )
    return True


__all__ = [
    "register",
    "is_hooked",
    "after_init_hicache",
]
