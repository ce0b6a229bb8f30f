"""``bench-server --workload pd``: the decode offload sync in a real PD pair.

Each round starts a fresh cpu-server PD pair (cpu_server/pd.py: prefill TP 1, decode
TP ``--tp`` with KV offload to a file store, SGLang's PD router, Mooncake TCP, a private
network namespace); each arm of the round gets a fresh decode server (and router)
beside that prefill, and is driven through the router with bench_serving's
generated-shared-prefix workload in one interpreter inside the namespace. The arms
differ on the decode side only (the prefill is the same for all, so sharing it within
a round costs no fairness and saves a start per arm):

- ``stock``: SGLang's blocking MIN all_reduce in ``check_offload_progress`` every
  decode step (with an injected latency, it sleeps that long first);
- ``plugin``: the plugin pipelining it (its async reduce completes no earlier than the
  injected latency after issue);
- ``bound``: that reduce answered with each rank's own queue sizes (cpu-server's
  ``--cpu-bound``; no collective to delay, so its one measurement stands for every
  latency).

Stock's and the plugin's decode servers serve every ``--latency-ms`` in one process:
``--runs`` blocks of one run per latency, every other block reversed (0, 3.2, 3.2, 0,
...), the latency switched between runs through a latency file
(``HICACHE_ASYNC_ACK_CPU_REDUCE_LATENCY_FILE``). A latency's ratio to its own 0 ms is
then paired within one server, free of what differs from one start to the next.

Before a round's first visit, its requests run once unmeasured (``warm_prefill``), so
every visit finds the prefill's prefix cache alike. Figures per arm and latency:
bench_serving's output throughput (decode output tokens per second of the pair) and
median inter-token latency, averaged over the runs, and the mean time
``check_offload_progress`` took per decode-loop pass (pd_standins.PassTimes), for
passes that began with a running batch (they launch a decode forward: this time is on
the inter-token latency's path) and for the rest; ratios paired by round with 95%
intervals (stats.py). Claims: the plugin keeps >= 0.95 of its own 0 ms at every
injected latency; plugin / stock is printed with its interval, whatever it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

from hicache_async_ack_lab.bench.multiturn import run_bench_client
from hicache_async_ack_lab.bench.pd_report import (
    FIGURES,
    PD_ARMS,
    arm_table,
    draw_png,
    ratio_table,
    ratios,
    sync_rows,
    sync_table,
    title_of,
)
from hicache_async_ack_lab.cli_support import ToolError

GAUGE = "sglang:hicache_decode_offload_sync_pipelined"
CLIENT_TIMEOUT_S = 900.0


def client_args(cfg: dict, port: int, model: Path, out: Path, seed: int) -> list[str]:
    """bench_serving's argv for one run against the router (no /flush_cache: the
    router does not serve it, and the decode holds no prefix cache)."""
    args = [
        "--backend", "sglang", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(cfg["num_groups"]),
        "--gsp-prompts-per-group", str(cfg["prompts_per_group"]),
        "--gsp-system-prompt-len", str(cfg["system_prompt_len"]),
        "--gsp-question-len", str(cfg["question_len"]),
        "--gsp-output-len", str(cfg["output_len"]),
        "--request-rate", str(cfg["request_rate"]),
        "--disable-tqdm", "--seed", str(seed), "--output-file", str(out),
    ]  # fmt: skip
    if cfg["max_concurrency"]:
        args += ["--max-concurrency", str(cfg["max_concurrency"])]
    return args


def run_client(pair, argvs: list[list[str]], workdir: Path, name: str,
               latencies: Optional[list[float]] = None,
               latency_file: Optional[Path] = None) -> list[dict]:  # fmt: skip
    """bench_serving once per argv, in one interpreter born in the pair's namespace;
    with ``latency_file``, run i starts once the file says ``latencies[i]``."""
    spec = workdir / f"client-{name}.json"
    lats: list[Optional[float]] = list(latencies) if latencies else [None] * len(argvs)
    spec.write_text(json.dumps({
        "latency_file": str(latency_file) if latency_file else None,
        "runs": [{"argv": a, "latency_ms": lat} for a, lat in zip(argvs, lats)],
    }))  # fmt: skip
    module = ["hicache_async_ack_lab.bench.pd", str(spec)]
    spawn = partial(pair.ns.call, subprocess.Popen)
    return run_bench_client(module, argvs, workdir, name, CLIENT_TIMEOUT_S, spawn)


def arm_of(arm: str) -> dict:
    from hicache_async_ack_lab.bench.arms import arm_env

    return arm_env(arm)


def pipelined_ranks(pair) -> int:
    """How many decode ranks the plugin's gauge says pipeline (the decode's /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    return int(sum(s.value for f in text_string_to_metric_families(
        pair.decode.get("/metrics").decode()) for s in f.samples if s.name == GAUGE))  # fmt: skip


