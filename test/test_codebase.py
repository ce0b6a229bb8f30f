"""The packages' shape stays what docs/design.md says: no import cycle, no private
name used across modules, no module over MAX_LINES lines, and the runtime package
(what GPU nodes load) imports nothing from the lab (read from the sources, nothing
imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME, LAB = "hicache_async_ack", "hicache_async_ack_lab"
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


def test_no_private_name_imported_across_modules():
    mods = modules()
    used = []
    for m, path in mods.items():
        for target, names, line in imports(m, path):
            if not target.startswith("hicache_async_ack"):
                continue
            used += [
                f"{m}:{line} imports {target}.{n}"
                for n in names
                if n.startswith("_") and not n.startswith("__")
            ]
            used += [
                f"{m}:{line} imports {target}" for part in target.split(".") if part.startswith("_")
            ]
    assert used == []


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
