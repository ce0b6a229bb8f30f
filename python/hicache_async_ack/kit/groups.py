"""The groups upstream reduces over, and which one group a single reduce can
stand for (attention CP x TP through the TP group: docs/design.md)."""

from __future__ import annotations

from typing import Callable

from .decision import Decision, blocking
from .views import Cache

WorldSize = Callable[[object], int]


def collective_groups(cache: Cache, world_size: WorldSize) -> list[tuple[str, object, int]]:
    """The groups upstream's _all_reduce_attn_groups reduces over, in order."""
    groups = [
        (label, g, world_size(g))
        for label, g in (("attn CP", cache.attn_cp_group), ("attn TP", cache.attn_tp_group))
        if g is not None and world_size(g) > 1
    ]
    if not groups and cache.tp_world_size > 1:
        groups = [("TP", cache.tp_group, cache.tp_world_size)]
    return groups


def no_span_reason(names: str) -> str:
    return (
        f"{names}: two collectives per step and no existing group spans exactly "
        "their ranks (DP attention?)"
    )


def group_decision(cache: Cache, world_size: WorldSize) -> Decision:
    """The groups one reduce can stand for, for the cache's lifetime: one group
    of world size > 1, or attention CP x TP through the TP group (its span is
    checked at the first step, after the first exchange: a gather here would
    hang a rank without the plugin, which runs none)."""
    groups = collective_groups(cache, world_size)
    if not groups:
        return blocking(
            "world size 1: upstream runs no collective, nothing to hide", "world_size_1"
        )
    if len(groups) > 1:
        names = " x ".join(f"{label}({ws})" for label, _, ws in groups)
        (_, cp, cp_ws), (_, attn_tp, attn_tp_ws) = groups
        if cache.tp_group is None or cp_ws * attn_tp_ws != cache.tp_world_size:
            return blocking(no_span_reason(names), "no_span")
        return Decision(
            True,
            f"TP group, equal to {names}",
            group=cache.tp_group,
            world_size=cache.tp_world_size,
            span=(cp, attn_tp),
            groups=names,
        )
    label, group, ws = groups[0]
    return Decision(True, f"one {label} group", group=group, world_size=ws)
