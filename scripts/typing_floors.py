"""The typing floors CI holds (issue 53): mypy's expression report (``--any-exprs-report``)
over the runtime, every module of features/ and kit/, metrics and path_info at FLOOR%
precise or more, the runtime as a whole at TOTAL_FLOOR% or more. Prints the report's
lines for the floored modules; exits 1 naming each module below its floor.

    python scripts/typing_floors.py [--mypy PATH]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = "hicache_async_ack"
FLOOR = 90.0
TOTAL_FLOOR = 95.0
FLOORED = re.compile(rf"{RUNTIME}\.(features(\..+)?|kit(\..+)?|metrics|path_info)")
ROW = re.compile(r"^\s*(\S+)\s+(\d+)\s+(\d+)\s+([\d.]+)%\s*$")


def coverage(report: str) -> dict[str, float]:
    """Module (and "Total") -> % precise, from any-exprs.txt's text."""
    out = {}
    for line in report.splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = float(m.group(4))
    return out


def problems(cov: dict[str, float]) -> list[str]:
    """Each module under its floor; the floored modules must exist (else the report is
    not the runtime's)."""
    floored = {m: c for m, c in cov.items() if FLOORED.fullmatch(m)}
    if len(floored) < 10 or "Total" not in cov:
        return [f"the report covers {len(floored)} floored modules: not the runtime's"]
    out = [f"{m}: {c:.2f}% < {FLOOR}%" for m, c in sorted(floored.items()) if c < FLOOR]
    if cov["Total"] < TOTAL_FLOOR:
        out.append(f"the runtime: {cov['Total']:.2f}% < {TOTAL_FLOOR}%")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mypy", default=str(Path(sys.executable).with_name("mypy")))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [args.mypy, "--any-exprs-report", out, str(ROOT / "python" / RUNTIME)],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        report = Path(out, "any-exprs.txt")
        if not report.exists():
            print(done.stdout + done.stderr, file=sys.stderr)
            return 1
        cov = coverage(report.read_text())
    for m, c in sorted(cov.items()):
        if FLOORED.fullmatch(m) or m == "Total":
            print(f"typing: {m:48} {c:6.2f}%")
    bad = problems(cov)
    for b in bad:
        print(f"typing: below the floor: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
