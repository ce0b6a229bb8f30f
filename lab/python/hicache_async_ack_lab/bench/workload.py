"""What each bench arm runs on a rank, and the modelled slow host.

Arms, each on fresh ranks (hooks cannot be un-applied in a process):

- ``l1``: no HiCache; check_hicache_events is never called.
- ``blocking``: SGLang's loader with an SGLANG_PLUGINS whitelist without us,
  i.e. stock behaviour: one blocking MIN all_reduce per step.
- ``bound`` (zero-sync bound): stock, with the collective replaced by a local
  no-op. Each rank pops its own ready counts, which is wrong across ranks: a
  measurement device only, never a mode anyone can pick. No ack-sync design
  can cost less per step.
- ``floor`` (one-collective floor): the bound, plus, inside the timed check, a
  wait on the previous step's async MIN all_reduce and the issue of the next
  one, on a preallocated tensor of upstream's size. What any design that keeps
  upstream's agreement must pay.
- ``pipelined``: this plugin, picked up by SGLang's loader through its entry
  point; one arm per ``--depth`` value.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, ENTRY_POINT_NAME, PLUGINS_VAR
from hicache_async_ack.sglang_plugin import ACK_FEATURE, Collectives, state_of
from hicache_async_ack_lab.cli_support import ToolError
from hicache_async_ack_lab.plugin_env import wrap_async_min
from hicache_async_ack_lab.sim.cache import SimCache, build_cache
from hicache_async_ack_lab.sim.collectives import DelayedHandle, delayed
from hicache_async_ack_lab.sim.layout import attention_cp_layout, create_groups
from hicache_async_ack_lab.sim.traffic import Traffic, TrafficSpec, WallClock

KINDS = ("l1", "blocking", "bound", "floor", "pipelined")
# The references whose pops are local to each rank by construction.
LOCAL_POPS = ("bound", "floor")
BLOCKING_PLUGINS = "none_selected"  # an SGLANG_PLUGINS whitelist without us
COPY_MS = (0.5, 8.0)  # D2H / H2D copy time on the side stream, per rank, uniform
# Per step: 0-3 write-through backups, 0-1 load-back, and with --storage a 5%
# chance per storage queue of a control entry.
TRAFFIC = TrafficSpec(max_writes=3, pending_p=0.0, max_loads=1, storage_p=0.05, storage_lag=0)


@dataclass(frozen=True)
class ArmSpec:
    name: str  # as reported: the kind, or pipelined@<depth> when several depths run
    kind: str
    depth: str = "1"  # pipelined only: SGLANG_HICACHE_ASYNC_ACK_DEPTH


class Schedule:
    """The injected collective latency, by phase: ``phases`` is ((ms, steps), ...)
    over the measured steps (warmup runs the first phase; the last phase runs
    to the end). The rank loop sets ``step``."""

    def __init__(self, phases: tuple[tuple[float, int], ...], warmup: int):
        self.phases = phases
        self.warmup = warmup
        self.step = 0

    def phase_of(self, step: int) -> int:
        left = step - self.warmup
        for i, (_, steps) in enumerate(self.phases[:-1]):
            if left < steps:
                return i
            left -= steps
        return len(self.phases) - 1

    def latency_s(self) -> float:
        return self.phases[self.phase_of(self.step)][0] / 1000.0

    @property
    def injects(self) -> bool:
        """Whether any phase injects latency (else nothing is wrapped at all)."""
        return any(ms > 0 for ms, _ in self.phases)


@dataclass
class Arm:
    """One rank's side of an arm: the cache it drives (None for l1), its
    traffic, and the group carrying the pipelined reduce if not the TP group."""

    spec: ArmSpec
    sim: Optional[SimCache]
    traffic: Optional[Traffic]
    dedicated: Any = None


def delayed_all_reduce(original: Callable, latency_s: Callable[[], float]) -> Callable:
    def all_reduce(data, tp_reduce_op):
        time.sleep(latency_s())
        return original(data, tp_reduce_op)

    return all_reduce


def local_no_op(data, tp_reduce_op) -> None:
    """The zero-sync bound's "collective": every rank keeps its own counts."""


