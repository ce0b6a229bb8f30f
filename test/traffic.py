"""Seeded HiCache traffic and lifecycle events for one rank, used by the gloo
rank worker and by the in-process many-rank simulation.

Two generators: ``sched`` is seeded with the scenario seed (the same on every
rank) and decides what is enqueued and which lifecycle event runs at which step,
as the scheduler would, symmetrically; ``mine`` is seeded per rank and decides
when each transfer finishes (and a storage entry appears) on this rank.
"""

from __future__ import annotations

import os
import random
import time

from hicache_async_ack.simulated import STORAGE_QUEUE_NAMES, build_cache

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
ENV_KEYS = ("SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC", "SGLANG_HICACHE_ASYNC_ACK_DEPTH")


class RankDriver:
    def __init__(self, spec: dict, rank: int, world: int, groups: dict):
        from hicache_async_ack import sglang_plugin

        for k in ENV_KEYS:
            os.environ.pop(k, None)
        os.environ.update(spec.get("env", {}))
        self.spec = spec
        self.rank = rank
        self.world = world
        self.storage = spec.get("storage", False)
        self.extra = tuple(spec.get("extra_pools", ()))
        topology = {}
        if spec.get("cp_x_tp"):  # attention CP x attention TP inside the TP group
            cp = groups["odd_cp" if spec["cp_x_tp"] == "odd" else "attn_cp"]
            topology = dict(attn_cp_group=cp, attn_tp_group=groups["attn_tp"])
        self.sim = build_cache(
            tp_group=groups["tp"],
            tp_world_size=world,
            storage=self.storage,
            extra_pools=self.extra,
            **topology,
        )
        sglang_plugin.after_init_hicache(None, self.sim.cache)  # as init_hicache would
        self.state = sglang_plugin.state_of(self.sim.cache)
        self.sched = random.Random(spec["seed"])
        self.mine = random.Random(spec["seed"] * 7919 + rank)
        self.max_delay = spec.get("max_delay", 3)
        self.event_p = spec.get("event_p", 0.0)
        names = spec.get("events", EVENTS)
        self.events = tuple(e for e in names if self.storage or e not in _STORAGE_ONLY)
        self.future_puts: list[tuple] = []  # (visible at step, queue name, uid)
        self.last_visible: dict = {}
        self.step = 0
        self.enqueued = 0
        self.event_counts: dict[str, int] = {}

    @property
    def total_steps(self) -> int:
        return self.spec["steps"] + self.spec.get("drain_steps", self.max_delay + 12)

    def _finish_at(self, skew: int):
        t = self.step + self.mine.randint(0, self.max_delay) + skew
        return lambda: self.step >= t

    def storage_names(self) -> list:
        return list(STORAGE_QUEUE_NAMES) + [("extra", p) for p in self.extra]

    def traffic(self, step: int) -> None:
        """Enqueue this step's acks and storage entries (before the event)."""
        self.step = step
        sim, sched = self.sim, self.sched
        if self.spec.get("diverge_at") == step and self.rank == 1:
            sim.tree.write_back_duplicate_reclaim_digest += 1
        if self.spec.get("die_at") == step and self.rank == self.world - 1:
            os._exit(17)  # a rank dies mid-run, no goodbye
        if self.spec.get("stall_at") == step and self.rank == self.world - 1:
            time.sleep(self.spec["stall_s"])  # stops stepping: peers' waits time out
            os._exit(18)
        if step < self.spec["steps"]:
            skew = self.rank if self.spec.get("skew") else 0
            for _ in range(sched.randint(0, 3)):
                sim.add_ack("write", self._finish_at(skew), pending=sched.random() < 0.3)
                self.enqueued += 1
            for _ in range(sched.randint(0, 2)):
                sim.add_ack("load", self._finish_at(skew))
                self.enqueued += 1
            if sim.cc.enable_storage:
                for name in self.storage_names():
                    if sched.random() < 0.4:
                        # appears on this rank a little later; FIFO order kept per queue
                        t = max(self.last_visible.get(name, 0), step + self.mine.randint(0, 2))
                        self.last_visible[name] = t
                        self.future_puts.append((t, name, sim.cc.next_uid()))
        for put in [p for p in self.future_puts if p[0] <= step]:
            self.future_puts.remove(put)
            sim.cc.put_storage(put[1], uid=put[2])

    def pick_event(self, step: int):
        if step < self.spec["steps"] and self.event_p and self.sched.random() < self.event_p:
            return self.sched.choice(self.events)
        return None

    def run_event(self, ev: str) -> None:
        sim = self.sim
        self.event_counts[ev] = self.event_counts.get(ev, 0) + 1
        storage_on = sim.cc.enable_storage
        if ev == "write_back_flush":
            sim.write_back_flush()
        elif ev == "reset":
            sim.reset()
            self.future_puts.clear()
        elif ev == "detach" and storage_on:
            sim.detach_storage()
            self.future_puts.clear()
        elif ev == "attach" and self.storage and not storage_on:
            sim.attach_storage()
            self.last_visible.clear()
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
            for name in self.storage_names():
                left[str(name)] = cc.storage_queue(name).qsize()
        return left

    def summary(self, per_step: list) -> dict:
        decision = self.state.decide(self.sim.cache)
        return {
            "pops": per_step,
            "violations": self.sim.cc.violations,
            "left": self.left(),
            "pending": self.state.sync.pending if self.state.sync else 0,
            "pipelined": decision.pipelined,
            "reason": decision.reason,
            "counts": {"enqueued": self.enqueued, "events": self.event_counts},
        }


_STORAGE_ONLY = ("detach", "attach", "drain_storage")
# detach drains the storage queues locally, best-effort, by upstream's design
# (drain_storage_control_queues_local): those pops may differ across ranks.
LOCAL_DRAIN_EVENTS = ("detach",)
ACK_KINDS = ("write", "load")


def run_scenario(spec: dict, rank: int, world: int, groups: dict) -> dict:
    """All steps of one scenario on one rank of real process groups."""
    d = RankDriver(spec, rank, world, groups)
    per_step = []
    for step in range(d.total_steps):
        d.traffic(step)
        ev = d.pick_event(step)
        if ev:
            d.run_event(ev)
        pre = d.sim.take_pops()  # popped by the lifecycle path itself
        d.sim.cache.check_hicache_events()
        per_step.append([pre, d.sim.take_pops()])
    return d.summary(per_step)
