"""The scheduler's side of a differential scenario on one rank
(:mod:`.differential`): arrivals, aborts, finished requests, the boundary and
the storage retries, then the waiting-queue walk (prefill) or the transfer
queue (PD decode), as SGLang 0.5.23's scheduler runs them, and what limited
the walk."""

from __future__ import annotations

from hicache_async_ack_lab.sim.admission import SchedulerShim, adder_for, admit
from hicache_async_ack_lab.sim.lifecycle import Record, handle_key

TOKEN_BASE = 1_000_000  # request i attempt a prompts tokens from (i * 64 + a) * TOKEN_BASE
FAMILY_BASE = 900_000_000  # a family's shared prefix tokens from (f + 1) * FAMILY_BASE


class Req:
    """What the scheduler keeps per waiting request (the retries read rid and
    storage_prefetch_retry_attempts)."""

    def __init__(self, rid: str, tokens: list[int], arrived: int):
        self.rid = rid
        self.tokens = tokens
        self.arrived = arrived
        self.storage_prefetch_retry_attempts = 0
        self.loaded = 0  # storage tokens popped for it (kept across a refused admission)
        self.start = None


class Scheduler:
    """The scheduler's side of the scenario on one rank."""

    def __init__(self, spec: dict, rank: int, sim, record: Record):
        self.spec, self.rank, self.sim, self.record = spec, rank, sim, record
        self.cache = sim.cache
        self.requests = {r["rid"]: r for r in spec["requests"]}
        self.index = {r["rid"]: i for i, r in enumerate(spec["requests"])}
        self.limits_spec = spec.get("limits", {})
        self.attempt: dict = {}
        self.waiting: list[Req] = []  # arrival order
        self.transfer: list[Req] = []  # PD decode: the transfer queue
        self.running: dict = {}  # rid -> the pass it finishes
        self.requeue_at: dict = {}  # pass -> [rid]
        self.limits: list = []  # (pass, kind, key): what limited the walk
        self.adder = adder_for(self.cache)
        self.scheduler = SchedulerShim(self.cache)

    def handle(self, rid):
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        return CacheRequestHandle(rid=rid, attempt_id=self.attempt[rid])

    def key(self, rid) -> tuple:
        return (rid, self.attempt[rid])

    def tokens_of(self, rid: str) -> list[int]:
        r = self.requests[rid]
        first = (self.index[rid] * 64 + self.attempt[rid]) * TOKEN_BASE
        family = r.get("family")
        shared = []
        if family is not None:
            base = (family[0] + 1) * FAMILY_BASE
            shared = list(range(base, base + min(family[1], r["tokens"])))
        return shared + list(range(first, first + r["tokens"] - len(shared)))

    def prefetch(self, req: Req, storage_hit_end=None) -> None:
        """``Scheduler._prefetch_kvcache``: the whole prompt from the root."""
        stats = self.cache._prefetch_outcome_stats
        declined = stats["declined_rate_limited"]
        self.cache.prefetch_from_storage(
            self.handle(req.rid), 0, req.tokens, None, None, matched_prefix_tokens=[],
            extra_key=None, cache_salt=None, storage_hit_end=storage_hit_end,
        )  # fmt: skip
        if stats["declined_rate_limited"] != declined:
            self.limits.append((self.sim.cc.clock.now, "declined_rate_limited", self.key(req.rid)))

    def arrive(self, rid: str, p: int) -> None:
        self.attempt[rid] = self.attempt.get(rid, -1) + 1
        req = Req(rid, self.tokens_of(rid), p)
        self.record.add(self.key(rid), "arrived")
        if self.spec.get("mode") == "decode":
            return self.prealloc(req, p)
        self.prefetch(req)
        self.waiting.append(req)

    def prealloc(self, req: Req, p: int) -> None:
        """A PD decode node's prealloc: probe L3, then prefetch the hit (its end known)."""
        cache, cc = self.cache, self.sim.cc
        limited = cc.prefetch_rate_limited()
        cc.probing = req.rid
        hit = cache.query_storage_hit_length(0, req.tokens)
        self.record.add(self.key(req.rid), "probe", hit)
        if limited:
            self.limits.append((p, "probe_rate_limited", self.key(req.rid)))
        if hit > 0:
            self.prefetch(req, storage_hit_end=hit)
        self.transfer.append(req)

    def step(self, p: int, arriving: bool) -> None:
        cache, spec = self.cache, self.spec
        declined = cache._prefetch_outcome_stats["declined_rate_limited"]
        for rid in self.requeue_at.pop(p, []):
            self.arrive(rid, p)
        for r in spec["requests"] if arriving else ():
            if r["arrive"] == p:
                self.arrive(r["rid"], p)
        for r in spec["requests"]:
            if r.get("abort") == p:
                self.abort(r["rid"], p)
        self.sim.cc.deliver()
        for rid, until in list(self.running.items()):
            if until <= p:
                del self.running[rid]
                self.sim.tree.finished(self.key(rid))
        self.scheduler.boundary()
        self.retries(p)
        if spec.get("mode") == "decode":
            self.transfer_queue(p)
        else:
            admitted = self.walk(p)
            if admitted or self.running:
                self.scheduler.forward_ct += 1  # the pass ran a forward
        parked = cache._prefetch_outcome_stats["declined_rate_limited"] - declined
        parked -= sum(1 for lim in self.limits if lim[0] == p and lim[1] == "declined_rate_limited")
        if parked > 0:  # buffer_only: hits parked for host capacity in the drain
            self.limits.append((p, "declined_rate_limited", parked))

    def abort(self, rid: str, p: int) -> None:
        queue = self.transfer if self.spec.get("mode") == "decode" else self.waiting
        req = next((q for q in queue if q.rid == rid), None)
        if req is None:
            return
        self.record.add(self.key(rid), "aborted")
        self.cache.release_aborted_request(self.handle(rid))
        queue.remove(req)

    def retries(self, p: int) -> None:
        """``Scheduler._process_storage_prefetch_retries`` after the boundary."""
        retry = self.spec.get("retry")
        if retry is None or self.spec.get("mode") == "decode":
            return
        ready = self.cache.storage_prefetch_retries.pop_ready(
            self.waiting, retry["interval"], retry["attempts"]
        )
        for req, storage_hit_end in ready:
            req.storage_prefetch_retry_attempts += 1
            self.record.add(self.key(req.rid), "reissued")
            self.prefetch(req, storage_hit_end)

    def walk(self, p: int) -> list:
        cache, lim = self.cache, self.limits_spec
        if p in lim.get("full", ()):
            return []
        cutoff = lim.get("cutoff", {}).get(str(p))
        budget = lim.get("tokens")
        rem = budget if budget is not None else None
        allocatable = None if lim.get("running") is None else lim["running"] - len(self.running)
        admitted: list = []
        for req in list(self.waiting):
            if cutoff is not None and req.arrived >= cutoff:
                break  # the batch is full from here on (by arrival)
            if rem is not None and rem <= 0:
                self.limits.append((p, "token_budget", self.key(req.rid)))
                break
            if allocatable is not None and len(admitted) >= allocatable:
                self.limits.append((p, "batch_full", self.key(req.rid)))
                break
            h = self.handle(req.rid)
            if not cache.check_prefetch_progress(h):
                continue
            loaded, start = cache.pop_prefetch_loaded_span(h)
            if loaded:
                req.loaded, req.start = loaded, start
            extend = len(req.tokens) - req.loaded
            if rem is not None and extend > rem and admitted:
                # add_one_req: NO_TOKEN (the first of a batch is chunked instead)
                self.limits.append((p, "refused", self.key(req.rid)))
                break
            self.record.admitting = True  # its accounting's exit is the admission's
            try:
                admit(self.adder, h, req.loaded, len(req.tokens), req.start)
            finally:
                self.record.admitting = False
            key = handle_key(h)
            self.sim.tree.admit(key)
            if cache.buffer_pipeline is not None:
                cache.buffer_pipeline.consume(h)
            self.record.add(key, "admitted", req.loaded)
            if rem is not None:
                rem -= extend
            self.waiting.remove(req)
            admitted.append(req.rid)
            cache.storage_prefetch_retries.cancel(req.rid)
            r = self.requests[req.rid]
            if lim.get("running") is not None:  # it holds its pages until it finishes
                self.running[req.rid] = p + 1 + int(r.get("decode", 2))
            if r.get("requeue") is not None and self.attempt[req.rid] == 0:
                self.requeue_at.setdefault(p + 1 + r["requeue"], []).append(req.rid)
        return admitted

    def transfer_queue(self, p: int) -> None:
        cache = self.cache
        for req in list(self.transfer):
            h = self.handle(req.rid)
            if not cache.check_prefetch_progress(h):
                continue
            loaded = cache.pop_prefetch_loaded_tokens(h)
            self.record.add(self.key(req.rid), "loaded_back", loaded)
            self.transfer.remove(req)

    def idle(self) -> bool:
        return not (self.waiting or self.transfer or self.running or self.requeue_at
                    or self.cache.ongoing_prefetch)  # fmt: skip
