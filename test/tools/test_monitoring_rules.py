"""The shipped alert rules under `promtool test rules` (Debian's Prometheus 2.42,
installed by scripts/setup.sh): a firing and a non-firing case per alert, their
input series from real servers' expositions (test/data/monitoring/, recorded by
test/support/monitoring_capture.py), in both spellings a Prometheus stores. Negative
controls: with any one alert's expression broken, promtool fails on that alert."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hicache_async_ack.metrics import FAMILIES, SERIES
from hicache_async_ack.metrics import PATH_INFO as SERIES_PATH_INFO

from support import monitoring_cases as mc

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "monitoring" / "grafana-dashboard.json"
_SERIES = re.compile(r"sglang\[:_\]\w+")
NAME_RE = re.compile(r"sglang\[:_\]([a-z_]+(?:\([a-z_|]+\)[a-z_]*)?)")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool missing: scripts/setup.sh installs Debian's prometheus")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_rule_file_checks():
    out = run_promtool("check", "rules", str(mc.RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(mc.rules_by_alert())} rules found" in out.stdout, out.stdout


def test_the_committed_promtool_tests_are_generated_from_the_fixtures():
    assert mc.TESTS.read_text() == mc.text(), (
        "monitoring/tests/prometheus-alerts.test.yml is stale: "
        "python test/support/monitoring_cases.py"
    )


def test_every_alert_has_a_firing_and_a_non_firing_case():
    alerts = mc.rules_by_alert()
    assert alerts, "no alert in the rule file"
    cases = mc.cases()
    for alert in alerts:
        kinds = {c.fires for c in cases if c.alert == alert}
        assert kinds == {True, False}, (alert, kinds)
    assert {c.alert for c in cases} == set(alerts)
    for c in cases:
        assert c.fires == bool(c.expect), c


def test_promtool_rule_tests_pass():
    out = run_promtool("test", "rules", str(mc.TESTS))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "SUCCESS" in out.stdout, out.stdout


def _mutated(tmp_path: Path, alert: str, expr: str) -> Path:
    """The rule file with one alert's expression replaced, and the committed
    tests pointed at it."""
    rules = yaml.safe_load(mc.RULES.read_text())
    hit = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert]
    assert len(hit) == 1, alert
    hit[0]["expr"] = expr
    (tmp_path / mc.RULES.name).write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = yaml.safe_load(mc.TESTS.read_text())
    tests["rule_files"] = [mc.RULES.name]
    tests["tests"] = [t for t in tests["tests"] if t["name"].startswith(f"{alert} ")]
    assert len(tests["tests"]) >= 4, (alert, "a firing and a non-firing case, two spellings")
    out = tmp_path / "tests.yml"
    out.write_text(yaml.safe_dump(tests, sort_keys=False, width=100000))
    return out


@pytest.mark.parametrize("alert", sorted(mc.rules_by_alert()))
@pytest.mark.parametrize(
    "broken, verdict",
    [("vector(0) > 1", "fires"), ("vector(1)", "does not fire")],
    ids=["never-fires", "always-fires"],
)
def test_a_broken_expression_fails_that_alerts_cases(tmp_path, alert, broken, verdict):
    """Negative control: each alert's firing cases catch a rule that never fires,
    its non-firing cases one that always does."""
    out = run_promtool("test", "rules", str(_mutated(tmp_path, alert, broken)))
    assert out.returncode != 0, out.stdout[-3000:]
    failed = out.stdout + out.stderr
    assert f"{alert} {verdict}:" in failed, failed[-3000:]


def test_annotations_are_rendered_from_labels_only():
    """The generated expectations render {{ $labels.x }} only (no $value)."""
    for alert, rule in mc.rules_by_alert().items():
        for text in rule.get("annotations", {}).values():
            rest = re.sub(r"\{\{\s*\$labels\.\w+\s*\}\}", "", text)
            assert "{{" not in rest, (alert, text)


def test_fixtures_hold_both_spellings_of_the_same_series():
    names = sorted({p.stem for p in mc.DATA.glob("*.txt")})
    assert {"plugin", "plugin-fresh", "stock", "inert", "slow", "slow-fresh"} <= set(names), names
    for name in names:
        txt = mc.exposition(name, "txt")
        om = mc.exposition(name, "om")
        assert all(s.name.startswith("sglang:") for s in txt), name
        assert all(s.name.startswith("sglang_") for s in om), name
        assert {(s.name.replace(":", "_", 1), s.labels) for s in txt} == {
            (s.name, s.labels) for s in om if not s.name.endswith("_created")
        }, name


def _patterns(text: str) -> list[re.Pattern]:
    return [re.compile("sglang_" + m.replace("sglang[:_]", "")) for m in NAME_RE.findall(text)]


@pytest.mark.parametrize("path", [mc.RULES, DASHBOARD], ids=lambda p: p.name)
def test_every_name_the_kit_matches_is_in_a_real_exposition(path):
    """Each series pattern the rules or the dashboard name matches a series of a
    recorded exposition: a typo would match nothing, silently."""
    exported = {
        s.name for n in ("plugin", "slow", "stock", "inert", "decode-offload-slow")
        for s in mc.exposition(n, "om")
    }  # fmt: skip
    patterns = _patterns(path.read_text())
    assert patterns, path
    for pattern in patterns:
        assert any(pattern.fullmatch(n) for n in exported), pattern.pattern


def test_input_notation_is_promtools():
    assert mc.compress([1.0, 1.0, 1.0, "_", "_", "stale", 2.0, 4.0, 6.0, 0.5]) == (
        "1+0x2 _x1 stale 2+2x2 0.5"
    )
    assert mc.compress([3.0, 2.0]) == "3-1x1"


def test_a_down_target_goes_stale_and_up_reads_0(tmp_path):
    """What Prometheus does when a target stops answering: its series end with a
    staleness marker, ``up`` turns 0."""
    (tmp_path / "x.txt").write_text('sglang:a{tp_rank="0"} 1.0\n')
    case = mc.Case("A", True, "x", {"n:1": [mc.Seg(2, "x"), mc.Seg(2)]}, 3)
    series = {s["series"]: s["values"] for s in mc.input_series(case, "txt", tmp_path)}
    assert series == {
        'sglang:a{instance="n:1",job="sglang",tp_rank="0"}': "1+0x1 stale _",
        'up{instance="n:1",job="sglang"}': "1+0x1 0+0x1",
    }, series


def test_rules_written_for_the_colon_spelling_miss_every_openmetrics_scrape(tmp_path):
    """Negative control of the spelling: the same rules matching only
    ``sglang:`` (what they said before) fail every firing case scraped as
    OpenMetrics, Prometheus's default, and none scraped as plain text."""
    rules = mc.RULES.read_text().replace("sglang[:_]", "sglang:")
    assert rules != mc.RULES.read_text()
    (tmp_path / mc.RULES.name).write_text(rules)
    tests = yaml.safe_load(mc.TESTS.read_text())
    tests["rule_files"] = [mc.RULES.name]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False, width=100000))
    out = run_promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert out.returncode != 0
    failed = set(re.findall(r"name: (.*?) \[", out.stdout + out.stderr))
    firing = {f"{c.alert} fires: {c.what}" for c in mc.cases() if c.fires}
    assert firing, "no firing case"
    om = set(re.findall(r"name: (.*?) \[OpenMetrics", out.stdout + out.stderr))
    text = set(re.findall(r"name: (.*?) \[plain-text", out.stdout + out.stderr))
    assert firing <= om, firing - om
    assert not (text & firing), text & firing
    assert failed


