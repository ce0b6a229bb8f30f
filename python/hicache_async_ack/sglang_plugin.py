"""The SGLang plugin: hooks, registration and the version guard.

Entry point ``hicache_async_ack = hicache_async_ack.sglang_plugin:register`` in
the group ``sglang.srt.plugins`` (a public contract: operators' SGLANG_PLUGINS
lists name it). SGLang's ``load_plugins()`` calls :func:`register` in every
process, then applies the hooks. The pipelined step itself lives in
:mod:`hicache_async_ack.ack_sync`; this module only attaches it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Callable, Optional

from . import __version__
from .ack_sync import (
    CacheState,
    agreed_ready_counts,
    attach_state,
    pipelined_check_hicache_events,
    state_of,
)
from .env import ENABLE_VAR, PLUGINS_VAR, read_settings

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")

CACHE_MODULE = "sglang.srt.mem_cache.unified_radix_cache"
CACHE_CLASS = f"{CACHE_MODULE}.UnifiedRadixCache"
CHECKED_AGAINST = "sglang 0.5.23"
TAG = f"hicache-async-ack {__version__}"
_MARK = "_hicache_async_ack_hook"  # set on our hook functions, found via __wrapped__

# Methods the hooks call or wrap, with the parameter names they rely on.
REQUIRED_METHODS: dict[str, tuple[str, ...]] = {
    "check_hicache_events": ("self",),
    "_sync_hicache_ready_counts": ("self",),
    "init_hicache": ("self", "server_args", "params"),
    "writing_check": ("self", "write_back", "finish_count"),
    "loading_check": ("self", "finish_count"),
    "_count_ready_acks": ("self", "ack_queue"),
    "_drain_storage_control_queues_impl": (
        "self",
        "n_storage_hit",
        "n_ack_prefetch",
        "n_backup",
        "n_release",
        "extra_release_counts",
        "log_metrics",
    ),
}


# ---------------------------------------------------------------- version guard
def upstream_shape_problems(cls: Any = None) -> list[str]:
    """What the hooks rely on but this SGLang lacks; empty when supported."""
    if cls is None:
        try:
            cls = importlib.import_module(CACHE_MODULE).UnifiedRadixCache
        except Exception as exc:  # any import failure means unsupported
            return [f"cannot import {CACHE_CLASS}: {exc!r}"]
    problems = []
    for name, params in REQUIRED_METHODS.items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            problems.append(f"{name}() is missing")
            continue
        fn = inspect.unwrap(fn)
        got = tuple(inspect.signature(fn).parameters)
        if got != params:
            problems.append(f"{name}{got} != expected {name}{params}")
    return problems


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
    """AFTER UnifiedRadixCache.init_hicache: decide once, say it once per rank."""
    state = attach(cache)
    state.announce(state.decide(cache))
    return result


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


def _raise_config_error(error: ValueError):
    @_hook
    def before_init_hicache(cache, *args, **kwargs):
        raise error

    return before_init_hicache


# (target attribute, hook type name, hook). Checked against sglang 0.5.23.
# - init_hicache AFTER: runs once per cache after the controller exists; builds
#   the per-cache state and logs pipelined/blocking. Stands down (logs blocking)
#   for every ineligible topology.
# - check_hicache_events AROUND: the pipelined step (consume -> upstream pops ->
#   issue). Stands down to the original when the decision is blocking, after
#   draining anything in flight.
# - _sync_hicache_ready_counts AROUND: replaces the blocking reduce only while a
#   pipelined step is running on that cache; otherwise calls the original.
HOOKS: tuple[tuple[str, str, Callable], ...] = (
    ("init_hicache", "AFTER", after_init_hicache),
    ("check_hicache_events", "AROUND", around_check_hicache_events),
    ("_sync_hicache_ready_counts", "AROUND", around_sync_hicache_ready_counts),
)


def register() -> None:
    """Entry point called by SGLang's load_plugins() in every process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        settings = read_settings()
    except ValueError as error:
        # load_plugins() swallows exceptions from plugins; raise from a hook at
        # HiCache init instead so the server refuses to start with a bad value.
        logger.error("hicache-async-ack: %s", error)
        HookRegistry.register(
            f"{CACHE_CLASS}.init_hicache", _raise_config_error(error), HookType.BEFORE
        )
        return
    if not settings.enabled:
        logger.info("HiCache ack sync: blocking (upstream path) because %s=0", ENABLE_VAR)
        return
    problems = upstream_shape_problems()
    if problems:
        logger.warning(
            "hicache-async-ack %s: this SGLang does not match what the plugin was "
            "checked against (%s); registering no hooks, stock behaviour kept: %s",
            __version__,
            CHECKED_AGAINST,
            "; ".join(problems),
        )
        return
    for attr, kind, hook in HOOKS:
        HookRegistry.register(f"{CACHE_CLASS}.{attr}", hook, getattr(HookType, kind))
    logger.debug("hicache-async-ack: registered %d hooks on %s", len(HOOKS), CACHE_CLASS)


__all__ = [
    "register",
    "is_hooked",
    "upstream_shape_problems",
    "after_init_hicache",
]