def check_arm(cfg: dict, arm: str, ranks: int, log: str, name: str) -> None:
    from hicache_async_ack_lab.cpu_server.bound import BOUND_MARK

    want = cfg["tp"] if arm == "plugin" else 0
    if ranks != want:
        raise ToolError(f"{name}: {ranks} decode ranks pipelined, expected {want}")
    if (arm == "bound") != (BOUND_MARK in log):
        raise ToolError(f"{name}: the bound's mark {'missing' if arm == 'bound' else 'on'}")


def visit_order(cfg: dict) -> list[list[tuple[str, tuple[float, ...]]]]:
    """Per round, one decode server per arm, forward in even rounds and backward in odd
    ones (stats.round_order). Stock and the plugin serve every latency in theirs; the
    bound 0 ms only (it has no collective to delay)."""
    from hicache_async_ack_lab.bench.stats import round_order

    visits = [(arm, (0.0,) if arm == "bound" else tuple(cfg["latencies_ms"]))
              for arm in PD_ARMS if arm in cfg["arms"]]  # fmt: skip
    return round_order(visits, cfg["rounds"])


def run_sequence(latencies: Sequence[float], runs: int) -> list[tuple[float, int]]:
    """(latency, block) of each run of a visit: ``runs`` blocks with every latency once,
    every other block reversed (0, 3.2, 3.2, 0, ...), so a drift linear in time over
    an even number of blocks adds the same to every latency. Block b runs seed + b for
    every latency: each latency gets the same prompts."""
    out = []
    for block in range(runs):
        order = list(latencies) if block % 2 == 0 else list(latencies)[::-1]
        out += [(lat, block) for lat in order]
    return out


def run_round(cfg: dict, order: list, rnd: int, workdir: Path, quiet: bool) -> list[dict]:
    """One round: a fresh pair (prefill and the first arm's decode), then a fresh decode
    server (and router) beside the same prefill for every further arm; each decode
    serves every latency of its arm, switched between runs through a latency file."""
    from hicache_async_ack_lab.cpu_server.pd import PDPair

    out: list[dict] = []
    pair = PDPair(
        ["--enable-metrics", *cfg["server_args"]], workdir=workdir / f"pd-r{rnd}",
        decode_tp=cfg["tp"], start_timeout_s=cfg["start_timeout_s"],
    )  # fmt: skip
    try:
        for i, (arm, lats) in enumerate(order):
            name = f"pd-{arm}-r{rnd}"
            visit = Visit(arm, tuple(lats), pair.workdir / name)
            load_start, t0 = os.getloadavg(), time.monotonic()
            if i == 0:
                pair.decode_env = visit.env()
                pair.start()
                warm_prefill(cfg, pair, rnd, workdir)
            else:
                pair.restart_decode(visit.env(), 0.0, name)
            recs = measure(cfg, pair, visit, rnd, workdir, name)
            wall = time.monotonic() - t0
            for rec in recs:
                rec |= {"loadavg_start": load_start, "wall_s": wall / len(recs)}
            out += recs
            with open(workdir / "visits.jsonl", "a") as f:  # survives a failed later visit
                f.writelines(json.dumps(rec) + "\n" for rec in recs)
            if not quiet:
                for rec in recs:
                    print(f"[round {rnd + 1}] {name} at {rec['latency_ms']:g} ms: "
                          f"{rec['output_throughput'] or 0:.1f} out tok/s, ITL "
                          f"{rec['median_itl_ms'] or 0:.2f} ms, sync "
                          f"{rec['sync_ms_running']:.3f} ms per pass with a running batch, "
                          f"load {load_start[0]:.1f} -> {rec['loadavg_end'][0]:.1f}",
                          file=sys.stderr, flush=True)  # fmt: skip
    finally:
        pair.stop()
    return out


