"""The files the upstream patch adds, kept under ``files/`` at the paths they
take in SGLang's repository (``sglang/...`` under its ``python/`` folder,
``test/...`` at its root).

They are written for SGLang directly, not composed from the plugin's core:
the in-tree form keeps what a first pull request needs (one pipelined
all_reduce per step, symmetric pops by position, cross-rank agreement on the
depth, the switch and the reclaim digest) and leaves the plugin's machinery
(hooks, version guard, auto depth, metrics, protocol version) out; the same
gloo scenario suites check that both pop the same entries at the same steps
(docs/upstream-patch.md). Formatted with SGLang's pinned black and isort (the
tests check it), so ruff and mypy here leave ``files/`` alone.
"""

from __future__ import annotations

from pathlib import Path

from hicache_async_ack_lab.cli_support import ToolError

FILES = Path(__file__).resolve().with_name("files")
MODULE_NAME = "hicache_ack_sync"
# Under unified_cache/, where mem_cache/README.md files the Unified Radix Cache's
# parts (its storage_attachment.py, built by init_hicache too, sits there).
MODULE = f"sglang.srt.mem_cache.unified_cache.{MODULE_NAME}"
MODULE_PATH = f"sglang/srt/mem_cache/unified_cache/{MODULE_NAME}.py"
CLASS_NAME = "HiCacheAckSync"
# How the module names a peer running this plugin (issue 22 point 5: the stamp
# ranges); the one line of the patch allowed to name it.
PEER_PLUGIN = "a peer runs the hicache-async-ack plugin"
# SGLang's CPU unit test (built like its test_hiradix_pp_sync_drain.py) and a
# 2-rank gloo test, at their paths from the repository root.
TEST_PATHS = (
    "test/registered/unit/mem_cache/test_hicache_ack_sync.py",
    "test/registered/unit/mem_cache/test_hicache_ack_sync_gloo.py",
)


class ComposeError(ToolError):
    """A file the patch adds is missing from this install."""


def read(rel: str) -> str:
    """The text of the added file at ``rel`` (a path from ``files/``)."""
    try:
        return (FILES / rel).read_text()
    except OSError as exc:
        raise ComposeError(f"cannot read {FILES / rel}: {exc.strerror}") from exc


def compose() -> str:
    """The text of the module the patch adds (MODULE_PATH)."""
    return read(MODULE_PATH)
