"""cpu-server stand-ins for SGLang's Mooncake storage backend on a CPU-only host.

For Mooncake SGLang switches the host KV layout to ``page_first_direct``, whose
two direct copy ops ``pool_host/mha.py`` binds only on CUDA/HIP/XPU: on CPU the
first write-back or load raises NameError in every scheduler. Here they are plain
index copies. Mooncake's transfer engine also listens on every interface whatever
it is told, so a server process that loads the backend outside a network
namespace with only ``lo`` (``hicache-async-ack mooncake-master``) refuses to
create the store.
"""

from __future__ import annotations

from typing import Callable

STANDINS = {
    "mooncake host layout": "transfer_kv_per_layer_direct_pf_lf and "
    "transfer_kv_all_layer_direct_lf_pf (page_first_direct) bound as CPU index copies",
    "mooncake network": "the store is created only in a network namespace with just lo",
}


def _pages(indices, page_size: int):
    idx = indices.long().cpu()
    return idx // page_size, idx % page_size


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
) -> None:
    """Host (page, layer, offset) rows of one layer -> device token rows."""
    page, offset = _pages(src_indices, page_size)
    dst_idx = dst_indices.long().cpu()
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_idx.to(dst.device)] = src[page, layer_id, offset].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
) -> None:
    """Device token rows of every layer -> host (page, layer, offset) rows.

    ``src_ptrs`` is all K layers then all V layers; ``dst_ptrs`` the host K and V."""
    layers = len(src_ptrs) // len(dst_ptrs)
    page, offset = _pages(dst_indices, page_size)
    src_idx = src_indices.long().cpu()
    for j, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            dst[page, layer, offset] = src[src_idx.to(src.device)].to(dst.device)


def _bind_direct_ops(module) -> None:
    for op in (transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
        if getattr(module, op.__name__, None) is None:
            setattr(module, op.__name__, op)


def _require_private_network(module) -> None:
    # At the store's construction, not the module's import: SGLang imports the
    # module for any HiCache server (its L3 layout report).
    real_init = module.MooncakeStore.__init__

    def __init__(self, *args, **kwargs):
        from .mooncake import only_loopback

        if not only_loopback():
            raise RuntimeError(
                "cpu-server: Mooncake's transfer engine listens on every interface; run "
                "the server inside the master's private network namespace (see "
                "`hicache-async-ack mooncake-master --help`)"
            )
        real_init(self, *args, **kwargs)

    module.MooncakeStore.__init__ = __init__


def _then(first: Callable, second: Callable) -> Callable:
    def both(module) -> None:
        first(module)
        second(module)

    return both


def register(patches: dict, standins: dict) -> None:
    """Add these to cpu-server's post-import patches and its start-up description."""
    mha = "sglang.srt.mem_cache.pool_host.mha"
    patches[mha] = _then(patches[mha], _bind_direct_ops) if mha in patches else _bind_direct_ops
    patches["sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"] = _require_private_network
    standins.update(STANDINS)
