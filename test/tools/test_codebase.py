"""The packages' shape stays what docs/design.md says: no import cycle, no private
name used across modules, no module over MAX_LINES lines, the runtime package
(what GPU nodes load) imports nothing from the lab, the lab and the tests reach
the runtime only through its public modules (each with ``__all__``, only names
in it) and patch nothing of it (read from the sources, nothing imported). Each
check has a negative control: a broken source it must catch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME, LAB = "hicache_async_ack", "hicache_async_ack_lab"
# The runtime's public face: what the lab and the tests may import (issue 48).
FACE = ("sglang_plugin", "env", "names", "errors", "protocol", "guard", "metrics", "tools", "wire")
PUBLIC = tuple(f"{RUNTIME}.{m}" for m in FACE)
PACKAGES = {RUNTIME: ROOT / "python" / RUNTIME, LAB: ROOT / "lab" / "python" / LAB}
MAX_LINES = 450
# Written for SGLang, shipped as data (the in-tree form): not modules of this package.
EXCLUDED = ("intree/files/",)


def package_modules(name: str) -> dict[str, Path]:
    package, out = PACKAGES[name], {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if any(rel.startswith(e) for e in EXCLUDED):
            continue
        parts = [name, *rel[:-3].split("/")]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    assert len(out) > 10, f"the package {name} was not found"
    return out


def modules() -> dict[str, Path]:
    """Every module of both packages (they form one import graph)."""
    return {m: p for name in PACKAGES for m, p in package_modules(name).items()}


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import, at any depth
    (a function-level import closes a cycle as surely as a top-level one)."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, path.name == "__init__.py", node)
            out.append((target, [a.name for a in node.names], node.lineno))
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for target, names, _ in imports(m, path):
            for name in names or [None]:
                sub = f"{target}.{name}" if name else None
                if sub in mods:  # from package import module
                    edges[m].add(sub)
                elif target in mods:
                    edges[m].add(target)
        edges[m].discard(m)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    edges = graph()
    assert sum(map(len, edges.values())) > 50, "the import graph is empty: the check is broken"
    assert cycles(edges) == []


def test_the_cycle_check_finds_a_cycle():
    """Negative control: a two-module loop through a function-level import."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def private_imports(mods: dict[str, Path]) -> list[str]:
    """``from ours import _name`` and ``import ours._module`` across modules."""
    used = []
    for m, path in mods.items():
        for target, names, line in imports(m, path):
            if not target.startswith(RUNTIME):
                continue
            used += [
                f"{m}:{line} imports {target}.{n}"
                for n in names
                if n.startswith("_") and not n.startswith("__")
            ]
            used += [
                f"{m}:{line} imports {target}" for part in target.split(".") if part.startswith("_")
            ]
    return used


def test_no_private_name_imported_across_modules():
    assert private_imports(modules()) == []


def test_the_private_import_check_finds_one(tmp_path):
    """Negative control: a private name and a private module, imported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from hicache_async_ack.kit.owner import _secret\nimport hicache_async_ack._x\n")
    assert private_imports({"hicache_async_ack_lab.bad": bad}) == [
        "hicache_async_ack_lab.bad:1 imports hicache_async_ack.kit.owner._secret",
        "hicache_async_ack_lab.bad:2 imports hicache_async_ack._x",
    ]


def private_attribute_uses(m: str, path: Path, mods: dict[str, Path]) -> list[str]:
    """``module._name`` where ``module`` is one of ours imported here."""
    tree = ast.parse(path.read_text())
    ours = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(m, path.name == "__init__.py", node)
            for a in node.names:
                if f"{target}.{a.name}" in mods:
                    ours[a.asname or a.name] = f"{target}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ours
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append(f"{m}:{node.lineno} uses {ours[node.value.id]}.{node.attr}")
    return out


def test_no_private_attribute_of_another_module():
    mods = modules()
    found = [u for m, p in mods.items() for u in private_attribute_uses(m, p, mods)]
    assert found == []


def test_the_private_attribute_check_finds_one(tmp_path):
    """Negative control: ``module._name`` of a module of ours imported here."""
    bad = tmp_path / "bad.py"
    bad.write_text("from hicache_async_ack import guard\nx = guard._cache\n")
    mods = {"hicache_async_ack.guard": bad}
    assert private_attribute_uses("hicache_async_ack_lab.bad", bad, mods) == [
        "hicache_async_ack_lab.bad:2 uses hicache_async_ack.guard._cache"
    ]


def lab_imports(mods: dict[str, Path]) -> list[str]:
    """Every import of the lab by a runtime module, at any depth."""
    return [
        f"{m}:{line} imports {target}"
        for m, path in mods.items()
        if m.split(".")[0] == RUNTIME
        for target, _, line in imports(m, path)
        if target.split(".")[0] == LAB
    ]


def test_the_runtime_imports_nothing_from_the_lab():
    runtime = package_modules(RUNTIME)
    assert (
        "hicache_async_ack.sglang_plugin" in runtime and "hicache_async_ack.tools.doctor" in runtime
    )
    assert lab_imports(runtime) == []


def test_the_boundary_check_finds_a_lab_import(tmp_path):
    """Negative control: a runtime module with a function-level lab import."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from hicache_async_ack_lab.sim import cache\n")
    assert lab_imports({"hicache_async_ack.bad": bad}) == [
        "hicache_async_ack.bad:2 imports hicache_async_ack_lab.sim"
    ]


