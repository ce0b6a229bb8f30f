"""``hicache-async-ack upstream-patch``: the in-tree form, proven by the same suites.

For every SGLang release whose source is here (the installed one; the
per-release test overlays of tools/releases.py when present) the patch generated
from it applies with ``patch -p1`` to a fresh copy, and the patched files keep
upstream's method bodies under their new names. On the installed release the
patched tree then runs, with the plugin excluded by SGLANG_PLUGINS: the
in-tree unit checks (intree_checks.py: loading, settings, PP and buffer modes)
and the real-gloo scenarios at TP=4 (symmetric pops, nothing left, pipelined
pops equal to blocking pops k steps earlier, a lifecycle run, ranks that
disagree stopping loudly). A patch that no longer applies names the hunk; a
source the generator cannot find its anchors in names the anchor.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_async_ack.env import ALLOW_UNTESTED_VAR, DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR
from hicache_async_ack.testing.checks import assert_lagged_equal, assert_symmetric_and_complete
from hicache_async_ack.testing.scenarios import ACK_KINDS, LOCAL_DRAIN_EVENTS
from hicache_async_ack.tools import cli
from hicache_async_ack.tools.intree import module as composer
from hicache_async_ack.tools.intree import unidiff
from hicache_async_ack.tools.intree.edits import CACHE_PATH, ENVIRON_PATH, RENAMED
from hicache_async_ack.tools.releases import cache_root
from hicache_async_ack.tools.upstream_patch import generate, installed_root

from gloo_ranks import run_fresh, scenario_job

REPO = Path(__file__).resolve().parents[1]
MODULE_PATH = composer.MODULE_PATH
EXISTING = (CACHE_PATH, ENVIRON_PATH)
WORLD = 4
OFF = {ENABLE_VAR: "0"}
EXCLUDED = "some_other_plugin"  # an SGLANG_PLUGINS list without us


def _version(root: Path) -> str:
    """The release installed under ``root`` (its dist-info; sglang/version.py
    may hold a placeholder), or the folder's name."""
    infos = sorted(root.glob("sglang-*.dist-info"))
    return infos[0].name[len("sglang-") : -len(".dist-info")] if infos else root.name


def release_roots() -> list:
    """Directories holding an ``sglang/`` to patch: the installed release first,
    then each per-release test overlay present (tools/releases.py makes them)."""
    installed = installed_root()
    found = {_version(installed): installed}
    overlays = cache_root() / "sglang-overlays"
    for hit in sorted(overlays.glob(f"*/{CACHE_PATH}")):
        root = hit.parents[3]
        found.setdefault(_version(root), root)
    return [pytest.param(root, id=v) for v, root in found.items()]


RELEASES = release_roots()


def patch_p1(patch: str, root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["patch", "-p1", "--batch", "--forward", "-d", str(root), *extra],
        input=patch,
        capture_output=True,
        text=True,
        timeout=60,
    )


def copy_sources(src: Path, dest: Path) -> Path:
    """The files the patch edits, alone, at their paths under ``dest``."""
    for rel in EXISTING:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dest / rel)
    return dest


def mirror(src: Path, dest: Path) -> Path:
    """A tree of symlinks to ``src/sglang`` whose directories on the patch's
    paths are real (without their __pycache__) and whose patched files are
    copies: importable as SGLang, patched in place, fast to build."""
    real_dirs = {Path(p).parents[i].as_posix() for p in (MODULE_PATH, *EXISTING) for i in range(3)}

    def walk(rel: str) -> None:
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(src / rel):
            path = f"{rel}/{entry.name}"
            if entry.name == "__pycache__":
                continue
            if path in real_dirs:
                walk(path)
            elif path in EXISTING:
                shutil.copyfile(entry.path, dest / path)
            else:
                os.symlink(entry.path, dest / path)

    walk("sglang")
    return dest


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["upstream-patch", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def methods(path: Path, cls: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}


def body_without_docstring(fn: ast.FunctionDef) -> list[str]:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.dump(s) for s in body]


# ------------------------------------------------------------ every release
@pytest.mark.parametrize("root", RELEASES)
def test_the_patch_applies_with_patch_p1_to_a_fresh_copy(root, tmp_path):
    patch = generate(root)
    tree = copy_sources(root, tmp_path)
    done = patch_p1(patch, tree)
    assert done.returncode == 0, done.stdout + done.stderr
    for rel in (MODULE_PATH, *EXISTING):
        assert f"patching file {rel}" in done.stdout
        compile((tree / rel).read_text(), rel, "exec")
    assert "offset" not in done.stdout and "fuzz" not in done.stdout, done.stdout
    assert (tree / MODULE_PATH).read_text() == composer.compose()