# ------------------------------------------- the dashboard and the alerts agree
def _panels() -> list[dict]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert any(p.get("targets") for p in panels), "no panel with a query"
    return panels


def _exported() -> set[str]:
    """Every series name the plugin can export, in both spellings, with the suffixes
    Prometheus gives counters and histograms."""
    declared = {SERIES_PATH_INFO, *SERIES}
    declared |= {name for families in FAMILIES.values() for _, _, name, *_ in families}
    assert len(declared) > 10, declared
    suffixes = ("", "_total", "_sum", "_count", "_bucket", "_created")
    return {(name + s).replace(":", sep, 1) for name in declared for s in suffixes for sep in ":_"}


def test_every_dashboard_series_is_one_the_plugin_exports():
    """Each name a panel selects is declared in metrics.py (SERIES, FAMILIES, the path
    info), or is Prometheus's own `up`: no panel reads a series that does not exist."""
    exported = _exported()
    names = []
    for panel in _panels():
        for target in panel.get("targets", []):
            names += [m.replace("sglang[:_]", "sglang_") for m in _SERIES.findall(target["expr"])]
            if "up{" in target["expr"]:
                names.append("up")
    assert names, "no series named by the dashboard"
    missing = [n for n in names if n != "up" and n not in exported]
    assert missing == [], missing


