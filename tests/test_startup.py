"""Start-up decides the run once (titan_thd/startup.py): `resolve_run` returns a frozen `Run` and never
writes the config; nothing after it reads the raw fields it resolves, or writes any config field; the
Trainer keeps no copy of a `Run` field (it reads `self.run.<field>`), and its attribute legend lists
exactly the attributes it sets."""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from pathlib import Path

import pytest

from titan_thd.config import load_config
from titan_thd.run import Run
from titan_thd.startup import resolve_run

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # every field start-up resolves, left to it: flavor "", pad_to_multiple 0, compile auto, cp mode auto
    "llama defaults, cp 2": (["--parallelism.context_parallel_degree", "2"], 2),
    "dsv4, empty flavor, cp 2": (["--model.name", "dsv4", "--parallelism.context_parallel_degree", "2"], 2),
    "dsv4 pp 2 x tp 2": (
        ["--model.name", "dsv4", "--model.flavor", "micro", "--parallelism.pipeline_parallel_degree", "2"]
        + ["--parallelism.tensor_parallel_degree", "2", "--training.tokens_per_microbatch", "256"],
        4,
    ),
    "hybrid cp": (
        ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_mode", "hybrid"],
        2,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resolve_run_decides_without_writing_the_config(case, tmp_path):
    argv, world = CASES[case]
    cfg = load_config([*argv, "--job.dump_folder", str(tmp_path)])
    before = copy.deepcopy(cfg)
    run = resolve_run(cfg, world)
    assert cfg == before, "resolve_run wrote the config"
    assert cfg.model.flavor == before.model.flavor and cfg.data.pad_to_multiple == before.data.pad_to_multiple
    # The decisions, each read from the Run (independently derived here from the rules in the docs).
    spec_default = {"llama": "debug", "dsv4": "tiny"}
    assert run.flavor == (cfg.model.flavor or spec_default[cfg.model.name])
    cp = cfg.parallelism.context_parallel_degree
    expected_mode = (
        cfg.parallelism.context_parallel_mode
        if cfg.parallelism.context_parallel_mode != "auto"
        else {"llama": "zigzag", "dsv4": "contiguous"}[cfg.model.name]
    )
    assert run.cp_mode == expected_mode
    assert run.pad_to_multiple == (2 * cp if cp > 1 and expected_mode != "contiguous" else 1)
    assert run.hybrid_threshold == cfg.training.tokens_per_microbatch // cp
    assert isinstance(run.compile.on, bool) and cfg.training.compile == "auto"
    assert run.layout(0).pad_to_multiple == run.pad_to_multiple and run.layout(0).rule is run.rule
    assert run.dims.world_size == world
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.flavor = "other"  # type: ignore[misc]


def _sources() -> list[Path]:
    files = [*(ROOT / "titan_thd").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    for extra in ("benchmarks", "dev"):
        files += (ROOT / extra).rglob("*.py")
    return [f for f in files if "config" not in f.relative_to(ROOT).parts and f.name != "startup.py"]


# Reads of the config fields start-up resolves: `<anything>.data.pad_to_multiple`, `.model.flavor`,
# `.training.compile`, `.parallelism.context_parallel_mode`, `.parallelism.hybrid_cp_threshold`.
_RAW_READ = re.compile(
    r"\.(data\.pad_to_multiple|model\.flavor|training\.compile|parallelism\.context_parallel_mode"
    r"|parallelism\.hybrid_cp_threshold)\b"
)
# A write of any config field: `cfg.section.field = ...` / `setattr(cfg.section, ...)`.
_WRITE = re.compile(r"^\s*(self\.)?(cfg|config|c)\.[a-z_]+\.[a-z_]+\s*=[^=]|setattr\((self\.)?(cfg|config)\b")


def _code_lines(path: Path):
    """(number, code) of each line outside docstrings, comments dropped and string literals reduced to
    the expressions of their `{...}` fields (an f-string's fields are code, its text is not)."""
    in_doc = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if in_doc or stripped.startswith(('"""', "'''")):
            if (stripped.count('"""') + stripped.count("'''")) % 2:
                in_doc = not in_doc
            continue
        code = re.sub(r"\"[^\"]*\"|'[^']*'", lambda m: " ".join(re.findall(r"\{([^{}]*)\}", m.group())), line)
        yield n, code.split("#", 1)[0]


def test_nothing_after_start_up_reads_a_field_it_resolves_or_writes_the_config():
    raw, writes = [], []
    for path in _sources():
        for n, code in _code_lines(path):
            where = f"{path.relative_to(ROOT)}:{n}"
            if _RAW_READ.search(code):
                raw.append(where)
            if _WRITE.search(code):
                writes.append(where)
    assert not raw, f"read the Run instead of these raw config fields: {raw}"
    assert not writes, f"the config is written after loading: {writes}"


RUN_FIELDS = {f.name for f in dataclasses.fields(Run)}


def _run_field(node: ast.AST) -> str | None:
    """The Run field an expression reads as it is, `run.<field>...` or `self.run.<field>...`, else None."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    chain.reverse()
    if isinstance(node, ast.Name) and node.id == "self" and chain[:1] == ["run"]:
        chain = chain[1:]
    elif not (isinstance(node, ast.Name) and node.id == "run"):
        return None
    return chain[0] if chain and chain[0] in RUN_FIELDS else None


def _run_copies(path: Path) -> list[int]:
    """Lines that copy a Run field onto `self`: `self.spec = run.spec`, `self.a, self.b = run.a, run.b`,
    `self.t = self.run.cfg.training` (a second holder of a decision that `run` holds)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts, strict=False))
            for t, v in pairs:
                on_self = (
                    isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                )
                if on_self and t.attr != "run" and _run_field(v) is not None:
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_the_trainer_keeps_no_copy_of_a_run_field():
    copies = _run_copies(ROOT / "titan_thd" / "train.py")
    assert not copies, (
        f"titan_thd/train.py copies Run fields onto the Trainer (read self.run.<field>): lines {copies}"
    )


def test_the_trainer_legend_lists_exactly_its_attributes():
    """The annotations at the top of `Trainer` are its table of contents: every attribute a method sets
    is listed there, and nothing else is."""
    tree = ast.parse((ROOT / "titan_thd" / "train.py").read_text())
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    legend = {
        n.target.id for n in trainer.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    set_ = {
        t.attr
        for n in ast.walk(trainer)
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    assert "run" in legend and "step" in set_  # the probe reads what it should
    assert legend == set_, (
        f"set but not in the legend: {sorted(set_ - legend)}; listed, never set: {sorted(legend - set_)}"
    )


def test_the_guards_catch_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        'x = run.flavor  # fine\ny = cfg.model.flavor\ncfg.data.pad_to_multiple = 4\nmsg = "cfg.model.flavor"\n'
        "self.spec = run.spec\nself.run, cfg = run, run.cfg  # fine: the run itself, a local\n"
        "self.a, self.dims = 1, run.dims\nself.t = self.run.cfg.training\nself.memory = plan_memory(run)  # fine\n"
    )
    lines = dict(_code_lines(probe))
    assert [n for n, c in lines.items() if _RAW_READ.search(c)] == [2, 3]
    assert [n for n, c in lines.items() if _WRITE.search(c)] == [3]
    assert _run_copies(probe) == [5, 7, 8]
