"""The version guard: does the installed SGLang behave like a tested release, per feature?

The hooks hand upstream's own methods the agreed counts, which is only right while those
methods do what they did on a tested release. So at load time the guard fingerprints each
method in :data:`TARGETS` (:mod:`.fingerprint`) and compares them with the table recorded
from the tested wheels (``upstream_fingerprints.json``, written by the lab's ``releases
record``). Verdicts, per feature on its own methods only: **tested** (all match one
release: it runs), **untested** (a body changed: upstream's path unless
``SGLANG_HICACHE_ASYNC_ACK_ALLOW_UNTESTED=1``), **incompatible** (missing, or other
parameters: off even with the opt-in), **absent** (missing as recorded for a tested
release: nothing registered). docs/versions.md says how to widen the range.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from .fingerprint import (  # noqa: F401  (the lab records tables with these)
    BODY,
    SCHEME,
    SIGNATURE,
    canonical,
    find_def,
    fingerprint_def,
    fingerprint_function,
    module_source_path,
    param_names,
    parse_function_source,
)
from .names import SYNC_NAMES
from .targets import (  # noqa: F401  (the guard's vocabulary, re-exported)
    CACHE_CLASS,
    CACHE_MODULE,
    MANAGER_CLASS,
    MANAGER_MODULE,
    TARGETS,
    Target,
)

TABLE_PATH = Path(__file__).with_name("upstream_fingerprints.json")


@dataclass(frozen=True)
class Probe:
    """What one target looks like in the SGLang at hand."""

    target: Target
    fingerprint: Optional[str] = None
    params: Optional[tuple[str, ...]] = None
    missing: Optional[str] = None  # why it could not be found
    unreadable: Optional[str] = None  # found, but its source could not be read


def probe_node(target: Target, node: ast.AST) -> Probe:
    return Probe(target, fingerprint_def(node, target.scope), param_names(node))


def probe_live(target: Target) -> Probe:
    """Probe the imported SGLang."""
    try:
        obj: Any = importlib.import_module(target.module)
    except Exception as exc:  # any import failure: not there
        return Probe(target, missing=f"cannot import {target.module}: {exc!r}")
    for part in target.qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return Probe(target, missing=f"{target.module} has no {target.qualname}")
    if not callable(obj):
        return Probe(target, missing=f"{target.qualname} is not callable")
    try:
        node = parse_function_source(inspect.getsource(inspect.unwrap(obj)))
    except Exception as exc:  # no source shipped (compiled only), or not a def
        return Probe(target, unreadable=f"source not readable: {exc!r}")
    return probe_node(target, node)


def load_table(path: Optional[Path] = None) -> dict[str, dict[str, Optional[str]]]:
    """Recorded fingerprints: {release: {qualname: fingerprint or None}}."""
    path = TABLE_PATH if path is None else path
    data = json.loads(path.read_text())
    if data.get("scheme") != SCHEME:
        raise ValueError(
            f"{path.name} was recorded with fingerprint scheme {data.get('scheme')!r}, "
            f"this plugin computes {SCHEME!r}: record it again"
        )
    return data["releases"]


def release_key(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string ("0.5.23.post1" -> (0, 5, 23))."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip().lstrip("v"))
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def tested_releases(table: Optional[dict] = None) -> list[str]:
    """The tested releases, oldest first."""
    return sorted(load_table() if table is None else table, key=release_key)


def in_tested_range(version: Optional[str], tested: Iterable[str]) -> bool:
    """Whether a version string falls between the oldest and newest tested release."""
    keys = sorted(release_key(r) for r in tested)
    key = release_key(version or "")
    return bool(key) and keys[0] <= key <= keys[-1]


def installed_version() -> Optional[str]:
    """The installed SGLang's version string (the first on the path, as for the import)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class MethodVerdict:
    probe: Probe
    same_as: tuple[str, ...]  # tested releases with this exact fingerprint
    signature: Optional[str] = None  # why the parameters do not fit the hooks
    # missing here, and recorded as absent (null) in these tested releases
    absent_as: tuple[str, ...] = ()

    @property
    def target(self) -> Target:
        return self.probe.target

    @property
    def blocking(self) -> Optional[str]:
        """A problem the opt-in cannot override (missing, or other parameters)."""
        return self.probe.missing or self.signature

    def describe(self) -> str:
        if self.probe.missing and self.absent_as and not self.signature:
            needs = ", ".join(self.target.features)
            return (
                f"absent, as recorded for {', '.join(self.absent_as)}: {needs} "
                "stands down (the other features are judged without it)"
            )
        if self.blocking:
            return f"INCOMPATIBLE: {self.blocking}"
        if self.probe.unreadable:
            return f"UNKNOWN: {self.probe.unreadable}"
        if self.same_as:
            return f"same as {', '.join(self.same_as)} ({self.probe.fingerprint})"
        return f"CHANGED: matches no tested release ({self.probe.fingerprint})"


