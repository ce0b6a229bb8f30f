"""Shared fixtures: the plugin's hooks applied to the real SGLang class (once per
test process) and a fake MIN collective for single-process unit tests, handed to
the plugin in an :class:`Environment` (never patched into it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack.sglang_plugin import (
    Collectives,
    Environment,
    environment,
    init_cache,
    use_environment,
)
from hicache_async_ack_lab.sim.collectives import FakeGroup, MinHub


@pytest.fixture(scope="session")
def plugin():
    """register() + apply_hooks(), as load_plugins() does, once per process."""
    import os

    from sglang.srt.plugins.hook_registry import HookRegistry

    from hicache_async_ack import sglang_plugin

    saved = os.environ.pop(ENABLE_VAR, None)
    sglang_plugin.register()
    HookRegistry.apply_hooks()
    if saved is not None:
        os.environ[ENABLE_VAR] = saved
    return sglang_plugin


@pytest.fixture
def environment_kept() -> Iterator[Environment]:
    """For tests that call register() or install an environment: the one in
    force before (the plugin fixture's verdict) is put back after, or a later
    test's cache reads this test's."""
    before = environment()
    yield before
    use_environment(before)


def fake_sizes(group: object) -> int:
    return group.size if isinstance(group, FakeGroup) else 1


@pytest.fixture
def hub(plugin, environment_kept):
    """The plugin's reduce through a one-rank MinHub (a programmable peer can
    join it); FakeGroup sizes stand in for world sizes."""
    hub = MinHub(world=1)
    collectives = Collectives(async_min=lambda g: hub.collective(0), world_size=fake_sizes)
    use_environment(Environment(collectives=collectives, judged=environment_kept.judged))
    return hub


@pytest.fixture
def install(environment_kept):
    """Install the environment in force with ``changes`` (a field each: a
    negative control's substitutes, collectives with another span check) for
    the states built from now on."""

    def install(**changes: object) -> Environment:
        env = replace(environment(), **changes)
        use_environment(env)
        return env

    return install


@pytest.fixture
def make_cache(plugin, hub, monkeypatch):
    """Build a real UnifiedRadixCache on a SimController and run what the
    plugin's init_hicache hooks run (what SGLang does at server start)."""
    from hicache_async_ack_lab.sim.cache import build_cache

    def make(tp: int = 2, env: dict | None = None, params: object = None, **kwargs):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        if "tp_group" not in kwargs:
            kwargs["tp_group"] = FakeGroup(tp)
            kwargs["tp_world_size"] = tp
        sim = build_cache(**kwargs)
        # upstream's blocking _all_reduce as a world of one (the first pipelined
        # step's exchange runs through it); tests that watch it replace it
        sim.cache.__dict__["_all_reduce"] = lambda tensor, op: None
        init_cache(sim.cache, params)
        return sim

    return make
