"""Compose ``sglang/srt/mem_cache/hicache_ack_sync.py`` from the plugin's own
sources, as they are when this runs.

The statements of env.py (only those the rest needs), core.py, ack_sync.py and
the in-tree glue (``glue.py``) are copied as source text, with the comments
above them, in that order. Their imports are merged and pruned to what the
module uses; relative imports between them go (the names live in one module
now); ``__all__`` goes; a name the glue defines replaces the plugin's. Then the
text is made SGLang's: ``logging.getLogger(__name__)``, no comment naming this
package, no reference to its docs. Anything the composition cannot account for
(an import of another module of the package, a name the module uses but no
longer defines, a docstring that names the package) raises
:class:`ComposeError` naming it.
"""

from __future__ import annotations

import ast
import builtins
import re
import symtable
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..options import ToolError

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # python/hicache_async_ack
GLUE = Path(__file__).with_name("glue.py")
MODULE_NAME = "hicache_ack_sync"
MODULE_PATH = f"sglang/srt/mem_cache/{MODULE_NAME}.py"
# (label, path), in the order their statements appear in the module. env.py
# contributes only what the others use.
SOURCES = (
    ("env.py", PACKAGE_DIR / "env.py"),
    ("core.py", PACKAGE_DIR / "core.py"),
    ("ack_sync.py", PACKAGE_DIR / "ack_sync.py"),
    ("glue.py", GLUE),
)
PRUNED = ("env.py",)
SECTION_TITLES = {
    "env.py": "settings",
    "core.py": "the pipelined reduce (engine-agnostic)",
    "ack_sync.py": "the step on UnifiedRadixCache",
    "glue.py": "per-cache state, created on first use",
}
# Relative imports that resolve inside the composed module.
LOCAL_MODULES = {"env", "core", "ack_sync"}
# What unified_radix_cache.py imports from the module (checked to exist).
EXPORTS = (
    "agreed_ready_counts",
    "get_ack_sync_state",
    "pipelined_check_hicache_events",
    "state_of",
)
# Words the module must not contain (it is SGLang's code, not ours).
# (The settings' names contain HICACHE_ASYNC_ACK in capitals: that is not the package.)
FORBIDDEN = re.compile(r"hicache_async_ack|hicache-async-ack|[Pp]lugin")
# Text rewrites of the plugin's prose; each is a no-op when its text is absent.
REWRITES = (
    (re.compile(r"\s*\((?:see )?docs/[^)]*\)"), ""),  # "(docs/design.md, ...)"
    (re.compile(r"(?<![\w.])core\.(?=[A-Za-z_])"), ""),  # "core.Stamp": one module now
)
LOGGER = re.compile(r"^logger\s*=\s*logging\.getLogger\(.*\)\s*$")
BANNER_WIDTH = 80


class ComposeError(ToolError):
    """The plugin's sources changed in a way the in-tree module cannot follow."""


@dataclass
class Chunk:
    """One top-level statement, with the comment lines right above it."""

    source: str
    text: str  # comments + statement, as in the source
    blank_before: int  # blank lines above its comments in the source
    defines: set[str]
    uses: set[str]
    is_def: bool


@dataclass
class Parsed:
    docstring: str
    chunks: list[Chunk] = field(default_factory=list)
    imports: list[tuple[str, Optional[str], str]] = field(default_factory=list)
    local_names: list[tuple[str, str]] = field(default_factory=list)  # (name, from module)


def _names_used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _names_defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    out: set[str] = set()
    for t in targets:
        out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_all(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign) and _names_defined(node) == {"__all__"}


def parse_source(label: str, text: str) -> Parsed:
    tree = ast.parse(text)
    lines = text.splitlines()
    body = tree.body
    doc = ast.get_docstring(tree, clean=True) or ""
    parsed = Parsed(doc)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and node not in body:
            raise ComposeError(
                f"{label}:{node.lineno}: a nested relative import "
                f"(from {'.' * node.level}{node.module or ''} import ...): the in-tree "
                "module carries only env.py, core.py and ack_sync.py"
            )
    prev_end = 0
    for node in body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        above = lines[prev_end : start - 1]
        prev_end = node.end_lineno or node.lineno
        if node is body[0] and _is_docstring(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            _local_import(label, node, parsed)
            continue
        if isinstance(node, ast.Import):
            parsed.imports += [(a.name, None, a.asname or a.name) for a in node.names]
            continue
        if isinstance(node, ast.ImportFrom):
            parsed.imports += [(node.module or "", a.name, a.asname or a.name) for a in node.names]
            continue
        if _is_all(node):
            continue
        blank = 0
        while above and not above[0].strip():
            above.pop(0)
            blank += 1
        stmt = lines[start - 1 : prev_end]
        parsed.chunks.append(
            Chunk(
                source=label,
                text="\n".join(above + stmt),
                blank_before=blank,
                defines=_names_defined(node),
                uses=_names_used(node),
                is_def=isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)),
            )
        )
    return parsed


