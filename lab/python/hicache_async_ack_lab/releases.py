"""SGLang releases, for maintainers: is a new release like a tested one, the
recorded fingerprint table, and per-release test overlays.

``python -m hicache_async_ack_lab.releases``

- ``check 0.5.24 [--diff]``: fetch that wheel (``pip download --no-deps``) and say,
  method by method, which tested release it matches; exit 0 when every fingerprint
  matches one tested release (the range can simply be widened), 1 when not.
- ``record [--add] [RELEASE ...]``: fetch the wheels and write
  ``upstream_fingerprints.json`` (the only way that table is written). No release:
  record the tested ones again; ``--add``: the tested ones plus these.
- ``overlay RELEASE``: install that SGLang with ``pip install --no-deps --target``
  into a cached folder outside the checkout (idempotent) and print the folder; put it
  on ``PYTHONPATH`` over the project's venv to test against that release.
- ``tested``: the tested releases, one a line.

Wheels are kept in ``~/.cache/hicache-async-ack/wheels`` and overlays in
``~/.cache/hicache-async-ack/sglang-overlays`` (``HICACHE_ASYNC_ACK_CACHE`` moves both).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Optional

from hicache_async_ack import guard as upstream
from hicache_async_ack.guard import (
    TABLE_PATH,
    TARGETS,
    Probe,
    Verdict,
    find_def,
    judge,
    module_source_path,
    probe_node,
    release_key,
)
from hicache_async_ack.names import ACK
from hicache_async_ack_lab.cli_support import ToolError

PIP_TIMEOUT_S = 600.0


def cache_root() -> Path:
    return Path(
        os.environ.get("HICACHE_ASYNC_ACK_CACHE") or Path.home() / ".cache" / "hicache-async-ack"
    )


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise ToolError(f"{' '.join(cmd)} took over {PIP_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise ToolError(f"{' '.join(cmd)} failed:\n{tail}")


def fetch(release: str) -> Path:
    """The wheel (or sdist) of ``sglang==release``, downloaded once into the cache."""
    wheels = cache_root() / "wheels"

    def cached() -> list[Path]:
        return sorted(wheels.glob(f"sglang-{release}-*.whl")) + sorted(
            wheels.glob(f"sglang-{release}.tar.gz")
        )

    if not cached():
        wheels.mkdir(parents=True, exist_ok=True)
        _pip("download", "--no-deps", f"sglang=={release}", "-d", str(wheels))
    found = cached()
    if not found:
        raise ToolError(f"pip downloaded no wheel or sdist of sglang=={release} into {wheels}")
    return found[0]


def archive_reader(path: Path) -> Callable[[str], Optional[str]]:
    """A file's text by its path inside the package (``sglang/...``), or None."""
    if path.suffix == ".whl":
        archive = zipfile.ZipFile(path)
        names = set(archive.namelist())

        def read_whl(name: str) -> Optional[str]:
            return archive.read(name).decode() if name in names else None

        return read_whl
    with tarfile.open(path) as tar:  # an sdist: sglang-X/python/sglang/... or the like
        texts: dict[str, str] = {}
        for member in tar.getmembers():
            name = _package_relative(member.name)
            f = tar.extractfile(member) if name and name.endswith(".py") else None
            if name and f is not None:
                texts[name] = f.read().decode()
    return texts.get


def _package_relative(name: str) -> Optional[str]:
    """``sglang-0.5.24/python/sglang/srt/x.py`` -> ``sglang/srt/x.py``."""
    parts = name.split("/")
    for i, part in enumerate(parts[:-1]):
        if part == "sglang":
            return "/".join(parts[i:])
    return None


def probe_sources(read: Callable[[str], Optional[str]]) -> list[Probe]:
    """Probe an SGLang that is not imported (a downloaded wheel): ``read`` gives a
    file's text by its path inside the wheel, or None when it has no such file."""
    import ast

    trees: dict[str, Optional[ast.Module]] = {}
    probes = []
    for target in TARGETS:
        if target.module not in trees:
            texts = (read(p) for p in module_source_path(target.module))
            text = next((t for t in texts if t is not None), None)
            trees[target.module] = None if text is None else ast.parse(text)
        tree = trees[target.module]
        node = None if tree is None else find_def(tree, target.qualname)
        if node is None:
            where = "module" if tree is None else "definition"
            missing = f"no {where} for {target.module}.{target.qualname}"
            probes.append(Probe(target, missing=missing))
        else:
            probes.append(probe_node(target, node))
    return probes


