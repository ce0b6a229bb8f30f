"""The zero-sync bound on SGLang's real server: a measurement device of cpu-server only.

With ``HICACHE_ASYNC_ACK_CPU_BOUND=1`` (``cpu-server --cpu-bound``, or bench-server's
``bound`` arm) every HiCache collective of the server answers with the rank's own
value: ``UnifiedRadixCache._all_reduce`` / ``_all_reduce_attn_groups`` and the cache
controller's ``_all_reduce`` return without reducing. No ack-sync design can cost
less, so the bound is the limit the plugin is measured against.

Why the answers are still right here: on CPU every copy has finished by the time
its ack is counted and every rank makes the same scheduling decisions, so every
rank's counts are equal and a MIN over equal values is each rank's own. That stops
being true the moment acks finish at different times on different ranks, so the
bound refuses skew (``HICACHE_ASYNC_ACK_CPU_SKEW``); it also refuses injected
latency (it has no collective to delay: measure it once, it stands for every
latency) and the plugin being on (it would run its own reduce beside it).

Never a mode a server can be put in otherwise: the variable is read only by the
stand-ins that cpu-server's boot directory loads.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Mapping, MutableMapping, Optional

from ...env import ENABLE_VAR, parse_bool, plugin_whitelisted
from .settings import (
    CPU_REDUCE_LATENCY_VAR,
    CPU_SKEW_VAR,
    parse_cpu_reduce_latency_ms,
    parse_cpu_skew,
)

logger = logging.getLogger("hicache_async_ack.cpu_server")

# HICACHE_ASYNC_ACK_CPU_BOUND: "1" (any true spelling) makes every HiCache collective
# of a cpu-server answer with the rank's own value (the zero-sync bound, a
# measurement device). Unset or false: real collectives. Read by the stand-ins only.
CPU_BOUND_VAR = "HICACHE_ASYNC_ACK_CPU_BOUND"

STANDIN = (
    "zero-sync bound (only with --cpu-bound): every HiCache collective answers with the "
    "rank's own value"
)


def requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_bool(CPU_BOUND_VAR, env.get(CPU_BOUND_VAR), False)


def check(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the bound is asked for; raises ValueError where it would be wrong."""
    env = os.environ if environ is None else environ
    if not requested(env):
        return False
    if parse_cpu_skew(env.get(CPU_SKEW_VAR)):
        raise ValueError(
            f"{CPU_BOUND_VAR}: the zero-sync bound is only valid while every rank's counts "
            f"are equal; {CPU_SKEW_VAR} makes acks finish at different times per rank"
        )
    if parse_cpu_reduce_latency_ms(env.get(CPU_REDUCE_LATENCY_VAR)):
        raise ValueError(
            f"{CPU_BOUND_VAR}: the zero-sync bound has no collective to delay; unset "
            f"{CPU_REDUCE_LATENCY_VAR} (its figures stand for every latency)"
        )
    if parse_bool(ENABLE_VAR, env.get(ENABLE_VAR), True) and plugin_whitelisted(env):
        raise ValueError(
            f"{CPU_BOUND_VAR}: the bound is stock SGLang without its collectives; set "
            f"{ENABLE_VAR}=0 so the plugin does not run its own reduce beside it"
        )
    return True


def _own_value_attn_groups(self, tensor, op) -> None:
    """Every rank keeps its own value (the reduce over equal values, without it)."""


def _own_value(self, data, tp_reduce_op) -> None:
    """No TP reduce and no PP propagation: the rank's own value stands."""


def _own_value_groups(self, tensor, op, groups) -> None:
    """The cache controller's storage-path reduce, rank-local."""


def _patch_unified_radix_cache(module) -> None:
    if not check():
        return
    cls = module.UnifiedRadixCache
    # wraps(): the plugin's guard fingerprints these (unwrapped); keep what it sees.
    cls._all_reduce_attn_groups = functools.wraps(cls._all_reduce_attn_groups)(
        _own_value_attn_groups
    )
    cls._all_reduce = functools.wraps(cls._all_reduce)(_own_value)
    logger.warning("cpu-server: ZERO-SYNC BOUND, HiCache collectives answer locally")


def _patch_cache_controller(module) -> None:
    if not check():
        return
    cls = module.HiCacheController
    cls._all_reduce = functools.wraps(cls._all_reduce)(_own_value_groups)


PATCHES: dict[str, Callable] = {
    "sglang.srt.mem_cache.unified_radix_cache": _patch_unified_radix_cache,
    "sglang.srt.managers.cache_controller": _patch_cache_controller,
}


def _after(first: Optional[Callable], then: Callable) -> Callable:
    if first is None:
        return then

    def both(module) -> None:
        first(module)
        then(module)

    return both


def register(patches: MutableMapping[str, Callable], standins: MutableMapping[str, str]) -> None:
    """Add the bound's patches after the stand-ins' own for the same modules."""
    for name, patch in PATCHES.items():
        patches[name] = _after(patches.get(name), patch)
    standins["zero-sync bound"] = STANDIN
