"""Option parsing shared by the tools: typed argparse values that name what
they accept, and the options bench and doctor have in common."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional

MAX_TP = 64
DEFAULT_TP = 4
DEFAULT_STEP_MS = 11.0


def int_in(name: str, lo: int, hi: Optional[int] = None, why: str = "") -> Callable[[str], int]:
    accepted = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"

    def parse(raw: str) -> int:
        try:
            v: Optional[int] = int(raw)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(
                f"invalid {name} {raw!r}; accepted values: {accepted}{why}"
            )
        return v

    return parse


def nonneg_float(name: str, unit: str) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            v = float(raw)
        except ValueError:
            v = math.nan
        if not (v >= 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(
                f"invalid {name} {raw!r}; accepted values: a number >= 0 ({unit})"
            )
        return v

    return parse


def subcommand(
    sub: Any, name: str, summary: str, description: str, **kw: Any
) -> argparse.ArgumentParser:
    """A subcommand parser with the options every tool shares (--tp, --step-ms)."""
    return sub.add_parser(
        name, parents=[ranks_and_step_parent()], help=summary, description=description, **kw
    )


def ranks_and_step_parent() -> argparse.ArgumentParser:
    """--tp and --step-ms, as bench and doctor both take them."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--tp",
        type=int_in("--tp", 1, MAX_TP),
        default=DEFAULT_TP,
        help=f"ranks (processes) in the TP group (default {DEFAULT_TP})",
    )
    p.add_argument(
        "--step-ms",
        type=nonneg_float("--step-ms", "milliseconds"),
        default=DEFAULT_STEP_MS,
        help=f"forward time per scheduler step, host idle (default {DEFAULT_STEP_MS:g})",
    )
    return p
