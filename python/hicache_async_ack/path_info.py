"""The "why" series: ``sglang:hicache_sync_path_info{sync, path, reason, <cache labels>} 1``
per rank and sync, so a dashboard reads why a rank is blocking without its logs.
``reason`` is the decision's bounded snake_case code (the series count stays small); on
a change the previous combination drops to 0. prometheus_client (or SGLang's collector
class) is imported only when a path is published, i.e. only with metrics on.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Mapping, Optional, Protocol, cast

from .names import CACHE_SYNCS, LOGGER_NAME, SYNC_NAMES

logger = logging.getLogger(LOGGER_NAME)


class Labelled(Protocol):
    """A metric family class's instance (prometheus_client's, or SGLang's collector's)."""

    def labels(self, **labels: str) -> object: ...


FamilyClass = Callable[..., Labelled]


class Settable(Protocol):
    def set(self, value: float) -> None: ...


def collector_classes(
    metrics_collector: object = None,
) -> tuple[FamilyClass, FamilyClass, FamilyClass]:
    """(Counter, Gauge, Histogram): the classes SGLang's cache metrics use (``_counter_cls``
    ...; other collectors, e.g. Ray's, get ours too); the gauge from the scheduler role's
    collector class; prometheus_client's where SGLang has none."""
    from prometheus_client import Counter, Gauge, Histogram

    cache_cls = type(metrics_collector) if metrics_collector is not None else None
    counter: Optional[FamilyClass] = getattr(cache_cls, "_counter_cls", None)
    histogram: Optional[FamilyClass] = getattr(cache_cls, "_histogram_cls", None)
    gauge: Optional[FamilyClass] = getattr(cache_cls, "_gauge_cls", None)
    if gauge is None or cache_cls is None:  # no collector at all: the scheduler role's
        scheduler_cls = _scheduler_collector_class()
        gauge = gauge or getattr(scheduler_cls, "_gauge_cls", None)
        if cache_cls is None:
            counter = getattr(scheduler_cls, "_counter_cls", None)
            histogram = getattr(scheduler_cls, "_histogram_cls", None)
    defaults = cast(tuple[FamilyClass, FamilyClass, FamilyClass], (Counter, Gauge, Histogram))
    return counter or defaults[0], gauge or defaults[1], histogram or defaults[2]


def _scheduler_collector_class() -> object:
    try:
        from sglang.srt.observability.metrics_collector import (
            STAT_LOGGER_ROLE_SCHEDULER,
            SchedulerMetricsCollector,
            resolve_collector_class,
        )

        found: object = resolve_collector_class(
            STAT_LOGGER_ROLE_SCHEDULER, SchedulerMetricsCollector
        )
        return found
    except Exception:  # an SGLang without pluggable collectors
        return None


NAME = "sglang:hicache_sync_path_info"
# blocking: SGLang's own path on a hooked cache; off: the plugin registered nothing for it.
PATHS = ("pipelined", "blocking", "off")
OTHER = "other"  # a code that is not a bounded snake_case word
_CODE = re.compile(r"[a-z][a-z0-9_]{0,47}")

# label names -> gauge family (one per label set, as metrics.py keeps them)
_families: dict[tuple[str, ...], Labelled] = {}
# (labels, sync) -> the (path, reason) child currently at 1
_current: dict[tuple[tuple[tuple[str, str], ...], str], tuple[str, str]] = {}


def reason_code(code: Optional[str]) -> str:
    """``code`` if a bounded snake_case word, else ``other`` (no series per wording)."""
    return code if code is not None and _CODE.fullmatch(code) else OTHER


def _family(labelnames: tuple[str, ...], metrics_collector: object = None) -> Labelled:
    fam = _families.get(labelnames)
    if fam is not None:
        return fam
    gauge = collector_classes(metrics_collector)[1]
    extra: dict[str, Any] = {}
    if _families:
        from prometheus_client import Gauge as PromGauge

        if gauge is cast(object, PromGauge):  # the name is taken in the default registry
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
    labels: Mapping[str, object],
    metrics_collector: object = None,
) -> bool:
    """Set this rank's ``sync`` to ``path`` for ``reason`` (the one replaced drops to 0).
    Never raises: False, logged, when the series cannot be written."""
    try:
        if sync not in SYNC_NAMES:
            raise ValueError(f"unknown sync {sync!r} (one of {SYNC_NAMES})")
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
            gauge(fam, own, sync, before).set(0)
        gauge(fam, own, sync, now).set(1)
        _current[key] = now
        return True
    except Exception as exc:
        logger.warning("HiCache %s: path info not exported for %s: %r", sync, dict(labels), exc)
        return False


def gauge(fam: Labelled, own: Mapping[str, str], sync: str, path: tuple[str, str]) -> Settable:
    """The info series' child for this rank, ``sync`` and (path, reason)."""
    return cast(Settable, fam.labels(**own, sync=sync, path=path[0], reason=path[1]))


def inert_hook(reason: str, syncs: tuple[str, ...] = CACHE_SYNCS) -> Callable[..., object]:
    """An AFTER init_hicache hook where features stand down: publishes path ``off`` with
    ``reason`` for each of ``syncs`` under the cache's labels; reads only
    ``cache.metrics_collector``, takes any arguments and never raises."""

    def after_init_hicache_path_info(
        result: object, cache: object, *args: object, **kwargs: object
    ) -> object:
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