class Visit:
    """One arm's decode server in a round: its latencies, the file that switches them,
    and where its ranks write their check times (pd_standins.PassTimes)."""

    def __init__(self, arm: str, latencies: tuple[float, ...], root: Path):
        self.arm, self.latencies = arm, latencies
        self.times_dir = root / "passes"
        # the bound refuses an injected latency, even a file saying 0
        self.latency_file = None if arm == "bound" else root / "latency_ms"

    def env(self) -> dict[str, str]:
        from hicache_async_ack_lab.cpu_server.pd_standins import PASS_TIMES_DIR_VAR
        from hicache_async_ack_lab.cpu_server.settings import (
            CPU_REDUCE_LATENCY_FILE_VAR,
            write_latency_file,
        )

        env = arm_of(self.arm) | {PASS_TIMES_DIR_VAR: str(self.times_dir)}
        if self.latency_file is not None:
            self.latency_file.parent.mkdir(parents=True, exist_ok=True)
            write_latency_file(self.latency_file, self.latencies[0])
            env[CPU_REDUCE_LATENCY_FILE_VAR] = str(self.latency_file)
        return env


def client_argvs(cfg: dict, pair, workdir: Path, name: str,
                 blocks: Sequence[int]) -> list[list[str]]:  # fmt: skip
    from hicache_async_ack_lab.cpu_server.model import ensure_model

    model = ensure_model()
    return [client_args(cfg, pair.router_port, model, workdir / f"bench-{name}-{i}.jsonl",
                        cfg["seed"] + b) for i, b in enumerate(blocks)]  # fmt: skip


def warm_prefill(cfg: dict, pair, rnd: int, workdir: Path) -> None:
    """The round's requests once, unmeasured, on a fresh pair. The prefill lives for the
    whole round and every visit sends it the same prompts: without this, the first visit
    computes every prefill (~2,200 new tokens, competing with the decode ranks for the
    2 cores) and the later ones hit its prefix cache (~30), a penalty that falls on
    whichever arm comes first in the round."""
    name = f"pd-warmup-r{rnd}"
    run_client(pair, client_argvs(cfg, pair, workdir, name, range(cfg["runs"])), workdir, name)


PASS_TIMES_SETTLE_S = 1.5  # > PassTimes.WRITE_EVERY_S: the files hold the last run


def pass_times_since(before: dict, after: dict) -> dict:
    """``after`` less ``before``, cell by cell (passes, seconds and popping are running
    sums; the longest pass is kept as ``after`` has it)."""
    out: dict = {}
    for rank, lats in after.items():
        for lat, kinds in lats.items():
            for kind, cell in kinds.items():
                old = before.get(rank, {}).get(lat, {}).get(kind, [0, 0.0, 0.0, 0.0])
                new = [cell[0] - old[0], cell[1] - old[1], cell[2], cell[3] - old[3]]
                out.setdefault(rank, {}).setdefault(lat, {})[kind] = new
    return out


def pass_figures(times: dict, latency_ms: float) -> dict:
    """Per pass kind, at one latency, over every rank's passes: how many, and the mean
    ms per pass of the whole check, of the sync alone (the check less upstream's pops)
    and of the pops."""
    from hicache_async_ack_lab.cpu_server.pd_standins import PASS_KINDS

    key, out = f"{latency_ms:g}", {}
    for kind in PASS_KINDS:
        cells = [rank[key][kind] for rank in times.values() if key in rank]
        n = sum(c[0] for c in cells)
        check, pops = sum(c[1] for c in cells), sum(c[3] for c in cells)
        out[f"passes_{kind}"] = n
        for name, total in (("check", check), ("sync", check - pops), ("pops", pops)):
            out[f"{name}_ms_{kind}"] = 1000.0 * total / n if n else 0.0
    return out


