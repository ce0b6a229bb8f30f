"""What ``bench``'s side arms share (``--prefetch N``: prefetch.py, ``--decode-offload N``:
offload.py), each a loop of SGLang's real code on ranks forked like the ack bench's:
the option that picks one, each arm's ranks in turn, and the pass loop every rank runs.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterator, Sequence

from hicache_async_ack.tools import Job, run_ranks
from hicache_async_ack_lab.fresh import preload

BENCH_RANK_MODULE = "hicache_async_ack_lab.bench.rank_loop"  # preloaded as the ack bench does


def add_option(p: Any, flag: str, what: str, arms: Sequence[str]) -> None:
    """``flag N`` (0, the default: the ack arms) runs these arms instead."""
    help_text = f"instead of the ack arms: {what}; arms " + ", ".join(arms)
    p.add_argument(flag, type=int, default=0, metavar="N", help=help_text)


def pass_config(args: Any) -> dict:
    """What every rank's pass loop needs (``Passes``), and the one latency the side arms
    inject: the first phase of ``--inject-latency-ms``."""
    return {
        "steps": args.steps,
        "warmup": args.warmup,
        "step_ms": args.step_ms,
        "latency_ms": args.inject_latency_ms[0][0] if args.inject_latency_ms else 0.0,
    }


def arm_results(
    args: Any,
    arms: Sequence[str],
    target: str,
    cfg: dict,
    tp: int,
    latency_per_pass_ms: float,
    what: str,
) -> Iterator[tuple[str, list[dict]]]:
    """``(arm, its ranks' results)``, each arm run on fresh ranks once the one before
    it is judged (``target(ctx, cfg | {"arm": arm})``)."""
    preload(args.quiet, BENCH_RANK_MODULE)
    passes = args.steps + args.warmup
    for arm in arms:
        job = Job(
            target=target,
            world_size=tp,
            payload=dict(cfg, arm=arm),
            timeout_s=120.0 + passes * (args.step_ms + latency_per_pass_ms + 50) / 1e3,
            label=f"{what} {arm} arm",
            group_timeout_s=60.0,
        )
        t0 = time.monotonic()
        results = [r for r in run_ranks(job) if r is not None]
        if not args.quiet:
            print(f"[{arm}] {tp} ranks in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        yield arm, results


class Passes:
    """One rank's pass loop: ``for step, measured in passes:`` runs the body after rank
    0's broadcast on the TP group (the scheduler's ``recv_requests``), then lets the
    forward "run" with the host idle until ``step_ms`` from the pass's start.

    After the loop: ``step_ms`` (each measured pass, whole) and ``window_s`` (the
    measured passes' wall time)."""

    def __init__(self, ctx: Any, cfg: dict) -> None:
        self.ctx = ctx
        self.warmup, self.steps, self.pass_s = cfg["warmup"], cfg["steps"], cfg["step_ms"] / 1e3
        self.step_ms: list[float] = []
        self.window_s = 0.0

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        import torch
        import torch.distributed as dist

        bcast = torch.zeros(4, dtype=torch.int64)
        dist.barrier()
        t_window = time.perf_counter()
        for step in range(self.warmup + self.steps):
            measured = step >= self.warmup
            t0 = time.perf_counter()
            if step == self.warmup:
                t_window = t0
            dist.broadcast(bcast, src=0)
            yield step, measured
            left = t0 + self.pass_s - time.perf_counter()
            if left > 0:
                time.sleep(left)
            if measured:
                self.step_ms.append((time.perf_counter() - t0) * 1000.0)
            self.ctx.report(step + 1)
        self.window_s = time.perf_counter() - t_window
