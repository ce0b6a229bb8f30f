"""The three syncs, each a :class:`~hicache_async_ack.kit.feature.Feature`: the
ack counts and the decode offload, owners on the kit's template; the prefetch
votes, a rider of the ack counts' reduce."""

from __future__ import annotations

from typing import Any

from ..kit.feature import Feature, check_order


def all_features() -> tuple[Feature[Any], ...]:
    """Every feature, in registration order; each one's ``after`` is asserted
    (the votes wrap the ack counts' hooks: their pass boundary brackets its step)."""
    from . import ack_counts, decode_offload, prefetch_votes, vote_hooks

    assert vote_hooks.FEATURE is prefetch_votes.FEATURE  # its hooks are declared
    return check_order((ack_counts.FEATURE, prefetch_votes.FEATURE, decode_offload.FEATURE))
