"""The version guard: fingerprints of what the hooked and relied-on methods do,
the recorded table, the verdict register() acts on, doctor's lines and the
next-release check. Part of the per-release subset: on every tested SGLang the
installed release must match its own record."""

from __future__ import annotations

import ast
import inspect
import logging
import re
import zipfile
from pathlib import Path

import pytest

from hicache_async_ack import guard as upstream
from hicache_async_ack import sglang_plugin
from hicache_async_ack.env import ALLOW_UNTESTED_VAR, ENABLE_VAR
from hicache_async_ack.guard import TARGETS, check_installed, fingerprint_function
from hicache_async_ack.names import ACK, BY_NAME, SYNC_NAMES
from hicache_async_ack.sglang_plugin import Environment, hooked_for
from hicache_async_ack.tools import Exit, diagnose
from hicache_async_ack_lab import releases
from hicache_async_ack_lab.testing.drift import (
    drifted,
    drifted_module_source,
    extra_return_field,
    no_op_first,
    renamed_last_param,
    runs_here,
)

ROOT = Path(__file__).resolve().parents[2]
SYNC = "_sync_hicache_ready_counts"
SYNC_QUALNAME = f"UnifiedRadixCache.{SYNC}"
LOGGER = "sglang.srt.mem_cache.hicache_async_ack"


@pytest.fixture
def cache_cls():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache


