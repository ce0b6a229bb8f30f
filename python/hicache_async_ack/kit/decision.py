"""A sync's path decision: pipelined or not, why (for operators) and a bounded
reason code (for machines: the path info series, doctor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from ..names import ReasonCode


@dataclass(frozen=True)
class Decision:
    """A path decision: pipelined or not, why (for operators) and ``code`` (for
    machines). ``group`` and ``world_size``: the group a pipelined reduce runs
    over; ``span``: attention CP x TP, the (CP, attn TP) groups whose union the
    first step checks against ``group`` (after the first exchange)."""

    pipelined: bool
    reason: str
    code: ReasonCode = "pipelined"
    group: object = None
    world_size: int = 1
    span: Optional[tuple[object, object]] = None
    groups: str = ""  # the groups it stands for, as the operator reads them: "attn CP(2) x ..."


def blocking(reason: str, code: ReasonCode) -> Decision:
    return Decision(False, reason, code)


def missing_attrs(obj: object, names: Iterable[str]) -> Optional[Decision]:
    missing = [a for a in names if not hasattr(obj, a)]
    if missing:
        return blocking(f"this SGLang's cache lacks {', '.join(missing)}", "missing_attrs")
    return None


def untested_release(release: Optional[str], whose: str) -> Optional[Decision]:
    """Why a feature stays on upstream's path where the guard matched no tested
    release for ``whose`` methods (None: it matched ``release``)."""
    if release is not None:
        return None
    return blocking(
        f"the guard matched no tested release for {whose} (docs/versions.md)", "untested_release"
    )