class FloorCheck:
    """The one-collective floor's check_hicache_events: upstream's check without
    a collective (the bound), plus waiting on the previous step's async MIN
    all_reduce and issuing the next one, of upstream's size, the cheapest way we
    know (the plugin's own primitive: a preallocated tensor and the process
    group's allreduce), so floor - bound is the collective and nothing else."""

    def __init__(self, cache, group, size: int, schedule: Schedule):
        self.check = type(cache).check_hicache_events.__get__(cache)
        self.issue = Collectives().async_min(group)
        self.values = [0] * size
        self.schedule = schedule if schedule.injects else None
        self.pending: Any = None

    def __call__(self) -> None:
        if self.pending is not None:
            self.pending.wait()
        self.check()
        work = self.issue(self.values)
        if self.schedule is not None:
            work = DelayedHandle(work, time.perf_counter() + self.schedule.latency_s())
        self.pending = work


def _load_plugins_for(spec: ArmSpec) -> None:
    """SGLang's real loader, with the plugin whitelisted only where it runs."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.plugins import load_plugins

    from hicache_async_ack.sglang_plugin import is_hooked

    if spec.kind == "pipelined":
        os.environ[PLUGINS_VAR] = ENTRY_POINT_NAME
        os.environ[ENABLE_VAR] = "1"
        os.environ[DEPTH_VAR] = spec.depth
    else:
        os.environ[PLUGINS_VAR] = BLOCKING_PLUGINS
    load_plugins()  # entry points, whitelist, apply_hooks
    hooked = is_hooked(UnifiedRadixCache.check_hicache_events)
    if hooked != (spec.kind == "pipelined"):
        raise ToolError(
            f"{spec.name} arm: SGLang's loader {'applied' if hooked else 'did not apply'} "
            "the plugin's hooks (is the plugin installed as an entry point?)"
        )


def prepare(spec: ArmSpec, cfg: dict, rank: int, world: int, schedule: Schedule) -> Arm:
    """Load plugins as SGLang does for this arm and build the rank's cache."""
    if spec.kind == "l1":
        return Arm(spec, None, None)
    import torch.distributed as dist

    _load_plugins_for(spec)
    dedicated = None
    if spec.kind == "pipelined":
        if cfg["reduce_group"] == "dedicated":
            timeout = timedelta(seconds=cfg["group_timeout_s"])
            dedicated = dist.new_group(backend="gloo", timeout=timeout)

            def on_dedicated(_group, g=dedicated):
                return Collectives().async_min(g)

            wrap_async_min(lambda base: on_dedicated)
        if schedule.injects:
            wrap_async_min(lambda base: lambda g: delayed(base(g), schedule.latency_s))
    groups = create_groups(rank, attention_cp_layout(world, cfg["cp"]), cfg["group_timeout_s"])
    sim = build_cache(
        tp_group=dist.group.WORLD, tp_world_size=world, storage=cfg["storage"], **groups
    )
    cache = sim.cache.__dict__
    if spec.kind == "blocking" and schedule.injects:
        cache["_all_reduce"] = delayed_all_reduce(sim.cache._all_reduce, schedule.latency_s)
    elif spec.kind in LOCAL_POPS:
        cache["_all_reduce"] = local_no_op
    if spec.kind == "floor":
        size = 4 + (4 + len(sim.cc.extra_pools) if cfg["storage"] else 0)  # upstream's layout
        cache["check_hicache_events"] = FloorCheck(sim.cache, dist.group.WORLD, size, schedule)
    traffic = Traffic(sim, TRAFFIC, cfg["seed"], rank, WallClock(COPY_MS))
    return Arm(spec, sim, traffic, dedicated)


def describe_path(arm: Arm, world: int) -> str:
    """What the arm really ran, checked after its first step."""
    kind = arm.spec.kind
    if arm.sim is None:
        return "no HiCache: check_hicache_events not called"
    if kind == "blocking":
        return f"stock SGLang ({PLUGINS_VAR}={BLOCKING_PLUGINS})"
    if kind == "bound":
        return "stock check, collective replaced by a local no-op (measurement only)"
    if kind == "floor":
        return "the bound + one async MIN all_reduce per step (the plugin's primitive)"
    state = state_of(ACK_FEATURE, arm.sim.cache)
    decision = state.decide(arm.sim.cache) if state is not None else None
    if decision is not None and not decision.pipelined and world == 1:
        return f"plugin stands down: {decision.reason}"
    if decision is None or not decision.pipelined:
        why = decision.reason if decision is not None else "no plugin state"
        raise ToolError(f"pipelined arm runs the blocking path: {why}")
    path = f"pipelined over the {decision.reason} (depth {arm.spec.depth})"
    if arm.dedicated is not None:
        path += "; reduce issued on a dedicated gloo group"
    return path
