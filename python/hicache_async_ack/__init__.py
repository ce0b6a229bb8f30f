"""hicache-async-ack: pipeline SGLang's per-step HiCache ack-count all_reduce.

The core (:mod:`hicache_async_ack.protocol.reduce`) imports without SGLang; the SGLang
adapter (:mod:`hicache_async_ack.sglang_plugin`) is loaded by SGLang's plugin
loader through the ``sglang.srt.plugins`` entry point.
"""

__version__ = "0.1.0"
