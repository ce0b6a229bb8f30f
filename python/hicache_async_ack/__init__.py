"""hicache-async-ack: pipeline SGLang's per-step HiCache ack-count all_reduce.

The core (:mod:`hicache_async_ack.protocol.reduce`) imports without SGLang; the SGLang
adapter (:mod:`hicache_async_ack.sglang_plugin`) is loaded by SGLang's plugin
loader through the ``sglang.srt.plugins`` entry point.

``__version__`` is written here only (both wheels read it; the lab's is kept equal) and
moves whenever the wire protocol does: :data:`hicache_async_ack.wire.RELEASES` records
the wire of each release, and a test ties the two.
"""

__version__ = "0.2.0"