@dataclass(frozen=True)
class FeatureVerdict:
    """The guard's verdict for one feature, on the methods it wraps or relies on."""

    feature: str
    status: str  # "tested", "untested", "incompatible" or "absent" (recorded so)
    release: Optional[str]  # the tested release its methods behave like, or None
    changed: tuple[str, ...]  # its methods that differ from the reference release's
    problems: tuple[str, ...]  # what keeps it off even with the opt-in
    absent: tuple[str, ...]  # its methods this SGLang lacks, as recorded for a release

    def summary(self, verdict: "Verdict") -> str:
        """One line: what was found for this feature and what follows."""
        shown = f"SGLang {verdict.installed or '(version unknown)'}"
        if self.status == "tested":
            line = f"{shown} matches tested release {self.release}"
            if verdict.installed != self.release:
                where = "inside" if verdict.in_range else "outside"
                line += (
                    f" method for method (its version string is {where} the tested "
                    f"range {verdict.range_text})"
                )
            return line
        if self.status == "absent":
            return f"{shown} lacks {', '.join(self.absent)}, as recorded: nothing to pipeline"
        if self.status == "incompatible":
            return f"{shown} is incompatible: " + "; ".join(self.problems)
        where = "in" if verdict.in_range else "outside"
        ref = verdict.reference
        recorded = "what was recorded for" if ref == verdict.installed else "release"
        n = len(self.changed)
        return (
            f"{shown} ({where} the tested range {verdict.range_text}) is untested: "
            f"{', '.join(self.changed)} differ{'s' if n == 1 else ''} from {recorded} {ref}"
        )


@dataclass(frozen=True)
class Verdict:
    """The installed SGLang against the table, judged per feature on its own methods."""

    installed: Optional[str]  # the version string
    tested: tuple[str, ...]  # the tested releases, oldest first
    methods: tuple[MethodVerdict, ...]
    reference: str  # the tested release differences are reported against

    @property
    def in_range(self) -> bool:
        return in_tested_range(self.installed, self.tested)

    @property
    def range_text(self) -> str:
        return f"{self.tested[0]} to {self.tested[-1]}"

    def of(self, feature: str) -> list[MethodVerdict]:
        return [m for m in self.methods if feature in m.target.features]

    def feature_incompatible(self, feature: str) -> list[str]:
        """What keeps ``feature`` off even with the opt-in, each said once (a method
        recorded as absent is not one)."""
        return list(
            dict.fromkeys(
                m.blocking
                for m in self.of(feature)
                if m.blocking and not (m.absent_as and not m.signature)
            )
        )

    def feature_absent(self, feature: str) -> list[str]:
        """``feature``'s methods this SGLang lacks, as a tested release was recorded."""
        return [m.target.qualname for m in self.of(feature) if m.probe.missing and m.absent_as]

    def feature_matched(self, feature: str) -> tuple[str, ...]:
        """The tested releases every target of ``feature`` matches."""
        mine = self.of(feature)
        return tuple(r for r in self.tested if all(r in m.same_as for m in mine))

    def feature_release(self, feature: str) -> Optional[str]:
        """The tested release ``feature``'s methods behave like (preferring its own)."""
        matched = self.feature_matched(feature)
        if self.installed in matched:
            return self.installed
        return matched[-1] if matched else None

    def feature(self, feature: str) -> FeatureVerdict:
        absent = tuple(self.feature_absent(feature))
        problems = tuple(self.feature_incompatible(feature))
        release = self.feature_release(feature)
        changed = tuple(  # present, with another body (missing ones are problems or absent)
            m.target.qualname
            for m in self.of(feature)
            if m.probe.fingerprint is not None and self.reference not in m.same_as
        )
        if absent:
            status = "absent"
        elif problems:
            status = "incompatible"
        else:
            status = "tested" if release is not None else "untested"
        return FeatureVerdict(feature, status, release, changed, problems, absent)

    def features(self) -> list[FeatureVerdict]:
        return [self.feature(f) for f in SYNC_NAMES]


