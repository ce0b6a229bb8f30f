"""``hicache-async-ack`` command line: ``bench``, ``bench-server``, ``cpu-server``,
``mooncake-master``, ``doctor`` and ``upstream-patch``."""

from __future__ import annotations

import argparse
import signal
import sys

from .. import __version__
from . import doctor, upstream_patch
from .bench import driver as bench
from .bench import server as bench_server
from .cpu_server import cli as cpu_server
from .cpu_server import mooncake
from .options import ToolError
from .ranks import RanksFailed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache-async-ack",
        description="SGLang plugin that pipelines the per-step HiCache ack-count "
        "all_reduce. Commands to check it is active and to measure what it saves.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(
        dest="command",
        metavar="{bench,bench-server,cpu-server,mooncake-master,doctor,upstream-patch}",
        required=True,
    )
    bench.add_parser(sub)
    bench_server.add_parser(sub)
    cpu_server.add_parser(sub)
    mooncake.add_parser(sub)
    doctor.add_parser(sub)
    upstream_patch.add_parser(sub)
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    parser = build_parser()
    # cpu-server passes what it does not know on to launch_server; nothing else may.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    previous = signal.signal(signal.SIGTERM, _terminate)  # tear ranks down on SIGTERM too
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"hicache-async-ack {args.command}: interrupted; ranks killed", file=sys.stderr)
        return 130
    except (ToolError, RanksFailed) as exc:
        print(f"hicache-async-ack {args.command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
