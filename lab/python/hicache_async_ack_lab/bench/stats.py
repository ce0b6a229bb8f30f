"""Figures that mean something on a shared machine: paired rounds, intervals, verdicts.

bench-server measures every arm once per round, in an order that reverses from one
round to the next (``round_order``), and compares arms only within a round: the
ratio of two arms is taken per round, and its 95% interval is a t-interval on the
log of those per-round ratios (``paired_ratio``). A box whose load drifts slowly
moves both arms of a round together, so the drift cancels in the ratio; what it
does not cancel (load that comes and goes within a round) widens the interval.

A claim ("plugin >= 0.98 of the bound") then holds only if the interval's worse end
satisfies it, fails only if the better end does not, and is **inconclusive** in
between (``verdict``): a busy box yields "inconclusive", never a number read as a
result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

# Two-sided 95% quantiles of Student's t, by degrees of freedom (1-30); beyond, the
# normal 1.96 is within 2% of the exact value.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a t-interval needs at least 2 paired rounds")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def round_order(configs: Sequence, rounds: int) -> list[list]:
    """Round r runs the configs forward if r is even, backward if odd.

    Over each pair of rounds every config sits at positions i and n-1-i, so every
    config's mean position is the same: a load that drifts linearly in time adds the
    same to every config and cancels in their ratios (with an odd number of rounds,
    up to the last round's share)."""
    return [list(configs) if r % 2 == 0 else list(configs)[::-1] for r in range(rounds)]


@dataclass(frozen=True)
class Interval:
    ratio: float  # geometric mean of the per-round ratios
    low: Optional[float]  # 95% interval; None with fewer than 2 rounds
    high: Optional[float]
    n: int  # paired rounds

    def fmt(self, spec: str = ".3f") -> str:
        if self.low is None or self.high is None:
            return f"{self.ratio:{spec}} (1 round: no interval)"
        return f"{self.ratio:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> Interval:
    """num[r] / den[r] per round r: geometric mean and 95% t-interval of the log-ratios."""
    if len(num) != len(den):
        raise ValueError(f"paired rounds differ in number: {len(num)} vs {len(den)}")
    logs = [math.log(a / b) for a, b in zip(num, den) if a > 0 and b > 0]
    if not logs:
        raise ValueError("no round with both figures above zero")
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return Interval(math.exp(mean), None, None, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Interval:
    """a[r] - b[r] per round r: the mean and its 95% t-interval (an Interval whose
    ``ratio`` is that mean difference), for figures that add (ms per pass)."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds differ in number: {len(a)} vs {len(b)}")
    if not a:
        raise ValueError("no paired round")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return Interval(mean, None, None, n)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


@dataclass(frozen=True)
class Claim:
    """What a ratio must show: at least ``threshold`` (sense ">=") or below it ("<")."""

    threshold: float
    sense: str = ">="

    def __post_init__(self):
        if self.sense not in (">=", "<"):
            raise ValueError(f"sense {self.sense!r}: expected '>=' or '<'")

    def __str__(self) -> str:
        return f"{self.sense} {self.threshold:g}"


HOLDS, FAILS, INCONCLUSIVE = "holds", "fails", "inconclusive"


def verdict(iv: Interval, claim: Claim) -> str:
    """holds / fails at the interval's ends; inconclusive where it spans the threshold."""
    if iv.low is None or iv.high is None:
        return INCONCLUSIVE
    if claim.sense == ">=":
        if iv.low >= claim.threshold:
            return HOLDS
        return FAILS if iv.high < claim.threshold else INCONCLUSIVE
    if iv.high < claim.threshold:
        return HOLDS
    return FAILS if iv.low >= claim.threshold else INCONCLUSIVE
