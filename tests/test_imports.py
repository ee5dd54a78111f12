"""No import cycles in titan_thd, between modules or between packages; the config is a leaf; scripts,
benchmarks and dev harnesses import no tests.

The graph is read from the source with `ast`, not by importing anything. What counts as an edge:
- every `import titan_thd...` / `from titan_thd... import ...` (relative imports resolved), at
  module level or inside a function: a lazy import runs whenever its function does, so a cycle
  through it is a cycle all the same (lazy imports must not be used to hide one);
- imports under `if TYPE_CHECKING:` (annotations only) in the second graph, `annotations=True`:
  never executed, but a module that needs another's types to be read depends on it, and a circle
  hidden behind `TYPE_CHECKING` is still a circle (both graphs must have none);
- `from pkg import name` is an edge to the module `pkg.name` when that is a module, else to `pkg`.
What does not count:
- third-party modules, including the optional extras imported lazily (transformer_engine,
  transformers): they are outside the graph;
- `importlib.import_module(...)` of a computed name (the model registry): not an import statement.
Package level: every module maps to its unit, `titan_thd.<subpackage>` (data, models, ops,
parallel, components, config; nested packages collapse into their top-level one) or the top-level
module itself (`titan_thd.train`, `titan_thd`); edges inside a unit are dropped.

The config package is the graph's leaf: every module may read it at run time, so it imports no
other titan_thd module (annotation-only imports included), and `import titan_thd.config` loads
neither torch nor numpy.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, annotations: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`, at any depth; those under `if TYPE_CHECKING:` only with
    `annotations`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not annotations:
                for other in child.orelse:
                    visit(other)
                continue
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path, package: str, annotations: bool = False) -> dict[str, set[str]]:
    """{module: modules of `package` it imports} for every module under root/package (`annotations`:
    the imports under `if TYPE_CHECKING:` too)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path)), annotations):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, level - 1 packages up
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                # `import a.b.c` names a.b.c; keep the longest prefix that is one of our modules.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def package_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    def unit(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])  # titan_thd, titan_thd.config, titan_thd.data (for data.x.y too)

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        u = unit(module)
        out.setdefault(u, set()).update(unit(t) for t in targets if unit(t) != u)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) through every strongly connected component of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the graphs are small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    def path_back(start: str, comp: set[str]) -> list[str]:
        # Breadth-first inside the component from start back to start: a shortest cycle.
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        path = [v]
                        while path[-1] != start:
                            path.append(prev[path[-1]])
                        return [*reversed(path), start]
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        raise AssertionError("a strongly connected component has a cycle")

    return [path_back(min(comp), comp) for comp in components]


def _fmt(found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(c) for c in found)


# Run-time imports (what executes), then annotation-only imports too (what a reader must read).
GRAPHS = pytest.mark.parametrize("annotations", [False, True], ids=["runtime", "with-annotations"])


@GRAPHS
def test_no_module_cycles(annotations):
    found = cycles(import_graph(ROOT, "titan_thd", annotations))
    assert not found, f"import cycles between modules (annotations={annotations}):\n{_fmt(found)}"


@GRAPHS
def test_no_package_cycles(annotations):
    graph = package_graph(import_graph(ROOT, "titan_thd", annotations), "titan_thd")
    # The graph reads what it should: the five packages and the top-level modules are its nodes.
    for unit in ("data", "models", "ops", "parallel", "components", "config", "train"):
        assert f"titan_thd.{unit}" in graph
    assert "titan_thd.data" in graph["titan_thd.ops"]  # ops read BatchMeta
    found = cycles(graph)
    # with-annotations fails (at 7aa271b) only on one annotation-only import in a file this change
    # does not own: titan_thd/parallel/fsdp.py imports components.precision under TYPE_CHECKING, and
    # components imports parallel at run time (checkpoint, validation). Left failing for its owner.
    assert not found, f"import cycles between packages (annotations={annotations}):\n{_fmt(found)}"


