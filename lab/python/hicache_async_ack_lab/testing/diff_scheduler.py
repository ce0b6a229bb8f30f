"""The scheduler's side of a differential scenario on one rank
(:mod:`.differential`), in the order of SGLang 0.5.23's event loop, through
upstream's own methods on a minimal ``Scheduler``
(:mod:`hicache_async_ack_lab.sim.sched_shim`): arrivals and retractions
(``Scheduler._add_request_to_queue``: ``_prefetch_kvcache`` matches the device and
host trees and prefetches the remainder), aborts (``_release_aborted_request``), this
rank's storage reports, finished requests, device pressure, the operator's
flush / detach / attach once the scheduler is idle, the boundary
(``Scheduler._process_hicache_events``: ``check_hicache_events``, then the storage
retries through ``_process_storage_prefetch_retries`` / ``_retry_storage_prefetch``),
then the waiting-queue walk (:mod:`.diff_walk`) or a PD decode node's transfer queue.

Requests are SGLang's own ``Req`` objects, kept alive in the waiting queue (a held
start re-runs ``_prefetch_kvcache`` on them). A prompt is its cacheable tokens and one
tail token (the match stops one short of the prompt: ``_compute_max_prefix_len``), so
a request of n tokens asks L3 for at most n; a family's requests share their first
tokens (a system prompt), so they match what another one's prefetch inserted.
"""

from __future__ import annotations

import dataclasses

from hicache_async_ack_lab.sim.host_tree import ROOT
from hicache_async_ack_lab.sim.lifecycle import Record, handle_key
from hicache_async_ack_lab.sim.sched_shim import new_req, new_scheduler
from hicache_async_ack_lab.testing import diff_walk
from hicache_async_ack_lab.testing.diff_build import RecordingRetries, family_tokens

TOKEN_BASE = 1_000_000  # request i attempt a: its own tokens from (i * 64 + a) * TOKEN_BASE
TAIL = 7  # the prompt's last token (never cached)


