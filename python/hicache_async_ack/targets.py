"""Every upstream function any sync wraps or relies on: the one list the version guard
fingerprints and ``upstream_fingerprints.json`` records per tested release, each naming
the syncs relying on it (docs/versions.md). No SGLang import here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fingerprint import BODY, SIGNATURE
from .names import ACK, OFFLOAD, SYNC_NAMES, VOTES

CACHE_MODULE = "sglang.srt.mem_cache.unified_radix_cache"
CACHE_CLASS = f"{CACHE_MODULE}.UnifiedRadixCache"
MANAGER_MODULE = "sglang.srt.disaggregation.decode_kvcache_offload_manager"
ADDER_MODULE = "sglang.srt.managers.schedule_policy"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
MANAGER_CLASS = f"{MANAGER_MODULE}.DecodeKVCacheOffloadManager"


@dataclass(frozen=True)
class Target:
    """One upstream function: where it is, the parameters the plugin passes (None: never
    calls it), what the fingerprint covers (BODY or SIGNATURE), the syncs relying on it."""

    module: str
    qualname: str
    params: Optional[tuple[str, ...]]
    scope: str
    features: tuple[str, ...] = (ACK,)

    @property
    def label(self) -> str:
        return self.qualname.removeprefix("UnifiedRadixCache.")


_URC, _M, _V, _OP = CACHE_MODULE, MANAGER_MODULE, (VOTES,), ("self", "operation")
_DRAIN = ("self", "n_storage_hit", "n_ack_prefetch", "n_backup", "n_release",
          "extra_release_counts", "log_metrics")  # fmt: skip
_START = ("self", "request", "last_host_node_id", "new_input_tokens", "last_hash", "prefix_keys",
          "matched_prefix_tokens", "extra_key", "cache_salt", "storage_hit_end")  # fmt: skip
TARGETS: tuple[Target, ...] = (
    Target(_URC, "UnifiedRadixCache.check_hicache_events", ("self",), BODY, (ACK, VOTES)),
    Target(_URC, "UnifiedRadixCache._sync_hicache_ready_counts", ("self",), BODY, (ACK, VOTES)),
    Target(_URC, "UnifiedRadixCache.init_hicache", ("self", "server_args", "params"), SIGNATURE,
           (ACK, VOTES)),
    Target(_URC, "UnifiedRadixCache.writing_check", ("self", "write_back", "finish_count"), BODY),
    Target(_URC, "UnifiedRadixCache.loading_check", ("self", "finish_count"), BODY),
    Target(_URC, "UnifiedRadixCache._count_ready_acks", ("self", "ack_queue"), BODY),
    Target(_URC, "UnifiedRadixCache._drain_storage_control_queues_impl", _DRAIN, BODY),
    Target(_URC, "UnifiedRadixCache._all_reduce", None, BODY, (ACK, VOTES)),
    Target(_URC, "UnifiedRadixCache._all_reduce_attn_groups", None, BODY),
    Target(_URC, "UnifiedRadixCache._can_terminate_prefetch", _OP, BODY, _V),
    Target(_URC, "UnifiedRadixCache.check_prefetch_progress", ("self", "request"), BODY, _V),
    Target(_URC, "UnifiedRadixCache._prefetch_deadline_expired", _OP, BODY, _V),
    Target(_URC, "UnifiedRadixCache.finish_storage_prefetch_admission",
           ("self", "request", "fulfilled_tokens", "reason"), BODY, _V),
    Target(_URC, "UnifiedRadixCache._start_storage_prefetch_wait", _OP, BODY, _V),
    Target(_URC, "UnifiedRadixCache.release_aborted_request", ("self", "request"), BODY, _V),
    Target(_URC, "UnifiedRadixCache.prefetch_from_storage", _START, BODY, _V),
    Target(_URC, "UnifiedRadixCache._handle_prefetch_result", _OP, BODY, _V),
    Target(_URC, "UnifiedRadixCache.reset", ("self",), SIGNATURE, _V),
    Target(_URC, "UnifiedRadixCache.inc_host_lock_ref", ("self", "node_id"), SIGNATURE, _V),
    Target(_URC, "UnifiedRadixCache.dec_host_lock_ref", ("self", "node_id", "params"), SIGNATURE,
           _V),
    Target(ADDER_MODULE, "PrefillAdder._account_prefill_cache_admission",
           ("self", "req", "prefix_len"), BODY, _V),
    Target(ADDER_MODULE, "PrefillAdder.add_chunked_req", ("self", "req"), BODY, _V),
    Target(SCHEDULER_MODULE, "Scheduler._process_hicache_events", None, BODY, _V),
    Target(SCHEDULER_MODULE, "Scheduler._prefetch_kvcache", ("self", "req", "storage_hit_end"),
           BODY, _V),
    Target("sglang.srt.plugins.hook_registry", "_wrap_fn", None, BODY, SYNC_NAMES),
    Target(_M, "DecodeKVCacheOffloadManager.check_offload_progress", ("self",), BODY, (OFFLOAD,)),
    Target(_M, "DecodeKVCacheOffloadManager._check_offload_progress", ("self", "finish_count"),
           BODY, (OFFLOAD,)),
    Target(_M, "DecodeKVCacheOffloadManager._check_backup_progress", ("self", "finish_count"),
           BODY, (OFFLOAD,)),
    Target(_M, "DecodeKVCacheOffloadManager.drain_before_retraction", None, BODY, (OFFLOAD,)),
)  # fmt: skip
