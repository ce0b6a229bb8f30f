"""A fourth sync, added as docs/design.md's "Adding a sync" says: a names row, a state
class on the owner template (its three abstract methods), one Feature with its hook,
handed to register() through the environment; nothing else of the runtime changes.
The toy pipelines its object's per-step blocking reduce: popped one step late, by
identity, on the protocol's own reduce, its errors its own."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Hashable, Mapping, Optional, Sequence

import pytest

from hicache_async_ack.env import Switch
from hicache_async_ack.errors import ErrorPair, HiCacheAsyncAckError, HiCacheAsyncAckMismatch
from hicache_async_ack.guard import Judged, check_installed
from hicache_async_ack.names import Sync
from hicache_async_ack.sglang_plugin import (
    Collectives,
    Decision,
    Environment,
    Feature,
    OwnerState,
    environment,
    register,
    state_of,
    use_environment,
)
from hicache_async_ack_lab.sim.collectives import MinHub

from support.toy import ToyManager

TARGET = "support.toy.ToyManager"


class ToyError(HiCacheAsyncAckError):
    """The toy sync cannot go on here."""


class ToyMismatch(ToyError, HiCacheAsyncAckMismatch):
    """The toy's group disagrees."""


# 1. the row: name, title, where its state lives, the setting that turns it off, errors
TOY = Sync("toy_sync", "Toy sync", "_toy_sync_state",
           Switch("TOY_SYNC_SETTING", True, "pipelined", "upstream's path"),
           ErrorPair(ToyError, ToyMismatch))  # fmt: skip


# 2. the state: the owner template's three abstract methods
class ToyState(OwnerState[ToyManager]):
    sync = TOY

    def __init__(self, manager: ToyManager, blocker: Optional[Decision], env: Environment):
        group = Decision(True, "toy group", group=manager.tp_group,
                         world_size=manager.tp_world_size)  # fmt: skip
        super().__init__(blocker or group, env)
        self.core = self.core_class(env.collectives.async_min(manager.tp_group), 1)

    def first_exchange(self, manager: ToyManager) -> bool:
        self.agreed = True
        return True

    def ready(self, manager: ToyManager) -> tuple[Mapping[Hashable, Sequence[object]], int]:
        return {"ack_write_queue": list(manager.cache_controller.ack_write_queue)}, 0

    def pop(self, manager: ToyManager, pops: Mapping[Hashable, int]) -> None:
        manager._pop(pops.get("ack_write_queue", 0))


# 3. the feature and its one hook
FEATURE = Feature(TOY, ToyState, TARGET)


@FEATURE.hook(TARGET, "step", "AROUND")
def around_step(original: Any, manager: ToyManager, *a: Any, **k: Any) -> Any:
    return FEATURE.ensure(manager).step(manager, original, *a, **k)


@pytest.fixture
def toy(environment_kept):
    """register() with the toy as the environment's features, as load_plugins() runs it."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hub = MinHub(world=1)
    env = Environment(
        collectives=Collectives(async_min=lambda g: hub.collective(0), world_size=lambda g: 2),
        judged=Judged(check_installed()),
        features=(FEATURE,),
    )
    register(env)
    HookRegistry.apply_hooks()
    yield hub
    use_environment(environment_kept)


def test_a_fourth_sync_is_a_row_a_subclass_and_a_feature(toy):
    manager = ToyManager(tp_group="toy", tp_world_size=2)
    q = manager.cache_controller.ack_write_queue
    first = [object(), object()]
    q += first
    manager.step()  # issues the reduce of 2: nothing popped yet (upstream popped both)
    assert manager.popped == [] and len(toy.issued) == 1
    q.append(later := object())
    manager.step()  # pops the agreed 2, then reduces what is left
    assert manager.popped == first
    manager.step()
    assert manager.popped == [*first, later]
    state = state_of(FEATURE, manager)
    assert isinstance(state, ToyState) and state.decide(manager).pipelined
    assert environment().features == (FEATURE,)


def test_the_toys_protocol_errors_are_its_own_titled(toy):
    manager = ToyManager(tp_group="toy", tp_world_size=2)
    q = manager.cache_controller.ack_write_queue
    q += [object(), object(), object()]
    manager.step()
    q[1], q[2] = q[2], q[1]  # a FIFO violation between issue and consume
    with pytest.raises(ToyError, match="^Toy sync: a queue was reordered") as err:
        manager.step()
    assert err.value.seen["agreed"] == 3


def test_a_state_missing_an_abstract_method_cannot_be_built(toy):
    """The template's methods are abstract: an owner that forgets one fails at once."""

    class Incomplete(OwnerState[ToyManager]):
        sync = replace(TOY, name="incomplete")

        def ready(self, manager: ToyManager) -> tuple[Mapping[Hashable, Sequence[object]], int]:
            return {}, 0

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(Decision(False, "x"), environment())  # type: ignore[abstract]
