"""The README's first command, scripts/bench.sh: every mode reaches a command that
exists (each run with --help, so nothing is measured; setup.sh, idempotent, reuses the
venv the suite runs in)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODES = ["--no-server", "--server-only", "--seed-table", "--sweep", "--pd"]


@pytest.mark.parametrize("mode", MODES)
def test_every_bench_mode_reaches_a_lab_command(mode):
    script = (ROOT / "scripts" / "bench.sh").read_text()
    assert f"  {mode})" in script  # the mode this test runs is one the script has
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench.sh"), mode, "--help"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "usage: hicache-async-ack-lab bench" in proc.stdout, proc.stdout[-2000:]