@pytest.mark.parametrize("root", RELEASES)
def test_the_original_bodies_survive_renamed_and_the_methods_route_through_the_module(
    root, tmp_path
):
    tree = copy_sources(root, tmp_path)
    assert patch_p1(generate(root), tree).returncode == 0
    before = methods(root / CACHE_PATH, "UnifiedRadixCache")
    after = methods(tree / CACHE_PATH, "UnifiedRadixCache")
    assert set(after) == set(before) | set(RENAMED.values())
    for name, impl in RENAMED.items():
        assert body_without_docstring(after[impl]) == body_without_docstring(before[name])
    for name in set(before) - set(RENAMED):
        assert ast.dump(after[name]) == ast.dump(before[name]), name
    check = ast.unparse(after["check_hicache_events"])
    assert "pipelined_check_hicache_events(get_ack_sync_state(self, UnifiedRadixCache)" in check
    assert "agreed_ready_counts(state_of(self)" in ast.unparse(after["_sync_hicache_ready_counts"])


@pytest.mark.parametrize("root", RELEASES)
def test_the_settings_are_declared_in_envs_and_nothing_else_changes(root, tmp_path):
    tree = copy_sources(root, tmp_path)
    assert patch_p1(generate(root), tree).returncode == 0

    def fields(path: Path) -> dict[str, str]:
        (envs,) = [n for n in ast.parse(path.read_text()).body if getattr(n, "name", "") == "Envs"]
        return {
            t.id: ast.unparse(n.value)
            for n in envs.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }

    before, after = fields(root / ENVIRON_PATH), fields(tree / ENVIRON_PATH)
    assert after == {**before, ENABLE_VAR: "EnvBool(True)", DEPTH_VAR: "EnvStr('1')"}


# ------------------------------------------------------------ the text
@pytest.fixture(scope="module")
def patch_text() -> str:
    return generate(installed_root())


def test_the_patch_reads_as_sglang_code(patch_text):
    added = [line[1:] for line in patch_text.splitlines() if line.startswith("+")]
    named = [line for line in added if composer.FORBIDDEN.search(line)]
    assert named == []
    module = composer.compose()
    assert "logger = logging.getLogger(__name__)" in module
    assert f"envs.{ENABLE_VAR}.get()" in module and f"envs.{DEPTH_VAR}.get()" in module
    assert "os.environ" not in module and "getenv" not in module
    assert patch_text.startswith(f"diff --git a/{MODULE_PATH} b/{MODULE_PATH}\nnew file mode")


def test_the_repo_stores_none_of_sglangs_text():
    """The generator's sources hold no line of the methods it edits."""
    source = (installed_root() / CACHE_PATH).read_text()
    lines = source.splitlines()
    upstream = set()
    for fn in methods(installed_root() / CACHE_PATH, "UnifiedRadixCache").values():
        if fn.name in RENAMED:
            upstream |= {
                s.strip() for s in lines[fn.lineno : fn.end_lineno] if len(s.strip()) >= 30
            }
    assert len(upstream) > 10  # the check has something to look for
    ours = [*(REPO / "python/hicache_async_ack/tools/intree").glob("*.py")]
    ours += [REPO / "python/hicache_async_ack/tools/upstream_patch.py"]
    ours += [p for p in [REPO / "docs/upstream-patch.md"] if p.exists()]
    for path in ours:
        text = path.read_text()
        assert not [line for line in upstream if line in text], path


@pytest.mark.parametrize("form", ["default", "root", "package"])
def test_the_cli_writes_the_patch_to_stdout(capsys, patch_text, form):
    args = {
        "default": [],
        "root": ["--sglang-src", str(installed_root())],
        "package": ["--sglang-src", str(installed_root() / "sglang")],
    }[form]
    assert run_cli(capsys, *args) == (0, patch_text, "")


# ------------------------------------------------------------ loud failures
def _hunk_with(patch: str, path: str, needle: str) -> unidiff.Hunk:
    (f,) = [f for f in unidiff.parse(patch) if f.path == path]
    return next(h for h in f.hunks if any(needle in line for line in h.old))


def test_check_says_the_patch_applies_to_an_unchanged_copy(capsys, tmp_path):
    copy_sources(installed_root(), tmp_path)
    rc, out, err = run_cli(capsys, "--check", str(tmp_path))
    assert (rc, err) == (0, "") and "applies to" in out and "(3 files)" in out


