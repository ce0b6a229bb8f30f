"""SGLang's real load_plugins() in a fresh process picks the entry point up, and
the version guard decides what it registers (on every tested SGLang: this file is
part of the per-release subset)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hicache_async_ack.env import ALLOW_UNTESTED_VAR, ENABLE_VAR, PLUGINS_VAR
from hicache_async_ack.guard import installed_version
from hicache_async_ack_lab.testing.drift import runs_here

SYNC = "_sync_hicache_ready_counts"

DRIFT = "HICACHE_ASYNC_ACK_TEST_DRIFT"  # probe only: drift this method before loading
PROBE = textwrap.dedent(
    f"""
    import logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as C
    if os.environ.get("{DRIFT}"):  # an SGLang whose method does something else
        from hicache_async_ack_lab.testing import drift
        name, _, how = os.environ["{DRIFT}"].partition(":")
        drift.drift_method(C, name, getattr(drift, how or "extra_return_field"))
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from hicache_async_ack.sglang_plugin import hooked_for, is_hooked
    names = ("init_hicache", "check_hicache_events", "_sync_hicache_ready_counts")
    print("HOOKED", [is_hooked(getattr(C, n)) for n in names])
    print("FEATURES", sorted(set().union(*(hooked_for(getattr(C, n)) for n in names))))
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


ENVS = {
    "default": {},
    "whitelisted": {PLUGINS_VAR: "hicache_async_ack"},
    "other": {PLUGINS_VAR: "some_other_plugin"},
    "disabled": {ENABLE_VAR: "0"},
    "bad_env": {ENABLE_VAR: "maybe"},
    "drifted": {DRIFT: SYNC},
    "drifted_allowed": {DRIFT: SYNC, ALLOW_UNTESTED_VAR: "1"},
    # one harmless statement in a method only one feature relies on
    "ack_only_drift": {DRIFT: "writing_check:no_op_first"},
    "votes_only_drift": {DRIFT: "_can_terminate_prefetch:no_op_first"},
}
AT_ONCE = 3  # fresh processes importing SGLang at a time (each 10-15 s of CPU)
TIMEOUT_S = 900  # per process, on a busy 2-core box


@pytest.fixture(scope="module")
def outputs():
    """One fresh process per environment, a few at a time (imports are slow)."""
    out: dict = {}
    names = list(ENVS)
    for i in range(0, len(names), AT_ONCE):
        procs = {name: _start(**ENVS[name]) for name in names[i : i + AT_ONCE]}
        try:
            for name, p in procs.items():
                text, _ = p.communicate(timeout=TIMEOUT_S)
                assert p.returncode == 0, f"{name}: {text[-3000:]}"
                out[name] = text
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return out


def test_loader_applies_hooks(outputs):
    assert "HOOKED [True, True, True]" in outputs["default"]
    assert "HOOKED [True, True, True]" in outputs["whitelisted"]
    release = installed_version()
    assert f"SGLang {release} matches tested release {release}" in outputs["default"]


def test_changed_method_body_leaves_loader_stock_naming_it(outputs):
    """Same version, same signatures, _sync_hicache_ready_counts returns one more
    field: the real loader applies no hook and the warning names the method."""
    out = outputs["drifted"]
    assert "HOOKED [False, False, False]" in out
    assert f"is untested: UnifiedRadixCache.{SYNC} differs from" in out
    assert f"set {ALLOW_UNTESTED_VAR}=1" in out


def test_changed_method_body_with_opt_in_applies_hooks_loudly(outputs):
    out = outputs["drifted_allowed"]
    assert "HOOKED [True, True, True]" in out
    assert "RUNNING ON AN UNTESTED SGLANG" in out and f"UnifiedRadixCache.{SYNC}" in out


def test_whitelist_without_us_leaves_stock_behaviour(outputs):
    assert "HOOKED [False, False, False]" in outputs["other"]


def test_opt_out_registers_nothing_and_says_why(outputs):
    assert "HOOKED [False, False, False]" in outputs["disabled"]
    assert f"blocking (upstream path) because {ENABLE_VAR}=0" in outputs["disabled"]


def test_bad_env_fails_server_start_not_swallowed(outputs):
    # Only the init_hicache guard is registered; it raises at HiCache init.
    assert "HOOKED [True, False, False]" in outputs["bad_env"]
    assert f"{ENABLE_VAR}='maybe' is not a boolean" in outputs["bad_env"]


def test_bad_env_raises_at_cache_init(plugin, monkeypatch, environment_kept):
    """The guard hook itself: register() with a bad value registers one BEFORE
    init_hicache hook, which raises a ValueError naming the values."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from hicache_async_ack import sglang_plugin

    calls: list = []
    monkeypatch.setattr(HookRegistry, "register", lambda *a, **k: calls.append(a))
    monkeypatch.setenv(ENABLE_VAR, "maybe")
    sglang_plugin.register()
    ((target, guard, kind),) = calls
    assert target.endswith(".init_hicache") and kind.name == "BEFORE"
    with pytest.raises(ValueError, match="not a boolean"):
        guard(object(), None, None)


def test_a_method_only_the_ack_sync_relies_on_stops_only_the_ack_sync(outputs):
    """writing_check gained a harmless statement: the ack sync stands down, named;
    the votes (where this SGLang has them) keep their hooks."""
    out = outputs["ack_only_drift"]
    assert "HiCache ack sync (hicache-async-ack" in out and "UnifiedRadixCache.writing_check" in out
    features = next(line for line in out.splitlines() if line.startswith("FEATURES"))
    assert "ack_counts" not in features
    assert ("prefetch_votes" in features) == ("prefetch_votes" in runs_here())


def test_a_method_only_the_votes_rely_on_stops_only_the_votes(outputs):
    out = outputs["votes_only_drift"]
    features = next(line for line in out.splitlines() if line.startswith("FEATURES"))
    assert "ack_counts" in features and "prefetch_votes" not in features
    release = installed_version()
    assert "HiCache ack sync (hicache-async-ack" in out
    assert f"SGLang {release} matches tested release {release}; pipelining allowed" in out
