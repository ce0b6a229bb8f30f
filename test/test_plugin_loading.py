"""SGLang's real load_plugins() in a fresh process picks the entry point up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hicache_async_ack.env import ENABLE_VAR, PLUGINS_VAR

PROBE = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as C
    from hicache_async_ack.sglang_plugin import is_hooked
    names = ("init_hicache", "check_hicache_events", "_sync_hicache_ready_counts")
    print("HOOKED", [is_hooked(getattr(C, n)) for n in names])
    """
)


def _start(**env_overrides) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env.update(env_overrides)
    return subprocess.Popen(
        [sys.executable, "-c", PROBE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def outputs():
    """One fresh process per environment, run concurrently (imports are slow)."""
    procs = {
        "default": _start(),
        "whitelisted": _start(**{PLUGINS_VAR: "hicache_async_ack"}),
        "other": _start(**{PLUGINS_VAR: "some_other_plugin"}),
        "disabled": _start(**{ENABLE_VAR: "0"}),
        "bad_env": _start(**{ENABLE_VAR: "maybe"}),
    }
    out = {}
    try:
        for name, p in procs.items():
            text, _ = p.communicate(timeout=300)
            assert p.returncode == 0, f"{name}: {text[-3000:]}"
            out[name] = text
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out


def test_loader_applies_hooks(outputs):
    assert "HOOKED [True, True, True]" in outputs["default"]
    assert "HOOKED [True, True, True]" in outputs["whitelisted"]


def test_whitelist_without_us_leaves_stock_behaviour(outputs):
    assert "HOOKED [False, False, False]" in outputs["other"]


def test_opt_out_registers_nothing_and_says_why(outputs):
    assert "HOOKED [False, False, False]" in outputs["disabled"]
    assert f"blocking (upstream path) because {ENABLE_VAR}=0" in outputs["disabled"]


def test_bad_env_fails_server_start_not_swallowed(outputs):
    # Only the init_hicache guard is registered; it raises at HiCache init.
    assert "HOOKED [True, False, False]" in outputs["bad_env"]
    assert f"{ENABLE_VAR}='maybe' is not a boolean" in outputs["bad_env"]


def test_bad_env_raises_at_cache_init(plugin, monkeypatch):
    """The guard hook itself: init_hicache raises a ValueError naming the values."""
    from hicache_async_ack import sglang_plugin

    err = ValueError(f"{ENABLE_VAR}='maybe' is not a boolean")
    guard = sglang_plugin._raise_config_error(err)
    with pytest.raises(ValueError, match="not a boolean"):
        guard(object(), None, None)


def test_version_drift_registers_nothing(monkeypatch, caplog):
    """A renamed method or changed signature: inert, warning naming it."""
    import logging

    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.plugins.hook_registry import HookRegistry

    from hicache_async_ack import sglang_plugin

    class Drifted(UnifiedRadixCache):
        def loading_check(self, count=None):  # finish_count renamed
            pass

    Drifted._sync_hicache_ready_counts = None  # removed upstream
    assert any("loading_check" in p for p in sglang_plugin.upstream_shape_problems(Drifted))
    assert any(
        "_sync_hicache_ready_counts" in p for p in sglang_plugin.upstream_shape_problems(Drifted)
    )
    assert sglang_plugin.upstream_shape_problems(UnifiedRadixCache) == []

    registered = []
    monkeypatch.setattr(HookRegistry, "register", lambda *a, **k: registered.append(a))
    monkeypatch.setattr(
        sglang_plugin, "upstream_shape_problems", lambda cls=None: ["loading_check drift"]
    )
    monkeypatch.delenv(ENABLE_VAR, raising=False)
    caplog.set_level(logging.WARNING, logger="sglang.srt.mem_cache.hicache_async_ack")
    sglang_plugin.register()
    assert registered == []
    assert "registering no hooks, stock behaviour kept: loading_check drift" in caplog.text
