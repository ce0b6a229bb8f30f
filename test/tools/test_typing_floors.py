"""scripts/typing_floors.py, the typing floors .ci/run holds: its reading of mypy's
expression report, and that it refuses a module under its floor (negative control)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def floors():
    spec = importlib.util.spec_from_file_location(
        "typing_floors", ROOT / "scripts" / "typing_floors.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(rows: dict[str, float]) -> str:
    lines = ["Name   Anys   Exprs   Coverage", "-" * 30]
    lines += [f"{m} 1 100 {c:.2f}%" for m, c in rows.items()]
    return "\n".join(lines)


GOOD = {f"hicache_async_ack.kit.m{i}": 99.0 for i in range(8)}
GOOD |= {"hicache_async_ack.metrics": 91.0, "hicache_async_ack.path_info": 95.0,
         "hicache_async_ack.features.ack_counts": 90.0, "hicache_async_ack.tools.doctor": 50.0,
         "Total": 96.0}  # fmt: skip


def test_a_report_at_its_floors_passes():
    f = floors()
    cov = f.coverage(report(GOOD))
    assert cov["hicache_async_ack.metrics"] == 91.0 and cov["Total"] == 96.0
    assert f.problems(cov) == []  # tools/ has no floor of its own, only the total


def test_a_module_under_its_floor_or_a_low_total_is_named():
    f = floors()
    bad = dict(GOOD, **{"hicache_async_ack.features.vote_hooks": 81.5, "Total": 94.0})
    found = f.problems(f.coverage(report(bad)))
    assert any("vote_hooks: 81.50%" in p for p in found), found
    assert any("the runtime: 94.00%" in p for p in found), found


def test_a_report_of_something_else_is_refused():
    f = floors()
    assert f.problems(f.coverage(report({"other.module": 100.0, "Total": 100.0})))
