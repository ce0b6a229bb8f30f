"""The plugin's settings parse as SGLang's own EnvBool / EnvInt parse them
(sglang.srt.environ: a boolean is ``value.lower()`` in its spellings, no
stripping; an integer is ``int(value)``), and with the plugin off nothing else is
read: one rule, stated in env.py and README. Every setting's values and
errors are tested here, and only here."""

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
def registered(monkeypatch, caplog, environment_kept):
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


# ------------------------------------------------ values and their errors
@pytest.mark.parametrize("raw", [None, "1", "true", "TRUE", "Yes", "y"])
def test_enable_true_spellings(raw):
    assert env.parse_bool(env.ENABLE_VAR, raw, True) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "n"])
def test_enable_false_spellings(raw):
    assert env.parse_bool(env.ENABLE_VAR, raw, True) is False


@pytest.mark.parametrize("raw", ["2", "on", "enable", "tru"])
def test_enable_bad_value_names_variable_and_accepted_values(raw):
    with pytest.raises(ValueError) as err:
        env.read_settings({env.ENABLE_VAR: raw})
    msg = str(err.value)
    assert env.ENABLE_VAR in msg and "true, 1, yes, y" in msg and "false, 0, no, n" in msg


@pytest.mark.parametrize("raw, depth", [(None, 1), ("1", 1), ("3", 3), (" 8 ", 8)])
def test_depth_good_values(raw, depth):
    environ = {} if raw is None else {env.DEPTH_VAR: raw}
    assert env.read_settings(environ).depth == depth


@pytest.mark.parametrize("raw", ["0", "-1", "9", "two", "1.5"])
def test_depth_bad_values(raw):
    with pytest.raises(ValueError, match=f"{env.DEPTH_VAR}.*from 1 to 8"):
        env.read_settings({env.DEPTH_VAR: raw})


def test_plugins_whitelist():
    assert env.plugin_whitelisted({})
    assert env.plugin_whitelisted({env.PLUGINS_VAR: "a, hicache_async_ack"})
    assert not env.plugin_whitelisted({env.PLUGINS_VAR: "other"})


def test_the_votes_setting_names_its_accepted_values():
    assert env.prefetch_votes_enabled({}) is True
    assert env.prefetch_votes_enabled({PREFETCH_VOTES_VAR: "No"}) is False
    with pytest.raises(ValueError, match=f"{PREFETCH_VOTES_VAR}='maybe'.*accepted values"):
        env.prefetch_votes_enabled({PREFETCH_VOTES_VAR: "maybe"})
