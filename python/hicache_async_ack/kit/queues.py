"""Views of a controller's queues: the first entries of a list or a
``queue.Queue``, by the names upstream's tensor order uses."""

from __future__ import annotations

import itertools
from typing import Callable, Hashable

from ..names import EXTRA_POOL_QUEUES


def queue_by_name(cc, name: Hashable):
    """A controller queue by name; ``("extra", pool)`` is an extra host pool's."""
    if isinstance(name, tuple):  # ("extra", pool_name)
        return getattr(cc, EXTRA_POOL_QUEUES, {}).get(name[1])
    return getattr(cc, str(name), None)


def queue_head(q, n: int) -> list:
    """The first ``n`` entries of a list or a ``queue.Queue`` (under its mutex)."""
    if q is None:
        return []
    if isinstance(q, list):
        return q[:n]
    with q.mutex:  # queue.Queue filled by storage threads
        return list(itertools.islice(q.queue, n))


def head_reader(owner) -> Callable[[Hashable, int], list]:
    """``head(name, n)``: the first n entries of a queue of ``owner``'s
    controller (whichever controller it holds when called)."""

    def head(name: Hashable, n: int) -> list:
        cc = owner.cache_controller
        return [] if cc is None else queue_head(queue_by_name(cc, name), n)

    return head