def judge(
    probes: list[Probe],
    installed: Optional[str],
    table: Optional[dict[str, dict[str, Optional[str]]]] = None,
) -> Verdict:
    table = load_table() if table is None else table
    tested = tuple(tested_releases(table))
    methods = []
    for p in probes:
        signature = None
        t = p.target
        if p.params is not None and t.params is not None and p.params != t.params:
            signature = (
                f"{t.qualname} takes ({', '.join(p.params)}), "
                f"the hooks pass ({', '.join(t.params)})"
            )
        same = tuple(
            r for r in tested if p.fingerprint and table[r].get(t.qualname) == p.fingerprint
        )
        absent = tuple(
            r
            for r in tested
            if p.missing and t.qualname in table[r] and table[r][t.qualname] is None
        )
        methods.append(MethodVerdict(p, same, signature, absent))

    def score(release: str) -> tuple[int, tuple[int, ...]]:
        return sum(release in m.same_as for m in methods), release_key(release)

    reference = installed if installed is not None and installed in tested else None
    return Verdict(installed, tested, tuple(methods), reference or max(tested, key=score))


def check_installed(table: Optional[Path] = None) -> Verdict:
    """The verdict on the SGLang this process imports, against ``table`` (None: the
    shipped one); never raises for SGLang's sake (an unreadable table raises)."""
    return judge([probe_live(t) for t in TARGETS], installed_version(), load_table(table))


UNTESTED = "untested (opt-in)"  # a feature's release under the opt-in, none matched


@dataclass(frozen=True)
class Judged:
    """What register() decided on: the verdict (None: every feature stands down) and
    whether the untested opt-in is set."""

    verdict: Optional[Verdict] = None
    untested_ok: bool = False

    def runs(self, sync: str) -> bool:
        """Whether register() hooks ``sync`` here (its methods tested, or untested with
        the opt-in)."""
        if self.verdict is None:
            return False
        status = self.verdict.feature(sync).status
        return status == "tested" or (status == "untested" and self.untested_ok)

    def stand_down(self, sync: str) -> Optional[str]:
        """The reason code ``sync`` stands down with here (``not_in_release``: recorded as
        absent; ``untested_release``: any other verdict that keeps it off), or None."""
        if self.runs(sync):
            return None
        absent = self.verdict is not None and self.verdict.feature(sync).status == "absent"
        return "not_in_release" if absent else "untested_release"


__all__ = ["BODY", "CACHE_CLASS", "CACHE_MODULE", "MANAGER_CLASS", "MANAGER_MODULE", "SCHEME",
    "SIGNATURE", "TABLE_PATH", "TARGETS", "UNTESTED", "FeatureVerdict", "Judged", "MethodVerdict",
    "Probe", "Target", "Verdict", "canonical", "check_installed", "find_def", "fingerprint_def",
    "fingerprint_function", "in_tested_range", "installed_version", "judge", "load_table",
    "module_source_path", "param_names", "parse_function_source", "probe_live", "probe_node",
    "release_key", "tested_releases"]  # fmt: skip