def test_a_patch_that_no_longer_applies_names_the_hunk(capsys, tmp_path, patch_text):
    """A release whose _sync_hicache_ready_counts changed next to its def line."""
    hunk = _hunk_with(patch_text, CACHE_PATH, "def _sync_hicache_ready_counts(")
    copy_sources(installed_root(), tmp_path)
    target = tmp_path / CACHE_PATH
    lines = target.read_text().splitlines()
    at = next(i for i in range(len(lines)) if lines[i : i + len(hunk.old)] == hunk.old)
    middle = at + len(hunk.old) // 2  # inside the hunk, not at its edge
    lines[middle] += "  # moved"
    target.write_text("\n".join(lines) + "\n")
    rc, out, err = run_cli(capsys, "--check", str(tmp_path))
    assert rc == 1 and out == ""
    assert f"{CACHE_PATH}: hunk #{hunk.number} does not apply ({hunk.header})" in err
    assert f"line {middle + 1} should read" in err and "# moved" in err
    # GNU patch, which the README tells to use, fails on the same hunk
    for fuzz in ("--fuzz=0", "--fuzz=2"):
        dry = patch_p1(patch_text, tmp_path, "--dry-run", fuzz)
        assert dry.returncode != 0 and f"Hunk #{hunk.number} FAILED" in dry.stdout, dry.stdout


@pytest.mark.parametrize(
    "path, old, new, message",
    [
        (
            CACHE_PATH,
            "def _sync_hicache_ready_counts(",
            "def _sync_ready_counts(",
            "UnifiedRadixCache._sync_hicache_ready_counts() not found",
        ),
        (
            CACHE_PATH,
            "def writing_check(",
            "def writing_check_v2(",
            "does not have what the ack sync calls: writing_check() is missing",
        ),
        (ENVIRON_PATH, "class Envs:", "class Environment:", "no top-level class Envs"),
        (ENVIRON_PATH, "class EnvStr(", "class EnvText(", "no class EnvStr"),
    ],
    ids=["sync-renamed", "writing_check-renamed", "no-Envs", "no-EnvStr"],
)
def test_a_source_without_an_anchor_fails_naming_it(capsys, tmp_path, path, old, new, message):
    copy_sources(installed_root(), tmp_path)
    target = tmp_path / path
    assert old in target.read_text()
    target.write_text(target.read_text().replace(old, new))
    rc, out, err = run_cli(capsys, "--sglang-src", str(tmp_path))
    assert rc == 1 and out == ""
    assert message in err


def test_an_already_patched_tree_is_refused(capsys, tmp_path, patch_text):
    copy_sources(installed_root(), tmp_path)
    assert patch_p1(patch_text, tmp_path).returncode == 0
    rc, _, err = run_cli(capsys, "--sglang-src", str(tmp_path))
    assert rc == 1 and "already patched" in err


# ------------------------------------------------------------ the patched tree runs
@pytest.fixture(scope="module", params=RELEASES)
def patched_tree(request, tmp_path_factory) -> Path:
    """Each release's SGLang, patched with the patch generated from it."""
    root = request.param
    tree = mirror(root, tmp_path_factory.mktemp("patched-sglang"))
    done = patch_p1(generate(root), tree)
    assert done.returncode == 0, done.stdout + done.stderr
    return tree


@pytest.fixture(scope="module")
def intree_env(patched_tree) -> dict[str, str]:
    """A fresh interpreter's environment: the patched tree first on the path,
    the plugin excluded, no SGLANG_ settings from this process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    path = [str(patched_tree)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), **{PLUGINS_VAR: EXCLUDED})
    return env


def test_the_in_tree_unit_checks_pass_on_the_patched_tree(intree_env):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test/intree_checks.py"],
        cwd=REPO,
        env=intree_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 10, tail


PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as C
from hicache_async_ack.sglang_plugin import is_hooked
names = ("init_hicache", "check_hicache_events", "_sync_hicache_ready_counts")
print("HOOKED", [is_hooked(getattr(C, n)) for n in names], C.__module__)
"""


@pytest.mark.parametrize("untested", ["0", "1"])
def test_the_plugin_installed_next_to_a_patched_tree_stands_down(intree_env, untested):
    """Not excluded by SGLANG_PLUGINS, the plugin must not wrap the in-tree
    step a second time (two reduces per step, one agreement shadowing the other),
    even where an operator allowed untested SGLang releases."""
    env = {k: v for k, v in intree_env.items() if k != PLUGINS_VAR}
    env[ALLOW_UNTESTED_VAR] = untested
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HOOKED [False, False, False]" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "carries the pipelined ack sync itself" in done.stdout


