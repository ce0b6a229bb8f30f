"""``bench-server --storage mooncake``: requests that wait on L3 prefetches.

The prefetch votes' headline in a real server: each arm is a cpu-server at TP=2
with Mooncake as its L3 store (its own ``mooncake_master``, in a private network
namespace with the server and this client; tools/cpu_server/mooncake.py), under
SGLang's default ``timeout`` prefetch policy. A warm-up round stores every prompt
in Mooncake (write-through); each measured round flushes device and host first
(``/flush_cache``; the store keeps them) and then sends every prompt at once, so
each request waits in the queue on its own storage prefetch while the scheduler
decides, every pass, whether the prefetches may go on: stock with one blocking
all_reduce per waiting request, the plugin with one async vote for all of them.

Figures per round: output throughput, TTFT (streamed), storage-hit prompts; and
from cpu-server's counters (HICACHE_ASYNC_ACK_CPU_COUNT_DIR, rank 0's scheduler)
the scheduling passes, the blocking cache collectives per pass, the prefetches in
flight, the L3 hit queries sent to Mooncake per request and the tokens loaded from L3.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from hicache_async_ack import __version__
from hicache_async_ack.tools import nonneg_float
from hicache_async_ack_lab.bench.driver import save, versions
from hicache_async_ack_lab.bench.summary import render
from hicache_async_ack_lab.cli_support import ToolError

BACKENDS = ("mooncake",)
MOONCAKE_ARGS = [
    "--hicache-write-policy", "write_through",
    "--hicache-storage-backend", "mooncake",
]  # fmt: skip
REQUEST_TIMEOUT_S = 600.0
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "rho sigma tau upsilon phi chi psi omega"
).split()
# (key in a round's figures, column)
FIGURES = (
    ("output_throughput", "out tok/s"),
    ("l3_queries_per_request", "L3 queries/req"),
    ("tokens_from_l3", "tokens from L3"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("storage_hit_share", "storage hits"),
    ("blocking_per_pass", "blocking coll/pass"),
    ("all_reduce_per_deciding_pass", "all_reduce/deciding pass"),
    ("prefetches_per_pass", "prefetches/pass"),
    ("prefetches_in_flight", "in flight (max)"),
    ("prefetches_issued", "prefetches issued"),
    ("declined_rate_limited", "declined: host full"),
)
COUNTED = ("tokens_from_l3", "prefetches_issued", "declined_rate_limited")  # whole numbers


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pct(v: Optional[float], spec: str) -> str:
    return "-" if v is None else f"{v * 100:{spec}}%"


def add_arguments(p) -> None:
    g = p.add_argument_group("storage mode (--storage)")
    g.add_argument("--storage", choices=BACKENDS,
                   help="requests wait on L3 prefetches from this store instead of "
                   "bench_serving's workload (see tools/bench/storage.py)")  # fmt: skip
    g.add_argument("--storage-prompts", type=int, default=24,
                   help="prompts sent at once per round (default 24)")  # fmt: skip
    g.add_argument("--storage-prompt-words", type=int, default=40,
                   help="words per prompt (~3.7 tokens each; default 40)")  # fmt: skip
    g.add_argument("--storage-prefetch-timeout-s", default=None,
                   type=nonneg_float("prefetch timeout", "seconds"),
                   help="the servers' prefetch_timeout_base (default: SGLang's, 1 s; on "
                   "2 cores most prefetches of a burst miss it, a longer one keeps "
                   "them waiting, and voted on, to the end)")  # fmt: skip


STORAGE_HICACHE_RATIO = 32.0
TOKENS_PER_WORD = 3.7  # the bundled tokenizer on these words, measured


def burst_tokens(cfg: dict) -> float:
    return cfg["storage_prompts"] * cfg["storage_prompt_words"] * TOKENS_PER_WORD


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def stream(url: str, text: str, max_new_tokens: int) -> dict:
    """One streamed request: TTFT (first chunk), total time, the last meta_info."""
    import urllib.request

    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}  # fmt: skip
    req = urllib.request.Request(
        url + "/generate", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    t0 = time.monotonic()
    ttft: Optional[float] = None
    meta: dict = {}
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.monotonic() - t0
            meta = json.loads(line[5:]).get("meta_info", meta)
    return {"ttft_s": ttft, "latency_s": time.monotonic() - t0, "meta": meta}


def send_round(
    server, texts: list[str], max_new_tokens: int, offsets_s: Optional[list[float]] = None
) -> tuple[list[dict], float]:
    """Every text at once, or text i ``offsets_s[i]`` seconds after the first, each
    from a thread inside the server's namespace (its TTFT from its own send)."""
    out: list = [None] * len(texts)
    ns = server._ns()

    def one(i: int) -> None:
        try:
            ns.enter()
            if offsets_s:
                time.sleep(max(0.0, t0 + offsets_s[i] - time.monotonic()))
            out[i] = stream(server.url, texts[i], max_new_tokens)
        except Exception as exc:  # noqa: BLE001 - a failed request fails the arm below
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30 + max(offsets_s or [0.0]))
    wall = time.monotonic() - t0
    failed = [r for r in out if not isinstance(r, dict)]
    if failed:
        raise ToolError(f"{len(failed)} of {len(texts)} requests failed: {failed[0]!r}")
    return out, wall


