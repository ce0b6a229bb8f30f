"""Every error the plugin raises, in one place. Engine-agnostic (no SGLang or
torch import), so the protocol can raise them where they are detected.

Each sync has an error (it cannot continue on this rank: a peer died, a
collective timed out) and a mismatch (the ranks of a group disagree; raised on
every rank of the group before anything is popped or used). Never retried: a
retry would desynchronise the collectives."""

from __future__ import annotations


class HiCacheAsyncAckError(RuntimeError):
    """A sync of hicache-async-ack cannot continue on this rank: the base of
    every error the plugin raises."""


class HiCacheAsyncAckMismatch(HiCacheAsyncAckError):
    """The ranks of a group disagree (protocol, settings, what they hold)."""


class HiCacheAckSyncError(HiCacheAsyncAckError):
    """The ack-count sync cannot continue on this rank."""


class HiCacheAckSyncMismatch(HiCacheAckSyncError, HiCacheAsyncAckMismatch):
    """The ranks disagree on the protocol, its settings, the layout flags or the
    reclaim digest."""


class PrefetchVoteError(HiCacheAsyncAckError):
    """The prefetch votes cannot continue on this rank."""


class PrefetchVoteMismatch(PrefetchVoteError, HiCacheAsyncAckMismatch):
    """The ranks disagree on the ongoing operations, the requests their walks
    reached or the protocol; raised before any verdict is used."""


class AdmissionMismatch(PrefetchVoteMismatch):
    """The ranks admitted different requests (or lengths) to the batch in one
    scheduling pass (their waiting-queue walks diverged: SGLang #30760)."""


class OffloadSyncError(HiCacheAsyncAckError):
    """The decode offload sync cannot continue on this rank."""


class OffloadSyncMismatch(OffloadSyncError, HiCacheAsyncAckMismatch):
    """The decode ranks disagree (a stock peer, the setting, the stamp)."""


__all__ = ["AdmissionMismatch", "HiCacheAckSyncError", "HiCacheAckSyncMismatch",
    "HiCacheAsyncAckError", "HiCacheAsyncAckMismatch", "OffloadSyncError", "OffloadSyncMismatch",
    "PrefetchVoteError", "PrefetchVoteMismatch"]  # fmt: skip
