"""Seeded scenarios for one rank: traffic, lifecycle events, and what was popped.

A scenario ``spec`` (a JSON-able dict) names a seed, a step count, the traffic
and the lifecycle events; :class:`RankDriver` plays it on one rank's real
UnifiedRadixCache, over real process groups (:func:`run_specs`, a rank target
for :func:`hicache_async_ack.tools.run_ranks`) or over a :class:`MinHub` in one
process (the many-rank simulation in the tests).

Spec keys: name, seed, steps, env (plugin settings for this scenario, over
the process's own), rank_env ({rank: settings} for one rank only), max_delay /
skew (when acks finish, in steps), storage, extra_pools, event_p / events
(lifecycle events, chosen by the shared generator), cp_x_tp ("grid": the SGLang
layout, "odd": one no group spans), drain_steps, fresh_group (a new TP group
for this scenario, so one whose collectives end out of step leaves the next
ones sound), and the faults diverge_at / die_at / stall_at (+ stall_s) /
protocol_at (rank 1 speaks another protocol version from that step) /
expect_error.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Optional

from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR
from hicache_async_ack.protocol import PROTOCOL_VERSION as PLUGIN_PROTOCOL
from hicache_async_ack.sglang_plugin import ACK_FEATURE, environment, init_cache, state_of
from hicache_async_ack_lab.plugin_env import installed
from hicache_async_ack_lab.sim.cache import build_cache
from hicache_async_ack_lab.sim.clock import ModelClock, modelled
from hicache_async_ack_lab.sim.traffic import StepClock, Traffic, TrafficSpec
from hicache_async_ack_lab.testing.spec_ranks import apply_env

EVENTS = (
    "write_back_flush",
    "reset",
    "detach",
    "attach",
    "loading_check",
    "drain_storage",
    "release_host_resources",
)
# Events that run upstream's own blocking all_reduce: every rank must be inside
# them at once (threads in the in-process simulation).
COLLECTIVE_EVENTS = ("loading_check", "drain_storage")
STORAGE_ONLY_EVENTS = ("detach", "attach", "drain_storage")
# detach drains the storage queues locally, best-effort, by upstream's design
# (drain_storage_control_queues_local): those pops may differ across ranks.
LOCAL_DRAIN_EVENTS = ("detach",)
ACK_KINDS = ("write", "load")
PROTOCOL_VERSION = PLUGIN_PROTOCOL  # what this release speaks
SETTINGS_VARS = (ENABLE_VAR, DEPTH_VAR)
# The process's own settings, captured at its first scenario (a rank's, as spawned);
# every scenario starts from them. Tests that run scenarios in-process reset it.
process_settings: Optional[dict[str, Optional[str]]] = None
# In-tree mode (payload "in_tree"): the SGLang on the path carries the ack sync
# itself (hicache-async-ack-lab upstream-patch), the plugin is not loaded, and the
# cache gets its HiCacheAckSync as the patched init_hicache creates it.
IN_TREE_MODULE = "sglang.srt.mem_cache.unified_cache.hicache_ack_sync"
_in_tree = False


def _in_tree_module():
    """The patched tree's ack sync module (its PROTOCOL_VERSION is what that rank speaks)."""
    return importlib.import_module(IN_TREE_MODULE)


def apply_settings(spec: dict, rank: int) -> None:
    """The process's own plugin settings, then the scenario's, then this rank's."""
    global process_settings
    if process_settings is None:
        process_settings = {k: os.environ.get(k) for k in SETTINGS_VARS}
    apply_env(spec, rank, process_settings)


