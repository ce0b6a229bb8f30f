"""``hicache-async-ack bench-server``: plugin vs stock on SGLang's real server.

Each arm is a real ``launch_server`` on this CPU-only host (``cpu-server``),
driven by SGLang's own ``python -m sglang.bench_serving`` with the
``generated-shared-prefix`` dataset: groups of requests share a long system
prompt, so prefixes are cached, evicted to the host pool and loaded back. The
arms differ only in ``SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC``. With
``--latency-ms`` the servers model a host whose gloo all_reduce is slow (the
seed's B200 host: 3.2 ms), inside the server processes.

One server per (arm, latency), ``--runs`` bench_serving runs on it (the cache
flushed before each), arms in ABBA order across latencies so a drift of the
box's load does not favour one arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ... import __version__
from ...env import ENABLE_VAR
from ..options import ToolError, int_in
from .driver import _parse_list, save, versions
from .summary import _fmt, _pct, render

ARMS = ("stock", "plugin")
ARM_ENV = {"stock": {ENABLE_VAR: "0"}, "plugin": {ENABLE_VAR: "1"}}
# What bench_serving reports that the table shows: (key in its JSON, column).
FIGURES = (
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
)
BENCH_TIMEOUT_S = 900.0  # one bench_serving run; a stuck server fails the arm


def server_args(cfg: dict) -> list[str]:
    return [
        "--tp", str(cfg["tp"]), "--enable-hierarchical-cache", "--enable-metrics",
        "--max-total-tokens", str(cfg["max_total_tokens"]),
        "--hicache-ratio", str(cfg["hicache_ratio"]),
        *cfg["server_args"],
    ]  # fmt: skip


def bench_serving_cmd(cfg: dict, port: int, model: Path, out: Path, seed: int) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.bench_serving",
        "--backend", "sglang", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(cfg["num_groups"]),
        "--gsp-prompts-per-group", str(cfg["prompts_per_group"]),
        "--gsp-system-prompt-len", str(cfg["system_prompt_len"]),
        "--gsp-question-len", str(cfg["question_len"]),
        "--gsp-output-len", str(cfg["output_len"]),
        "--request-rate", str(cfg["request_rate"]),
        "--flush-cache", "--disable-tqdm", "--seed", str(seed),
        "--output-file", str(out),
    ]  # fmt: skip
    if cfg["max_concurrency"]:
        cmd += ["--max-concurrency", str(cfg["max_concurrency"])]
    return cmd


def run_bench_serving(cmd: list[str], log: Path) -> dict:
    out = Path(cmd[cmd.index("--output-file") + 1])
    with open(log, "ab") as f:
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            timeout=BENCH_TIMEOUT_S,
        ).returncode  # fmt: skip
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise ToolError(f"bench_serving failed (exit {rc}); its log {log}:\n" + "\n".join(tail))
    return json.loads(out.read_text().strip().splitlines()[-1])


def plugin_state(server) -> dict:
    """What the server's own /metrics says about the ack sync, summed over ranks."""
    from prometheus_client.parser import text_string_to_metric_families

    pipelined, popped = [], 0.0
    for family in text_string_to_metric_families(server.get("/metrics").decode()):
        for s in family.samples:
            if s.name == "sglang:hicache_ack_sync_pipelined":
                pipelined.append(s.value)
            elif s.name == "sglang:hicache_ack_sync_popped_entries_total":
                popped += s.value
    return {"pipelined_ranks": int(sum(pipelined)), "popped_entries": popped}


