"""No module of the package, and no script, imports a private name of another titan_thd module
(`from titan_thd.x import _name`, a relative `from .x import _name`, `import titan_thd.x._y`): what
another module needs has a public name, so each mechanism has one door and a reader can tell what
a module offers from the names without an underscore.

Read from the source with `ast` (every import at any depth, lazy and TYPE_CHECKING ones included);
third-party private names (torch's `_StridedShard`, ...) are not ours to rename and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("titan_thd", "scripts")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root: Path, folders: tuple[str, ...] = FOLDERS) -> list[str]:
    """`path:line: what` for every import of a private titan_thd name under root/folders."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom):
                    ours = node.level > 0 or (node.module or "").split(".")[0] == "titan_thd"
                    modules = (node.module or "").split(".")
                    names = [a.name for a in node.names if _private(a.name)]
                    names += [node.module] if ours and any(_private(m) for m in modules) else []
                    if ours and names:
                        found += [
                            f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {n}"
                            for n in names
                        ]
                elif isinstance(node, ast.Import):
                    found += [
                        f"{rel}:{node.lineno}: import {a.name}"
                        for a in node.names
                        if a.name.split(".")[0] == "titan_thd" and any(_private(p) for p in a.name.split("."))
                    ]
    return found


def test_no_private_cross_module_import():
    assert (ROOT / "titan_thd" / "train.py").is_file()  # the scan looks where the code is
    found = private_imports(ROOT)
    assert not found, "private names imported from another module (give them a public name):\n" + "\n".join(
        found
    )


def test_checker_finds_private_imports(tmp_path):
    files = {
        "titan_thd/a.py": "from titan_thd.b import public, _hidden\n",
        "titan_thd/c.py": "def f():\n    from .b import _lazy\n",
        "titan_thd/d.py": "import titan_thd._impl\nfrom torch.distributed.tensor._utils import x\n",
        "scripts/"
        + "s.py": "from titan_thd.b import (\n    ok,\n    _too,\n)\nfrom torch.x import _StridedShard\n",
        "titan_thd/e.py": "from __future__ import annotations\nfrom titan_thd import __version__\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = [f.split(": ", 1)[1] for f in private_imports(tmp_path)]
    assert found == [
        "from titan_thd.b import _hidden",
        "from .b import _lazy",
        "import titan_thd._impl",
        "from titan_thd.b import _too",
    ]
