"""The promtool unit tests of monitoring/prometheus-alerts.yml, built from the real
expositions in test/data/monitoring/ (test/support/monitoring_capture.py records them).

Every alert gets a firing and a non-firing case. A case is a set of scrape
targets, each a timeline of one-minute scrapes; a scrape is one recorded
exposition (its series, names and label sets exactly as the server wrote them,
plus the ``job``/``instance`` labels Prometheus adds), or the target being down
(``up`` 0, its series stale from then on). Where a rule reads a rate, the
counters grow at the rate the real server showed between two captures of it
(``grow``). Histogram buckets are left out (no rule reads them; the dashboard's
quantiles are checked against a real Prometheus). Each case is generated twice:
from the plain-text captures (names ``sglang:...``) and from the OpenMetrics ones
(``sglang_...``), the two spellings a Prometheus stores depending on the protocol
it negotiated.

``python test/support/monitoring_cases.py`` rewrites monitoring/tests/prometheus-alerts.test.yml
(committed, so ``promtool test rules`` runs without Python);
test/tools/test_monitoring_rules.py checks that it is current and that it passes.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "test" / "data" / "monitoring"
RULES = ROOT / "monitoring" / "prometheus-alerts.yml"
TESTS = ROOT / "monitoring" / "tests" / "prometheus-alerts.test.yml"
JOB = "sglang"
FORMATS = {"txt": "plain-text scrape (sglang:)", "om": "OpenMetrics scrape (sglang_)"}
COUNTER_SUFFIXES = ("_total", "_sum", "_count", "_bucket")

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.name, self.labels


def exposition(name: str, fmt: str, data: Path = DATA) -> list[Sample]:
    """The samples of ``data/<name>.<fmt>``, as a scrape stores them."""
    out = []
    for line in (data / f"{name}.{fmt}").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"{name}.{fmt}: cannot parse {line!r}")
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out.append(Sample(m.group(1), labels, float(m.group(3))))
    if not out:
        raise ValueError(f"{name}.{fmt} holds no sample")
    return out


def captured_at(name: str, data: Path = DATA) -> float:
    return float(json.loads((data / "captured.json").read_text())[name])


# ------------------------------------------------------------------ timelines
Scrape = Optional[dict]  # {series key: value}, None: the target is down
Filter = Callable[[Sample], bool]


@dataclass
class Seg:
    """``minutes`` scrapes of one target: a capture held steady, a capture's
    counters growing at the real rate between two captures, or down."""

    minutes: int
    capture: Optional[str] = None  # None: down
    grow_from: Optional[str] = None  # counters grow from this capture to ``capture``
    keep: Optional[Filter] = None  # only these samples (e.g. one node's ranks)

    def scrapes(self, fmt: str, data: Path) -> list[Scrape]:
        if self.capture is None:
            return [None] * self.minutes
        after = [
            s
            for s in exposition(self.capture, fmt, data)
            if not s.name.endswith("_bucket") and (not self.keep or self.keep(s))
        ]
        if self.grow_from is None:
            one = {s.key: s.value for s in after}
            return [dict(one) for _ in range(self.minutes)]
        before = {s.key: s.value for s in exposition(self.grow_from, fmt, data)}
        span_s = captured_at(self.capture, data) - captured_at(self.grow_from, data)
        assert span_s > 0, (self.grow_from, self.capture)
        out = []
        for minute in range(self.minutes):
            scrape = {}
            for s in after:
                start = before.get(s.key, 0.0)
                if s.name.endswith(COUNTER_SUFFIXES):
                    scrape[s.key] = start + (s.value - start) * (minute * 60.0) / span_s
                else:
                    scrape[s.key] = s.value
            out.append(scrape)
        return out


def rank(tp: str) -> Filter:
    """One node of a two-node TP=2 launch: its rank's series (and the series no
    rank carries only on node 0's rank 0, as SGLang exports them there)."""
    return lambda s: dict(s.labels).get("tp_rank", "0") == tp


@dataclass
class Case:
    alert: str
    fires: bool
    what: str  # the situation, in an operator's words
    targets: dict[str, list[Seg]]  # instance -> timeline
    eval_minute: int
    expect: list[dict[str, str]] = field(default_factory=list)  # the alerts' own labels


def _fmt(v: float) -> str:
    return repr(round(v, 9)) if v != int(v) else str(int(v))


