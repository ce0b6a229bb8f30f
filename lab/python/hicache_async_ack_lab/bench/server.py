"""``hicache-async-ack-lab bench-server``: the seed's arms on SGLang's real server.

Each arm is a real ``launch_server`` on this CPU-only host (``cpu-server``):

- ``l1``: the same server without ``--enable-hierarchical-cache`` (no host pool);
- ``stock``: L2 (HiCache), SGLang's blocking ack-count all_reduce;
- ``plugin``: L2 with the plugin pipelining it;
- ``bound``: L2 with every HiCache collective answered by the rank's own value
  (cpu-server's ``--cpu-bound``: valid because on CPU without skew every rank's
  counts are equal; a measurement device, never a mode a server can be put in);
- ``local``: the plugin, a step late as usual, with its reduces answered by the
  rank's own value (``--cpu-local-reduce``, valid as the bound is): it splits
  plugin / bound into the step-late pop's cost (local / bound) and the real
  collective's (plugin / local).

``--latency-ms`` models a host whose gloo all_reduce is slow (the seed's B200 host:
3.2 ms) inside the L2 servers; l1, the bound and local delay no HiCache collective,
so one measurement of each stands for every latency.

Workloads: ``gsp`` (the quick default), bench_serving's generated-shared-prefix;
``multiturn``, the seed's shape: ``--lanes`` concurrent conversations x ``--turns``
turns, each turn the whole history plus a new question, replayed by bench_serving
over the chat API with the server's real replies (``multiturn.py``). A list of
``--lanes`` is a sweep. ``shared-prompt`` (with ``--storage mooncake``): one system
prompt read from L3 by many requests, stock against the plugin's read-once
(``shared_prompt.py``).

Rounds: every round starts every arm's server afresh (an idle server's scheduler
spins on a core, so two cannot wait side by side on 2 cores, and a fresh start
each round puts the server-to-server spread into the interval instead of hiding
it), in an order that reverses from one round to the next (``stats.round_order``:
a linear drift of the box's load cancels in every ratio). Ratios are taken per
round; each is printed with its 95% interval and a verdict on its claim, which is
"inconclusive" where the interval spans the claim's threshold.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from hicache_async_ack_lab.bench import multiturn, pd, shared_prompt, storage
from hicache_async_ack_lab.bench.arms import (
    ARMS,
    DEFAULT_ARMS,
    WORKLOADS,
    arm_env,
    check_arm,
    config_of,
    load_visits,
    plugin_state,
    rounds_of,
    server_args,
)
from hicache_async_ack_lab.bench.driver import add_int, choice_list, list_of, save, versions
from hicache_async_ack_lab.bench.server_report import draw_png, print_report, ratios
from hicache_async_ack_lab.cli_support import ToolError

FIGURES = (
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("median_itl_ms", "ITL p50 ms"),
)
DEFAULT_LATENCIES_MS = (0.0, 3.2)
BENCH_TIMEOUT_S = 900.0  # one bench_serving run; a stuck server fails the arm
START_ATTEMPTS, START_RETRY_S = 3, 30.0
# The config's keys bench_serving takes as --gsp-<key>, in the order they are passed.
GSP_SIZES = ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len")


def gsp_args(cfg: dict, port: int, model: Path, out: Path, seed: int) -> list[str]:
    """bench_serving's argv (without the interpreter) for one generated-shared-prefix run."""
    args = [
        *multiturn.serving_args("sglang", port, model),
        "--dataset-name",
        "generated-shared-prefix",
    ]
    for key in GSP_SIZES:  # --gsp-num-groups N, ...
        args += [f"--gsp-{key.replace('_', '-')}", str(cfg[key])]
    args += [
        "--request-rate", str(cfg["request_rate"]),
        "--cache-report", "--flush-cache", "--disable-tqdm",
        "--seed", str(seed),
        "--output-file", str(out),
    ]  # fmt: skip
    if cfg["max_concurrency"]:
        args += ["--max-concurrency", str(cfg["max_concurrency"])]
    return args