class RankDriver:
    def __init__(self, spec: dict, rank: int, world: int, groups: dict):
        apply_settings(spec, rank)
        if _in_tree:
            _in_tree_module().PROTOCOL_VERSION = PROTOCOL_VERSION
        self.spec = spec
        self.rank = rank
        self.world = world
        self.storage = spec.get("storage", False)
        topology = {}
        if spec.get("cp_x_tp"):  # attention CP x attention TP inside the TP group
            cp = groups["odd_cp" if spec["cp_x_tp"] == "odd" else "attn_cp_group"]
            topology = dict(attn_cp_group=cp, attn_tp_group=groups["attn_tp_group"])
        # --enable-metrics: labelled as SGLang labels a cache (metrics: a cache_type)
        cache_type = (
            spec["metrics"] if isinstance(spec.get("metrics"), str) else "UnifiedRadixCache"
        )
        labels = {"cache_type": cache_type, "tp_rank": rank, "pp_rank": 0, "dp_rank": 0}
        self.sim = build_cache(
            tp_group=groups["tp"],
            tp_world_size=world,
            storage=self.storage,
            extra_pools=tuple(spec.get("extra_pools", ())),
            metrics_labels=labels if spec.get("metrics") else None,
            **topology,
        )
        # as init_hicache(server_args, params) would, with --enable-metrics or not
        params = SimpleNamespace(enable_metrics=bool(spec.get("metrics")))
        self.step = 0
        self.clock: Optional[ModelClock] = None  # model time, with latency_ms
        model: dict = {}
        if spec.get("latency_ms"):
            # a slow collective: [[from step, ms], ...], read when a reduce is issued
            # in model time: the latency model, never the wall clock of a busy
            # box, decides what auto depth sees (the reduce itself is real)
            self.clock = clock = ModelClock()
            base = environment().collectives.async_min
            model = dict(clock=clock,
                         async_min=lambda g: modelled(base(g), self.latency_s, clock))  # fmt: skip
        if _in_tree:
            assert state_of(ACK_FEATURE, self.sim.cache) is None  # no plugin
            attach_in_tree(self.sim.cache)
        else:
            with installed(**model):
                init_cache(self.sim.cache, params)
        self.max_delay = spec.get("max_delay", 3)
        steps = StepClock(self.max_delay, rank if spec.get("skew") else 0)
        self.traffic = Traffic(self.sim, TrafficSpec(), spec["seed"], rank, steps)
        self.event_p = spec.get("event_p", 0.0)
        names = spec.get("events", EVENTS)
        self.events = tuple(e for e in names if self.storage or e not in STORAGE_ONLY_EVENTS)
        self.event_counts: dict[str, int] = {}
        self.depths: list[int] = []  # the lag depth after each step (auto depth moves it)

    @property
    def state(self):
        if _in_tree:
            return InTreeState(self.sim.cache)
        state = state_of(ACK_FEATURE, self.sim.cache)
        assert state is not None, "the cache has no ack sync state"
        return state

    @property
    def total_steps(self) -> int:
        return self.spec["steps"] + self.spec.get("drain_steps", self.max_delay + 12)

    def latency_s(self) -> float:
        ms = [ms for start, ms in self.spec["latency_ms"] if start <= self.step]
        return (ms[-1] if ms else 0.0) / 1000.0

    def step_traffic(self, step: int) -> None:
        """Faults due at this step, then this step's traffic (before the event)."""
        spec, last = self.spec, self.world - 1
        self.step = step
        if spec.get("step_ms"):  # the forward, host idle
            if self.clock is not None:
                self.clock.advance(spec["step_ms"] / 1000.0)
            else:
                time.sleep(spec["step_ms"] / 1000.0)
        if spec.get("diverge_at") == step and self.rank == 1:
            self.sim.tree.write_back_duplicate_reclaim_digest += 1
        if spec.get("die_at") == step and self.rank == last:
            os._exit(17)  # a rank dies mid-run, no goodbye
        if spec.get("stall_at") == step and self.rank == last:
            time.sleep(spec["stall_s"])  # stops stepping: peers' waits time out
            os._exit(18)
        if spec.get("protocol_at") == step and self.rank == 1:
            if _in_tree:  # a peer on another release
                _in_tree_module().PROTOCOL_VERSION = PROTOCOL_VERSION + 1
            else:
                self.state.core.protocol = PROTOCOL_VERSION + 1
        self.traffic.enqueue(step, new_work=step < spec["steps"])

    def pick_event(self, step: int):
        sched = self.traffic.sched
        if step < self.spec["steps"] and self.event_p and sched.random() < self.event_p:
            return sched.choice(self.events)
        return None

    def run_event(self, ev: str) -> None:
        sim = self.sim
        self.event_counts[ev] = self.event_counts.get(ev, 0) + 1
        storage_on = sim.cc.enable_storage
        if ev == "write_back_flush":
            sim.write_back_flush()
        elif ev == "reset":
            sim.reset()
            self.traffic.forget_storage()
        elif ev == "detach" and storage_on:
            sim.detach_storage()
            self.traffic.forget_storage()
        elif ev == "attach" and self.storage and not storage_on:
            sim.attach_storage()
            self.traffic.forget_storage()
        elif ev == "loading_check":
            sim.cache.loading_check()  # upstream's own blocking reduce
        elif ev == "drain_storage" and storage_on:
            sim.cache.drain_storage_control_queues()
        elif ev == "release_host_resources":
            sim.cache.release_host_resources()
            sim.cache.shutdown()

    def left(self) -> dict:
        cc = self.sim.cc
        left = {
            "write": len(cc.ack_write_queue) + len(cc.pending_writes),
            "load": len(cc.ack_load_queue),
            "ongoing_write": len(self.sim.cache.ongoing_write_through),
            "ongoing_load": len(self.sim.cache.ongoing_load_back),
        }
        if cc.enable_storage:
            for name in self.traffic.storage_names():
                left[str(name)] = cc.storage_queue(name).qsize()
        return left

    def summary(self, per_step: list, events: list) -> dict:
        decision = self.state.decide(self.sim.cache)
        return {
            "pops": per_step,
            "events": events,
            "depths": self.depths,
            "metrics_on": self.state.metrics is not None,
            "metrics_module_loaded": "hicache_async_ack.metrics" in sys.modules,
            "steps_run": len(per_step),
            "violations": self.sim.cc.violations,
            "left": self.left(),
            "pending": self.state.core.pending if self.state.core else 0,
            "pipelined": decision.pipelined,
            "reason": decision.reason,
            "counts": {"enqueued": self.traffic.enqueued, "events": self.event_counts},
        }