@pytest.fixture
def registered(monkeypatch, caplog, environment_kept):
    """register() with HookRegistry.register recording instead of registering:
    the targets of the sync hooks; ``run.features`` the features they serve,
    ``run.inert`` the syncs the path-info hooks mark off (and why)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    calls: list = []

    def record(target, fn, *a, **k):
        if fn.__name__ == "after_init_hicache_path_info":
            reason, syncs = (c.cell_contents for c in fn.__closure__)
            run.inert.update({sync: reason for sync in syncs})
        else:
            calls.append(target)
            run.features.update(hooked_for(fn))

    monkeypatch.setattr(HookRegistry, "register", record)
    for var in (ENABLE_VAR, ALLOW_UNTESTED_VAR):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)

    def run(table: Path | None = None, **env) -> list:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        calls.clear()
        run.features, run.inert = set(), {}
        sglang_plugin.register(Environment(table=table))  # judged afresh, on this table
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


def _fp(source: str, scope: str = upstream.BODY) -> str:
    return upstream.fingerprint_def(upstream.parse_function_source(source), scope)


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
    assert _fp(body_changed, upstream.SIGNATURE) == _fp(SAMPLE, upstream.SIGNATURE)
    assert _fp(SAMPLE.replace("d=None", "e=None"), upstream.SIGNATURE) != _fp(
        SAMPLE, upstream.SIGNATURE
    )


def test_unchanged_method_fingerprint_is_stable(cache_cls, plugin):
    """The live method (hooked by the plugin fixture: the guard unwraps), its
    source re-parsed, and the module file parsed as a wheel is: one fingerprint."""
    method = getattr(cache_cls, SYNC)
    assert sglang_plugin.is_hooked(method)
    live = fingerprint_function(method)
    assert fingerprint_function(inspect.unwrap(method)) == live
    node = upstream.parse_function_source(inspect.getsource(inspect.unwrap(method)))
    assert upstream.fingerprint_def(ast.parse(ast.unparse(node)).body[0]) == live
    text = Path(inspect.getsourcefile(cache_cls) or "").read_text()
    node = upstream.find_def(ast.parse(text), SYNC_QUALNAME)
    assert node is not None and upstream.fingerprint_def(node) == live


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
        ack = [t.qualname for t in TARGETS if ACK in t.features]
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


def test_unreadable_table_keeps_stock_behaviour(registered, caplog, tmp_path):
    assert registered(table=tmp_path / "missing.json") == []
    assert "cannot judge this SGLang" in caplog.text


def test_recorded_table_matches_installed_release():
    """The SGLang this suite runs on (each tested release in turn) is recorded,
    and every live fingerprint equals its record: every feature is tested there,
    or recorded as absent (0.5.20's decode offload, 0.5.20-0.5.22's votes
    predicate)."""
    verdict = check_installed()
    assert verdict.installed in verdict.tested, verdict.installed
    judged = verdict.features()
    assert [f.feature for f in judged] == list(SYNC_NAMES)
    for f in judged:
        assert f.status in ("tested", "absent"), (f, [m.describe() for m in verdict.methods])
        assert f.changed == () and f.problems == ()
        assert f.release == (verdict.installed if f.status == "tested" else None)
    assert verdict.feature("ack_counts").status == "tested"
    assert verdict.in_range


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


def test_every_target_says_its_role_and_why_and_the_docs_table_is_generated_from_them():
    """Issue 53 item 6: one annotated index of upstream; docs/versions.md's table is
    exactly what the index generates (a target added, or a reason changed, shows)."""
    from hicache_async_ack_lab.releases import index_in, index_table

    assert len(TARGETS) > 20
    for t in TARGETS:
        assert t.roles and set(t.roles) <= {"hooked", "called", "shadowed", "read"}, t
        assert t.why and t.removal and t.features, t
    doc = (ROOT / "docs" / "versions.md").read_text()
    assert index_in(doc) == index_table(), "run `python -m hicache_async_ack_lab.releases index`"
    # negative control: a doc whose table lacks a row does not match
    stale = doc.replace(index_table().splitlines()[3] + "\n", "")
    assert index_in(stale) != index_table()
    # every hook the features declare is on a target whose role says hooked
    from hicache_async_ack.sglang_plugin import all_features

    hooked = {f"{h.target.rsplit('.', 1)[1]}.{h.method}" for f in all_features() for h in f.hooks}
    assert hooked, "no hook declared: the check is broken"
    for name in hooked:
        rows = [t for t in TARGETS if t.qualname == name or t.qualname.endswith(f".{name}")]
        assert rows and "hooked" in rows[0].roles, name


# ------------------------------------------------------------- the verdict
def _probes(fingerprints: dict[str, str]) -> list[upstream.Probe]:
    return [upstream.Probe(t, fingerprints[t.qualname], t.params) for t in TARGETS]


TABLE = {
    "1.0.1": {t.qualname: f"a-{t.label}" for t in TARGETS},
    "1.0.2": {t.qualname: f"b-{t.label}" if t.label == SYNC else f"a-{t.label}" for t in TARGETS},
}


def test_verdict_matches_one_release_method_for_method():
    v = upstream.judge(_probes(TABLE["1.0.2"]), "1.0.2", TABLE)
    for f in v.features():
        assert (f.status, f.release) == ("tested", "1.0.2"), f
    assert v.in_range
    same = {m.target.label: m.same_as for m in v.methods}
    assert same[SYNC] == ("1.0.2",) and same["check_hicache_events"] == ("1.0.1", "1.0.2")


def test_verdict_mixing_two_releases_is_untested():
    """Each method matches some tested release, but no release has them all."""
    mixed = dict(TABLE["1.0.2"])
    mixed["UnifiedRadixCache.check_hicache_events"] = "b-check_hicache_events"
    TABLE_3 = dict(TABLE, **{"1.0.3": dict(mixed, **{SYNC_QUALNAME: "a-" + SYNC})})
    v = upstream.judge(_probes(mixed), "1.0.4", TABLE_3)
    ack = v.feature("ack_counts")
    assert ack.status == "untested" and ack.release is None
    assert v.reference == "1.0.3" and ack.changed == (SYNC_QUALNAME,)
    assert "outside the tested range 1.0.1 to 1.0.3" in ack.summary(v)
    assert v.feature("decode_offload").status == "tested"  # none of its methods is mixed


def test_verdict_newer_version_same_methods_runs_and_says_so():
    v = upstream.judge(_probes(TABLE["1.0.2"]), "1.0.9", TABLE)
    ack = v.feature("ack_counts")
    assert ack.status == "tested" and ack.release == "1.0.2" and not v.in_range
    assert "outside the tested range 1.0.1 to 1.0.2" in ack.summary(v)


def test_verdict_in_range_version_with_other_body_names_the_method():
    prints = dict(TABLE["1.0.1"], **{SYNC_QUALNAME: "zzz"})
    v = upstream.judge(_probes(prints), "1.0.1", TABLE)
    ack = v.feature("ack_counts")
    assert ack.status == "untested" and v.reference == "1.0.1"
    assert ack.changed == (SYNC_QUALNAME,)
    assert f"{SYNC_QUALNAME} differs from what was recorded for 1.0.1" in ack.summary(v)


def exclusive_method(feature: str) -> str:
    """A method only ``feature`` wraps or relies on (its mutant moves only it)."""
    return next(t.qualname for t in TARGETS if t.features == (feature,))


@pytest.mark.parametrize("feature", SYNC_NAMES)
def test_a_mutant_of_one_features_method_stops_only_that_feature(feature):
    """One table for all three, one verdict per feature: a release where one
    method only ``feature`` relies on changed leaves the other two tested."""
    qualname = exclusive_method(feature)
    prints = dict(TABLE["1.0.2"], **{qualname: "mutant"})
    v = upstream.judge(_probes(prints), "1.0.2", TABLE)
    judged = {f.feature: f for f in v.features()}
    assert judged[feature].status == "untested" and judged[feature].changed == (qualname,)
    others = [f for name, f in judged.items() if name != feature]
    assert len(others) == 2 and all(f.status == "tested" for f in others), others


def test_a_mutant_of_a_shared_method_stops_every_feature_that_relies_on_it():
    prints = dict(TABLE["1.0.2"], **{SYNC_QUALNAME: "mutant"})  # the ack sync's and the votes'
    v = upstream.judge(_probes(prints), "1.0.2", TABLE)
    status = {f.feature: f.status for f in v.features()}
    assert status == {"ack_counts": "untested", "prefetch_votes": "untested",
                      "decode_offload": "tested"}  # fmt: skip


@pytest.mark.parametrize(
    "version, inside",
    [("1.0.1", True), ("1.0.2.post1", True), ("1.0.0", False), ("1.0.3", False), ("", False)],
)
def test_version_range(version, inside):
    assert upstream.in_tested_range(version, TABLE) is inside


# ---------------------------------------------------- register() acts on it
def test_tested_release_registers_and_logs_the_match(registered, caplog):
    hooks = registered()
    assert hooks and registered.features == runs_here()
    assert set(registered.inert) == {"ack_counts", "prefetch_votes"} - runs_here()
    installed = upstream.installed_version()
    assert f"SGLang {installed} matches tested release {installed}" in caplog.text


def test_drifted_method_leaves_its_features_on_upstreams_path(
    registered, caplog, monkeypatch, cache_cls
):
    """Same version string, same signatures; _sync_hicache_ready_counts (the ack
    sync's and the votes') returns one more field: neither registers a hook, a
    warning per feature names the method and the opt-in; the decode offload sync
    runs, and the path info marks the two off."""
    live = runs_here()
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    registered()
    assert registered.features == live - {"ack_counts", "prefetch_votes"}
    # where this SGLang has no votes predicate, the votes were off before the drift
    votes = "untested_release" if "prefetch_votes" in live else "not_in_release"
    assert registered.inert == {"ack_counts": "untested_release", "prefetch_votes": votes}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 + ("prefetch_votes" in live)
    for text in warnings:
        assert f"is untested: {SYNC_QUALNAME} differs from what was recorded" in text
        assert "Not hooked" in text and f"{ALLOW_UNTESTED_VAR}=1" in text


@pytest.mark.parametrize("feature", SYNC_NAMES)
def test_a_method_only_one_feature_relies_on_stops_only_that_feature(
    registered, caplog, monkeypatch, feature
):
    """On the live classes: the one feature stands down (named), the others
    register their hooks."""
    import importlib

    live = runs_here()
    if feature not in live:
        pytest.skip(f"{feature} does not run on this SGLang")
    target = next(t for t in TARGETS if t.features == (feature,))
    owner = importlib.import_module(target.module)
    *path, name = target.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, drifted(getattr(owner, name), no_op_first))
    registered()
    assert registered.features == live - {feature}
    title = BY_NAME[feature].title
    assert any(
        r.getMessage().startswith(title) and target.qualname in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    )


def test_allow_untested_registers_with_loud_warning(registered, caplog, monkeypatch, cache_cls):
    live = runs_here()
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    registered(**{ALLOW_UNTESTED_VAR: "1"})
    assert registered.features == live
    assert "RUNNING ON AN UNTESTED SGLANG" in caplog.text and SYNC_QUALNAME in caplog.text


@pytest.mark.parametrize("name", ["writing_check", "loading_check"])
def test_changed_parameters_stay_inert_even_with_opt_in(
    registered, caplog, monkeypatch, cache_cls, name
):
    monkeypatch.setattr(cache_cls, name, drifted(getattr(cache_cls, name), renamed_last_param))
    registered(**{ALLOW_UNTESTED_VAR: "1"})
    assert "ack_counts" not in registered.features  # only the ack sync pops through them
    assert f"is incompatible: UnifiedRadixCache.{name} takes (" in caplog.text
    assert "finish_count_renamed" in caplog.text and "cannot override" in caplog.text


def test_missing_method_stays_inert(registered, caplog, monkeypatch, cache_cls):
    monkeypatch.delattr(cache_cls, "_count_ready_acks")
    registered(**{ALLOW_UNTESTED_VAR: "1"})
    assert "ack_counts" not in registered.features
    qualname = "UnifiedRadixCache._count_ready_acks"
    assert f"is incompatible: {upstream.CACHE_MODULE} has no {qualname}" in caplog.text


def test_bad_opt_in_value_fails_server_start(registered, caplog):
    assert registered(**{ALLOW_UNTESTED_VAR: "perhaps"}) == [f"{upstream.CACHE_CLASS}.init_hicache"]
    assert f"{ALLOW_UNTESTED_VAR}='perhaps' is not a boolean" in caplog.text


# ------------------------------------------------------------------ doctor
LIVE_LAUNCH = ["--tp", "4", "--enable-hierarchical-cache"]


def _doctor(monkeypatch, launch=None, verbose=False, **env):
    for var in (ENABLE_VAR, ALLOW_UNTESTED_VAR):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return diagnose(launch, verbose)


def guard_rows(rep) -> dict[str, str]:
    """The version guard's row per sync, its wrapping (to the value column) undone."""
    text = re.sub(r"\n {20,}(?=\S)", " ", "\n".join(rep.lines))
    rows = {}
    for sync in SYNC_NAMES:
        found = re.search(rf"^  {sync} +((?:yes|NO|UNTESTED)\b.*)$", text, re.M)
        assert found, (sync, text)
        rows[sync] = found.group(1)
    return rows


