"""The three syncs, each a feature on :mod:`hicache_async_ack.adapter`: its
state, its step, its hooks with their notes, and the order they need."""

from __future__ import annotations

from ..adapter import Feature


def all_features() -> tuple[Feature, ...]:
    """Every feature, in registration order (the ack sync's hooks first: see
    each feature's ``order``)."""
    from . import ack_sync, decode_offload, prefetch_votes

    return (ack_sync.FEATURE, prefetch_votes.FEATURE, decode_offload.FEATURE)
