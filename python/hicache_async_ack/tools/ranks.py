"""Start a set of gloo ranks on 127.0.0.1, run a function in each, collect results.

The one rank spawner of the project (bench, doctor and the multi-rank tests).
Ranks are forked from the calling process, which imports what they need once
(SGLang's cache module costs 10-15 s of CPU per import). The calling process
must be clean: it must not have applied any plugin hooks, since forked ranks
inherit its classes. The bench and doctor are; pytest's process is not, so the
tests call :func:`run_fresh`, which runs the same spawner in a fresh interpreter
(``python -m hicache_async_ack.tools.ranks``), several rank sets in a row.

Every rank joins a gloo group over a FileStore with an explicit timeout,
binds to the loopback interface, runs in its own process group, dies with its
parent, and is SIGKILLed when the run ends, fails, times out or is interrupted.
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
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

# What SGLang-driving ranks need, imported once before forking.
SGLANG_PRELOAD = (
    "torch.distributed",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.plugins",
)


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
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # best effort; the parent also kills us
        pass
    if os.getppid() != parent_pid:
        os._exit(70)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _rank_main(job: Job, rank: int, workdir: str, progress, parent_pid: int) -> None:
    """Body of a forked rank: rendezvous, run the target, write its result."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
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


def _kill(procs) -> None:
    for p in procs:
        if p.exitcode is not None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            p.kill()
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=5)


def _how(code: Optional[int]) -> str:
    if code is None:
        return "was still running (killed)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _describe_failures(procs, workdir: Path, job: Job) -> str:
    errors = []
    for rank in range(len(procs)):
        f = workdir / f"rank{rank}.error.json"
        if f.exists():
            try:
                errors.append(json.loads(f.read_text()))
            except ValueError:
                pass
    errors.sort(key=lambda e: e["time"])
    lines = [
        f"rank {rank} {_how(p.exitcode)}"
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
    """Fork ``job.world_size`` ranks and return their results, in rank order
    (None for an allowed rank that died). Raises RanksFailed if another rank
    dies or the ranks outlive ``job.timeout_s``; every rank is killed before
    this returns or raises (also on KeyboardInterrupt)."""
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
            try:
                os.setpgid(p.pid, p.pid)  # also done by the child; whichever is first
            except OSError:
                pass
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


def run_fresh(
    jobs: list[Job],
    *,
    env: Optional[dict[str, str]] = None,
    preload: tuple[str, ...] = SGLANG_PRELOAD,
) -> list:
    """Run ``jobs`` one after another in a fresh interpreter (which imports
    ``preload`` once and forks every rank set from it). Returns, per job, the
    ranks' results or the RanksFailed it raised."""
    tmp = Path(tempfile.mkdtemp(prefix="hicache-async-ack-jobs-"))
    spec = {"preload": list(preload), "jobs": [asdict(j) for j in jobs]}
    (tmp / "jobs.json").write_text(json.dumps(spec))
    log = tmp / "launcher.log"
    timeout = 180.0 + sum(j.timeout_s for j in jobs)
    cmd = [sys.executable, "-m", __name__, str(tmp / "jobs.json"), str(tmp / "out.json")]
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd,
                env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out = tmp / "out.json"
        if proc.returncode != 0 or not out.exists():
            raise RanksFailed(f"rank launcher {_how(proc.returncode)}:\n{log.read_text()[-4000:]}")
        return [
            RanksFailed(r["error"]) if "error" in r else r["results"]
            for r in json.loads(out.read_text())
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    """Launcher body for :func:`run_fresh`: preload, then run each job."""
    jobs_file, out_file = argv
    spec = json.loads(Path(jobs_file).read_text())
    for module in spec["preload"]:
        importlib.import_module(module)
    out: list[dict[str, Any]] = []
    for raw in spec["jobs"]:
        raw["rank_env"] = {int(k): v for k, v in raw["rank_env"].items()}
        raw["allow_exit"] = tuple(raw["allow_exit"])
        try:
            out.append({"results": run_ranks(Job(**raw))})
        except RanksFailed as exc:
            out.append({"error": str(exc)})
    _write_json(Path(out_file), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def preload(quiet: bool, *modules: str) -> None:
    """Import SGLang and the rank target's modules once, before forking the ranks."""
    import warnings

    t = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in (*SGLANG_PRELOAD, *modules):
            importlib.import_module(module)
    if not quiet:
        took = time.monotonic() - t
        print(f"imported sglang once for all ranks in {took:.1f} s", file=sys.stderr)
