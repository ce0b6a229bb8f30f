"""The plugin's vocabulary, written once: the syncs, the controller queues they count,
the stop policies and the logger. Engine-agnostic: no SGLang or torch import here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from .env import ENABLE_VAR, OFFLOAD_SYNC_VAR, PREFETCH_VOTES_VAR

LOGGER_NAME = "sglang.srt.mem_cache.hicache_async_ack"

SyncName = Literal["ack_counts", "prefetch_votes", "decode_offload"]


@dataclass(frozen=True)
class Sync:
    """One sync: name (the guard's feature, the ``sync`` label), title (logs, errors),
    its state's attribute, its metrics key and the setting that turns it off."""

    name: SyncName
    title: str
    state_attr: str
    metrics_key: str
    setting: str


ACK_COUNTS = Sync("ack_counts", "HiCache ack sync", "_hicache_ack_sync_state", "ack", ENABLE_VAR)
PREFETCH_VOTES = Sync("prefetch_votes", "HiCache prefetch votes",
                      "_hicache_prefetch_votes_state", "votes", PREFETCH_VOTES_VAR)  # fmt: skip
DECODE_OFFLOAD = Sync("decode_offload", "HiCache decode offload sync",
                      "_hicache_offload_sync_state", "offload", OFFLOAD_SYNC_VAR)  # fmt: skip
SYNCS = (ACK_COUNTS, PREFETCH_VOTES, DECODE_OFFLOAD)  # registration order
ACK, VOTES, OFFLOAD = (s.name for s in SYNCS)
SYNC_NAMES = tuple(s.name for s in SYNCS)
BY_NAME = {s.name: s for s in SYNCS}
# The syncs a UnifiedRadixCache carries (decode offload lives on PD decode's manager).
CACHE_SYNCS = (ACK, VOTES)

# HybridCacheController's queues, in upstream's ready-count tensor order: the ack lists,
# then (with storage) the storage control queues, then one per extra host pool.
ACK_QUEUES = ("ack_write_queue", "ack_load_queue")
STORAGE_QUEUES = ("prefetch_hit_queue", "ack_prefetch_queue", "ack_backup_queue",
                  "host_mem_release_queue")  # fmt: skip
EXTRA_POOL_QUEUES = "extra_host_mem_release_queues"  # {pool: queue.Queue}
# The decode offload manager's controller: offload acks, storage backups.
OFFLOAD_QUEUES = ("ack_write_queue", "ack_backup_queue")


@dataclass(frozen=True)
class ExtraPool:
    """An extra host pool's release queue (``extra_host_mem_release_queues[pool]``)."""

    pool: str

    @property
    def label(self) -> str:
        return f"{EXTRA_POOL_QUEUES}:{self.pool}"


QueueName = Union[str, ExtraPool]


def queue_label(name: QueueName) -> str:
    """The ``queue`` label of a queue: its attribute name, or an extra pool's."""
    return name.label if isinstance(name, ExtraPool) else name


# --hicache-storage-prefetch-policy values: the walk decides under the first two.
TIMEOUT, BEST_EFFORT, WAIT_COMPLETE = "timeout", "best_effort", "wait_complete"
STOP_POLICIES = (TIMEOUT, BEST_EFFORT, WAIT_COMPLETE)

__all__ = ["ACK", "ACK_COUNTS", "ACK_QUEUES", "BEST_EFFORT", "BY_NAME", "CACHE_SYNCS",
    "DECODE_OFFLOAD", "EXTRA_POOL_QUEUES", "ExtraPool", "LOGGER_NAME", "OFFLOAD",
    "OFFLOAD_QUEUES", "PREFETCH_VOTES", "QueueName", "STOP_POLICIES", "STORAGE_QUEUES", "SYNCS",
    "SYNC_NAMES", "Sync", "SyncName", "TIMEOUT", "VOTES", "WAIT_COMPLETE"]  # fmt: skip
