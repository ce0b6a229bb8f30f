"""The three syncs, each a :class:`~hicache_async_ack.kit.feature.Feature`: its
state, its step, its hooks with their notes, and what it must be registered
after."""

from __future__ import annotations

from ..kit.feature import Feature, check_order


def all_features() -> tuple[Feature, ...]:
    """Every feature, in registration order; each one's ``after`` is asserted
    (the votes wrap the ack sync's hooks: their pass boundary brackets its step)."""
    from . import ack_sync, decode_offload, prefetch_votes, vote_hooks  # noqa: F401 (hooks)

    return check_order((ack_sync.FEATURE, prefetch_votes.FEATURE, decode_offload.FEATURE))
