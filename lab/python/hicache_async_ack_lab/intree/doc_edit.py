"""The edit to a checkout's environment-variable reference doc (a checkout only: an
installed SGLang has no docs): the two settings as rows of its HiCache table."""

from __future__ import annotations

from hicache_async_ack import env
from hicache_async_ack_lab.intree.edits import DEPTH_MAX, EditError

DOC_PATH = "docs/references/environment_variables.md"  # in a checkout of the repo
DOC_ROWS = (
    f"| `{env.ENABLE_VAR}` | Pipeline HiCache's per-step ready-count all_reduce "
    "(`UnifiedRadixCache.check_hicache_events`): issue it asynchronously and pop what it "
    f"agreed on `{env.DEPTH_VAR}` steps later, off the scheduler's critical path. `false` "
    "restores the blocking all_reduce. PP, attention CP x attention TP, `buffer_only` host "
    "memory and PD decode always block. Must match on every node of a TP group. | `true` |\n"
    f"| `{env.DEPTH_VAR}` | Steps between issuing that all_reduce and popping what it "
    f"agreed on, 1 to {DEPTH_MAX}: a larger depth hides a slower collective, and acks are "
    "reaped that many steps later. Must match on every node of a TP group. | `1` |\n"
)
DOC_SECTION = (
    "\n## HiCache\n\n| Environment Variable | Description | Default Value |\n| --- | --- | --- |\n"
)


def edit_doc(text: str, path: str = DOC_PATH) -> str:
    """The reference doc with the two settings: after the last HiCache row, or
    in a HiCache section at the end when the doc has none."""
    if env.ENABLE_VAR in text:
        raise EditError(f"{path} already documents {env.ENABLE_VAR}")
    lines = text.splitlines(keepends=True)
    rows = [i for i, line in enumerate(lines) if line.startswith("| `SGLANG_HICACHE_")]
    if rows:
        at = rows[-1] + 1
        return "".join(lines[:at]) + DOC_ROWS + "".join(lines[at:])
    return text.rstrip("\n") + "\n" + DOC_SECTION + DOC_ROWS
