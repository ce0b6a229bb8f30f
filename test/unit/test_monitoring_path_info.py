"""The path-info series (path_info.py) in SGLang's multiprocess layout: one series
per rank and sync at 1, the replaced combination at 0 after a change of path,
bounded reason codes, created through the cache's collector classes, never
raising. Each case runs in fresh interpreters: prometheus_client's registry and
the multiprocess files are per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PUBLISH = """
from hicache_async_ack import metrics as path_info
labels = dict(cache_type="UnifiedRadixCache", tp_rank={rank}, pp_rank=0, dp_rank=0)
{body}
"""

READ = """
import json
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
reg = CollectorRegistry()
MultiProcessCollector(reg, path={path!r})
out = []
for fam in text_string_to_metric_families(generate_latest(reg).decode()):
    out += [[s.name, s.labels, s.value] for s in fam.samples]
print(json.dumps(out))
"""


def _py(code: str, prom_dir) -> str:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom_dir))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _rank(prom_dir, rank: int, body: str) -> str:
    return _py(PUBLISH.format(rank=rank, body=textwrap.dedent(body)), prom_dir)


def _exposition(prom_dir) -> list:
    import json

    return json.loads(_py(READ.format(path=str(prom_dir)), prom_dir))


def _info(samples) -> dict:
    return {
        (s[1]["tp_rank"], s[1]["sync"], s[1]["path"], s[1]["reason"]): s[2]
        for s in samples
        if s[0] == "sglang:hicache_sync_path_info"
    }


def test_one_series_per_rank_and_sync_at_1(tmp_path):
    for rank in (0, 1):
        _rank(
            tmp_path,
            rank,
            """
            assert path_info.publish("ack_counts", "pipelined", "pipelined", labels)
            assert path_info.publish("prefetch_votes", "blocking", "no_storage", labels)
            assert path_info.publish("decode_offload", "off", "untested_release", labels)
            """,
        )
    info = _info(_exposition(tmp_path))
    assert info == {
        (r, *k): 1.0
        for r in ("0", "1")
        for k in (
            ("ack_counts", "pipelined", "pipelined"),
            ("prefetch_votes", "blocking", "no_storage"),
            ("decode_offload", "off", "untested_release"),
        )
    }, info


def test_a_change_of_path_leaves_the_old_one_at_0(tmp_path):
    _rank(
        tmp_path,
        0,
        """
        path_info.publish("ack_counts", "pipelined", "pipelined", labels)
        path_info.publish("ack_counts", "blocking", "pp", labels)
        path_info.publish("ack_counts", "blocking", "pp", labels)  # unchanged: no-op
        """,
    )
    info = _info(_exposition(tmp_path))
    assert info == {
        ("0", "ack_counts", "pipelined", "pipelined"): 0.0,
        ("0", "ack_counts", "blocking", "pp"): 1.0,
    }, info


def test_reason_is_a_bounded_code_never_a_message(tmp_path):
    _rank(
        tmp_path,
        0,
        """
        path_info.publish("ack_counts", "blocking", "the installed SGLang differs in x", labels)
        assert path_info.reason_code("untested_release") == "untested_release"
        assert path_info.reason_code("Pipelined") == "other"
        assert path_info.reason_code(None) == "other"
        assert path_info.reason_code("a" * 49) == "other"
        """,
    )
    info = _info(_exposition(tmp_path))
    assert info == {("0", "ack_counts", "blocking", "other"): 1.0}, info


def test_bad_input_is_logged_never_raised(tmp_path):
    out = _rank(
        tmp_path,
        0,
        """
        import logging
        logging.basicConfig(level=logging.WARNING)
        assert not path_info.publish("acks", "pipelined", "pipelined", labels)
        assert not path_info.publish("ack_counts", "fast", "pipelined", labels)
        assert not path_info.publish("ack_counts", "off", "x", dict(labels, sync="s"))
        print("survived")
        """,
    )
    assert "survived" in out
    assert _info(_exposition(tmp_path)) == {}


def test_second_label_set_in_one_process_exports_both(tmp_path):
    _rank(
        tmp_path,
        0,
        """
        assert path_info.publish("ack_counts", "pipelined", "pipelined", labels)
        assert path_info.publish("ack_counts", "off", "disabled_by_env", dict(labels, model="m"))
        """,
    )
    samples = [s for s in _exposition(tmp_path) if s[0] == "sglang:hicache_sync_path_info"]
    assert sorted(s[1].get("model", "") for s in samples) == ["", "m"], samples


def test_created_through_the_caches_collector_class(tmp_path):
    """A deployment with other collector classes (RayEngine) gets the series
    through the cache's gauge class, as the ack sync's own series."""
    _rank(
        tmp_path,
        0,
        """
        from types import SimpleNamespace
        made = []

        class RecordingGauge:
            def __init__(self, name, doc, labelnames, **kw):
                made.append((name, tuple(labelnames), kw))
            def labels(self, **kw):
                return self
            def set(self, v):
                made.append(("set", v))

        class Collector:
            _gauge_cls = RecordingGauge

        assert path_info.publish("ack_counts", "pipelined", "pipelined", labels, Collector())
        name, names, kw = made[0]
        assert name == "sglang:hicache_sync_path_info", made
        assert names[-3:] == ("sync", "path", "reason"), names
        assert "registry" not in kw, kw
        assert made[1] == ("set", 1), made
        """,
    )


def test_inert_hook_publishes_off_with_the_caches_labels_and_nothing_without_metrics(tmp_path):
    """The version guard's stand-down hook: path off for both cache syncs under
    the cache's own labels; a cache without metrics (no collector) gets none;
    whatever the hooked method returned is returned unchanged."""
    _rank(
        tmp_path,
        0,
        """
        from types import SimpleNamespace
        hook = path_info.inert_hook("untested_release")
        cache = SimpleNamespace(metrics_collector=SimpleNamespace(labels=labels))
        assert hook("result", cache, "server_args", params=None) == "result"
        assert hook(None, SimpleNamespace()) is None  # metrics off: nothing
        assert hook(None, SimpleNamespace(metrics_collector=SimpleNamespace(labels=3))) is None
        """,
    )
    info = _info(_exposition(tmp_path))
    assert info == {
        ("0", "ack_counts", "off", "untested_release"): 1.0,
        ("0", "prefetch_votes", "off", "untested_release"): 1.0,
    }, info


def _noop_statement(node) -> None:
    import ast

    node.body.insert(len(node.body), ast.parse("_drifted_by_test = None").body[0])


def _registered(monkeypatch) -> list:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from hicache_async_ack import sglang_plugin
    from hicache_async_ack.env import ALLOW_UNTESTED_VAR, ENABLE_VAR

    calls: list = []
    monkeypatch.setattr(
        HookRegistry, "register", lambda target, fn, kind: calls.append((target, fn.__name__))
    )
    for var in (ENABLE_VAR, ALLOW_UNTESTED_VAR):
        monkeypatch.delenv(var, raising=False)
    sglang_plugin.register(sglang_plugin.Environment())  # judged afresh
    return calls


def test_an_inert_plugin_registers_only_the_path_info_hook(monkeypatch, environment_kept):
    """The version guard refuses a changed SGLang method every feature relies on
    (HookRegistry's _wrap_fn): no sync hook, only the AFTER init_hicache hook
    that exports path "off" (the inert capture in test/data/monitoring/inert.*
    shows what it exports on a real server)."""
    from sglang.srt.plugins import hook_registry

    from hicache_async_ack.guard import CACHE_CLASS
    from hicache_async_ack_lab.testing.drift import drifted

    monkeypatch.setattr(hook_registry, "_wrap_fn", drifted(hook_registry._wrap_fn, _noop_statement))
    assert _registered(monkeypatch) == [
        (f"{CACHE_CLASS}.init_hicache", "after_init_hicache_path_info")
    ]


def test_a_method_only_the_ack_sync_relies_on_marks_only_it_off(monkeypatch, environment_kept):
    """writing_check changed: the ack sync stands down (its path info hook marks
    it off), the votes and the offload sync keep their hooks."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from hicache_async_ack.guard import CACHE_CLASS, MANAGER_CLASS, check_installed
    from hicache_async_ack_lab.testing.drift import drifted

    runnable = {f.feature for f in check_installed().features() if f.status == "tested"}
    monkeypatch.setattr(
        UnifiedRadixCache,
        "writing_check",
        drifted(UnifiedRadixCache.writing_check, _noop_statement),
    )
    calls = _registered(monkeypatch)
    inert = [t for t, name in calls if name == "after_init_hicache_path_info"]
    assert inert == [f"{CACHE_CLASS}.init_hicache"]
    hooked = {t for t, name in calls if name != "after_init_hicache_path_info"}
    if "prefetch_votes" in runnable:
        assert f"{CACHE_CLASS}._can_terminate_prefetch" in hooked
    if "decode_offload" in runnable:
        assert f"{MANAGER_CLASS}.check_offload_progress" in hooked
    assert f"{CACHE_CLASS}._sync_hicache_ready_counts" not in hooked or (
        "prefetch_votes" in runnable  # the votes' own hook on it (they ride it)
    )


def test_a_tested_sglang_registers_the_sync_hooks_and_no_path_info_hook(
    monkeypatch, environment_kept
):
    calls = _registered(monkeypatch)
    assert calls, "no hook registered on a tested SGLang"
    assert "after_init_hicache_path_info" not in {name for _, name in calls}, calls
