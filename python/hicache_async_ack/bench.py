"""``hicache-async-ack bench``: what the blocking ack-count reduce costs on this
host, and what the plugin gives back.

TP scheduler-like ranks run as separate processes over real gloo on 127.0.0.1.
Each rank drives SGLang's real ``UnifiedRadixCache.check_hicache_events`` on a
cache built by :func:`hicache_async_ack.simulated.build_cache`, in a loop that
models the scheduler's step: the request broadcast ``recv_requests`` does on the
same group, ``check_hicache_events`` (timed: the per-step cost), then a forward
of ``--step-ms`` during which the host is idle while write-through backups and
load-backs finish on a "side stream" after a per-rank random delay.

Three arms, each on fresh ranks (hooks cannot be un-applied in a process):

- ``l1``: no HiCache; check_hicache_events is never called (the baseline).
- ``blocking``: SGLang's loader with ``SGLANG_PLUGINS=none_selected``, i.e.
  stock behaviour: one blocking MIN all_reduce per step.
- ``pipelined``: SGLang's loader picks up this plugin through its entry point.

Ranks are forked from this process after it imported SGLang once (importing
``unified_radix_cache`` costs ~15 s of CPU; paying it once instead of once per
rank per arm keeps a TP=8 run on a 2-core box from spending minutes importing).
Every rank is its own process group and is killed (SIGKILL to the group) when
the run ends, fails, times out or is interrupted; ranks also die with their
parent (PR_SET_PDEATHSIG) and every collective has a timeout.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from . import __version__
from .env import DEPTH_DEFAULT, DEPTH_MAX, DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR

ARMS = ("l1", "blocking", "pipelined")
ARM_COLORS = {"l1": "#888888", "blocking": "#d62728", "pipelined": "#2ca02c"}
REDUCE_GROUPS = ("shared", "dedicated")
MIN_STEPS = 20
MAX_TP = 64
DEFAULT_TP = 4
DEFAULT_STEPS = 400
DEFAULT_WARMUP = 20
DEFAULT_STEP_MS = 11.0
COLLECTIVE_TIMEOUT_S = 60.0  # every gloo collective; a dead peer surfaces within this
BLOCKING_PLUGINS = "none_selected"  # an SGLANG_PLUGINS whitelist without us
COPY_MS = (0.5, 8.0)  # D2H / H2D copy time on the side stream, per rank, uniform
WRITES_PER_STEP = (0, 1, 1, 2, 2, 3)  # write-through backups enqueued per step
LOAD_PROBABILITY = 0.25  # a load-back per step (bounded: at most one)
STORAGE_PROBABILITY = 0.2  # a storage control entry per step, with --storage


class BenchError(RuntimeError):
    """The benchmark (or doctor measurement) cannot give a result."""


# =====================================================================
# Rank spawning (shared with doctor)
# =====================================================================
@dataclass
class RankContext:
    rank: int
    world_size: int
    progress: Any  # shared array of int64, one slot per rank: steps done (-1: starting)

    def report(self, done: int) -> None:
        self.progress[self.rank] = done


RankTarget = Callable[[RankContext, dict], dict]


def loopback_ifname() -> Optional[str]:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if name == "lo" or name.startswith("lo"):
            return name
    return None


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; the parent also kills us
        pass
    if os.getppid() != parent_pid:
        os._exit(70)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _rank_main(target, rank, world_size, workdir, progress, payload, parent_pid) -> None:
    """Body of a forked rank: rendezvous over a FileStore, run target, write result."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    workdir = Path(workdir)
    try:
        lo = loopback_ifname()
        if lo:
            os.environ["GLOO_SOCKET_IFNAME"] = lo  # loopback only
        import torch.distributed as dist

        store = dist.FileStore(str(workdir / "store"), world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        result = target(RankContext(rank, world_size, progress), payload)
        _write_json(workdir / f"rank{rank}.json", result)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 1
        err = {
            "rank": rank,
            "time": time.time(),
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            "violations": list(getattr(exc, "violations", []) or []),
        }
        try:
            _write_json(workdir / f"rank{rank}.error.json", err)
        finally:
            sys.stderr.flush()
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the parent's atexit handlers and gloo teardown


def _kill_ranks(procs) -> None:
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


def _describe_failures(procs, workdir: Path, label: str) -> str:
    errors = []
    for rank in range(len(procs)):
        f = workdir / f"rank{rank}.error.json"
        if f.exists():
            try:
                errors.append(json.loads(f.read_text()))
            except ValueError:
                pass
    errors.sort(key=lambda e: e["time"])
    lines = []
    for rank, p in enumerate(procs):
        code = p.exitcode
        if code is None:
            lines.append(f"rank {rank} was still running (killed)")
            continue
        if code == 0:
            continue
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        lines.append(f"rank {rank} {how}")
    msg = f"{label}: a rank died: " + "; ".join(lines)
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
    target: RankTarget,
    world_size: int,
    payload: dict,
    *,
    timeout_s: float,
    label: str,
    on_progress: Optional[Callable[[list[int]], None]] = None,
    poll_s: float = 0.2,
) -> list[dict]:
    """Fork ``world_size`` ranks joined by a gloo process group on loopback, run
    ``target(ctx, payload)`` in each and return their results (rank order).

    Raises BenchError if a rank dies or the ranks outlive ``timeout_s``; every
    rank is killed before this returns or raises (also on KeyboardInterrupt)."""
    ctx = multiprocessing.get_context("fork")
    progress = ctx.Array("q", [-1] * world_size, lock=False)
    workdir = Path(tempfile.mkdtemp(prefix="hicache-async-ack-"))
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(target, rank, world_size, str(workdir), progress, payload, os.getpid()),
                name=f"{label}-rank{rank}",
                daemon=True,
            )
            p.start()
            try:
                os.setpgid(p.pid, p.pid)  # also done by the child; whichever is first
            except OSError:
                pass
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        while True:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.3)  # let the peers' errors land, for the message
                raise BenchError(_describe_failures(procs, workdir, label))
            if all(p.exitcode == 0 for p in procs):
                break
            if time.monotonic() > deadline:
                done = list(progress)
                raise BenchError(
                    f"{label}: ranks did not finish within {timeout_s:.0f} s "
                    f"(steps done per rank: {done}); killed them"
                )
            if on_progress is not None:
                on_progress(list(progress))
            multiprocessing.connection.wait(
                [p.sentinel for p in procs if p.exitcode is None], timeout=poll_s
            )
        results = []
        for rank in range(world_size):
            f = workdir / f"rank{rank}.json"
            if not f.exists():
                raise BenchError(f"{label}: rank {rank} exited without a result")
            results.append(json.loads(f.read_text()))
        return results
    finally:
        _kill_ranks(procs)
        shutil.rmtree(workdir, ignore_errors=True)


