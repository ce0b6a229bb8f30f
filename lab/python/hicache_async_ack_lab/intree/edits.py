"""The edits to SGLang's own files, computed from the source given.

``unified_radix_cache.py``: one import; ``ack_sync`` defaults to None (the
blocking path) on the class, as ``BasePrefixCache`` declares ``cache_controller``,
so that caches built without ``__init__`` (SGLang's unit tests build them with
``object.__new__`` and set only what the stock step reads) keep the stock step
unchanged, and again in ``__init__`` next to the other HiCache collaborators;
``init_hicache`` ends by creating it, with the disaggregation mode from its
server args; ``_sync_hicache_ready_counts`` is split into the local counts
(``_local_hicache_ready_counts``, counting over ``_hicache_ready_queues``, the
one list of what is counted, by position as the stock code counts) and the
reduce, so the pipelined path counts with the same code;
``check_hicache_events`` takes its counts from ``ack_sync`` when set, and issues
the next all_reduce right after its pops.
``environ.py``: the two settings, at the end of the radix-cache section.
``docs/references/environment_variables.md`` (a checkout only): two rows.

Everything is located with ``ast`` in the text given; what cannot be found, or
is found in a shape the edit does not fit, raises :class:`EditError` naming it.
The added lines are formatted as SGLang's black and isort would leave them (the
tests check that with SGLang's pinned versions).
"""

from __future__ import annotations

import ast
import re

from hicache_async_ack import env
from hicache_async_ack_lab.cli_support import ToolError
from hicache_async_ack_lab.intree.module import CLASS_NAME, MODULE

CACHE_PATH = "sglang/srt/mem_cache/unified_radix_cache.py"
ENVIRON_PATH = "sglang/srt/environ.py"
CACHE_CLASS = "UnifiedRadixCache"
ENVS_CLASS = "Envs"
ATTR = "ack_sync"
SYNC_CALL = "self._sync_hicache_ready_counts()"
RADIX_SECTION = re.compile(r"\bradix\b", re.IGNORECASE)
SECTION_RULE = re.compile(r"^\s*# ={10,}\s*$")
DEPTH_MAX = 8  # the in-tree module's MAX_DEPTH

LOCAL = "_local_hicache_ready_counts"
QUEUES = "_hicache_ready_queues"
# The storage control queues _sync_hicache_ready_counts counts, in its order
# (checked against the source: a release that counts others fails loudly).
STORAGE_QUEUES = (
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)
# What the local counts end with: the names the reduce then uses.
LOCAL_NAMES = ("write_acks", "load_acks", "storage_queue_sizes", "extra_pool_names")
# Where __init__ defaults the HiCache collaborators that init_hicache builds.
INIT_ANCHORS = ("self._storage_attachment", "self.cache_controller")
CLASS_DEFAULT = f"""# Also a class default (as BasePrefixCache has for cache_controller): a cache
# built without __init__, as unit tests build one, keeps the blocking path.
{ATTR}: Optional[{CLASS_NAME}] = None
"""
INIT_FIELD = f"""# Pipelines check_hicache_events' ready-count all_reduce; built by
# init_hicache where the step allows it (None: the blocking all_reduce).
self.{ATTR}: Optional[{CLASS_NAME}] = None"""
CREATE = """
# Every rank of the TP group reaches the same decision here.
self.{attr} = {cls}.create(self, {args}.disaggregation_mode)"""
QUEUES_METHOD = (
    f"""def {QUEUES}(self) -> list:
    \"\"\"What check_hicache_events pops from, in the order of its ready counts:
    the write and load acks, then, with storage, the storage control queues
    (extra pools last, in the order of their names).\"\"\"
    cc = self.cache_controller
    queues = [cc.ack_write_queue, cc.ack_load_queue]
    if self.enable_storage:
        extra = getattr(cc, "extra_host_mem_release_queues", {{}})
        queues += [
"""
    + "".join(f"            cc.{name},\n" for name in STORAGE_QUEUES)
    + """            *extra.values(),
        ]
    return queues
"""
)
LOCAL_DOC = '"""This rank\'s ready counts, before the all_reduce agrees on them."""'
# By position, as the stock code counts: whatever type a queue has.
LOCAL_COUNT = f"""write_queue, load_queue, *storage_queues = self.{QUEUES}()
write_acks = self._count_ready_acks(write_queue)
load_acks = self._count_ready_acks(load_queue)
storage_queue_sizes = tuple(q.qsize() for q in storage_queues)"""
LOCAL_RETURN = f"return {', '.join(LOCAL_NAMES)}"
LOCAL_CALL = f"""{", ".join(LOCAL_NAMES)} = (
    self.{LOCAL}()
)"""
COUNTS = f"""(
    {SYNC_CALL}
    if self.{ATTR} is None
    else self.{ATTR}.agreed_counts()
)"""
COUNTS_COMMENT = f"""# With {ATTR}: the counts agreed by the all_reduce issued {ATTR}.depth
# steps ago instead of a blocking all_reduce of the current ones."""
ISSUE = f"""if self.{ATTR} is not None:
    # Count what is ready after this step's pops; reduce it while the next
    # forward runs.
    self.{ATTR}.issue()"""
