"""The SGLang plugin's entry point: :func:`register` judges each feature
(:mod:`hicache_async_ack.features`) with the version guard
(:mod:`hicache_async_ack.guard`) on the methods that feature wraps or relies
on, and registers the hooks of those that may run.

Entry point ``hicache_async_ack = hicache_async_ack.sglang_plugin:register`` in
the group ``sglang.srt.plugins`` (a public contract: operators' SGLANG_PLUGINS
lists name it). SGLang's ``load_plugins()`` calls :func:`register` in every
process, then applies the hooks. Every hook, with its notes (target, why, how,
when it stands down, upstream PR, removal), lives beside its feature.
"""

from __future__ import annotations

import logging
from typing import Optional

from . import path_info
from .env import (
    ALLOW_UNTESTED_VAR,
    ENABLE_VAR,
    allow_untested,
    offload_sync_enabled,
    prefetch_votes_enabled,
    read_settings,
)
from .features import all_features
from .features.ack_sync import TAG
from .guard import CACHE_CLASS, Verdict, check_installed, remember
from .kit.feature import Feature
from .kit.hooks import hook, is_hooked, registrations
from .names import LOGGER_NAME, TITLES

logger = logging.getLogger(LOGGER_NAME)


def config_error_hook(error: ValueError):
    """A BEFORE init_hicache hook that raises ``error``: load_plugins() swallows
    what register() raises, so a bad setting stops the server here instead."""

    def before_init_hicache(cache, *args, **kwargs):
        raise error

    return hook(before_init_hicache)


def register() -> None:
    """Entry point called by SGLang's load_plugins() in every process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    untested_ok = False
    try:
        settings = read_settings()
        if settings.enabled:  # with the plugin off nothing else is read (env.py)
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
    verdict = judge_installed(untested_ok)
    allowed: list[Feature] = []
    standing_down: dict[str, str] = {}  # sync -> reason code
    for feature in all_features():
        if verdict is None:
            standing_down[feature.sync] = "untested_release"
        elif allows(verdict, feature, untested_ok):
            allowed.append(feature)
        else:
            absent = verdict.feature(feature.sync).status == "absent"
            standing_down[feature.sync] = "not_in_release" if absent else "untested_release"
    hooks = [h for feature in allowed for h in feature.hooks]
    for target, kind, fn in registrations(hooks):
        HookRegistry.register(target, fn, getattr(HookType, kind))
    # A feature that stands down on this SGLang is visible per rank all the same:
    # path "off" and why, on every cache (sglang:hicache_sync_path_info).
    for reason in sorted(set(standing_down.values())):
        syncs = tuple(s for s in path_info.CACHE_SYNCS if standing_down.get(s) == reason)
        if syncs:
            info = path_info.inert_hook(reason, syncs)
            HookRegistry.register(f"{CACHE_CLASS}.init_hicache", info, HookType.AFTER)
    logger.debug("hicache-async-ack: registered %d hooks", len(hooks))


IN_TREE_MODULE = "sglang.srt.mem_cache.unified_cache.hicache_ack_sync"  # upstream-patch adds it


def carries_the_sync_itself() -> bool:
    """Whether this SGLang was patched with the in-tree form: hooking it again
    would pipeline the pipelined step."""
    import importlib.util

    try:
        return importlib.util.find_spec(IN_TREE_MODULE) is not None
    except ImportError:
        return False


def judge_installed(untested_ok: bool) -> Optional[Verdict]:
    """The version guard's verdict on this SGLang, remembered for every feature
    (None, logged, if it cannot judge: then every feature stands down)."""
    try:
        verdict = check_installed()
    except Exception as exc:  # e.g. the table missing from a broken install
        remember(None, False)
        logger.error("%s: cannot judge this SGLang (%r); registering no hooks", TAG, exc)
        return None
    remember(verdict, untested_ok)  # every feature reads its own verdict from it
    return verdict


def allows(verdict: Verdict, feature: Feature, untested_ok: bool) -> bool:
    """Whether ``feature`` may run on this SGLang, said once per process: the
    guard's verdict on its own methods, whatever the other features' are."""
    judged = verdict.feature(feature.sync)
    title = TITLES[feature.sync]
    summary = judged.summary(verdict)
    if judged.status == "tested":
        logger.info("%s (%s): %s; pipelining allowed", title, TAG, summary)
        return True
    if judged.status == "absent":
        logger.info("%s (%s): not hooked: %s", title, TAG, summary)
        return False
    if judged.status == "incompatible":
        logger.warning(
            "%s (%s): %s. Not hooked, stock behaviour kept (%s cannot override this: the "
            "hooks need these methods, called with these parameters).",
            title,
            TAG,
            summary,
            ALLOW_UNTESTED_VAR,
        )
        return False
    if not untested_ok:
        logger.warning(
            "%s (%s): %s. Not hooked, stock behaviour kept. Tested: %s. To run anyway "
            "after reading what changed, set %s=1 on every node.",
            title,
            TAG,
            summary,
            ", ".join(verdict.tested),
            ALLOW_UNTESTED_VAR,
        )
        return False
    logger.warning(
        "%s (%s): RUNNING ON AN UNTESTED SGLANG because %s=1. %s. It was not tested "
        "against these methods: if they changed what they return or pop, the server "
        "can fail or the ranks can pop different entries. Tested: %s.",
        title,
        TAG,
        ALLOW_UNTESTED_VAR,
        summary,
        ", ".join(verdict.tested),
    )
    return True


__all__ = ["register", "is_hooked"]
