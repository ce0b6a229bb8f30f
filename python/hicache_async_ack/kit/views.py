"""The slices of SGLang the syncs read, as Protocols: what a hook hands a state is typed
here, not ``Any``, so mypy checks every read against what the plugin relies on (the
guard checks the same methods at run time: targets.py). SGLang's own classes are not
followed by mypy; their objects meet these shapes structurally. Also the metrics a state
is handed (:class:`SyncMetrics`)."""

from __future__ import annotations

from typing import Hashable, Mapping, MutableMapping, Optional, Protocol, Sequence


class RequestHandle(Protocol):
    """``CacheRequestHandle``: a request attempt, the key of every prefetch map."""

    @property
    def rid(self) -> str: ...

    @property
    def attempt_id(self) -> int: ...

    def __hash__(self) -> int: ...


class Operation(Protocol):
    """``PrefetchOperation``."""

    @property
    def handle(self) -> RequestHandle: ...

    def is_terminated(self) -> bool: ...


class RadixKey(Protocol):
    """A read's key: its tokens and namespace."""

    extra_key: Optional[str]
    cache_salt: Optional[str]

    def raw_token_ids(self) -> Sequence[int]: ...


class Ongoing(Protocol):
    """``_OngoingPrefetch``: the read's anchor, its key, its operation."""

    @property
    def anchor_node_id(self) -> object: ...

    @property
    def prefetch_key(self) -> RadixKey: ...

    @property
    def operation(self) -> Operation: ...


class PrefetchWait(Protocol):
    """``_StoragePrefetchWait``: a request's admission-poll deadline."""

    expired: bool


class LockReceipt(Protocol):
    def to_dec_params(self) -> object: ...


class InsertResult(Protocol):
    inserted_host_node: object
    host_insert_dropped: bool


class TreeCore(Protocol):
    write_back_duplicate_reclaim_digest: int
    is_eagle: bool

    def insert_host(
        self, node_id: object, key: object, value: object, hashes: object
    ) -> object: ...


class Controller(Protocol):
    """``HybridCacheController``: the ack lists (the storage queues are read by name)."""

    ack_write_queue: list[object]
    ack_load_queue: list[object]


class Cache(Protocol):
    """``UnifiedRadixCache``: what the ack counts and the prefetch votes read."""

    cache_controller: Optional[Controller]
    tree_core: TreeCore
    linker: object
    host_memory_mode: str
    pp_size: int
    tp_group: object
    tp_world_size: int
    attn_cp_group: object
    attn_tp_group: object
    enable_storage: bool
    ongoing_prefetch: MutableMapping[Hashable, Ongoing]
    prefetch_stop_policy: str
    page_size: int
    prefetch_threshold: int
    _storage_prefetch_wait: Mapping[Hashable, PrefetchWait]

    def writing_check(
        self, write_back: bool = False, finish_count: Optional[int] = None
    ) -> object: ...

    def loading_check(self, finish_count: Optional[int] = None) -> object: ...

    def _count_ready_acks(self, ack_queue: Sequence[object]) -> int: ...

    def _drain_storage_control_queues_impl(
        self, n_storage_hit: int, n_ack_prefetch: int, n_backup: int, n_release: int,
        extra_release_counts: Mapping[str, int], log_metrics: bool,
    ) -> object: ...  # fmt: skip

    def check_prefetch_progress(self, request: Hashable) -> bool: ...

    def inc_host_lock_ref(self, node_id: object) -> LockReceipt: ...

    def dec_host_lock_ref(self, node_id: object, params: object = None) -> object: ...

    def _all_reduce(self, data: object, tp_reduce_op: object) -> object: ...


class OffloadController(Protocol):
    ack_write_queue: list[object]


class OffloadManager(Protocol):
    """PD decode's ``DecodeKVCacheOffloadManager``."""

    cache_controller: Optional[OffloadController]
    tp_group: object
    tp_world_size: int

    def _check_offload_progress(self, finish_count: int) -> object: ...

    def _check_backup_progress(self, finish_count: int) -> object: ...


class Request(Protocol):
    """A scheduler's ``Req``, as the votes note it."""

    cache_request_handle: Hashable
    prefix_len: int


class Adder(Protocol):
    """The scheduler's ``PrefillAdder``: the batch it builds."""

    tree_cache: Optional[Cache]
    can_run_list: list[object]


class Scheduler(Protocol):
    tree_cache: Optional[Cache]

    def _prefetch_kvcache(self, req: object, storage_hit_end: Optional[int] = None) -> object: ...


class SyncMetrics(Protocol):
    """What a state hands its metrics (metrics.SyncSeries; a test's sink)."""

    def on_path(self, pipelined: bool) -> None: ...

    def on_step(
        self, wait_s: Optional[float], issue_s: float, pops: Mapping[Hashable, int]
    ) -> None: ...

    def on_failure(self, reason: str) -> None: ...


class AckMetrics(SyncMetrics, Protocol):
    """The ack counts' series (metrics.AckSyncMetrics): the depth and group size too."""

    def on_path(
        self, pipelined: bool, depth: int = 0, group_size: Optional[int] = None
    ) -> None: ...


class VoteMetrics(SyncMetrics, Protocol):
    """The prefetch votes' series (metrics.PrefetchVoteMetrics)."""

    def on_pass(
        self, wait_s: Optional[float], issue_s: float, voted: int, overflow: int = 0
    ) -> None: ...

    def on_stop(self, n: int = 1) -> None: ...

    def on_hold(self, why: str) -> None: ...

    def on_read_once(self, saved_tokens: int) -> None: ...


__all__ = ["AckMetrics", "Adder", "Cache", "Controller", "InsertResult", "LockReceipt",
    "OffloadController", "OffloadManager", "Ongoing", "Operation", "PrefetchWait", "RadixKey",
    "Request", "RequestHandle", "Scheduler", "SyncMetrics", "TreeCore", "VoteMetrics"]  # fmt: skip