def test_doctor_shows_release_range_and_every_fingerprint(monkeypatch):
    rep = _doctor(monkeypatch, verbose=True)
    text = "\n".join(rep.lines)
    installed = upstream.installed_version()
    assert f"SGLang {installed}, in the tested range" in " ".join(text.split())
    assert TARGETS
    for t in TARGETS:
        found = re.search(rf"^    {re.escape(t.label)}: (.*)$", text, re.M)
        assert found, (t.label, text)
        line = found.group(1)
        # a method the table records as absent in this release (one only another
        # feature needs, e.g. 0.5.20's missing prefetch deadline predicate)
        absent = line.startswith("absent, as recorded for ") and installed in line
        assert line.startswith("same as ") or absent, (t.label, line)
    rows = guard_rows(rep)
    for feature in runs_here():
        assert rows[feature] == f"yes: SGLang {installed} matches tested release {installed}"
    assert rep.code == Exit.LIVE
    assert "same as" not in "\n".join(_doctor(monkeypatch).lines)  # the table is --verbose's


def test_doctor_says_which_feature_stands_down_and_why(monkeypatch, cache_cls):
    live = runs_here()
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    rep = _doctor(monkeypatch, verbose=True)
    text = "\n".join(rep.lines)
    assert re.search(rf"^    {SYNC}: CHANGED: matches no tested release", text, re.M)
    assert re.search(r"^    check_hicache_events: same as", text, re.M)
    ack = guard_rows(rep)["ack_counts"]
    assert ack.startswith("NO, stands down: ") and SYNC_QUALNAME in ack
    assert ALLOW_UNTESTED_VAR in ack
    assert rep.code == Exit.GUARD  # the ack sync decides, whatever else still runs
    if "decode_offload" in live:  # the offload sync's methods are untouched
        assert guard_rows(rep)["decode_offload"].startswith("yes: ")
    rep = _doctor(monkeypatch, **{ALLOW_UNTESTED_VAR: "1"})
    assert guard_rows(rep)["ack_counts"].startswith("UNTESTED, runs anyway")
    assert rep.code == Exit.LIVE