class Scheduler:
    """The scheduler's side of the scenario on one rank."""

    def __init__(self, spec: dict, rank: int, sim, record: Record):
        self.spec, self.rank, self.sim, self.record = spec, rank, sim, record
        self.cache = sim.cache
        self.page_size = spec.get("page_size", 1)
        self.shim = new_scheduler(self.cache, spec, self.page_size)
        self.requests = {r["rid"]: r for r in spec["requests"]}
        self.index = {r["rid"]: i for i, r in enumerate(spec["requests"])}
        self.limits_spec = spec.get("limits", {})
        self.attempt: dict = {}
        self.arrived: dict = {}  # rid -> the pass its current attempt arrived
        self.transfer: list = []  # PD decode: the transfer queue
        self.running: dict = {}  # (rid, attempt) -> (Req, the pass it finishes)
        self.requeue_at: dict = {}  # pass -> [rid]
        self.limits: list = []  # (pass, kind, key): what limited the walk
        self.popped: dict = {}  # key -> L3 tokens popped for it, until its admission
        self.admin = [list(a) for a in spec.get("admin", [])]  # [pass, what] still to do

    @property
    def waiting(self) -> list:
        return self.shim.waiting_queue

    def decode(self) -> bool:
        return self.spec.get("mode") == "decode"

    def key(self, rid) -> tuple:
        return (rid, self.attempt[rid])

    def tokens_of(self, rid: str) -> list[int]:
        """The prompt's cacheable tokens (the tail token follows them)."""
        r = self.requests[rid]
        first = (self.index[rid] * 64 + self.attempt[rid]) * TOKEN_BASE
        family = r.get("family")
        shared = [] if family is None else family_tokens(family[0], min(family[1], r["tokens"]))
        return shared + list(range(first, first + r["tokens"] - len(shared)))

    def stats(self) -> int:
        return self.cache._prefetch_outcome_stats["declined_rate_limited"]

    # -- arrivals
    def arrive(self, rid: str, p: int) -> None:
        from sglang.srt.managers.scheduler import Scheduler as Upstream

        self.attempt[rid] = self.attempt.get(rid, -1) + 1
        self.arrived[rid] = p
        r = self.requests[rid]
        req = new_req(rid, self.tokens_of(rid) + [TAIL], r.get("priority"))
        req.cache_request_handle = dataclasses.replace(
            req.cache_request_handle, attempt_id=self.attempt[rid]
        )
        self.record.add(self.key(rid), "arrived")
        if self.decode():
            return self.prealloc(req, p)
        declined = self.stats()
        Upstream._add_request_to_queue(self.shim, req)
        # what device and host held of the prompt at arrival (the match
        # _prefetch_kvcache made; unset without storage): the host-served clause
        matched = getattr(req, "storage_prefetch_last_match_len", None)
        if matched is not None:
            self.record.add(self.key(rid), "matched", matched)
        if self.stats() != declined:
            self.limits.append((p, "declined_rate_limited", self.key(rid)))

    def prealloc(self, req, p: int) -> None:
        """A PD decode node's prealloc: probe L3, then prefetch the hit (its end known)."""
        cache, cc = self.cache, self.sim.cc
        tokens = list(req.origin_input_ids[:-1])
        limited = cc.prefetch_rate_limited()
        cc.probing = req.rid
        hit = cache.query_storage_hit_length(ROOT, tokens)
        self.record.add(handle_key(req.cache_request_handle), "probe", hit)
        if limited:
            self.limits.append((p, "probe_rate_limited", handle_key(req.cache_request_handle)))
        if hit > 0:
            declined = self.stats()
            cache.prefetch_from_storage(
                req.cache_request_handle, ROOT, tokens, None, None, matched_prefix_tokens=[],
                extra_key=None, cache_salt=None, storage_hit_end=hit,
            )  # fmt: skip
            if self.stats() != declined:
                self.limits.append((p, "declined_rate_limited", self.key(req.rid)))
        self.transfer.append(req)

    # -- the pass
    def step(self, p: int, arriving: bool) -> None:
        from sglang.srt.managers.scheduler import Scheduler as Upstream

        spec = self.spec
        declined = self.stats()
        for rid in self.requeue_at.pop(p, []):
            self.arrive(rid, p)
        for r in spec["requests"] if arriving else ():
            if r["arrive"] == p:
                self.arrive(r["rid"], p)
        for r in spec["requests"]:
            if r.get("abort") == p:
                self.abort(r["rid"])
            if r.get("retract") == p:
                self.retract(r["rid"])
        self.sim.cc.deliver()
        for key, (req, until) in list(self.running.items()):
            if until <= p:
                self.finish(key, req)
        evict = spec.get("evict_device", {}).get(str(p))
        if evict:
            self.sim.tree.evict_device(evict)
        self.operator(p)
        Upstream._process_hicache_events(self.shim, should_retry_storage_prefetch=not self.decode())
        if self.decode():
            self.transfer_queue()
        elif diff_walk.walk(self, p) or self.running:
            self.shim.forward_ct += 1  # the pass ran a forward
        parked = self.stats() - declined
        parked -= sum(1 for lim in self.limits if lim[0] == p and lim[1] == "declined_rate_limited")
        if parked > 0:  # retries declined, buffer_only hits parked for host capacity
            self.limits.append((p, "declined_rate_limited", parked))

    def finish(self, key: tuple, req) -> None:
        """The request finished running: its path is the tree's again (its own KV
        is not inserted: see docs/differential.md)."""
        del self.running[key]
        self.cache.unlock(req.lock)
        req.lock = None
        self.record.add(key, "finished")

    def admitted(self, req, p: int, loaded: int, host: int) -> None:
        """``req`` joined the batch of pass ``p`` with ``loaded`` tokens from L3 and
        ``host`` loaded back from the host; recorded with its cached prefix."""
        key = handle_key(req.cache_request_handle)
        if self.cache.buffer_pipeline is not None:
            self.cache.buffer_pipeline.consume(req.cache_request_handle)
        self.record.add(key, "admitted", loaded, req.prefix_len)
        if host > 0:  # whether a cached page is still host-only moves with timing
            self.record.add(key, "host_loaded", host)
        r = self.requests[req.rid]
        self.running[key] = (req, p + 1 + int(r.get("decode", 2)))
        if r.get("requeue") is not None and self.attempt[req.rid] == 0:
            self.requeue_at.setdefault(p + 1 + r["requeue"], []).append(req.rid)

    def abort(self, rid: str) -> None:
        """An abort of a waiting (prefetching or not), running or queued decode request."""
        from sglang.srt.managers.scheduler import Scheduler as Upstream

        if self.key(rid) in self.running:
            req, _ = self.running.pop(self.key(rid))
            self.cache.unlock(req.lock)
            req.lock, state = None, "running"
        else:
            queue = self.transfer if self.decode() else self.waiting
            req = next((q for q in queue if q.rid == rid), None)
            if req is None:
                return
            queue.remove(req)
            ongoing = req.cache_request_handle in self.cache.ongoing_prefetch
            state = "prefetching" if ongoing else "waiting"
        self.record.add(self.key(rid), "aborted", state)
        if self.decode():
            self.cache.release_aborted_request(req.cache_request_handle)
        else:
            Upstream._release_aborted_request(self.shim, req)

    def retract(self, rid: str) -> None:
        """Decode ran out of memory: the running request goes back to the queue
        (``retract_decode``, then ``_add_request_to_queue(req, is_retracted=True)``)."""
        from sglang.srt.managers.scheduler import Scheduler as Upstream

        if self.key(rid) not in self.running or self.decode():
            return
        req, _ = self.running.pop(self.key(rid))
        self.cache.unlock(req.lock)
        first = (self.index[rid] * 64 + 63) * TOKEN_BASE  # what it decoded so far
        req.output_ids.extend(range(first, first + 2))
        req.reset_for_retract()
        self.record.add(self.key(rid), "retracted")
        self.arrived[rid] = self.sim.cc.clock.now
        Upstream._add_request_to_queue(self.shim, req, is_retracted=True)

    def idle(self) -> bool:
        return not (self.waiting or self.transfer or self.running or self.requeue_at
                    or self.cache.ongoing_prefetch)  # fmt: skip

    def operator(self, p: int) -> None:
        """The operator's flush / detach / attach, due from its pass on, done once
        the scheduler accepts it (SGLang refuses them unless idle; a paused engine
        flushes with requests waiting)."""
        for item in list(self.admin):
            at, what = item
            if at > p:
                continue
            busy = bool(self.running) if what == "paused_flush" else not self.idle()
            if busy:
                continue
            self.admin.remove(item)
            # what a flush of a paused engine drops: the prefetches still ongoing
            dropped = sorted(f"{h.rid}:{h.attempt_id}" for h in self.cache.ongoing_prefetch)
            self.record.add("operator", what, at, *([dropped] if what == "paused_flush" else []))
            if what in ("flush", "paused_flush"):
                self.flush()
            elif what == "detach":
                self.sim.detach_storage()
                self.shim.enable_hicache_storage = False
            elif what == "attach":
                self.sim.attach_storage()
                self.shim.enable_hicache_storage = True

    def flush(self) -> None:
        """``flush_cache``: upstream's ``reset()`` (the tree, the controller, the
        host pool, the prefetch state, a fresh retry set: recorded again)."""
        self.cache.reset()
        self.cache.storage_prefetch_retries = RecordingRetries(self.record)

    def transfer_queue(self) -> None:
        cache = self.cache
        for req in list(self.transfer):
            h = req.cache_request_handle
            if not cache.check_prefetch_progress(h):
                continue
            loaded = cache.pop_prefetch_loaded_tokens(h)
            self.record.add(handle_key(h), "loaded_back", loaded)
            self.transfer.remove(req)
