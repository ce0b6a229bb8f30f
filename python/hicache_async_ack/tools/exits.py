"""doctor's exit codes: one per cause, in the order doctor checks them (where several
hold, the lowest code is the exit status). Only the ack sync decides: it is the product;
the prefetch votes and the decode offload sync are reported on their own lines."""

from __future__ import annotations

import textwrap
from enum import IntEnum


class Exit(IntEnum):
    LIVE = 0
    FAILED = 1
    USAGE = 2
    NO_SGLANG = 3
    SWITCHED_OFF = 4
    INVALID_SETTING = 5
    NO_ENTRY_POINT = 6
    EXCLUDED = 7
    LAUNCH_REJECTED = 8
    IN_TREE = 9
    GUARD = 10
    STANDS_DOWN = 11


MEANING: dict[Exit, str] = {
    Exit.LIVE: "the ack sync would pipeline on the launch given after --, or (without one) "
    "is allowed on this node",
    Exit.FAILED: "doctor itself failed (an error it printed; --measure's ranks died)",
    Exit.USAGE: "doctor's own options were not understood (argparse)",
    Exit.NO_SGLANG: "no SGLang importable by this Python: the wrong interpreter",
    Exit.SWITCHED_OFF: "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC is false: the plugin reads "
    "nothing else and stays out",
    Exit.INVALID_SETTING: "a setting of the plugin is invalid: a server with HiCache "
    "would refuse to start",
    Exit.NO_ENTRY_POINT: "the entry point is not installed: SGLang's loader never calls the plugin",
    Exit.EXCLUDED: "SGLANG_PLUGINS does not list hicache_async_ack: SGLang's loader skips it",
    Exit.LAUNCH_REJECTED: "SGLang's own argument parser rejects the launch arguments",
    Exit.IN_TREE: "this SGLang carries the pipelined ack sync itself: the plugin registers nothing",
    Exit.GUARD: "the version guard keeps the ack sync off: its methods are untested or "
    "incompatible on this SGLang",
    Exit.STANDS_DOWN: "the launch makes the ack sync stand down (TP=1, PP, buffer_only, a "
    "linker, LMCache, CP x TP without a spanning group, ...)",
}


def exit_table(width: int = 100) -> str:
    """The table, as ``doctor --help`` prints it."""
    lines = ["exit status (where several causes hold, the lowest code):"]
    for code in Exit:
        lines += textwrap.wrap(MEANING[code], width, initial_indent=f"  {code.value:>2}  ",
                               subsequent_indent=" " * 6)  # fmt: skip
    return "\n".join(lines)


__all__ = ["Exit", "MEANING", "exit_table"]
