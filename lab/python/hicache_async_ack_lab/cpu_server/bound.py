"""The zero-sync bound on SGLang's real server: a measurement device of cpu-server only.

With ``HICACHE_ASYNC_ACK_CPU_BOUND=1`` (``cpu-server --cpu-bound``, or bench-server's
``bound`` arm) every HiCache collective of the server answers with the rank's own
value: ``UnifiedRadixCache._all_reduce`` / ``_all_reduce_attn_groups``, the cache
controller's ``_all_reduce`` and PD decode's ``check_offload_progress`` MIN return
without reducing. No ack-sync design can cost
less, so the bound is the limit the plugin is measured against.

Why the answers are still right here: on CPU every copy has finished by the time
its ack is counted and every rank makes the same scheduling decisions, so every
rank's counts are equal and a MIN over equal values is each rank's own. That stops
being true the moment acks finish at different times on different ranks, so the
bound refuses skew (``HICACHE_ASYNC_ACK_CPU_SKEW``); it also refuses injected
latency (it has no collective to delay: measure it once, it stands for every
latency) and the plugin being on (it would run its own reduce beside it).

With ``HICACHE_ASYNC_ACK_CPU_LOCAL_REDUCE=1`` (``cpu-server --cpu-local-reduce``,
bench-server's ``local`` arm) the plugin runs as usual, a step late, but its async
reduces answer with the rank's own value: the step-late pop without the collective.
It splits the plugin's distance to the bound in two: ``local / bound`` is what
popping a step late costs, ``plugin / local`` what the real collective costs on this
box (gloo's thread and wake-ups competing for the cores). Valid, and refused,
exactly where the bound is, except that it needs the plugin on.

With ``HICACHE_ASYNC_ACK_CPU_DEDICATED_GROUP=1`` (bench-server's ``dedicated`` arm)
the plugin issues its async reduces on a gloo group of its own, created right after
SGLang's model-parallel groups by every rank in the same order, instead of the TP
group that also carries the scheduler's per-step ``recv_requests`` broadcast: does
an op left in flight there cost the next step? Only where the world is one TP group.

Never a mode a server can be put in otherwise: the variables are read only by the
stand-ins that cpu-server's boot directory loads.
"""

from __future__ import annotations

import functools
import logging
import os
from datetime import timedelta
from typing import Mapping, MutableMapping, Optional

from hicache_async_ack.env import ENABLE_VAR, parse_bool, plugin_whitelisted
from hicache_async_ack_lab.cpu_server.patching import Patch, add_patches, replace
from hicache_async_ack_lab.cpu_server.settings import (
    CPU_REDUCE_LATENCY_FILE_VAR,
    CPU_REDUCE_LATENCY_VAR,
    CPU_SKEW_VAR,
    latency_injected,
    parse_cpu_skew,
)

logger = logging.getLogger("hicache_async_ack_lab.cpu_server")

# HICACHE_ASYNC_ACK_CPU_BOUND: "1" (any true spelling) makes every HiCache collective
# of a cpu-server answer with the rank's own value (the zero-sync bound, a
# measurement device). Unset or false: real collectives. Read by the stand-ins only.
CPU_BOUND_VAR = "HICACHE_ASYNC_ACK_CPU_BOUND"
BOUND_MARK = "ZERO-SYNC BOUND"  # logged once per scheduler process

# HICACHE_ASYNC_ACK_CPU_LOCAL_REDUCE: "1" (any true spelling) makes the plugin's
# async reduces answer with the rank's own value (the step-late pop without the
# collective, a measurement device). Unset or false: real reduces. Stand-ins only.
CPU_LOCAL_REDUCE_VAR = "HICACHE_ASYNC_ACK_CPU_LOCAL_REDUCE"
LOCAL_MARK = "LOCAL PLUGIN REDUCE"  # logged once per scheduler process

# HICACHE_ASYNC_ACK_CPU_DEDICATED_GROUP: "1" (any true spelling) puts the plugin's async
# reduces on a gloo group of their own (a measurement device). Stand-ins only.
CPU_DEDICATED_GROUP_VAR = "HICACHE_ASYNC_ACK_CPU_DEDICATED_GROUP"
DEDICATED_MARK = "DEDICATED REDUCE GROUP"  # logged once per scheduler process
DEDICATED_TIMEOUT_S = 600
_DEDICATED: dict = {}  # "group": the process group, once SGLang's groups exist

# bench-server arm -> the start-up mark its device logs (the arm really ran it)
MARKS = {"bound": BOUND_MARK, "local": LOCAL_MARK, "dedicated": DEDICATED_MARK}

STANDINS = {
    "zero-sync bound": "zero-sync bound (only with --cpu-bound): every HiCache collective "
    "answers with the rank's own value",
    "dedicated reduce group": "dedicated reduce group (only with "
    "HICACHE_ASYNC_ACK_CPU_DEDICATED_GROUP=1): the plugin's async reduces on a gloo group "
    "of their own",
    "local plugin reduce": "local plugin reduce (only with --cpu-local-reduce): the "
    "plugin's async reduces answer with the rank's own value",
}


def requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_bool(CPU_BOUND_VAR, env.get(CPU_BOUND_VAR), False)


def local_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_bool(CPU_LOCAL_REDUCE_VAR, env.get(CPU_LOCAL_REDUCE_VAR), False)


