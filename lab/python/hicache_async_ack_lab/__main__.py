"""``python -m hicache_async_ack_lab COMMAND``: the lab's commands (``--help`` lists them)."""

import sys

from hicache_async_ack_lab.cli import main

sys.exit(main())
