"""A request's admission to the batch as SGLang 0.5.23's prefill adder
accounts it: through the real ``PrefillAdder._account_prefill_cache_admission``
(which calls the cache's ``finish_storage_prefetch_admission``), with the Req
fields it reads. Test support (the walk scenarios and the differential runs)."""

from __future__ import annotations

from types import SimpleNamespace


class AdmittedReq:
    """What the admission accounting reads of a Req (upstream's own methods)."""

    def __init__(self, handle, loaded: int, start, prompt: int):
        from sglang.srt.managers.schedule_batch import Req

        self.cache_request_handle = handle
        self.rid = handle.rid
        self.retracted_stain = False
        self.host_hit_length = self.host_loaded_length = self.storage_hit_length = loaded
        self.swa_host_hit_length = self.mamba_host_hit_length = 0
        self.auxiliary_swa_host_hit_length = 0
        self.storage_hit_start = start
        self.host_hit_is_storage = False
        self.extend_end = prompt
        self.prefix_len = loaded
        for name in ("materialized_host_hit_len", "fulfilled_storage_hit_len"):
            setattr(self, name, getattr(Req, name).__get__(self))
        self.needs_host_load_back = Req.needs_host_load_back.__get__(self)


def adder_for(cache):
    """The prefill adder's fields the accounting touches."""
    return SimpleNamespace(
        tree_cache=cache, log_device_hit_tokens=0, log_host_hit_tokens=0, log_storage_hit_tokens=0
    )


def admit(adder, handle, prefix_len: int = 0, prompt: int = 0, start=None) -> None:
    """Account ``handle``'s request as admitted with ``prefix_len`` cached tokens
    (``prompt`` tokens in all: the rest is its extend)."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    req = AdmittedReq(handle, prefix_len, start, max(prompt, prefix_len))
    PrefillAdder._account_prefill_cache_admission(adder, req, prefix_len)


class SchedulerShim:
    """What ``Scheduler._process_hicache_events`` reads of the scheduler (storage
    retries are not run): the pass boundary goes through SGLang's own method,
    and ``forward_ct`` counts the forwards run, as the scheduler's does."""

    def __init__(self, cache):
        self.tree_cache = cache
        self.enable_hierarchical_cache = True
        self.enable_hicache_storage = False
        self.forward_ct = 0

    def boundary(self) -> None:
        from sglang.srt.managers.scheduler import Scheduler

        Scheduler._process_hicache_events(self)
