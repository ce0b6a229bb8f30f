"""The "why" series: which path each sync runs on a rank, and the reason code.

``sglang:hicache_sync_path_info{sync, path, reason, <the cache's labels>} 1`` per
rank and sync, info-style: a dashboard reads why a rank is blocking (the same
decision its log line states) without opening logs, and an alert can tell "the
plugin is installed and nothing pipelines" from "no plugin". ``reason`` is the
decision's bounded snake_case code, never its free-text message, so the series
count stays small. On a change of path the previous combination drops to 0: the
current one is the series at 1 (multiprocess gauges cannot be removed).

Engine-agnostic: prometheus_client (or the collector class SGLang hands over) is
imported only when a path is published, which happens only with metrics on.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Optional

from .names import ACK, LOGGER_NAME, SYNCS, VOTES

logger = logging.getLogger(LOGGER_NAME)

NAME = "sglang:hicache_sync_path_info"
# pipelined; blocking: SGLang's own blocking path on a cache the plugin hooks;
# off: the plugin registered nothing for it (disabled, guard, in-tree SGLang).
PATHS = ("pipelined", "blocking", "off")
OTHER = "other"  # a code that is not a bounded snake_case word
_CODE = re.compile(r"[a-z][a-z0-9_]{0,47}")

# label names -> gauge family (one per label set, as metrics.py keeps them)
_families: dict[tuple[str, ...], Any] = {}
# (labels, sync) -> the (path, reason) child currently at 1
_current: dict[tuple[tuple[tuple[str, str], ...], str], tuple[str, str]] = {}


def reason_code(code: Optional[str]) -> str:
    """``code`` if it is a bounded snake_case word, else ``other``: a message
    passed by mistake must not mint one series per wording."""
    return code if code is not None and _CODE.fullmatch(code) else OTHER


def _family(labelnames: tuple[str, ...], metrics_collector: Any = None):
    fam = _families.get(labelnames)
    if fam is not None:
        return fam
    from .metrics import collector_classes

    gauge = collector_classes(metrics_collector)[1]
    extra: dict[str, Any] = {}
    if _families:
        from prometheus_client import Gauge as PromGauge

        if gauge is PromGauge:  # the name is taken in the default registry
            extra = {"registry": None}
    fam = _families[labelnames] = gauge(
        NAME,
        "1 per rank and sync for the path it runs (pipelined, blocking, off) and "
        "the reason code of that decision; a previous path of the rank reads 0.",
        labelnames=[*labelnames, "sync", "path", "reason"],
        multiprocess_mode="mostrecent",
        **extra,
    )
    return fam


def publish(
    sync: str,
    path: str,
    reason: Optional[str],
    labels: Mapping[str, Any],
    metrics_collector: Any = None,
) -> bool:
    """Set this rank's ``sync`` to ``path`` for ``reason`` (a decision's code);
    the combination it replaces drops to 0. Never raises (metrics never fail
    HiCache); False, logged, when the series cannot be written."""
    try:
        if sync not in SYNCS:
            raise ValueError(f"unknown sync {sync!r} (one of {SYNCS})")
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r} (one of {PATHS})")
        own = {k: str(v) for k, v in labels.items()}
        clash = {"sync", "path", "reason"} & set(own)
        if clash:
            raise ValueError(f"labels {sorted(clash)} are this series' own")
        fam = _family(tuple(own), metrics_collector)
        key = (tuple(own.items()), sync)
        now = (path, reason_code(reason))
        before = _current.get(key)
        if before is not None and before != now:
            fam.labels(**own, sync=sync, path=before[0], reason=before[1]).set(0)
        fam.labels(**own, sync=sync, path=now[0], reason=now[1]).set(1)
        _current[key] = now
        return True
    except Exception as exc:
        logger.warning("HiCache %s: path info not exported for %s: %r", sync, dict(labels), exc)
        return False


def path_of(pipelined: bool, off: bool = False) -> str:
    """The ``path`` label of a decision."""
    return "pipelined" if pipelined else "off" if off else "blocking"


# The syncs a UnifiedRadixCache carries (the decode offload sync lives on PD
# decode's offload manager, which is built elsewhere and announces itself).
CACHE_SYNCS = (ACK, VOTES)


def inert_hook(reason: str, syncs: tuple[str, ...] = CACHE_SYNCS):
    """An AFTER hook for the cache's ``init_hicache`` where features stand down
    (the version guard refused this SGLang for them): it publishes path ``off``
    with ``reason`` for each of ``syncs`` under the cache's own metric labels,
    so "installed and not pipelining" is visible, sync by sync. It reads only
    ``cache.metrics_collector`` (present with --enable-metrics), touches nothing
    else, takes any arguments (the hooked signature may have changed) and never
    raises."""

    def after_init_hicache_path_info(result, cache, *args, **kwargs):
        try:
            collector = getattr(cache, "metrics_collector", None)
            labels = getattr(collector, "labels", None)
            if isinstance(labels, Mapping):
                for sync in syncs:
                    publish(sync, "off", reason, labels, collector)
        except Exception as exc:  # never fail HiCache init
            logger.warning("HiCache: path info not exported: %r", exc)
        return result

    return after_init_hicache_path_info
