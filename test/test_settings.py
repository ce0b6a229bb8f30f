"""The plugin's settings parse as SGLang's own EnvBool / EnvInt parse them
(sglang.srt.environ: a boolean is ``value.lower()`` in its spellings, no
stripping; an integer is ``int(value)``), and with the plugin off nothing else is
read: one rule, stated in env.py and README."""

from __future__ import annotations

import logging

import pytest

from hicache_async_ack import env, sglang_plugin
from hicache_async_ack.env import (
    ALLOW_UNTESTED_VAR,
    DEPTH_VAR,
    ENABLE_VAR,
    OFFLOAD_SYNC_VAR,
    PREFETCH_VOTES_VAR,
)

SPELLINGS = ["1", "0", "true", "False", "YES", "n", "", " 0", "0 ", " true", "on", "2"]


def sglang_bool(raw: str):
    """SGLang's EnvBool on ``raw``: its value, or ValueError (it warns and uses
    the default; the plugin refuses to start instead)."""
    from sglang.srt.environ import EnvBool

    return EnvBool(False).parse(raw)


def sglang_int(raw: str):
    from sglang.srt.environ import EnvInt

    return EnvInt(1).parse(raw)


def outcome(fn, *args):
    try:
        return fn(*args)
    except ValueError:
        return "invalid"


@pytest.mark.parametrize("raw", SPELLINGS)
def test_booleans_parse_as_sglang_envbool(raw):
    ours = outcome(env.parse_bool, ENABLE_VAR, raw, True)
    assert ours == outcome(sglang_bool, raw), raw


@pytest.mark.parametrize("raw", ["1", "8", " 2", "3 ", "", " ", "0", "9", "1.0", "x", "+2"])
def test_depths_parse_as_sglang_envint(raw):
    ours = outcome(env.parse_depth, DEPTH_VAR, raw, 1)
    theirs = outcome(sglang_int, raw)
    if theirs != "invalid" and not 1 <= theirs <= env.DEPTH_MAX:
        theirs = "invalid"  # in range only: the plugin's own bound
    assert ours == theirs, raw


def test_auto_is_the_one_word_a_depth_takes():
    assert env.parse_depth(DEPTH_VAR, "auto", 1) == env.DEPTH_AUTO
    assert env.parse_depth(DEPTH_VAR, "AUTO", 1) == env.DEPTH_AUTO
    with pytest.raises(ValueError):
        env.parse_depth(DEPTH_VAR, " auto", 1)


def test_unset_is_the_default():
    assert env.read_settings({}) == env.Settings(True, 1, False)
    assert env.prefetch_votes_enabled({}) and env.offload_sync_enabled({})
    assert not env.allow_untested({})


@pytest.fixture
def registered(monkeypatch, caplog, judged_kept):
    from sglang.srt.plugins.hook_registry import HookRegistry

    calls: list = []
    monkeypatch.setattr(HookRegistry, "register", lambda *a, **k: calls.append(a))
    for var in (ENABLE_VAR, DEPTH_VAR, ALLOW_UNTESTED_VAR, PREFETCH_VOTES_VAR, OFFLOAD_SYNC_VAR):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO, logger="sglang.srt.mem_cache.hicache_async_ack")

    def run(**values) -> list:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        calls.clear()
        sglang_plugin.register()
        return list(calls)

    return run


@pytest.mark.parametrize(
    "var", [DEPTH_VAR, ALLOW_UNTESTED_VAR, PREFETCH_VOTES_VAR, OFFLOAD_SYNC_VAR]
)
def test_with_the_plugin_off_no_other_setting_is_read(registered, var):
    """ENABLE=0 registers no hook at all, a bad value elsewhere included."""
    assert registered(**{ENABLE_VAR: "0", var: "maybe"}) == []


@pytest.mark.parametrize(
    "var", [DEPTH_VAR, ALLOW_UNTESTED_VAR, PREFETCH_VOTES_VAR, OFFLOAD_SYNC_VAR]
)
def test_with_the_plugin_on_a_bad_setting_stops_the_server(registered, var):
    """Negative control of the above: the same bad value with the plugin on
    registers the one raising hook (load_plugins() would swallow a raise)."""
    calls = registered(**{var: "maybe"})
    assert len(calls) == 1 and calls[0][0].endswith(".init_hicache")


def test_a_bad_enable_value_stops_the_server(registered):
    calls = registered(**{ENABLE_VAR: " 0"})
    assert len(calls) == 1 and calls[0][0].endswith(".init_hicache")
