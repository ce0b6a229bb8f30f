"""The upstream patch: the ack sync as SGLang's own code, generated at run time
from the plugin's sources and the installed SGLang (``hicache-async-ack
upstream-patch``; docs/upstream-patch.md).

- ``glue``: the in-tree glue (settings from SGLang's ``envs``, the lazily created
  per-cache state); read as text, never imported by the plugin
- ``module``: composes ``sglang/srt/mem_cache/hicache_ack_sync.py`` from
  core.py, env.py, ack_sync.py and the glue
- ``edits``: the edits to ``unified_radix_cache.py`` and ``environ.py``, located
  with ``ast`` in the given source
- ``unidiff``: the unified diff, and a strict applier that names the hunk that
  does not apply
"""
