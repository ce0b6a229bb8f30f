"""The rounds of a ``bench-server`` mode that runs its own visits (``storage.py``,
``shared_prompt.py``): each visit recorded as it ends, so a run cut short can be
reported later (``--from-visits``), and the host line every report starts with."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from hicache_async_ack_lab.bench.arms import load_visits


def run_visits(args, cfg: dict, orders: list, visit_fn: Callable[..., dict],
               name: str) -> tuple[list[dict], dict, str]:  # fmt: skip
    """Every round's visits in ``orders`` (or, with --from-visits, an earlier run's,
    reported only), each added to WORKDIR/visits.jsonl as it ends; with the run's load
    averages and wall time, and the host line that says them."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix=f"hicache-bench-{name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_at_start, t0 = os.getloadavg(), time.monotonic()
    visits = load_visits(args.from_visits) if args.from_visits else []
    if visits:  # report only: earlier runs' rounds, pooled
        cfg["rounds"] = len({v["round"] for v in visits})
        load_at_start = visits[0]["loadavg_start"]
    for rnd, order in enumerate([] if visits else orders):
        for conf in order:
            visits.append(visit_fn(cfg, conf, rnd, workdir, args.quiet))
            with open(workdir / "visits.jsonl", "a") as f:  # survives a failed later visit
                f.write(json.dumps(visits[-1]) + "\n")
    load_at_end, wall = os.getloadavg(), time.monotonic() - t0
    if args.from_visits:
        load_at_end, wall = visits[-1]["loadavg_end"], sum(v["wall_s"] for v in visits)
    host = (f"host: {os.cpu_count()} CPUs, load average {load_at_start[0]:.2f} at start, "
            f"{load_at_end[0]:.2f} at end (other work on the box skews every figure); "
            f"{len(visits)} server runs in {wall / 60:.1f} min; logs in {workdir}")  # fmt: skip
    facts = {"loadavg_start": load_at_start, "loadavg_end": load_at_end, "wall_s": wall}
    return visits, facts, host
