"""``bench-server --workload pd``: the decode offload sync in a real PD pair.

Each round starts a fresh cpu-server PD pair (cpu_server/pd.py: prefill TP 1, decode
TP ``--tp`` with KV offload to a file store, SGLang's PD router, Mooncake TCP, a private
network namespace); each arm of the round gets a fresh decode server (and router)
beside that prefill, and is driven through the router with bench_serving's
generated-shared-prefix workload, run ``--runs`` times in one interpreter inside the
namespace. The arms differ on the decode side only (the prefill is the same for all,
so sharing it within a round costs no fairness and saves a start per arm):

- ``stock``: SGLang's blocking MIN all_reduce in ``check_offload_progress`` every
  decode step (with ``--latency-ms``, it sleeps that long first);
- ``plugin``: the plugin pipelining it (its async reduce completes no earlier than the
  injected latency after issue);
- ``bound``: that reduce answered with each rank's own queue sizes (cpu-server's
  ``--cpu-bound``; no collective to delay, so its one measurement stands for every
  latency).

Before a round's first visit, its requests run once unmeasured (``warm_prefill``), so
every visit finds the prefill's prefix cache alike. Figures per visit: bench_serving's
output throughput (decode output tokens per second of the pair) and median
inter-token latency, averaged over the runs, and the plugin's mean wait on the due
reduce per decode-loop pass (the fresh decode's /metrics); ratios paired by round
with 95% intervals (stats.py). Claims: the plugin keeps >= 0.95 of its own 0 ms
at every injected latency; plugin / stock is printed with its interval, whatever it is.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from hicache_async_ack.tools.options import ToolError
from hicache_async_ack_lab.bench.stats import Claim, paired_ratio, verdict
from hicache_async_ack_lab.bench.summary import render

PD_ARMS = ("stock", "plugin", "bound")
FIGURES = (("output_throughput", "out tok/s"), ("median_itl_ms", "ITL p50 ms"))
GAUGE = "sglang:hicache_decode_offload_sync_pipelined"
WAIT = "sglang:hicache_decode_offload_sync_wait_seconds"
HEADLINE = 0.95  # plugin at latency / its own 0 ms
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


def run_client(pair, argvs: list[list[str]], workdir: Path, name: str) -> list[dict]:
    """bench_serving once per argv, in one interpreter born in the pair's namespace."""
    spec, log = workdir / f"client-{name}.json", workdir / f"bench-{name}.log"
    spec.write_text(json.dumps(argvs))
    cmd = [sys.executable, "-m", "hicache_async_ack_lab.bench.pd", str(spec)]
    with open(log, "ab") as f:
        proc = pair.ns.call(
            subprocess.Popen, cmd, stdout=f, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(CLIENT_TIMEOUT_S * len(argvs))
        except BaseException:  # a timeout, Ctrl-C or SIGTERM: the client goes too
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = -9
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
    outs = [Path(a[a.index("--output-file") + 1]) for a in argvs]
    if rc != 0 or not all(o.exists() for o in outs):
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise ToolError(f"bench_serving failed (exit {rc}); its log {log}:\n" + "\n".join(tail))
    return [json.loads(o.read_text().strip().splitlines()[-1]) for o in outs]


def arm_of(arm: str) -> dict:
    from hicache_async_ack_lab.bench.arms import arm_env

    return arm_env(arm)


def decode_metrics(pair) -> tuple[int, float, int]:
    """(ranks pipelined, mean per-step wait on the due reduce in ms, steps) from the
    decode's /metrics: the wait says whether an injected latency reached the decode
    loop (the decode server is fresh per visit, so the histogram is this visit's)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(pair.decode.get("/metrics").decode())
               for s in f.samples]  # fmt: skip

    def total(name: str) -> float:
        return sum(s.value for s in samples if s.name == name)

    steps = int(total(WAIT + "_count"))
    wait_ms = 1000.0 * total(WAIT + "_sum") / steps if steps else 0.0
    return int(total(GAUGE)), wait_ms, steps


def check_arm(cfg: dict, arm: str, ranks: int, log: str, name: str) -> None:
    from hicache_async_ack_lab.cpu_server.bound import BOUND_MARK

    want = cfg["tp"] if arm == "plugin" else 0
    if ranks != want:
        raise ToolError(f"{name}: {ranks} decode ranks pipelined, expected {want}")
    if (arm == "bound") != (BOUND_MARK in log):
        raise ToolError(f"{name}: the bound's mark {'missing' if arm == 'bound' else 'on'}")


def run_round(cfg: dict, order: list, rnd: int, workdir: Path, quiet: bool) -> list[dict]:
    """One round: a fresh pair (prefill and the first arm's decode), then a fresh decode
    server (and router) beside the same prefill for every further arm."""
    from hicache_async_ack_lab.cpu_server.pd import PDPair

    out: list[dict] = []
    pair = PDPair(
        ["--enable-metrics", *cfg["server_args"]], workdir=workdir / f"pd-r{rnd}",
        decode_tp=cfg["tp"], start_timeout_s=cfg["start_timeout_s"],
    )  # fmt: skip
    try:
        for i, (arm, latency_ms, _) in enumerate(order):
            name = f"pd-{arm}-{latency_ms:g}ms-r{rnd}"
            load_start, t0 = os.getloadavg(), time.monotonic()
            if i == 0:
                pair.decode_env, pair.latency_ms = arm_of(arm), latency_ms
                pair.start()
                warm_prefill(cfg, pair, rnd, workdir)
            else:
                pair.restart_decode(arm_of(arm), latency_ms, name)
            out.append(measure(cfg, pair, (arm, latency_ms), rnd, workdir, name))
            out[-1] |= {"loadavg_start": load_start, "wall_s": time.monotonic() - t0}
            with open(workdir / "visits.jsonl", "a") as f:  # survives a failed later visit
                f.write(json.dumps(out[-1]) + "\n")
            if not quiet:
                rec = out[-1]
                print(f"[round {rnd + 1}] {name}: {rec['output_throughput'] or 0:.1f} out "
                      f"tok/s, ITL {rec['median_itl_ms'] or 0:.2f} ms, load "
                      f"{load_start[0]:.1f} -> {rec['loadavg_end'][0]:.1f}, wait on the due "
                      f"reduce {rec['offload_wait_ms']:.3f} ms/step",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        pair.stop()
    return out


def client_argvs(cfg: dict, pair, workdir: Path, name: str) -> list[list[str]]:
    from hicache_async_ack_lab.cpu_server.model import ensure_model

    model = ensure_model()
    return [client_args(cfg, pair.router_port, model, workdir / f"bench-{name}-{r}.jsonl",
                        cfg["seed"] + r) for r in range(cfg["runs"])]  # fmt: skip


def warm_prefill(cfg: dict, pair, rnd: int, workdir: Path) -> None:
    """The round's requests once, unmeasured, on a fresh pair. The prefill lives for the
    whole round and every visit sends it the same prompts: without this, the first visit
    computes every prefill (~2,200 new tokens, competing with the decode ranks for the
    2 cores) and the later ones hit its prefix cache (~30), a penalty that falls on
    whichever arm comes first in the round."""
    name = f"pd-warmup-r{rnd}"
    run_client(pair, client_argvs(cfg, pair, workdir, name), workdir, name)


def measure(cfg: dict, pair, conf: tuple, rnd: int, workdir: Path, name: str) -> dict:
    """``--runs`` bench_serving runs against the pair's router; the arm checked."""
    arm, latency_ms = conf
    results = run_client(pair, client_argvs(cfg, pair, workdir, name), workdir, name)
    ranks, wait_ms, steps = decode_metrics(pair)
    check_arm(cfg, arm, ranks, pair.decode.log(), name)
    want = cfg["num_groups"] * cfg["prompts_per_group"] * cfg["output_len"]
    for res in results:
        if (res.get("total_output_tokens") or 0) < want:
            raise ToolError(f"{name}: {res.get('total_output_tokens')} output tokens of "
                            f"{want}; see {pair.workdir}")  # fmt: skip
    runs = [{k: res.get(k) for k, _ in FIGURES} | {"completed": res.get("completed"),
             "duration": res.get("duration"), "median_ttft_ms": res.get("median_ttft_ms")}
            for res in results]  # fmt: skip
    rec = {"arm": arm, "latency_ms": latency_ms, "lanes": None, "round": rnd,
           "startup_s": pair.startup_s, "loadavg_end": os.getloadavg(),
           "pipelined_ranks": ranks, "offload_wait_ms": wait_ms, "offload_steps": steps,
           "runs": runs}  # fmt: skip
    for key, _ in FIGURES:
        vals = [float(x) for x in (r.get(key) for r in runs) if x]
        rec[key] = sum(vals) / len(vals) if vals else None
    return rec


# -- the report ------------------------------------------------------------------------


Spec = tuple[str, tuple, tuple, Optional[Claim]]


def ratio_specs(cfg: dict) -> list[tuple[str, tuple, tuple, Optional[Claim], float]]:
    """(name, numerator, denominator, claim or None: printed only, latency)."""
    arms = set(cfg["arms"])
    out: list[tuple[str, tuple, tuple, Optional[Claim], float]] = []
    for lat in cfg["latencies_ms"]:
        plugin, stock, bnd = ("plugin", lat, None), ("stock", lat, None), ("bound", 0.0, None)
        specs: list[Spec] = [("plugin / stock", plugin, stock, None),
                 ("plugin / bound", plugin, bnd, None),
                 ("stock / bound", stock, bnd, None)]  # fmt: skip
        if lat and 0.0 in cfg["latencies_ms"]:
            specs += [("plugin / own 0 ms", plugin, ("plugin", 0.0, None), Claim(HEADLINE)),
                      ("stock / own 0 ms", stock, ("stock", 0.0, None), None)]  # fmt: skip
        out += [(n, a, b, c, lat) for n, a, b, c in specs if a[0] in arms and b[0] in arms]
    return out


def ratios(cfg: dict, visits: list[dict]) -> list[dict]:
    """Every ratio of both figures, paired by round (ITL: lower is better, so its
    ratio is the denominator's ITL over the numerator's: > 1 is faster, as for tok/s)."""
    rows = []
    for key, label in FIGURES:
        by: dict = {}
        for v in visits:
            if v.get(key):
                by.setdefault((v["arm"], v["latency_ms"], None), {})[v["round"]] = v[key]
        for name, num, den, claim, lat in ratio_specs(cfg):
            a, b = by.get(num, {}), by.get(den, {})
            common = sorted(set(a) & set(b))
            if not common:
                continue
            x, y = [a[r] for r in common], [b[r] for r in common]
            iv = paired_ratio(y, x) if key == "median_itl_ms" else paired_ratio(x, y)
            rows.append({"figure": label, "ratio": name, "latency_ms": lat, "n": iv.n,
                         "value": iv.ratio, "low": iv.low, "high": iv.high,
                         "interval": iv.fmt(), "claim": str(claim) if claim else "-",
                         "verdict": verdict(iv, claim) if claim else "-"})  # fmt: skip
    return rows


def arm_table(visits: list[dict]) -> str:
    rows: list[tuple[str, ...]] = [("arm", "injected", "rounds", "out tok/s median", "range",
                                    "ITL p50 ms median", "range", "wait/step ms",
                                    "start-up s")]  # fmt: skip
    confs = sorted({(v["arm"], v["latency_ms"]) for v in visits},
                   key=lambda c: (c[1], PD_ARMS.index(c[0])))  # fmt: skip
    for arm, lat in confs:
        vs = [v for v in visits if (v["arm"], v["latency_ms"]) == (arm, lat)]
        cells = []
        for key, _ in FIGURES:
            vals = [v[key] for v in vs if v.get(key)]
            cells += [f"{statistics.median(vals):.2f}" if vals else "-",
                      f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"]  # fmt: skip
        ups = [v["startup_s"] for v in vs if v.get("startup_s")]
        waits = [v["offload_wait_ms"] for v in vs if v.get("offload_steps")]
        rows.append((arm, "-" if arm == "bound" else f"{lat:g} ms", str(len(vs)), *cells,
                     f"{statistics.median(waits):.3f}" if waits else "-",
                     f"{statistics.median(ups):.0f}" if ups else "-"))  # fmt: skip
    return render(rows)


def ratio_table(rows: list[dict]) -> str:
    out: list[tuple[str, ...]] = [("figure", "ratio", "injected", "rounds",
                                   "value [95% interval]", "claim", "verdict")]  # fmt: skip
    for r in rows:
        out.append((r["figure"], r["ratio"], f"{r['latency_ms']:g} ms", str(r["n"]),
                    r["interval"], r["claim"], r["verdict"]))  # fmt: skip
    return render(out)


def title_of(cfg: dict) -> str:
    return (
        f"real PD pair (prefill TP 1, decode TP {cfg['tp']} with KV offload to a file store, "
        f"Mooncake TCP, SGLang's router), generated-shared-prefix {cfg['num_groups']}x"
        f"{cfg['prompts_per_group']} (system {cfg['system_prompt_len']}, question "
        f"{cfg['question_len']}, output {cfg['output_len']} tokens), concurrency "
        f"{cfg['max_concurrency'] or 'unbounded'}; {cfg['rounds']} rounds x {cfg['runs']} "
        "run(s), a fresh pair each"
    )


def draw_png(path: Path, cfg: dict, visits: list[dict]) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hicache_async_ack_lab.bench.plot import color

    colors = {"stock": "blocking", "plugin": "pipelined", "bound": "bound"}
    confs = sorted({(v["arm"], v["latency_ms"]) for v in visits},
                   key=lambda c: (c[1], PD_ARMS.index(c[0])))  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, (key, label) in zip(axes, FIGURES):
        for i, conf in enumerate(confs):
            pts = [v[key] for v in visits if (v["arm"], v["latency_ms"]) == conf and v.get(key)]
            if pts:
                ax.bar(i, statistics.median(pts), 0.7, color=color(colors[conf[0]]))
                ax.plot([i] * len(pts), pts, "k.", markersize=4)
        ax.set_xticks(range(len(confs)),
                      [a if a == "bound" else f"{a}\n{lat:g} ms" for a, lat in confs])  # fmt: skip
        ax.set_ylabel(f"{label} (median of rounds; dots: each round)")
    fig.suptitle("\n".join(textwrap.wrap(title_of(cfg), 110)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from hicache_async_ack import __version__
    from hicache_async_ack_lab.bench.arms import config_of, load_visits, rounds_of
    from hicache_async_ack_lab.bench.driver import save, versions

    cfg = config_of(args)
    if set(cfg["arms"]) - set(PD_ARMS):
        raise ToolError(f"--workload pd runs the arms {', '.join(PD_ARMS)}")
    if cfg["tp"] < 2:
        raise ToolError("--workload pd: --tp is the decode's, and needs 2 or more ranks")
    workdir = Path(args.workdir) if args.workdir else Path(
        __import__("tempfile").mkdtemp(prefix="hicache-bench-pd-"))  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    load_at_start, t0 = os.getloadavg(), time.monotonic()
    visits = load_visits(args.from_visits) if args.from_visits else []
    if visits:
        cfg["rounds"] = len({v["round"] for v in visits})
        load_at_start = visits[0]["loadavg_start"]
    for rnd, order in enumerate([] if visits else rounds_of(cfg)):
        visits += run_round(cfg, order, rnd, workdir, args.quiet)
    rows = ratios(cfg, visits)
    wall = sum(v["wall_s"] for v in visits) if args.from_visits else time.monotonic() - t0
    print(f"hicache-async-ack-lab bench-server --workload pd {__version__}: {title_of(cfg)}")
    print(f"host: {os.cpu_count()} CPUs, load average {load_at_start[0]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end; {len(visits)} PD pairs in {wall / 60:.1f} min; "
          f"logs in {workdir}")  # fmt: skip
    print(arm_table(visits))
    print()
    print(ratio_table(rows))
    print("ITL ratios are inverted (the denominator's ITL over the numerator's): > 1 is "
          "faster, as for tok/s. bound: the decode offload MIN answered with each rank's "
          "own queue sizes (valid on CPU without skew).")  # fmt: skip
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kind": "server-pd", "config": cfg,
              "versions": versions(), "cpu_count": os.cpu_count(), "wall_s": wall,
              "visits": visits, "ratios": rows}  # fmt: skip
    save(args, record, "bench-server-pd", lambda png: draw_png(png, cfg, visits))
    return 0


def main(argv: list[str]) -> int:
    """Run bench_serving once per argv list in ``argv[0]`` (a JSON file)."""
    runs = json.loads(Path(argv[0]).read_text())
    from sglang.benchmark.serving import cli_main

    for i, run_argv in enumerate(runs):
        sys.argv = ["bench_serving", *run_argv]
        print(f"=== hicache-async-ack: bench_serving run {i + 1}/{len(runs)}", flush=True)
        cli_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
