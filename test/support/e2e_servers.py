"""Shared pieces of the end-to-end tests on SGLang's real server (cpu-server).

A server start costs one to three minutes here, so each test module starts
each configuration once (module-scoped fixtures) and runs many checks on it.
Every server runs in its own process group and is always taken down.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from prometheus_client.parser import text_string_to_metric_families

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack_lab.cpu_server import Server
from hicache_async_ack_lab.cpu_server.model import VOCAB_SIZE

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


# Write-through to a file storage backend, so flushed prefixes come back from storage.
STORAGE_ARGS = [
    "--hicache-write-policy", "write_through",
    "--hicache-storage-backend", "file",
    # Our prompts are ~110 tokens: below upstream's 256-token default no
    # prefetch would start.
    "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 16}',
]  # fmt: skip


def prompts(n: int, words: int = 30, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


# How far the logprob of the same greedy token may move between two answers to one
# prompt. Measured on cpu-server's seeded model (float32): a prefix restored from host
# or storage vs recomputed, plugin vs stock, alone vs in a batch of four: at most
# ~1e-6 (different reduction orders in the prefill/extend/decode kernels). Any
# wrong KV moves them by 1e-2 to 1 (the negative control measures it). 1e-4 is 100x
# the first and 100x under the second.
LOGPROB_TOL = 1e-4


@dataclass(frozen=True)
class Reply:
    """What a greedy answer depends on: its tokens, their logprobs, where its prefix came from."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached: int  # prompt tokens not recomputed
    host: int  # of those, loaded back from the host pool
    storage: int  # of those, fetched from the storage backend

    @property
    def restored(self) -> int:
        return self.host + self.storage


def ask(server: Server, text: str, max_new_tokens: int = 8, **sampling) -> Reply:
    """One greedy request with its logprobs (ignore_eos: always max_new_tokens tokens)."""
    r = server.generate(
        text, max_new_tokens=max_new_tokens, return_logprob=True, ignore_eos=True, **sampling
    )
    meta = r["meta_info"]
    pairs = meta["output_token_logprobs"]
    return Reply(
        text=r["text"],
        tokens=tuple(int(tok) for _, tok, _ in pairs),
        logprobs=tuple(float(lp) for lp, _, _ in pairs),
        cached=int(meta["cached_tokens"]),
        host=host_tokens(r),
        storage=host_tokens(r, "storage"),
    )


@dataclass(frozen=True)
class Comparison:
    """Two answers to the same prompts, pair by pair (``compare``)."""

    pairs: int
    restored: int  # pairs whose second answer had KV from host or storage
    mismatches: tuple[str, ...]  # token or logprob differences beyond LOGPROB_TOL
    same_tokens: int  # pairs with the same greedy tokens
    max_logprob_diff: float  # over those

    def __str__(self) -> str:
        diff = f"{self.max_logprob_diff:.2e}" if self.same_tokens else "-"
        head = (
            f"{self.pairs} pairs, {self.restored} restored from host/storage, "
            f"{self.same_tokens} with the same tokens, max logprob diff {diff} "
            f"(tolerance {LOGPROB_TOL:g})"
        )
        return "\n  ".join([head, *self.mismatches])


def compare(expected: Sequence[Reply], got: Sequence[Reply]) -> Comparison:
    """Greedy tokens equal and each token's logprob within LOGPROB_TOL, pair by pair.

    The one check every e2e correctness test and the negative control share: the
    control (a server whose KV copies are broken on purpose) must make it report
    mismatches, or it proves nothing."""
    assert len(expected) == len(got) > 0, (len(expected), len(got))
    mismatches, worst, same = [], 0.0, 0
    for i, (a, b) in enumerate(zip(expected, got)):
        assert len(a.tokens) == len(b.tokens) > 0, (i, a, b)
        where = f"#{i} (restored {b.restored} of {b.cached} cached)"
        if a.tokens != b.tokens:
            mismatches.append(f"{where}: tokens {list(a.tokens)} != {list(b.tokens)}")
            continue
        same += 1
        diff = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        worst = max(worst, diff)
        if not diff <= LOGPROB_TOL:  # NaN fails too
            mismatches.append(f"{where}: same tokens, logprobs off by {diff:.3g}")
    restored = sum(1 for b in got if b.restored > 0)
    return Comparison(len(expected), restored, tuple(mismatches), same, worst)


def assert_same(expected: Sequence[Reply], got: Sequence[Reply], restored: bool = True) -> None:
    """No mismatch; with ``restored``, at least one second answer used restored KV (else
    the comparison covered a recompute only and could not see a broken copy)."""
    c = compare(expected, got)
    print(f"compare: {c}")  # the measured diff, for the record (pytest -rP)
    assert not c.mismatches, str(c)
    if restored:
        assert c.restored > 0, f"no answer used KV from host or storage: {c}"


def assert_cache_dependent(replies: Sequence[Reply]) -> None:
    """Served by a model whose answers depend on the prompt: not dummy weights, whose
    every logprob is -ln(vocab) whatever the KV."""
    assert replies, "no replies"
    flat = -math.log(VOCAB_SIZE)
    assert any(abs(lp - flat) > 0.1 for r in replies for lp in r.logprobs), replies[:2]
    assert len({r.tokens for r in replies}) > 1, "every prompt got the same reply"


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


# -- the sequence the correctness checks (and their negative control) run ---------

SEQUENCE = prompts(10)
RESENT = 4  # the first four are sent again once the ten have overflowed the device pool


def run_sequence(server: Server) -> list[Reply]:
    """SEQUENCE, then its first RESENT prompts again (their prefixes by then on host)."""
    return [ask(server, p) for p in SEQUENCE + SEQUENCE[:RESENT]]


def storage_env(tmp: Path) -> dict:
    """The file backend's directory, under ``tmp``."""
    root = tmp / "storage"
    root.mkdir()
    return {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(root)}


def storage_files(server: Server, timeout_s: float = 60.0) -> int:
    """Files the server's file backend holds, once their count stops moving."""
    root = Path(server.env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"])
    last, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = sum(len(files) for _, _, files in os.walk(root))
        if n != last:
            last, stable_since = n, time.monotonic()
        elif n > 0 and time.monotonic() - stable_since > 2.0:
            return n
        time.sleep(0.5)
    return last


def ask_together(server: Server, texts: Sequence[str], **kw) -> list[Reply]:
    """All at once (one thread each), in the order given."""
    replies: dict = {}
    errors: list = []

    def send(i: int) -> None:
        try:
            replies[i] = ask(server, texts[i], **kw)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sorted(replies) == list(range(len(texts))), sorted(replies)
    return [replies[i] for i in range(len(texts))]


def flush_and_resend(server: Server) -> list[Reply]:
    """Empty device and host (storage stays), then send SEQUENCE's first RESENT prompts
    together: their storage prefetches are in flight at once."""
    assert storage_files(server) > 0, "nothing was written to the file backend"
    assert b"Cache flushed" in server.post("/flush_cache?timeout=30")
    return ask_together(server, SEQUENCE[:RESENT])


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
        agree = len(out) == ranks > 0 and all(v == out["0"] for v in out.values())
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
