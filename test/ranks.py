"""Spawn a set of gloo ranks once and run many scenarios in them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("rank_worker.py")


def run_ranks(
    world: int,
    specs: list[dict],
    *,
    timeout: float = 900.0,
    group_timeout: float = 30.0,
    allow_exit: frozenset | set = frozenset(),
) -> list[dict]:
    """Run ``specs`` on ``world`` ranks; returns each rank's results by scenario.

    Ranks are killed (whole process group) if they outlive ``timeout``, so a bug
    fails the test instead of hanging CI.
    """
    tmp = Path(tempfile.mkdtemp(prefix="hicache-ranks-"))
    (tmp / "spec.json").write_text(json.dumps(specs))
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    f"--rank={rank}",
                    f"--world={world}",
                    f"--store={tmp / 'store'}",
                    f"--spec={tmp / 'spec.json'}",
                    f"--out={tmp}",
                    f"--timeout={group_timeout}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = []
    for rank, p in enumerate(procs):
        path = tmp / f"rank{rank}.json"
        if p.returncode != 0 and rank not in allow_exit:
            log = (tmp / f"rank{rank}.log").read_text()[-3000:]
            raise AssertionError(f"rank {rank} exited with {p.returncode}:\n{log}")
        out.append(json.loads(path.read_text()) if path.exists() else {})
    return out


def assert_symmetric_and_complete(results: list[dict], name: str) -> dict:
    """Every rank popped the same entries in the same step, never an unfinished
    ack, and nothing is left queued at the end. Returns rank 0's result."""
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}: {r.get('traceback') or r['error']}"
        assert r["violations"] == [], f"rank {rank}: {r['violations'][:5]}"
        assert all(v == 0 for v in r["left"].values()), f"rank {rank} left {r['left']}"
        assert r["pending"] == 0 or r["pipelined"], r
    ref = per_rank[0]["pops"]
    for rank, r in enumerate(per_rank[1:], 1):
        for step, (a, b) in enumerate(zip(ref, r["pops"])):
            assert a == b, f"step {step}: rank 0 popped {a}, rank {rank} popped {b}"
        assert len(ref) == len(r["pops"])
    return per_rank[0]


def assert_lagged_equal(pipelined: list, blocking: list, k: int) -> None:
    """Step s+k of the pipelined run pops exactly what step s of the blocking run
    popped (same seed, same traffic), and the first k steps pop nothing."""
    assert any(post for _, post in blocking), "nothing popped: the test would prove nothing"
    assert [post for _, post in pipelined[k:]] == [post for _, post in blocking[:-k]]
    assert all(post == [] for _, post in pipelined[:k] + blocking[-k:])
