"""A minimal SGLang ``Scheduler`` (``object.__new__``, as SGLang's own unit tests
build one) carrying what its storage-prefetch methods read, so the differential
runs upstream's code where the scheduler runs it: ``_add_request_to_queue``
(``_prefetch_kvcache``: the match on the device and host trees, the prefetch of
the remainder anchored on the matched host node), ``_process_hicache_events``
(the boundary, then ``_process_storage_prefetch_retries`` /
``_retry_storage_prefetch``), ``_prefetch_after_device_hit_loss``, the queue
order (``SchedulePolicy.calc_priority``) and admissions (a real ``PrefillAdder``).

Test support. What stands in, and why:

* the server's configuration: a dummy ``ServerArgs`` published through SGLang's
  own ``override_server_args`` (the retry pacing, the host memory mode, the
  schedule policy; ``get_memory()`` and friends read it);
* the device KV allocator (:class:`KVAllocator`): a pool that never runs out
  (admission is limited by the prefill token budget and the running requests
  allowed, which the scenario draws); it hands the adder SGLang's own
  ``PrefillBudget``;
* the running batch: the list of running ``Req`` objects (the adder reads its
  requests' sampling parameters); ``ScheduleBatch`` would need device tensors,
  so priority preemption, which releases through it, is not run.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any, Optional

UNLIMITED = 1 << 40
MAX_NEW_TOKENS = 4


class KVAllocator:
    """What ``PrefillAdder`` reads of the device KV allocator (no memory limit)."""

    def __init__(self, page_size: int):
        self.page_size = page_size

    def available_size(self) -> int:
        return UNLIMITED

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens: int = 0):
        from sglang.srt.mem_cache.prefill_budget import PrefillBudget

        return PrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        return 0


class ServerConfig:
    """SGLang's published configuration for one scenario (``get_memory()`` etc.)."""

    def __init__(self, **fields: Any):
        from sglang.srt.runtime_context import get_context

        self.override = get_context().override_server_args(**fields)

    def __enter__(self) -> "ServerConfig":
        self.override.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.override.restore()


def server_config(spec: dict) -> ServerConfig:
    retry = spec.get("retry") or {"interval": 0, "attempts": 0}
    return ServerConfig(
        hicache_storage_prefetch_retry_poll_interval=retry["interval"],
        hicache_storage_prefetch_retry_max_attempts=retry["attempts"],
        hicache_host_memory_mode=spec.get("host_memory_mode", "cache"),
        schedule_policy=queue_policy(spec),
    )


def queue_policy(spec: dict) -> str:
    order = spec.get("order", "fcfs")
    return "fcfs" if order == "priority" else order


def new_scheduler(cache, spec: dict, page_size: int):
    """A ``Scheduler`` with what its prefetch, retry, queue and policy paths read."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.managers.scheduler import Scheduler

    priority = spec.get("order") == "priority"
    shim = object.__new__(Scheduler)
    off = ("enable_lmcache", "enable_unified_cache_external_linker",
           "schedule_low_priority_values_first", "abort_on_priority_when_disabled")  # fmt: skip
    shim.__dict__.update(dict.fromkeys(off, False))
    shim.__dict__.update({
        "tree_cache": cache, "enable_hierarchical_cache": True, "enable_hicache_storage": True,
        "disaggregation_mode": DisaggregationMode.NULL, "waiting_queue": [],
        "max_queued_requests": None, "enable_priority_scheduling": priority,
        "processed_tokens_counter": 0, "page_size": page_size, "forward_ct": 0,
        "token_to_kv_pool_allocator": KVAllocator(page_size),
        "policy": SchedulePolicy(queue_policy(spec), cache, True, priority, False),
    })  # fmt: skip
    return shim


def new_req(rid: str, tokens: list[int], priority: Optional[int] = None):
    """SGLang's own ``Req`` for a prompt (it builds on CPU)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    params.normalize(None)
    return Req(rid, "", array("q", tokens), params, priority=priority)


def new_adder(shim, running: list, max_prefill_tokens: Optional[int]):
    """The prefill adder of one walk, as ``_get_new_batch_prefill_raw`` builds it
    (no chunking: a request is admitted whole or not at all)."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return PrefillAdder(
        shim.page_size,
        shim.tree_cache,
        shim.token_to_kv_pool_allocator,
        SimpleNamespace(reqs=running),
        1.0,
        UNLIMITED if max_prefill_tokens is None else max_prefill_tokens,
        None,
    )
