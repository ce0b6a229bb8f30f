"""Start a set of gloo ranks on 127.0.0.1, run a function in each, collect results.

The project's one rank spawner (doctor, the lab's bench and multi-rank tests). Ranks are
forked from the caller, which imports what they need once and must not have applied any
plugin hooks. Each rank joins a gloo group over a FileStore with a timeout, binds to the
loopback, runs in its own process group, dies with its parent, and is SIGKILLed at the end.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional


class RanksFailed(RuntimeError):
    """A rank died, or the ranks outlived their timeout."""


@dataclass
class RankContext:
    rank: int
    world_size: int
    progress: Any  # shared int64 array, one slot per rank: steps done (-1: starting)

    def report(self, done: int) -> None:
        self.progress[self.rank] = done


@dataclass
class Job:
    """One set of ranks. ``target`` is "module:function", called in every rank
    as ``function(ctx, payload) -> dict`` (JSON-serialisable)."""

    target: str
    world_size: int
    payload: dict = field(default_factory=dict)
    timeout_s: float = 300.0
    label: str = "ranks"
    group_timeout_s: float = 60.0  # every gloo collective; a dead peer surfaces within this
    rank_env: dict[int, dict[str, str]] = field(default_factory=dict)  # set before the target
    allow_exit: tuple[int, ...] = ()  # ranks that may die (fault tests): no failure

    def resolve(self) -> Callable[[RankContext, dict], dict]:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


def loopback_ifname() -> Optional[str]:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n.startswith("lo")), None)


def _die_with_parent(parent_pid: int) -> None:
    with suppress(Exception):  # best effort; the parent also kills us
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(70)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _rank_main(job: Job, rank: int, workdir: str, progress: Any, parent_pid: int) -> None:
    """Body of a forked rank: rendezvous, run the target, write its result."""
    with suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    out = Path(workdir)
    try:
        lo = loopback_ifname()
        if lo:
            os.environ["GLOO_SOCKET_IFNAME"] = lo  # loopback only
        os.environ.update(job.rank_env.get(rank, {}))
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            store=dist.FileStore(str(out / "store"), job.world_size),
            rank=rank,
            world_size=job.world_size,
            timeout=timedelta(seconds=job.group_timeout_s),
        )
        result = job.resolve()(RankContext(rank, job.world_size, progress), job.payload)
        _write_json(out / f"rank{rank}.json", result)
    except BaseException as exc:  # reported to the parent, then exit 1
        err = {
            "rank": rank,
            "time": time.time(),
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            "violations": list(getattr(exc, "violations", []) or []),
        }
        try:
            _write_json(out / f"rank{rank}.error.json", err)
        finally:
            sys.stderr.flush()
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the parent's atexit handlers and gloo teardown


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.exitcode is not None:
            continue
        with suppress(OSError):
            os.killpg(p.pid, signal.SIGKILL)
        with suppress(OSError, ValueError):
            p.kill()
    for p in procs:
        p.join(timeout=5)


def describe_exit(code: Optional[int]) -> str:
    """How a process ended, for an error message (None: it was still running)."""
    if code is None:
        return "was still running (killed)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _describe_failures(procs: list[Any], workdir: Path, job: Job) -> str:
    errors = []
    for rank in range(len(procs)):
        f = workdir / f"rank{rank}.error.json"
        if f.exists():
            with suppress(ValueError):
                errors.append(json.loads(f.read_text()))
    errors.sort(key=lambda e: e["time"])
    lines = [
        f"rank {rank} {describe_exit(p.exitcode)}"
        for rank, p in enumerate(procs)
        if p.exitcode != 0 and rank not in job.allow_exit
    ]
    msg = f"{job.label}: a rank died: " + "; ".join(lines)
    if errors:
        first = errors[0]
        msg += f"\nfirst error (rank {first['rank']}): {first['error']}"
        if first.get("violations"):
            msg += "\nviolations: " + "; ".join(first["violations"][:10])
        tb = first.get("traceback", "").rstrip().splitlines()
        if tb:
            msg += "\n  " + "\n  ".join(tb[-8:])
    return msg


def run_ranks(
    job: Job,
    on_progress: Optional[Callable[[list[int]], None]] = None,
    poll_s: float = 0.2,
) -> list[Optional[dict]]:
    """Fork ``job.world_size`` ranks and return their results in rank order (None for an
    allowed rank that died); RanksFailed if another dies or they outlive the timeout.
    Every rank is killed before this returns or raises."""
    job.resolve()  # import the target here, once, not in every rank
    ctx = multiprocessing.get_context("fork")
    progress = ctx.Array("q", [-1] * job.world_size, lock=False)
    workdir = Path(tempfile.mkdtemp(prefix="hicache-async-ack-"))
    procs: list = []
    try:
        for rank in range(job.world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(job, rank, str(workdir), progress, os.getpid()),
                name=f"{job.label}-rank{rank}",
                daemon=True,
            )
            p.start()
            assert p.pid is not None
            with suppress(OSError):
                os.setpgid(p.pid, p.pid)  # also done by the child; whichever is first
            procs.append(p)
        deadline = time.monotonic() + job.timeout_s
        while True:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if any(r not in job.allow_exit for r in failed):
                time.sleep(0.3)  # let the peers' errors land, for the message
                raise RanksFailed(_describe_failures(procs, workdir, job))
            if all(p.exitcode is not None for p in procs):
                break
            if time.monotonic() > deadline:
                raise RanksFailed(
                    f"{job.label}: ranks did not finish within {job.timeout_s:.0f} s "
                    f"(steps done per rank: {list(progress)}); killed them"
                )
            if on_progress is not None:
                on_progress(list(progress))
            multiprocessing.connection.wait(
                [p.sentinel for p in procs if p.exitcode is None], timeout=poll_s
            )
        results: list[Optional[dict]] = []
        for rank in range(job.world_size):
            f = workdir / f"rank{rank}.json"
            if f.exists():
                results.append(json.loads(f.read_text()))
            elif rank in job.allow_exit:
                results.append(None)
            else:
                raise RanksFailed(f"{job.label}: rank {rank} exited without a result")
        return results
    finally:
        _kill(procs)
        shutil.rmtree(workdir, ignore_errors=True)
