"""Seeded prefetch scenarios on real gloo ranks: requests waiting on storage
prefetches, deadlines that each rank's clock sees at another pass, and
lifecycle events, driven through SGLang's real cache methods.

A rank target for :func:`hicache_async_ack.tools.run_ranks` (``run_prefetch_specs``).
Per pass, as the scheduler does: new requests start their prefetch (the set
and the deadlines come from a generator every rank shares; the order they are
added in, and each rank's clock skew, are this rank's own), lifecycle events
run (reset, storage detach then attach, an aborted request), then
``check_hicache_events`` (the ack sync and the votes' pass boundary), then
``check_prefetch_progress`` for the waiting requests in queue order, up to a
budget (the batch filling up). Each rank's deadline is upstream's
admission-poll timer counted in passes (:func:`~hicache_async_ack_lab.sim.
prefetch.poll_deadline`: it starts at the first check that finds the prefetch
unfinished, and passes a per-rank number of passes later), so "the same
verdict in the same pass" can be checked exactly.

Spec keys: name, seed, passes, warmup (passes before the first request),
env / rank_env ({rank: settings}), events (bool), check_all (every waiting
request every pass), expect_error, host_memory_mode (the cache's), skew
({rank: from_pass}: from that pass until the last arrival, that rank's
waiting-queue loop visits one request fewer than the others', as a rank whose
batch fills up earlier does: SGLang #30760; a request that rank never reaches
is never timed out, as in stock, so the skew ends before the drain),
completions (bool: storage reads also finish, each rank's at its own pass but
in submission order, as one transfer worker per rank finishes them; their acks
are drained by the agreed count inside ``check_hicache_events``),
loop_only_verdicts (bool: the negative control; a verdict ends an operation
only where a rank's loop reaches it, instead of at the pass boundary, so a
skewed rank must diverge).
"""

from __future__ import annotations

import random
import traceback
from types import SimpleNamespace

from hicache_async_ack.env import ENABLE_VAR, PREFETCH_VOTES_VAR
from hicache_async_ack_lab.plugin_env import EventLog, installed
from hicache_async_ack_lab.sim.cache import build_cache
from hicache_async_ack_lab.sim.prefetch import add_prefetch
from hicache_async_ack_lab.testing.spec_ranks import run_specs

VARS = (ENABLE_VAR, PREFETCH_VOTES_VAR)


