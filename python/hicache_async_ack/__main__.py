"""``python -m hicache_async_ack doctor``."""

import sys

from .tools.cli import main

sys.exit(main())
