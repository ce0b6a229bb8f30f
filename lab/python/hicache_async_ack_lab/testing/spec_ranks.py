"""One rank target body for the prefetch-vote and decode-offload scenario suites:
SGLang's load_plugins(), then each scenario spec on a fresh gloo TP group, with
the process's own settings restored and the spec's (and this rank's) applied."""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence


def apply_env(spec: dict, rank: int, saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    os.environ.update(spec.get("env", {}))
    os.environ.update(spec.get("rank_env", {}).get(str(rank), {}))


def run_specs(
    ctx, payload: dict, variables: Sequence[str], run_one: Callable[[dict, int, int, object], dict]
) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    saved = {k: os.environ.get(k) for k in variables}
    load_plugins()
    timeout = timedelta(seconds=payload.get("group_timeout_s", 60.0))
    results: dict = {}
    for spec in payload["specs"]:
        apply_env(spec, ctx.rank, saved)
        group = dist.new_group(list(range(ctx.world_size)), backend="gloo", timeout=timeout)
        t0 = time.monotonic()
        results[spec["name"]] = run_one(spec, ctx.rank, ctx.world_size, group)
        results[spec["name"]]["seconds"] = time.monotonic() - t0
        ctx.report(len(results))
    return results
