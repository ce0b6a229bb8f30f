"""Hooks: marking ours, finding them in a wrapper chain, registering them with SGLang's
HookRegistry. Several features' AROUND hooks on one method are registered as one that
nests them in feature order (HookRegistry warns on two AROUND hooks; ours nest on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import CellType
from typing import Any, Callable, Iterable, Literal, Optional, Union, cast

HOOK_MARK = "_hicache_async_ack_hook"  # on our hook functions: the features they serve
HookKind = Literal["BEFORE", "AFTER", "AROUND"]
Fn = Callable[..., Any]  # upstream's method a hook wraps (SGLang is not typed here)


def hook(fn: Fn, *features: str) -> Fn:
    """Mark ``fn`` as one of our hooks, serving ``features`` (:func:`hooked_for`)."""
    setattr(fn, HOOK_MARK, frozenset(features) | getattr(fn, HOOK_MARK, frozenset()))
    return fn


def _cell_value(cell: object) -> object:
    try:
        contents: object = cast(CellType, cell).cell_contents
    except ValueError:  # empty cell
        return None
    return contents


def _marks(fn: object) -> Optional[frozenset[str]]:
    """The union of our marks in ``fn``'s wrapper chain (closure cells, ``__wrapped__``),
    None if none is ours."""
    found: Optional[frozenset[str]] = None
    while fn is not None:
        cells: tuple[object, ...] = getattr(fn, "__closure__", None) or ()
        for obj in (fn, *(_cell_value(c) for c in cells)):
            marks: object = getattr(obj, HOOK_MARK, None)
            if isinstance(marks, frozenset):
                found = marks if found is None else found | marks
        fn = getattr(fn, "__wrapped__", None)
    return found


def hooked_for(fn: object) -> frozenset[str]:
    """The features whose hooks sit in ``fn``'s wrapper chain."""
    return _marks(fn) or frozenset()


def is_hooked(fn: object) -> bool:
    """Whether any of our hooks sits in ``fn``'s wrapper chain."""
    return _marks(fn) is not None


def unhooked(cls: type, names: Iterable[str], feature: str) -> Optional[str]:
    """Why ``cls`` does not run ``feature``'s hooks on ``names``, or None."""
    names = tuple(names)
    if not names:
        return f"no hook of {feature} on {cls.__name__} was declared (its hooks not loaded)"
    for name in names:
        fn = getattr(cls, name, None)
        if fn is None or feature not in hooked_for(fn):
            return (
                f"{cls.__name__}.{name} is not our hook (overridden by a subclass, or "
                "the hook failed to apply)"
            )
    return None


@dataclass(frozen=True)
class Hook:
    """One hook: class path, method, HookType name, function, the feature it serves."""

    target: str
    method: str
    kind: HookKind
    fn: Fn
    feature: str = ""


def nest_arounds(fns: list[Fn]) -> Fn:
    """One AROUND hook running ``fns`` nested, the first innermost."""

    def around(original: Fn, *args: Any, **kwargs: Any) -> Any:
        call = original
        for fn in fns:
            call = _bound(fn, call)
        return call(*args, **kwargs)

    return around


def _bound(fn: Fn, inner: Fn) -> Fn:
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(inner, *args, **kwargs)

    return call


def registrations(hooks: Iterable[Hook]) -> list[tuple[str, HookKind, Fn]]:
    """(dotted target, HookType name, function) to register, in order; the AROUND hooks
    of one method become one, nested in declaration order, at the first's place."""
    out: list[tuple[str, HookKind, Union[Fn, list[Hook]]]] = []
    arounds: dict[str, list[Hook]] = {}
    for h in hooks:
        target = f"{h.target}.{h.method}"
        if h.kind != "AROUND":
            out.append((target, h.kind, h.fn))
            continue
        if target not in arounds:
            arounds[target] = []
            out.append((target, "AROUND", arounds[target]))  # filled below
        arounds[target].append(h)
    result: list[tuple[str, HookKind, Fn]] = []
    for target, kind, fn in out:
        if isinstance(fn, list):
            fns = [h.fn for h in fn]
            fn = fns[0] if len(fns) == 1 else hook(nest_arounds(fns), *(h.feature for h in fn))
        result.append((target, kind, fn))
    return result