def test_doctors_verdict_names_the_cause_and_the_syncs_still_live(monkeypatch, cache_cls, capsys):
    """A changed method the ack sync relies on, on a launch every sync serves: exit with
    the guard's code (never a bare "plugin ACTIVE"), naming the method, the offload sync
    still live on its own line; its own setting off, it stands down by name."""
    from hicache_async_ack.env import OFFLOAD_SYNC_VAR
    from hicache_async_ack.tools import main

    live = runs_here()
    if "decode_offload" not in live:
        pytest.skip("no sync but the ack sync runs on this SGLang")
    launch = ["--", *LIVE_LAUNCH, "--disaggregation-mode", "decode",
              "--disaggregation-decode-enable-offload-kvcache"]  # fmt: skip
    for var in (ENABLE_VAR, ALLOW_UNTESTED_VAR, OFFLOAD_SYNC_VAR):
        monkeypatch.delenv(var, raising=False)
    assert main(["doctor", *launch]) == Exit.LIVE  # control: nothing changed
    capsys.readouterr()
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    assert main(["doctor", *launch]) == Exit.GUARD
    out = " ".join(capsys.readouterr().out.split())
    verdict = out.split("verdict: ")[1]
    assert verdict.startswith(f"INACTIVE (exit {Exit.GUARD.value}): the version guard keeps")
    assert SYNC_QUALNAME in verdict and "still live (extras" in verdict
    assert "decode_offload live: pipelined over the TP group" in out, out
    monkeypatch.setenv(OFFLOAD_SYNC_VAR, "0")
    main(["doctor", *launch])
    out = " ".join(capsys.readouterr().out.split())
    assert f"decode_offload standing down (feature_disabled_by_env): {OFFLOAD_SYNC_VAR}=0" in out


