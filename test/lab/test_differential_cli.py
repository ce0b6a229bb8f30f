"""``hicache-async-ack-lab differential``: the command line around the
differential runs (test_differential.py tests the comparison).

A replayed finding runs both arms over real gloo and says 0 differ, printing
how often each path of issue 52's list was exercised (and, in a run long enough,
warning on any never exercised); the same finding with its negative control says
1 differs, counts it by clause, shows it as a scenario to replay and writes it to
--first (and --failed, every one), which replays as it was (so the CLI does not
print a count it did not measure). Bad input names what is accepted."""

from __future__ import annotations

import json

import pytest

from hicache_async_ack_lab import cli
from hicache_async_ack_lab.testing import diff_cli
from hicache_async_ack_lab.testing.diff_findings import FINDINGS, controlled

FINDING = next(s for s in FINDINGS if s["name"] == "f2_finish_after_deadline")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["differential", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_replayed_finding_matches_stock(tmp_path, capsys, monkeypatch):
    path = tmp_path / "finding.json"
    path.write_text(json.dumps(FINDING))
    monkeypatch.setattr(diff_cli, "WARN_FROM", 1)  # a run this short warns too
    rc, out, _ = run_cli(capsys, "--replay", str(path))
    assert rc == 0, out
    assert "1 scenarios, 0 differ from stock (0 on a hard clause" in out, out
    assert "stop 1" in out  # what it exercised is printed
    assert "resources (rank 0), stock / plugin: L3 queries 1 / 1, reads 1 / 1" in out, out
    assert "issue 52's paths: host match (admitted with host tokens) 1," in out, out
    assert "order fcfs 1," in out and "TP=2 1," in out, out
    warning = next(line for line in out.splitlines() if "WARNING: never exercised" in line)
    assert "TP=4" in warning and "TP=2" not in warning, warning


def test_a_difference_is_shown_as_a_scenario_to_replay(tmp_path, capsys):
    path, first, failed = (tmp_path / f for f in ("control.json", "first.json", "failed.json"))
    path.write_text(json.dumps([controlled(FINDING)]))
    argv = ("--replay", str(path), "--first", str(first), "--failed", str(failed))
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 1, out
    assert "1 scenarios, 1 differ from stock" in out, out
    assert "failing scenarios by clause: " in out, out
    assert "scenario f2_finish_after_deadline_control:" in out and "replay it:" in out
    assert json.loads(first.read_text()) == controlled(FINDING)
    assert json.loads(failed.read_text()) == [controlled(FINDING)]


@pytest.mark.parametrize(
    "content, said",
    [
        ("not json", "not a readable JSON scenario"),
        ("[]", "expected a scenario object or a list of them"),
        ('{"passes": 3}', "expected a scenario object or a list of them"),
    ],
)
def test_a_bad_replay_file_is_named(tmp_path, capsys, content, said):
    path = tmp_path / "bad.json"
    path.write_text(content)
    rc, _, err = run_cli(capsys, "--replay", str(path))
    assert rc != 0 and said in err and str(path) in err, err


def test_a_non_positive_count_is_refused(capsys):
    rc, _, err = run_cli(capsys, "--scenarios", "0")
    assert rc != 0 and "--scenarios and --batch take a positive count" in err, err


def test_an_unknown_control_names_the_accepted_ones(tmp_path, capsys):
    path = tmp_path / "control.json"
    path.write_text(json.dumps({**FINDING, "control": ["no_such_guarantee"]}))
    rc, _, err = run_cli(capsys, "--replay", str(path))
    assert rc != 0, err  # refused before any rank starts
    assert "unknown control(s) ['no_such_guarantee']; accepted: after_pops" in err, err