def without_docstring(node):
    """A copy of a definition without its docstring (for showing diffs)."""
    import ast
    import copy

    node = copy.copy(node)
    body = getattr(node, "body", None)
    if isinstance(body, list):
        doc = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        node.body = (body[1:] if doc and isinstance(body[0].value.value, str) else body) or [
            ast.Pass()
        ]
    return node


def probe_release(release: str) -> tuple[Path, list[upstream.Probe]]:
    wheel = fetch(release)
    return wheel, probe_sources(archive_reader(wheel))


# ------------------------------------------------------------------- record
def record(releases: list[str], path: Path = TABLE_PATH) -> dict:
    """Fingerprint the wheels of ``releases`` and write the table."""
    table: dict[str, dict[str, Optional[str]]] = {}
    for release in sorted(set(releases), key=release_key):
        wheel, probes = probe_release(release)
        # A method the ack sync needs must be there; one only another feature
        # needs is recorded as absent (null): that feature stays off there (the
        # decode offload sync on 0.5.20, the prefetch votes before 0.5.23).
        missing = [p.target.qualname for p in probes if p.missing and ACK in p.target.features]
        if missing:
            raise ToolError(f"sglang {release} ({wheel.name}) lacks {', '.join(missing)}")
        table[release] = {p.target.qualname: p.fingerprint for p in probes}
    data = {
        "about": "Generated by `python -m hicache_async_ack_lab.releases record` from "
        "the real wheels; do not edit by hand (docs/versions.md).",
        "scheme": upstream.SCHEME,
        "releases": table,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


# -------------------------------------------------------------------- check
def describe(verdict: Verdict, source: str) -> list[str]:
    lines = [f"sglang {verdict.installed} ({source}) against tested {verdict.range_text}:"]
    width = max(len(m.target.label) for m in verdict.methods)
    lines += [f"  {m.target.label.ljust(width)}  {m.describe()}" for m in verdict.methods]
    judged = verdict.features()
    for f in judged:
        lines.append(f"{f.feature}: {f.status}: {f.summary(verdict)}")
    changed = sorted({q for f in judged for q in f.changed})
    if all(f.status in ("tested", "absent") for f in judged):
        if verdict.installed in verdict.tested:
            lines.append("verdict: a tested release, and every fingerprint matches its record.")
        else:
            lines.append(
                f"verdict: every feature's fingerprints match a tested release. To widen the "
                f"range: record --add {verdict.installed}, bash scripts/test.sh --sglang "
                f"{verdict.installed}, then README's Supported section (docs/versions.md)."
            )
    elif any(f.status == "incompatible" for f in judged):
        problems = [p for f in judged for p in f.problems]
        lines.append("verdict: INCOMPATIBLE: " + "; ".join(dict.fromkeys(problems)))
    else:
        lines.append(
            f"verdict: CHANGED against {verdict.reference}: {', '.join(changed)}. "
            "Read those changes (--diff) and adapt the plugin where they matter before "
            "recording this release (docs/versions.md)."
        )
    return lines


def all_tested(verdict: Verdict) -> bool:
    """Every feature runs there (or is recorded as absent there)."""
    return all(f.status in ("tested", "absent") for f in verdict.features())


def _normalised_source(read: Callable[[str], Optional[str]], target: upstream.Target) -> list:
    import ast

    for name in module_source_path(target.module):
        text = read(name)
        if text is not None:
            node = find_def(ast.parse(text), target.qualname)
            if node is not None:
                return ast.unparse(without_docstring(node)).splitlines()
    return []


def diff_lines(verdict: Verdict, candidate: Path) -> list[str]:
    """Unified diffs (normalised source) of the changed methods against the reference."""
    ref = archive_reader(fetch(verdict.reference))
    new = archive_reader(candidate)
    out: list[str] = []
    changed = {q for f in verdict.features() for q in f.changed}
    for m in verdict.methods:
        if m.target.qualname not in changed:
            continue
        out += difflib.unified_diff(
            _normalised_source(ref, m.target),
            _normalised_source(new, m.target),
            f"{verdict.reference}/{m.target.qualname}",
            f"{verdict.installed}/{m.target.qualname}",
            lineterm="",
        )
    return out


def check(release: str, show_diff: bool = False) -> tuple[Verdict, list[str]]:
    t0 = time.monotonic()
    wheel, probes = probe_release(release)
    verdict = judge(probes, release)
    lines = describe(verdict, wheel.name)
    if show_diff and not all_tested(verdict):
        lines += diff_lines(verdict, wheel)
    lines.append(f"({time.monotonic() - t0:.1f} s)")
    return verdict, lines


# ------------------------------------------------------------------ overlay
def overlay(release: str) -> Path:
    """A folder holding only ``sglang==release`` (no dependencies), installed once."""
    pyver = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    target = cache_root() / "sglang-overlays" / f"{release}-{pyver}"
    stamp = target / ".complete"
    if stamp.is_file():
        return target
    print(f"releases: installing sglang {release} into {target} (once)", file=sys.stderr)
    wheel = fetch(release)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _pip("install", "--no-deps", "--no-compile", "--target", str(tmp), str(wheel))
        (tmp / ".complete").write_text(f"{wheel.name}\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------- cli
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hicache_async_ack_lab.releases",
        description="SGLang releases: check a new one against the tested ones, record "
        "the fingerprint table, install test overlays.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="does this release match a tested one, method by method?")
    c.add_argument("release")
    c.add_argument("--diff", action="store_true", help="show the changed methods' diffs")
    r = sub.add_parser("record", help="write the fingerprint table from the real wheels")
    r.add_argument("releases", nargs="*")
    r.add_argument("--add", action="store_true", help="keep the tested releases, add these")
    o = sub.add_parser("overlay", help="install one release into a cached folder; print it")
    o.add_argument("release")
    sub.add_parser("tested", help="the tested releases, one a line")
    sub.add_parser("index", help="docs/versions.md's table of every upstream target")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "check":
            verdict, lines = check(args.release, args.diff)
            print("\n".join(lines))
            return 0 if all_tested(verdict) else 1
        if args.command == "record":
            releases = list(args.releases)
            if args.add or not releases:
                releases += upstream.tested_releases()
            data = record(releases)
            print(f"recorded {', '.join(data['releases'])} into {TABLE_PATH}")
            return 0
        if args.command == "overlay":
            print(overlay(args.release))
            return 0
        if args.command == "index":
            print(index_table())
            return 0
        print("\n".join(upstream.tested_releases()))
        return 0
    except ToolError as exc:
        print(f"releases {args.command}: error: {exc}", file=sys.stderr)
        return 2


INDEX_BEGIN = "<!-- upstream index: `python -m hicache_async_ack_lab.releases index` -->"
INDEX_END = "<!-- end of the upstream index -->"


def index_table() -> str:
    """docs/versions.md's table, from the one annotated index (targets.TARGETS), between
    its markers: each target with its syncs, role, why, upstream PR and removal."""
    rows = [
        INDEX_BEGIN,
        "| target | syncs | role | why | upstream PR | can go |",
        "|---|---|---|---|---|---|",
    ]
    for t in TARGETS:
        where = t.module.removeprefix("sglang.srt.")
        scope = " (signature)" if t.scope == upstream.SIGNATURE else ""
        rows.append(
            f"| `{t.qualname}` in `{where}`{scope} | {', '.join(t.features)} | "
            f"{', '.join(t.roles)} | {t.why} | {t.pr or '-'} | {t.removal} |"
        )
    rows.append(INDEX_END)
    return "\n".join(rows)


def index_in(text: str) -> str:
    """The index as a document holds it (from its begin marker to its end marker)."""
    start, end = text.find(INDEX_BEGIN), text.find(INDEX_END)
    return text[start : end + len(INDEX_END)] if 0 <= start < end else ""


__all__ = ["INDEX_BEGIN", "INDEX_END", "check", "fetch", "index_in", "index_table", "overlay",
    "record"]  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
