"""Engine-agnostic: auto depth, the rule every rank applies to the same agreed
observations at the same consume, so the lag depth moves on every rank at once
with no extra collective (docs/design.md, "Auto depth"). No SGLang or torch
import here."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .stamp import OBS_MAX

WAIT_FLOOR_S = 200e-6  # shorter waits are noise (the collective's own cost), not latency


def observation(waited_s: float, next_pending: bool, step_s: float) -> int:
    """One rank's observation at a consume, for the group's MAX: how long it
    waited on the due reduce, in steps of its own (``step_s``: from the end of
    its previous consume to this one, so the step's work, not its waits)
    rounded up, 0 for a wait under WAIT_FLOOR_S; above one bit:
    whether the reduce after it was still in flight (so one step less depth
    would have waited). Any wait outranks every 'still in flight'."""
    if waited_s < WAIT_FLOOR_S:
        steps = 0
    else:
        steps = max(1, math.ceil(waited_s / step_s)) if step_s > 0 else 1
    return min(OBS_MAX, (steps << 1) | int(next_pending))


@dataclass
class AutoDepth:
    """The depth rule every rank applies to the same agreed observations at the
    same consume, so the depth moves on every rank at once with no extra
    collective. An observation says how many steps some rank waited (rounded
    up) and whether the next reduce was still in flight.

    * Once some rank waited on ``raise_after`` of the last ``depth + 1``
      consumed reduces (a sustained latency: one long reduce is an outlier and
      moves nothing; at depth k a sustained one shows on every k-th consume,
      since the k - 1 reduces issued right after the one waited on are done by
      then), the depth rises by the smallest of those waits in steps: the depth
      that would not have waited on any of them, at once.
    * Lower by one when, on ``lower_after`` consecutive ones, nobody waited and
      every rank found the next reduce already complete.

    After a change, the reduces that still carry an observation made at the old
    depth are ignored, so one latency episode is counted once: the one issued
    in the step of the change, plus, after a raise by W, the W issued in the
    steps whose consume the raise skips (they carry the same observation). So
    W + 1 after a raise, 1 after a lower. ``issued_step`` and ``now_step``
    count reduces issued, the same on every rank."""

    lo: int = 1
    hi: int = 8
    raise_after: int = 2
    lower_after: int = 16
    depth: int = 1
    # the waits (steps, 0: none) of the latest depth + 1 consumes since the last change
    _recent: deque[int] = field(default_factory=deque)
    _clean: int = 0
    _settled_after: int = 0  # reduces issued up to this step predate the last change
    # the latest changes, (step, from, to): for the log and the tests
    changes: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=64))

    def update(self, obs_max: int, issued_step: int, now_step: int) -> int:
        if issued_step <= self._settled_after:
            return self.depth
        waited, next_pending = obs_max >> 1, obs_max & 1
        self._recent.append(waited)
        if len(self._recent) > self.depth + 1:
            self._recent.popleft()
        waits = [w for w in self._recent if w]
        self._clean = self._clean + 1 if not waited and not next_pending else 0
        new = self.depth
        if len(waits) >= self.raise_after:
            new = min(self.hi, self.depth + min(waits))
        elif self._clean >= self.lower_after and self.depth > self.lo:
            new = self.depth - 1
        if new != self.depth:
            self.changes.append((now_step, self.depth, new))
            # the next issue carries this consume's observation; a raise by W
            # skips W consumes, whose issues carry it again
            self._settled_after = now_step + 1 + max(0, new - self.depth)
            self.depth, self._clean = new, 0
            self._recent.clear()
        return self.depth
