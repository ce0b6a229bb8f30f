"""A sync's path decision: pipelined or not, why (for operators) and a bounded
reason code (for machines: the path info series, doctor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

ReasonCode = Literal[
    "pipelined",
    "disabled_by_env",  # SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0
    "feature_disabled_by_env",  # the feature's own setting is off
    "excluded_by_sglang_plugins",  # SGLANG_PLUGINS leaves the plugin out (doctor)
    "untested_release",  # the guard matched no tested release for this feature
    "not_in_release",  # this SGLang lacks the feature's methods, as recorded (0.5.20 PD)
    "in_tree",  # this SGLang carries the in-tree form
    "missing_attrs",  # this SGLang's objects lack what the feature reads
    "hooks_missing",  # a hooked method is not our hook (subclass override)
    "world_size_1",
    "no_span",  # attention CP x TP with no existing group spanning both
    "no_controller",
    "linker",  # an external cache linker is attached
    "host_memory_mode",
    "pp",
    "no_storage",
    "storage_without_votes",  # storage attached, the walk not the votes' (the ack counts)
    "policy",  # a prefetch stop policy the votes do not know
    "policy_not_timeout",
    "agreeing",  # the group has not yet agreed on the setting
    "draining",  # inside drain_before_retraction
]


@dataclass(frozen=True)
class Decision:
    """A path decision: pipelined or not, why (for operators) and ``code`` (for
    machines). ``group`` and ``world_size``: the group a pipelined reduce runs
    over; ``span``: attention CP x TP, the (CP, attn TP) groups whose union the
    first step checks against ``group`` (after the first exchange)."""

    pipelined: bool
    reason: str
    code: ReasonCode = "pipelined"
    group: Any = None
    world_size: int = 1
    span: Optional[tuple[Any, Any]] = None


def blocking(reason: str, code: ReasonCode) -> Decision:
    return Decision(False, reason, code)


def missing_attrs(obj: Any, names: Iterable[str]) -> Optional[Decision]:
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