# =====================================================================
# One bench rank
# =====================================================================
class _DelayedHandle:
    """Wraps a collective handle: wait() returns only once the modelled latency
    has passed since issue (then the real result)."""

    __slots__ = ("inner", "ready_at")

    def __init__(self, inner, ready_at: float):
        self.inner = inner
        self.ready_at = ready_at

    def wait(self):
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self.inner.wait()


def _delayed_factory(base_factory, latency_s: float):
    def factory(group):
        collective = base_factory(group)

        def issue(values):
            return _DelayedHandle(collective(values), time.perf_counter() + latency_s)

        return issue

    return factory


def _delayed_all_reduce(original, latency_s: float):
    def all_reduce(data, tp_reduce_op):
        time.sleep(latency_s)
        return original(data, tp_reduce_op)

    return all_reduce


class _SimFailure(RuntimeError):
    def __init__(self, msg, violations):
        super().__init__(msg)
        self.violations = violations


def attention_cp_groups(rank: int, world: int, cp: int) -> dict:
    """Attention CP x TP groups laid out as SGLang's initialize_model_parallel does
    (attn TP contiguous, attn CP strided by attn_tp_size). Every rank creates every
    group, in the same order, as collective group creation requires."""
    if cp <= 1:
        return {}
    import torch.distributed as dist

    attn_tp = world // cp
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    out = {}
    layouts = (
        ("attn_tp_group", [list(range(i * attn_tp, (i + 1) * attn_tp)) for i in range(cp)]),
        ("attn_cp_group", [list(range(i, world, attn_tp)) for i in range(attn_tp)]),
    )
    for key, groups in layouts:
        for ranks in groups:
            g = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                out[key] = g
    return out