ENVIRON_FIELDS = f"""# HiCache: pipeline the ready-count all_reduce of check_hicache_events (pop
# what it agreed on DEPTH steps later); false restores the blocking all_reduce.
# Both must be set identically on every node of a TP group.
{env.ENABLE_VAR} = EnvBool(True)
{env.DEPTH_VAR} = EnvInt(1)"""


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


def _apply(lines: list[str], edits: list[tuple[int, int, list[str]]]) -> str:
    """Replace lines first..last (1-based; last = first - 1: insert before
    first) with the new ones, bottom-up so earlier numbers stay valid."""
    for first, last, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        lines[first - 1 : last] = new
    return "\n".join(lines)


# ------------------------------------------------------- unified_radix_cache.py
def _import_edit(tree: ast.Module, path: str) -> tuple[int, int, list[str]]:
    """Before the first top-level ``from sglang...`` import that isort puts
    after ours (first-party, from-imports sorted by module, case-insensitively)."""
    line = f"from {MODULE} import {CLASS_NAME}"
    siblings = [
        n
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang.")
    ]
    if not siblings:
        raise EditError(f"{path}: no top-level 'from sglang... import' to place the import by")
    after = [n for n in siblings if (n.module or "").lower() > MODULE.lower()]
    at = after[0].lineno if after else (siblings[-1].end_lineno or siblings[-1].lineno) + 1
    return at, at - 1, [line]


def _class_default_edit(cls: ast.ClassDef) -> tuple[int, int, list[str]]:
    """First in the class body, after a docstring if it has one."""
    first = cls.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        at = (first.end_lineno or first.lineno) + 1
        return at, at - 1, ["", *_indent(CLASS_DEFAULT, first.col_offset)[:-1]]
    decorators = getattr(first, "decorator_list", [])
    at = min([first.lineno] + [d.lineno for d in decorators])
    return at, at - 1, _indent(CLASS_DEFAULT, first.col_offset)


def _init_field_edit(fn: ast.FunctionDef, path: str) -> tuple[int, int, list[str]]:
    """After the default of the storage attachment (or of the controller) in
    __init__: the other collaborators init_hicache builds."""
    for anchor in INIT_ANCHORS:
        for node in fn.body:
            if isinstance(node, (ast.AnnAssign, ast.Assign)):
                targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
                if any(ast.unparse(t) == anchor for t in targets):
                    at = (node.end_lineno or node.lineno) + 1
                    return at, at - 1, _indent(INIT_FIELD, node.col_offset)
    raise EditError(f"{path}: {CACHE_CLASS}.__init__() sets none of {', '.join(INIT_ANCHORS)}")


