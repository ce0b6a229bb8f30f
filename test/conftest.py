"""Shared fixtures: the plugin's hooks applied to the real SGLang class (once per
test process) and a fake MIN collective for single-process unit tests."""

from __future__ import annotations

import pytest

from hicache_async_ack.env import ENABLE_VAR
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
def judged_kept(monkeypatch):
    """For tests that call register(): it remembers its verdict for the process's
    hooks; put back what was judged before (the plugin fixture's), or a later
    test's cache reads this test's drift."""
    from hicache_async_ack import guard

    for attr in ("verdict", "untested_ok", "known"):
        monkeypatch.setattr(guard.JUDGED, attr, getattr(guard.JUDGED, attr))


@pytest.fixture
def hub(plugin, monkeypatch):
    """Route the plugin's reduce through a one-rank MinHub (a programmable
    peer can join it); FakeGroup sizes stand in for world sizes."""
    from hicache_async_ack.kit import collectives as adapter
    from hicache_async_ack.kit import groups

    hub = MinHub(world=1)
    monkeypatch.setattr(
        adapter.INSTALLED, "current", adapter.Collectives(async_min=lambda g: hub.collective(0))
    )
    monkeypatch.setattr(groups, "world_size", lambda g: g.size if isinstance(g, FakeGroup) else 1)
    return hub


@pytest.fixture
def make_cache(plugin, hub, monkeypatch):
    """Build a real UnifiedRadixCache on a SimController and run the plugin's
    init_hicache hook on it (what SGLang does at server start)."""
    from hicache_async_ack.features import ack_sync
    from hicache_async_ack_lab.sim.cache import build_cache

    def make(tp: int = 2, env: dict | None = None, **kwargs):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        if "tp_group" not in kwargs:
            kwargs["tp_group"] = FakeGroup(tp)
            kwargs["tp_world_size"] = tp
        sim = build_cache(**kwargs)
        # upstream's blocking _all_reduce as a world of one (the first pipelined
        # step's exchange runs through it); tests that watch it replace it
        sim.cache.__dict__["_all_reduce"] = lambda tensor, op: None
        ack_sync.after_init_hicache(None, sim.cache)
        return sim

    return make
