"""One rank of a mixed group: a patched SGLang tree beside a plugin node.

Test support. ``python -m hicache_async_ack_lab.testing.mixed_node RANK WORLD PORT
OUT.json`` joins a gloo group through the TCPStore at 127.0.0.1:PORT (the
caller's, the master) and runs a few scheduler steps of ``check_hicache_events``
on the real ``UnifiedRadixCache`` of :mod:`..sim.cache`, with one write and one
load ack ready. Which ack sync the rank runs depends only on its interpreter: a
patched tree on PYTHONPATH (plugin excluded) runs the in-tree one, a stock
SGLang with the plugin loaded runs the plugin's. Writes ``{"form", "error",
"popped"}``: the form it ran, the error that stopped it, what it popped.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

STEPS = 3
GROUP_TIMEOUT_S = 120.0


def run(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    from hicache_async_ack_lab.sim.cache import build_cache
    from hicache_async_ack_lab.testing.scenarios import IN_TREE_MODULE, attach_in_tree

    load_plugins()  # what run_scheduler_process does first
    try:
        importlib.import_module(IN_TREE_MODULE)
        form = "in_tree"
    except ImportError:
        form = "plugin"
    out: dict = {"form": form, "error": "", "popped": []}
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    sim = build_cache(tp_group=dist.group.WORLD, tp_world_size=world)
    cache = sim.cache
    if form == "in_tree":
        cache.__dict__["ack_sync"] = None
        attach_in_tree(cache)
        assert cache.ack_sync is not None, "the in-tree rank must pipeline"
    else:
        from hicache_async_ack.sglang_plugin import ACK_FEATURE, init_cache, state_of

        init_cache(cache)
        state = state_of(ACK_FEATURE, cache)
        assert state is not None and state.decide(cache).pipelined, "the plugin must pipeline"
    for kind in ("write", "load"):
        sim.add_ack(kind, lambda: True)  # ready everywhere: popped only if agreed
    try:
        for _ in range(STEPS):
            cache.check_hicache_events()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    out["popped"] = sim.take_pops()
    dist.destroy_process_group()
    return out


def main(argv: list[str]) -> int:
    rank, world, port, path = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    try:
        result = run(rank, world, port)
    except BaseException as exc:  # reported, not raised: the caller reads the file
        result = {"form": "?", "error": f"{type(exc).__name__}: {exc}", "popped": []}
        result["traceback"] = traceback.format_exc()
    path.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
