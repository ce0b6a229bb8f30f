"""``hicache-async-ack upstream-patch``: the ack sync as a patch to SGLang itself.

Writes to stdout a unified diff against the installed SGLang (or
``--sglang-src``), paths relative to the directory holding ``sglang/``
(``a/sglang/srt/...``), so ``patch -p1 -d <that directory>`` applies it. It
adds ``sglang/srt/mem_cache/hicache_ack_sync.py`` (composed from this
package's core, settings parsing and SGLang-side step, plus the in-tree glue),
routes ``UnifiedRadixCache.check_hicache_events`` and
``_sync_hicache_ready_counts`` through it, and declares the two settings in
``sglang/srt/environ.py``. Nothing of SGLang's text is stored here: the diff is
computed from the source it is run against. ``--check DIR`` says whether that
diff applies to another tree, naming each hunk that does not. docs/upstream-patch.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Optional

from .intree import unidiff
from .intree.edits import CACHE_PATH, ENVIRON_PATH, edit_cache, edit_environ
from .intree.module import MODULE_PATH, compose
from .options import ToolError

SUMMARY = "write the in-tree form (a patch to SGLang) to stdout"
DESCRIPTION = (
    "Write to stdout a unified diff that puts the pipelined HiCache ack sync into "
    "SGLang itself: a new module sglang/srt/mem_cache/hicache_ack_sync.py, "
    "UnifiedRadixCache.check_hicache_events routed through it, and the two settings "
    "declared in sglang/srt/environ.py. Computed from the installed SGLang (or "
    "--sglang-src); apply with: patch -p1 -d <directory holding sglang/>."
)


def installed_root() -> Path:
    """The directory holding the installed ``sglang`` package (not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ToolError("SGLang is not installed here; pass --sglang-src DIR")
    return Path(list(spec.submodule_search_locations)[0]).parent


def source_root(path: Optional[str]) -> Path:
    """The directory holding ``sglang/``: DIR itself, DIR's parent when DIR is
    the package, or DIR/python in a checkout of the SGLang repository."""
    if path is None:
        return installed_root()
    d = Path(path).expanduser().resolve()
    for root in (d, d.parent, d / "python"):
        if (root / CACHE_PATH).is_file():
            return root
    raise ToolError(f"{path}: no {CACHE_PATH} in it, its parent or its python/ folder")


def _read(root: Path, rel: str) -> str:
    try:
        return (root / rel).read_text()
    except OSError as exc:
        raise ToolError(f"cannot read {root / rel}: {exc.strerror}") from exc


def new_texts(root: Path) -> dict[str, tuple[Optional[str], str]]:
    """path -> (old text or None, new text), for every file the patch touches."""
    module = compose()
    cache = _read(root, CACHE_PATH)
    environ = _read(root, ENVIRON_PATH)
    return {
        MODULE_PATH: (None, module),
        CACHE_PATH: (cache, edit_cache(cache, module)),
        ENVIRON_PATH: (environ, edit_environ(environ)),
    }


def generate(root: Path) -> str:
    """The patch against the SGLang source under ``root``."""
    return "".join(unidiff.file_diff(p, old, new) for p, (old, new) in new_texts(root).items())


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
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    root = source_root(args.sglang_src)
    patch = generate(root)
    if args.check is None:
        sys.stdout.write(patch)
        return 0
    target = source_root(args.check)
    changed = unidiff.apply(patch, target)  # raises PatchDoesNotApply, a ToolError
    print(f"the patch from {root} applies to {target} ({len(changed)} files)")
    return 0