def test_no_panel_reads_the_votes_wait_which_stays_0():
    """The votes ride the ack counts' reduce: their wait series is kept at 0
    (metrics.py says so), so a panel on it would show a flat line forever."""
    kept_at_0 = [doc for families in FAMILIES.values() for _, _, n, doc, *_ in families
                 if n == "sglang:hicache_prefetch_votes_wait_seconds"]  # fmt: skip
    assert kept_at_0 and kept_at_0[0].startswith("Kept at 0"), kept_at_0
    exprs = [t["expr"] for p in _panels() for t in p.get("targets", [])]
    assert exprs and not [e for e in exprs if "prefetch_votes_wait_seconds" in e]


def _normal(expr: str) -> str:
    """An expression without the dashboard's job filter and without whitespace."""
    return re.sub(r"\s+", "", expr.replace(', job=~"$job"', ""))


def _split_threshold(expr: str) -> tuple[str, float]:
    m = re.fullmatch(r"(.*\))\s*>\s*([0-9.]+)\s*", expr.strip(), re.S)
    assert m, expr
    return m.group(1), float(m.group(2))


def hidden_problems(rules: dict[str, dict], panels: list[dict]) -> list[str]:
    """Where a "not hidden" alert and the dashboard's panel on the same wait series
    disagree: another expression, another window, another threshold line."""
    problems = []
    alerts = {a: r for a, r in rules.items() if a.endswith("NotHidden")}
    if not alerts:
        return ["no NotHidden alert"]
    for alert, rule in sorted(alerts.items()):
        inner, threshold = _split_threshold(rule["expr"])
        (series,) = set(re.findall(r"sglang\[:_\]\w+_wait_seconds_sum", inner))
        shown = [
            (p, t["expr"]) for p in panels for t in p.get("targets", []) if series in t["expr"]
        ]
        if len(shown) != 1:
            problems.append(f"{alert}: {len(shown)} panels read {series}")
            continue
        panel, expr = shown[0]
        if _normal(expr) != _normal(inner):
            problems.append(f"{alert}: panel {panel['title']!r} plots {expr!r}, not {inner!r}")
        steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {})
        lines = [s["value"] for s in steps.get("steps", []) if s.get("value") is not None]
        if lines != [threshold]:
            problems.append(f"{alert}: panel {panel['title']!r} draws {lines}, not {threshold}")
    return problems


def test_the_hidden_panels_plot_the_alerts_own_expression():
    """One definition of "hidden": the ack wait net of the collective's own floor
    (0.5 ms per consume), used by HiCacheAckSyncNotHidden and the dashboard alike."""
    rules = mc.rules_by_alert()
    assert "0.0005 * rate(" in rules["HiCacheAckSyncNotHidden"]["expr"]
    assert hidden_problems(rules, _panels()) == []


def test_the_hidden_check_finds_a_panel_that_drifted():
    """Negative control: the panel as it was (the raw wait rate, over Grafana's
    interval, no threshold line) and a panel on another threshold are caught."""
    rules, panels = mc.rules_by_alert(), _panels()
    ack = [p for p in panels if "ack_sync_wait_seconds_sum" in json.dumps(p)]
    assert len(ack) == 1
    raw = json.loads(json.dumps(ack[0]))
    raw["targets"][0]["expr"] = (
        "sum by (instance, cache_type, tp_rank, pp_rank, dp_rank) (rate({__name__=~"
        '"sglang[:_]hicache_ack_sync_wait_seconds_sum", job=~"$job"}[$__rate_interval]))'
    )
    raw["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] = 0.1
    found = "\n".join(hidden_problems(rules, [raw if p is ack[0] else p for p in panels]))
    assert "HiCacheAckSyncNotHidden: panel" in found and "plots" in found, found
    assert "draws [0.1], not 0.02" in found, found
    without = [p for p in panels if p is not ack[0]]
    assert "HiCacheAckSyncNotHidden: 0 panels read" in "\n".join(hidden_problems(rules, without))


def test_readme_quotes_the_same_definition():
    """README's wait-share query is the alert's, without its threshold."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", readme, re.S)
    queries = [q.strip() for b in blocks for q in b.split("\n\n") if q.strip()]
    inner, _ = _split_threshold(mc.rules_by_alert()["HiCacheAckSyncNotHidden"]["expr"])
    assert _normal(inner) in {_normal(q) for q in queries}, queries
