"""``hicache-async-ack-lab`` command line: ``bench``, ``bench-server``,
``cpu-server``, ``mooncake-master``, ``upstream-patch`` and ``differential``:
what measures, demonstrates and checks the plugin, never loaded by it."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from hicache_async_ack_lab import cli_support, upstream_patch
from hicache_async_ack_lab.bench import driver as bench
from hicache_async_ack_lab.bench import server as bench_server
from hicache_async_ack_lab.cpu_server import cli as cpu_server
from hicache_async_ack_lab.cpu_server import mooncake
from hicache_async_ack_lab.testing import diff_cli


def build_parser() -> argparse.ArgumentParser:
    return cli_support.build_parser(
        cli_support.LAB_PROG,
        "The hicache-async-ack lab: benchmarks, SGLang's real server on CPU, the "
        "Mooncake launcher and the in-tree patch (the plugin itself is hicache-async-ack).",
        [
            bench.add_parser,
            bench_server.add_parser,
            cpu_server.add_parser,
            mooncake.add_parser,
            upstream_patch.add_parser,
            diff_cli.add_parser,
        ],
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_support.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
