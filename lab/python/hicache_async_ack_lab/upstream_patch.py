"""``hicache-async-ack-lab upstream-patch``: the ack sync as a patch to SGLang itself.

Writes to stdout a unified diff against the installed SGLang (or
``--sglang-src``) that adds ``sglang/srt/mem_cache/unified_cache/hicache_ack_sync.py`` (a
small helper created in ``init_hicache``), uses it in
``UnifiedRadixCache.check_hicache_events``, declares the two settings in the
radix-cache section of ``sglang/srt/environ.py``, and adds SGLang-layout tests
under ``test/registered/unit/mem_cache/``. Against a checkout of SGLang's
repository, paths are the repository's (``python/sglang/...``, ``test/...``)
and the environment-variable reference is updated too; against an installed
SGLang, paths are relative to the directory holding ``sglang/``. Either way
``patch -p1 -d <that directory>`` applies it. Nothing of SGLang's text is
stored here: the diff is computed from the source it is run against.
``--check DIR`` says whether that diff applies to another tree, naming each
hunk that does not. docs/upstream-patch.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hicache_async_ack_lab.cli_support import ToolError
from hicache_async_ack_lab.intree import unidiff
from hicache_async_ack_lab.intree.doc_edit import DOC_PATH, edit_doc
from hicache_async_ack_lab.intree.edits import CACHE_PATH, ENVIRON_PATH, edit_cache, edit_environ
from hicache_async_ack_lab.intree.module import MODULE_PATH, TEST_PATHS, read

SUMMARY = "write the in-tree form (a patch to SGLang) to stdout"
DESCRIPTION = (
    "Write to stdout a unified diff that puts the pipelined HiCache ack sync into "
    "SGLang itself: a new helper sglang/srt/mem_cache/unified_cache/hicache_ack_sync.py used by "
    "UnifiedRadixCache.check_hicache_events, the two settings in "
    "sglang/srt/environ.py, and SGLang-layout tests. Computed from the installed "
    "SGLang (or --sglang-src); apply with: patch -p1 -d <directory holding sglang/> "
    "(or the repository's root for a checkout)."
)


@dataclass(frozen=True)
class Tree:
    """An SGLang source: ``root`` is what the patch's paths are relative to;
    ``package`` holds ``sglang/``; a checkout has them differ (``python/``)."""

    root: Path
    package: Path

    @property
    def prefix(self) -> str:
        return "" if self.root == self.package else f"{self.package.relative_to(self.root)}/"


def installed_root() -> Path:
    """The directory holding the installed ``sglang`` package (not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ToolError("SGLang is not installed here; pass --sglang-src DIR")
    return Path(list(spec.submodule_search_locations)[0]).parent


def source_root(path: Optional[str]) -> Tree:
    """The SGLang source at ``path``: the directory holding ``sglang/``, the
    ``sglang`` package itself, or a checkout of the repository (``python/``
    under it); the installed SGLang when None."""
    if path is None:
        root = installed_root()
        return Tree(root, root)
    d = Path(path).expanduser().resolve()
    if (d / "python" / CACHE_PATH).is_file():
        return Tree(d, d / "python")
    for root in (d, d.parent):
        if (root / CACHE_PATH).is_file():
            return Tree(root, root)
    raise ToolError(f"{path}: no {CACHE_PATH} in it, its parent or its python/ folder")


def _read(root: Path, rel: str) -> str:
    try:
        return (root / rel).read_text()
    except OSError as exc:
        raise ToolError(f"cannot read {root / rel}: {exc.strerror}") from exc


def new_texts(tree: Tree, tests: bool = True) -> dict[str, tuple[Optional[str], str]]:
    """path in the patch -> (old text or None, new text), for every file it touches."""
    cache = _read(tree.package, CACHE_PATH)
    environ = _read(tree.package, ENVIRON_PATH)
    p = tree.prefix
    out: dict[str, tuple[Optional[str], str]] = {
        p + MODULE_PATH: (None, read(MODULE_PATH)),
        p + CACHE_PATH: (cache, edit_cache(cache)),
        p + ENVIRON_PATH: (environ, edit_environ(environ)),
    }
    doc = tree.root / DOC_PATH
    if p and doc.is_file():  # a checkout: the reference doc lives at its root
        text = _read(tree.root, DOC_PATH)
        out[DOC_PATH] = (text, edit_doc(text))
    if tests:
        # SGLang's own tests are left as they are: those that build the cache
        # without __init__ get ack_sync from its class default (edits.py).
        out.update({rel: (None, read(rel)) for rel in TEST_PATHS})
    return out


def generate(tree: Tree | Path, tests: bool = True) -> str:
    """The patch against the SGLang source ``tree`` (a Path: the directory
    holding ``sglang/``)."""
    if isinstance(tree, Path):
        tree = Tree(tree, tree)
    texts = new_texts(tree, tests)
    return "".join(unidiff.file_diff(path, old, new) for path, (old, new) in texts.items())


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("upstream-patch", help=SUMMARY, description=DESCRIPTION)
    p.add_argument(
        "--sglang-src",
        metavar="DIR",
        help="the SGLang source to diff against: the directory holding sglang/, the "
        "sglang package itself, or a checkout of the repository (default: the "
        "installed SGLang)",
    )
    p.add_argument(
        "--check",
        metavar="DIR",
        help="instead of printing the patch, check that it applies to the SGLang tree "
        "at DIR (same forms as --sglang-src); names each hunk that does not",
    )
    p.add_argument(
        "--no-tests",
        action="store_true",
        help="leave out the tests (against an installed SGLang they would land in a "
        "test/ folder next to sglang/)",
    )
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    tree = source_root(args.sglang_src)
    patch = generate(tree, tests=not args.no_tests)
    if args.check is None:
        sys.stdout.write(patch)
        return 0
    target = source_root(args.check)
    if target.prefix != tree.prefix:
        raise ToolError(
            f"{args.check} is laid out differently from {tree.root} (a checkout and an "
            "installed SGLang): generate the patch from the same kind of tree"
        )
    changed = unidiff.apply(patch, target.root)  # raises PatchDoesNotApply, a ToolError
    print(f"the patch from {tree.root} applies to {target.root} ({len(changed)} files)")
    return 0
