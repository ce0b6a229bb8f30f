"""The runtime's one command, ``hicache-async-ack doctor``, with the rank
spawner and option types it shares with the lab (``hicache_async_ack_lab``)."""
