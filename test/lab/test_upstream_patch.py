"""``hicache-async-ack-lab upstream-patch``: the in-tree form, proven by the same suites.

For every SGLang release whose source is here (the installed one; the
per-release test overlays of tools/releases.py when present) the patch generated
from it applies with ``patch -p1`` to a fresh copy, adds at most MAX_ADDED lines
under ``sglang/srt/``, and leaves black and isort (SGLang's pinned versions and
settings) with nothing new to say. The patched tree then runs, with the plugin
excluded by SGLANG_PLUGINS: the tests the patch adds (SGLang's layout, SGLang's
way), the checks SGLang's own PP unit test makes (intree_checks.py), and the
real-gloo scenarios at TP=4 (symmetric pops, nothing left, pipelined pops equal
to blocking pops k steps earlier, lifecycle runs, ranks that disagree stopping
before any pop), whose pops must equal the plugin's in the same scenarios.
A patch that no longer applies names the hunk; a source the generator cannot
find its anchors in names the anchor.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import black
import isort
import pytest

from hicache_async_ack.env import ALLOW_UNTESTED_VAR, DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR
from hicache_async_ack_lab import cli
from hicache_async_ack_lab.intree import module as files
from hicache_async_ack_lab.intree import unidiff
from hicache_async_ack_lab.intree.doc_edit import DOC_PATH
from hicache_async_ack_lab.intree.edits import CACHE_PATH, CLASS_DEFAULT, ENVIRON_PATH
from hicache_async_ack_lab.releases import cache_root
from hicache_async_ack_lab.testing.scenarios import ACK_KINDS, LOCAL_DRAIN_EVENTS
from hicache_async_ack_lab.upstream_patch import Tree, generate, installed_root

from support.checks import assert_lagged_equal, assert_symmetric_and_complete
from support.gloo_ranks import run_fresh, scenario_job

REPO = Path(__file__).resolve().parents[2]
MODULE_PATH = files.MODULE_PATH
EXISTING = (CACHE_PATH, ENVIRON_PATH)
EDITED_METHODS = ("__init__", "init_hicache", "_sync_hicache_ready_counts", "check_hicache_events")
NEW_METHODS = {"_hicache_ready_queues", "_local_hicache_ready_counts"}
MAX_ADDED = 300  # lines under sglang/srt/, tests not counted (issue 18)
WORLD = 4
OFF = {ENABLE_VAR: "0"}
EXCLUDED = "some_other_plugin"  # an SGLANG_PLUGINS list without us
# Words of the plugin that SGLang's code has no use for.
FORBIDDEN = re.compile(r"hicache_async_ack|hicache-async-ack|[Pp]lugin|[Uu]pstream|protocol")


def _version(root: Path) -> str:
    """The release installed under ``root`` (its dist-info; sglang/version.py
    may hold a placeholder), or the folder's name."""
    infos = sorted(root.glob("sglang-*.dist-info"))
    return infos[0].name[len("sglang-") : -len(".dist-info")] if infos else root.name


def release_roots(soak_overlays: bool = False) -> list:
    """Directories holding an ``sglang/`` to patch: the installed release first,
    then each per-release test overlay present (tools/releases.py makes them);
    ``soak_overlays``: the overlays' params marked soak."""
    installed = installed_root()
    found = {_version(installed): installed}
    overlays = cache_root() / "sglang-overlays"
    for hit in sorted(overlays.glob(f"*/{CACHE_PATH}")):
        root = hit.parents[3]
        found.setdefault(_version(root), root)
    soak = pytest.mark.soak if soak_overlays else ()
    return [
        pytest.param(root, id=v, marks=() if root == installed else soak)
        for v, root in found.items()
    ]


RELEASES = release_roots()
# The patched tree's runs (minutes of gloo ranks per release) on the overlays are soak
# (-m soak): the installed release's run every path the patch adds; the static checks
# above run on every release.
RUN_RELEASES = release_roots(soak_overlays=True)


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


def class_level(path: Path, cls: str = "UnifiedRadixCache") -> list[str]:
    """The statements of the class body that are not methods, in order."""
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return [ast.unparse(n) for n in node.body if not isinstance(n, ast.FunctionDef)]


