"""``hicache-async-ack doctor``: would the plugin be active here (exit 0, else 1), and
what does the blocking path cost on this host (gloo latency, informational)?"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import __version__
from ..env import (
    ALLOW_UNTESTED_DEFAULT,
    ALLOW_UNTESTED_VAR,
    DEPTH_DEFAULT,
    DEPTH_VAR,
    ENABLE_DEFAULT,
    ENABLE_VAR,
    ENTRY_POINT_NAME,
    OFFLOAD_SYNC_DEFAULT,
    OFFLOAD_SYNC_VAR,
    PLUGINS_VAR,
    PREFETCH_VOTES_DEFAULT,
    PREFETCH_VOTES_VAR,
    allow_untested,
    parse_bool,
    parse_depth,
    plugin_whitelisted,
)
from ..guard import check_installed
from ..names import SYNCS
from .options import int_in, subcommand
from .ranks import Job, RankContext, run_ranks

GROUP = "sglang.srt.plugins"
DEFAULT_ROUNDS = 200
TENSOR_LEN = 10


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)  # the syncs that would run
    down: list[str] = field(default_factory=list)  # "sync (why)" for those standing down

    def add(self, key: str, value: str) -> None:
        self.lines.append((key, value))

    def block(self, why: str) -> None:
        self.blockers.append(why)


def allreduce_rank(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, Any]:
    """Per round: align the ranks with a broadcast (the scheduler's
    recv_requests), time one blocking MIN all_reduce of a small int64 tensor,
    then idle a little, as between scheduler steps."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(TENSOR_LEN, dtype=torch.int64)
    b = torch.zeros(1, dtype=torch.int64)
    lat = []
    warm = cfg["warmup"]
    total = warm + cfg["rounds"]
    ctx.report(0)
    for i in range(total):
        dist.broadcast(b, src=0)
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        dt = time.perf_counter() - t0
        if i >= warm:
            lat.append(dt * 1000.0)
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


def _entry_point() -> Any:
    from importlib.metadata import entry_points

    return next((ep for ep in entry_points(group=GROUP) if ep.name == ENTRY_POINT_NAME), None)


# Every variable the plugin reads: (variable, parser, default, what the value means,
# why it would keep the plugin from running or None).
Describe = Callable[[Any], str]
SETTINGS: tuple[tuple[str, Callable, Any, Describe, Callable[[Any], Optional[str]]], ...] = (
    (ENABLE_VAR, parse_bool, ENABLE_DEFAULT, lambda on: "enabled" if on else "DISABLED",
     lambda on: None if on else f"{ENABLE_VAR}=0 keeps the blocking path"),
    (DEPTH_VAR, parse_depth, DEPTH_DEFAULT, lambda depth: f"depth {depth}", lambda _: None),
    (ALLOW_UNTESTED_VAR, parse_bool, ALLOW_UNTESTED_DEFAULT,
     lambda on: f"on an untested SGLang the plugin {'runs' if on else 'stays inert'}",
     lambda _: None),
    (PREFETCH_VOTES_VAR, parse_bool, PREFETCH_VOTES_DEFAULT,
     lambda on: "on: with a storage backend under the timeout policy (TP > 1, no PP), the "
     "prefetch votes ride the ack-count reduce (whether this SGLang runs them: "
     "'supported: prefetch_votes' above)" if on
     else "off: one blocking reduce per waiting prefetch", lambda _: None),
    (OFFLOAD_SYNC_VAR, parse_bool, OFFLOAD_SYNC_DEFAULT,
     lambda on: "on: with --disaggregation-decode-enable-offload-kvcache (TP > 1) the decode "
     "offload sync pipelines (whether this SGLang runs it: 'supported: "
     "decode_offload' above)" if on else "off", lambda _: None),
)  # fmt: skip


def _add_settings(rep: Report) -> None:
    """The plugin's variables, as register() would read them."""
    for var, parse, default, describe, blocker in SETTINGS:
        raw = os.environ.get(var)
        shown = "unset" if raw is None else repr(raw)
        default_note = " (default)" if raw in (None, "") else ""
        try:
            value = parse(var, raw, default)
        except ValueError as exc:
            rep.add(var, f"{shown} -> INVALID: {exc}")
            rep.block(f"{var} is invalid: HiCache init would raise and the server not start")
            continue
        rep.add(var, f"{shown} -> {describe(value)}{default_note}")
        why = blocker(value)
        if why is not None:
            rep.block(why.replace("=0", f"={raw}"))


