"""Engine-agnostic (no SGLang/torch): auto depth, applied by every rank to the same
agreed observations, so the depth moves everywhere at once (docs/design.md)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .stamp import OBS_MAX

WAIT_FLOOR_S = 200e-6  # shorter waits are noise (the collective's own cost), not latency


def observation(waited_s: float, next_pending: bool, step_s: float) -> int:
    """One rank's observation for the group's MAX: its wait on the due reduce in its own
    steps (``step_s``: since its previous consume returned), rounded up, 0 under
    WAIT_FLOOR_S; the low bit: the next reduce was still in flight."""
    if waited_s < WAIT_FLOOR_S:
        steps = 0
    else:
        steps = max(1, math.ceil(waited_s / step_s)) if step_s > 0 else 1
    return min(OBS_MAX, (steps << 1) | int(next_pending))


@dataclass
class AutoDepth:
    """The depth rule. Raise by the smallest wait (in steps) once some rank waited on
    ``raise_after`` of the last ``depth + 1`` consumes (one long reduce moves nothing);
    lower by one after ``lower_after`` consecutive clean consumes (no wait, next one
    done). After a change, reduces carrying an old-depth observation are ignored (W + 1
    after a raise by W, 1 after a lower). Steps count reduces issued (same everywhere)."""

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
            # the next issue carries this observation; a raise by W skips W consumes
            self._settled_after = now_step + 1 + max(0, new - self.depth)
            self.depth, self._clean = new, 0
            self._recent.clear()
        return self.depth