def added_lines(patch: str) -> dict[str, int]:
    """Lines the patch adds, per file."""
    out: Counter = Counter()
    for f in unidiff.parse(patch):
        out[f.path] += sum(len(h.new) - len(h.old) for h in f.hunks)
    return dict(out)


def findings(text: str) -> Counter:
    """What SGLang's pinned black and isort (its .isort.cfg: profile black,
    sglang first-party) would change in ``text``: the lines they remove and add."""
    out: Counter = Counter()
    isorted = isort.code(text, profile="black", known_first_party=["sglang"])
    for tool, new in (("isort", isorted), ("black", black.format_str(text, mode=black.Mode()))):
        for line in difflib.unified_diff(text.splitlines(), new.splitlines(), lineterm="", n=0):
            if line[:1] in "+-" and line[:3] not in ("+++", "---"):
                out[(tool, line)] += 1
    return out


# ------------------------------------------------------------ every release
@pytest.mark.parametrize("root", RELEASES)
def test_the_patch_applies_is_small_and_is_formatted_at_sglangs_settings(root, tmp_path):
    patch = generate(root)
    tree = copy_sources(root, tmp_path)
    done = patch_p1(patch, tree)
    assert done.returncode == 0, done.stdout + done.stderr
    new = [MODULE_PATH, *files.TEST_PATHS]
    for rel in (*new, *EXISTING):
        assert f"patching file {rel}" in done.stdout
        compile((tree / rel).read_text(), rel, "exec")
    assert "offset" not in done.stdout and "fuzz" not in done.stdout, done.stdout
    added = added_lines(patch)
    under_srt = sum(n for path, n in added.items() if path.startswith("sglang/srt/"))
    assert under_srt <= MAX_ADDED, added
    for rel in new:
        assert findings((tree / rel).read_text()) == Counter(), rel
    for rel in EXISTING:  # SGLang's wheels are formatted by later versions
        assert findings((tree / rel).read_text()) == findings((root / rel).read_text()), rel


@pytest.mark.parametrize("root", RELEASES)
def test_four_methods_change_and_the_counting_exists_once(root, tmp_path):
    """__init__ and init_hicache gain one statement each; the blocking sync is
    split into the local counts (over the one queue list) and the reduce of
    them, unchanged; the module counts by calling those, never by itself."""
    tree = copy_sources(root, tmp_path)
    assert patch_p1(generate(root), tree).returncode == 0
    before = methods(root / CACHE_PATH, "UnifiedRadixCache")
    after = methods(tree / CACHE_PATH, "UnifiedRadixCache")
    assert set(after) == set(before) | NEW_METHODS
    for name in set(before) - set(EDITED_METHODS):
        assert ast.dump(after[name]) == ast.dump(before[name]), name

    def dumps(body: list) -> list[str]:
        return [ast.dump(s) for s in body]

    assert class_level(tree / CACHE_PATH) == [
        *class_level(root / CACHE_PATH),
        "ack_sync: Optional[HiCacheAckSync] = None",
    ]
    init, new_init = before["__init__"].body, after["__init__"].body
    added = [ast.unparse(s) for s in new_init if ast.dump(s) not in dumps(init)]
    assert added == ["self.ack_sync: Optional[HiCacheAckSync] = None"]
    assert len(new_init) == len(init) + 1
    hicache = after["init_hicache"].body
    assert dumps(hicache[:-1]) == dumps(before["init_hicache"].body)
    assert ast.unparse(hicache[-1]) == (
        "self.ack_sync = HiCacheAckSync.create(self, server_args.disaggregation_mode)"
    )
    # The blocking sync: the local counts, then its own statements from the reduce on.
    old = before["_sync_hicache_ready_counts"].body
    local, sync = (
        after["_local_hicache_ready_counts"].body,
        after["_sync_hicache_ready_counts"].body,
    )
    assert ast.unparse(sync[0]) == (
        "write_acks, load_acks, storage_queue_sizes, extra_pool_names = "
        "self._local_hicache_ready_counts()"
    )
    assert dumps(sync[1:]) == dumps(old[len(local) - 2 :])
    assert dumps(local[1:-2]) == dumps(old[: len(local) - 3])  # docstring, ..., if, return
    assert "self._hicache_ready_queues()" in ast.unparse(local[-2].orelse)
    assert "qsize" in ast.unparse(after["_hicache_ready_queues"]) + ast.unparse(local[-2])
    check = ast.unparse(after["check_hicache_events"])
    assert (
        " = self._sync_hicache_ready_counts() if self.ack_sync is None "
        "else self.ack_sync.agreed_counts()" in check
    )
    assert "if self.ack_sync is not None:\n        self.ack_sync.issue()" in check
    module = files.compose()
    assert "cache._local_hicache_ready_counts()" in module
    assert "cache._hicache_ready_queues()" in module
    for counting in ("qsize", "_count_ready_acks", "ack_write_queue", "prefetch_hit_queue"):
        assert counting not in module, counting


