"""The edits to SGLang's own files, computed from the source given.

``unified_radix_cache.py``: ``check_hicache_events`` becomes a thin method that
runs the pipelined step around the original body, renamed
``_check_hicache_events_impl``; ``_sync_hicache_ready_counts`` becomes a thin
method that answers from the consumed agreement inside a pipelined step and
otherwise calls the original body, renamed ``_sync_hicache_ready_counts_blocking``;
one import. ``environ.py``: the two settings, declared in ``Envs`` next to the
other HiCache fields.

Everything is located with ``ast`` in the text given; what cannot be found, or
is found in a shape the in-tree module does not fit, raises :class:`EditError`
naming it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections import Counter
from typing import Optional

from ... import env
from ..options import ToolError
from .module import EXPORTS, MODULE_NAME

CACHE_PATH = "sglang/srt/mem_cache/unified_radix_cache.py"
ENVIRON_PATH = "sglang/srt/environ.py"
CACHE_CLASS = "UnifiedRadixCache"
ENVS_CLASS = "Envs"
MODULE = f"sglang.srt.mem_cache.{MODULE_NAME}"
# (method, what its original body is renamed to)
RENAMED = {
    "check_hicache_events": "_check_hicache_events_impl",
    "_sync_hicache_ready_counts": "_sync_hicache_ready_counts_blocking",
}
SETTINGS_READ = ("enabled", "depth", "auto")  # what the glue's read_settings fills in

CHECK_DOC = '''"""{summary}

The ready-count all_reduce is pipelined ({module}): this step
consumes the reduce issued {depth_var} steps ago,
pops what every rank agreed on and issues the next one. A cache that is
not eligible (PP, buffer_only, an external linker, ...) runs
{impl} with the blocking all_reduce.
"""'''
CHECK_BODY = """pipelined_check_hicache_events(
    get_ack_sync_state(self, {cls}),
    self,
    type(self).{impl},
)"""
CHECK_IMPL_DOC = '"""Poll async HiCache events with the counts of _sync_hicache_ready_counts."""'
SYNC_DOC = '''"""The ready counts every rank agrees on: inside a pipelined
check_hicache_events step, those of the reduce consumed at its start;
anywhere else, a blocking all_reduce."""'''
SYNC_BODY = """return agreed_ready_counts(
    state_of(self), self, type(self).{impl}
)"""
SYNC_IMPL_DOC = '"""MIN-reduce the ready counts across ranks with a blocking all_reduce."""'
ENVIRON_FIELDS = """# HiCache: pipeline the ready-count all_reduce of check_hicache_events (issue it
# async, consume it {depth_var} steps later); 0 restores the
# blocking all_reduce.
{enable_var} = EnvBool({enable_default})
# Reduces in flight, 1-{depth_max} (acks are popped that many steps late), or "{auto}".
{depth_var} = EnvStr({depth_default})"""
SECTION_RULE = re.compile(r"^\s*# ={10,}\s*$")
HICACHE_FIELD = re.compile(r"^SGLANG_(?!TEST_)\w*HICACHE\w*$")


class EditError(ToolError):
    """SGLang's source is not in a shape the patch can be computed for."""


def _indent(text: str, spaces: int) -> list[str]:
    pad = " " * spaces
    return [pad + line if line else line for line in text.split("\n")]


