"""Shared fixtures: the plugin's hooks applied to the real SGLang class (once per
test process) and a fake MIN collective for single-process unit tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))


class FakeGroup:
    """A process group stand-in with a fixed world size."""

    def __init__(self, size: int, name: str = "tp"):
        self.size = size
        self.name = name

    def __repr__(self):
        return f"FakeGroup({self.name}, {self.size})"


class FakeHandle:
    def __init__(self, coll, values):
        self.coll = coll
        self.values = list(values)
        self.waited = False

    def wait(self):
        self.waited = True
        self.coll.events.append(("wait", len(self.coll.issued) - 1))
        if self.coll.fail_on_wait is not None:
            raise self.coll.fail_on_wait
        peer = self.coll.peer(self.values)
        return [min(a, b) for a, b in zip(self.values, peer)]


class FakeCollective:
    """MIN-reduce with one simulated peer; ``peer(values)`` gives its values."""

    def __init__(self):
        self.issued: list[list[int]] = []
        self.handles: list[FakeHandle] = []
        self.events: list = []
        self.peer = lambda values: values
        self.fail_on_wait: BaseException | None = None

    def __call__(self, values):
        self.issued.append(list(values))
        self.events.append(("issue", list(values)))
        h = FakeHandle(self, values)
        self.handles.append(h)
        return h


@pytest.fixture(scope="session")
def plugin():
    """register() + apply_hooks(), as load_plugins() does, once per process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from hicache_async_ack import sglang_plugin

    saved = os.environ.pop("SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC", None)
    sglang_plugin.register()
    HookRegistry.apply_hooks()
    if saved is not None:
        os.environ["SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC"] = saved
    return sglang_plugin


@pytest.fixture
def fake_collective(plugin, monkeypatch):
    """Route the plugin's reduce through a FakeCollective; FakeGroup sizes."""
    coll = FakeCollective()
    monkeypatch.setattr(plugin, "collective_factory", lambda group: coll)
    monkeypatch.setattr(plugin, "_world_size", lambda g: g.size if isinstance(g, FakeGroup) else 1)
    return coll


@pytest.fixture
def make_cache(plugin, fake_collective, monkeypatch):
    """Build a real UnifiedRadixCache on a SimController and run the plugin's
    init_hicache hook on it (what SGLang does at server start)."""
    from hicache_async_ack.simulated import build_cache

    def make(tp: int = 2, env: dict | None = None, **kwargs):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        if "tp_group" not in kwargs:
            kwargs["tp_group"] = FakeGroup(tp)
            kwargs["tp_world_size"] = tp
        sim = build_cache(**kwargs)
        plugin.after_init_hicache(None, sim.cache)
        return sim

    return make