def _local_import(label: str, node: ast.ImportFrom, parsed: Parsed) -> None:
    module = (node.module or "").rsplit(".", 1)[-1]
    if node.level > 3 or module not in LOCAL_MODULES:
        raise ComposeError(
            f"{label}:{node.lineno}: imports from {'.' * node.level}{node.module or ''}, "
            f"which the in-tree module does not carry (it holds {', '.join(sorted(LOCAL_MODULES))} "
            "and the glue); move what it needs into one of those or keep it plugin-only"
        )
    parsed.local_names += [(a.name, module) for a in node.names]
    for a in node.names:
        if a.asname and a.asname != a.name:
            raise ComposeError(f"{label}:{node.lineno}: 'import {a.name} as {a.asname}'")


# ------------------------------------------------------------------ selection
def select(parsed: dict[str, Parsed]) -> list[Chunk]:
    """The chunks of the module, in order: the glue's names replace the
    others'; env.py keeps only what the rest needs (transitively)."""
    glue_names = set().union(*(c.defines for c in parsed["glue.py"].chunks))
    chunks: list[Chunk] = []
    for label, p in parsed.items():
        for c in p.chunks:
            if label != "glue.py" and c.defines & glue_names:
                if not c.defines <= glue_names:
                    raise ComposeError(
                        f"{label}: one statement defines {sorted(c.defines)}; the glue "
                        f"replaces only {sorted(c.defines & glue_names)}"
                    )
                continue
            chunks.append(c)
    kept = [c for c in chunks if c.source not in PRUNED]
    needed = set().union(*(c.uses for c in kept))
    candidates = [c for c in chunks if c.source in PRUNED]
    take: list[Chunk] = []
    changed = True
    while changed:
        changed = False
        for c in candidates:
            if c not in take and c.defines & needed:
                take.append(c)
                needed |= c.uses
                changed = True
    chunks = [c for c in chunks if c.source not in PRUNED or c in take]
    seen: dict[str, str] = {}
    for c in chunks:
        for name in c.defines:
            if name in seen:
                raise ComposeError(f"{name} is defined in both {seen[name]} and {c.source}")
            seen[name] = c.source
    for label, p in parsed.items():
        for name, module in p.local_names:
            if name not in seen:
                raise ComposeError(
                    f"{label} imports {name} from .{module}, which no source of the "
                    "in-tree module defines any more"
                )
    return chunks


# ------------------------------------------------------------------ text
def _drop_comment_runs(text: str) -> str:
    """Drop every run of full-line comments that names this package."""
    out: list[str] = []
    run: list[str] = []

    def flush() -> None:
        if not any(FORBIDDEN.search(line) for line in run):
            out.extend(run)
        run.clear()

    for line in text.split("\n"):
        if line.strip().startswith("#"):
            run.append(line)
            continue
        flush()
        out.append(line)
    flush()
    return "\n".join(out)


def sglang_text(text: str) -> str:
    text = _drop_comment_runs(text)
    for pattern, repl in REWRITES:
        text = pattern.sub(repl, text)
    return text


def banner(title: str) -> str:
    return "# " + "-" * (BANNER_WIDTH - len(title) - 3) + " " + title


def docstring(parsed: dict[str, Parsed]) -> str:
    """The glue's docstring, then core.py's after its summary (its paragraphs on
    how the reduce agrees; one that talks about imports describes the plugin's
    layout and is left out)."""
    paras = [p for p in parsed["core.py"].docstring.split("\n\n")[1:] if "import" not in p]
    text = "\n\n".join([parsed["glue.py"].docstring.strip(), *paras]).strip()
    if '"""' in text:
        raise ComposeError('a module docstring contains """')
    return f'"""{sglang_text(text)}\n"""'