def _find_class(tree: ast.Module, name: str, path: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise EditError(f"{path}: no top-level class {name}")


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


# ------------------------------------------------------- unified_radix_cache.py
def check_calls(cls: ast.ClassDef, module_text: str, path: str) -> None:
    """Every ``cache.<method>(...)`` the in-tree module makes exists in the class
    and takes the keywords it passes."""
    methods = _methods(cls)
    problems = []
    for node in ast.walk(ast.parse(module_text)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "cache"
        ):
            continue
        name = node.func.attr
        fn = methods.get(name)
        if fn is None:
            problems.append(f"{name}() is missing")
            continue
        params = _params(fn)
        unknown = [k.arg for k in node.keywords if k.arg not in params and fn.args.kwarg is None]
        if unknown:
            problems.append(f"{name}() takes no {', '.join(str(k) for k in unknown)}")
    if problems:
        raise EditError(
            f"{path}: {CACHE_CLASS} does not have what the ack sync calls: "
            + "; ".join(sorted(set(problems)))
        )


def _signature_lines(lines: list[str], fn: ast.FunctionDef) -> list[str]:
    """The ``def`` line(s) up to the colon (the body starts on a later line)."""
    first_body = fn.body[0]
    end = first_body.lineno - 1
    sig = lines[fn.lineno - 1 : end]
    while sig and not sig[-1].rstrip().endswith(":"):
        sig.pop()
    if not sig:
        raise EditError(f"cannot find where the signature of {fn.name}() ends")
    return sig


def _method_edit(
    lines: list[str], fn: ast.FunctionDef, thin_doc: str, thin_body: str, impl_doc: str
) -> tuple[int, int, list[str]]:
    """(first line, last line, replacement) for one method: the thin method,
    a blank line, then the original renamed with a new docstring."""
    indent = fn.col_offset
    sig = _signature_lines(lines, fn)
    impl = RENAMED[fn.name]
    pattern = re.compile(rf"\bdef {re.escape(fn.name)}\(")
    if len(pattern.findall(sig[0])) != 1:
        raise EditError(f"cannot find 'def {fn.name}(' on line {fn.lineno}")
    renamed = [pattern.sub(f"def {impl}(", sig[0], count=1), *sig[1:]]
    body_start = fn.lineno - 1 + len(sig)  # index of the first line after the signature
    first = fn.body[0]
    has_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    rest_start = (first.end_lineno or first.lineno) if has_doc else body_start
    thin = sig + _indent(thin_doc, indent + 4) + _indent(thin_body, indent + 4)
    original = renamed + _indent(impl_doc, indent + 4) + lines[rest_start : fn.end_lineno]
    return fn.lineno, fn.end_lineno or fn.lineno, thin + [""] + original


def _summary(fn: ast.FunctionDef, default: str) -> str:
    doc = ast.get_docstring(fn)
    return doc.strip().split("\n\n")[0].replace("\n", " ") if doc else default


def _import_edit(tree: ast.Module, lines: list[str], path: str) -> tuple[int, list[str]]:
    """Where the import goes (before the first ``sglang.srt.mem_cache`` import
    that sorts after it, isort's order), and its lines."""
    names = ", ".join(sorted(EXPORTS))
    one = f"from {MODULE} import {names}"
    text = (
        one
        if len(one) <= 88
        else f"from {MODULE} import (\n" + "".join(f"    {n},\n" for n in sorted(EXPORTS)) + ")"
    )
    siblings = [
        n
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang.srt.")
    ]
    if not siblings:
        raise EditError(f"{path}: no top-level 'from sglang.srt... import' to place the import by")
    after = [n for n in siblings if (n.module or "") > MODULE]
    if after:
        return after[0].lineno - 1, text.split("\n")
    return siblings[-1].end_lineno or siblings[-1].lineno, text.split("\n")


def edit_cache(text: str, module_text: str, path: str = CACHE_PATH) -> str:
    """unified_radix_cache.py with the pipelined ack sync."""
    if MODULE_NAME in text:
        raise EditError(f"{path} already mentions {MODULE_NAME}: this tree is already patched")
    tree = ast.parse(text)
    lines = text.split("\n")
    cls = _find_class(tree, CACHE_CLASS, path)
    methods = _methods(cls)
    for name, impl in RENAMED.items():
        if name not in methods:
            raise EditError(f"{path}: {CACHE_CLASS}.{name}() not found")
        if impl in methods:
            raise EditError(f"{path}: {CACHE_CLASS}.{impl}() already exists")
        if _params(methods[name]) != ["self"] or methods[name].decorator_list:
            raise EditError(
                f"{path}: {CACHE_CLASS}.{name}() takes {_params(methods[name])} or is "
                "decorated; the patch is written for a plain (self) method"
            )
    check_calls(cls, module_text, path)
    check = methods["check_hicache_events"]
    sync = methods["_sync_hicache_ready_counts"]
    edits = [
        _method_edit(
            lines,
            check,
            CHECK_DOC.format(
                summary=_summary(check, "Called per scheduler step to poll async HiCache events."),
                module=MODULE_NAME,
                depth_var=env.DEPTH_VAR,
                impl=RENAMED[check.name],
            ),
            CHECK_BODY.format(cls=CACHE_CLASS, impl=RENAMED[check.name]),
            CHECK_IMPL_DOC,
        ),
        _method_edit(
            lines, sync, SYNC_DOC, SYNC_BODY.format(impl=RENAMED[sync.name]), SYNC_IMPL_DOC
        ),
    ]
    at, import_lines = _import_edit(tree, lines, path)
    edits.append((at + 1, at, import_lines))  # an insertion: first > last
    for first, last, new in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[first - 1 : last] = new
    return "\n".join(lines)


# ------------------------------------------------------------------ environ.py
def check_settings_fields() -> None:
    """The glue's read_settings fills enabled, depth and auto; a new Settings
    field without a default would need the glue to read it too."""
    for f in dataclasses.fields(env.Settings):
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in SETTINGS_READ and no_default:
            raise EditError(
                f"env.Settings has a field {f.name!r} without a default; the in-tree "
                "read_settings (tools/intree/glue.py) does not read it"
            )


def _sections(cls: ast.ClassDef, lines: list[str]) -> list[tuple[int, str]]:
    """(line, title) of each three-line section header in the class body."""
    out = []
    end = cls.end_lineno or len(lines)
    for i in range(cls.lineno, end - 2):
        if SECTION_RULE.match(lines[i]) and SECTION_RULE.match(lines[i + 2]):
            out.append((i + 1, lines[i + 1].strip().lstrip("#").strip()))
    return out


def _anchor(cls: ast.ClassDef, lines: list[str]) -> ast.stmt:
    """The field the settings go after: the last HiCache field of the section
    holding most HiCache fields (test knobs excluded), or of the class."""
    fields = [
        (n, t.id)
        for n in cls.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    ]
    sections = _sections(cls, lines)

    def section_of(node: ast.stmt) -> Optional[str]:
        titles = [title for line, title in sections if line < node.lineno]
        return titles[-1] if titles else None

    hicache = [n for n, name in fields if HICACHE_FIELD.match(name)]
    if not hicache:
        return cls.body[-1]
    counts = Counter(section_of(n) for n in hicache)
    best = counts.most_common(1)[0][0]
    return [n for n in hicache if section_of(n) == best][-1]


def edit_environ(text: str, path: str = ENVIRON_PATH) -> str:
    """environ.py with the two settings declared in Envs."""
    check_settings_fields()
    tree = ast.parse(text)
    lines = text.split("\n")
    cls = _find_class(tree, ENVS_CLASS, path)
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [c for c in ("EnvBool", "EnvStr") if c not in defined]
    if missing:
        raise EditError(f"{path}: no class {', '.join(missing)} (SGLang's typed env fields)")
    for var in (env.ENABLE_VAR, env.DEPTH_VAR):
        if re.search(rf"^\s+{var}\s*=", text, re.MULTILINE):
            raise EditError(f"{path}: {ENVS_CLASS} already declares {var}")
    anchor = _anchor(cls, lines)
    block = ENVIRON_FIELDS.format(
        enable_var=env.ENABLE_VAR,
        enable_default=repr(bool(env.ENABLE_DEFAULT)),
        depth_var=env.DEPTH_VAR,
        depth_default=json.dumps(str(env.DEPTH_DEFAULT)),
        depth_max=env.DEPTH_MAX,
        auto=env.DEPTH_AUTO,
    )
    at = anchor.end_lineno or anchor.lineno
    lines[at:at] = _indent(block, anchor.col_offset)
    return "\n".join(lines)
