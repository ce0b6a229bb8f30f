"""Unified diffs in git's shape (``diff --git`` headers, the enclosing ``def``
after each ``@@``), and a strict applier that names the hunk that does not apply.

The applier is GNU patch without fuzz: each hunk's old lines must match exactly,
at the line the header names or, like patch, at the nearest offset from it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hicache_async_ack_lab.cli_support import ToolError

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
CONTEXT_LINE = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s")


class PatchDoesNotApply(ToolError):
    """A hunk's old lines are not in the tree."""


# ------------------------------------------------------------------ writing
def _context(old_lines: list[str], body: list[str], i: int, start: int) -> str:
    """The nearest ``def``/``class`` line above the first line hunk ``i`` of
    ``body`` changes (``start``: its first old line, 1-based), like git's
    funcname, but taken at the change rather than above the hunk, so a hunk
    that starts at a ``def`` is named after it."""
    lead = 0
    for line in body[i + 1 :]:
        if not line.startswith(" "):
            break
        lead += 1
    for line in reversed(old_lines[: max(start - 1 + lead, 0)]):
        if CONTEXT_LINE.match(line):
            return " " + line.strip()[:80]
    return ""


def file_diff(path: str, old: Optional[str], new: str) -> str:
    """The diff of one file (``old`` None: a new file), git-style headers."""
    for label, text in (("old", old), ("new", new)):
        if text and not text.endswith("\n"):
            raise ToolError(f"{path}: the {label} text has no final newline")
    old_lines = (old or "").splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    body = list(
        difflib.unified_diff(
            old_lines,
            new_lines,
            fromfile="/dev/null" if old is None else f"a/{path}",
            tofile=f"b/{path}",
            n=3,
        )
    )
    if not body:
        return ""
    head = [f"diff --git a/{path} b/{path}\n"]
    if old is None:
        head.append("new file mode 100644\n")
    out = []
    bare = [line.rstrip("\n") for line in old_lines]
    for i, line in enumerate(body):
        m = HUNK.match(line.rstrip("\n"))
        if m and old is not None:
            line = line.rstrip("\n") + _context(bare, body, i, int(m.group(1))) + "\n"
        elif line.startswith(("--- ", "+++ ")):
            line = line.rstrip() + "\n"  # difflib adds a tab when no date is given
        out.append(line)
    return "".join(head + out)


# ------------------------------------------------------------------ reading
@dataclass
class Hunk:
    number: int  # 1-based, within its file
    header: str
    old_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str
    new_file: bool
    hunks: list[Hunk] = field(default_factory=list)


def parse(diff: str) -> list[FilePatch]:
    files: list[FilePatch] = []
    lines = diff.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            src, dst = line[4:].strip(), lines[i + 1][4:].strip()
            path = dst[2:] if dst.startswith("b/") else dst
            files.append(FilePatch(path, src == "/dev/null"))
            i += 2
            continue
        m = HUNK.match(line)
        if m:
            if not files:
                raise ToolError(f"line {i + 1}: a hunk before any file header")
            f = files[-1]
            hunk = Hunk(len(f.hunks) + 1, line, int(m.group(1)))
            old_n = int(m.group(2) if m.group(2) is not None else 1)
            new_n = int(m.group(4) if m.group(4) is not None else 1)
            i += 1
            while (len(hunk.old) < old_n or len(hunk.new) < new_n) and i < len(lines):
                body = lines[i]
                tag, text = (body[:1], body[1:]) if body else (" ", "")
                if tag in " -":
                    hunk.old.append(text)
                if tag in " +":
                    hunk.new.append(text)
                if tag not in " -+\\":
                    raise ToolError(f"line {i + 1}: not a hunk line: {body!r}")
                i += 1
            f.hunks.append(hunk)
            continue
        i += 1
    return files


# ------------------------------------------------------------------ applying
def _find(lines: list[str], block: list[str], expected: int, floor: int) -> Optional[int]:
    """Index where ``block`` matches ``lines``, nearest to ``expected``, not
    before ``floor``."""
    if not block:
        return max(expected, floor)
    last = len(lines) - len(block)
    for delta in range(0, len(lines) + 1):
        for at in (expected - delta, expected + delta) if delta else (expected,):
            if floor <= at <= last and lines[at : at + len(block)] == block:
                return at
    return None


def _why(lines: list[str], hunk: Hunk, at: int, offset: int) -> str:
    """The first line that differs where the hunk was expected (numbered as in
    the file, before the earlier hunks were applied)."""
    for k, want in enumerate(hunk.old):
        got = lines[at + k] if 0 <= at + k < len(lines) else None
        if got != want:
            where = f"line {at + k + 1 - offset}"
            found = "the end of the file" if got is None else repr(got)
            return f"{where} should read {want!r}, found {found}"
    return "its lines are there, but before an earlier hunk"  # pragma: no cover


def apply(diff: str, root: Path) -> dict[str, str]:
    """The new text of every file the diff touches, read under ``root`` (the
    directory holding ``sglang/``). Raises :class:`PatchDoesNotApply` naming
    every hunk that does not apply (file, number, header, the first line that
    differs where it was expected)."""
    out: dict[str, str] = {}
    failures: list[str] = []
    for f in parse(diff):
        target = root / f.path
        if f.new_file:
            if target.exists():
                failures.append(f"{f.path}: is to be created but exists (already patched?)")
                continue
            lines: list[str] = []
        else:
            try:
                lines = target.read_text().splitlines()
            except OSError as exc:
                failures.append(f"{f.path}: cannot read it ({exc.strerror})")
                continue
        offset = 0
        floor = 0
        for hunk in f.hunks:
            expected = max(hunk.old_start - 1 + offset, 0) if hunk.old else hunk.old_start
            at = _find(lines, hunk.old, expected, floor)
            if at is None:
                failures.append(
                    f"{f.path}: hunk #{hunk.number} does not apply ({hunk.header}): "
                    + _why(lines, hunk, min(max(expected, 0), len(lines)), offset)
                )
                continue
            lines[at : at + len(hunk.old)] = hunk.new
            offset += len(hunk.new) - len(hunk.old)
            floor = at + len(hunk.new)
        out[f.path] = "\n".join(lines) + "\n"
    if failures:
        raise PatchDoesNotApply("the patch does not apply:\n  " + "\n  ".join(failures))
    return out