def _outside(graph: dict[str, set[str]], unit: str) -> list[str]:
    """`module -> target` for every import of a module of `unit` that leaves it."""
    members = {m for m in graph if m == unit or m.startswith(unit + ".")}
    return [f"{m} -> {t}" for m in sorted(members) for t in sorted(graph[m] - members)]


def test_config_imports_no_other_module():
    """The config is a leaf: nothing in titan_thd/config/ imports another titan_thd module, not even
    for annotations (choice types live in config/choices.py; what a resume may change in
    config/resume_keys.py). So no arrow runs back up from the config, and no circle passes through it."""
    graph = import_graph(ROOT, "titan_thd", annotations=True)
    assert (
        "titan_thd.config.sections" in graph
        and "titan_thd.config.choices" in graph["titan_thd.config.sections"]
    )
    offenders = _outside(graph, "titan_thd.config")
    assert not offenders, (
        "titan_thd/config/ imports other titan_thd modules (move what it needs into config/):\n"
        + ("\n".join(offenders))
    )


def test_importing_the_config_loads_nothing_else():
    """What `import titan_thd.config` actually loads (run in a fresh interpreter): the config's own
    modules and the empty `titan_thd` package, no torch, no numpy."""
    code = (
        "import json, sys; import titan_thd.config; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('titan_thd', 'torch', 'numpy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "titan_thd.config.sections" in loaded  # the probe sees the modules it loaded
    others = [
        m
        for m in loaded
        if m != "titan_thd" and m != "titan_thd.config" and not m.startswith("titan_thd.config.")
    ]
    assert not others, f"import titan_thd.config loads {others}"


SCRIPT_FOLDERS = ("scripts", "benchmarks", "dev")
"""What a user, a benchmark or a developer runs from the repository: none of it imports tests/."""


def test_scripts_import_only_the_package():
    paths = [p for folder in SCRIPT_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert any(p.parent.name == "scripts" for p in paths)  # the folders are where this test looks
    offenders = []
    for path in paths:
        for node in _imports(ast.parse(path.read_text()), annotations=True):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            rel = path.relative_to(ROOT)
            offenders += [f"{rel}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not offenders, "scripts import from tests/ (move the helper into titan_thd):\n" + "\n".join(
        offenders
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_cycles(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/x.py": "from pkg.a import y\n",  # module cycle x -> y -> x, y's side lazy
            "pkg/a/y.py": "def f():\n    from pkg.a.x import g\n",
            "pkg/a/z.py": "from pkg.b.w import h\n",  # package cycle a -> b -> a, no module cycle
            "pkg/b/__init__.py": "",
            "pkg/b/w.py": "from ..a import x\n",
            "pkg/b/v.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a.z import q\n"
                "import transformers\n"
            ),
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a.x"] == {"pkg.a.y"} and graph["pkg.a.y"] == {"pkg.a.x"}
    assert graph["pkg.b.w"] == {"pkg.a.x"}  # relative import resolved
    assert graph["pkg.b.v"] == set()  # TYPE_CHECKING and third-party imports are no run-time edges
    assert cycles(graph) == [["pkg.a.x", "pkg.a.y", "pkg.a.x"]]
    assert cycles(package_graph(graph, "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert _outside(graph, "pkg.b") == ["pkg.b.w -> pkg.a.x"]
    graph["pkg.a.y"].clear()
    assert cycles(graph) == []

    # With annotations, the TYPE_CHECKING import is an edge (the third-party one still is not): a
    # circle through it is found, and it counts as leaving its package.
    full = import_graph(tmp_path, "pkg", annotations=True)
    assert full["pkg.b.v"] == {"pkg.a.z"}
    assert _outside(full, "pkg.b") == ["pkg.b.v -> pkg.a.z", "pkg.b.w -> pkg.a.x"]
    full["pkg.a.y"].clear()
    full["pkg.a.z"].add("pkg.b.v")
    assert cycles(full) == [["pkg.a.z", "pkg.b.v", "pkg.a.z"]]
