"""Shared pieces of the end-to-end tests on SGLang's real server (cpu-server).

A server start costs one to three minutes here, so each test module starts
each configuration once (module-scoped fixtures) and runs many checks on it.
Every server runs in its own process group and is always taken down.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack.tools.cpu_server import Server

# Device pool 512 tokens, host pool 4x: ten ~110-token prompts overflow the
# device, so early prefixes are evicted to host and loaded back when re-sent.
BASE_ARGS = [
    "--tp", "2", "--enable-hierarchical-cache", "--enable-metrics",
    "--max-total-tokens", "512", "--hicache-ratio", "4",
]  # fmt: skip
STOCK_ENV = {ENABLE_VAR: "0"}
START_TIMEOUT_S = 900.0  # two ranks importing SGLang on a loaded 2-core box
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
    "omicron pi rho sigma tau upsilon phi chi psi omega"
).split()


def prompts(n: int, words: int = 30, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def start(tmp: Path, name: str, args=(), env=None, **kw) -> Server:
    server = Server(
        [*BASE_ARGS, *args],
        env=env,
        log_path=tmp / f"{name}.log",
        start_timeout_s=START_TIMEOUT_S,
        **kw,
    )
    server.start()
    return server


def serve(tmp: Path, name: str, args=(), env=None, **kw) -> Iterator[Server]:
    """Fixture body: start, yield, always stop. Its log stays in ``tmp`` (pytest's
    tmp_path_factory keeps the last few runs')."""
    server = start(tmp, name, args, env, **kw)
    try:
        yield server
    finally:
        server.stop()


def metric_samples(server: Server, name: str) -> list:
    """Samples of one family from the server's real /metrics, e.g.
    ``sglang:hicache_ack_sync_pipelined``; [] when it is not exposed."""
    text = server.get("/metrics").decode()
    out = []
    for family in text_string_to_metric_families(text):
        out.extend(s for s in family.samples if s.name == name or family.name == name)
    return out


def host_tokens(reply: dict, where: str = "host") -> int:
    details = reply["meta_info"].get("cached_tokens_details") or {}
    return int(details.get(where) or 0)


def settled(read, ranks: int, settle_s: float = 120.0) -> dict:
    """``read()`` (a {tp_rank: value} mapping) once every rank has caught up.

    Every rank pops, votes and counts the same entries, each at its own step: a
    scrape can catch one rank a step behind another (more so on a loaded box). So
    poll until the ranks agree, and return what was seen last if they never do.
    """
    deadline = time.monotonic() + settle_s
    while True:
        out = read()
        agree = len(out) == ranks and all(v == out["0"] for v in out.values())
        if agree or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def popped_by_rank(server: Server, ranks: int) -> dict:
    """Entries popped per queue, per tp_rank, once every rank has caught up."""

    def read() -> dict:
        out: dict = {}
        for s in metric_samples(server, "sglang:hicache_ack_sync_popped_entries_total"):
            if s.name.endswith("_total"):
                out.setdefault(s.labels["tp_rank"], {})[s.labels["queue"]] = s.value
        return out

    return settled(read, ranks)
