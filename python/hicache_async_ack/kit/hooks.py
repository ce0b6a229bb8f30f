"""Hooks: marking ours, finding them in a wrapper chain, and registering them
with SGLang's HookRegistry.

Where several features hook the same method AROUND, one hook is registered
that nests theirs in feature order (the first feature's innermost, as
HookRegistry would nest them): the order is the code's, and HookRegistry never
sees two AROUND hooks of ours on one method (it warns on that, as one that
skips ``original`` would bypass the other: ours nest on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

HOOK_MARK = "_hicache_async_ack_hook"  # on our hook functions: the features they serve


def hook(fn: Callable, *features: str) -> Callable:
    """Mark ``fn`` as one of our hooks, serving ``features`` (:func:`hooked_for`)."""
    setattr(fn, HOOK_MARK, frozenset(features) | getattr(fn, HOOK_MARK, frozenset()))
    return fn


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _marks(fn) -> Optional[frozenset]:
    """The union of our marks in ``fn``'s wrapper chain, None if none is ours.
    HookRegistry's wrappers keep the hook in a closure cell and the original in
    __wrapped__."""
    found: Optional[frozenset] = None
    while fn is not None:
        cells = getattr(fn, "__closure__", None) or ()
        for obj in (fn, *(_cell_value(c) for c in cells)):
            marks = getattr(obj, HOOK_MARK, None)
            if isinstance(marks, frozenset):
                found = marks if found is None else found | marks
        fn = getattr(fn, "__wrapped__", None)
    return found


def hooked_for(fn) -> frozenset:
    """The features whose hooks sit in ``fn``'s wrapper chain."""
    return _marks(fn) or frozenset()


def is_hooked(fn) -> bool:
    """Whether any of our hooks sits in ``fn``'s wrapper chain."""
    return _marks(fn) is not None


def unhooked(cls, names: Iterable[str], feature: str) -> Optional[str]:
    """Why ``cls`` does not run ``feature``'s hooks on ``names``, or None."""
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
    """One hook: ``target`` (a class path), the method, the HookType name, the
    function and the feature it serves."""

    target: str
    method: str
    kind: str  # "BEFORE", "AFTER" or "AROUND"
    fn: Callable
    feature: str = ""


def nest_arounds(fns: list[Callable]) -> Callable:
    """One AROUND hook running ``fns`` nested, the first innermost."""

    def around(original, *args, **kwargs):
        call = original
        for fn in fns:
            call = _bound(fn, call)
        return call(*args, **kwargs)

    return around


def _bound(fn: Callable, inner: Callable) -> Callable:
    def call(*args, **kwargs):
        return fn(inner, *args, **kwargs)

    return call


def registrations(hooks: Iterable[Hook]) -> list[tuple[str, str, Callable]]:
    """(dotted target, HookType name, function) to register, in order: each hook
    as declared, except that the AROUND hooks of one method become one, nesting
    them in declaration order at the place of the first."""
    out: list = []
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
    result = []
    for target, kind, fn in out:
        if isinstance(fn, list):
            fns = [h.fn for h in fn]
            fn = fns[0] if len(fns) == 1 else hook(nest_arounds(fns), *(h.feature for h in fn))
        result.append((target, kind, fn))
    return result
