"""Which plugin release speaks which wire protocol (no SGLang, no torch).

Every rank stamps its reduces with ``protocol.stamp.PROTOCOL_VERSION``; ranks that
differ stop at the first exchange. What a release puts on the wire is fingerprinted
from the wire's constants (every upper-case int, or mapping to ints, of
:mod:`.protocol.stamp` and :mod:`.protocol.votes`: the protocol numbers, field widths,
flag bits, section layout, codes) and recorded per release in :data:`RELEASES`; a test
(test/tools/test_wire.py) fails when the tree's fingerprint is not the one recorded for
``__version__``, so the version moves whenever the wire does. A change to how those
constants are laid out must bump ``PROTOCOL_VERSION``, which the fingerprint covers.

The protocol core does not import this module (it sits above it); messages that name
releases take their text from :func:`describe_protocol` and :func:`protocol_hint`.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Mapping, Optional, Union

from . import __version__
from .protocol import stamp, votes

WIRE_MODULES: tuple[ModuleType, ...] = (stamp, votes)
WireValue = Union[int, dict[str, int]]
_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*")


@dataclass(frozen=True)
class Release:
    """One plugin release: its version, the ``PROTOCOL_VERSION`` values its builds spoke
    (oldest first; the last is what it ships), and the fingerprint of its wire."""

    version: str
    protocols: tuple[int, ...]
    wire: str

    @property
    def protocol(self) -> int:
        return self.protocols[-1]


# Oldest first. A wire change is a new row with a new version; until that version
# ships, its own row is updated in place (one line).
RELEASES: tuple[Release, ...] = (
    # Never tagged: its builds (2026-11-30 to 2026-12-06) all said 0.1.0 and spoke
    # protocols 1 to 4; the fingerprint is its last build's.
    Release("0.1.0", (1, 2, 3, 4), "d7ee64c2840ac2a9"),
    # 5: held prefetch starts, the read-once flag (votes 14); storage stays stock's
    # path unless the votes ride.
    Release("0.2.0", (5,), "a55a29e12fee4c52"),
)


def _assigned(module: ModuleType) -> set[str]:
    """The names ``module`` itself assigns at its top level (not those it imports)."""
    names: set[str] = set()
    for node in ast.parse(inspect.getsource(module)).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def wire_constants(modules: tuple[ModuleType, ...] = WIRE_MODULES) -> dict[str, WireValue]:
    """The wire's constants, ``module.NAME -> value``: every upper-case int (not bool) or
    mapping of str to int that one of ``modules`` assigns at its top level."""
    out: dict[str, WireValue] = {}
    for module in modules:
        short = module.__name__.rsplit(".", 1)[-1]
        for name in sorted(_assigned(module)):
            value = getattr(module, name, None)
            if not _CONSTANT.fullmatch(name):
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                out[f"{short}.{name}"] = value
            elif isinstance(value, Mapping) and all(
                isinstance(k, str) and isinstance(v, int) for k, v in value.items()
            ):
                out[f"{short}.{name}"] = dict(value)
    return out


def wire_fingerprint(constants: Optional[Mapping[str, WireValue]] = None) -> str:
    """16 hex digits of SHA-256 over the wire's constants (this tree's by default),
    in a canonical form: sorted names, sorted mapping keys."""
    data = wire_constants() if constants is None else constants
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def release(version: str = __version__) -> Optional[Release]:
    """The recorded row of ``version``, None if there is none."""
    return next((r for r in RELEASES if r.version == version), None)


def versions_speaking(protocol: int) -> tuple[str, ...]:
    """The releases whose builds spoke ``protocol``, oldest first."""
    return tuple(r.version for r in RELEASES if protocol in r.protocols)


def describe_protocol(protocol: int) -> str:
    """``protocol 4 (hicache-async-ack 0.1.0)``, for a peer's protocol in a message."""
    versions = versions_speaking(protocol)
    if versions:
        return f"protocol {protocol} (hicache-async-ack {', '.join(versions)})"
    newest = RELEASES[-1]
    later = "a later release" if protocol > newest.protocol else "an unknown build"
    return f"protocol {protocol} ({later} than hicache-async-ack {newest.version} knows)"


def protocol_hint(version: str = __version__) -> str:
    """What to do about a protocol mismatch, naming the protocol each release speaks."""
    spoken = "; ".join(
        f"{', '.join(map(str, r.protocols))}: hicache-async-ack {r.version}" for r in RELEASES
    )
    return (
        f"This node runs hicache-async-ack {version}, protocol {stamp.PROTOCOL_VERSION} "
        f"(protocols by release: {spoken}). Install the same release on every node."
    )


def tie_problems(
    version: str = __version__,
    releases: tuple[Release, ...] = RELEASES,
    constants: Optional[Mapping[str, WireValue]] = None,
) -> list[str]:
    """Why the table does not tie ``version`` to the wire ``constants`` describe (this
    tree's by default), or why the table itself is inconsistent; empty: it does."""
    data = wire_constants() if constants is None else constants
    wire, protocol = wire_fingerprint(data), data.get("stamp.PROTOCOL_VERSION")
    problems = []
    row = next((r for r in releases if r.version == version), None)
    if row is None:
        problems.append(f"no row for hicache-async-ack {version} in wire.RELEASES: add one")
    else:
        if row.wire != wire:
            problems.append(
                f"the wire changed (fingerprint {wire}, protocol {protocol}) but "
                f"hicache-async-ack {version} is recorded with {row.wire}: bump the version "
                "(hicache_async_ack.__version__ and the lab's) and add its row to "
                "wire.RELEASES; before it ships, update its row instead. Bump "
                "protocol/stamp.py's PROTOCOL_VERSION too if the layout changed."
            )
        if row.protocol != protocol:
            problems.append(
                f"hicache-async-ack {version} is recorded as speaking protocol "
                f"{row.protocol}, the tree speaks {protocol}: correct its row"
            )
        if releases[-1] is not row:
            problems.append(f"{version} is not the newest row of wire.RELEASES")
    for old, new in zip(releases, releases[1:]):
        if _key(new.version) <= _key(old.version):
            problems.append(f"wire.RELEASES: {new.version} follows {old.version}")
        if new.wire != old.wire and new.protocols[0] <= old.protocol:
            problems.append(
                f"{new.version}'s wire differs from {old.version}'s but its protocol "
                f"{new.protocols[0]} does not move past {old.protocol}: bump PROTOCOL_VERSION"
            )
    return problems


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


__all__ = ["RELEASES", "WIRE_MODULES", "Release", "describe_protocol", "protocol_hint",
    "release", "tie_problems", "versions_speaking", "wire_constants",
    "wire_fingerprint"]  # fmt: skip