def _add_upstream(rep: Report) -> None:
    """The installed SGLang against the tested releases, fingerprint by fingerprint."""
    try:
        untested_ok = allow_untested()
    except ValueError:
        untested_ok = False  # reported (and blocking) with the settings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdict = check_installed()
    where = "in" if verdict.in_range else "OUTSIDE"
    rep.add(
        "tested range",
        f"SGLang {verdict.range_text} ({', '.join(verdict.tested)}): "
        f"{verdict.installed or 'none installed'} is {where} it",
    )
    rep.add("fingerprints", "each method the hooks wrap or rely on, against the recorded ones")
    for m in verdict.methods:
        rep.add(f"  {m.target.label}", m.describe())
    for judged in verdict.features():
        summary = judged.summary(verdict)
        key = f"supported: {judged.feature}"
        if judged.status == "tested":
            rep.add(key, f"yes: {summary}")
            rep.live.append(judged.feature)
        elif judged.status == "absent":
            rep.add(key, f"not here: {summary} (it stands down; the others are judged alone)")
            rep.down.append(f"{judged.feature} (not in this release)")
        elif judged.status == "incompatible":
            rep.add(key, f"NO, stands down: {summary}")
            rep.down.append(f"{judged.feature} (incompatible methods)")
        elif untested_ok:
            rep.add(key, f"UNTESTED, running anyway ({ALLOW_UNTESTED_VAR}): {summary}")
            rep.live.append(judged.feature)
        else:
            rep.add(key, f"NO, stands down: {summary} ({ALLOW_UNTESTED_VAR}=1 runs it anyway)")
            rep.down.append(f"{judged.feature} (untested methods: {', '.join(judged.changed)})")
    if not rep.live:
        rep.block(
            f"no feature of the plugin would run on this SGLang (tested: {verdict.range_text})"
        )


def diagnose(tp: int, step_ms: float, rounds: int) -> Report:
    from importlib import metadata

    def version(dist: str) -> Optional[str]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    rep = Report()
    dist_version = version("hicache-async-ack")
    # the package's own directory, not this module's (tools/)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plugin = f"{__version__} ({here})"
    if dist_version is None:
        plugin += "; NOT installed as a distribution"
    elif dist_version != __version__:
        plugin += f"; installed metadata says {dist_version} (stale install?)"
    rep.add("plugin", f"hicache-async-ack {plugin}")

    rep.add("SGLang", version("sglang") or "not installed")
    rep.add("torch", version("torch") or "not installed")

    _add_upstream(rep)

    ep = _entry_point()
    if ep is None:
        rep.add("entry point", f"MISSING: no {ENTRY_POINT_NAME!r} in group {GROUP}")
        rep.block("the entry point is not installed (pip install the plugin)")
    else:
        rep.add("entry point", f"{ep.name} = {ep.value} (group {GROUP})")

    raw_plugins = os.environ.get(PLUGINS_VAR)
    if plugin_whitelisted():
        shown = "unset: every installed plugin loads" if not raw_plugins else repr(raw_plugins)
        rep.add(PLUGINS_VAR, f"{shown} -> loaded")
    else:
        rep.add(PLUGINS_VAR, f"{raw_plugins!r} -> SKIPPED ({ENTRY_POINT_NAME} not listed)")
        rep.block(f"{PLUGINS_VAR}={raw_plugins!r} does not list {ENTRY_POINT_NAME}")
    _add_settings(rep)
    for sync in SYNCS:  # a sync its own setting turns off stands down too
        try:
            on = parse_bool(sync.setting, os.environ.get(sync.setting), True)
        except ValueError:
            continue  # invalid: reported (and blocking) with the settings
        if sync.name in rep.live and not on:
            rep.live.remove(sync.name)
            rep.down.append(f"{sync.name} ({sync.setting}=0)")

    if rounds > 0:
        try:
            m = measure_allreduce(tp, rounds)
        except Exception as exc:  # informational only
            rep.add("gloo all_reduce", f"measurement failed: {exc}")
        else:
            med = m["median"]
            rep.add(
                "gloo all_reduce",
                f"{tp} ranks on 127.0.0.1, {rounds} x {TENSOR_LEN} int64 MIN: "
                f"median {med:.3f} ms, p90 {m['p90']:.3f} ms",
            )
            penalty = med / (step_ms + med) if step_ms + med > 0 else 0.0
            rep.add(
                "blocking penalty",
                f"~{100 * penalty:.1f}% of throughput on the blocking path at "
                f"{step_ms:g} ms/step (median / (step + median))",
            )
    else:
        rep.add("gloo all_reduce", "not measured (--rounds 0)")
    return rep


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    rep = diagnose(args.tp, args.step_ms, args.rounds)
    width = max(len(k) for k, _ in rep.lines)
    print(f"hicache-async-ack doctor ({time.monotonic() - t0:.1f} s)")
    for k, v in rep.lines:
        print(f"  {k.ljust(width)}  {v}")
    if rep.blockers:
        print("verdict: plugin INACTIVE - SGLang would run the blocking path:")
        for b in rep.blockers:
            print(f"  - {b}")
        return 1
    line = "verdict: plugin ACTIVE - SGLang's loader applies it in every process; live: "
    line += ", ".join(rep.live)
    if rep.down:
        line += f"; standing down: {'; '.join(rep.down)}"
    print(line)
    return 0


SUMMARY = "check the plugin would be active here; measure this host's gloo latency"
DESCRIPTION = (
    "Report versions, SGLang support, entry point, SGLANG_PLUGINS and the plugin's env "
    "settings, and measure the N-rank gloo all_reduce latency (--tp ranks; --step-ms for "
    "the predicted penalty). Exits non-zero when the plugin would not be active."
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = subcommand(sub, "doctor", SUMMARY, DESCRIPTION)
    p.add_argument(
        "--rounds",
        type=int_in("--rounds", 0),
        default=DEFAULT_ROUNDS,
        help=f"all_reduces to time (default {DEFAULT_ROUNDS}; 0 skips)",
    )
    p.set_defaults(func=run)
    return p
