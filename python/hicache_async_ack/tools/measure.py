"""doctor --measure: what the blocking path costs on this host, timed over real gloo
ranks on 127.0.0.1 (informational: it never changes doctor's exit status)."""

from __future__ import annotations

import textwrap
import time
from typing import Any

from .ranks import Job, RankContext, run_ranks

TENSOR_LEN = 10  # about the ack counts' reduce: counts, stamp, flags


def allreduce_rank(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, Any]:
    """Per round: align the ranks with a broadcast (the scheduler's recv_requests), time
    one blocking MIN all_reduce of a small int64 tensor, then idle a little."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(TENSOR_LEN, dtype=torch.int64)
    b = torch.zeros(1, dtype=torch.int64)
    lat = []
    warm = cfg["warmup"]
    ctx.report(0)
    for i in range(warm + cfg["rounds"]):
        dist.broadcast(b, src=0)
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        if i >= warm:
            lat.append((time.perf_counter() - t0) * 1000.0)
        time.sleep(cfg["gap_ms"] / 1000.0)
        ctx.report(i + 1)
    return {"lat_ms": lat}


def measure_allreduce(tp: int, rounds: int, gap_ms: float = 1.0) -> dict:
    import numpy as np

    job = Job(
        target=f"{__name__}:allreduce_rank",
        world_size=tp,
        payload={"rounds": rounds, "warmup": 20, "gap_ms": gap_ms},
        timeout_s=60.0 + rounds * (gap_ms + 50.0) / 1000.0,
        label="gloo all_reduce measurement",
    )
    lat = [x for r in run_ranks(job) if r is not None for x in r["lat_ms"]]
    median, p90 = np.quantile(lat, (0.5, 0.9))
    return {"median": float(median), "p90": float(p90), "n": len(lat)}


def measure(tp: int, rounds: int, step_ms: float) -> list[str]:
    """What the blocking path costs on this host (informational: no exit code)."""
    try:
        m = measure_allreduce(tp, rounds)
    except Exception as exc:  # noqa: BLE001 (informational only)
        return [f"  gloo all_reduce: measurement failed: {exc}"]
    med = m["median"]
    penalty = med / (step_ms + med) if step_ms + med > 0 else 0.0
    text = (
        f"gloo all_reduce: median {med:.3f} ms, p90 {m['p90']:.3f} ms ({m['n']} timed); "
        f"blocking penalty ~{100 * penalty:.1f}% of throughput at {step_ms:g} ms/step "
        "(median / (step + median))"
    )
    return textwrap.wrap(text, 100, initial_indent="  ", subsequent_indent="    ")
