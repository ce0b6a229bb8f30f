"""The plugin's vocabulary, written once: a row per sync, the controller queues they
count, the stop policies and the logger. Engine-agnostic: no SGLang or torch import here.

A sync is a row here and a state class on the kit's templates (docs/design.md, "Adding a
sync"): everything else about it (its log title, where its state lives, its metrics'
``sync`` label, the setting doctor reports, its errors) is read from its row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from .env import ENABLE, OFFLOAD_SYNC, Switch
from .env import PREFETCH_VOTES as VOTES_SETTING
from .errors import (
    AdmissionMismatch,
    ErrorPair,
    HiCacheAckSyncError,
    HiCacheAckSyncMismatch,
    OffloadSyncError,
    OffloadSyncMismatch,
    PrefetchVoteError,
    PrefetchVoteMismatch,
)
from .protocol.votes import BEST_EFFORT, TIMEOUT, WAIT_COMPLETE

LOGGER_NAME = "sglang.srt.mem_cache.hicache_async_ack"

SyncName = str  # a row's name: the guard's feature, the ``sync`` label, doctor's key


@dataclass(frozen=True)
class Sync:
    """One sync: ``name`` (the guard's feature, the ``sync`` label), ``title`` (logs,
    errors), the attribute its state lives in on SGLang's object, the setting that turns
    it off (doctor's row) and its errors."""

    name: SyncName
    title: str
    state_attr: str
    setting: Switch
    errors: ErrorPair


ACK_COUNTS = Sync("ack_counts", "HiCache ack sync", "_hicache_ack_sync_state", ENABLE,
                  ErrorPair(HiCacheAckSyncError, HiCacheAckSyncMismatch))  # fmt: skip
PREFETCH_VOTES = Sync(
    "prefetch_votes", "HiCache prefetch votes", "_hicache_prefetch_votes_state", VOTES_SETTING,
    ErrorPair(PrefetchVoteError, PrefetchVoteMismatch, AdmissionMismatch),
)  # fmt: skip
DECODE_OFFLOAD = Sync("decode_offload", "HiCache decode offload sync",
                      "_hicache_offload_sync_state", OFFLOAD_SYNC,
                      ErrorPair(OffloadSyncError, OffloadSyncMismatch))  # fmt: skip
SYNCS = (ACK_COUNTS, PREFETCH_VOTES, DECODE_OFFLOAD)  # registration order
ACK, VOTES, OFFLOAD = ACK_COUNTS.name, PREFETCH_VOTES.name, DECODE_OFFLOAD.name
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


# Why a sync is on the path it is: a bounded code per decision (the path info series'
# ``reason`` label, doctor, the troubleshooting page's table).
ReasonCode = Literal[
    "pipelined",
    "disabled_by_env",  # SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0
    "feature_disabled_by_env",  # the feature's own setting is off
    "untested_release",  # the guard matched no tested release for this feature
    "not_in_release",  # this SGLang lacks the feature's methods, as recorded (0.5.20 PD)
    "in_tree",  # this SGLang carries the in-tree form
    "missing_attrs",  # this SGLang's objects lack what the feature reads
    "hooks_missing",  # a hooked method is not our hook (subclass override)
    "world_size_1",
    "no_span",  # attention CP x TP with no existing group spanning both
    "no_controller",
    "linker",  # an external cache linker is attached
    "host_memory_mode",
    "pp",
    "no_storage",
    "storage_without_votes",  # storage attached, the walk not the votes' (the ack counts)
    "policy",  # a prefetch stop policy the votes do not know
    "policy_not_timeout",
    "agreeing",  # the group has not yet agreed on the setting
    "draining",  # inside drain_before_retraction
]

# --hicache-storage-prefetch-policy values (protocol.votes): the walk decides under the
# first two.
STOP_POLICIES = (TIMEOUT, BEST_EFFORT, WAIT_COMPLETE)

__all__ = ["ACK", "ACK_COUNTS", "ACK_QUEUES", "BEST_EFFORT", "BY_NAME", "CACHE_SYNCS",
    "DECODE_OFFLOAD", "EXTRA_POOL_QUEUES", "ExtraPool", "LOGGER_NAME", "OFFLOAD",
    "OFFLOAD_QUEUES", "PREFETCH_VOTES", "QueueName", "ReasonCode", "STOP_POLICIES",
    "STORAGE_QUEUES", "SYNCS", "SYNC_NAMES", "Sync", "SyncName", "TIMEOUT", "VOTES",
    "WAIT_COMPLETE", "queue_label"]  # fmt: skip
