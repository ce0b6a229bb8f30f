"""The plugin's vocabulary, written once: the syncs (the guard's feature names,
the ``sync`` label of the path info series, the log lines' subjects), the
controller queues they count, and the logger every rank writes to.
Engine-agnostic: no SGLang or torch import here."""

from __future__ import annotations

# The logger of every line the plugin writes (under SGLang's mem_cache loggers).
LOGGER_NAME = "sglang.srt.mem_cache.hicache_async_ack"

# The three syncs, each one feature (features/), in registration order.
ACK, VOTES, OFFLOAD = "ack_counts", "prefetch_votes", "decode_offload"
SYNCS = (ACK, VOTES, OFFLOAD)
TITLES = {
    ACK: "HiCache ack sync",
    VOTES: "HiCache prefetch votes",
    OFFLOAD: "HiCache decode offload sync",
}

# HybridCacheController's queues, in upstream's ready-count tensor order: the two
# ack lists, then (with storage) the four storage control queues.
ACK_QUEUES = ("ack_write_queue", "ack_load_queue")
STORAGE_QUEUES = (
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)
EXTRA_POOL_QUEUES = "extra_host_mem_release_queues"  # {pool: queue.Queue}, one per extra pool
# The decode offload manager's controller: offload acks, storage backups.
OFFLOAD_QUEUES = ("ack_write_queue", "ack_backup_queue")
