"""What each bench arm runs on a rank, and the modelled slow host.

Arms, each on fresh ranks (hooks cannot be un-applied in a process):

- ``l1``: no HiCache; check_hicache_events is never called (the baseline).
- ``blocking``: SGLang's loader with an SGLANG_PLUGINS whitelist without us,
  i.e. stock behaviour: one blocking MIN all_reduce per step.
- ``pipelined``: SGLang's loader picks up this plugin through its entry point.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from ... import ack_sync
from ...env import DEPTH_VAR, ENABLE_VAR, ENTRY_POINT_NAME, PLUGINS_VAR
from ...testing.layout import attention_cp_layout, create_groups
from ...testing.sim_cache import SimCache, build_cache
from ...testing.traffic import Traffic, TrafficSpec, WallClock
from ..options import ToolError

ARMS = ("l1", "blocking", "pipelined")
BLOCKING_PLUGINS = "none_selected"  # an SGLANG_PLUGINS whitelist without us
COPY_MS = (0.5, 8.0)  # D2H / H2D copy time on the side stream, per rank, uniform
# Per step: 0-3 write-through backups, 0-1 load-back, and with --storage a 5%
# chance per storage queue of a control entry.
TRAFFIC = TrafficSpec(max_writes=3, pending_p=0.0, max_loads=1, storage_p=0.05, storage_lag=0)


class DelayedHandle:
    """A collective handle whose wait() returns only once the modelled latency
    has passed since issue (then the real result)."""

    __slots__ = ("inner", "ready_at")

    def __init__(self, inner, ready_at: float):
        self.inner = inner
        self.ready_at = ready_at

    def wait(self):
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self.inner.wait()

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.ready_at and self.inner.is_completed()


def delayed_factory(base_factory, latency_s: float):
    def factory(group):
        collective = base_factory(group)

        def issue(values):
            return DelayedHandle(collective(values), time.perf_counter() + latency_s)

        return issue

    return factory


def delayed_all_reduce(original, latency_s: float):
    def all_reduce(data, tp_reduce_op):
        time.sleep(latency_s)
        return original(data, tp_reduce_op)

    return all_reduce


@dataclass
class Arm:
    """One rank's side of an arm: the cache it drives (None for l1), and the
    process group carrying the pipelined reduce when it is not the TP group."""

    name: str
    sim: Optional[SimCache]
    traffic: Optional[Traffic]
    dedicated: Any = None


def prepare(arm: str, cfg: dict, rank: int, world: int) -> Arm:
    """Load plugins as SGLang does for this arm and build the rank's cache."""
    if arm == "l1":
        return Arm(arm, None, None)
    import torch.distributed as dist
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.plugins import load_plugins

    from ...sglang_plugin import is_hooked

    if arm == "pipelined":
        os.environ[PLUGINS_VAR] = ENTRY_POINT_NAME
        os.environ[ENABLE_VAR] = "1"
        os.environ[DEPTH_VAR] = str(cfg["depth"])
    else:
        os.environ[PLUGINS_VAR] = BLOCKING_PLUGINS
    load_plugins()  # SGLang's real loader: entry points, whitelist, apply_hooks
    hooked = is_hooked(UnifiedRadixCache.check_hicache_events)
    if hooked != (arm == "pipelined"):
        raise ToolError(
            f"{arm} arm: SGLang's loader {'applied' if hooked else 'did not apply'} "
            "the plugin's hooks (is the plugin installed as an entry point?)"
        )
    inject_s = cfg["inject_latency_ms"] / 1000.0
    dedicated = None
    if arm == "pipelined":
        if cfg["reduce_group"] == "dedicated":
            timeout = timedelta(seconds=cfg["group_timeout_s"])
            dedicated = dist.new_group(backend="gloo", timeout=timeout)

            def on_dedicated(_group, g=dedicated):
                return ack_sync.torch_min_all_reduce(g)

            ack_sync.collective_factory = on_dedicated
        if inject_s > 0:
            ack_sync.collective_factory = delayed_factory(ack_sync.collective_factory, inject_s)
    groups = create_groups(rank, attention_cp_layout(world, cfg["cp"]), cfg["group_timeout_s"])
    sim = build_cache(
        tp_group=dist.group.WORLD, tp_world_size=world, storage=cfg["storage"], **groups
    )
    if arm == "blocking" and inject_s > 0:
        sim.cache.__dict__["_all_reduce"] = delayed_all_reduce(sim.cache._all_reduce, inject_s)
    traffic = Traffic(sim, TRAFFIC, cfg["seed"], rank, WallClock(COPY_MS))
    return Arm(arm, sim, traffic, dedicated)


def describe_path(arm: Arm, world: int, depth: int) -> str:
    """What the arm really ran, checked after its first step."""
    if arm.sim is None:
        return "no HiCache: check_hicache_events not called"
    if arm.name == "blocking":
        return f"stock SGLang ({PLUGINS_VAR}={BLOCKING_PLUGINS})"
    state = ack_sync.state_of(arm.sim.cache)
    decision = state.decide(arm.sim.cache) if state is not None else None
    if decision is not None and not decision.pipelined and world == 1:
        return f"plugin stands down: {decision.reason}"
    if decision is None or not decision.pipelined:
        why = decision.reason if decision is not None else "no plugin state"
        raise ToolError(f"pipelined arm runs the blocking path: {why}")
    path = f"pipelined over the {decision.reason} (depth {depth})"
    if arm.dedicated is not None:
        path += "; reduce issued on a dedicated gloo group"
    return path
