"""Attention CP x TP laid out as SGLang's initialize_model_parallel lays it out.

Inside one TP group of ``world`` ranks with attention context parallelism
``cp``: attention TP groups are contiguous blocks of ``world // cp`` ranks and
attention CP groups are strided by that size. :func:`create_groups` builds
real gloo groups from such a layout; every rank creates every group, in the
same order, as collective group creation requires.
"""

from __future__ import annotations

from datetime import timedelta

Layout = dict[str, list[list[int]]]


def attention_cp_layout(world: int, cp: int) -> Layout:
    """{"attn_tp_group": [...], "attn_cp_group": [...]} for CP=cp inside TP=world."""
    if cp <= 1:
        return {}
    if world % cp:
        raise ValueError(f"attention CP {cp} must divide the TP size {world}")
    attn_tp = world // cp
    return {
        "attn_tp_group": [list(range(i * attn_tp, (i + 1) * attn_tp)) for i in range(cp)],
        "attn_cp_group": [list(range(i, world, attn_tp)) for i in range(attn_tp)],
    }


def create_groups(rank: int, layout: Layout, timeout_s: float) -> dict:
    """This rank's group for each name of ``layout`` (real gloo groups)."""
    import torch.distributed as dist

    out = {}
    for key, blocks in layout.items():
        for ranks in blocks:
            g = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                out[key] = g
    return out
