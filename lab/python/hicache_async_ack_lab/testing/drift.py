"""An SGLang whose method does something else: same name, same signature, another
body (test support for the version guard).

The drifted function is built from the installed method's own source at run time
(nothing of SGLang's is copied into this repository), changed by an AST transform,
and compiled under a pseudo file name registered in :mod:`linecache`, so
``inspect.getsource`` reads it as the guard reads any method.
"""

from __future__ import annotations
import __future__

import ast
import inspect
import linecache
import textwrap
from typing import Any, Callable

Transform = Callable[[ast.FunctionDef], None]


def extra_return_field(node: ast.FunctionDef) -> None:
    """Every ``return (a, b, ...)`` returns one more field: ``(a, b, ..., 0)``.
    What upstream did to ``_sync_hicache_ready_counts`` between releases."""
    returns = [
        n for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)
    ]
    if not returns:
        raise ValueError(f"{node.name} returns no tuple literal: nothing to drift")
    for r in returns:
        assert isinstance(r.value, ast.Tuple)
        r.value.elts.append(ast.Constant(0))


def no_op_first(node: ast.FunctionDef) -> None:
    """One harmless statement first (``_drift = 0``): what it does is unchanged,
    its fingerprint is not (any body change is a change the guard must see)."""
    stmt = ast.Assign(targets=[ast.Name("_drift", ast.Store())], value=ast.Constant(0))
    body = node.body
    at = (
        1
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        else 0
    )
    body.insert(at, ast.fix_missing_locations(stmt))


def renamed_last_param(node: ast.FunctionDef) -> None:
    """The last positional parameter gets another name (a signature change); the
    body follows, so the function still runs."""
    arg = node.args.args[-1]
    old, arg.arg = arg.arg, f"{arg.arg}_renamed"
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id == old:
            n.id = arg.arg


def source_of(fn: Callable) -> str:
    return textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))


def drifted_module_source(text: str, qualname: str, transform: Transform) -> str:
    """A whole module's source with one ``Class.method`` transformed (for a fake wheel)."""
    tree = ast.parse(text)
    scope: Any = tree
    for part in qualname.split("."):
        scope = next(
            n
            for n in scope.body
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part
        )
    transform(scope)
    return ast.unparse(tree)


def drifted(fn: Callable, transform: Transform = extra_return_field) -> Callable:
    """A copy of ``fn`` (hook wrappers unwrapped) with ``transform`` applied to its
    body, in ``fn``'s module namespace. Methods using zero-argument ``super()``
    cannot be copied this way."""
    original = inspect.unwrap(fn)
    node = ast.parse(source_of(original)).body[0]
    assert isinstance(node, ast.FunctionDef)
    transform(node)
    text = ast.unparse(node) + "\n"
    filename = f"<drifted {original.__module__}.{original.__qualname__}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    flags = __future__.annotations.compiler_flag  # annotations stay unevaluated
    code = compile(text, filename, "exec", flags=flags, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, original.__globals__, namespace)
    new = namespace[node.name]
    new.__qualname__ = original.__qualname__
    return new


def drift_method(cls: type, name: str, transform: Transform = extra_return_field) -> Callable:
    """Replace ``cls.name`` by a drifted copy; returns what was there before."""
    before = cls.__dict__[name]
    setattr(cls, name, drifted(before, transform))
    return before


def runs_here() -> set[str]:
    """The features the installed SGLang has every method of, as recorded (0.5.20:
    no decode offload; 0.5.20-0.5.22: no votes): what a test of another release
    expects to be hooked or sent."""
    from hicache_async_ack import guard

    return {f.feature for f in guard.check_installed().features() if f.status == "tested"}
