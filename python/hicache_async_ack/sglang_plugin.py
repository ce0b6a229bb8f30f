"""The SGLang plugin's entry point and its public face.

:func:`register` (entry point ``hicache_async_ack`` in group ``sglang.srt.plugins``, a
public contract) judges each sync with the version guard on its own methods and
registers the hooks of those that may run; SGLang's ``load_plugins()`` calls it with no
argument, a caller driving SGLang itself hands in an :class:`Environment`. The rest is
what a caller may use: the environment, the states (a negative control subclasses one),
:func:`init_cache` for a cache built by hand, :func:`state_of`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from .env import (
    ALLOW_UNTESTED_VAR,
    ENABLE_VAR,
    allow_untested,
    offload_sync_enabled,
    prefetch_votes_enabled,
    read_settings,
)
from .features import all_features
from .features.ack_counts import FEATURE as ACK_FEATURE
from .features.ack_counts import TAG, AckCountsState
from .features.decode_offload import FEATURE as OFFLOAD_FEATURE
from .features.decode_offload import OffloadSyncState
from .features.prefetch_votes import FEATURE as VOTES_FEATURE
from .features.prefetch_votes import PrefetchVoteState
from .features.vote_landing import Landing, Pins
from .features.vote_starts import Remainder, Starts
from .guard import CACHE_CLASS, Judged, Verdict, check_installed
from .kit.collectives import Collectives, TorchHandle
from .kit.decision import Decision
from .kit.environment import Environment, EventSink, environment, use_environment
from .kit.feature import Feature, FeatureState, state_of
from .kit.hooks import hook, hooked_for, is_hooked, registrations
from .kit.owner import OwnerState
from .names import ACK_COUNTS, CACHE_SYNCS, LOGGER_NAME, SyncName
from .path_info import inert_hook

logger = logging.getLogger(LOGGER_NAME)
IN_TREE_MODULE = "sglang.srt.mem_cache.unified_cache.hicache_ack_sync"  # upstream-patch adds it


def config_error_hook(error: ValueError) -> Callable[..., Any]:
    """A BEFORE init_hicache hook raising ``error`` (load_plugins() swallows ours)."""

    def before_init_hicache(cache: Any, *args: Any, **kwargs: Any) -> None:
        raise error

    return hook(before_init_hicache)


def register(env: Optional[Environment] = None) -> None:
    """Entry point called by SGLang's load_plugins() in every process; ``env``, if given,
    is installed for every state built from now on."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    env = environment() if env is None else env
    untested_ok = False
    try:
        settings = read_settings()
        if settings.enabled:  # with the plugin off nothing else is read (env.py)
            untested_ok = allow_untested()
            prefetch_votes_enabled()  # validated here; read per cache at init
            offload_sync_enabled()  # validated here; read at the manager's first step
    except ValueError as error:  # raised at HiCache init instead: the server refuses to start
        logger.error("hicache-async-ack: %s", error)
        HookRegistry.register(
            f"{CACHE_CLASS}.init_hicache", config_error_hook(error), HookType.BEFORE
        )
        return
    if not settings.enabled:
        logger.info("%s: blocking (upstream path) because %s=0", ACK_COUNTS.title, ENABLE_VAR)
        return
    if carries_the_sync_itself():
        logger.info("%s: this SGLang carries the pipelined ack sync itself (%s); registering "
                    "no hooks", TAG, IN_TREE_MODULE)  # fmt: skip
        # the path info series still says why this plugin's syncs are off here
        HookRegistry.register(f"{CACHE_CLASS}.init_hicache", inert_hook("in_tree", CACHE_SYNCS),
                              HookType.AFTER)  # fmt: skip
        return
    verdict = env.judged.verdict if env.judged is not None else judge_installed(env)
    judged = Judged(verdict, untested_ok)
    use_environment(replace(env, judged=judged))
    allowed: list[Feature[Any]] = []
    standing_down: dict[SyncName, str] = {}  # sync -> reason code
    features: Sequence[Feature[Any]] = env.features or all_features()
    for feature in features:
        code = judged.stand_down(feature.sync.name)
        if verdict is not None:
            allows(verdict, feature, untested_ok)  # says why, in the log
        if code is None:
            allowed.append(feature)
        else:
            standing_down[feature.sync.name] = code
    hooks = [h for feature in allowed for h in feature.hooks]
    for target, kind, fn in registrations(hooks):
        HookRegistry.register(target, fn, getattr(HookType, kind))
    # a sync standing down here still shows path "off" and why (path info series)
    for reason in sorted(set(standing_down.values())):
        syncs = tuple(s for s in CACHE_SYNCS if standing_down.get(s) == reason)
        if syncs:
            HookRegistry.register(f"{CACHE_CLASS}.init_hicache", inert_hook(reason, syncs),
                                  HookType.AFTER)  # fmt: skip
    logger.debug("hicache-async-ack: registered %d hooks", len(hooks))