def test_doctor_blocks_when_no_feature_would_run(monkeypatch, cache_cls):
    """With every feature's methods changed, no guard row says yes and the exit is the
    guard's; control: the same report before the change says yes."""
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager as manager_cls,
    )

    assert "yes: " in guard_rows(_doctor(monkeypatch))["ack_counts"]
    monkeypatch.setattr(cache_cls, SYNC, drifted(getattr(cache_cls, SYNC)))
    for name in ("check_offload_progress",):
        monkeypatch.setattr(manager_cls, name, drifted(getattr(manager_cls, name), no_op_first))
    rep = _doctor(monkeypatch, LIVE_LAUNCH)
    rows = guard_rows(rep)
    assert all(not v.startswith("yes") for v in rows.values()), rows
    assert rep.code == Exit.GUARD
    assert not any(v.live for v in rep.syncs.values())


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
    # the scheduler's modules the votes hook too, as installed
    import importlib

    others = {
        m: Path(inspect.getsourcefile(importlib.import_module(m)) or "").read_text()
        for m in (
            "sglang.srt.managers.schedule_policy",
            "sglang.srt.managers.scheduler",
            "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface",
        )
    }
    for version, text in variants.items():
        with zipfile.ZipFile(wheels / f"sglang-{version}-py3-none-any.whl", "w") as z:
            z.writestr("sglang/srt/mem_cache/unified_radix_cache.py", text)
            z.writestr("sglang/srt/plugins/hook_registry.py", hooks_file)
            for module, source in others.items():
                z.writestr(module.replace(".", "/") + ".py", source)
    monkeypatch.setenv("HICACHE_ASYNC_ACK_CACHE", str(tmp_path))
    return wheels


def test_release_check_same_methods_says_widen(fake_wheels, capsys):
    installed = upstream.installed_version()
    assert releases.main(["check", "9.9.8"]) == 0
    out = capsys.readouterr().out
    assert f"ack_counts: tested: SGLang 9.9.8 matches tested release {installed}" in out
    assert "verdict: every feature's fingerprints match a tested release" in out
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
    assert {f.status for f in before.features()} == {"untested"}
    recorded = {**table, "0.5.24": {p.target.qualname: p.fingerprint for p in probes}}
    after = upstream.judge(probes, "0.5.24", recorded)
    assert {f.status for f in after.features()} == {"tested"}
    assert [after.feature_release(f) for f in features] == ["0.5.24"] * 3