def _check_equal_counts(var: str, what: str, env: Mapping[str, str]) -> None:
    """Answering locally is right only while every rank's counts are equal, and there is
    then no collective left to delay."""
    if parse_cpu_skew(env.get(CPU_SKEW_VAR)):
        raise ValueError(
            f"{var}: {what} is only valid while every rank's counts are equal; "
            f"{CPU_SKEW_VAR} makes acks finish at different times per rank"
        )
    if latency_injected(env):
        raise ValueError(
            f"{var}: {what} has no collective to delay; unset {CPU_REDUCE_LATENCY_VAR} "
            f"and {CPU_REDUCE_LATENCY_FILE_VAR} (its figures stand for every latency)"
        )


def check(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the bound is asked for; raises ValueError where it would be wrong."""
    env = os.environ if environ is None else environ
    if not requested(env):
        return False
    _check_equal_counts(CPU_BOUND_VAR, "the zero-sync bound", env)
    if local_requested(env):
        raise ValueError(f"{CPU_BOUND_VAR} and {CPU_LOCAL_REDUCE_VAR}: choose one")
    if parse_bool(ENABLE_VAR, env.get(ENABLE_VAR), True) and plugin_whitelisted(env):
        raise ValueError(
            f"{CPU_BOUND_VAR}: the bound is stock SGLang without its collectives; set "
            f"{ENABLE_VAR}=0 so the plugin does not run its own reduce beside it"
        )
    return True


def check_local(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the local plugin reduce is asked for; raises ValueError where wrong."""
    env = os.environ if environ is None else environ
    if not local_requested(env):
        return False
    _check_equal_counts(CPU_LOCAL_REDUCE_VAR, "the local plugin reduce", env)
    if not (parse_bool(ENABLE_VAR, env.get(ENABLE_VAR), True) and plugin_whitelisted(env)):
        raise ValueError(
            f"{CPU_LOCAL_REDUCE_VAR}: the local reduce is the plugin's; it needs the "
            f"plugin loaded and {ENABLE_VAR} unset or 1"
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
    replace(module.UnifiedRadixCache, "_all_reduce_attn_groups", _own_value_attn_groups)
    replace(module.UnifiedRadixCache, "_all_reduce", _own_value)
    logger.warning("cpu-server: %s, HiCache collectives answer locally", BOUND_MARK)


def _patch_cache_controller(module) -> None:
    if not check():
        return
    replace(module.HiCacheController, "_all_reduce", _own_value_groups)


def _own_value_offload_progress(self) -> None:
    """PD decode offload progress without its MIN: each rank pops its own queue sizes.
    On CPU every offload copy is done when queued; a backup finishes on the rank's own
    storage thread, so the ranks may pop one a step apart, which only moves when host
    pages are freed (the tiny model's pool never fills)."""
    cc = self.cache_controller
    self._check_offload_progress(len(cc.ack_write_queue))
    self._check_backup_progress(cc.ack_backup_queue.qsize())


def _patch_offload_manager(module) -> None:
    if not check():
        return
    cls = module.DecodeKVCacheOffloadManager
    replace(cls, "check_offload_progress", _own_value_offload_progress)
    logger.warning("cpu-server: %s, the decode offload progress answers locally", BOUND_MARK)


def check_dedicated(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    if not parse_bool(CPU_DEDICATED_GROUP_VAR, env.get(CPU_DEDICATED_GROUP_VAR), False):
        return False
    if local_requested(env) or requested(env):
        raise ValueError(f"{CPU_DEDICATED_GROUP_VAR}: the local reduce and the bound have none")
    return True


def _patch_parallel_state(module) -> None:
    if not check_dedicated():
        return
    real = module.initialize_model_parallel

    @functools.wraps(real)
    def initialize_model_parallel(*args, **kwargs):
        real(*args, **kwargs)
        import torch.distributed as dist

        world, tp = dist.get_world_size(), module.get_tp_group().world_size
        if world != tp:
            raise RuntimeError(f"{CPU_DEDICATED_GROUP_VAR}: world {world} is not one TP group")
        # Every rank, in the same order, right after SGLang's own groups; a rank that
        # never joins fails the others after the timeout, not never.
        _DEDICATED["group"] = dist.new_group(
            list(range(world)), backend="gloo", timeout=timedelta(seconds=DEDICATED_TIMEOUT_S)
        )
        logger.warning("cpu-server: %s for the plugin's async reduces", DEDICATED_MARK)

    module.initialize_model_parallel = initialize_model_parallel


def _patch_plugin_reduces(module) -> None:
    from hicache_async_ack_lab.plugin_env import wrap_async_min

    if check_dedicated():
        wrap_async_min(lambda base: lambda group: base(_DEDICATED["group"]))
    if not check_local():
        return
    from hicache_async_ack_lab.sim.collectives import EchoHandle

    wrap_async_min(lambda base: lambda group: EchoHandle)
    logger.warning("cpu-server: %s, the plugin's reduces answer locally", LOCAL_MARK)


PATCHES: dict[str, Patch] = {
    "sglang.srt.mem_cache.unified_radix_cache": _patch_unified_radix_cache,
    "sglang.srt.managers.cache_controller": _patch_cache_controller,
    "hicache_async_ack.sglang_plugin": _patch_plugin_reduces,
    "sglang.srt.distributed.parallel_state": _patch_parallel_state,
    "sglang.srt.disaggregation.decode_kvcache_offload_manager": _patch_offload_manager,
}


def register(patches: MutableMapping[str, Patch], standins: MutableMapping[str, str]) -> None:
    """Add the bound's patches after the stand-ins' own for the same modules."""
    add_patches(patches, PATCHES.items())
    standins.update(STANDINS)