def visit(cfg: dict, conf: tuple, rnd: int, workdir: Path, quiet: bool) -> dict:
    """Start ``conf``'s server afresh, run ``--runs`` bench_serving runs, stop it."""
    from hicache_async_ack_lab.cpu_server import Server
    from hicache_async_ack_lab.cpu_server.model import ensure_model

    arm, latency_ms, lanes = conf
    model = ensure_model()
    name = f"{arm}-{latency_ms:g}ms" + (f"-{lanes}lanes" if lanes else "") + f"-r{rnd}"
    load_start = os.getloadavg()
    server = Server(
        server_args(cfg, arm),
        env=arm_env(arm),
        latency_ms=latency_ms,
        log_path=workdir / f"server-{name}.log",
        start_timeout_s=cfg["start_timeout_s"],
    )
    t0 = time.monotonic()
    attempts = start(server, name, quiet)
    try:
        argvs = []
        for r in range(cfg["runs"]):
            out = workdir / f"bench-{name}-{r}.jsonl"
            seed = cfg["seed"] + r
            if cfg["workload"] == "multiturn":
                trace = multiturn.write_trace(workdir / f"trace-{name}-{r}.json", cfg, lanes, seed)
                argvs.append(multiturn.bench_args(cfg, server.port, model, trace, lanes, out))
            else:
                argvs.append(gsp_args(cfg, server.port, model, out, seed))
        results, loads = multiturn.run_client(argvs, workdir, name, BENCH_TIMEOUT_S)
        state = plugin_state(server) if arm != "l1" else {"pipelined_ranks": 0}
    finally:
        server.stop()
    check_arm(cfg, arm, state, server, name)
    check_served(cfg, server, name, results)
    runs = [
        {key: res.get(key) for key, _ in FIGURES}
        | {
            "completed": res.get("completed"),
            "total_output_tokens": res.get("total_output_tokens"),
            "duration": res.get("duration"),
            "host_share": multiturn.host_share(res),
            "cache_report": res.get("cache_report"),
        }
        | load
        for res, load in zip(results, loads)
    ]
    tputs = [float(x["output_throughput"]) for x in runs if x["output_throughput"]]
    rec = {
        "arm": arm,
        "latency_ms": latency_ms,
        "lanes": lanes,
        "round": rnd,
        "startup_s": server.startup_s,
        "start_attempts": attempts,
        "wall_s": time.monotonic() - t0,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "output_throughput": sum(tputs) / len(tputs) if tputs else None,
        "runs": runs,
        **state,
    }
    if not quiet:
        share = [x["host_share"] for x in runs if x["host_share"] is not None]
        print(
            f"[round {rnd + 1}] {name}: {rec['output_throughput'] or 0:.1f} out tok/s"
            + (f", host hits {100 * share[0]:.0f}% of prompt tokens" if share else "")
            + f", load {load_start[0]:.1f} -> {rec['loadavg_end'][0]:.1f}",
            file=sys.stderr,
        )
    return rec


REFUSED_MARK = "exceeds the maximum allowed length"  # SGLang's refusal of a long input


def check_served(cfg: dict, server, name: str, results: list[dict]) -> None:
    """Every request must have been served: SGLang answers an input longer than the
    context a 512-token pool allows with an error at once, which bench_serving counts
    as completed and which would make the arm look faster for doing less."""
    refused = server.log().count(REFUSED_MARK)
    if refused:
        raise ToolError(
            f"{name}: the server refused {refused} request(s) as longer than its context "
            f"(device pool {cfg['max_total_tokens']} tokens): raise --max-total-tokens or "
            f"shorten the prompts; see {server.log_path}"
        )
    for res in results:
        want = (res.get("completed") or 0) * cfg["output_len"]
        if want and (res.get("total_output_tokens") or 0) < want:
            raise ToolError(
                f"{name}: {res.get('total_output_tokens')} output tokens for "
                f"{res.get('completed')} requests of {cfg['output_len']}: some got no "
                f"reply; see {server.log_path}"
            )


