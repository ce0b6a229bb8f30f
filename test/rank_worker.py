"""One scheduler-like rank for the multi-rank tests (run by test/ranks.py).

Joins a gloo group on 127.0.0.1 (FileStore, explicit timeout), loads plugins
through SGLang's real load_plugins(), then runs every scenario of the spec file
against a real UnifiedRadixCache on that group and writes what it popped, step
by step, to <out-dir>/rank<R>.json.

Scenario traffic and lifecycle events: see traffic.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()

    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    from traffic import run_scenario

    load_plugins()  # what run_scheduler_process does first
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(args.store, args.world),
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    timeout = timedelta(seconds=args.timeout)
    groups = {"tp": dist.new_group(list(range(args.world)), backend="gloo", timeout=timeout)}
    if args.world == 4:
        # Attention CP=2 x TP=2 the way SGLang's initialize_model_parallel lays them
        # out: attn TP groups are contiguous, attn CP groups strided by attn_tp_size.
        # Every rank creates every group, in the same order.
        # "odd_cp" is a layout no single group matches (CP groups equal to the
        # TP groups): the plugin must keep it blocking.
        layouts = (
            ("attn_tp", [[0, 1], [2, 3]]),
            ("attn_cp", [[0, 2], [1, 3]]),
            ("odd_cp", [[0, 1], [2, 3]]),
        )
        for key, layout in layouts:
            for ranks in layout:
                g = dist.new_group(ranks, backend="gloo", timeout=timeout)
                if args.rank in ranks:
                    groups[key] = g
    with open(args.spec) as f:
        specs = json.load(f)
    results = {}
    broken = False
    for spec in specs:
        if broken:
            results[spec["name"]] = {"error": "skipped after an earlier failure"}
            continue
        t0 = time.monotonic()
        try:
            results[spec["name"]] = run_scenario(spec, args.rank, args.world, groups)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[spec["name"]] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            broken = not spec.get("expect_error")
        results[spec["name"]]["seconds"] = time.monotonic() - t0
        with open(f"{args.out}/rank{args.rank}.json", "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown races at exit; results are on disk


if __name__ == "__main__":
    main()
