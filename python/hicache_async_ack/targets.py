"""Every upstream function any feature wraps or relies on: the one list the
version guard (:mod:`hicache_async_ack.guard`) fingerprints and the one table
(``upstream_fingerprints.json``) records per tested release. Each target names
the features that rely on it; a feature runs where all of its targets match.
No SGLang import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fingerprint import BODY, SIGNATURE
from .names import ACK, OFFLOAD, SYNCS, VOTES

CACHE_MODULE = "sglang.srt.mem_cache.unified_radix_cache"
CACHE_CLASS = f"{CACHE_MODULE}.UnifiedRadixCache"
MANAGER_MODULE = "sglang.srt.disaggregation.decode_kvcache_offload_manager"
ADDER_MODULE = "sglang.srt.managers.schedule_policy"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
MANAGER_CLASS = f"{MANAGER_MODULE}.DecodeKVCacheOffloadManager"

ALL = SYNCS


@dataclass(frozen=True)
class Target:
    """One upstream function the plugin wraps or relies on."""

    module: str
    qualname: str
    # the parameter names the plugin passes (None: it never calls it)
    params: Optional[tuple[str, ...]]
    scope: str  # BODY or SIGNATURE
    why: str
    features: tuple[str, ...] = (ACK,)  # the features that wrap or rely on it

    @property
    def label(self) -> str:
        return self.qualname.removeprefix("UnifiedRadixCache.")


_URC = CACHE_MODULE
TARGETS: tuple[Target, ...] = (
    Target(
        _URC,
        "UnifiedRadixCache.check_hicache_events",
        ("self",),
        BODY,
        "hooked AROUND: the pipelined step runs it with the agreed counts; AFTER: the "
        "votes' pass boundary",
        (ACK, VOTES),
    ),
    Target(
        _URC,
        "UnifiedRadixCache._sync_hicache_ready_counts",
        ("self",),
        BODY,
        "hooked AROUND: the ack sync answers it (the tuple it returns, what it counts); "
        "on upstream's path the votes' section rides its one MIN reduce",
        (ACK, VOTES),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.init_hicache",
        ("self", "server_args", "params"),
        SIGNATURE,
        "hooked AFTER: only when it runs and its arguments (what it builds is checked "
        "per cache at run time)",
        (ACK, VOTES),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.writing_check",
        ("self", "write_back", "finish_count"),
        BODY,
        "pops the agreed number of write acks",
    ),
    Target(
        _URC,
        "UnifiedRadixCache.loading_check",
        ("self", "finish_count"),
        BODY,
        "pops the agreed number of load acks",
    ),
    Target(
        _URC,
        "UnifiedRadixCache._count_ready_acks",
        ("self", "ack_queue"),
        BODY,
        "counts the ready head of an ack queue; the plugin reduces that count",
    ),
    Target(
        _URC,
        "UnifiedRadixCache._drain_storage_control_queues_impl",
        (
            "self",
            "n_storage_hit",
            "n_ack_prefetch",
            "n_backup",
            "n_release",
            "extra_release_counts",
            "log_metrics",
        ),
        BODY,
        "pops the agreed number of storage control entries",
    ),
    Target(
        _URC,
        "UnifiedRadixCache._all_reduce",
        None,
        BODY,
        "the reduce the plugin replaces (pp_size 1: the attention groups only); the "
        "first exchanges and the votes' ride go through it",
        (ACK, VOTES),
    ),
    Target(
        _URC,
        "UnifiedRadixCache._all_reduce_attn_groups",
        None,
        BODY,
        "the groups upstream reduces over; the plugin picks the same",
    ),
    Target(
        _URC,
        "UnifiedRadixCache._can_terminate_prefetch",
        ("self", "operation"),
        BODY,
        "hooked AROUND: the prefetch votes answer it (one blocking MAX per request upstream)",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.check_prefetch_progress",
        ("self", "request"),
        BODY,
        "asks _can_terminate_prefetch once per ongoing operation and acts on the verdict; "
        "the votes call it at the pass boundary",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache._prefetch_deadline_expired",
        ("self", "operation"),
        BODY,
        "the deadline predicate each rank votes with (PP0's view, as upstream reduces it)",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.finish_storage_prefetch_admission",
        ("self", "request", "fulfilled_tokens", "reason"),
        BODY,
        "hooked AFTER: the scheduler calls it for every request it admits, in order "
        "(the votes' admission check)",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache._start_storage_prefetch_wait",
        ("self", "operation"),
        BODY,
        "starts the deadline at the first check that finds the prefetch unfinished "
        "(after the votes' _can_terminate_prefetch answered no)",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.release_aborted_request",
        ("self", "request"),
        BODY,
        "hooked BEFORE: an abort drops the pin a stop took (upstream releases the rest at once)",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache._handle_prefetch_result",
        ("self", "operation"),
        BODY,
        "what a stop keeps: inserts the agreed completed tokens through "
        "tree_core.insert_host (the node the votes pin until admission)",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.reset",
        ("self",),
        SIGNATURE,
        "hooked AFTER: the tree is gone, and the pins with it",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.inc_host_lock_ref",
        ("self", "node_id"),
        SIGNATURE,
        "pins the pages a stop inserted",
        (VOTES,),
    ),
    Target(
        _URC,
        "UnifiedRadixCache.dec_host_lock_ref",
        ("self", "node_id", "params"),
        SIGNATURE,
        "releases that pin",
        (VOTES,),
    ),
    Target(
        ADDER_MODULE,
        "PrefillAdder._account_prefill_cache_admission",
        ("self", "req", "prefix_len"),
        BODY,
        "hooked AFTER: the adder calls it for every request it admits, in order, with "
        "its prefix length (the admission check)",
        (VOTES,),
    ),
    Target(
        ADDER_MODULE,
        "PrefillAdder.add_chunked_req",
        ("self", "req"),
        BODY,
        "hooked AFTER: a chunked request's next chunk joins the batch here",
        (VOTES,),
    ),
    Target(
        SCHEDULER_MODULE,
        "Scheduler._process_hicache_events",
        None,
        BODY,
        "hooked BEFORE: the pass boundary, where the scheduler's forward count is read "
        "for the messages",
        (VOTES,),
    ),
    Target(
        "sglang.srt.plugins.hook_registry",
        "_wrap_fn",
        None,
        BODY,
        "how SGLang's HookRegistry calls AROUND and AFTER hooks",
        ALL,
    ),
    Target(
        MANAGER_MODULE,
        "DecodeKVCacheOffloadManager.check_offload_progress",
        ("self",),
        BODY,
        "hooked AROUND: the pipelined offload step replaces its blocking MIN",
        (OFFLOAD,),
    ),
    Target(
        MANAGER_MODULE,
        "DecodeKVCacheOffloadManager._check_offload_progress",
        ("self", "finish_count"),
        BODY,
        "pops the agreed number of offload acks",
        (OFFLOAD,),
    ),
    Target(
        MANAGER_MODULE,
        "DecodeKVCacheOffloadManager._check_backup_progress",
        ("self", "finish_count"),
        BODY,
        "pops the agreed number of storage backups",
        (OFFLOAD,),
    ),
    Target(
        MANAGER_MODULE,
        "DecodeKVCacheOffloadManager.drain_before_retraction",
        None,
        BODY,
        "hooked AROUND: upstream's blocking check inside it",
        (OFFLOAD,),
    ),
)
