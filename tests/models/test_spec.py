"""ModelSpec hooks are typed fields: a misspelt hook fails where the spec is built; the guide to adding a
model lists exactly the spec's fields; no code outside titan_thd/models/ names a model family, imports
one or tests for its classes."""

import ast
import collections.abc
import dataclasses
import inspect
import re
import types
import typing
from pathlib import Path

import pytest

from titan_thd.models import MODEL_NAMES, get_model_spec
from titan_thd.models.dsv4 import update_router_bias
from titan_thd.models.dsv4.decode import DSv4Decoder
from titan_thd.models.dsv4.hf_adapter import HF as DSV4_HF
from titan_thd.models.hf.adapter import HFAdapter
from titan_thd.models.llama.decode import LlamaDecoder
from titan_thd.models.spec import CompileSpec, ModelSpec, ParallelSpec, PipelineSpec


def test_misspelt_hook_is_a_type_error():
    with pytest.raises(TypeError, match="after_optimizer_stp"):
        ModelSpec(
            name="toy",
            flavors={},
            build=None,
            flops_per_step=None,
            parallel=ParallelSpec("zigzag"),
            after_optimizer_stp=print,
        )
    with pytest.raises(TypeError, match="hooks"):  # the old string-keyed dict is gone
        ModelSpec(
            name="toy", flavors={}, build=None, flops_per_step=None, parallel=ParallelSpec("zigzag"), hooks={}
        )


def test_specs_hooks():
    llama, dsv4 = get_model_spec("llama"), get_model_spec("dsv4")
    assert not llama.hf.initialises and llama.after_optimizer_step is None  # llama: HF export only
    assert dsv4.hf is DSV4_HF and dsv4.hf.initialises
    assert dsv4.after_optimizer_step is update_router_bias
    assert llama.decoder is LlamaDecoder and dsv4.decoder is DSv4Decoder  # generate picks them by spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.after_optimizer_step = update_router_bias


def _table_rows(text: str, heading: str) -> list[tuple[str, list[str] | None, str]]:
    """(name, documented arguments or None, type) of each row of the table under `heading` (up to
    the next heading): first column `name(a, b, *, c)` or `name`, second the type in backquotes."""
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)]
        if len(cells) > 3 and cells[1].startswith("`"):
            m = re.fullmatch(r"`(\w+)(?:\((.*)\))?`", cells[1])
            params = None if m.group(2) is None else [a.strip() for a in m.group(2).split(",")]
            rows.append((m.group(1), params, cells[2].strip("`").replace("\\|", "|")))
    return rows


def _positional(params: list[str]) -> list[str]:
    return params[: params.index("*")] if "*" in params else params


def _callable_args(hint) -> list | None:
    """The argument types of a Callable annotation (Optional unwrapped); ... as Ellipsis; None if the
    annotation is not a Callable."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is not collections.abc.Callable:
        return None
    return typing.get_args(hint)[0]


SPEC_TABLES = {
    "## 2. What a ModelSpec holds": ModelSpec,
    "### ParallelSpec": ParallelSpec,
    "### CompileSpec": CompileSpec,
    "### PipelineSpec": PipelineSpec,
    "### HFAdapter": HFAdapter,
}


def _hooks(cls, name: str) -> list:
    """Every registered family's value of the field `name` of `cls` (for Callable[..., R] fields,
    whose arguments the annotation does not say)."""
    specs = [get_model_spec(n) for n in MODEL_NAMES]
    owner = {ModelSpec: lambda s: s, ParallelSpec: lambda s: s.parallel, CompileSpec: lambda s: s.compile}
    return [getattr(owner[cls](s), name) for s in specs if getattr(owner[cls](s), name, None) is not None]


def test_the_guide_lists_exactly_the_spec_fields():
    """docs/adding_a_model.md's tables list every field of ModelSpec, ParallelSpec, CompileSpec,
    PipelineSpec and HFAdapter, in order, with its type as the dataclass annotates it, and each hook
    with as many arguments as its Callable takes (a `Callable[..., R]` hook: the positional and
    keyword-only arguments of every family's hook): a field added or changed without its line in the
    guide fails here."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "adding_a_model.md").read_text()
    for heading, cls in SPEC_TABLES.items():
        rows = _table_rows(text, heading)
        fields = dataclasses.fields(cls)
        assert [r[0] for r in rows] == [f.name for f in fields], heading
        hints = typing.get_type_hints(cls)
        for (name, params, documented), f in zip(rows, fields, strict=True):
            assert documented == f.type, (heading, name, documented, f.type)
            args = _callable_args(hints[name])
            assert (params is None) == (args is None), (heading, name, "a hook is written name(args)")
            if args is Ellipsis:
                for hook in _hooks(cls, name):
                    sig = inspect.signature(hook).parameters.values()
                    kw = [p.name for p in sig if p.kind is p.KEYWORD_ONLY]
                    assert len(_positional(params)) == sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig), (
                        name
                    )
                    assert params[len(_positional(params)) + 1 :] == kw, (name, hook, kw)
            elif args is not None:
                assert len(params) == len(args), (heading, name, params, args)


