"""Every error the plugin raises, in one place. Engine-agnostic (no SGLang or
torch import).

Each sync has an error (it cannot continue on this rank: a peer died, a
collective timed out) and a mismatch (the ranks of a group disagree; raised on
every rank of the group before anything is popped or used), its :class:`ErrorPair`
(on its names row). The protocol raises its own (:mod:`.protocol.errors`); a sync's
state translates them once into its pair, titled. Never retried: a retry would
desynchronise the collectives."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

from .protocol.errors import BatchMismatch, PeerMismatch, ProtocolError


class HiCacheAsyncAckError(RuntimeError):
    """A sync of hicache-async-ack cannot continue on this rank: the base of
    every error the plugin raises. ``seen``: what the protocol observed, if it raised."""

    seen: Mapping[str, object] = MappingProxyType({})


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


@dataclass(frozen=True)
class ErrorPair:
    """A sync's errors: ``error`` (it cannot go on here), ``mismatch`` (its group
    disagrees) and, where it checks batches, ``batch`` (the ranks' batches differ)."""

    error: type[HiCacheAsyncAckError]
    mismatch: type[HiCacheAsyncAckError]
    batch: Optional[type[HiCacheAsyncAckError]] = None

    def translate(self, title: str, exc: ProtocolError) -> HiCacheAsyncAckError:
        """The protocol's error as this sync's, titled, carrying what was seen."""
        cls = self.error
        if isinstance(exc, PeerMismatch):
            cls = self.batch if isinstance(exc, BatchMismatch) and self.batch else self.mismatch
        err = cls(f"{title}: {exc}")
        err.seen = exc.seen
        return err


__all__ = ["ErrorPair", "AdmissionMismatch", "HiCacheAckSyncError", "HiCacheAckSyncMismatch",
    "HiCacheAsyncAckError", "HiCacheAsyncAckMismatch", "OffloadSyncError", "OffloadSyncMismatch",
    "PrefetchVoteError", "PrefetchVoteMismatch"]  # fmt: skip
