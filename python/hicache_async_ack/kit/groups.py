"""The groups upstream reduces over, and which one group a single reduce can
stand for (attention CP x TP through the TP group: docs/design.md)."""

from __future__ import annotations

from typing import Any

from .decision import Decision, blocking


def world_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group=group)


def collective_groups(cache) -> list[tuple[str, Any, int]]:
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


def group_decision(cache) -> Decision:
    """The groups one reduce can stand for, for the cache's lifetime: one group
    of world size > 1, or attention CP x TP through the TP group (its span is
    checked at the first step, after the first exchange)."""
    groups = collective_groups(cache)
    if not groups:
        return blocking(
            "world size 1: upstream runs no collective, nothing to hide", "world_size_1"
        )
    if len(groups) > 1:
        names = " x ".join(f"{label}({ws})" for label, _, ws in groups)
        (_, cp, cp_ws), (_, attn_tp, attn_tp_ws) = groups
        if cache.tp_group is None or cp_ws * attn_tp_ws != cache.tp_world_size:
            return blocking(no_span_reason(names), "no_span")
        # Whether the union of the two is exactly the TP group needs every
        # member's groups: gathered at the first step, after the first exchange
        # (a gather here would hang a rank without the plugin, which runs none).
        return Decision(
            True,
            f"TP group, equal to {names}",
            group=cache.tp_group,
            world_size=cache.tp_world_size,
            span=(cp, attn_tp),
        )
    label, group, ws = groups[0]
    return Decision(True, f"one {label} group", group=group, world_size=ws)


def spanning_group(cache, cp_group, attn_tp_group):
    """The existing group over which one MIN equals upstream's MIN over the CP
    group followed by the MIN over the attn TP group, or None.

    After the two reduces rank r holds the MIN over the union of CP(t) for t in
    TP(r). One reduce over group G gives the same iff that union is G for every
    r in G. The candidate is the cache's TP group (it contains both); the check
    needs every member's CP and TP ranks, so it gathers them over that group
    once, in the first pipelined step right after the first exchange (which ran
    on the CP and attn TP groups, as upstream's reduce does, and showed that
    every rank it reached pipelines with the same settings); every member
    reaches the same verdict from the same data. No group is created."""
    import torch.distributed as dist

    tp = cache.tp_group
    if tp is None or cache.tp_world_size <= 1:
        return None
    mine = (
        dist.get_rank(),
        sorted(dist.get_process_group_ranks(cp_group)),
        sorted(dist.get_process_group_ranks(attn_tp_group)),
    )
    gathered: list = [None] * cache.tp_world_size
    dist.all_gather_object(gathered, mine, group=tp)
    members = set(dist.get_process_group_ranks(tp))
    cp_of = {rank: set(cp) for rank, cp, _ in gathered}
    for _, _, tp_ranks in gathered:
        if not set(tp_ranks) <= cp_of.keys():
            return None
        if set().union(*(cp_of[t] for t in tp_ranks)) != members:
            return None
    return tp