# What check_hicache_events runs: the stock step, and the patched one with the
# two methods the split adds.
STEP = ("check_hicache_events", "_sync_hicache_ready_counts")
PATCHED_STEP = (*STEP, *NEW_METHODS)


def reads(path: Path, names: tuple) -> tuple[set, set]:
    """(attributes of self, attributes of the cache controller) that the methods
    ``names`` of UnifiedRadixCache read."""
    fns = methods(path, "UnifiedRadixCache")
    own, controller = set(), set()
    for name in names:
        for n in ast.walk(fns[name]):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                base = ast.unparse(n.value)
                if base == "self":
                    own.add(n.attr)
                elif base in ("cc", "self.cache_controller"):
                    controller.add(n.attr)
    return own, controller


def hand_built_gaps(stock: Path, patched: Path) -> list[str]:
    """What the patched step reads that a cache built by hand for the stock step
    (object.__new__, then what the stock step reads) may lack: attributes of
    self or of its controller the stock step does not read and the class does
    not define (a method, or a default in its body)."""
    (own, controller), (old_own, old_controller) = (
        reads(patched, PATCHED_STEP),
        reads(stock, STEP),
    )
    tree = ast.parse(patched.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "UnifiedRadixCache"]
    defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    defined |= {
        t.id
        for n in cls.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    gaps = sorted(own - old_own - defined)
    return gaps + sorted(f"cache_controller.{a}" for a in controller - old_controller)


def without_class_default(text: str) -> str:
    """The patched cache as the patch before issue 35 left it: ack_sync set by
    __init__ alone."""
    block = textwrap.indent(CLASS_DEFAULT, "    ") + "\n"
    assert text.count(block) == 1, "the class default is not where the patch puts it"
    return text.replace(block, "")


@pytest.mark.parametrize("root", RELEASES)
def test_what_the_patched_step_reads_a_hand_built_cache_has(root, tmp_path):
    """Issue 35: SGLang's unit tests build the cache with object.__new__ and set
    what the stock step reads (test_hiradix_pp_sync_drain.py). The patched step
    reads nothing more, but for what the class itself defines: the two new
    methods and ack_sync's default. Negative control: without the class
    default, ack_sync is the gap (what failed SGLang's TestUnifiedPPSyncBatching)."""
    tree = copy_sources(root, tmp_path)
    assert patch_p1(generate(root), tree).returncode == 0
    own, _ = reads(tree / CACHE_PATH, PATCHED_STEP)
    assert {"ack_sync", *NEW_METHODS} <= own  # the reads are seen
    assert hand_built_gaps(root / CACHE_PATH, tree / CACHE_PATH) == []
    cache = tree / CACHE_PATH
    cache.write_text(without_class_default(cache.read_text()))
    assert hand_built_gaps(root / CACHE_PATH, cache) == ["ack_sync"]


@pytest.mark.parametrize("root", RELEASES)
def test_the_settings_are_declared_in_the_radix_cache_section(root, tmp_path):
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
    assert after == {**before, ENABLE_VAR: "EnvBool(True)", DEPTH_VAR: "EnvInt(1)"}
    text = (tree / ENVIRON_PATH).read_text()
    headers = [m.start() for m in re.finditer(r"# =+\n\s*# (.*)\n\s*# =+", text)]
    section = max(h for h in headers if h < text.index(ENABLE_VAR))
    assert "radix" in text[section : text.index("\n", text.index("\n", section) + 1)].lower()


# ------------------------------------------------------------ the text
@pytest.fixture(scope="module")
def patch_text() -> str:
    return generate(installed_root())


def test_the_patch_reads_as_sglang_code(patch_text):
    added = [line[1:] for line in patch_text.splitlines() if line.startswith("+")]
    hits = [line for line in added if FORBIDDEN.search(line)]
    assert [line for line in hits if files.PEER_PLUGIN not in line] == []
    assert len(hits) == 1  # the error naming a peer that runs the plugin
    module = files.compose()
    assert "logger = logging.getLogger(__name__)" in module
    assert "torch.distributed.all_reduce(" in module and "async_op=True" in module
    assert f"envs.{ENABLE_VAR}" in module and f"envs.{DEPTH_VAR}" in module
    assert patch_text.startswith(f"diff --git a/{MODULE_PATH} b/{MODULE_PATH}\nnew file mode")


def test_the_repo_stores_none_of_sglangs_text():
    """The generator's sources hold no line of the methods it edits."""
    source = (installed_root() / CACHE_PATH).read_text()
    lines = source.splitlines()
    upstream = set()
    for fn in methods(installed_root() / CACHE_PATH, "UnifiedRadixCache").values():
        if fn.name in EDITED_METHODS:
            upstream |= {
                s.strip() for s in lines[fn.lineno : fn.end_lineno] if len(s.strip()) >= 30
            }
    assert len(upstream) > 10  # the check has something to look for
    ours = [*(REPO / "lab/python/hicache_async_ack_lab/intree").rglob("*.py")]
    ours += [REPO / "lab/python/hicache_async_ack_lab/upstream_patch.py"]
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


def test_no_tests_leaves_the_tests_out(capsys, patch_text):
    rc, out, _ = run_cli(capsys, "--no-tests")
    assert rc == 0 and "test/registered" not in out and out in patch_text


# A test in a checkout shaped like SGLang's test_hiradix_pp_sync_drain.py: it
# builds the cache with object.__new__ and sets what the stock step reads. The
# patch leaves it as it is (the class default covers it).
OBJECT_NEW_TEST_PATH = "test/registered/unit/mem_cache/test_step_example.py"
OBJECT_NEW_TEST = """import unittest

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


class TestStep(unittest.TestCase):
    def _make_cache(self):
        cache = object.__new__(UnifiedRadixCache)
        cache.pp_rank = 0
        cache.linker = None
        cache.buffer_pipeline = None
        return cache

    def test_step(self):
        self._make_cache().check_hicache_events()
"""


def _checkout(tmp_path: Path, doc: str) -> Path:
    """A checkout of SGLang's repository: python/sglang/..., the env var doc and
    a test that builds the cache with object.__new__."""
    copy_sources(installed_root(), tmp_path / "python")
    (tmp_path / DOC_PATH).parent.mkdir(parents=True)
    (tmp_path / DOC_PATH).write_text(doc)
    (tmp_path / OBJECT_NEW_TEST_PATH).parent.mkdir(parents=True)
    (tmp_path / OBJECT_NEW_TEST_PATH).write_text(OBJECT_NEW_TEST)
    return tmp_path


DOC = """# Environment Variables

## Storage & Caching

| Environment Variable | Description | Default Value |
| --- | --- | --- |
| `SGLANG_HICACHE_EXAMPLE` | An example row | `0` |
| `SGLANG_OTHER_EXAMPLE` | Another row | `1` |

## Other

Text.
"""


def test_against_a_checkout_paths_are_the_repositorys_and_the_doc_is_updated(capsys, tmp_path):
    checkout = _checkout(tmp_path, DOC)
    patch = generate(Tree(checkout, checkout / "python"))
    paths = [f.path for f in unidiff.parse(patch)]
    assert paths == [
        f"python/{MODULE_PATH}",
        f"python/{CACHE_PATH}",
        f"python/{ENVIRON_PATH}",
        DOC_PATH,
        *files.TEST_PATHS,
    ]
    assert run_cli(capsys, "--sglang-src", str(checkout))[1] == patch
    rc, out, _ = run_cli(capsys, "--sglang-src", str(checkout), "--check", str(checkout))
    assert rc == 0 and "(6 files)" in out
    done = patch_p1(patch, checkout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (checkout / OBJECT_NEW_TEST_PATH).read_text() == OBJECT_NEW_TEST
    doc = (checkout / DOC_PATH).read_text().splitlines()
    at = doc.index("| `SGLANG_HICACHE_EXAMPLE` | An example row | `0` |")
    assert doc[at + 1].startswith(f"| `{ENABLE_VAR}` |") and doc[at + 1].endswith("| `true` |")
    assert doc[at + 2].startswith(f"| `{DEPTH_VAR}` |") and doc[at + 2].endswith("| `1` |")
    assert doc[at + 3] == "| `SGLANG_OTHER_EXAMPLE` | Another row | `1` |"


def test_a_doc_without_hicache_rows_gets_a_hicache_section(tmp_path):
    checkout = _checkout(tmp_path, "# Environment Variables\n\nText.\n")
    (new,) = [
        f
        for f in unidiff.parse(generate(Tree(checkout, checkout / "python")))
        if f.path == DOC_PATH
    ]
    added = [line for h in new.hunks for line in h.new[len(h.old) :]]
    assert added[:2] == ["", "## HiCache"] and added[-1].startswith(f"| `{DEPTH_VAR}` |")


# ------------------------------------------------------------ loud failures
def _hunk_with(patch: str, path: str, needle: str) -> unidiff.Hunk:
    (f,) = [f for f in unidiff.parse(patch) if f.path == path]
    return next(h for h in f.hunks if any(needle in line for line in h.old))


def test_check_says_the_patch_applies_to_an_unchanged_copy(capsys, tmp_path):
    copy_sources(installed_root(), tmp_path)
    rc, out, err = run_cli(capsys, "--check", str(tmp_path))
    assert (rc, err) == (0, "") and "applies to" in out and "(5 files)" in out


def test_a_patch_that_no_longer_applies_names_the_hunk(capsys, tmp_path, patch_text):
    """A release whose check_hicache_events changed next to the sync call."""
    hunk = _hunk_with(patch_text, CACHE_PATH, "self._sync_hicache_ready_counts()")
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
            "def init_hicache(",
            "def init_hierarchical_cache(",
            "UnifiedRadixCache.init_hicache() not found",
        ),
        (
            CACHE_PATH,
            ") = self._sync_hicache_ready_counts()",
            ") = self._sync_ready_counts()",
            "has 0 statements '... = self._sync_hicache_ready_counts()', not one",
        ),
        (ENVIRON_PATH, "class Envs:", "class Environment:", "no top-level class Envs"),
        (ENVIRON_PATH, "class EnvInt(", "class EnvInteger(", "no class EnvInt"),
        (ENVIRON_PATH, "# Radix and sparse KV caches", "# Sparse KV caches", "no radix-cache"),
    ],
    ids=["init-renamed", "sync-call-gone", "no-Envs", "no-EnvInt", "no-radix-section"],
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
@pytest.fixture(scope="module", params=RUN_RELEASES)
def release(request, tmp_path_factory) -> tuple[Path, Path]:
    """(each release's SGLang, that release patched with the patch generated from it)."""
    root = request.param
    tree = mirror(root, tmp_path_factory.mktemp("patched-sglang"))
    done = patch_p1(generate(root), tree)
    assert done.returncode == 0, done.stdout + done.stderr
    return root, tree