LIFECYCLE = dict(max_delay=3, skew=True, storage=True, extra_pools=["mamba"], event_p=0.08)
SPECS = [
    dict(name="pipelined", seed=11, steps=200, max_delay=3, skew=True),
    dict(name="blocking", seed=11, steps=200, max_delay=3, skew=True, env=OFF),
    dict(name="pipelined_storage", seed=12, steps=200, storage=True, extra_pools=["mamba"]),
    dict(name="blocking_storage", seed=12, steps=200, storage=True, extra_pools=["mamba"], env=OFF),
    dict(name="pipelined_depth2", seed=11, steps=200, max_delay=3, skew=True, env={DEPTH_VAR: "2"}),
    dict(LIFECYCLE, name="lifecycle_depth1", seed=101, steps=1500),
    dict(LIFECYCLE, name="lifecycle_depth2", seed=102, steps=1000, env={DEPTH_VAR: "2"}),
    dict(LIFECYCLE, name="lifecycle_auto", seed=103, steps=300, env={DEPTH_VAR: "auto"}),
    dict(
        name="other_depth",
        seed=2,
        steps=60,
        fresh_group=True,
        expect_error=True,
        rank_env={"1": {DEPTH_VAR: "2"}},
    ),
    dict(name="control_after", seed=4, steps=60, fresh_group=True),
]
STOCK_RANK = 3


@pytest.fixture(scope="module")
def gloo(intree_env):
    """One launcher on the patched tree: the scenarios, then a rank set where
    one rank opts out (it runs upstream's blocking reduce)."""
    jobs = [
        scenario_job(WORLD, SPECS, timeout=900, group_timeout=30),
        scenario_job(
            WORLD,
            [dict(name="stock_peer", seed=5, steps=60, expect_error=True)],
            timeout=300,
            group_timeout=30,
            rank_env={STOCK_RANK: OFF},
        ),
    ]
    for job in jobs:
        job.payload["in_tree"] = True
    out = run_fresh(jobs, env=intree_env)
    for r in out:
        if isinstance(r, Exception):
            raise AssertionError(str(r))
    return {"main": out[0], "stock": out[1]}


@pytest.mark.parametrize(
    "name, pipelined",
    [
        ("pipelined", True),
        ("blocking", False),
        ("pipelined_storage", True),
        ("blocking_storage", False),
        ("pipelined_depth2", True),
        ("control_after", True),
    ],
)
def test_symmetric_pops_nothing_left_on_the_patched_tree(gloo, name, pipelined):
    r0 = assert_symmetric_and_complete(gloo["main"], name)
    assert r0["pipelined"] is pipelined, r0["reason"]
    if not pipelined:
        assert r0["reason"] == f"{ENABLE_VAR}=0"


@pytest.mark.parametrize(
    "pipelined, blocking, k",
    [
        ("pipelined", "blocking", 1),
        ("pipelined_storage", "blocking_storage", 1),
        ("pipelined_depth2", "blocking", 2),
    ],
)
def test_pipelined_pops_what_blocking_popped_k_steps_earlier(gloo, pipelined, blocking, k):
    main = gloo["main"][0]
    assert_lagged_equal(main[pipelined]["pops"], main[blocking]["pops"], k)


@pytest.mark.parametrize("name", ["lifecycle_depth1", "lifecycle_depth2", "lifecycle_auto"])
def test_lifecycle_on_the_patched_tree(gloo, name):
    """Write-back flushes, resets, storage detach/attach, blocking drains at
    random steps. Storage entries drained locally by a detach are best-effort
    per rank (upstream's design), so in those steps only acks are compared."""
    for per in gloo["main"]:
        for step, ev in zip(per[name]["pops"], per[name]["events"]):
            if ev in LOCAL_DRAIN_EVENTS:
                step[0] = [p for p in step[0] if p[0] in ACK_KINDS]
    r0 = assert_symmetric_and_complete(gloo["main"], name)
    assert r0["pipelined"]
    for ev in ("write_back_flush", "reset", "detach", "attach", "loading_check"):
        assert r0["counts"]["events"].get(ev, 0) > 0, (ev, r0["counts"]["events"])


def test_ranks_that_disagree_stop_loudly_before_any_pop(gloo):
    for rank, per in enumerate(gloo["main"]):
        r = per["other_depth"]
        err = r.get("error", "")
        assert "HiCacheAckSyncMismatch" in err and "the lag depth differs" in err, (rank, err)
        assert f"this rank {2 if rank == 1 else 1}," in err and DEPTH_VAR in err
        assert [p for pre, post in r["pops"] for p in pre + post] == []
        assert r.get("popped_in_failed_step") == []


def test_an_opted_out_peer_trips_upstreams_check_and_stops_the_others(gloo):
    for rank, per in enumerate(gloo["stock"]):
        r = per["stock_peer"]
        err = r.get("error", "")
        if rank == STOCK_RANK:
            assert not r["pipelined"] and "duplicate-reclaim victims diverged" in err, err
        else:
            assert "ran SGLang's blocking ack sync" in err and ENABLE_VAR in err, (rank, err)
        assert [p for pre, post in r["pops"] for p in pre + post] == [], rank
