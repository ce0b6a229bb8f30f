"""The SGLang plugin's entry point: :func:`register` walks the features
(:mod:`hicache_async_ack.features`), each registering its own hooks, after the
version guard (:mod:`hicache_async_ack.guard`) said which may run.

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
from .adapter import hook, is_hooked
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

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")


def config_error_hook(error: ValueError):
    """A BEFORE init_hicache hook that raises ``error``: load_plugins() swallows
    what register() raises, so a bad setting stops the server here instead."""

    @hook
    def before_init_hicache(cache, *args, **kwargs):
        raise error

    return before_init_hicache


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
    verdict = guard_allows(untested_ok)
    if verdict is None:
        # No sync hook; one that only exports path "off" per rank, so an inert
        # plugin is visible (sglang:hicache_sync_path_info, docs/monitoring.md).
        info = path_info.inert_hook("untested_release")
        HookRegistry.register(f"{CACHE_CLASS}.init_hicache", info, HookType.AFTER)
        return
    registered = 0
    for feature in all_features():
        # A feature whose hooked methods this SGLang lacks registers nothing (the
        # decode offload sync on 0.5.20); otherwise its state decides per object,
        # from the guard's verdict on its own targets, and says why.
        absent = verdict.missing_methods(h.method for h in feature.hooks)
        if absent:
            logger.info("%s: %s not hooked: this SGLang lacks %s", TAG, feature.sync, absent)
            continue
        for h in feature.hooks:
            HookRegistry.register(f"{h.target}.{h.method}", h.fn, getattr(HookType, h.kind))
            registered += 1
    logger.debug("hicache-async-ack: registered %d hooks", registered)


IN_TREE_MODULE = "sglang.srt.mem_cache.unified_cache.hicache_ack_sync"  # upstream-patch adds it


def carries_the_sync_itself() -> bool:
    """Whether this SGLang was patched with the in-tree form: hooking it again
    would pipeline the pipelined step."""
    import importlib.util

    try:
        return importlib.util.find_spec(IN_TREE_MODULE) is not None
    except ImportError:
        return False


def guard_allows(untested_ok: bool) -> Optional[Verdict]:
    """The version guard's verdict on this SGLang, logged once per process, if
    it lets the plugin register (None if not)."""
    try:
        verdict = check_installed()
    except Exception as exc:  # e.g. the table missing from a broken install
        remember(None, False)
        logger.error("%s: cannot judge this SGLang (%r); registering no hooks", TAG, exc)
        return None
    remember(verdict, untested_ok)  # every feature reads its own verdict from it
    if verdict.status == "tested":
        logger.info("%s: %s; pipelining allowed", TAG, verdict.summary())
        return verdict
    if verdict.status == "incompatible":
        logger.warning(
            "%s: %s. Registering no hooks, stock behaviour kept (%s cannot override "
            "this: the hooks need these methods, called with these parameters).",
            TAG,
            verdict.summary(),
            ALLOW_UNTESTED_VAR,
        )
        return None
    if not untested_ok:
        logger.warning(
            "%s: %s. Registering no hooks, stock behaviour kept. Tested: %s. To run "
            "anyway after reading what changed, set %s=1 on every node.",
            TAG,
            verdict.summary(),
            ", ".join(verdict.tested),
            ALLOW_UNTESTED_VAR,
        )
        return None
    logger.warning(
        "%s: RUNNING ON AN UNTESTED SGLANG because %s=1. %s. The pipelined ack sync "
        "was not tested against these methods: if they changed what they return or "
        "pop, the server can fail or the ranks can pop different entries. Tested: %s.",
        TAG,
        ALLOW_UNTESTED_VAR,
        verdict.summary(),
        ", ".join(verdict.tested),
    )
    return verdict


__all__ = ["register", "is_hooked"]
