"""The version guard: fingerprints of what the hooked and relied-on methods do,
the recorded table, the verdict register() acts on, doctor's lines and the
next-release check. Part of the per-release subset: on every tested SGLang the
installed release must match its own record."""

from __future__ import annotations

import ast
import inspect
import logging
import zipfile
from pathlib import Path

import pytest

from hicache_async_ack import fingerprint, sglang_plugin
from hicache_async_ack import guard as upstream
from hicache_async_ack.env import ALLOW_UNTESTED_VAR, ENABLE_VAR
from hicache_async_ack.fingerprint import fingerprint_function
from hicache_async_ack.guard import TARGETS, check_installed
from hicache_async_ack.tools import doctor
from hicache_async_ack_lab import releases
from hicache_async_ack_lab.testing.drift import (
    drifted,
    drifted_module_source,
    extra_return_field,
    renamed_last_param,
)

ROOT = Path(__file__).resolve().parents[1]
SYNC = "_sync_hicache_ready_counts"
SYNC_QUALNAME = f"UnifiedRadixCache.{SYNC}"
LOGGER = "sglang.srt.mem_cache.hicache_async_ack"


@pytest.fixture
def cache_cls():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache


@pytest.fixture
def registered(monkeypatch, caplog):
    """register() with HookRegistry.register recording instead of registering."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    calls: list = []

    def record(target, fn, *a, **k):  # the sync hooks (not the inert path-info one)
        if fn.__name__ != "after_init_hicache_path_info":
            calls.append(target)

    monkeypatch.setattr(HookRegistry, "register", record)
    for var in (ENABLE_VAR, ALLOW_UNTESTED_VAR):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)

    def run(**env) -> list:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        calls.clear()
        sglang_plugin.register()
        return list(calls)

    return run


# ------------------------------------------------------------ the fingerprint
SAMPLE = '''
@decorate(level=1)
def sample(self, a, b: int = 2, /, *args, c, d=None, **kw) -> tuple[int, ...]:
    """A docstring."""
    x: int = a + b  # a comment
    if (y := x * 2) > 0 and not c:
        return (x, -y, f"{a!r:>{b}} and {c}", [i for i in args if i], {k: v for k, v in kw})
    try:
        with open(a) as fh, lock:
            del fh[0]
    except (ValueError, KeyError) as e:
        raise RuntimeError("no") from e
    finally:
        pass
    match a:
        case [1, *rest] if rest:
            yield rest
    g = lambda y, *, z=3: y**z
    return a[1:2, ::3], b"x", 1.5, 2j, ..., None, True, {1, 2}, g
'''
# The same function: another docstring, formatting, comments and annotations.
SAMPLE_RESTYLED = '''
@decorate(level = 1)
def sample(self, a, b = 2, /, *args, c, d = None, **kw):
    """Another docstring,
    on two lines."""
    x: float = (a
                + b)
    if (y := x * 2) > 0 and (not c):
        return x, -y, f"{a!r:>{b}} and {c}", [i for i in args if i], {k: v for k, v in kw}
    try:
        with open(a) as fh, lock:
            del fh[0]
    except (ValueError, KeyError) as e:
        raise RuntimeError('no') from e
    finally:
        pass
    match a:
        case [1, *rest] if rest:
            yield rest
    g = lambda y, *, z=3: y ** z
    return (a[1:2, ::3], b'x', 1.5, 2j, ..., None, True, {1, 2}, g)
'''
# Recorded once. The canonical form uses only node class names and fields, so it
# must not move with the Python version; if this fails on a new Python, the
# scheme changed: fix canonical() (or bump SCHEME and record the table again).
SAMPLE_FINGERPRINT = "b5a3c75042f5ab6f"


def _fp(source: str, scope: str = fingerprint.BODY) -> str:
    return fingerprint.fingerprint_def(fingerprint.parse_function_source(source), scope)


def test_fingerprint_is_the_recorded_one_on_this_python():
    assert _fp(SAMPLE) == SAMPLE_FINGERPRINT


def test_fingerprint_ignores_docstring_comments_format_and_annotations():
    assert _fp(SAMPLE_RESTYLED) == _fp(SAMPLE)


@pytest.mark.parametrize(
    "old, new",
    [
        ("return a[1:2, ::3]", "return a[1:3, ::3]"),  # a constant
        ("y**z", "y*z"),  # an operator
        ("{1, 2}, g", "{1, 2}, g, 0"),  # one more field returned
        ('RuntimeError("no")', 'RuntimeError("No")'),  # a message
        ("if (y := x * 2) > 0 and not c:", "if (y := x * 2) > 0 or not c:"),
        ("d=None", "d=0"),  # a default
    ],
)
def test_fingerprint_changes_with_what_the_code_does(old, new):
    assert old in SAMPLE
    assert _fp(SAMPLE.replace(old, new)) != _fp(SAMPLE)


def test_signature_scope_sees_parameters_not_the_body():
    body_changed = SAMPLE.replace("return a[1:2, ::3]", "return a[1:3, ::3]")
    assert _fp(body_changed, fingerprint.SIGNATURE) == _fp(SAMPLE, fingerprint.SIGNATURE)
    assert _fp(SAMPLE.replace("d=None", "e=None"), fingerprint.SIGNATURE) != _fp(
        SAMPLE, fingerprint.SIGNATURE
    )


def test_unchanged_method_fingerprint_is_stable(cache_cls, plugin):
    """The live method (hooked by the plugin fixture: the guard unwraps), its
    source re-parsed, and the module file parsed as a wheel is: one fingerprint."""
    method = getattr(cache_cls, SYNC)
    assert sglang_plugin.is_hooked(method)
    live = fingerprint_function(method)
    assert fingerprint_function(inspect.unwrap(method)) == live
    node = fingerprint.parse_function_source(inspect.getsource(inspect.unwrap(method)))
    assert fingerprint.fingerprint_def(ast.parse(ast.unparse(node)).body[0]) == live
    text = Path(inspect.getsourcefile(cache_cls) or "").read_text()
    node = fingerprint.find_def(ast.parse(text), SYNC_QUALNAME)
    assert node is not None and fingerprint.fingerprint_def(node) == live


def test_drifted_body_changes_fingerprint_not_parameters(cache_cls):
    method = getattr(cache_cls, SYNC)
    changed = drifted(method, extra_return_field)
    assert fingerprint_function(changed) != fingerprint_function(method)
    assert inspect.signature(changed) == inspect.signature(inspect.unwrap(method))


# --------------------------------------------------------------- the table
def test_table_is_current_and_covers_every_target():
    table = upstream.load_table()
    names = {t.qualname for t in TARGETS}
    assert upstream.tested_releases() == sorted(table, key=upstream.release_key)
    for release, prints in table.items():
        assert set(prints) == names, release
        # the ack sync's targets exist on every tested release; another feature's
        # may be recorded absent (null): that feature stays off there
        ack = [t.qualname for t in TARGETS if upstream.ACK in t.features]
        assert ack and all(prints[q] for q in ack), release


def test_table_of_another_scheme_is_refused(tmp_path):
    """A change to canonical() must come with a re-recorded table."""
    path = tmp_path / "table.json"
    path.write_text(upstream.TABLE_PATH.read_text().replace(upstream.SCHEME, "canonical-ast-0"))
    with pytest.raises(ValueError, match="record it again"):
        upstream.load_table(path)


def test_table_ships_in_the_wheel():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["hicache_async_ack"]
    assert upstream.TABLE_PATH.name in data


def test_unreadable_table_keeps_stock_behaviour(registered, caplog, monkeypatch, tmp_path):
    monkeypatch.setattr(upstream, "TABLE_PATH", tmp_path / "missing.json")
    assert registered() == []
    assert "cannot judge this SGLang" in caplog.text


def test_recorded_table_matches_installed_release():
    """The SGLang this suite runs on (each tested release in turn) is recorded,
    and every live fingerprint equals its record."""
    verdict = check_installed()
    assert verdict.installed in verdict.tested, verdict.installed
    assert verdict.status == "tested", [m.describe() for m in verdict.methods]
    assert verdict.release == verdict.installed
    assert verdict.in_range
    assert verdict.changed == []


def test_table_is_what_record_writes_from_the_wheel(tmp_path):
    """Regenerating the installed release's row from its real wheel (pip
    download --no-deps, cached) gives the committed row: generated, not typed."""
    installed = upstream.installed_version()
    assert installed is not None
    data = releases.record([installed], path=tmp_path / "table.json")
    assert data["scheme"] == upstream.SCHEME
    assert data["releases"][installed] == upstream.load_table()[installed]


def test_docs_state_the_tested_range():
    tested = upstream.tested_releases()
    span = f"{tested[0]} to {tested[-1]}"
    readme = (ROOT / "README.md").read_text()
    supported = readme.split("## Supported", 1)[1].split("\n## ", 1)[0]
    assert span in supported
    assert ALLOW_UNTESTED_VAR in supported and ALLOW_UNTESTED_VAR in readme.split("## Supported")[0]
    assert span in (ROOT / "docs" / "versions.md").read_text()


# ------------------------------------------------------------- the verdict
def _probes(fingerprints: dict[str, str]) -> list[upstream.Probe]:
    return [upstream.Probe(t, fingerprints[t.qualname], t.params) for t in TARGETS]


TABLE = {
    "1.0.1": {t.qualname: f"a-{t.label}" for t in TARGETS},
    "1.0.2": {t.qualname: f"b-{t.label}" if t.label == SYNC else f"a-{t.label}" for t in TARGETS},
}


def test_verdict_matches_one_release_method_for_method():
    v = upstream.judge(_probes(TABLE["1.0.2"]), "1.0.2", TABLE)
    assert (v.status, v.matched, v.release, v.in_range) == ("tested", ("1.0.2",), "1.0.2", True)
    same = {m.target.label: m.same_as for m in v.methods}
    assert same[SYNC] == ("1.0.2",) and same["check_hicache_events"] == ("1.0.1", "1.0.2")


def test_verdict_mixing_two_releases_is_untested():
    """Each method matches some tested release, but no release has them all."""
    mixed = dict(TABLE["1.0.2"])
    mixed["UnifiedRadixCache.check_hicache_events"] = "b-check_hicache_events"
    TABLE_3 = dict(TABLE, **{"1.0.3": dict(mixed, **{SYNC_QUALNAME: "a-" + SYNC})})
    v = upstream.judge(_probes(mixed), "1.0.4", TABLE_3)
    assert v.status == "untested" and v.matched == ()
    assert v.reference == "1.0.3" and v.changed == [SYNC_QUALNAME]
    assert "outside the tested range 1.0.1 to 1.0.3" in v.summary()


def test_verdict_newer_version_same_methods_runs_and_says_so():
    v = upstream.judge(_probes(TABLE["1.0.2"]), "1.0.9", TABLE)
    assert v.status == "tested" and v.release == "1.0.2" and not v.in_range
    assert "outside the tested range 1.0.1 to 1.0.2" in v.summary()


def test_verdict_in_range_version_with_other_body_names_the_method():
    prints = dict(TABLE["1.0.1"], **{SYNC_QUALNAME: "zzz"})
    v = upstream.judge(_probes(prints), "1.0.1", TABLE)
    assert v.status == "untested" and v.reference == "1.0.1"
    assert v.changed == [SYNC_QUALNAME]
    assert f"{SYNC_QUALNAME} differs from what was recorded for 1.0.1" in v.summary()


@pytest.mark.parametrize(
    "version, inside",
    [("1.0.1", True), ("1.0.2.post1", True), ("1.0.0", False), ("1.0.3", False), ("", False)],
)
def test_version_range(version, inside):
    assert upstream.in_tested_range(version, TABLE) is inside


# ---------------------------------------------------- register() acts on it
def expected_hooks() -> int:
    from hicache_async_ack.features import all_features

    verdict = upstream.check_installed()
    features = all_features()
    assert len(features) == 3
    return sum(
        len(f.hooks) for f in features if not verdict.missing_methods(h.method for h in f.hooks)
    )


def test_tested_release_registers_and_logs_the_match(registered, caplog):
    hooks = registered()
    # every feature whose hooked methods this SGLang has (0.5.20: no decode offload)
    assert hooks and len(hooks) == expected_hooks()
    installed = upstream.installed_version()
    assert f"SGLang {installed} matches tested release {installed}" in caplog.text


def test_drifted_method_leaves_plugin_inert_naming_it(registered, caplog, monkeypatch, cache_cls):
    """Same version string, same signatures; _sync_hicache_ready_counts returns
    one more field: no hook, a warning naming the method and the opt-in."""
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    assert registered() == []
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1
    text = warning[0].getMessage()
    assert f"is untested: {SYNC_QUALNAME} differs from what was recorded" in text
    assert "Registering no hooks" in text and f"{ALLOW_UNTESTED_VAR}=1" in text


def test_allow_untested_registers_with_loud_warning(registered, caplog, monkeypatch, cache_cls):
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    assert len(registered(**{ALLOW_UNTESTED_VAR: "1"})) == expected_hooks()
    assert "RUNNING ON AN UNTESTED SGLANG" in caplog.text and SYNC_QUALNAME in caplog.text


@pytest.mark.parametrize("name", ["writing_check", "loading_check"])
def test_changed_parameters_stay_inert_even_with_opt_in(
    registered, caplog, monkeypatch, cache_cls, name
):
    monkeypatch.setattr(cache_cls, name, drifted(getattr(cache_cls, name), renamed_last_param))
    assert registered(**{ALLOW_UNTESTED_VAR: "1"}) == []
    assert f"is incompatible: UnifiedRadixCache.{name} takes (" in caplog.text
    assert "finish_count_renamed" in caplog.text and "cannot override" in caplog.text


def test_missing_method_stays_inert(registered, caplog, monkeypatch, cache_cls):
    monkeypatch.delattr(cache_cls, "_count_ready_acks")
    assert registered(**{ALLOW_UNTESTED_VAR: "1"}) == []
    qualname = "UnifiedRadixCache._count_ready_acks"
    assert f"is incompatible: {upstream.CACHE_MODULE} has no {qualname}" in caplog.text


def test_bad_opt_in_value_fails_server_start(registered, caplog):
    assert registered(**{ALLOW_UNTESTED_VAR: "perhaps"}) == [f"{upstream.CACHE_CLASS}.init_hicache"]
    assert f"{ALLOW_UNTESTED_VAR}='perhaps' is not a boolean" in caplog.text


# ------------------------------------------------------------------ doctor
def _doctor(monkeypatch, **env) -> doctor.Report:
    for var in (ENABLE_VAR, ALLOW_UNTESTED_VAR):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return doctor.diagnose(tp=2, step_ms=11.0, rounds=0)


def test_doctor_shows_release_range_and_every_fingerprint(monkeypatch):
    rep = _doctor(monkeypatch)
    lines = dict(rep.lines)
    installed = upstream.installed_version()
    assert lines["SGLang"] == installed
    assert lines["tested range"].endswith(f": {installed} is in it")
    assert TARGETS
    for t in TARGETS:
        line = lines[f"  {t.label}"]
        # a method the table records as absent in this release (one only another
        # feature needs, e.g. 0.5.20's missing prefetch deadline predicate)
        absent = line.startswith("absent, as recorded for ") and installed in line
        assert line.startswith("same as ") or absent, (t.label, line)
        assert installed in lines[f"  {t.label}"]
    assert lines["supported"] == f"yes: SGLang {installed} matches tested release {installed}"
    assert rep.blockers == []


def test_doctor_drifted_method_is_inactive_unless_opted_in(monkeypatch, cache_cls):
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    rep = _doctor(monkeypatch)
    lines = dict(rep.lines)
    assert lines[f"  {SYNC}"].startswith("CHANGED: matches no tested release")
    assert lines["  check_hicache_events"].startswith("same as")
    assert lines["supported"].startswith("NO: ") and SYNC_QUALNAME in lines["supported"]
    assert any("untested" in b and ALLOW_UNTESTED_VAR in b for b in rep.blockers)
    rep = _doctor(monkeypatch, **{ALLOW_UNTESTED_VAR: "1"})
    assert dict(rep.lines)["supported"].startswith("UNTESTED, running anyway")
    assert rep.blockers == []


# ------------------------------------------------- the next-release check
@pytest.fixture
def fake_wheels(tmp_path, monkeypatch, cache_cls):
    """A private wheel cache holding 9.9.8 (the installed release's sources,
    reformatted) and 9.9.9 (the same with _sync_hicache_ready_counts drifted)."""
    from sglang.srt.plugins import hook_registry

    cache_file = Path(inspect.getsourcefile(cache_cls) or "").read_text()
    hooks_file = Path(inspect.getsourcefile(hook_registry) or "").read_text()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    variants = {
        "9.9.8": ast.unparse(ast.parse(cache_file)),
        "9.9.9": drifted_module_source(cache_file, SYNC_QUALNAME, extra_return_field),
    }
    for version, text in variants.items():
        with zipfile.ZipFile(wheels / f"sglang-{version}-py3-none-any.whl", "w") as z:
            z.writestr("sglang/srt/mem_cache/unified_radix_cache.py", text)
            z.writestr("sglang/srt/plugins/hook_registry.py", hooks_file)
    monkeypatch.setenv("HICACHE_ASYNC_ACK_CACHE", str(tmp_path))
    return wheels


def test_release_check_same_methods_says_widen(fake_wheels, capsys):
    installed = upstream.installed_version()
    assert releases.main(["check", "9.9.8"]) == 0
    out = capsys.readouterr().out
    assert f"verdict: every fingerprint matches {installed}" in out
    assert "record --add 9.9.8" in out and "CHANGED" not in out


def test_release_check_changed_method_names_it(fake_wheels, capsys):
    installed = upstream.installed_version()
    assert releases.main(["check", "9.9.9"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith(SYNC))
    assert "CHANGED: matches no tested release" in line
    assert f"verdict: CHANGED against {installed}: {SYNC_QUALNAME}." in out
    assert sum("CHANGED:" in x for x in out.splitlines()) == 1


def test_release_check_unknown_release_fails_cleanly(fake_wheels, capsys, monkeypatch):
    monkeypatch.setattr(releases, "_pip", lambda *a: None)  # "downloads" nothing
    assert releases.main(["check", "9.9.7"]) == 2
    assert "no wheel or sdist of sglang==9.9.7" in capsys.readouterr().err


def test_a_recorded_release_turns_every_feature_on():
    """One table for all three features: a release whose methods of every feature
    differ from each tested one leaves all three off; recording it (what
    `releases record --add` writes) turns all three on."""
    from dataclasses import replace

    probes = [upstream.probe_live(t) for t in TARGETS]
    missing = [p.target.qualname for p in probes if p.missing]
    if missing:  # an older release (0.5.20-0.5.22): runs in the full suite on the newest
        pytest.skip(f"this SGLang lacks {missing}: not every feature can run on it")
    features = ("ack_counts", "prefetch_votes", "decode_offload")
    changed = {}
    for feature in features:  # one method of each feature changed in the new release
        i = next(
            i
            for i, p in enumerate(probes)
            if p.target.features == (feature,)
            or (feature == "ack_counts" and p.target.qualname.endswith("writing_check"))
        )
        probes[i] = replace(probes[i], fingerprint=f"new-{feature}")
        changed[feature] = probes[i].target.qualname
    assert len(set(changed.values())) == 3
    table = upstream.load_table()
    before = upstream.judge(probes, "0.5.24", table)
    assert [before.feature_release(f) for f in features] == [None, None, None]
    assert before.status == "untested"
    recorded = {**table, "0.5.24": {p.target.qualname: p.fingerprint for p in probes}}
    after = upstream.judge(probes, "0.5.24", recorded)
    assert after.status == "tested"
    assert [after.feature_release(f) for f in features] == ["0.5.24"] * 3