def start(server, name: str, quiet: bool) -> int:
    """Start the server; on a shared box a start can fail for want of memory another
    job holds for a moment (SGLang sizes its host pool against free memory), so a
    failed start is retried twice after a pause. The attempts go in the record."""
    from hicache_async_ack_lab.cpu_server import ServerFailed

    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            server.start()
            return attempt
        except ServerFailed as exc:
            if attempt == START_ATTEMPTS:
                raise ToolError(
                    f"{name}: the server did not start {attempt} times: {exc}"
                ) from None
            if not quiet:
                last = str(exc).strip().splitlines()[-1:] or [""]
                print(
                    f"[{name}] start {attempt} failed ({last[0][:120]}); retrying in "
                    f"{START_RETRY_S:.0f} s",
                    file=sys.stderr,
                )
            time.sleep(START_RETRY_S)
    raise AssertionError("unreachable")


def run(args) -> int:
    if args.workload == shared_prompt.WORKLOAD:  # one prompt read from L3 by many
        # argparse hands a left-out option its default object itself: ``is`` tells it
        # from the same value typed, so these defaults are the workload's own
        if args.arms is DEFAULT_ARMS:
            args.arms = shared_prompt.ARMS
        if args.latency_ms is DEFAULT_LATENCIES_MS:
            args.latency_ms = (0.0,)
        return shared_prompt.run(args)
    if shared_prompt.READ_ONCE in args.arms:
        raise ToolError(f"the {shared_prompt.READ_ONCE} arm runs only with --workload "
                        f"{shared_prompt.WORKLOAD} (and --storage mooncake)")  # fmt: skip
    if storage.wanted(args):  # requests waiting on L3 prefetches instead (storage.py)
        return storage.run(args)
    if args.workload == "pd":  # a PD pair's decode offload sync instead (pd.py)
        return pd.run(args)
    cfg = config_of(args)
    # SIGTERM unwinds like Ctrl-C, so the server and client of the visit stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for device in ("bound", "local"):
        if device in cfg["arms"] and any("skew" in a for a in cfg["server_args"]):
            raise ToolError(
                f"the {device} arm is only valid without skew (every rank's counts equal)"
            )
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hicache-bench-server-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()
    t0 = time.monotonic()
    visits = []
    if args.from_visits:  # an earlier run's visits, complete or cut short: report only
        visits = load_visits(args.from_visits)
        cfg["rounds"] = len({v["round"] for v in visits})
        load_at_start = visits[0]["loadavg_start"] if visits else load_at_start
    for rnd, order in enumerate([] if args.from_visits else rounds_of(cfg)):
        for conf in order:
            visits.append(visit(cfg, conf, rnd, workdir, args.quiet))
            with open(workdir / "visits.jsonl", "a") as f:  # survives a failed later visit
                f.write(json.dumps(visits[-1]) + "\n")
    wall_s = sum(v["wall_s"] for v in visits) if args.from_visits else time.monotonic() - t0
    table = ratios(cfg, visits)
    load_end = visits[-1]["loadavg_end"] if args.from_visits and visits else os.getloadavg()
    print_report(cfg, visits, table, load_at_start, load_end, wall_s, workdir)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kind": "server",
        "config": cfg,
        "versions": versions(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": load_at_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": wall_s,
        "visits": visits,
        "ratios": table,
    }
    save(args, record, "bench-server", lambda png: draw_png(png, cfg, visits, table))
    return 0


def _latency(x: str) -> float:
    v = float(x)
    if not (v >= 0 and v != float("inf")):
        raise ValueError(f"{x!r} is not a latency")
    return v


def _lane_count(x: str) -> int:
    v = int(x)
    if v < 1:
        raise ValueError(f"{x!r} is below 1")
    return v


