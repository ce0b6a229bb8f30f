"""What the lab's commands share: the error a tool reports in one line
(:class:`ToolError`) and the runner of a parsed command (SIGTERM tears ranks
down as Ctrl-C does)."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType
from typing import Callable, Iterable, Optional, Sequence

from hicache_async_ack import __version__
from hicache_async_ack.tools import RanksFailed

LAB_PROG = "hicache-async-ack-lab"


class ToolError(RuntimeError):
    """A tool cannot give a result (bad combination of options, failed run)."""


def build_parser(prog: str, description: str,
                 adders: Iterable[Callable[..., object]]) -> argparse.ArgumentParser:  # fmt: skip
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in adders:
        add(sub)
    return parser


def _terminate(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> int:
    """Parse and run one command: a tool's own error is one line on stderr, exit 1."""
    # cpu-server passes what it does not know on to launch_server; nothing else may.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted; ranks killed", file=sys.stderr)
        return 130
    except (ToolError, RanksFailed) as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
