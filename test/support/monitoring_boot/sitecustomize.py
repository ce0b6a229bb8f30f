# Test support (test/support/monitoring_capture.py, the "inert" capture): put first on a
# cpu-server's PYTHONPATH. Installs the cpu-server's stand-ins (what its own boot/
# sitecustomize does), then drifts one method the version guard fingerprints
# (UnifiedRadixCache.check_hicache_events, which both cache syncs hook, gets a
# no-op statement) the moment SGLang's module is imported, in every server
# process: the guard then keeps both inert, as after an SGLang upgrade that
# changed that method, and the server runs
# SGLang's own blocking path. Nothing of SGLang's is copied: drifted() rewrites the
# installed method's own source at run time.
import ast
import importlib.abc
import importlib.util
import sys

from hicache_async_ack_lab.cpu_server.standins import install

install()

MODULE = "sglang.srt.mem_cache.unified_radix_cache"
CLASS, METHOD = "UnifiedRadixCache", "check_hicache_events"


def _noop_statement(node: ast.FunctionDef) -> None:
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(
        getattr(first, "value", None), ast.Constant
    )
    node.body.insert(1 if docstring else 0, ast.parse("_drifted_by_test = None").body[0])


def _drift(module) -> None:
    from hicache_async_ack_lab.testing.drift import drifted

    cls = getattr(module, CLASS)
    setattr(cls, METHOD, drifted(getattr(cls, METHOD), _noop_statement))


class _DriftOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_drift(module):
            exec_module(module)
            _drift(module)

        spec.loader.exec_module = exec_and_drift  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _DriftOnImport())
