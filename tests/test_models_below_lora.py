"""No module under titan_thd/models/ imports titan_thd.lora: LoRA sits above the models and attaches
adapters to their projections (models/projection.py, docs/adding_a_model.md §7), so a model file
reads as the model and the dependency runs one way, lora -> models.

Read from the source with `ast` (every import at any depth, lazy ones included; a relative import is
resolved against the file's package).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BELOW, ABOVE = "titan_thd.models", "titan_thd.lora"


def _imported(node: ast.AST, package: str) -> list[str]:
    """The absolute module names an import statement names (a `from m import x` names m and m.x)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, *([base] if base else [])])
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def upward_imports(root: Path, below: str = BELOW, above: str = ABOVE) -> list[str]:
    """`path:line: module` for every import of `above` (or a module inside it) from a file of `below`."""
    found = []
    folder = root / Path(*below.split("."))
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts)
        package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [n for n in _imported(node, package) if n == above or n.startswith(above + ".")]
            if names:
                found.append(f"{rel}:{node.lineno}: {names[0]}")
    return found


def test_no_model_file_imports_lora():
    assert (ROOT / "titan_thd" / "models" / "projection.py").is_file()  # the scan looks where the code is
    found = upward_imports(ROOT)
    assert not found, "titan_thd/models/ imports titan_thd.lora (lora sits above the models):\n" + "\n".join(
        found
    )


def test_checker_finds_upward_imports(tmp_path):
    files = {
        "titan_thd/models/a.py": "from titan_thd.lora.targets import attach\nimport torch\n",
        "titan_thd/models/fam/b.py": "def f():\n    import titan_thd.lora.merge\n",
        "titan_thd/models/fam/c.py": "from ...lora import targets\nfrom ..projection import Linear\n",
        "titan_thd/models/fam/__init__.py": "from titan_thd import lora\n",
        "titan_thd/models/ok.py": "from titan_thd.models.projection import Linear\nfrom titan_thd import models\n",
        "titan_thd/lora/up.py": "from titan_thd.lora.targets import attach\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert upward_imports(tmp_path) == [
        "titan_thd/models/a.py:1: titan_thd.lora.targets",
        "titan_thd/models/fam/__init__.py:1: titan_thd.lora",
        "titan_thd/models/fam/b.py:2: titan_thd.lora.merge",
        "titan_thd/models/fam/c.py:1: titan_thd.lora",
    ]


def test_no_type_only_imports():
    """An `if TYPE_CHECKING:` import hides a loop between two modules instead of breaking it (the three
    once in models/hf/ were a type-only loop between the spec and the HF package)."""
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "titan_thd").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.strip().startswith("if TYPE_CHECKING")
    ]
    assert not found, found
