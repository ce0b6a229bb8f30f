"""A toy SGLang object for the fourth-sync test (test/unit/test_adding_a_sync.py): a
manager whose ``step`` runs a blocking MIN all_reduce of its queue's length and pops
that many, as upstream's per-step syncs do. Hooks land on it by its dotted path."""

from __future__ import annotations

from typing import Any, Callable, Optional


class ToyController:
    def __init__(self) -> None:
        self.ack_write_queue: list[Any] = []


class ToyManager:
    """Upstream's shape: ``step()`` reduces ``len(queue)`` over the group, then pops."""

    def __init__(self, tp_group: Any, tp_world_size: int,
                 reduce: Optional[Callable[[int], int]] = None) -> None:  # fmt: skip
        self.cache_controller = ToyController()
        self.tp_group = tp_group
        self.tp_world_size = tp_world_size
        self.reduce = reduce or (lambda n: n)  # a world of one: its own count
        self.popped: list[Any] = []

    def step(self) -> None:
        self._pop(self.reduce(len(self.cache_controller.ack_write_queue)))

    def _pop(self, n: int) -> None:
        q = self.cache_controller.ack_write_queue
        self.popped += q[:n]
        del q[:n]
