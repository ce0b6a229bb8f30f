"""Fingerprints of what a function does: a hash of its source as a canonical
syntax tree, the same whether the source comes from a live function
(``inspect.getsource``) or from a file in a wheel that is never imported.

Canonical means: node class names and ``_fields`` only, never ``ast.dump`` (whose
format changes between Python versions); positions are not fields; empty and None
fields are left out, so a field that a newer Python adds with an empty default
changes nothing; docstrings, comments, formatting and type annotations do not count.
Constants keep their type, so ``1`` and ``'1'`` differ. No SGLang here: the targets
and the verdict are :mod:`hicache_async_ack.guard`'s.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import textwrap
from typing import Any, Callable, Iterable, Optional

# Bump when canonical() changes: every recorded fingerprint changes with it, and the
# table must be recorded again (guard.load_table refuses one of another scheme).
SCHEME = "canonical-ast-1"

BODY = "body"  # the whole definition: what it does
SIGNATURE = "signature"  # name, parameters and decorators only


_SKIPPED_FIELDS = frozenset(
    {
        "ctx",  # Load / Store / Del: implied by the position
        "type_comment",
        "kind",  # Constant.kind: the u"" prefix
        "annotation",  # annotations do not change what runs
        "returns",
        "simple",  # AnnAssign.simple
        "type_params",  # 3.12+; empty for everything fingerprinted here
    }
)
_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _body_without_docstring(node: ast.AST, body: list) -> list:
    if (
        isinstance(node, _DOCSTRING_OWNERS)
        and body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return body[1:]
    return body


def without_docstring(node: ast.AST) -> ast.AST:
    """A copy of a definition without its docstring (for showing diffs)."""
    node = copy.copy(node)
    body = getattr(node, "body", None)
    if isinstance(body, list):
        node.body = _body_without_docstring(node, body) or [ast.Pass()]  # type: ignore[attr-defined]
    return node


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
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in scope
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        scope = node.body
    return node