def test_the_lab_imports_the_runtime():
    """The graph really spans both packages (else the boundary check reads nothing)."""
    edges = graph()
    assert any(
        m.startswith(LAB) and any(t.split(".")[0] == RUNTIME for t in ts) for m, ts in edges.items()
    )


@pytest.mark.parametrize("limit", [MAX_LINES])
def test_no_module_over_the_limit(limit):
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    assert max(sizes.values()) > 100, "no module read: the check is broken"
    assert {m: n for m, n in sizes.items() if n > limit} == {}


# ------------------------------------------------------------- the public face
def consumer_files() -> list[Path]:
    """What reaches the runtime from outside: the lab's modules and the tests."""
    files = list(package_modules(LAB).values()) + sorted((ROOT / "test").rglob("*.py"))
    assert len(files) > 60, "no lab or test file read: the check is broken"
    return files


# Imports in code and in the code a test runs in a subprocess (a string).
IMPORT_TEXT = re.compile(
    rf"^\s*(?:from\s+({RUNTIME}(?:\.\w+)*)\s+import\s+(?:\(([^)]*)\)|([\w, ]+))"
    rf"|import\s+({RUNTIME}(?:\.\w+)*))",
    re.M,
)


def reached(files: list[Path], runtime: dict[str, Path]) -> dict[str, set[str]]:
    """Runtime module -> the names taken from it (a submodule taken from a
    package counts as that module, reached whole)."""
    out: dict[str, set[str]] = {}
    for path in files:
        for m in IMPORT_TEXT.finditer(path.read_text()):
            base = m.group(1) or m.group(4)
            listed = re.sub(r"#[^\n]*", "", m.group(2) or m.group(3) or "")  # comments out
            taken = (n.split(" as ")[0].strip() for n in listed.split(","))
            names = [n for n in taken if n]
            for name in names or [""]:
                if name and f"{base}.{name}" in runtime:
                    out.setdefault(f"{base}.{name}", set())
                else:
                    out.setdefault(base, set()).update([name] if name else [])
    return out


