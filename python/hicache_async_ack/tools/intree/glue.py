# The in-tree glue of the upstream patch: what SGLang's own tree needs on top of
# core.py, env.py and ack_sync.py, which the plugin attaches with hooks instead.
# Never imported: tools/intree/module.py reads this file as text and appends
# its statements (after this comment and the docstring below, which becomes the
# docstring of sglang/srt/mem_cache/hicache_ack_sync.py) to the composed module.
# A name defined here replaces the plugin's definition of the same name
# (read_settings: SGLang's envs instead of os.environ).
"""Pipelined HiCache ready-count sync for UnifiedRadixCache.

Every scheduler step, check_hicache_events MIN-reduces across the TP ranks how
many write-back / load-back acks (and, with a storage backend, storage control
entries) each rank has finished, with a blocking all_reduce right before the
next forward is launched. Here that reduce is issued with async_op=True at the
end of step t and consumed at step t+k (k = SGLANG_HICACHE_ASYNC_ACK_DEPTH,
default 1): every rank pops at step t+k exactly what the blocking path pops at
step t. Same collectives per step, same pops on every rank, k steps later.

One step of check_hicache_events:
  1. reap PP sends, flush pending backups (the cache's own code);
  2. wait on the reduce issued k steps ago and reconcile it with the queues;
  3. pop the agreed entries through writing_check / loading_check / the storage
     drain (the cache's own code, given the agreed counts);
  4. buffer flush, storage metrics (the cache's own code);
  5. count what is ready now and issue the next reduce.

Pipelined where the step keeps exactly one collective: one group among attn CP /
attn TP / TP, or attn CP x attn TP through the TP group, with pp_size == 1, no
external linker and host memory mode "cache". Everything else keeps the
blocking path and logs why; SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0 restores it
everywhere. The per-cache state is created on the cache's first
check_hicache_events, so caches built without init_hicache work as before.
"""

from __future__ import annotations

from sglang.srt.environ import envs

from ...ack_sync import CacheState, attach_state, state_of
from ...env import DEPTH_AUTO, DEPTH_DEFAULT, DEPTH_VAR, ENABLE_VAR, Settings, parse_depth

# Overriding either in a subclass bypasses the pipelined step: such a cache
# keeps the blocking path.
PIPELINED_METHODS = ("check_hicache_events", "_sync_hicache_ready_counts")


def read_settings() -> Settings:
    """The ack sync's settings from SGLang's environment registry; a bad depth
    raises ValueError naming the accepted values."""
    depth = parse_depth(DEPTH_VAR, envs.SGLANG_HICACHE_ASYNC_ACK_DEPTH.get(), DEPTH_DEFAULT)
    return Settings(
        enabled=envs.SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC.get(),
        depth=1 if depth == DEPTH_AUTO else int(depth),
        auto=depth == DEPTH_AUTO,
    )


def get_ack_sync_state(cache, base: type) -> CacheState:
    """The cache's ack sync state, created on its first check_hicache_events
    (every rank of the group is there at the same step, which the eligibility
    check of attn CP x attn TP relies on: it gathers over the TP group once)."""
    state = state_of(cache)
    if state is None:
        settings = read_settings()
        blocker = None if settings.enabled else f"{ENABLE_VAR}=0"
        for name in PIPELINED_METHODS:
            if blocker is None and getattr(type(cache), name) is not getattr(base, name):
                blocker = f"{type(cache).__name__}.{name} is overridden by a subclass"
        state = attach_state(cache, blocker, settings=settings)
    return state
