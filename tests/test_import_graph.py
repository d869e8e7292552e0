"""The import graph of the package: no cycle among the modules of ``kernels/`` and ``tritonllm/``, the
layers ``kernels -> nn -> models -> train`` (a layer imports nothing from the layers after it), and no
module over :data:`MAX_LINES` lines but the few listed.

Read from the sources with ``ast``, nothing imported: every ``import`` and ``from ... import`` statement,
at module level or inside a function (a lazy import still ties the two modules together), relative
imports resolved against the importing module's package, and ``kernels/`` read as ``tritonllm.kernels``
(pyproject.toml's package-dir). ``from package import name`` is an edge to ``package.name`` where that is
a module, else to the package (its ``__init__``). Imports under ``if TYPE_CHECKING:`` never run and are
left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: package name -> folder (pyproject.toml's package-dir, the two this graph covers)
PACKAGE_DIRS = {"tritonllm.kernels": ROOT / "kernels", "tritonllm": ROOT / "tritonllm"}
#: the layers, lowest first: a module of one imports nothing from the layers after it
LAYERS = ("tritonllm.kernels", "tritonllm.nn", "tritonllm.models", "tritonllm.train")
#: longest module allowed, in lines
MAX_LINES = 700


def modules() -> dict[str, Path]:
    """Every module of the covered packages: dotted name -> file (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] == "kernels" and package == "tritonllm":
                continue  # not a folder of tritonllm/ (kernels/ is mapped above)
            name = ".".join((package, *parts))
            found.setdefault(name.removesuffix(".__init__"), path)
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = _type_checking_only(tree)
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in known else source)
    edges = set()
    for target in targets:
        # the module itself, or the nearest enclosing module we know (`import tritonllm.kernels.gemm.x`)
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_find_cycle_finds_one():
    """The search itself: a three-module loop is found and printed in order; a diamond is no cycle."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None


def test_no_import_cycle():
    """No chain of imports among the package's modules leads back to where it started."""
    edges = graph()
    assert "tritonllm.kernels.gemm_sm90" in edges["tritonllm.kernels.gemm"]  # the graph is read, relative imports too
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers():
    """kernels -> nn -> models -> train: kernels imports nothing of tritonllm outside tritonllm.kernels, and
    each layer nothing from a later one."""
    bad = []
    for module, targets in graph().items():
        if _in(module, "tritonllm.kernels"):
            bad += [(module, t) for t in targets if not _in(t, "tritonllm.kernels")]
        for rank, layer in enumerate(LAYERS):
            if _in(module, layer):
                bad += [(module, t) for t in targets for later in LAYERS[rank + 1:] if _in(t, later)]
    assert not bad, "imports against the layers kernels -> nn -> models -> train:\n" + "\n".join(
        f"  {m} imports {t}" for m, t in sorted(set(bad)))


def test_module_length():
    """No module of kernels/ or tritonllm/ over MAX_LINES lines."""
    too_long = {}
    for path in modules().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_long[path.relative_to(ROOT).as_posix()] = lines
    assert not too_long, f"modules over {MAX_LINES} lines (split them by subject): {too_long}"
