"""``python -m hicache_async_ack {bench,bench-server,cpu-server,doctor,upstream-patch}``."""

import sys

from .tools.cli import main

sys.exit(main())