def compress(values: list) -> str:
    """promtool's input notation: runs of a constant step as ``a+bxn`` (n + 1
    values), missing samples ``_`` (``_xn``), ``stale`` where a series ended."""
    out, i = [], 0
    while i < len(values):
        v = values[i]
        if v == "_":
            j = i
            while j + 1 < len(values) and values[j + 1] == "_":
                j += 1
            out.append("_" if j == i else f"_x{j - i}")
        elif v == "stale":
            j = i
            out.append("stale")
        else:
            j, step = i, None
            while j + 1 < len(values) and not isinstance(values[j + 1], str):
                d = values[j + 1] - values[j]
                if step is not None and abs(d - step) > 1e-9 * max(1.0, abs(step)):
                    break
                step, j = d, j + 1
            if j == i:
                out.append(_fmt(v))
            else:
                assert step is not None
                sign = "+" if step >= 0 else "-"
                out.append(f"{_fmt(v)}{sign}{_fmt(abs(step))}x{j - i}")
        i = j + 1
    return " ".join(out)


def input_series(case: Case, fmt: str, data: Path = DATA) -> list[dict[str, str]]:
    series: list[dict[str, str]] = []
    for instance, timeline in case.targets.items():
        scrapes: list[Scrape] = [s for seg in timeline for s in seg.scrapes(fmt, data)]
        keys = sorted({k for s in scrapes if s is not None for k in s})
        assert keys, (case.alert, instance, "a target with no series")
        extra = (("instance", instance), ("job", JOB))
        for name, labels in keys:
            values: list = []
            seen = False
            for s in scrapes:
                if s is not None and (name, labels) in s:
                    values.append(s[(name, labels)])
                    seen = True
                elif seen:  # a scrape without it: Prometheus marks it stale
                    values.append("stale")
                    seen = False
                else:
                    values.append("_")
            labelset = ",".join(f'{k}="{v}"' for k, v in sorted(labels + extra))
            series.append({"series": f"{name}{{{labelset}}}", "values": compress(values)})
        up = compress([0.0 if s is None else 1.0 for s in scrapes])
        series.append({"series": f'up{{instance="{instance}",job="{JOB}"}}', "values": up})
    return series


# -------------------------------------------------------------------- the cases
PLUGIN, FRESH = "plugin", "plugin-fresh"
STOCK, INERT = "stock", "inert"
SLOW, SLOW_FRESH = "slow", "slow-fresh"
OFFLOAD, OFFLOAD_SLOW = "decode-offload", "decode-offload-slow"
SCHEDULER = ("cache_type", "dp_rank", "pp_rank", "tp_rank")
N0, N1 = "node0:30000", "node1:30000"


def _ranks(instance: str, **labels: str) -> list[dict[str, str]]:
    base = dict(cache_type="UnifiedRadixCache", dp_rank="0", pp_rank="0", instance=instance)
    return [dict(base, tp_rank=tp, **labels) for tp in ("0", "1")]