def imports(parsed: dict[str, Parsed], body: str) -> str:
    """The module's imports: those of its sources that the body uses, in
    isort's sections (stdlib, third-party, sglang), plain imports first."""
    used = _names_used(ast.parse(body))
    plain: set[str] = set()
    froms: dict[str, set[str]] = {}
    for p in parsed.values():
        for module, name, bound in p.imports:
            if bound.split(".")[0] not in used:
                continue
            if name is None:
                plain.add(module)
            else:
                froms.setdefault(module, set()).add(name if bound == name else f"{name} as {bound}")

    def section(module: str) -> int:
        root = module.split(".")[0]
        return 0 if root in sys.stdlib_module_names else 2 if root == "sglang" else 1

    sections: dict[int, list[tuple[bool, str, str]]] = {}
    for m in plain:
        sections.setdefault(section(m), []).append((False, m, f"import {m}"))
    for m, names in froms.items():
        sections.setdefault(section(m), []).append((True, m, _from_import(m, sorted(names))))
    blocks = ["\n".join(line for *_, line in sorted(v)) for _, v in sorted(sections.items())]
    return "\n\n".join(["from __future__ import annotations", *blocks])


def _from_import(module: str, names: list[str]) -> str:
    one = f"from {module} import {', '.join(names)}"
    if len(one) <= 88:
        return one
    inner = "".join(f"    {n},\n" for n in names)
    return f"from {module} import (\n{inner})"


def compose() -> str:
    """The text of ``sglang/srt/mem_cache/hicache_ack_sync.py``."""
    parsed: dict[str, Parsed] = {}
    for label, path in SOURCES:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ComposeError(f"cannot read {label} ({path}): {exc}") from exc
        parsed[label] = parse_source(label, text)
    chunks = select(parsed)
    loggers = [c for c in chunks if LOGGER.match(c.text.strip())]
    chunks = [c for c in chunks if c not in loggers]
    parts: list[str] = []
    section = None
    prev_def = True
    for c in chunks:
        if c.source != section:
            section = c.source
            parts += ["\n\n\n", banner(SECTION_TITLES[c.source]), "\n"]
            blank = 0
        else:
            blank = 2 if c.is_def or prev_def else min(c.blank_before, 2)
            parts.append("\n" * (blank + 1))
        parts.append(sglang_text(c.text))
        prev_def = c.is_def
    body = "".join(parts).strip("\n") + "\n"
    head = [docstring(parsed), "", imports(parsed, body + ("logging" if loggers else ""))]
    if loggers:
        head += ["", "logger = logging.getLogger(__name__)"]
    text = "\n".join(head) + "\n\n\n" + body
    check_module(text)
    return text


# ------------------------------------------------------------------ checks
def check_module(text: str) -> None:
    """Compiles; every name it uses is defined; names nothing of this package;
    defines what unified_radix_cache.py imports from it."""
    try:
        compile(text, MODULE_PATH, "exec")
    except SyntaxError as exc:
        raise ComposeError(f"the composed {MODULE_PATH} does not compile: {exc}") from exc
    for i, line in enumerate(text.splitlines(), 1):
        if FORBIDDEN.search(line):
            raise ComposeError(
                f"{MODULE_PATH}:{i} names this package or its plugin form: {line.strip()!r} "
                "(a docstring or code of core.py / env.py / ack_sync.py needs neutral wording)"
            )
    table = symtable.symtable(text, MODULE_PATH, "exec")
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    missing = sorted(
        name
        for name in _global_references(table)
        if name not in defined and name not in vars(builtins)
    )
    if missing:
        raise ComposeError(f"{MODULE_PATH} uses names it does not define: {', '.join(missing)}")
    absent = [name for name in EXPORTS if name not in defined]
    if absent:
        raise ComposeError(
            f"{MODULE_PATH} lacks {', '.join(absent)} (unified_radix_cache.py calls it)"
        )


def _global_references(table: symtable.SymbolTable) -> set[str]:
    """Names read in ``table`` (and its children) that resolve at module level."""
    module = table.get_type() == "module"
    out = {
        s.get_name() for s in table.get_symbols() if s.is_referenced() and (module or s.is_global())
    }
    for child in table.get_children():
        out |= _global_references(child)
    return out
