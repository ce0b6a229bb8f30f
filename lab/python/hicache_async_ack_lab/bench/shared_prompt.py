"""``bench-server --storage mooncake --workload shared-prompt``: one system prompt, read
from L3 by many requests at once.

HiCache's L3 is there for shared prefixes. Each arm is a cpu-server at TP=2 with
Mooncake as its L3 store (write-through; its own ``mooncake_master`` in a private
network namespace, tools/cpu_server/mooncake.py). A warm-up request stores the system
prompt (~1,200 tokens by the bundled tokenizer) in Mooncake. Then, per arrival pattern
and measured run: ``/flush_cache`` (device and host; the store keeps what it holds) and
N requests (default 32), each the system prompt plus a short question of its own,
sent ``poisson`` (exponential gaps, 100 ms mean, seeded), ``dense`` (one every 15 ms)
or ``burst`` (all at once). The first request's prefetch reads the prompt from L3;
stock reads it again for every request that arrives while that read is in flight.

Arms: ``stock`` (the plugin off), ``plugin`` (read-once off, its default) and
``read-once`` (the plugin with SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_READ_ONCE=1: a
request whose L3 remainder a prefetch in flight covers waits for it, then reads only
the rest). Every round starts each arm's master and server afresh, in an order that
reverses from one round to the next; the arrivals and questions of a (round, pattern,
run) are the same in every arm, so arms are paired by round.

Figures per arm and pattern, each with its interval across rounds: L3 queries and keys
read per request (the master's own counters, cpu_server/mooncake_metrics.py), TTFT p50
and p99 (streamed, from each request's own send), output tok/s, and the read-once
counters of the plugin's /metrics (rank 0; "-" where the server has none). Then each
arm / stock, paired by round, and the issue's goal (shared_prompt_report.py).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Optional

from hicache_async_ack.env import ENABLE_VAR, READ_ONCE_VAR
from hicache_async_ack.tools import nonneg_float
from hicache_async_ack_lab.bench.driver import add_int, choice_list
from hicache_async_ack_lab.bench.storage import (
    MOONCAKE_ARGS,
    WORDS,
    ServerExited,
    flush_cache,
    send_round,
)
from hicache_async_ack_lab.cli_support import ToolError

WORKLOAD = "shared-prompt"
PATTERNS = ("poisson", "dense", "burst")
READ_ONCE = "read-once"
ARMS = ("stock", "plugin", READ_ONCE)
# The plugin's read-once counters (rank 0), per measured run: key -> series
READ_ONCE_SERIES = {
    "read_once_waits": "sglang:hicache_prefetch_read_once_waits_total",
    "read_once_saved_tokens": "sglang:hicache_prefetch_read_once_saved_tokens_total",
}
POOL_TOKENS = 4096  # the device pool: the whole prompt fits a request's context
MODEL_CONTEXT = 4096  # the bundled model's max_position_embeddings
BUDGET_MARGIN = 1.25  # host prefetch budget over N prompts' worth (stock reads up to N)


def arrival_offsets(pattern: str, n: int, seed: str, poisson_gap_ms: float,
                    dense_gap_ms: float) -> list[float]:  # fmt: skip
    """Seconds after the first request at which each of ``n`` requests is sent."""
    if pattern == "burst":
        return [0.0] * n
    if pattern == "dense":
        return [i * dense_gap_ms / 1000 for i in range(n)]
    if pattern != "poisson":
        raise ValueError(f"arrival pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
    rng, out, t = random.Random(f"arrivals:{seed}"), [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(1000 / poisson_gap_ms) if poisson_gap_ms > 0 else 0.0
        out.append(t)
    return out


def system_prompt(tokens: int, seed: int) -> tuple[str, int]:
    """Words whose text the bundled tokenizer reads as ``tokens`` tokens (or the first
    count at or above it), and that count."""
    from tokenizers import Tokenizer

    from hicache_async_ack_lab.cpu_server.model import ensure_model

    tok = Tokenizer.from_file(str(ensure_model() / "tokenizer.json"))
    rng = random.Random(f"system:{seed}")
    words = [rng.choice(WORDS) for _ in range(tokens)]  # a word is at least one token

    def count(k: int) -> int:
        return len(tok.encode(" ".join(words[:k])).ids)

    lo, hi = 1, tokens
    while lo < hi:  # the fewest words that reach ``tokens``
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) >= tokens else (mid + 1, hi)
    return " ".join(words[:lo]), count(lo)


def questions(n: int, words: int, seed: str) -> list[str]:
    """A new line and a question of its own per request (numbered: never repeated)."""
    rng = random.Random(f"questions:{seed}")
    return [f"\nQuestion {i + 1}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "?"
            for i in range(n)]  # fmt: skip


def arm_env(arm: str) -> dict[str, str]:
    if arm == READ_ONCE:
        return {ENABLE_VAR: "1", READ_ONCE_VAR: "1"}
    # read-once pinned off: an operator's exported value must not turn it on here
    return {ENABLE_VAR: "1" if arm == "plugin" else "0", READ_ONCE_VAR: "0"}


def read_once_counts(server) -> dict[str, Optional[float]]:
    """Rank 0's read-once counters from the server's /metrics (None: not exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {v: k for k, v in READ_ONCE_SERIES.items()}
    out: dict[str, Optional[float]] = dict.fromkeys(READ_ONCE_SERIES)
    for family in text_string_to_metric_families(server.get("/metrics").decode()):
        for s in family.samples:
            if s.name in names and s.labels.get("tp_rank", "0") == "0":
                out[names[s.name]] = (out[names[s.name]] or 0.0) + s.value
    return out


def measure(server, mc, texts: list[str], offsets: list[float], cfg: dict, tag: Path) -> dict:
    """One measured run: flush, the requests at their offsets, the L3 work they caused
    (the master's metrics before and after are kept beside the logs: TAG-*.prom)."""
    from hicache_async_ack_lab.bench.shared_prompt_report import round_figures
    from hicache_async_ack_lab.cpu_server.mooncake_metrics import parse, settled

    flush_cache(server)
    before, ro_before = settled(mc.metrics), read_once_counts(server)
    replies, wall = send_round(server, texts, cfg["output_len"], offsets)
    after, ro_after = settled(mc.metrics), read_once_counts(server)
    for when, text in (("before", before), ("after", after)):
        tag.with_name(f"{tag.name}-{when}.prom").write_text(text)
    unserved = [i for i, r in enumerate(replies) if not r["meta"].get("completion_tokens")]
    if unserved:
        raise ToolError(f"{tag.name}: {len(unserved)} of {len(replies)} requests got no output "
                        f"token (first: #{unserved[0]}); see {server.log_path}")  # fmt: skip
    read_once: dict[str, Optional[float]] = {}
    for k in READ_ONCE_SERIES:
        b, a = ro_before[k], ro_after[k]
        read_once[k] = None if a is None or b is None else a - b
    return round_figures(replies, wall, parse(before), parse(after), read_once)


def visit(cfg: dict, conf: tuple, rnd: int, workdir: Path, quiet: bool) -> dict:
    """A fresh master and server for ``conf``: the warm-up, then every pattern's runs."""
    from hicache_async_ack_lab.bench.arms import check_arm, plugin_state, server_args
    from hicache_async_ack_lab.bench.server_report import medians
    from hicache_async_ack_lab.cpu_server.mooncake import Mooncake, MooncakeServer

    arm, latency_ms, _ = conf
    name = f"shared-{arm}-{latency_ms:g}ms-r{rnd}"
    args = [*server_args(cfg, arm), *MOONCAKE_ARGS]
    if cfg.get("storage_prefetch_timeout_s") is not None:
        extra = {"prefetch_timeout_base": cfg["storage_prefetch_timeout_s"]}
        args += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
    patterns: dict[str, dict] = {}
    load_start, t0 = os.getloadavg(), time.monotonic()
    # A fresh master per visit: a store outlives its server, and arms must not share.
    with Mooncake(workdir / f"master-{name}") as mc:
        server = MooncakeServer(
            mc, args, env=arm_env(arm), log_path=workdir / f"server-{name}.log",
            latency_ms=latency_ms, start_timeout_s=cfg["start_timeout_s"],
        )  # fmt: skip
        with server:
            warm = questions(1, cfg["question_words"], f"{cfg['seed']}:warm-up")[0]
            send_round(server, [cfg["prompt"] + warm], cfg["output_len"])
            stored = mc.settled_keys()  # write-through has put the prompt in the store
            for pattern in cfg["patterns"]:
                runs = []
                for run in range(cfg["runs"]):
                    seed = f"{cfg['seed']}:{rnd}:{pattern}:{run}"
                    asks = questions(cfg["requests"], cfg["question_words"], seed)
                    texts = [cfg["prompt"] + q for q in asks]
                    gaps = (cfg["poisson_gap_ms"], cfg["dense_gap_ms"])
                    offsets = arrival_offsets(pattern, cfg["requests"], seed, *gaps)
                    tag = workdir / f"l3-{name}-{pattern}-{run}"
                    runs.append(measure(server, mc, texts, offsets, cfg, tag))
                patterns[pattern] = {"runs": runs, "median": medians(runs)}
            state = plugin_state(server)
    # the read-once arm is the plugin, pipelined on every rank
    check_arm(cfg, "plugin" if arm == READ_ONCE else arm, state, server, name)
    rec = {
        "arm": arm, "latency_ms": latency_ms, "lanes": None, "round": rnd,
        "startup_s": server.startup_s, "wall_s": time.monotonic() - t0,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "keys_stored": stored, "patterns": patterns, **state,
    }  # fmt: skip
    if not quiet:
        from hicache_async_ack_lab.bench.shared_prompt_report import visit_line

        print(f"[round {rnd + 1}] {name}: {visit_line(rec)}", file=sys.stderr, flush=True)
    return rec


def visit_again_once(cfg: dict, conf: tuple, rnd: int, workdir: Path, quiet: bool) -> dict:
    """``visit``, once more with a fresh master and server if the server died under it
    (SGLang's flush race, storage.ServerExited: no figure of its was kept)."""
    try:
        return visit(cfg, conf, rnd, workdir, quiet) | {"attempts": 1}
    except ServerExited as exc:
        print(f"[round {rnd + 1}] {conf[0]}: {exc}; once more", file=sys.stderr, flush=True)
    again = workdir / f"again-{conf[0]}-r{rnd}"  # the first attempt's logs stay
    again.mkdir(parents=True, exist_ok=True)
    return visit(cfg, conf, rnd, again, quiet) | {"attempts": 2}


def add_arguments(p) -> None:
    g = p.add_argument_group(
        f"{WORKLOAD} workload (with --storage mooncake; arms {', '.join(ARMS)} and "
        "--latency-ms 0 unless given)"
    )
    g.add_argument("--arrivals", type=choice_list("--arrivals", PATTERNS), default=PATTERNS,
                   help="arrival patterns, each measured in every server (default "
                   "poisson,dense,burst)")  # fmt: skip
    what = "requests per measured run, all with the same system prompt (default 32)"
    add_int(g, "--shared-requests", 32, hi=256, help=what)
    what = "the system prompt's length in tokens of the bundled tokenizer (default 1200)"
    add_int(g, "--shared-prompt-tokens", 1200, lo=16, hi=3800, help=what)
    what = "words per request's own question (default 12)"
    add_int(g, "--shared-question-words", 12, hi=200, help=what)
    g.add_argument(
        "--poisson-gap-ms",
        type=nonneg_float("--poisson-gap-ms", "milliseconds"),
        default=100.0,
        help="poisson: the mean gap between requests (default 100)",
    )
    g.add_argument(
        "--dense-gap-ms",
        type=nonneg_float("--dense-gap-ms", "milliseconds"),
        default=15.0,
        help="dense: the gap between requests (default 15)",
    )


def config(args) -> dict:
    """The run's configuration; refuses what cannot run with the reason and the fix."""
    from hicache_async_ack_lab.bench.arms import config_of

    if not args.storage:
        raise ToolError(f"--workload {WORKLOAD} reads the prompt from an L3 store: "
                        "add --storage mooncake")  # fmt: skip
    wrong = [a for a in args.arms if a not in ARMS]
    if wrong:
        raise ToolError(f"--workload {WORKLOAD} runs the arms {', '.join(ARMS)}; "
                        f"not {', '.join(wrong)}")  # fmt: skip
    cfg = config_of(args) | {
        "storage": args.storage, "patterns": list(args.arrivals),
        "requests": args.shared_requests, "prompt_tokens": args.shared_prompt_tokens,
        "question_words": args.shared_question_words, "poisson_gap_ms": args.poisson_gap_ms,
        "dense_gap_ms": args.dense_gap_ms,
        "storage_prefetch_timeout_s": args.storage_prefetch_timeout_s,
    }  # fmt: skip
    if args.max_total_tokens is None:
        cfg["max_total_tokens"] = POOL_TOKENS
    # ~4 tokens a question word, the output, a margin for the tokenizer's seams
    longest = cfg["prompt_tokens"] + 4 * cfg["question_words"] + 16 + cfg["output_len"]
    if longest > min(cfg["max_total_tokens"], MODEL_CONTEXT):
        raise ToolError(f"a request of ~{longest} tokens does not fit the device pool "
                        f"({cfg['max_total_tokens']}) or the model's context "
                        f"({MODEL_CONTEXT}): lower --shared-prompt-tokens or raise "
                        "--max-total-tokens")  # fmt: skip
    # SGLang lets prefetches hold half the host pool and declines the rest (the request
    # recomputes): room for every request's own read keeps stock's re-reads in view.
    need = BUDGET_MARGIN * 2 * cfg["requests"] * longest / cfg["max_total_tokens"]
    if args.hicache_ratio is None:
        cfg["hicache_ratio"] = float(max(4, -(-need // 1)))
    elif cfg["hicache_ratio"] < need:
        print(
            f"bench-server --workload {WORKLOAD}: --hicache-ratio {cfg['hicache_ratio']:g} "
            f"leaves SGLang's prefetch budget short of {cfg['requests']} prompts' reads "
            f"(~{need:.0f} needed): stock's extra reads may be declined",
            file=sys.stderr,
        )
    return cfg


def run(args) -> int:
    from hicache_async_ack import __version__
    from hicache_async_ack_lab.bench.driver import save, versions
    from hicache_async_ack_lab.bench.shared_prompt_report import draw_png, print_report
    from hicache_async_ack_lab.bench.stats import round_order
    from hicache_async_ack_lab.bench.visits import run_visits

    cfg = config(args)
    cfg["prompt"], cfg["prompt_tokens_counted"] = system_prompt(cfg["prompt_tokens"], cfg["seed"])
    confs = [(a, lat, None) for lat in cfg["latencies_ms"] for a in cfg["arms"]]
    orders = round_order(confs, cfg["rounds"])
    visits, run_facts, host = run_visits(args, cfg, orders, visit_again_once, "shared-prompt")
    print(f"hicache-async-ack-lab bench-server --storage {cfg['storage']} --workload "
          f"{WORKLOAD} {__version__}")  # fmt: skip
    print(host)
    record = print_report(cfg, visits) | {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kind": "server-shared-prompt",
        "config": {k: v for k, v in cfg.items() if k != "prompt"}, "versions": versions(),
        "cpu_count": os.cpu_count(), **run_facts, "visits": visits,
    }  # fmt: skip
    save(args, record, "bench-server-shared-prompt", lambda png: draw_png(png, cfg, visits))
    return 0
