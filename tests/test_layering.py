"""The architecture's layering, checked on the source: the model files know no backend and no layout
code, and a mesh is pure data."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rlflow"
BACKEND_WORDS = ("cpu_kernels", "torch_npu", "ctypes", "backends", "npu_", "data_ptr")


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_model_files_import_no_backend_and_no_layout_code():
    files = sorted((ROOT / "models").glob("*.py"))
    assert len(files) >= 5, files
    bad = []
    for f in files:
        for mod in _imports(f):
            # the ops package's public names only: no kernel module, no parallel code
            if mod.startswith(("rlflow.ops.", "rlflow.parallel", "torch_npu", "ctypes", "torch.distributed")) \
                    and mod.split(".")[-1] not in _public_ops():
                bad.append(f"{f.name} imports {mod}")
        text = f.read_text()
        bad += [f"{f.name} names {w!r}" for w in BACKEND_WORDS if w in text]
    assert not bad, "\n".join(bad)


def _public_ops() -> set[str]:
    import rlflow.ops
    return set(rlflow.ops.__all__)


def test_the_check_sees_a_planted_import(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    for i in range(5):
        (tmp_path / "models" / f"m{i}.py").write_text("import torch\n")
    (tmp_path / "models" / "m0.py").write_text("from rlflow.ops import cpu_kernels\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    try:
        test_model_files_import_no_backend_and_no_layout_code()
    except AssertionError as e:
        assert "cpu_kernels" in str(e)
    else:
        raise AssertionError("a model file importing a kernel module passed the check")


def test_a_mesh_is_pure_data():
    """Importing the mesh pulls in neither torch.distributed's executor nor the planner (the import cycle
    mesh -> dist -> plan -> cli -> models.sharding -> mesh is cut)."""
    code = ("import sys, rlflow.sharding.mesh; "
            "print(sorted(m for m in sys.modules if m.startswith('rlflow.sharding.') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['rlflow.sharding.mesh']", out


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST, here: str, is_package: bool):
    """(module, line) of every import in ``tree`` that can run: at module level and inside functions,
    not under ``if TYPE_CHECKING:``; relative imports resolved against ``here``."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for b in node.body for n in ast.walk(b)}
    pkg = here.split(".") if is_package else here.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            yield from ((f"{base}.{a.name}", node.lineno) for a in node.names)
            yield base, node.lineno


def import_graph(root: pathlib.Path) -> dict[str, dict[str, int]]:
    """module -> {module of ``root``'s package it imports: the line of its first import of it}. An import
    names the longest dotted prefix that is a module of the package (``from a.b import f``: a.b; ``from
    a import b``: a.b when b is a module, else a)."""
    files = {_module_name(f, root): f for f in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, f in files.items():
        out = graph.setdefault(name, {})
        for mod, line in _runtime_imports(ast.parse(f.read_text()), name, f.name == "__init__.py"):
            parts = mod.split(".")
            target = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in files), None)
            if target is not None and target != name and not name.startswith(target + "."):
                out[target] = min(out.get(target, line), line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] through every strongly connected component of more than one module
    (Tarjan's algorithm, then a shortest path back to the component's first module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in sorted(comps):
        start, members = comp[0], set(comp)
        prev: dict[str, str | None] = {start: None}
        frontier, last = [start], None
        while last is None:  # breadth first from start, to the first module that imports start
            last = next((v for v in frontier if start in graph[v]), None)
            nxt = []
            for v in frontier:
                for w in graph[v]:
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while last is not None:
            path.append(last)
            last = prev[last]
        cycles.append(path[::-1])
    return cycles


def test_the_import_graph_has_no_cycle():
    """No module of rlflow imports (at module level or in a function) one that imports it back, directly
    or through others: each cycle is listed as the chain of imports with the line of each."""
    graph = import_graph(ROOT)
    cycles = import_cycles(graph)
    shown = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}" for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(shown)


def test_the_cycle_check_sees_a_planted_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "rlflow"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import torch\nfrom rlflow.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from rlflow.a import g\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlflow import a\n")
    (pkg / "e.py").write_text("from rlflow import d\n")
    assert import_cycles(import_graph(pkg)) == [["rlflow.a", "rlflow.sub.b", "rlflow.sub.c", "rlflow.a"]]
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    try:
        test_the_import_graph_has_no_cycle()
    except AssertionError as e:
        assert "rlflow.a (line 2) -> rlflow.sub.b (line 1) -> rlflow.sub.c (line 2) -> rlflow.a" in str(e), str(e)
    else:
        raise AssertionError("a planted import cycle passed the check")


MAX_LINES = 400  # a module past this has, so far each time, held several concerns (issue 41)


def _long_modules(root: pathlib.Path) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted(root.rglob("*.py"))
            if "backends" not in p.relative_to(root).parts and (n := len(p.read_text().splitlines())) > MAX_LINES]


def test_no_module_outside_the_kernels_passes_400_lines():
    """One concern per module: none over ``MAX_LINES`` except the device kernels' bindings (ops/backends)."""
    assert not _long_modules(ROOT), "\n".join(_long_modules(ROOT))


def test_the_length_check_sees_a_planted_long_module(tmp_path):
    (tmp_path / "ops" / "backends").mkdir(parents=True)
    (tmp_path / "ops" / "backends" / "cpu.py").write_text("x = 1\n" * (MAX_LINES + 50))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _long_modules(tmp_path) == [f"long.py: {MAX_LINES + 1} lines"]