def _init_edit(fn: ast.FunctionDef, path: str) -> tuple[int, int, list[str]]:
    """The last statement of init_hicache (which must not return early), with
    the disaggregation mode from its server args."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Return):
            raise EditError(
                f"{path}: {CACHE_CLASS}.init_hicache() returns at line {node.lineno}; "
                "the patch creates the ack sync at its end"
            )
    params = [a.arg for a in fn.args.args]
    if len(params) < 2 or "server_args" not in params[1]:
        raise EditError(
            f"{path}: {CACHE_CLASS}.init_hicache() does not take the server args "
            f"first (parameters: {', '.join(params)})"
        )
    last = fn.body[-1]
    at = (last.end_lineno or last.lineno) + 1
    create = CREATE.format(attr=ATTR, cls=CLASS_NAME, args=params[1])
    return at, at - 1, _indent(create, fn.body[0].col_offset)


def _assigned(nodes: list[ast.stmt]) -> set[str]:
    """The names these statements assign (comprehension variables aside)."""
    targets = [
        t
        for s in nodes
        for n in ast.walk(s)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
    ]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _split_edits(
    fn: ast.FunctionDef, lines: list[str], path: str
) -> list[tuple[int, int, list[str]]]:
    """_sync_hicache_ready_counts becomes the local counts (its statements up to
    the reduce, counting over the queue list) and the reduce of them (the rest,
    under its own name)."""
    where = f"{path}: {CACHE_CLASS}._sync_hicache_ready_counts()"
    if fn.decorator_list or [a.arg for a in fn.args.args] != ["self"]:
        raise EditError(f"{where} is not a plain method of self alone")
    branches = [
        (i, n)
        for i, n in enumerate(fn.body)
        if isinstance(n, ast.If) and {"write_acks", "load_acks"} <= _assigned(n.orelse)
    ]
    if len(branches) != 1:
        raise EditError(f"{where}: no single if/else that counts write_acks and load_acks")
    i, branch = branches[0]
    orelse = branch.orelse
    if _assigned(orelse) != set(LOCAL_NAMES[:3]):
        raise EditError(f"{where}: its else branch sets {sorted(_assigned(orelse))}")
    counted = [
        ast.unparse(n.func.value).split(".")[-1]
        for s in orelse
        for n in ast.walk(s)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "qsize"
        and isinstance(n.func.value, ast.Attribute)
    ]
    if tuple(counted) != STORAGE_QUEUES:
        raise EditError(f"{where} counts the storage queues {counted}, not {STORAGE_QUEUES}")
    missing = set(LOCAL_NAMES) - _assigned(fn.body[: i + 1])
    if missing or i + 1 >= len(fn.body):
        raise EditError(f"{where}: {sorted(missing)} not set before the reduce")
    body = fn.body[0].col_offset
    header = lines[fn.lineno - 1 : fn.body[0].lineno - 1]
    if not header[0].lstrip().startswith(f"def {fn.name}("):
        raise EditError(f"{where}: the definition does not start on line {fn.lineno}")
    local_header = [header[0].replace(f"def {fn.name}(", f"def {LOCAL}(", 1)]
    end = branch.end_lineno or branch.lineno
    split = [
        *_indent(LOCAL_RETURN, body),
        "",
        *header,
        *_indent(LOCAL_CALL, body),
    ]
    return [
        (fn.lineno, fn.lineno - 1, _indent(QUEUES_METHOD, fn.col_offset)),
        (fn.lineno, fn.lineno, local_header),
        (fn.body[0].lineno, fn.body[0].lineno - 1, _indent(LOCAL_DOC, body)),
        (
            orelse[0].lineno,
            orelse[-1].end_lineno or orelse[-1].lineno,
            _indent(LOCAL_COUNT, orelse[0].col_offset),
        ),
        (end + 1, end, split),
    ]


def _check_edits(
    fn: ast.FunctionDef, lines: list[str], path: str
) -> list[tuple[int, int, list[str]]]:
    """In check_hicache_events: the counts from the ack sync when it is set
    (the assignment from _sync_hicache_ready_counts), and the issue right
    after the pops (after the storage drain that uses those counts)."""
    where = f"{path}: {CACHE_CLASS}.check_hicache_events()"
    body = fn.body
    assigns = [
        (i, n)
        for i, n in enumerate(body)
        if isinstance(n, ast.Assign) and ast.unparse(n.value) == SYNC_CALL
    ]
    if len(assigns) != 1:
        raise EditError(f"{where} has {len(assigns)} statements '... = {SYNC_CALL}', not one")
    i, assign = assigns[0]
    value = assign.value
    if value.lineno != value.end_lineno or value.end_lineno != assign.end_lineno:
        raise EditError(f"{where}: the call on line {value.lineno} does not end the statement")
    row = value.lineno - 1
    head = lines[row][: value.col_offset]
    indent = assign.col_offset
    counts = COUNTS.split("\n")
    replaced = [head + counts[0], *_indent("\n".join(counts[1:-1]), indent), " " * indent + ")"]
    targets = {n.id for t in assign.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    drains = [
        n
        for n in body[i + 1 :]
        if isinstance(n, ast.If)
        and targets & {x.id for x in ast.walk(n.test) if isinstance(x, ast.Name)}
    ]
    if drains:
        pops: ast.stmt = drains[-1]
    else:
        # Only the ack pops: issue after the last statement using the counts.
        users = [
            n
            for n in body[i + 1 :]
            if targets & {x.id for x in ast.walk(n) if isinstance(x, ast.Name)}
        ]
        if not users:
            raise EditError(f"{where}: nothing after line {assign.lineno} uses the counts")
        pops = users[-1]
    after = (pops.end_lineno or pops.lineno) + 1
    return [
        (assign.lineno, assign.lineno - 1, _indent(COUNTS_COMMENT, indent)),
        (row + 1, row + 1, replaced),
        (after, after - 1, _indent(ISSUE, indent)),
    ]


def edit_cache(text: str, path: str = CACHE_PATH) -> str:
    """unified_radix_cache.py with the pipelined ready-count all_reduce."""
    if MODULE in text:
        raise EditError(f"{path} already imports {MODULE}: this tree is already patched")
    tree = ast.parse(text)
    lines = text.split("\n")
    cls = _find_class(tree, CACHE_CLASS, path)
    methods = _methods(cls)
    for name in ("__init__", "init_hicache", "check_hicache_events", "_sync_hicache_ready_counts"):
        if name not in methods:
            raise EditError(f"{path}: {CACHE_CLASS}.{name}() not found")
    for name in (ATTR, LOCAL, QUEUES):
        if re.search(rf"\b{name}\b", text):
            raise EditError(f"{path} already uses the name {name}")
    bound = {
        a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names
    }
    if "Optional" not in bound:
        raise EditError(f"{path} does not import Optional from typing")
    edits = [
        _import_edit(tree, path),
        _class_default_edit(cls),
        _init_field_edit(methods["__init__"], path),
        _init_edit(methods["init_hicache"], path),
        *_split_edits(methods["_sync_hicache_ready_counts"], lines, path),
        *_check_edits(methods["check_hicache_events"], lines, path),
    ]
    return _apply(lines, edits)


# ------------------------------------------------------------------ environ.py
def _sections(cls: ast.ClassDef, lines: list[str]) -> list[tuple[int, str]]:
    """(line, title) of each three-line section header in the class body."""
    out = []
    end = cls.end_lineno or len(lines)
    for i in range(cls.lineno, end - 2):
        if SECTION_RULE.match(lines[i]) and SECTION_RULE.match(lines[i + 2]):
            out.append((i + 1, lines[i + 1].strip().lstrip("#").strip()))
    return out


def _radix_section_end(cls: ast.ClassDef, lines: list[str], path: str) -> ast.stmt:
    """The last field of the radix-cache section."""
    sections = _sections(cls, lines)
    found = [(line, title) for line, title in sections if RADIX_SECTION.search(title)]
    if not found:
        titles = ", ".join(repr(t) for _, t in sections) or "none"
        raise EditError(f"{path}: no radix-cache section in {ENVS_CLASS} (sections: {titles})")
    start = found[0][0]
    later = [line for line, _ in sections if line > start]
    end = later[0] if later else (cls.end_lineno or len(lines)) + 1
    fields = [n for n in cls.body if start < n.lineno < end]
    if not fields:
        raise EditError(f"{path}: the section {found[0][1]!r} has no field")
    return fields[-1]


def edit_environ(text: str, path: str = ENVIRON_PATH) -> str:
    """environ.py with the two settings declared at the end of the radix-cache
    section of Envs."""
    tree = ast.parse(text)
    lines = text.split("\n")
    cls = _find_class(tree, ENVS_CLASS, path)
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [c for c in ("EnvBool", "EnvInt") if c not in defined]
    if missing:
        raise EditError(f"{path}: no class {', '.join(missing)} (SGLang's typed env fields)")
    for var in (env.ENABLE_VAR, env.DEPTH_VAR):
        if re.search(rf"^\s+{var}\s*=", text, re.MULTILINE):
            raise EditError(f"{path}: {ENVS_CLASS} already declares {var}")
    anchor = _radix_section_end(cls, lines, path)
    at = (anchor.end_lineno or anchor.lineno) + 1
    return _apply(lines, [(at, at - 1, _indent(ENVIRON_FIELDS, anchor.col_offset))])