def _bench_rank(ctx: RankContext, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    arm = cfg["arm"]
    rank, world = ctx.rank, ctx.world_size
    steps, warmup = cfg["steps"], cfg["warmup"]
    total = steps + warmup
    step_s = cfg["step_ms"] / 1000.0
    inject_s = cfg["inject_latency_ms"] / 1000.0
    crash = cfg.get("crash")
    group = dist.group.WORLD
    dedicated = None

    sim = None
    path = "no HiCache: check_hicache_events not called"
    hooked = False
    if arm != "l1":
        if arm == "pipelined":
            os.environ[PLUGINS_VAR] = "hicache_async_ack"
            os.environ[ENABLE_VAR] = "1"
            os.environ[DEPTH_VAR] = str(cfg["depth"])
        else:
            os.environ[PLUGINS_VAR] = BLOCKING_PLUGINS
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.plugins import load_plugins

        from . import sglang_plugin
        from .simulated import build_cache

        load_plugins()  # SGLang's real loader: entry points, whitelist, apply_hooks
        hooked = sglang_plugin._is_hooked(UnifiedRadixCache.check_hicache_events)
        if hooked != (arm == "pipelined"):
            raise BenchError(
                f"{arm} arm: SGLang's loader {'applied' if hooked else 'did not apply'} "
                "the plugin's hooks (is the plugin installed as an entry point?)"
            )
        if arm == "pipelined":
            if cfg["reduce_group"] == "dedicated":
                dedicated = dist.new_group(
                    backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
                )
                sglang_plugin.collective_factory = lambda _group, g=dedicated: (
                    sglang_plugin.torch_min_all_reduce(g)
                )
            if inject_s > 0:
                sglang_plugin.collective_factory = _delayed_factory(
                    sglang_plugin.collective_factory, inject_s
                )
        sim = build_cache(
            tp_group=group,
            tp_world_size=world,
            storage=cfg["storage"],
            **attention_cp_groups(rank, world, cfg["cp"]),
        )
        if arm == "blocking" and inject_s > 0:
            sim.cache.__dict__["_all_reduce"] = _delayed_all_reduce(sim.cache._all_reduce, inject_s)

    shared = random.Random(cfg["seed"])  # same draws on every rank: same enqueue order
    own = random.Random(cfg["seed"] * 1_000_003 + 7919 * (rank + 1))  # copy times
    if sim is not None:
        from .simulated import STORAGE_QUEUE_NAMES, deadline

    bcast = torch.zeros(4, dtype=torch.int64)
    check_ms: list[float] = []
    step_ms: list[float] = []
    bcast_ms: list[float] = []
    bcast_at: list[tuple[float, float]] = []
    pops_per_step: list[int] = []
    outstanding: dict[int, Callable[[], bool]] = {}
    finish: dict[int, int] = {}  # ack uid -> step at whose start it was seen done
    popped: dict[int, tuple[str, int]] = {}  # uid -> (queue, step popped)
    t_window = None
    ctx.report(0)
    dist.barrier()
    for step in range(total):
        if crash is not None and crash[0] == rank and crash[1] == step:
            os._exit(3)  # --crash-rank-at: model a rank dying mid-run
        t0 = time.perf_counter()
        if step == warmup:
            t_window = t0
        # recv_requests: rank 0 broadcasts the step's requests on the same group.
        if rank == 0:
            bcast[0] = step
        dist.broadcast(bcast, src=0, group=group)
        if step >= warmup:
            t_b = time.perf_counter()
            bcast_ms.append((t_b - t0) * 1000.0)
            bcast_at.append((t0, t_b))  # CLOCK_MONOTONIC: comparable across ranks
        if sim is not None:
            c0 = time.perf_counter()
            try:
                sim.cache.check_hicache_events()
            except Exception as exc:
                raise _SimFailure(
                    f"check_hicache_events failed at step {step}: {exc!r}",
                    list(sim.cc.violations),
                ) from exc
            c1 = time.perf_counter()
            if step >= warmup:
                check_ms.append((c1 - c0) * 1000.0)
            pops = sim.take_pops()
            for queue_name, uid in pops:
                popped[uid] = (str(queue_name), step)
                if outstanding.pop(uid, None) is not None:
                    finish[uid] = step  # popped before this rank saw it done
            if step >= warmup:
                pops_per_step.append(len(pops))
            if sim.cc.violations:
                raise _SimFailure(f"violations at step {step}", list(sim.cc.violations))
            if step == 0 and arm == "pipelined":
                state = sglang_plugin.state_of(sim.cache)
                decision = state.decide(sim.cache) if state is not None else None
                if decision is not None and not decision.pipelined and world == 1:
                    path = f"plugin stands down: {decision.reason}"
                elif decision is None or not decision.pipelined:
                    why = decision.reason if decision is not None else "no plugin state"
                    raise BenchError(f"pipelined arm runs the blocking path: {why}")
                else:
                    path = f"pipelined over the {decision.reason} (depth {state.settings.depth})"
                    if dedicated is not None:
                        path += "; reduce issued on a dedicated gloo group"
            elif step == 0 and arm == "blocking":
                path = f"stock SGLang ({PLUGINS_VAR}={BLOCKING_PLUGINS})"
        # Forward: launched now, the host is idle until it completes. Backups of
        # this step's KV and load-backs for the next are copied on a side stream.
        fwd_end = time.perf_counter() + step_s
        n_write = shared.choice(WRITES_PER_STEP)
        n_load = 1 if shared.random() < LOAD_PROBABILITY else 0
        put = shared.random() < STORAGE_PROBABILITY and cfg["storage"]
        queue_pick = shared.randrange(4)
        if sim is not None:
            for kind, n in (("write", n_write), ("load", n_load)):
                for _ in range(n):
                    done = deadline(own.uniform(*COPY_MS) / 1000.0)
                    outstanding[sim.add_ack(kind, done)] = done
            if put:
                sim.cc.put_storage(STORAGE_QUEUE_NAMES[queue_pick])
        left = fwd_end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        # What has finished by the start of the next step, as this rank sees it.
        for uid in [u for u, done in outstanding.items() if done()]:
            del outstanding[uid]
            finish[uid] = step + 1
        t1 = time.perf_counter()
        if step >= warmup:
            step_ms.append((t1 - t0) * 1000.0)
        ctx.report(step + 1)
    window_s = time.perf_counter() - t_window
    # Let every collective still in flight (the last issued reduce) complete on
    # all ranks before any of them exits: gloo's barrier waits for prior work.
    if dedicated is not None:
        dist.barrier(group=dedicated)
    dist.barrier()
    return {
        "rank": rank,
        "arm": arm,
        "path": path,
        "hooked": hooked,
        "check_ms": check_ms,
        "step_ms": step_ms,
        "bcast_ms": bcast_ms,
        "bcast_at": bcast_at,
        "pops_per_step": pops_per_step,
        "window_s": window_s,
        "finish": finish,
        "popped": popped,
        "violations": list(sim.cc.violations) if sim is not None else [],
    }


# =====================================================================
# Figures
# =====================================================================
def quantile(values, q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_arm(arm: str, results: list[dict], warmup: int, steps: int) -> dict:
    """Per-arm figures from the ranks' raw results."""
    r0 = results[0]
    check = [x for r in results for x in r["check_ms"]]  # pooled over ranks
    bcast = [x for r in results for x in r["bcast_ms"]]
    # Split the broadcast into waiting for the last rank to arrive (skew: e.g.
    # a slower check_hicache_events on some rank) and what it took after that
    # (the collective itself; a reduce left in flight on the group shows here).
    after_last = []
    for per_step in zip(*(r["bcast_at"] for r in results)):
        last = max(t_in for t_in, _ in per_step)
        after_last += [(t_out - last) * 1000.0 for _, t_out in per_step]
    violations = [v for r in results for v in r["violations"]]
    # Lag: for every ack popped in the measured window, pop step minus the step
    # by whose start it had finished on every rank. Pops must agree across ranks.
    ack_lags = []
    acks = storage = 0
    divergent = 0
    for uid, (queue_name, pop_step) in r0["popped"].items():
        others = [r["popped"].get(uid) for r in results[1:]]
        if any(o is None or o[1] != pop_step for o in others):
            divergent += 1
        if pop_step < warmup:
            continue
        if queue_name in ("write", "load"):
            acks += 1
            fin = [r["finish"].get(uid) for r in results]
            if all(f is not None for f in fin):
                ack_lags.append(pop_step - max(fin))
        else:
            storage += 1
    for r in results[1:]:
        divergent += sum(1 for uid in r["popped"] if uid not in r0["popped"])
    if divergent:
        violations.append(f"{divergent} entries popped in different steps across ranks")
    steps_per_s = steps / r0["window_s"] if r0["window_s"] > 0 else math.nan
    has_check = bool(check)
    return {
        "path": r0["path"],
        "check_ms": (
            {
                "median": quantile(check, 0.5),
                "p90": quantile(check, 0.9),
                "p99": quantile(check, 0.99),
                "mean": sum(check) / len(check),
                "max": max(check),
            }
            if has_check
            else None
        ),
        "bcast_ms": {
            "median": quantile(bcast, 0.5),
            "p90": quantile(bcast, 0.9),
            "after_last_rank_median": quantile(after_last, 0.5),
            "after_last_rank_p90": quantile(after_last, 0.9),
        },
        "step_ms_median": quantile(r0["step_ms"], 0.5),
        "step_ms_p99": quantile(r0["step_ms"], 0.99),
        "steps_per_s": steps_per_s,
        "throughput_vs_l1": None,
        "acks_popped": acks,
        "storage_popped": storage,
        "pops_per_step_mean": (
            sum(r0["pops_per_step"]) / len(r0["pops_per_step"]) if r0["pops_per_step"] else 0.0
        ),
        "mean_lag_steps": (sum(ack_lags) / len(ack_lags)) if ack_lags else None,
        "max_lag_steps": max(ack_lags) if ack_lags else None,
        "violations": violations,
        "_check_samples": check,
    }


def _fmt(v, spec=".3f", none="-"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def format_table(summary: dict[str, dict]) -> str:
    head = (
        "arm",
        "check p50 ms",
        "p90",
        "p99",
        "bcast p50",
        "after last",
        "step p50 ms",
        "steps/s",
        "vs L1",
        "acks popped",
        "lag (steps)",
        "violations",
    )
    rows = [head]
    for arm, s in summary.items():
        c = s["check_ms"] or {}
        rel = s["throughput_vs_l1"]
        rows.append(
            (
                arm,
                _fmt(c.get("median")),
                _fmt(c.get("p90")),
                _fmt(c.get("p99")),
                _fmt(s["bcast_ms"]["median"]),
                _fmt(s["bcast_ms"]["after_last_rank_median"]),
                _fmt(s["step_ms_median"], ".2f"),
                _fmt(s["steps_per_s"], ".2f"),
                _fmt(None if rel is None else rel * 100, ".2f") + ("%" if rel is not None else ""),
                str(s["acks_popped"] + s["storage_popped"]),
                _fmt(s["mean_lag_steps"], ".2f"),
                str(len(s["violations"])),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def draw_png(path: Path, summary: dict[str, dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    with_check = [a for a, s in summary.items() if s["_check_samples"]]
    if with_check:
        data = [summary[a]["_check_samples"] for a in with_check]
        ax1.boxplot(data, showfliers=True, whis=(1, 99), flierprops={"markersize": 2})
        ax1.set_xticks(range(1, len(with_check) + 1), with_check)
        ax1.set_yscale("log")
        for i, a in enumerate(with_check, start=1):
            med = summary[a]["check_ms"]["median"]
            ax1.annotate(
                f"p50 {med:.3f}",
                (i, med),
                xytext=(30, 0),
                textcoords="offset points",
                fontsize=8,
                va="center",
            )
    ax1.set_ylabel("check_hicache_events per step (ms, log)")
    ax1.set_title("per-step cost (all ranks; whiskers p1-p99)", fontsize=10)
    ax1.grid(axis="y", alpha=0.3, which="both")

    arms = list(summary)
    rel = [summary[a]["throughput_vs_l1"] for a in arms]
    if all(r is not None for r in rel):
        vals = [r * 100 for r in rel]
        bars = ax2.bar(arms, vals, color=[ARM_COLORS[a] for a in arms])
        lo = min(vals)
        ax2.set_ylim(max(0.0, lo - max(2.0, (100 - lo) * 0.3)), max(103.0, max(vals) + 3.0))
        ax2.axhline(99.0, ls="--", lw=1, color="k", alpha=0.6, label="99% of L1")
        ax2.legend(loc="lower left", fontsize=8)
        ax2.set_ylabel("throughput vs L1 (%)")
        for b, v in zip(bars, vals):
            ax2.annotate(
                f"{v:.1f}%",
                (b.get_x() + b.get_width() / 2, v),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=9,
            )
    else:
        vals = [summary[a]["steps_per_s"] for a in arms]
        ax2.bar(arms, vals, color=[ARM_COLORS[a] for a in arms])
        ax2.set_ylabel("steps/s")
    ax2.set_title("throughput", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =====================================================================
# Driver
# =====================================================================
class _Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.label = ""
        self.total = 1
        self.t_first = None
        self.last_quarter = -1

    def start(self, label: str, total: int, ranks: int) -> None:
        self.label, self.total = label, total
        self.t_first, self.last_quarter = None, -1
        self.t_start = time.monotonic()
        self._emit(f"[{label}] starting {ranks} rank(s)...", final=not self.tty)

    def update(self, progress: list[int]) -> None:
        if not self.enabled:
            return
        done = min(progress)
        if done < 0:
            return
        now = time.monotonic()
        if self.t_first is None:
            self.t_first = (now, done)
        pct = 100.0 * done / self.total
        t0, d0 = self.t_first
        rate = (done - d0) / (now - t0) if now > t0 and done > d0 else 0.0
        eta = f"ETA {(self.total - done) / rate:.0f} s" if rate > 0 else "ETA ?"
        line = f"[{self.label}] {pct:5.1f}% ({done}/{self.total} steps), {eta}"
        if self.tty:
            self._emit(line, final=False)
        elif int(pct // 25) > self.last_quarter and done < self.total:
            self.last_quarter = int(pct // 25)
            self._emit(line, final=True)

    def finish(self, extra: str = "") -> None:
        took = time.monotonic() - self.t_start
        self._emit(f"[{self.label}] done in {took:.1f} s{extra}", final=True)

    def note(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=sys.stderr, flush=True)

    def _emit(self, line: str, final: bool) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def preload_sglang() -> None:
    """Import what the ranks need once, before forking them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.managers.cache_controller  # noqa: F401
        import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
        import sglang.srt.plugins  # noqa: F401
        import torch.distributed  # noqa: F401

        from . import sglang_plugin, simulated  # noqa: F401


def versions() -> dict:
    from importlib import metadata

    out = {"plugin": __version__, "python": platform.python_version()}
    for dist in ("torch", "sglang", "hicache-async-ack"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def arm_timeout_s(cfg: dict, world: int) -> float:
    per_step = (cfg["step_ms"] + cfg["inject_latency_ms"] + 5.0) / 1000.0
    return 60.0 + 2.0 * world + 4.0 * per_step * (cfg["steps"] + cfg["warmup"])


def run_arm(arm: str, cfg: dict, progress: _Progress) -> list[dict]:
    payload = dict(cfg, arm=arm)
    world = cfg["tp"]
    total = cfg["steps"] + cfg["warmup"]
    progress.start(arm, total, world)
    results = run_ranks(
        _bench_rank,
        world,
        payload,
        timeout_s=cfg["timeout_s"] or arm_timeout_s(cfg, world),
        label=f"{arm} arm",
        on_progress=progress.update,
    )
    progress.finish()
    return results


def run(args) -> int:
    if args.tp % args.cp:
        divisors = [d for d in range(1, args.tp + 1) if args.tp % d == 0]
        raise BenchError(f"--cp {args.cp} must divide --tp {args.tp}; accepted: {divisors}")
    cfg = {
        "tp": args.tp,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_ms": args.step_ms,
        "arms": list(args.arms),
        "inject_latency_ms": args.inject_latency_ms,
        "storage": args.storage,
        "seed": args.seed,
        "depth": args.depth,
        "cp": args.cp,
        "reduce_group": args.reduce_group,
        "timeout_s": args.timeout,
        "crash": args.crash_rank_at,
    }
    progress = _Progress(not args.quiet)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed  # noqa: F401  (once here, not once per forked rank)
    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    if any(a != "l1" for a in cfg["arms"]):
        progress.note("importing sglang once for all ranks (~15 s)...")
        t = time.monotonic()
        preload_sglang()
        progress.note(f"imported in {time.monotonic() - t:.1f} s")
    raw = {}
    for arm in cfg["arms"]:
        raw[arm] = run_arm(arm, cfg, progress)
    summary = {arm: summarize_arm(arm, raw[arm], cfg["warmup"], cfg["steps"]) for arm in raw}
    if "l1" in summary:
        base = summary["l1"]["steps_per_s"]
        for s in summary.values():
            s["throughput_vs_l1"] = s["steps_per_s"] / base if base else None

    title = (
        f"TP={cfg['tp']}, {cfg['steps']} steps (+{cfg['warmup']} warmup), "
        f"forward {cfg['step_ms']:g} ms, injected latency {cfg['inject_latency_ms']:g} ms, "
        f"depth {cfg['depth']}, reduce group {cfg['reduce_group']}"
        + (f", attention CP={cfg['cp']} x TP={cfg['tp'] // cfg['cp']}" if cfg["cp"] > 1 else "")
        + (", storage" if cfg["storage"] else "")
    )
    print(f"hicache-async-ack bench {__version__}: {title}")
    if load_at_start is not None:
        print(
            f"host: {os.cpu_count()} CPUs, load average {load_at_start[0]:.2f} at start "
            f"(other work on the box skews every figure)"
        )
    print(format_table(summary))
    for arm, s in summary.items():
        print(f"  {arm}: {s['path']}")
    if "blocking" in summary and "pipelined" in summary:
        b, p = summary["blocking"]["check_ms"], summary["pipelined"]["check_ms"]
        if b and p and b["median"] > 0:
            print(
                f"pipelined median check_hicache_events cost is "
                f"{100 * p['median'] / b['median']:.1f}% of blocking"
            )

    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in cfg.items() if k not in ("crash",)},
        "versions": versions(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_start": load_at_start,
        "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "arms": {
            a: {k: v for k, v in s.items() if not k.startswith("_")} for a, s in summary.items()
        },
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        progress.note(f"appended results to {out}")
    png = (
        Path(args.png)
        if args.png
        else (Path(args.out).with_suffix(".png") if args.out else Path("bench.png"))
    )
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        draw_png(png, summary, title)
        progress.note(f"wrote {png}")
    except ImportError as exc:
        print(f"warning: no PNG ({exc}); install matplotlib", file=sys.stderr)
    bad = {a: s["violations"] for a, s in summary.items() if s["violations"]}
    if bad:
        for a, v in bad.items():
            print(f"VIOLATIONS in {a}: " + "; ".join(v[:10]), file=sys.stderr)
        return 1
    return 0


# =====================================================================
# Options
# =====================================================================
def _int_in(name: str, lo: int, hi: Optional[int] = None, why: str = ""):
    accepted = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"

    def parse(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(
                f"invalid {name} {raw!r}; accepted values: {accepted}{why}"
            )
        return v

    return parse


def _nonneg_float(name: str):
    def parse(raw: str) -> float:
        try:
            v = float(raw)
        except ValueError:
            v = math.nan
        if not (v >= 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(
                f"invalid {name} {raw!r}; accepted values: a number >= 0 (milliseconds)"
            )
        return v

    return parse


def _arms(raw: str) -> tuple[str, ...]:
    picked = [a.strip().lower() for a in raw.split(",") if a.strip()]
    accepted = ", ".join(ARMS)
    for a in picked:
        if a not in ARMS:
            raise argparse.ArgumentTypeError(
                f"unknown arm {a!r}; accepted values: {accepted} (comma-separated)"
            )
    if not picked or len(set(picked)) != len(picked):
        raise argparse.ArgumentTypeError(
            f"invalid arms {raw!r}; accepted values: a comma-separated list without "
            f"repeats of {accepted}"
        )
    return tuple(picked)


def _crash(raw: str):
    try:
        r, s = raw.split(":")
        return (int(r), int(s))
    except ValueError:
        raise argparse.ArgumentTypeError("expected RANK:STEP") from None


EPILOG = f"""\
arms (run back to back, each on fresh ranks):
  l1         no HiCache: check_hicache_events is not called (the baseline)
  blocking   stock SGLang ({PLUGINS_VAR}={BLOCKING_PLUGINS} before load_plugins())
  pipelined  this plugin, applied by SGLang's own load_plugins()

--inject-latency-ms is a MODEL of a host whose gloo all_reduce is slow, not a
measurement: blocking sleeps X ms before every upstream _all_reduce; pipelined's
handle.wait() returns no earlier than X ms after the reduce was issued (the
reduce itself still runs over real gloo). `hicache-async-ack doctor` measures
this host's real gloo latency; the PR saw 0.5 ms on GB300 and 3.2 ms on B200.

Per step each rank: broadcasts a small tensor from rank 0 on the TP group (the
scheduler's recv_requests), runs check_hicache_events (timed), then "runs the
forward" for --step-ms (host idle) while 0-3 write-through backups and up to
one load-back finish after {COPY_MS[0]:g}-{COPY_MS[1]:g} ms (random per rank).
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="measure the blocking ack reduce vs the pipelined one on CPU/gloo",
        description="Run TP scheduler-like ranks over gloo on 127.0.0.1 driving "
        "SGLang's real UnifiedRadixCache.check_hicache_events, and compare "
        "L1 (no HiCache), blocking (stock) and pipelined (this plugin).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=_int_in("--tp", 1, MAX_TP),
        default=DEFAULT_TP,
        help=f"ranks (processes) in the TP group (default {DEFAULT_TP})",
    )
    p.add_argument(
        "--steps",
        type=_int_in("--steps", MIN_STEPS, why=" (fewer give no meaningful p99)"),
        default=DEFAULT_STEPS,
        help=f"measured steps per arm (default {DEFAULT_STEPS}, min {MIN_STEPS})",
    )
    p.add_argument(
        "--warmup",
        type=_int_in("--warmup", 0),
        default=DEFAULT_WARMUP,
        help=f"unmeasured steps first (default {DEFAULT_WARMUP})",
    )
    p.add_argument(
        "--step-ms",
        type=_nonneg_float("--step-ms"),
        default=DEFAULT_STEP_MS,
        help=f"simulated forward per step, host idle (default {DEFAULT_STEP_MS:g})",
    )
    p.add_argument(
        "--arms",
        type=_arms,
        default=ARMS,
        help=f"comma-separated, from {', '.join(ARMS)} (default: all)",
    )
    p.add_argument(
        "--inject-latency-ms",
        type=_nonneg_float("--inject-latency-ms"),
        default=0.0,
        help="model a slow host: extra latency of the ack reduce (see below; default 0)",
    )
    p.add_argument(
        "--storage",
        action="store_true",
        help="also feed the storage control queues (L3 backend on)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--depth",
        type=_int_in("--depth", 1, DEPTH_MAX),
        default=DEPTH_DEFAULT,
        help=f"{DEPTH_VAR} for the pipelined arm (1..{DEPTH_MAX}, default {DEPTH_DEFAULT})",
    )
    p.add_argument(
        "--cp",
        type=_int_in("--cp", 1, 64),
        default=1,
        help="attention context-parallel size inside the TP group (must divide --tp; "
        "CP>1 with TP/CP>1 makes upstream run two reduces per step)",
    )
    p.add_argument(
        "--reduce-group",
        choices=REDUCE_GROUPS,
        default="shared",
        help="pipelined arm: reduce on the TP group the broadcast uses "
        "(shared, as the plugin does) or on a second gloo group (dedicated)",
    )
    p.add_argument(
        "--out",
        metavar="FILE.jsonl",
        help="append one JSON object per run (config, versions, figures)",
    )
    p.add_argument("--png", metavar="FILE", help="plot (default: next to --out, else ./bench.png)")
    p.add_argument(
        "--timeout",
        type=_nonneg_float("--timeout"),
        default=0.0,
        help="seconds per arm before the ranks are killed (default: from the step count)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--crash-rank-at", type=_crash, default=None, help=argparse.SUPPRESS)


def main(argv=None) -> int:
    from .cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
