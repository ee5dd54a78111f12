"""Loading a configuration: defaults, then the TOML file, then `--section.field value` overrides.

Precedence: command line > TOML file (`--job.config_file`) > defaults; `load_config` then runs the
checks (checks.py). Every value is coerced to its field's annotation (`coerce`); unknown sections
and keys, wrong types and unreadable files are `ValueError`s that name the origin (the file or
"command line"), the key, the value and what is allowed, with the closest valid name.

    cfg = load_config(["--job.config_file", "train_configs/debug_dense_thd.toml",
                       "--training.steps", "20"])
"""

from __future__ import annotations

import json
import sys
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from titan_thd.config.checks import validate
from titan_thd.config.jsonfile import read_json_object
from titan_thd.config.schema import closest, field_type, section_types
from titan_thd.config.sections import Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# ============================================================================ coercion
def coerce(key: str, value: Any, typ: Any, from_cli: bool) -> Any:
    """Convert `value` to `typ` (from the command line: from its text); ValueError naming the key, the
    value and the expected type. Also used for the entries of [model.args] (`get_model_args`,
    titan_thd/models/__init__.py)."""

    def bad(expected: str) -> ValueError:
        return ValueError(f"{key}: got {value!r}, expected {expected}")

    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad("true or false")
    if typ is int:
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise bad("an integer")
    if typ is float:
        if isinstance(value, bool):
            raise bad("a number")
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("a number")
    # A union (training.compile: bool | Literal["auto"]): the first arm that takes the value.
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        expected = []
        for arm in typing.get_args(typ):
            try:
                return coerce(key, value, arm, from_cli)
            except ValueError as e:
                expected.append(str(e).partition(", expected ")[2])
        raise bad(", or ".join(expected))
    if typing.get_origin(typ) is Literal:
        allowed = typing.get_args(typ)
        if value in allowed:
            return value
        raise bad(f"one of {', '.join(allowed)}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    if typing.get_origin(typ) is tuple:  # tuple[X, ...]: a list, or comma-separated on the command line
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        item = typing.get_args(typ)[0]
        return tuple(coerce(f"{key}[{i}]", v, item, from_cli) for i, v in enumerate(value))
    if typ is dict or typing.get_origin(typ) is dict:
        if isinstance(value, dict):
            return value
        if from_cli and isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                try:
                    parsed = tomllib.loads(f"v = {value}")["v"]
                except tomllib.TOMLDecodeError:
                    parsed = None
            if isinstance(parsed, dict):
                return parsed
        if isinstance(value, str) and value.endswith(".json"):
            return _json_table(key, value)
        raise bad('a table, e.g. {"mode": "file", "path": "lengths.csv"}, or the path of a .json file')
    raise AssertionError(f"unsupported config type {typ} for {key}")


def _json_table(key: str, value: str) -> dict:
    """The JSON object of file `value` (relative to the working directory); ValueError naming the key,
    the file and, for bad JSON, its line and column."""
    return read_json_object(Path(value).expanduser().absolute(), prefix=f"{key} = {value!r}: ")


# ============================================================================ loading
# Fields that are open tables: `--section.field.KEY VALUE` sets one entry (checked by the component
# that reads the table).
_TABLES = ("model.args",)
# [model] settings that moved into [model.args] (they belong to one model family).
_MOVED_TO_MODEL_ARGS = (
    "attention_backend",
    "mtp_loss_weight",
    "indexer_loss_coeff",
    "indexer_loss_mode",
    "router_bias_update_rate",
)


def _table_entry(value: Any, from_cli: bool) -> Any:
    """A table entry's value: from the command line a TOML literal when it reads as one (0.2, true,
    ["a", "b"]), else the text itself; from a TOML file as it is."""
    if not from_cli or not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _apply(cfg: Config, key: str, value: Any, from_cli: bool, origin: str) -> None:
    sections = section_types()
    section, _, name = key.partition(".")
    if section not in sections or not name:
        raise ValueError(f"{origin}: unknown config section '{section}'.{closest(section, list(sections))}")
    table, _, entry = key.rpartition(".")
    if table in _TABLES and entry:
        getattr(getattr(cfg, section), table.partition(".")[2])[entry] = _table_entry(value, from_cli)
        return
    if section == "model" and name in _MOVED_TO_MODEL_ARGS:
        raise ValueError(
            f"{origin}: model.{name} is a setting of one model family: write it as --model.args.{name} "
            f"VALUE (TOML: `{name} = ...` under [model.args])"
        )
    cls = sections[section]
    names = [f.name for f in fields(cls)]
    if name not in names:
        raise ValueError(
            f"{origin}: unknown key '{key}'.{closest(name, names)} Valid keys of [{section}]: {', '.join(names)}"
        )
    try:
        coerced = coerce(key, value, field_type(cls, name), from_cli)
    except ValueError as e:
        raise ValueError(f"{origin}: {e}") from None
    setattr(getattr(cfg, section), name, coerced)


def _load_toml(cfg: Config, path: Path) -> None:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"job.config_file: {path} is a folder, expected a TOML file") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x}), expected TOML"
        ) from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: top-level key '{section}' must be a [section] table")
        for name, value in table.items():
            _apply(cfg, f"{section}.{name}", value, from_cli=False, origin=str(path))


def _parse_cli(argv: list[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"command line: expected --section.field, got {arg!r}")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"command line: {arg} needs a value (booleans too: {arg} true)")
            # The next token is always the value, so negative numbers (-1) work as values.
            value = argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the TOML file (--job.config_file), then command-line overrides; validated."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = _parse_cli(argv)
    cfg = Config()
    for key, value in pairs:
        if key == "job.config_file":
            cfg.job.config_file = value
    if cfg.job.config_file:
        _load_toml(cfg, Path(cfg.job.config_file))
    for key, value in pairs:
        _apply(cfg, key, value, from_cli=True, origin="command line")
    validate(cfg)
    return cfg
