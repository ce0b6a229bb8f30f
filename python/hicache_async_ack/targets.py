"""The one annotated index of upstream: every SGLang function any sync wraps or relies
on, each with its role, why the plugin needs it, the upstream PR where known and when it
can go. The version guard fingerprints exactly these, ``upstream_fingerprints.json``
records them per tested release, and docs/versions.md's table is generated from them
(``python -m hicache_async_ack_lab.releases index``; a test compares). No SGLang import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .fingerprint import BODY, SIGNATURE
from .names import ACK, OFFLOAD, SYNC_NAMES, VOTES

CACHE_MODULE = "sglang.srt.mem_cache.unified_radix_cache"
CACHE_CLASS = f"{CACHE_MODULE}.UnifiedRadixCache"
MANAGER_MODULE = "sglang.srt.disaggregation.decode_kvcache_offload_manager"
ADDER_MODULE = "sglang.srt.managers.schedule_policy"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
TREE_MODULE = "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface"
MANAGER_CLASS = f"{MANAGER_MODULE}.DecodeKVCacheOffloadManager"

# hooked: a hook of ours wraps it; called: the plugin calls it; shadowed: replaced on an
# instance for the length of a call; read: its behaviour or shape is relied on, uncalled.
Role = Literal["hooked", "called", "shadowed", "read"]
PR_39903 = "#39903"  # pipeline the HiCache ack-count all_reduce (the seed)
PR_33029 = "#33029"  # prefetch progress once per pass
UNTIL_ACK = "when SGLang pipelines the ack-count reduce itself (#39903)"
UNTIL_VOTES = "when SGLang decides prefetch deadlines without a collective per request"
UNTIL_OFFLOAD = "when SGLang pipelines the decode offload reduce"


@dataclass(frozen=True)
class Target:
    """One upstream function: where it is, the parameters the plugin passes (None: never
    calls it), what the fingerprint covers (BODY or SIGNATURE), the syncs relying on it,
    its role(s), why, the upstream PR (""; unknown) and when it can go."""

    module: str
    qualname: str
    params: Optional[tuple[str, ...]]
    scope: str
    features: tuple[str, ...]
    roles: tuple[Role, ...]
    why: str
    pr: str = ""
    removal: str = UNTIL_ACK

    @property
    def label(self) -> str:
        return self.qualname.removeprefix("UnifiedRadixCache.")


_URC, _M, _V, _AV, _OP = CACHE_MODULE, MANAGER_MODULE, (VOTES,), (ACK, VOTES), ("self", "operation")
_DRAIN = ("self", "n_storage_hit", "n_ack_prefetch", "n_backup", "n_release",
          "extra_release_counts", "log_metrics")  # fmt: skip
_START = ("self", "request", "last_host_node_id", "new_input_tokens", "last_hash", "prefix_keys",
          "matched_prefix_tokens", "extra_key", "cache_salt", "storage_hit_end")  # fmt: skip
_VOTE = dict(pr=PR_33029, removal=UNTIL_VOTES)
_OFF = dict(removal=UNTIL_OFFLOAD)
TARGETS: tuple[Target, ...] = (
    Target(_URC, "UnifiedRadixCache.check_hicache_events", ("self",), BODY, _AV, ("hooked",),
           "the step whose blocking reduce sits before the next forward; the votes' pass "
           "boundary", PR_39903),
    Target(_URC, "UnifiedRadixCache._sync_hicache_ready_counts", ("self",), BODY, _AV,
           ("hooked",), "where upstream takes its counts: answered from the consumed "
           "agreement; with upstream's carrier the votes' section rides its reduce", PR_39903),
    Target(_URC, "UnifiedRadixCache.init_hicache", ("self", "server_args", "params"),
           SIGNATURE, _AV, ("hooked",), "builds each cache's state once the controller and "
           "groups exist", PR_39903),
    Target(_URC, "UnifiedRadixCache.writing_check", ("self", "write_back", "finish_count"),
           BODY, (ACK,), ("called",), "pops the agreed write acks", PR_39903),
    Target(_URC, "UnifiedRadixCache.loading_check", ("self", "finish_count"), BODY, (ACK,),
           ("called",), "pops the agreed load acks", PR_39903),
    Target(_URC, "UnifiedRadixCache._count_ready_acks", ("self", "ack_queue"), BODY, (ACK,),
           ("called",), "counts what is ready, as upstream does", PR_39903),
    Target(_URC, "UnifiedRadixCache._drain_storage_control_queues_impl", _DRAIN, BODY, (ACK,),
           ("called",), "pops the agreed storage control entries", PR_39903),
    Target(_URC, "UnifiedRadixCache._all_reduce", None, BODY, _AV, ("called", "shadowed"),
           "the first exchanges run over upstream's groups; shadowed for the votes' section "
           "on upstream's reduce", PR_39903),
    Target(_URC, "UnifiedRadixCache._all_reduce_attn_groups", None, BODY, (ACK,), ("read",),
           "its groups (CP, then attn TP) decide the one group a pipelined reduce stands for",
           PR_39903),
    Target(_URC, "UnifiedRadixCache._can_terminate_prefetch", _OP, BODY, _V, ("hooked",),
           "stock's blocking MAX per request the walk reaches", **_VOTE),
    Target(_URC, "UnifiedRadixCache.check_prefetch_progress", ("self", "request"), BODY, _V,
           ("hooked", "called"), "lands a stop through upstream's code; holds a held "
           "start's request; sees a read land", **_VOTE),
    Target(_URC, "UnifiedRadixCache._prefetch_deadline_expired", _OP, BODY, _V,
           ("called",), "this rank's vote, and the KV-landed exemption judged on the group's "
           "verdict", **_VOTE),
    Target(_URC, "UnifiedRadixCache.finish_storage_prefetch_admission",
           ("self", "request", "fulfilled_tokens", "reason"), BODY, _V, ("hooked",),
           "an admission releases a stop's pin and a request's read-once wait", **_VOTE),
    Target(_URC, "UnifiedRadixCache._start_storage_prefetch_wait", _OP, BODY, _V, ("read",),
           "the deadline starts at the first blocked poll, the same under the votes", **_VOTE),
    Target(_URC, "UnifiedRadixCache.release_aborted_request", ("self", "request"), BODY, _V,
           ("hooked",), "an abort runs at once: drops a pin, a held start, ends waits on its "
           "read", **_VOTE),
    Target(_URC, "UnifiedRadixCache.prefetch_from_storage", _START, BODY, _V, ("hooked",),
           "a start a read in flight from its anchor covers is held (issue 52)", **_VOTE),
    Target(_URC, "UnifiedRadixCache._handle_prefetch_result", _OP, BODY, _V, ("read",),
           "a landing inserts at the read's anchor; _OngoingPrefetch leads with the anchor "
           "and key", **_VOTE),
    Target(_URC, "UnifiedRadixCache.reset", ("self",), SIGNATURE, _V, ("hooked",),
           "flush_cache: pins and held starts are forgotten", **_VOTE),
    Target(_URC, "UnifiedRadixCache.inc_host_lock_ref", ("self", "node_id"), SIGNATURE, _V,
           ("called",), "pins the pages a stop inserted, for one pass", **_VOTE),
    Target(_URC, "UnifiedRadixCache.dec_host_lock_ref", ("self", "node_id", "params"),
           SIGNATURE, _V, ("called",), "releases that pin", **_VOTE),
    Target(TREE_MODULE, "UnifiedTreeCoreInterface.insert_host",
           ("self", "node_id", "key", "host_value", "hash_value"), SIGNATURE, _V,
           ("shadowed",), "watched for the length of a stop, for the node it inserts",
           **_VOTE),
    Target(ADDER_MODULE, "PrefillAdder._account_prefill_cache_admission",
           ("self", "req", "prefix_len"), BODY, _V, ("hooked",), "every admission, for the "
           "admission check (SGLang #30760)", **_VOTE),
    Target(ADDER_MODULE, "PrefillAdder.add_chunked_req", ("self", "req"), BODY, _V,
           ("hooked",), "a chunk's admission, for the same check", **_VOTE),
    Target(SCHEDULER_MODULE, "Scheduler._process_hicache_events", None, BODY, _V, ("hooked",),
           "the pass's number as the scheduler counts its forwards, for messages", **_VOTE),
    Target(SCHEDULER_MODULE, "Scheduler._prefetch_kvcache", ("self", "req", "storage_hit_end"),
           BODY, _V, ("hooked", "called"), "a held start runs it again as a whole: match, "
           "then read the rest", **_VOTE),
    Target("sglang.srt.plugins.hook_registry", "_wrap_fn", None, BODY, SYNC_NAMES, ("read",),
           "how HookRegistry calls and nests hooks", removal="never: every hook needs it"),
    Target(_M, "DecodeKVCacheOffloadManager.check_offload_progress", ("self",), BODY,
           (OFFLOAD,), ("hooked",), "its blocking MIN of two queue sizes every decode step",
           **_OFF),
    Target(_M, "DecodeKVCacheOffloadManager._check_offload_progress", ("self", "finish_count"),
           BODY, (OFFLOAD,), ("called",), "pops the agreed offload acks", **_OFF),
    Target(_M, "DecodeKVCacheOffloadManager._check_backup_progress", ("self", "finish_count"),
           BODY, (OFFLOAD,), ("called",), "pops the agreed backups", **_OFF),
    Target(_M, "DecodeKVCacheOffloadManager.drain_before_retraction", None, BODY, (OFFLOAD,),
           ("hooked",), "a retraction runs upstream's blocking path", **_OFF),
)  # fmt: skip