class ServerExited(ToolError):
    """The server died under the bench (SGLang 0.5.23's flush can: a storage thread
    that does not stop in time fails ``reset()``, and the scheduler with it)."""


def flush_cache(server) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if b"Cache flushed" in server.post("/flush_cache?timeout=30"):
                return
        except OSError:  # refused while busy, or the server is going down
            if server.exited():
                errors = [x for x in server.log(300).splitlines() if "Error" in x] or ["-"]
                raise ServerExited(f"the server exited during /flush_cache ({errors[-1]}); "
                                   f"see {server.log_path}") from None  # fmt: skip
        time.sleep(1.0)
    raise ToolError("the server refused /flush_cache for two minutes")


def _counts_now(root: Path) -> dict:
    from hicache_async_ack_lab.cpu_server.mooncake_standins import read_counts

    time.sleep(0.5)  # the schedulers write their counts every 0.2 s while they pass
    return read_counts(root).get("0", {})


def _delta(after: dict, before: dict) -> dict:
    """The round's share of the counters (prefetch_max is a running maximum: kept)."""
    return {k: v if k == "prefetch_max" else v - before.get(k, 0) for k, v in after.items()}


def round_figures(replies: list[dict], wall: float, counts: dict) -> dict:
    ttfts = sorted(r["ttft_s"] * 1000 for r in replies if r["ttft_s"] is not None)
    out_tokens = sum(int(r["meta"].get("completion_tokens") or 0) for r in replies)
    hits = [int((r["meta"].get("cached_tokens_details") or {}).get("storage") or 0)
            for r in replies]  # fmt: skip
    passes = counts.get("passes", 0)
    return {
        "wall_s": wall,
        "output_throughput": out_tokens / wall if wall > 0 else None,
        "request_throughput": len(replies) / wall if wall > 0 else None,
        "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
        "p99_ttft_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "storage_hit_share": sum(h > 0 for h in hits) / len(hits) if hits else None,
        "storage_tokens": sum(hits),
        "passes": passes,
        "blocking_collectives": counts.get("blocking", 0),
        "blocking_per_pass": counts.get("blocking", 0) / passes if passes else None,
        # every all_reduce (blocking or async) in the passes with a prefetch to decide
        "all_reduce_per_deciding_pass": counts.get("deciding_all_reduces", 0)
        / counts["prefetch_passes"]
        if counts.get("prefetch_passes")
        else None,
        "prefetches_per_pass": counts.get("prefetches_voted", 0) / passes if passes else None,
        "prefetch_max": counts.get("prefetch_max", 0),
        # over the passes that had one in flight: how many each of them decided on
        "prefetches_in_flight": counts.get("prefetches_voted", 0) / counts["prefetch_passes"]
        if counts.get("prefetch_passes")
        else None,
        # SGLang's own outcome counters (None on a release without them)
        "prefetches_issued": counts.get("issued"),
        "declined_rate_limited": counts.get("declined_rate_limited"),
        # rank 0's hit queries to the store (_storage_hit_query, an assume_stored one
        # aside) per request sent, and its prefetches' completed tokens (None: no counts)
        "l3_queries": counts.get("l3_queries"),
        "l3_queries_per_request": counts["l3_queries"] / len(replies)
        if "l3_queries" in counts and replies
        else None,
        "tokens_from_l3": counts.get("l3_tokens_loaded"),
    }


