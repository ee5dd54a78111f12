"""Every documentation pointer resolves to a file and a heading that exist (CONTRIBUTING.md).

Pointer forms, each on one line: `docs/<name>.md`, `docs/<name>.md §N[.M]` (runs such as
`§3.1, §4`, `§2-§4`, `§2.5 / §3.1`), `docs/<name>.md pitfall N` (also after a run: `§5, pitfall 1`).
A `§N` needs a heading of that file that starts with the number (`## 9. Title`, `### 9.2 Title`),
`pitfall N` a heading `### Pitfall N: ...`. Inside docs/, `§N` alone refers to the same file and
`<name>.md §N` to a sibling. Pointers to notes outside the repository (the old research notes, the
old design file) and a `§` or `pitfall N` without a docs/ file are errors.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

_SEC = r"§\d+(?:\.\d+)*"
_RUN = rf"{_SEC}(?:[ \t]*(?:,|-|/|and)[ \t]*{_SEC})*"
_PITFALL = r"pitfall[ \t]+\d+"
# A file name, then optionally a run of sections and / or a pitfall, on the same line.
_REFS = rf"(?P<refs>[ \t]+(?:{_RUN}(?:[ \t]*,?[ \t]*{_PITFALL})?|{_PITFALL}))?"
POINTER = re.compile(rf"docs/(?P<name>[\w-]+)\.md{_REFS}")
DOC_POINTER = re.compile(rf"(?<![\w/.-])(?:docs/)?(?P<name>[\w-]+)\.md{_REFS}")  # inside docs/
BARE = re.compile(rf"(?P<refs>{_RUN}(?:[ \t]*,?[ \t]*{_PITFALL})?|{_PITFALL})")
# References to notes that live outside the repository, or to their old names; and to the issue
# tracker, which a reader of the code does not have ("issue 13", "the CP issue").
OLD_STYLE = re.compile(
    r"DESIGN\.md|\bresearch\b[ \t]*(?:§|/|note|[\w-]+\.md)|megatron_thd_spec|dsv4_architecture"
    r"|cpu_feasibility|torchtitan_anchor|tp_pp_ep\b|\.\./shared|shared/research"
    r"|\b[Ii]ssues?[ \t]+#?\d+\b|\bthe[ \t]+[\w-]+[ \t]+issue\b"
)
LEFTOVER = re.compile(r"§|\bpitfalls?[ \t]+\d|\bsections?[ \t]+\d")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t]*$", re.MULTILINE)
# The three drawers of files a person runs: what a user runs, benchmarks, developer harnesses and
# investigations. A path into one of them (`scripts/generate.py`, `./scripts/test.sh`) must exist.
DRAWERS = ("scripts", "benchmarks", "dev")
DRAWER_PATH = re.compile(
    r"(?:(?<=\./)|(?<![\w/.-]))(?:scripts|benchmarks|dev)/[\w-]+\.(?:py|sh|sbatch|txt)\b"
)


def scanned_files(root: Path) -> list[Path]:
    """Code, tests, scripts, configs and the top-level docs (this test file excluded)."""
    files = [p for d in ("titan_thd", "tests") for p in (root / d).rglob("*.py")]
    files += [p for d in DRAWERS for ext in ("*.py", "*.sh") for p in (root / d).rglob(ext)]
    files += sorted((root / "train_configs").glob("*.toml"))
    files += [root / n for n in ("run_train.sh", "pyproject.toml", "README.md", "CONTRIBUTING.md")]
    return sorted(p for p in files if p.is_file() and p.resolve() != THIS)


def anchors(doc: Path) -> tuple[set[str], set[str]]:
    """(section numbers, pitfall numbers) that the headings of `doc` define."""
    sections, pitfalls = set(), set()
    for m in HEADING.finditer(doc.read_text()):
        title = m.group("title")
        if num := re.match(r"(\d+(?:\.\d+)*)\.?(?:\s|$)", title):
            sections.add(num.group(1))
        if num := re.match(r"pitfall[ \t]+(\d+)\b", title, re.IGNORECASE):
            pitfalls.add(num.group(1))
    return sections, pitfalls


def parse_refs(refs: str | None) -> list[tuple[str, str]]:
    """[("§", "9.2"), ("pitfall", "1"), ...]; an integer range `§2-§4` also names §3."""
    if not refs:
        return []
    out = [("pitfall", n) for n in re.findall(r"pitfall[ \t]+(\d+)", refs)]
    for a, b in re.findall(r"§(\d+)[ \t]*-[ \t]*§(\d+)(?!\.)", refs):
        out += [("§", str(n)) for n in range(int(a) + 1, int(b))]
    return out + [("§", n) for n in re.findall(r"§(\d+(?:\.\d+)*)", refs)]


def check_text(path: Path, text: str, root: Path) -> tuple[list[str], int]:
    """(problems found in `text`, number of pointers checked)."""
    docs = root / "docs"
    in_docs = path.parent == docs
    problems, count = [], 0
    cache: dict[Path, tuple[set[str], set[str]]] = {}

    def resolve(target: Path, refs: list[tuple[str, str]], where: str, shown: str) -> None:
        nonlocal count
        count += 1
        if not target.is_file():
            problems.append(f"{where}: {shown}: {target.relative_to(root)} does not exist")
            return
        sections, pitfalls = cache.setdefault(target, anchors(target))
        for kind, value in refs:
            if value not in (sections if kind == "§" else pitfalls):
                problems.append(
                    f"{where}: {shown}: {target.relative_to(root)} has no heading for {kind} {value}"
                )

    covered = list(text)
    for m in (DOC_POINTER if in_docs else POINTER).finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        name = m.group("name")
        target = docs / f"{name}.md"
        if in_docs and not target.is_file() and (root / f"{name}.md").is_file():
            target = root / f"{name}.md"  # README.md, CONTRIBUTING.md
        resolve(target, parse_refs(m.group("refs")), f"{path.relative_to(root)}:{line}", m.group(0))
        covered[m.start() : m.end()] = " " * (m.end() - m.start())
    rest = "".join(covered)
    if in_docs:  # a bare `§N` or `pitfall N` in a note refers to the note itself
        for m in BARE.finditer(rest):
            line = rest.count("\n", 0, m.start()) + 1
            resolve(path, parse_refs(m.group("refs")), f"{path.relative_to(root)}:{line}", m.group(0))
    for m in OLD_STYLE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        problems.append(f"{path.relative_to(root)}:{line}: reference outside the repository: {m.group(0)!r}")
    if path.suffix != ".md":  # prose files may mention the forms themselves (CONTRIBUTING.md)
        for m in LEFTOVER.finditer(rest):
            line = rest.count("\n", 0, m.start()) + 1
            problems.append(
                f"{path.relative_to(root)}:{line}: {m.group(0)!r} is not part of a docs/<name>.md pointer"
            )
    return problems, count


def check_repository(root: Path) -> tuple[list[str], int, set[str]]:
    """(problems, pointers checked, names of docs/*.md referenced from outside docs/)."""
    problems, total, referenced = [], 0, set()
    for path in scanned_files(root) + sorted((root / "docs").glob("*.md")):
        text = path.read_text()
        found, count = check_text(path, text, root)
        problems += found
        total += count
        if path.parent != root / "docs":
            referenced |= {m.group("name") for m in POINTER.finditer(text)}
    return problems, total, referenced


def test_every_pointer_resolves():
    problems, total, referenced = check_repository(ROOT)
    assert not problems, "\n".join(problems)
    assert total >= 60, f"only {total} pointers found: the scan looks in the wrong places"
    unreferenced = {p.stem for p in (ROOT / "docs").glob("*.md")} - referenced
    assert not unreferenced, f"docs never pointed to from code, README or CONTRIBUTING: {unreferenced}"


def drawer_paths(root: Path) -> tuple[list[str], set[str]]:
    """(paths into a drawer that do not exist, drawer files named by some file other than themselves)."""
    missing, named = [], set()
    for path in scanned_files(root) + sorted((root / "docs").glob("*.md")):
        text = path.read_text()
        for m in DRAWER_PATH.finditer(text):
            if not (root / m.group(0)).exists():
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{path.relative_to(root)}:{line}: {m.group(0)} does not exist")
            elif (root / m.group(0)).resolve() != path.resolve():
                named.add(m.group(0))
    return missing, named


def test_every_drawer_file_exists_and_is_named():
    """scripts/, benchmarks/ and dev/ hold nothing unreferenced, and every path into them resolves
    (a moved script leaves no stale pointer behind)."""
    missing, named = drawer_paths(ROOT)
    assert not missing, "\n".join(missing)
    files = {str(p.relative_to(ROOT)) for d in DRAWERS for p in (ROOT / d).iterdir() if p.is_file()}
    assert len(files) >= 20, f"only {len(files)} files in {DRAWERS}: the scan looks in the wrong places"
    assert not files - named, f"never named outside themselves: {sorted(files - named)}"


def test_drawer_checker(tmp_path):
    root = _fake_repo(tmp_path, '"""Run ./scripts/a.sh, benchmarks/b.py and dev/gone.py; not /dev/null."""\n')
    (root / "scripts" / "a.sh").write_text("")
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "b.py").write_text('"""benchmarks/b.py names only itself."""\n')
    missing, named = drawer_paths(root)
    assert [m.split(": ", 1)[1] for m in missing] == ["dev/gone.py does not exist"]
    assert named == {"scripts/a.sh", "benchmarks/b.py"}


def _fake_repo(tmp_path: Path, code: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "note.md").write_text(
        "# Note\n## 9. Context\n### 9.2 Exchange\n## 13. Pitfalls\n### Pitfall 10: indexer\n"
        "See §9.2 and pitfall 10.\n"
    )
    for d in ("titan_thd", "tests", "scripts", "train_configs"):
        (tmp_path / d).mkdir()
    (tmp_path / "titan_thd" / "mod.py").write_text(code)
    return tmp_path


@pytest.mark.parametrize(
    "code",
    [
        '"""Fine (docs/note.md §9.2, docs/note.md §9, pitfall 10; docs/note.md §9-§9.2; docs/note.md)."""\n',
        "# docs/note.md pitfall 10 and docs/note.md §9.2 / §9\n",
        '"""docs/note.md §9.2, docs/note.md §9 and docs/note.md: the step issues 39k calls."""\n',
    ],
)
def test_checker_accepts_valid_pointers(tmp_path, code):
    problems, total, _ = check_repository(_fake_repo(tmp_path, code))
    assert problems == [] and total >= 3


@pytest.mark.parametrize(
    "code, message",
    [
        ('"""See docs/note.md §9.3."""\n', "has no heading for § 9.3"),
        ('"""See docs/note.md §9, pitfall 2."""\n', "has no heading for pitfall 2"),
        ('"""See docs/other.md §1."""\n', "docs/other.md does not exist"),
        ('"""See DESIGN.md section 3.1."""\n', "reference outside the repository: 'DESIGN.md'"),
        ('"""See research §9.2."""\n', "reference outside the repository: 'research §'"),
        (
            "# pipeline parallelism (issue 10): the stage split\n",
            "reference outside the repository: 'issue 10'",
        ),
        ('"""2x slower, issue 13 note."""\n', "reference outside the repository: 'issue 13'"),
        ('"""added by the CP issue"""\n', "reference outside the repository: 'the CP issue'"),
        ('"""(pitfall 10)"""\n', "'pitfall 1' is not part of a docs/<name>.md pointer"),
        ('"""(§9.2)"""\n', "'§' is not part of a docs/<name>.md pointer"),
    ],
)
def test_checker_reports_bad_pointers(tmp_path, code, message):
    problems, _, _ = check_repository(_fake_repo(tmp_path, code))
    assert any(message in p for p in problems), problems


# A repository path in the package's prose: segments joined by `/`, ending in a file name with a known
# extension. Not a path: globs (`tests/*.py`), placeholders (`models/<family>/decode.py`,
# `{folder}/x.json`, `train_configs/X.toml`), URLs and absolute paths (`/proc/cpuinfo`), dotted names
# (`parallel/shards.local_box`).
_EXTENSIONS = "py|md|sh|toml|txt|json|jsonl|gz|sbatch|yaml|yml|parquet|npy|safetensors"
PROSE_PATH = re.compile(
    rf"(?:(?<=\./)|(?<![\w/.<>{{}}*$~@:%-]))(?:[\w.-]+/)+[\w.-]*?\.(?:{_EXTENSIONS})(?!\.?[\w/*<>{{}}-])"
)
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z](?:\.|/|$)")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (also an attribute's: a string statement) and comment of `path`."""
    src = path.read_text()
    out = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(src, filename=str(path)))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    return out + [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


def package_paths(root: Path) -> tuple[list[str], int]:
    """(paths named in titan_thd/'s docstrings and comments that do not exist, paths checked). A path is
    looked up from the repository root, from titan_thd/ and from the folders between the file and
    titan_thd/, wherever its first folder exists; one whose first folder exists nowhere (`out_dir/...`,
    a run folder's files) is not a repository path."""
    package, missing, count = root / "titan_thd", [], 0
    for path in sorted(package.rglob("*.py")):
        bases = [root, package, *(p for p in path.parents if p.is_relative_to(package) and p != package)]
        for line, text in prose(path):
            for m in PROSE_PATH.finditer(text):
                rel = m.group(0)
                found = [b for b in bases if (b / rel.split("/")[0]).is_dir()]
                if not found or PLACEHOLDER.search(rel):
                    continue
                count += 1
                if not any((b / rel).exists() for b in found):
                    at = line + text.count("\n", 0, m.start())
                    missing.append(f"{path.relative_to(root)}:{at}: {rel} does not exist")
    return missing, count


def test_every_path_in_the_package_prose_exists():
    """A file the package's docstrings or comments name exists (a moved or renamed file leaves no stale
    pointer in the code)."""
    missing, count = package_paths(ROOT)
    assert not missing, "\n".join(missing)
    assert count >= 50, f"only {count} paths found: the scan looks in the wrong places"


def test_package_path_checker(tmp_path):
    (tmp_path / "titan_thd" / "sub").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    (tmp_path / "titan_thd" / "sub" / "here.py").write_text("")
    code = (
        '"""Tested in tests/test_a.py and tests/test_gone.py; see sub/here.py, ./sub/here.py and sub/old.py.\n\n'
        "Not paths: tests/*.py, sub/<name>/x.py, {out}/meta.json, train_configs/X.toml, /proc/cpuinfo,\n"
        'https://example.com/sub/x.py, sub/here.local_box, out_dir/rows.parquet."""\n\n'
        'X = 1\n"""An attribute docstring naming tests/missing.py."""\n'
        "y = 2  # a comment naming sub/here.py and docs/gone.md\n"
        'z = "a string that is no docstring: tests/not_prose.py"\n'
    )
    (tmp_path / "titan_thd" / "mod.py").write_text(code)
    (tmp_path / "docs").mkdir()
    missing, count = package_paths(tmp_path)
    assert [m.split(": ", 1) for m in missing] == [
        ["titan_thd/mod.py:1", "tests/test_gone.py does not exist"],
        ["titan_thd/mod.py:1", "sub/old.py does not exist"],
        ["titan_thd/mod.py:7", "tests/missing.py does not exist"],
        ["titan_thd/mod.py:8", "docs/gone.md does not exist"],
    ]
    assert count == 8
