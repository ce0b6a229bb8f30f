"""L3 work as ``mooncake_master`` itself counts it (its Prometheus metrics endpoint).

The master sees every client's RPCs, whichever rank or request sent them, so its
counters measure what a store operator pays for, with nothing in SGLang wrapped.
SGLang's Mooncake backend reaches it through three RPCs (checked against a live
master: one ``batch_is_exist``, ``batch_get_into`` and ``batch_put_from`` each):

- **queries**: ``batch_exists`` (a prefetch's hit query on each rank, and the check
  ``batch_set`` makes before writing) is one ``BatchExistKey`` request for all its
  keys: ``master_batch_exist_key_requests_total`` (+ ``master_exist_key_requests_total``,
  the single-key form), its keys ``master_batch_exist_key_items_total``;
- **reads**: ``batch_get_into`` (a prefetch's page transfer) looks every key up with
  one ``BatchGetReplicaList``; each item it answers is a key whose bytes the client
  then pulls from the owner's segment: ``master_batch_get_replica_list_items_total``
  less ``..._failed_items_total`` (+ the single-key ``GetReplicaList``), and their bytes
  ``mem_cache_hit_bytes_total`` (+ ``file_cache_hit_bytes_total``, an SSD tier);
- **writes**: ``master_batch_put_start_items_total`` (keys a write-back stored).

A key is one page's K or V of one TP rank (``<hash>_<rank>_k``), so a prompt of P
full pages read by a TP=2 server is 4 P keys.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

Counters = dict[str, float]

# figure -> (counters added, counters subtracted)
FIGURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "l3_queries": (
        ("master_exist_key_requests_total", "master_batch_exist_key_requests_total"), ()),
    "l3_keys_queried": (
        ("master_exist_key_requests_total", "master_batch_exist_key_items_total"), ()),
    "l3_keys_read": (
        ("master_get_replica_list_requests_total", "master_batch_get_replica_list_items_total"),
        ("master_get_replica_list_failures_total",
         "master_batch_get_replica_list_failed_items_total")),
    "l3_bytes_read": (("mem_cache_hit_bytes_total", "file_cache_hit_bytes_total"), ()),
    "l3_keys_written": (("master_batch_put_start_items_total",), ()),
}  # fmt: skip
REQUIRED = tuple(sorted({n for add, sub in FIGURES.values() for n in (*add, *sub)}))


class MetricsMissing(RuntimeError):
    """The master's metrics lack a counter the figures need (another Mooncake release)."""


def parse(text: str) -> Counters:
    """The unlabelled samples of Prometheus text: ``{name: value}``."""
    out: Counters = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and not line.startswith("#") and "{" not in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def l3_work(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """Each figure's growth between two snapshots of one master."""
    missing = [n for n in REQUIRED if n not in before or n not in after]
    if missing:
        raise MetricsMissing(
            f"mooncake_master's metrics lack {', '.join(missing)}: this bench reads "
            f"{', '.join(REQUIRED)}"
        )
    back = [n for n in REQUIRED if after[n] < before[n]]
    if back:
        raise ValueError(f"mooncake_master's counters went back ({', '.join(back)}): "
                         "a restarted master between the two snapshots")  # fmt: skip
    return {
        key: int(sum(after[n] - before[n] for n in add) - sum(after[n] - before[n] for n in sub))
        for key, (add, sub) in FIGURES.items()
    }


def settled(read: Callable[[], str], quiet_s: float = 1.0, timeout_s: float = 60.0) -> str:
    """The master's metrics text once the counters read here stop moving for
    ``quiet_s`` (a prefetch past its deadline still reads, write-backs land after the
    last reply), or the last snapshot when ``timeout_s`` runs out."""

    def used(text: str) -> Counters:
        return {n: v for n, v in parse(text).items() if n in REQUIRED}

    text = read()
    since, deadline = time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.2)
        now = read()
        if used(now) != used(text):
            since = time.monotonic()
        text = now
    return text
