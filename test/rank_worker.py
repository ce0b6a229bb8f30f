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
    group = dist.new_group(
        list(range(args.world)), backend="gloo", timeout=timedelta(seconds=args.timeout)
    )
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
            results[spec["name"]] = run_scenario(spec, args.rank, args.world, group)
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