def measure(cfg: dict, pair, visit: Visit, rnd: int, workdir: Path, name: str) -> list[dict]:
    """``--runs`` blocks of bench_serving runs against the pair's router, the latency
    switched between runs (run_sequence); the arm checked; one record per latency."""
    from hicache_async_ack_lab.cpu_server.pd_standins import read_pass_times

    seq = run_sequence(visit.latencies, cfg["runs"])
    argvs = client_argvs(cfg, pair, workdir, name, [b for _, b in seq])
    # what came before (SGLang's start-up request, the round's warm-up, idle passes)
    time.sleep(PASS_TIMES_SETTLE_S)
    before = read_pass_times(visit.times_dir)
    results = run_client(pair, argvs, workdir, name, [lat for lat, _ in seq],
                         visit.latency_file)  # fmt: skip
    arm, ranks = visit.arm, pipelined_ranks(pair)
    check_arm(cfg, arm, ranks, pair.decode.log(), name)
    want = cfg["num_groups"] * cfg["prompts_per_group"] * cfg["output_len"]
    for res in results:
        if (res.get("total_output_tokens") or 0) < want:
            raise ToolError(f"{name}: {res.get('total_output_tokens')} output tokens of "
                            f"{want}; see {pair.workdir}")  # fmt: skip
    time.sleep(PASS_TIMES_SETTLE_S)
    times = pass_times_since(before, read_pass_times(visit.times_dir))
    if len(times) != cfg["tp"]:
        raise ToolError(f"{name}: check times from {len(times)} decode ranks of {cfg['tp']} "
                        f"in {visit.times_dir}")  # fmt: skip
    recs = []
    for lat in visit.latencies:
        runs = [{k: res.get(k) for k, _ in FIGURES} | {"completed": res.get("completed"),
                 "duration": res.get("duration"), "median_ttft_ms": res.get("median_ttft_ms")}
                for res, (x, _) in zip(results, seq) if x == lat]  # fmt: skip
        figures = pass_figures(times, lat)
        if not figures["passes_running"]:
            raise ToolError(f"{name}: no decode pass with a running batch at {lat:g} ms "
                            f"(the latency file did not reach the ranks?); see "
                            f"{visit.times_dir}")  # fmt: skip
        rec = {"arm": arm, "latency_ms": lat, "lanes": None, "round": rnd, "visit": name,
               "startup_s": pair.startup_s, "loadavg_end": os.getloadavg(),
               "pipelined_ranks": ranks, "runs": runs} | figures  # fmt: skip
        for key, _ in FIGURES:
            vals = [float(x) for x in (r.get(key) for r in runs) if x]
            rec[key] = sum(vals) / len(vals) if vals else None
        recs.append(rec)
    return recs


def run(args) -> int:
    from hicache_async_ack import __version__
    from hicache_async_ack_lab.bench.arms import config_of, load_visits
    from hicache_async_ack_lab.bench.driver import save, versions

    cfg = config_of(args)
    if set(cfg["arms"]) - set(PD_ARMS):
        raise ToolError(f"--workload pd runs the arms {', '.join(PD_ARMS)}")
    if cfg["tp"] < 2:
        raise ToolError("--workload pd: --tp is the decode's, and needs 2 or more ranks")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hicache-bench-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_at_start, t0 = os.getloadavg(), time.monotonic()
    visits = load_visits(args.from_visits) if args.from_visits else []
    if visits:
        cfg["rounds"] = len({v["round"] for v in visits})
        load_at_start = visits[0]["loadavg_start"]
    for rnd, order in enumerate([] if visits else visit_order(cfg)):
        visits += run_round(cfg, order, rnd, workdir, args.quiet)
    rows = ratios(cfg, visits)
    servers = len({(v["round"], v.get("visit", v["arm"] + str(v["latency_ms"]))) for v in visits})
    wall = sum(v["wall_s"] for v in visits) if args.from_visits else time.monotonic() - t0
    load_at_end = visits[-1]["loadavg_end"] if args.from_visits and visits else os.getloadavg()
    print(f"hicache-async-ack-lab bench-server --workload pd {__version__}: {title_of(cfg)}")
    print(f"host: {os.cpu_count()} CPUs, load average {load_at_start[0]:.2f} at start, "
          f"{load_at_end[0]:.2f} at end; {servers} decode servers in {wall / 60:.1f} min; "
          f"logs in {workdir}")  # fmt: skip
    print(arm_table(visits))
    print()
    print(ratio_table(rows))
    syncs = sync_rows(cfg, visits)
    if syncs:
        print()
        print(sync_table(syncs))
    print("ITL ratios are inverted (the denominator's ITL over the numerator's): > 1 is "
          "faster, as for tok/s. bound: the decode offload MIN answered with each rank's "
          "own queue sizes (valid on CPU without skew).")  # fmt: skip
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kind": "server-pd", "config": cfg,
              "versions": versions(), "cpu_count": os.cpu_count(), "wall_s": wall,
              "visits": visits, "ratios": rows, "sync_added": syncs}  # fmt: skip
    save(args, record, "bench-server-pd", lambda png: draw_png(png, cfg, visits))
    return 0


def main(argv: list[str]) -> int:
    """Run bench_serving once per run in ``argv[0]`` (a JSON file), each after writing
    its latency to the spec's latency file (when it has one)."""
    spec = json.loads(Path(argv[0]).read_text())
    from sglang.benchmark.serving import cli_main

    from hicache_async_ack_lab.cpu_server.settings import write_latency_file

    for i, run in enumerate(spec["runs"]):
        if spec["latency_file"]:
            write_latency_file(spec["latency_file"], run["latency_ms"])
        sys.argv = ["bench_serving", *run["argv"]]
        print(f"=== hicache-async-ack: bench_serving run {i + 1}/{len(spec['runs'])}"
              f" (injected {run['latency_ms']} ms)", flush=True)  # fmt: skip
        cli_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
