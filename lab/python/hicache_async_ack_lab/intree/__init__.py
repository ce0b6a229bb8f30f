"""The upstream patch: the pipelined ack sync as SGLang's own code, computed
at run time against a given SGLang source (``hicache-async-ack
upstream-patch``; docs/upstream-patch.md).

- ``files/``: the files the patch adds, written for SGLang (its module and its
  tests), at their paths in SGLang's repository
- ``module``: where those files are and what they are called
- ``edits``: the edits to ``unified_radix_cache.py``, ``environ.py`` and the
  environment-variable reference, located with ``ast`` in the given source
- ``unidiff``: the unified diff, and a strict applier that names the hunk that
  does not apply
"""
