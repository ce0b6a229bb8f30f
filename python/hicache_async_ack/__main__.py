"""``python -m hicache_async_ack {bench,doctor}``."""

import sys

from .tools.cli import main

sys.exit(main())