def visit(cfg: dict, conf: tuple, rnd: int, workdir: Path, quiet: bool) -> dict:
    """A fresh master and server for ``conf``: a warm-up round, ``--runs`` measured ones."""
    from hicache_async_ack_lab.bench.arms import arm_env, check_arm, plugin_state, server_args
    from hicache_async_ack_lab.bench.server_report import medians, prefetch_votes
    from hicache_async_ack_lab.cpu_server.mooncake import Mooncake, MooncakeServer
    from hicache_async_ack_lab.cpu_server.mooncake_standins import COUNT_DIR_VAR

    arm, latency_ms, _ = conf
    name = f"storage-{arm}-{latency_ms:g}ms-r{rnd}"
    counts_dir = workdir / f"counts-{name}"
    counts_dir.mkdir(parents=True, exist_ok=True)
    texts = prompts(cfg["storage_prompts"], cfg["storage_prompt_words"], cfg["seed"])
    extra_cfg: dict = {"prefetch_threshold": 16}  # our prompts are short
    if cfg.get("storage_prefetch_timeout_s") is not None:
        extra_cfg["prefetch_timeout_base"] = cfg["storage_prefetch_timeout_s"]
    extra = json.dumps(extra_cfg)
    args = [*server_args(cfg, arm), *MOONCAKE_ARGS, "--hicache-storage-backend-extra-config", extra]
    runs: list[dict] = []
    load_start, t0 = os.getloadavg(), time.monotonic()
    # A fresh master per visit: a store outlives its server, and arms must not share.
    with Mooncake(workdir / f"master-{name}") as mc:
        server = MooncakeServer(
            mc, args, env={**arm_env(arm), COUNT_DIR_VAR: str(counts_dir)},
            log_path=workdir / f"server-{name}.log", latency_ms=latency_ms,
            start_timeout_s=cfg["start_timeout_s"],
        )  # fmt: skip
        with server:
            send_round(server, texts, cfg["output_len"])  # warm-up: stores every prompt
            mc.settled_keys()
            for _ in range(cfg["runs"]):
                flush_cache(server)
                before = _counts_now(counts_dir)
                replies, wall = send_round(server, texts, cfg["output_len"])
                runs.append(round_figures(replies, wall, _delta(_counts_now(counts_dir), before)))
            state = plugin_state(server)
            state["votes"] = prefetch_votes(server)
    check_arm(cfg, arm, state, server, name)
    tputs = [r["output_throughput"] for r in runs if r["output_throughput"]]
    rec = {
        "arm": arm, "latency_ms": latency_ms, "lanes": None, "round": rnd,
        "startup_s": server.startup_s, "wall_s": time.monotonic() - t0,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "output_throughput": sum(tputs) / len(tputs) if tputs else None,
        "median": medians(runs), "runs": runs, **state,
    }  # fmt: skip
    if not quiet:
        m = rec["median"]
        print(f"[round {rnd + 1}] {name}: {rec['output_throughput'] or 0:.1f} out tok/s, "
              f"L3 queries/req {_fmt(m.get('l3_queries_per_request'), '.2f')}, tokens from L3 "
              f"{_fmt(m.get('tokens_from_l3'), '.0f')}, storage hits "
              f"{_pct(m.get('storage_hit_share'), '.0f')}, blocking collectives"
              f"/pass {_fmt(m.get('blocking_per_pass'), '.2f')}, prefetches/pass "
              f"{_fmt(m.get('prefetches_per_pass'), '.2f')}, load {load_start[0]:.1f} -> "
              f"{rec['loadavg_end'][0]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
    return rec


def arm_table(visits: list[dict]) -> str:
    head = ("arm", "injected", "rounds", "out tok/s median", "range", *(c for _, c in FIGURES[1:]),
            "load start-end", "start-up s")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    confs = sorted({(v["arm"], v["latency_ms"]) for v in visits},
                   key=lambda c: (c[1], ("stock", "plugin").index(c[0])))  # fmt: skip
    for arm, lat in confs:
        vs = [v for v in visits if (v["arm"], v["latency_ms"]) == (arm, lat)]
        tput = [v["output_throughput"] for v in vs if v["output_throughput"]]
        cells = []
        for key, _ in FIGURES[1:]:
            values = [v["median"][key] for v in vs if v["median"].get(key) is not None]
            m = statistics.median(values) if values else None
            spec = ".0f" if key in COUNTED else ".2f"
            if key == "storage_hit_share":
                cells.append(_pct(m, ".0f"))
            elif key == "prefetches_in_flight":
                top = max((v["median"].get("prefetch_max") or 0 for v in vs), default=0)
                cells.append(f"{_fmt(m, '.1f')} ({top:.0f})")
            else:
                cells.append(_fmt(m, spec))
        loads = [x for v in vs for x in (v["loadavg_start"][0], v["loadavg_end"][0])]
        ups = [v["startup_s"] for v in vs if v["startup_s"]]
        rows.append((
            arm, f"{lat:g} ms", str(len(vs)),
            f"{statistics.median(tput):.1f}" if tput else "-",
            f"{min(tput):.0f}-{max(tput):.0f}" if tput else "-", *cells,
            f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-",
            f"{min(ups):.0f}-{max(ups):.0f}" if ups else "-",
        ))  # fmt: skip
    return render(rows)


# The headline: with latency the plugin keeps >= 0.95 of its own 0 ms.
HEADLINE = ("plugin / own 0 ms", 0.95)


def with_headline(rows: list[dict]) -> list[dict]:
    out = list(rows)
    for r in rows:
        if r["ratio"] == HEADLINE[0] and r["low"] is not None and r["high"] is not None:
            low, high, thr = r["low"], r["high"], HEADLINE[1]
            v = "holds" if low >= thr else ("fails" if high < thr else "inconclusive")
            out.append(r | {"claim": f">= {thr:g}", "verdict": v})
    return out


def title_of(cfg: dict) -> str:
    return (
        f"real server on Mooncake, TP={cfg['tp']}, {cfg['storage_prompts']} prompts of "
        f"{cfg['storage_prompt_words']} words at once per round, each waiting on its L3 "
        f"prefetch (device and host flushed before each round), output {cfg['output_len']} "
        f"tokens; {cfg['rounds']} rounds x {cfg['runs']} measured run(s), a fresh server each"
        + _timeout_note(cfg)
    )


def _timeout_note(cfg: dict) -> str:
    t = cfg.get("storage_prefetch_timeout_s")
    return "" if t is None else f"; prefetch timeout {t:g} s"


def draw_png(path: Path, visits: list[dict], title: str) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hicache_async_ack_lab.bench.plot import color

    latencies = sorted({v["latency_ms"] for v in visits})
    arms = [a for a in ("stock", "plugin") if any(v["arm"] == a for v in visits)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.8 / max(1, len(arms))
    panels = ((ax1, lambda v: v["output_throughput"]),
              (ax2, lambda v: v["median"].get("blocking_per_pass")))  # fmt: skip
    for j, arm in enumerate(arms):
        for i, lat in enumerate(latencies):
            vs = [v for v in visits if v["arm"] == arm and v["latency_ms"] == lat]
            x = i + (j - (len(arms) - 1) / 2) * width
            c = color("blocking" if arm == "stock" else "pipelined")
            for ax, get in panels:
                pts = [get(v) for v in vs if get(v) is not None]
                if not pts:
                    continue
                ax.bar(x, statistics.median(pts), width, color=c, label=arm if i == 0 else None)
                ax.plot([x] * len(pts), pts, "k.", markersize=4)
    labels = ("output tokens/s (median of rounds; dots: each round)",
              "blocking cache collectives per scheduling pass")  # fmt: skip
    for (ax, _), label in zip(panels, labels):
        ax.set_xticks(range(len(latencies)), [f"{lat:g} ms injected" for lat in latencies])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from hicache_async_ack_lab.bench.arms import config_of, rounds_of
    from hicache_async_ack_lab.bench.server_report import ratio_table, ratios
    from hicache_async_ack_lab.bench.visits import run_visits

    cfg = config_of(args) | {
        "storage": args.storage,
        "storage_prompts": args.storage_prompts,
        "storage_prompt_words": args.storage_prompt_words,
        "storage_prefetch_timeout_s": args.storage_prefetch_timeout_s,
    }
    if set(cfg["arms"]) - {"stock", "plugin"}:
        raise ToolError("--storage runs the stock and plugin arms only")
    if args.hicache_ratio is None:
        # SGLang lets prefetches occupy half the host pool and declines the rest ("host
        # full": they recompute instead of waiting); at 4x the 512-token device pool a
        # 24-prompt burst got 22 prefetches issued, 21 declined and 8% storage hits,
        # at 32x all 24 issued, 100% hits, 23 in flight at once.
        cfg["hicache_ratio"] = STORAGE_HICACHE_RATIO
    budget = cfg["hicache_ratio"] * cfg["max_total_tokens"] / 2
    if burst_tokens(cfg) > budget:
        print(f"bench-server --storage: a burst of ~{burst_tokens(cfg):.0f} prompt tokens "
              f"exceeds SGLang's prefetch budget ({budget:.0f} tokens, half the host pool): "
              "expect prefetches declined (host full); raise --hicache-ratio",
              file=sys.stderr)  # fmt: skip
    visits, run_facts, host = run_visits(args, cfg, rounds_of(cfg), visit, "storage")
    rows = with_headline(ratios(cfg, visits))
    print(
        f"hicache-async-ack-lab bench-server --storage {args.storage} {__version__}: "
        f"{title_of(cfg)}"
    )
    print(host)
    print(arm_table(visits))
    print()
    print(ratio_table(rows))
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kind": "server-storage", "config": cfg,
        "versions": versions(), "cpu_count": os.cpu_count(), **run_facts, "visits": visits,
        "ratios": rows,
    }  # fmt: skip
    save(args, record, "bench-server-storage",
         lambda png: draw_png(png, visits, title_of(cfg)))  # fmt: skip
    return 0


def wanted(args) -> Optional[str]:
    return getattr(args, "storage", None)