def module_all(path: Path) -> set[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return None


def face_problems(files: list[Path], runtime: dict[str, Path]) -> list[str]:
    problems = []
    for module, names in sorted(reached(files, runtime).items()):
        if module == RUNTIME:
            extra = names - {"__version__"}
            problems += [f"{RUNTIME}.{n} is not a public module" for n in sorted(extra)]
        elif module not in PUBLIC:
            problems.append(f"{module} is not public")
        elif (exported := module_all(runtime[module])) is None:
            problems.append(f"{module} has no __all__")
        else:
            problems += [f"{module}.{n} is not in its __all__" for n in sorted(names - exported)]
    return problems


def test_the_lab_and_the_tests_reach_only_the_public_face():
    runtime = package_modules(RUNTIME)
    face = reached(consumer_files(), runtime)
    assert "hicache_async_ack.sglang_plugin" in face and "hicache_async_ack.env" in face
    assert len(PUBLIC) <= 9
    assert face_problems(consumer_files(), runtime) == []


def test_the_face_check_finds_a_private_module_and_a_name_outside_all(tmp_path):
    """Negative control: a kit module reached, a name outside __all__, a module
    without __all__, a submodule of the package root that is not public (in a
    subprocess's code too)."""
    runtime = {
        RUNTIME: tmp_path / "init.py",
        f"{RUNTIME}.kit": tmp_path / "kit.py",
        f"{RUNTIME}.kit.owner": tmp_path / "owner.py",
        f"{RUNTIME}.env": tmp_path / "env.py",
        f"{RUNTIME}.names": tmp_path / "names.py",
    }
    runtime[f"{RUNTIME}.env"].write_text("__all__ = ['ENABLE_VAR']\n")
    runtime[f"{RUNTIME}.names"].write_text("X = 1\n")
    user = tmp_path / "test_user.py"
    user.write_text(
        "from hicache_async_ack.kit.owner import OwnerState\n"
        "from hicache_async_ack.env import ENABLE_VAR, _parse\n"
        "from hicache_async_ack import names, __version__\n"
        "CODE = '''\nfrom hicache_async_ack import kit\n'''\n"
    )
    assert face_problems([user], runtime) == [
        "hicache_async_ack.env._parse is not in its __all__",
        "hicache_async_ack.kit is not public",
        "hicache_async_ack.kit.owner is not public",
        "hicache_async_ack.names has no __all__",
    ]


def patched_seams(path: Path) -> list[str]:
    """``setattr``/``monkeypatch.setattr``/``delattr`` on a runtime module (or on
    something reached through one), by name or by dotted string, and
    assignments to its attributes: a collaborator must be handed in instead."""
    tree = ast.parse(path.read_text())
    ours: set[str] = set()  # local names bound to runtime modules or their members
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            ours |= {(a.asname or a.name).split(".")[0] for a in node.names
                     if a.name.split(".")[0] == RUNTIME}  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == RUNTIME:
            ours |= {a.asname or a.name for a in node.names}

    def root(expr: ast.expr) -> str | None:
        while isinstance(expr, (ast.Attribute, ast.Call, ast.Subscript)):
            expr = expr.func if isinstance(expr, ast.Call) else expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name not in ("setattr", "delattr"):
                continue
            target = node.args[0]
            text = target.value if isinstance(target, ast.Constant) else None
            if (isinstance(text, str) and text.startswith(f"{RUNTIME}.")) or root(target) in ours:
                found.append(f"{path.name}:{node.lineno} patches {ast.unparse(target)}")
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and root(t) in ours:
                    found.append(f"{path.name}:{node.lineno} assigns {ast.unparse(t)}")
    return sorted(found, key=lambda f: int(f.split(":")[1].split()[0]))


def test_nothing_patches_the_runtime():
    files = consumer_files()
    assert any("monkeypatch.setattr" in p.read_text() for p in files)  # the scan reads them
    assert [s for p in files for s in patched_seams(p)] == []


def test_the_seam_check_finds_patches(tmp_path):
    """Negative control: a module attribute patched by monkeypatch, by dotted
    string, by setattr on something reached through the runtime, and assigned;
    a third-party object patched is not the runtime's."""
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "from hicache_async_ack import guard\n"
        "from hicache_async_ack.sglang_plugin import environment\n"
        "def test(monkeypatch):\n"
        "    monkeypatch.setattr(guard, 'TABLE_PATH', None)\n"
        "    monkeypatch.setattr('hicache_async_ack.guard.TABLE_PATH', None)\n"
        "    setattr(environment().collectives, 'span', None)\n"
        "    guard.TABLE_PATH = None\n"
        "    monkeypatch.setattr(object, 'x', None)\n"
    )
    assert patched_seams(bad) == [
        "test_bad.py:4 patches guard",
        "test_bad.py:5 patches 'hicache_async_ack.guard.TABLE_PATH'",
        "test_bad.py:6 patches environment().collectives",
        "test_bad.py:7 assigns guard.TABLE_PATH",
    ]