def carries_the_sync_itself() -> bool:
    """Whether this SGLang carries the in-tree form (hooking it would pipeline twice)."""
    import importlib.util

    try:
        return importlib.util.find_spec(IN_TREE_MODULE) is not None
    except ImportError:
        return False


def judge_installed(env: Environment) -> Optional[Verdict]:
    """The guard's verdict on this SGLang (None, logged: every sync stands down)."""
    try:
        return check_installed(env.table)
    except Exception as exc:  # e.g. the table missing from a broken install
        logger.error("%s: cannot judge this SGLang (%r); registering no hooks", TAG, exc)
        return None


def allows(verdict: Verdict, feature: Feature[Any], untested_ok: bool) -> bool:
    """Whether ``feature`` may run on this SGLang (its own methods' verdict), logged."""
    judged = verdict.feature(feature.sync.name)
    title = feature.sync.title
    summary = judged.summary(verdict)
    tested = ", ".join(verdict.tested)
    if judged.status == "tested":
        logger.info("%s (%s): %s; pipelining allowed", title, TAG, summary)
        return True
    if judged.status == "absent":
        logger.info("%s (%s): not hooked: %s", title, TAG, summary)
        return False
    if judged.status == "incompatible":
        logger.warning("%s (%s): %s. Not hooked, stock behaviour kept (%s cannot override "
                       "this: the hooks need these methods, called with these parameters).",
                       title, TAG, summary, ALLOW_UNTESTED_VAR)  # fmt: skip
        return False
    if not untested_ok:
        logger.warning("%s (%s): %s. Not hooked, stock behaviour kept. Tested: %s. To run "
                       "anyway after reading what changed, set %s=1 on every node.",
                       title, TAG, summary, tested, ALLOW_UNTESTED_VAR)  # fmt: skip
        return False
    logger.warning("%s (%s): RUNNING ON AN UNTESTED SGLANG because %s=1. %s. It was not "
                   "tested against these methods: if they changed what they return or pop, "
                   "the server can fail or the ranks can pop different entries. Tested: %s.",
                   title, TAG, ALLOW_UNTESTED_VAR, summary, tested)  # fmt: skip
    return True


def init_cache(cache: object, params: object = None) -> None:
    """What SGLang's ``init_hicache`` hooks do, for a cache built by hand: the state of
    every cache sync this SGLang runs (register()'s verdict, else the guard's), in order
    (``params.enable_metrics`` turns the metrics on)."""
    env = environment()
    judged = env.judged if env.judged is not None else Judged(judge_installed(env))
    features: Sequence[Feature[Any]] = env.features or all_features()
    for feature in features:
        if feature.owner == CACHE_CLASS and judged.runs(feature.sync.name):
            init = next(h for h in feature.hooks if h.method == "init_hicache")
            init.fn(None, cache, None, params)


__all__ = ["ACK_FEATURE", "AckCountsState", "Collectives", "Decision", "Environment", "EventSink",
    "Feature", "FeatureState", "Landing", "OFFLOAD_FEATURE", "OffloadSyncState", "OwnerState",
    "Pins", "PrefetchVoteState", "Remainder", "Starts", "TorchHandle", "VOTES_FEATURE",
    "all_features", "environment", "hooked_for", "init_cache", "is_hooked", "register",
    "state_of", "use_environment"]  # fmt: skip