def _field_docs(path: Path, cls: str) -> dict[str, str]:
    """{field: its docstring} of a dataclass in a source file (the string after each annotation)."""
    body = next(
        n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls
    ).body
    return {
        a.target.id: d.value.value
        for a, d in zip(body, body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(d, ast.Expr) and isinstance(d.value, ast.Constant)
    }


def test_the_spec_docstrings_give_each_hook_its_arguments():
    """Each Callable field's docstring starts with its arguments, `(a, b) -> ...` or `a -> ...`, as many
    as the annotation takes (a `Callable[..., R]` hook: its keyword-only names are every family's)."""
    files = {HFAdapter: MODELS_DIR / "hf" / "adapter.py"}
    for cls in SPEC_TABLES.values():
        docs = _field_docs(files.get(cls, MODELS_DIR / "spec.py"), cls.__name__)
        for name, hint in typing.get_type_hints(cls).items():
            args = _callable_args(hint)
            if args is None:
                continue
            doc = " ".join(docs[name].split())
            m = re.match(r"\(([^()]*)\) ->", doc) or re.match(r"([^(),]+?) ->", doc)
            assert m, f"{cls.__name__}.{name}: the docstring should start with its arguments: {doc[:60]!r}"
            params = [a.strip() for a in m.group(1).split(",")]
            if args is Ellipsis:
                for hook in _hooks(cls, name):
                    kw = [
                        p.name
                        for p in inspect.signature(hook).parameters.values()
                        if p.kind is p.KEYWORD_ONLY
                    ]
                    assert params[len(_positional(params)) + 1 :] == kw, (cls.__name__, name, params, kw)
            else:
                assert len(params) == len(args), (cls.__name__, name, params, args)


REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "titan_thd" / "models"
FAMILIES = sorted(MODEL_NAMES)  # the family packages; models/hf/ is the generic HF door


def _generic_files() -> list[Path]:
    """The code that must know models only through their spec: titan_thd/ outside models/, and the
    user tools of scripts/. Tests, benchmarks/ and dev/ may reach into a family (they measure or
    check its modules)."""
    package = [p for p in (REPO / "titan_thd").rglob("*.py") if MODELS_DIR not in p.parents]
    return sorted(package + list((REPO / "scripts").rglob("*.py")))


def _family_classes() -> set[str]:
    """Every class a family package defines."""
    return {
        node.name
        for family in FAMILIES
        for path in (MODELS_DIR / family).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }


def _family_module(name: str) -> str | None:
    """The family a dotted module name lies in (titan_thd.models.<family>[.x]), or None."""
    parts = name.split(".")
    if parts[:2] == ["titan_thd", "models"] and len(parts) > 2 and parts[2] in FAMILIES:
        return parts[2]
    return None


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The module an ImportFrom names, relative imports resolved against the file's package."""
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(REPO).with_suffix("").parts[:-1])
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _names(node: ast.expr) -> set[str]:
    """The class names an isinstance / issubclass second argument mentions (x, m.x, (x, y))."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def family_references(text: str, path: Path, classes: set[str]) -> list[str]:
    """Each import of a family module (import, from-import, relative, importlib) and each isinstance /
    issubclass / `type(x) is` test against a family class in the source `text` of the file at `path`
    (where its relative imports start), as `line: what`."""
    found = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _family_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
            if any(_family_module(t) for t in targets):
                found.append(f"{node.lineno}: from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _family_module(arg.value):
                    found.append(f"{node.lineno}: {func}({arg.value!r})")
            if func in ("isinstance", "issubclass") and len(node.args) == 2:
                hit = _names(node.args[1]) & classes
                if hit:
                    found.append(f"{node.lineno}: {func}(..., {', '.join(sorted(hit))})")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            hit = set().union(*(_names(c) for c in node.comparators)) & classes
            if hit:
                found.append(f"{node.lineno}: `is` {', '.join(sorted(hit))}")
    return found


def test_the_family_guard_sees_every_form():
    """The checker itself: each way of importing a family or testing its class is reported, generic
    imports and look-ups by spec are not."""
    assert FAMILIES == ["dsv4", "llama"]
    classes = _family_classes()
    assert {"Llama", "DSv4Model", "Attention", "LlamaDecoder"} <= classes
    lines = [
        "import titan_thd.models.llama",
        "import titan_thd.models.dsv4.attention as a",
        "from titan_thd.models.dsv4 import spec",
        "from titan_thd.models import llama",
        "from ..models.llama.model import Llama",
        "importlib.import_module('titan_thd.models.dsv4')",
        "isinstance(m, Llama)",
        "isinstance(m, (int, dsv4_model.DSv4Model))",
        "issubclass(type(m), Attention)",
        "type(m) is Llama",
    ]
    good = [
        "from titan_thd.models import get_model_spec",
        "from titan_thd.models.spec import ModelSpec",
        "from titan_thd.models.decoding import Decoder",
        "import titan_thd.models",
        "spec = get_model_spec(cfg.model.name)",
        "isinstance(m, nn.Module)",
    ]
    # Read as if it were a module of titan_thd/inference/ (where its relative import starts).
    where = REPO / "titan_thd" / "inference" / "probe.py"
    found = family_references("\n".join(lines + good) + "\n", where, classes)
    assert [int(f.split(":")[0]) for f in found] == list(range(1, len(lines) + 1)), found


def test_no_family_is_imported_or_tested_by_class_outside_models():
    """Inference, the trainer, the data, parallel and pipeline code and the user tools reach a model
    family only through its ModelSpec (get_model_spec(name)): no import of titan_thd.models.<family>,
    no isinstance against a family's class."""
    classes = _family_classes()
    offenders = [
        f"{path.relative_to(REPO)}:{ref}"
        for path in _generic_files()
        for ref in family_references(path.read_text(), path, classes)
    ]
    assert not offenders, "\n".join(offenders)


def test_no_model_is_named_outside_its_package():
    """The trainer, data, parallel, pipeline and inference code and the user tools never test for a
    model by name (the spec says it all)."""
    offenders = []
    for path in _generic_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(
                r"""==\s*["'](llama|dsv4)["']|["'](llama|dsv4)["']\s*(==|in\b)|\b_FIRST\b|\b_LAST\b""", line
            ):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