SUMMARY = "the seed's arms (l1, stock, plugin, bound, local) on SGLang's real server (cpu-server)"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench-server",
        help=SUMMARY,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_int(p, "--tp", 2, hi=8, help="TP ranks (default 2)")
    p.add_argument(
        "--arms",
        type=choice_list("--arms", (*ARMS, shared_prompt.READ_ONCE)),
        default=DEFAULT_ARMS,
        help=f"comma-separated, of {', '.join(ARMS)}, {shared_prompt.READ_ONCE} (default "
        f"stock,plugin; {','.join(shared_prompt.ARMS)} for --workload {shared_prompt.WORKLOAD})",
    )
    p.add_argument(
        "--latency-ms",
        type=list_of("--latency-ms", _latency, "numbers >= 0 (ms), comma-separated"),
        default=DEFAULT_LATENCIES_MS,
        help="injected latency per HiCache all_reduce inside the L2 servers "
        f"(default 0,3.2: the seed's B200 host; 0 for --workload {shared_prompt.WORKLOAD})",
    )
    rounds_help = (
        "rounds; every arm once per round, order reversed each round; "
        "an interval needs 2, a useful one 5+ (default 3)"
    )
    add_int(p, "--rounds", 3, help=rounds_help)
    add_int(p, "--runs", 1, help="bench_serving runs per arm per round, averaged (default 1)")
    p.add_argument(
        "--workload",
        choices=(*WORKLOADS, shared_prompt.WORKLOAD),
        default="gsp",
        help="gsp: generated-shared-prefix (quick, default); multiturn: the "
        "seed's N lanes x M turns; pd: a PD pair (prefill TP 1, decode TP --tp with "
        "KV offload), gsp's requests through SGLang's PD router, arms stock, plugin, bound; "
        f"{shared_prompt.WORKLOAD} (with --storage mooncake): one system prompt read from "
        "L3 by many requests, L3 reads counted by mooncake_master",
    )
    g = p.add_argument_group("gsp workload")
    add_int(g, "--num-groups", 8)
    add_int(g, "--prompts-per-group", 8)
    add_int(g, "--system-prompt-len", 128)
    add_int(g, "--question-len", 32)
    g.add_argument("--request-rate", default="inf", help="bench_serving's (default inf)")
    add_int(g, "--max-concurrency", None)
    m = p.add_argument_group("multiturn workload")
    m.add_argument(
        "--lanes",
        type=list_of("--lanes", _lane_count, "integers >= 1, e.g. 4,8,16"),
        default=(8,),
        help="concurrent conversations; a list (4,8,16,32) is a sweep (default 8)",
    )
    add_int(m, "--turns", 6, help="default 6")
    add_int(m, "--system-words", 60)
    add_int(m, "--question-words", 15)
    add_int(p, "--output-len", 16, help="tokens per reply (default 16)")
    add_int(
        p,
        "--max-total-tokens",
        None,
        lo=64,
        help="device KV pool (default 512 for gsp and --storage: small, so prefixes go "
        "to host; 2048 for multiturn, whose longest history, ~950 tokens at the "
        "defaults, must fit one request's context)",
    )
    p.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help="host pool / device pool (default 4 for gsp; 16 for multiturn, so "
        "the host holds 8 lanes' histories; 32 with --storage, so SGLang's prefetch "
        "budget, half the host pool, takes a whole burst)",
    )
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
    p.add_argument(
        "--from-visits",
        metavar="VISITS.jsonl[,...]",
        help="run nothing: report earlier runs' visits (each workdir's visits.jsonl, "
        "also of a run cut short; several, comma-separated, pool their rounds), with "
        "the same options that described them",
    )
    p.add_argument("--workdir", help="server and bench_serving logs (default: a temp dir)")
    p.add_argument("--out", metavar="FILE.jsonl", help="append one JSON object per invocation")
    p.add_argument("--png", metavar="FILE")
    p.add_argument("--quiet", action="store_true")
    storage.add_arguments(p)
    shared_prompt.add_arguments(p)
    p.set_defaults(func=run)
    return p
