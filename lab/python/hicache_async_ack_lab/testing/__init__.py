"""Test-only support: seeded lifecycle scenarios for real-gloo and in-process
ranks, the checks they end with, and a drifted upstream method for the guard's
tests. Built on :mod:`hicache_async_ack_lab.sim`; never used by the plugin or the
shipped tools."""