def cases() -> list[Case]:
    return [
        # -- the upgrade case: installed, HiCache on, nothing pipelines
        Case(
            "HiCacheSyncStoodDown", True,
            "the version guard keeps the plugin inert (an SGLang method changed)",
            {N0: [Seg(20, INERT)]}, 15,
            [
                dict(instance=N0, job=JOB, sync=sync, reason="untested_release")
                for sync in ("ack_counts", "prefetch_votes")
            ],
        ),
        Case(
            "HiCacheSyncStoodDown", False, "the plugin pipelines",
            {N0: [Seg(20, PLUGIN)]}, 15,
        ),
        Case(
            "HiCacheSyncStoodDown", False, "stock SGLang (no plugin series)",
            {N0: [Seg(20, STOCK)]}, 15,
        ),
        # -- a pipelining server stopped by a sync error (the mixed launch)
        Case(
            "HiCacheSyncServerDown", True,
            "a pipelining two-node group; node 1 restarted without the plugin: "
            "both nodes stop in the first step and never serve a scrape again",
            {
                N0: [Seg(10, PLUGIN, keep=rank("0")), Seg(10)],
                N1: [Seg(10, PLUGIN, keep=rank("1")), Seg(10)],
            },
            15,
            [dict(instance=N0, job=JOB), dict(instance=N1, job=JOB)],
        ),
        Case(
            "HiCacheSyncServerDown", False, "a stock server goes down (not this plugin's)",
            {N0: [Seg(10, STOCK), Seg(10)]}, 15,
        ),
        Case(
            "HiCacheSyncServerDown", False, "the plugin pipelines, target up",
            {N0: [Seg(20, PLUGIN)]}, 15,
        ),
        # -- a restart after pipelining
        Case(
            "HiCacheSyncRestarted", True,
            "the schedulers restarted: counters start again from a fresh server's",
            {N0: [Seg(10, PLUGIN), Seg(10, FRESH)]}, 15,
            [dict(instance=N0, job=JOB)],
        ),
        Case(
            "HiCacheSyncRestarted", False, "one run, counters growing at the real rate",
            {N0: [Seg(20, PLUGIN, grow_from=FRESH)]}, 15,
        ),
        # -- a node of the group without metrics
        Case(
            "HiCacheAckSyncSeriesMissing", True,
            "two-node group, node 1 without --enable-metrics: only node 0's rank exports",
            {N0: [Seg(20, PLUGIN, keep=rank("0"))]}, 15,
            [dict(job=JOB, cache_type="UnifiedRadixCache", pp_rank="0", dp_rank="0")],
        ),
        Case(
            "HiCacheAckSyncSeriesMissing", False, "two-node group, both nodes scraped",
            {N0: [Seg(20, PLUGIN, keep=rank("0"))], N1: [Seg(20, PLUGIN, keep=rank("1"))]},
            15,
        ),
        # -- HiCache without the plugin
        Case(
            "HiCacheAckSyncNotInstalled", True, "stock SGLang with HiCache and metrics",
            {N0: [Seg(20, STOCK)]}, 17,
            [dict(instance=N0, job=JOB)],
        ),
        Case(
            "HiCacheAckSyncNotInstalled", False, "the plugin pipelines",
            {N0: [Seg(20, PLUGIN)]}, 17,
        ),
        Case(
            "HiCacheAckSyncNotInstalled", False,
            "the plugin installed but inert (HiCacheSyncStoodDown says why)",
            {N0: [Seg(20, INERT)]}, 17,
        ),
        # -- waits not hidden
        Case(
            "HiCacheAckSyncNotHidden", True,
            "a reduce slower than a step (50 ms): the real server's wait rate",
            {N0: [Seg(25, SLOW, grow_from=SLOW_FRESH)]}, 24,
            _ranks(N0),
        ),
        Case(
            "HiCacheAckSyncNotHidden", False,
            "the plugin on loopback serving a request a second: the real wait rate",
            {N0: [Seg(25, PLUGIN, grow_from=FRESH)]}, 24,
        ),
        Case(
            "HiCacheDecodeOffloadNotHidden", True,
            "a PD decode server whose offload reduce takes 50 ms: the real server's "
            "wait rate",
            {N0: [Seg(25, OFFLOAD_SLOW, grow_from=OFFLOAD)]}, 24,
            [dict(instance=N0, tp_rank=tp) for tp in ("0", "1")],
        ),
        Case(
            "HiCacheDecodeOffloadNotHidden", False, "stock SGLang (no offload series)",
            {N0: [Seg(25, STOCK)]}, 24,
        ),
    ]  # fmt: skip


# ---------------------------------------------------------------- rendering
def rules_by_alert(rules_path: Path = RULES) -> dict[str, dict]:
    import yaml

    groups = yaml.safe_load(rules_path.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def render(template: str, labels: dict[str, str]) -> str:
    """The annotation as Prometheus renders it; the shipped annotations use only
    ``{{ $labels.name }}`` (test_monitoring_rules checks that)."""
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def promtool_tests(data: Path = DATA, rules_path: Path = RULES) -> dict:
    rules = rules_by_alert(rules_path)
    tests = []
    for case in cases():
        rule = rules[case.alert]
        exp = []
        for labels in case.expect:
            exp.append(
                {
                    "exp_labels": {**labels, **rule.get("labels", {})},
                    "exp_annotations": {
                        k: render(v, labels) for k, v in rule.get("annotations", {}).items()
                    },
                }
            )
        for fmt, how in FORMATS.items():
            verdict = "fires" if case.fires else "does not fire"
            tests.append(
                {
                    "name": f"{case.alert} {verdict}: {case.what} [{how}]",
                    "interval": "1m",
                    "input_series": input_series(case, fmt, data),
                    "alert_rule_test": [
                        {
                            "eval_time": f"{case.eval_minute}m",
                            "alertname": case.alert,
                            "exp_alerts": exp,
                        }  # fmt: skip
                    ],
                }
            )
    return {
        "rule_files": [str(Path("..") / rules_path.name)],
        "evaluation_interval": "1m",
        "tests": tests,
    }


HEADER = (
    "# GENERATED by test/support/monitoring_cases.py from the real expositions in\n"
    "# test/data/monitoring/ (test/support/monitoring_capture.py records them): do not edit.\n"
    "# Run: promtool test rules monitoring/tests/prometheus-alerts.test.yml\n"
)


def text(data: Path = DATA, rules_path: Path = RULES) -> str:
    import yaml

    body = yaml.safe_dump(promtool_tests(data, rules_path), sort_keys=False, width=100000)
    return HEADER + body


def main(argv: list[str]) -> int:
    TESTS.parent.mkdir(parents=True, exist_ok=True)
    TESTS.write_text(text())
    print(f"wrote {TESTS.relative_to(ROOT)}: {len(cases())} cases x {len(FORMATS)} spellings")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
