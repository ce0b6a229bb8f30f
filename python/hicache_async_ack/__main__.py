"""``python -m hicache_async_ack {bench,doctor}``."""

import sys

from .cli import main

sys.exit(main())
