"""Fingerprints of what a function does: a hash of its source as a canonical syntax tree,
the same from a live function or from a wheel's file never imported. Canonical: node
class names and ``_fields`` only (never ``ast.dump``), no positions, empty/None fields
left out; docstrings, comments, formatting and annotations do not count; constants keep
their type. No SGLang here: the targets and the verdict are :mod:`.guard`'s.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from typing import Any, Callable, Iterable, Optional

# Bump when canonical() changes: the table must be recorded again (load_table checks).
SCHEME = "canonical-ast-1"

BODY = "body"  # the whole definition: what it does
SIGNATURE = "signature"  # name, parameters and decorators only


# ctx: implied by position; kind: the u"" prefix; annotations do not change what runs
_SKIPPED_FIELDS = frozenset(
    {"ctx", "type_comment", "kind", "annotation", "returns", "simple", "type_params"}
)
_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _body_without_docstring(node: ast.AST, body: list) -> list:
    first = body[0] if body and isinstance(node, _DOCSTRING_OWNERS) else None
    doc = first.value if isinstance(first, ast.Expr) else None
    return body[1:] if isinstance(doc, ast.Constant) and isinstance(doc.value, str) else body


def canonical(node: Any) -> str:
    """A text form of an AST that depends only on what the code does (module doc)."""
    if isinstance(node, ast.AST):
        parts = [type(node).__name__]
        for name, value in ast.iter_fields(node):
            if name in _SKIPPED_FIELDS:
                continue
            if name == "body" and isinstance(value, list):
                value = _body_without_docstring(node, value)
            if value is None or (isinstance(value, list) and not value):
                continue
            parts.append(f"{name}={canonical(value)}")
        return "(" + " ".join(parts) + ")"
    if isinstance(node, list):
        return "[" + ",".join(canonical(x) for x in node) + "]"
    return f"{type(node).__name__}:{node!r}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_def(node: ast.AST, scope: str = BODY) -> str:
    """The fingerprint of one function definition node."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError(f"not a function definition: {type(node).__name__}")
    if scope == SIGNATURE:
        return _digest(canonical(node.name) + canonical(node.args) + canonical(node.decorator_list))
    return _digest(canonical(node))


def param_names(node: ast.AST) -> tuple[str, ...]:
    """Parameter names in signature order, as ``inspect.signature`` lists them."""
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return tuple(names)


def parse_function_source(source: str) -> ast.AST:
    """The definition in one function's source (as ``inspect.getsource`` gives it)."""
    node = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError(f"source holds a {type(node).__name__}, not a function")
    return node


def fingerprint_function(fn: Callable, scope: str = BODY) -> str:
    """The fingerprint of a live function (hook wrappers unwrapped)."""
    return fingerprint_def(parse_function_source(inspect.getsource(inspect.unwrap(fn))), scope)


def module_source_path(module: str) -> tuple[str, str]:
    """The two places a module's source can live in a wheel, relative to its root."""
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


def find_def(tree: ast.Module, qualname: str) -> Optional[ast.AST]:
    """The definition of ``Class.method`` (or ``function``) at the top of a module."""
    scope: Iterable[ast.stmt] = tree.body
    node: Optional[ast.AST] = None
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, defs) and n.name == part), None)
        if node is None:
            return None
        scope = node.body
    return node