def attach_in_tree(cache) -> None:
    """What the patched init_hicache ends with (a server that is not PD decode)."""
    intree = importlib.import_module(IN_TREE_MODULE)
    cache.ack_sync = intree.HiCacheAckSync.create(cache, "null")


class InTreeState:
    """A patched tree's ack sync (``cache.ack_sync``, None on the blocking
    path) read as the summary reads the plugin's per-cache state."""

    metrics = None

    def __init__(self, cache):
        self.cache = cache

    @property
    def core(self):
        sync = self.cache.ack_sync
        if sync is None:
            return None
        return SimpleNamespace(depth=sync.depth, pending=len(sync.in_flight))

    def decide(self, cache):
        pipelined = cache.ack_sync is not None
        return SimpleNamespace(pipelined=pipelined, reason="" if pipelined else "blocking")


def run_scenario(spec: dict, rank: int, world: int, groups: dict) -> dict:
    """All steps of one scenario on one rank. On an error, what was popped up to
    it comes back with the error (the step that raised is not counted)."""
    d = RankDriver(spec, rank, world, groups)
    per_step: list[list] = []
    events: list[Optional[str]] = []
    try:
        for step in range(d.total_steps):
            d.step_traffic(step)
            ev = d.pick_event(step)
            if ev:
                d.run_event(ev)
            pre = d.sim.take_pops()  # popped by the lifecycle path itself
            d.sim.cache.check_hicache_events()
            per_step.append([pre, d.sim.take_pops()])
            events.append(ev)
            d.depths.append(d.state.core.depth if d.state.core else 0)
    except Exception as exc:
        out = d.summary(per_step, events)
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["popped_in_failed_step"] = d.sim.take_pops()
        return out
    finally:
        if _in_tree:
            _in_tree_module().PROTOCOL_VERSION = PROTOCOL_VERSION
    return d.summary(per_step, events)


def run_specs(ctx, payload: dict) -> dict:
    """Rank target: SGLang's real load_plugins() (what run_scheduler_process
    does first), the groups of ``payload["layout"]``, then every scenario of
    ``payload["specs"]`` in order. A failing scenario is recorded (with its
    traceback) and, unless it expected the error, skips the rest. With
    ``payload["in_tree"]`` the ranks run a patched SGLang's own ack sync."""
    global _in_tree
    from datetime import timedelta

    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    from hicache_async_ack_lab.sim.layout import create_groups

    load_plugins()
    _in_tree = bool(payload.get("in_tree"))
    if _in_tree:
        _in_tree_module()  # fails here unless the tree is patched
    timeout = payload.get("group_timeout_s", 60.0)
    everyone = list(range(ctx.world_size))

    def tp_group():
        return dist.new_group(everyone, backend="gloo", timeout=timedelta(seconds=timeout))

    groups = {"tp": tp_group()}
    groups.update(create_groups(ctx.rank, payload.get("layout", {}), timeout))
    results: dict[str, dict] = {}
    broken = False
    for spec in payload["specs"]:
        if broken:
            results[spec["name"]] = {"error": "skipped after an earlier failure"}
            continue
        if spec.get("fresh_group"):
            groups["tp"] = tp_group()
        t0 = time.monotonic()
        try:
            results[spec["name"]] = run_scenario(spec, ctx.rank, ctx.world_size, groups)
        except Exception as exc:  # setting the scenario up failed
            results[spec["name"]] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        results[spec["name"]]["seconds"] = time.monotonic() - t0
        broken = "error" in results[spec["name"]] and not spec.get("expect_error")
        ctx.report(len(results))
    return results
