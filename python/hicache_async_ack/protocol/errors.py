"""The protocol's own errors (no SGLang, no torch, no sync named): each carries what was
seen. A sync's state translates them once into its own pair, titled (kit.feature)."""

from __future__ import annotations

from typing import Mapping, Optional


class ProtocolError(Exception):
    """The protocol cannot go on on this rank: a collective failed or timed out, a reduce
    came back malformed, a queue lost its FIFO order. Never retried: a retry would
    desynchronise the collectives. ``seen``: what was observed, by name."""

    def __init__(self, message: str, seen: Optional[Mapping[str, object]] = None) -> None:
        super().__init__(message)
        self.seen: dict[str, object] = dict(seen or {})


class PeerMismatch(ProtocolError):
    """The ranks of a group disagree (a stamp, a setting, what they hold); raised on
    every rank before anything agreed is used."""


class BatchMismatch(PeerMismatch):
    """The ranks admitted different requests, or lengths, to one batch: their walks
    diverged (SGLang #30760)."""


__all__ = ["BatchMismatch", "PeerMismatch", "ProtocolError"]