def run_arm(cfg: dict, arm: str, latency_ms: float, workdir: Path, quiet: bool) -> dict:
    from ..cpu_server import Server
    from ..cpu_server.model import ensure_model

    model = ensure_model()
    name = f"{arm}-{latency_ms:g}ms"
    server = Server(
        server_args(cfg),
        env=ARM_ENV[arm],
        log_path=workdir / f"server-{name}.log",
        latency_ms=latency_ms,
        start_timeout_s=cfg["start_timeout_s"],
    )
    runs = []
    t0 = time.monotonic()
    with server:
        if not quiet:
            print(f"[{name}] server up in {server.startup_s:.0f} s", file=sys.stderr)
        for r in range(cfg["runs"]):
            out = workdir / f"bench-{name}-{r}.jsonl"
            cmd = bench_serving_cmd(cfg, server.port, model, out, cfg["seed"] + r)
            result = run_bench_serving(cmd, workdir / f"bench-{name}.log")
            runs.append({key: result.get(key) for key, _ in FIGURES} | {
                "completed": result.get("completed"),
                "duration": result.get("duration"),
            })  # fmt: skip
            if not quiet:
                print(
                    f"[{name}] run {r + 1}/{cfg['runs']}: "
                    f"{result.get('output_throughput', 0):.1f} output tok/s",
                    file=sys.stderr,
                )
        state = plugin_state(server)
    expected = cfg["tp"] if arm == "plugin" else 0
    if state["pipelined_ranks"] != expected:
        raise ToolError(
            f"{name}: {state['pipelined_ranks']} ranks pipelined, expected {expected}; "
            f"see {server.log_path}"
        )
    return {
        "arm": arm,
        "latency_ms": latency_ms,
        "startup_s": server.startup_s,
        "wall_s": time.monotonic() - t0,
        "runs": runs,
        "median": medians(runs),
        **state,
    }