def _env(first: Path, exclude_plugin: bool) -> dict[str, str]:
    """A fresh interpreter's environment: ``first`` first on the path, no
    SGLANG_ settings from this process, the plugin excluded or not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    path = [str(first)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if exclude_plugin:
        env[PLUGINS_VAR] = EXCLUDED
    return env


@pytest.fixture(scope="module")
def intree_env(release) -> dict[str, str]:
    return _env(release[1], exclude_plugin=True)


PREPEND = "--import-mode=prepend"


def _pytest(env: dict[str, str], cwd: Path, *args: str) -> tuple[int, int, str]:
    """pytest in a fresh interpreter: (exit status, tests passed, output's tail)."""
    done = subprocess.run(
        # prepend, as SGLang's CI imports them: a spawned rank unpickles its target by
        # module name, and importlib mode (our pyproject's) names a file outside the
        # rootdir by its path ("tmp.pytest-of-root..."), which no child can import
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", PREPEND, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        # spawned gloo ranks each import SGLang: minutes on a busy 2-core box
        timeout=1800,
    )
    passed = re.search(r"(\d+) passed", done.stdout)
    tail = (done.stdout + done.stderr)[-6000:]
    return done.returncode, (int(passed.group(1)) if passed else 0), tail


def test_the_patchs_tests_and_sglangs_pp_checks_pass_on_the_patched_tree(release, intree_env):
    """The tests the patch adds, and what SGLang's own PP unit test checks
    (intree_checks.py), in one interpreter: SGLang's import dominates."""
    tests = [str(release[1] / rel) for rel in files.TEST_PATHS]
    rc, passed, tail = _pytest(intree_env, REPO, *tests, "test/support/intree_checks.py", "-rs")
    # the patch's 14 + 3; our 8, of which the two buffer_only ones skip on 0.5.20
    assert rc == 0 and passed >= 17 + 6, tail


def test_sglangs_fixture_shape_fails_on_the_patch_without_the_class_default(tmp_path):
    """Negative control for intree_checks.py's ``fixture`` cases: on the patch
    as it was before issue 35 (ack_sync set by __init__ alone), caches built
    as SGLang's test_hiradix_pp_sync_drain.py builds them stop with the
    AttributeError that failed both of its TestUnifiedPPSyncBatching tests."""
    root = installed_root()
    tree = mirror(root, tmp_path / "sglang")
    assert patch_p1(generate(root), tree).returncode == 0
    cache = tree / CACHE_PATH
    cache.write_text(without_class_default(cache.read_text()))
    env = _env(tree, exclude_plugin=True)
    args = ("test/support/intree_checks.py", "-k", "fixture", "-rf", "--tb=line")
    rc, passed, tail = _pytest(env, REPO, *args)
    failed = re.findall(r"^FAILED \S+\[fixture\]", tail, re.M)
    # each raised in the patched step itself (SGLang's file, not the fixture)
    why = r"unified_radix_cache\.py:\d+: AttributeError: .* no attribute 'ack_sync'$"
    assert rc == 1 and passed == 0 and len(failed) == 3, tail
    assert len(re.findall(why, tail, re.M)) == 3, tail


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
# The scenarios both forms run; their pops must be equal.
SHARED = [
    dict(name="pipelined", seed=11, steps=150, max_delay=3, skew=True),
    dict(name="pipelined_storage", seed=12, steps=150, storage=True, extra_pools=["mamba"]),
    dict(name="pipelined_depth2", seed=11, steps=150, max_delay=3, skew=True, env={DEPTH_VAR: "2"}),
    dict(LIFECYCLE, name="lifecycle_depth1", seed=101, steps=600),
    dict(LIFECYCLE, name="lifecycle_depth2", seed=102, steps=400, env={DEPTH_VAR: "2"}),
]
SPECS = [
    *SHARED,
    dict(name="blocking", seed=11, steps=150, max_delay=3, skew=True, env=OFF),
    dict(name="blocking_storage", seed=12, steps=150, storage=True, extra_pools=["mamba"], env=OFF),
    dict(
        name="other_depth",
        seed=2,
        steps=40,
        fresh_group=True,
        expect_error=True,
        rank_env={"1": {DEPTH_VAR: "2"}},
    ),
    dict(name="control_after", seed=4, steps=40, fresh_group=True),
]
STOCK_RANK = 3


@pytest.fixture(scope="module")
def gloo(release, intree_env):
    """The scenarios on the patched tree (one launcher: the suites, then a rank
    set where one rank has the switch off), then the shared ones on the same
    release through the plugin."""
    jobs = [
        scenario_job(WORLD, SPECS, timeout=900, group_timeout=30),
        scenario_job(
            WORLD,
            [dict(name="stock_peer", seed=5, steps=40, expect_error=True)],
            timeout=300,
            group_timeout=30,
            rank_env={STOCK_RANK: OFF},
        ),
    ]
    for job in jobs:
        job.payload["in_tree"] = True
    out = run_fresh(jobs, env=intree_env)
    (plugin,) = run_fresh(
        [scenario_job(WORLD, SHARED, timeout=900, group_timeout=30)],
        env=_env(release[0], exclude_plugin=False),
    )
    for r in [*out, plugin]:
        if isinstance(r, Exception):
            raise AssertionError(str(r))
    return {"main": out[0], "stock": out[1], "plugin": plugin}


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
    assert r0["pipelined"] is pipelined


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


def _without_local_drains(results: list[dict], name: str) -> None:
    """Storage entries drained locally by a detach are best-effort per rank
    (SGLang's design): in those steps only acks are compared."""
    for per in results:
        for step, ev in zip(per[name]["pops"], per[name]["events"]):
            if ev in LOCAL_DRAIN_EVENTS:
                step[0] = [p for p in step[0] if p[0] in ACK_KINDS]


@pytest.mark.parametrize("name", ["lifecycle_depth1", "lifecycle_depth2"])
def test_lifecycle_on_the_patched_tree(gloo, name):
    """Write-back flushes, resets, storage detach/attach, blocking drains at
    random steps."""
    _without_local_drains(gloo["main"], name)
    r0 = assert_symmetric_and_complete(gloo["main"], name)
    assert r0["pipelined"]
    for ev in ("write_back_flush", "reset", "detach", "attach", "loading_check"):
        assert r0["counts"]["events"].get(ev, 0) > 0, (ev, r0["counts"]["events"])


@pytest.mark.parametrize("name", [spec["name"] for spec in SHARED])
def test_the_plugin_and_the_patched_tree_pop_the_same_entries_at_the_same_steps(gloo, name):
    for results in (gloo["main"], gloo["plugin"]):
        _without_local_drains(results, name)
    for rank, (intree, plugin) in enumerate(zip(gloo["main"], gloo["plugin"])):
        assert "error" not in plugin[name], plugin[name].get("traceback")
        assert plugin[name]["pipelined"] and intree[name]["pipelined"]
        assert any(post for _, post in intree[name]["pops"]), "nothing popped"
        for step, (a, b) in enumerate(zip(intree[name]["pops"], plugin[name]["pops"])):
            assert a == b, f"rank {rank}, step {step}: in-tree popped {a}, the plugin {b}"
        assert len(intree[name]["pops"]) == len(plugin[name]["pops"])


def test_ranks_that_disagree_stop_loudly_before_any_pop(gloo):
    for rank, per in enumerate(gloo["main"]):
        r = per["other_depth"]
        err = r.get("error", "")
        assert "RuntimeError" in err and f"{DEPTH_VAR} differs across ranks" in err, (rank, err)
        assert f"{2 if rank == 1 else 1} here" in err
        assert [p for pre, post in r["pops"] for p in pre + post] == []
        assert r.get("popped_in_failed_step") == []


def test_a_peer_with_the_switch_off_trips_its_digest_check_and_stops_the_others(gloo):
    for rank, per in enumerate(gloo["stock"]):
        r = per["stock_peer"]
        err = r.get("error", "")
        if rank == STOCK_RANK:
            assert not r["pipelined"] and "duplicate-reclaim victims diverged" in err, err
        else:
            assert "ran the blocking all_reduce" in err and ENABLE_VAR in err, (rank, err)
        assert [p for pre, post in r["pops"] for p in pre + post] == [], rank


def test_a_plugin_node_beside_a_patched_tree_node_both_stop_naming_the_mix(
    release, intree_env, tmp_path
):
    """Issue 22 point 5 over real gloo on 127.0.0.1: one interpreter on the
    patched tree (plugin excluded), one on the same release with the plugin
    loaded, in one group. Each must stop before any pop, naming the other form
    (not a depth, a bare digest or a timeout)."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    envs = [intree_env, _env(release[0], exclude_plugin=False)]
    outs = [tmp_path / f"rank{rank}.json" for rank in range(len(envs))]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(len(envs))]
    module = "hicache_async_ack_lab.testing.mixed_node"
    procs = []
    try:
        for rank, env in enumerate(envs):
            with open(logs[rank], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            module,
                            str(rank),
                            "2",
                            str(store.port),
                            str(outs[rank]),
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        for proc in procs:
            proc.wait(timeout=600)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    missing = [out for out in outs if not out.exists()]  # two ranks, each writes one
    assert not missing, [log.read_text()[-3000:] for log in logs]
    in_tree, plugin = (json.loads(out.read_text()) for out in outs)
    assert (in_tree["form"], plugin["form"]) == ("in_tree", "plugin"), (in_tree, plugin)
    assert "a peer runs the hicache-async-ack plugin" in in_tree["error"], in_tree
    assert "a peer runs SGLang's in-tree ack sync (a patched tree)" in plugin["error"], plugin
    for r in (in_tree, plugin):
        assert r["popped"] == [], r
        assert "differs" not in r["error"] and "bare digest" not in r["error"], r
        assert "imed out" not in r["error"] and "Connection" not in r["error"], r
