"""``hicache-async-ack`` command line: ``doctor``, the one command of the runtime
wheel. The lab's commands (``bench``, ``bench-server``, ``cpu-server``,
``mooncake-master``, ``upstream-patch``, ``differential``) are
``hicache-async-ack-lab``'s, in the ``hicache-async-ack-lab`` distribution."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType
from typing import Optional, Sequence

from .. import __version__
from ..protocol import PROTOCOL_VERSION
from . import doctor
from .ranks import RanksFailed

# The lab's commands: named here (not imported) so a runtime-only install says
# where they went instead of argparse's bare "invalid choice".
LAB_COMMANDS = ("bench", "bench-server", "cpu-server", "mooncake-master", "upstream-patch",
                "differential")  # fmt: skip
LAB_PROG = "hicache-async-ack-lab"


def _terminate(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


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
    parser = argparse.ArgumentParser(
        prog="hicache-async-ack",
        description="SGLang plugin that pipelines the per-step HiCache ack-count all_reduce. "
        "`doctor [-- <launch_server arguments>]` says whether it would pipeline here.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__} (wire protocol {PROTOCOL_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    doctor.add_parser(sub)
    launch = None  # doctor's `-- <launch_server arguments>`, read by SGLang's parser
    if "--" in argv:
        cut = argv.index("--")
        argv, launch = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if launch is not None:
        args.launch = launch
    previous = signal.signal(signal.SIGTERM, _terminate)  # SIGTERM kills ranks as Ctrl-C does
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted; ranks killed", file=sys.stderr)
        return 130
    except RanksFailed as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
