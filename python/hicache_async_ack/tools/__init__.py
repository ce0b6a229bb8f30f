"""The command-line tools (``hicache-async-ack bench`` and ``doctor``) and the
rank spawner they share with the tests."""
