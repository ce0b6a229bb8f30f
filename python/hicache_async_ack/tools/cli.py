"""``hicache-async-ack`` command line: ``doctor``, the one command of the runtime
wheel. The lab's commands (``bench``, ``bench-server``, ``cpu-server``,
``mooncake-master``, ``upstream-patch``) are ``hicache-async-ack-lab``'s, in the
``hicache-async-ack-lab`` distribution; :func:`run` is the runner both share."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable, Iterable, Optional, Sequence

from .. import __version__
from . import doctor
from .options import ToolError
from .ranks import RanksFailed

# The lab's commands: named here (not imported) so a runtime-only install says
# where they went instead of argparse's bare "invalid choice".
LAB_COMMANDS = (
    "bench",
    "bench-server",
    "cpu-server",
    "mooncake-master",
    "upstream-patch",
    "differential",
)
LAB_PROG = "hicache-async-ack-lab"


def build_parser(
    prog: str, description: str, adders: Iterable[Callable], passthrough: bool = False
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in adders:
        add(sub)
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> int:
    """Parse and run one command: SIGTERM tears ranks down as Ctrl-C does, and a
    tool's own error is one line on stderr, exit 1."""
    # cpu-server passes what it does not know on to launch_server; nothing else may.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted; ranks killed", file=sys.stderr)
        return 130
    except (ToolError, RanksFailed) as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in LAB_COMMANDS:
        print(
            f"hicache-async-ack: {argv[0]!r} is a lab command, not part of the runtime "
            f"plugin: install the hicache-async-ack-lab distribution (README, 'Two "
            f"wheels') and run `{LAB_PROG} {' '.join(argv)}`",
            file=sys.stderr,
        )
        return 2
    parser = build_parser(
        "hicache-async-ack",
        "SGLang plugin that pipelines the per-step HiCache ack-count all_reduce. "
        "`doctor` says whether this host is affected and whether the plugin is live.",
        [doctor.add_parser],
    )
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
