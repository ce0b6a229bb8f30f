"""Rank sets run in a fresh interpreter: the runtime's spawner
(``hicache_async_ack.tools.run_ranks``) forks ranks from the calling process,
which must not have applied any plugin hooks (forked ranks inherit its
classes). pytest's process has, so the tests and the differential call
:func:`run_fresh`, which runs the spawner in a fresh interpreter (``python -m
hicache_async_ack_lab.fresh``) that imports SGLang once and runs several rank
sets in a row; :func:`preload` imports SGLang once before a bench forks its ranks."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from hicache_async_ack.tools import Job, RanksFailed, describe_exit, run_ranks

# What SGLang-driving ranks need, imported once before forking.
SGLANG_PRELOAD = (
    "torch.distributed",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.plugins",
)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


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
            how = describe_exit(proc.returncode)
            raise RanksFailed(f"rank launcher {how}:\n{log.read_text()[-4000:]}")
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