def run_prefetch_scenario(spec: dict, rank: int, world: int, group) -> dict:
    from hicache_async_ack.sglang_plugin import VOTES_FEATURE, init_cache

    clock = SimpleNamespace(now=-1)
    sim = build_cache(tp_group=group, tp_world_size=world, storage=True)
    ps = add_prefetch(sim, budget=lambda op: op.test_budget[rank], clock=clock)
    params = SimpleNamespace(enable_metrics=False)
    log = EventLog()
    substitutes = {"prefetch_votes": loop_only()} if spec.get("loop_only_verdicts") else {}
    with installed(log, substitutes):
        init_cache(sim.cache, params)
    shared = random.Random(spec["seed"])  # the same draws on every rank
    local = random.Random(spec["seed"] * 1000 + rank)  # this rank's own
    cache = sim.cache
    if spec.get("host_memory_mode"):
        cache.__dict__["host_memory_mode"] = spec["host_memory_mode"]
        if spec["host_memory_mode"] == "buffer_only":  # what the storage drain reads there
            from collections import deque

            cache.__dict__["buffer_pipeline"] = SimpleNamespace(
                pending_hit_allocs=deque(),
                flush_pending_writes=lambda: None,  # no writes staged in these scenarios
                ongoing_write_through={},
                finish_storage_write_ack=lambda *a, **k: None,
            )
    skew_from = (spec.get("skew") or {}).get(str(rank))
    added: list = []
    reads: list = []  # (operation, its ack queue, this rank's finish pass), submission order
    raced = 0  # reads that finished in a pass where this rank's deadline had passed too
    per_pass: list = []
    detached_until = -1
    n_id = 0
    out: dict = {"events": {}}
    total = spec["passes"] + spec.get("drain", 40)
    p = 0
    try:
        for p in range(total):
            clock.now = p
            before = len(ps.ended)
            arriving = p >= spec.get("warmup", 3) and p < spec["passes"]
            if arriving and cache.enable_storage:
                k = shared.randint(0, 3)
                births = []
                for _ in range(k):
                    life = shared.randint(1, 6)
                    skews = [shared.randint(0, 3) for _ in range(world)]
                    finish: list = []  # per rank, the pass its storage read finishes
                    if spec.get("completions"):
                        base = p + shared.randint(1, 7)
                        finish = [base + shared.randint(0, 2) for _ in range(world)]
                    births.append((f"r{n_id}", [life + s for s in skews], finish))
                    n_id += 1
                in_order = list(births)  # submission order: the shared one
                local.shuffle(births)  # arrival order differs per rank
                handles = {}
                for rid, budgets, _ in births:
                    h = handles[rid] = ps.add(rid)
                    cache.ongoing_prefetch[h].operation.test_budget = budgets
                    added.append((rid, 0))
                for rid, _, finish in in_order:
                    if finish:  # one transfer worker: reads finish in submission order
                        op = cache.ongoing_prefetch[handles[rid]].operation
                        after = reads[-1][2] if reads else 0
                        reads.append((op, ps.read_queue(), max(after, finish[rank])))
            if spec.get("events") and arriving:
                ev = shared.random()
                if ev < 0.03 and cache.enable_storage:
                    ps.reset()
                    out["events"]["reset"] = out["events"].get("reset", 0) + 1
                elif ev < 0.06 and cache.enable_storage:
                    ps.detach()
                    detached_until = p + shared.randint(1, 4)
                    out["events"]["detach"] = out["events"].get("detach", 0) + 1
                elif ev < 0.15 and cache.ongoing_prefetch:
                    keys = sorted(cache.ongoing_prefetch, key=lambda h: h.rid)
                    ps.revoke(keys[shared.randrange(len(keys))])
                    out["events"]["abort"] = out["events"].get("abort", 0) + 1
            if not cache.enable_storage and p >= detached_until:
                sim.attach_storage()
                out["events"]["attach"] = out["events"].get("attach", 0) + 1
            while reads and reads[0][2] <= p:  # this rank's worker finished these reads
                op, q, _ = reads.pop(0)
                due = not op.is_terminated() and cache._prefetch_deadline_expired(op)
                raced += bool(ps.complete(op, q) and due)
            cache.check_hicache_events()
            waiting = sorted(cache.ongoing_prefetch, key=lambda h: int(h.rid[1:]))
            budget = len(waiting) if spec.get("check_all") else shared.randint(0, len(waiting))
            if skew_from is not None and skew_from <= p < spec["passes"]:
                budget = max(0, budget - 1)  # this rank's loop stops one request earlier
            for h in waiting[:budget]:
                ps.check(h)
            per_pass.append(sorted(ps.ended[before:]))
            if p >= spec["passes"] and not cache.ongoing_prefetch:
                break
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        out["error_pass"] = p
    from hicache_async_ack.sglang_plugin import state_of

    state = state_of(VOTES_FEATURE, cache)
    out.update(
        per_pass=per_pass,
        added=added,
        left=len(cache.ongoing_prefetch),
        raced=raced,
        stopped_on_verdict=log.counts.get("stop", 0),
        pipelined=bool(state and state.active),
        checks=ps.checks,
    )
    return out


def loop_only() -> type:
    """The negative control: the votes' state with stops kept instead of applied
    at the boundary, and answered where a rank's walk reaches their operation."""
    from hicache_async_ack.sglang_plugin import PrefetchVoteState

    class LoopOnlyVotes(PrefetchVoteState):
        kept: list = []

        def land(self, cache, token, reduced, exchange) -> None:
            verdicts = self.book.read(token, reduced, exchange)
            self.kept = self.kept + [r.op for r, stop in verdicts if stop]

        def reach(self, cache, original, operation) -> bool:
            if self.active and any(op is operation for op in self.kept):
                self.emit("stop", key=None)
                return True
            return super().reach(cache, original, operation)

    return LoopOnlyVotes


def run_prefetch_specs(ctx, payload: dict) -> dict:
    """Rank target: SGLang's load_plugins(), then each spec on a fresh TP group."""
    return run_specs(ctx, payload, VARS, run_prefetch_scenario)