def medians(runs: list[dict]) -> dict[str, float]:
    out = {}
    for key, _ in FIGURES:
        values = [float(r[key]) for r in runs if r[key] is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def order(arms: tuple[str, ...], latencies: tuple[float, ...]) -> list[tuple[str, float]]:
    """ABBA: the arm that goes first alternates from one latency to the next."""
    out = []
    for i, lat in enumerate(latencies):
        out += [(a, lat) for a in (arms if i % 2 == 0 else arms[::-1])]
    return out


def relative(results: list[dict]) -> None:
    """Output throughput vs stock at the same latency, and vs the arm at 0 ms."""
    by = {(r["arm"], r["latency_ms"]): r["median"].get("output_throughput") for r in results}
    for r in results:
        own = r["median"].get("output_throughput")
        stock = by.get(("stock", r["latency_ms"]))
        base = by.get((r["arm"], 0.0))
        r["vs_stock"] = own / stock if own and stock else None
        r["vs_own_no_latency"] = own / base if own and base else None


def format_table(results: list[dict]) -> str:
    head = ("arm", "latency", *(col for _, col in FIGURES), "vs stock", "vs own 0 ms", "runs")
    rows: list[tuple[str, ...]] = [head]
    for r in results:
        m = r["median"]
        spread = [x["output_throughput"] for x in r["runs"] if x["output_throughput"]]
        rows.append(
            (
                r["arm"],
                f"{r['latency_ms']:g} ms",
                *(_fmt(m.get(key), ".2f") for key, _ in FIGURES),
                _pct(r["vs_stock"], ".1f"),
                _pct(r["vs_own_no_latency"], ".1f"),
                f"{min(spread):.0f}-{max(spread):.0f}" if spread else "-",
            )
        )
    return render(rows)


def draw_png(path: Path, results: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plot import color

    latencies = sorted({r["latency_ms"] for r in results})
    arms = [a for a in ARMS if any(r["arm"] == a for r in results)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        for i, lat in enumerate(latencies):
            r = next((x for x in results if x["arm"] == arm and x["latency_ms"] == lat), None)
            if r is None:
                continue
            x = i + (j - (len(arms) - 1) / 2) * width
            c = color("blocking" if arm == "stock" else "pipelined")
            ax.bar(x, r["median"].get("output_throughput", 0), width, color=c,
                   label=arm if i == 0 else None)  # fmt: skip
            pts = [run["output_throughput"] for run in r["runs"]]
            ax.plot([x] * len(pts), pts, "k.", markersize=4)
    ax.set_xticks(range(len(latencies)), [f"{lat:g} ms injected" for lat in latencies])
    ax.set_ylabel("output tokens/s (median of runs; dots: each run)")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def title_of(cfg: dict) -> str:
    return (
        f"real server, TP={cfg['tp']}, bench_serving generated-shared-prefix "
        f"{cfg['num_groups']}x{cfg['prompts_per_group']} (system {cfg['system_prompt_len']}, "
        f"question {cfg['question_len']}, output {cfg['output_len']} tokens), "
        f"{cfg['runs']} runs per arm"
    )


def config_of(args) -> dict:
    return {
        k: getattr(args, k)
        for k in (
            "tp", "runs", "num_groups", "prompts_per_group", "system_prompt_len",
            "question_len", "output_len", "request_rate", "max_concurrency",
            "max_total_tokens", "hicache_ratio", "seed", "start_timeout_s",
        )
    } | {
        "arms": list(args.arms),
        "latencies_ms": list(args.latency_ms),
        "server_args": list(args.server_arg),
    }  # fmt: skip


def run(args) -> int:
    cfg = config_of(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hicache-bench-server-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()
    results = [
        run_arm(cfg, arm, lat, workdir, args.quiet)
        for arm, lat in order(tuple(args.arms), tuple(args.latency_ms))
    ]
    results.sort(key=lambda r: (r["latency_ms"], ARMS.index(r["arm"])))
    relative(results)
    print(f"hicache-async-ack bench-server {__version__}: {title_of(cfg)}")
    print(
        f"host: {os.cpu_count()} CPUs, load average {load_at_start[0]:.2f} at start "
        "(other work on the box skews every figure); logs in " + str(workdir)
    )
    print(format_table(results))
    startups = [r["startup_s"] for r in results if r["startup_s"]]
    if startups:
        print(f"server start-up: {min(startups):.0f}-{max(startups):.0f} s")
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kind": "server",
        "config": cfg,
        "versions": versions(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": load_at_start,
        "loadavg_end": os.getloadavg(),
        "results": results,
    }
    save(args, record, "bench-server", lambda png: draw_png(png, results, title_of(cfg)))
    return 0


def _latencies(raw: str) -> tuple[float, ...]:
    def item(x: str) -> float:
        v = float(x)
        if not (v >= 0 and v != float("inf")):
            raise ValueError(f"{x!r} is not a latency")
        return v

    values = _parse_list("--latency-ms", raw, item, "numbers >= 0 (ms), comma-separated")
    return tuple(dict.fromkeys(values))


def _arms(raw: str) -> tuple[str, ...]:
    def item(x: str) -> str:
        if x.lower() not in ARMS:
            raise ValueError(f"{x!r} is not one of them")
        return x.lower()

    accepted = f"a comma-separated list of {', '.join(ARMS)}"
    return tuple(dict.fromkeys(_parse_list("--arms", raw, item, accepted)))


SUMMARY = "plugin vs stock on SGLang's real server (cpu-server), driven by bench_serving"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-server", help=SUMMARY, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tp", type=int_in("--tp", 1, 8), default=2, help="TP ranks (default 2)")
    p.add_argument(
        "--runs",
        type=int_in("--runs", 1),
        default=3,
        help="bench_serving runs per arm (default 3; the table shows medians)",
    )
    p.add_argument("--arms", type=_arms, default=ARMS, help="stock,plugin (default both)")
    p.add_argument(
        "--latency-ms",
        type=_latencies,
        default=(0.0, 3.0),
        help="injected latency per HiCache all_reduce inside the servers, one "
        "server per arm and value (default 0,3)",
    )
    p.add_argument("--num-groups", type=int_in("--num-groups", 1), default=8)
    p.add_argument("--prompts-per-group", type=int_in("--prompts-per-group", 1), default=8)
    p.add_argument("--system-prompt-len", type=int_in("--system-prompt-len", 1), default=128)
    p.add_argument("--question-len", type=int_in("--question-len", 1), default=32)
    p.add_argument("--output-len", type=int_in("--output-len", 1), default=16)
    p.add_argument("--request-rate", default="inf", help="bench_serving's (default inf)")
    p.add_argument("--max-concurrency", type=int_in("--max-concurrency", 1), default=None)
    p.add_argument(
        "--max-total-tokens",
        type=int_in("--max-total-tokens", 64),
        default=512,
        help="device KV pool (default 512: small, so prefixes go to host)",
    )
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more launch_server argument (repeat; e.g. "
        "--server-arg=--disable-overlap-schedule)",
    )
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--workdir", help="server and bench_serving logs (default: a temp dir)")
    p.add_argument("--out", metavar="FILE.jsonl", help="append one JSON object per run")
    p.add_argument("--png", metavar="FILE")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)
    return p
