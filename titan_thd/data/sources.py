"""Dataset files: reading (jsonl, jsonl.gz, parquet), schema detection and normalisation.

Every record becomes either `{"messages": [{"role", "content"}, ...]}` (a chat conversation whose
first turn is a system turn, possibly empty) or `{"text": str}` (pre-training text). Records
carry their provenance (`path:LINE` for jsonl, 1-based line; `path:row N` for parquet, 0-based
row index) so every error can point at the offending record.

Schema detection looks at the columns of the first record; the first rule that matches wins:

    messages   a `messages` column: OpenAI chat messages (role / content)
    sharegpt   a `conversations` column: turns of {from, value}
    alpaca     one of instruction|prompt|query|question AND one of output|response|completion|answer
               (optional input|context, appended to the instruction after a blank line)
    text       a `text` column: raw text, every token trained

Roles: human, user -> user; gpt, assistant, model, chatgpt, bing, bard -> assistant;
system, developer -> system; tool, function, observation, ipython -> tool (matched lower-cased;
used for sharegpt `from` and for `messages` roles alike). Missing role -> user, None content -> "".
A top-level string `system` field (sharegpt, alpaca) becomes the system turn. Among synonyms the
first non-empty one wins.

Refused with a ValueError (never coerced): any other role name (a guess would train the wrong
turns), turn content that is not a string (multi-modal lists), non-string instruction / input /
output / text fields, lines that are not UTF-8 JSON objects, unreadable gzip / Parquet files.
Out of scope: tool-call structures, oasst message trees, preference pairs.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from titan_thd.config.choices import Schema

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

SCHEMAS: tuple[str, ...] = get_args(Schema)
INSTRUCTION_KEYS = ("instruction", "prompt", "query", "question")
OUTPUT_KEYS = ("output", "response", "completion", "answer")
INPUT_KEYS = ("input", "context")
ROLE_MAP = {
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "assistant", "model", "chatgpt", "bing", "bard"), "assistant"),
    **dict.fromkeys(("system", "developer"), "system"),
    **dict.fromkeys(("tool", "function", "observation", "ipython"), "tool"),
}
_SCHEMA_HELP = (
    "messages (column 'messages'), sharegpt ('conversations'), "
    f"alpaca (one of {'|'.join(INSTRUCTION_KEYS)} and one of {'|'.join(OUTPUT_KEYS)}), text ('text')"
)


@dataclass(frozen=True)
class Record:
    where: str
    """Provenance, `path:LINE` (jsonl) or `path:row N` (parquet)."""
    data: dict
    """Normalised record: {"messages": [...]} or {"text": str}."""


def resolve_data_path(path: str | Path, field: str = "data.path") -> Path:
    """An existing file or folder: absolute as given; relative against the working directory
    first, then the package assets (`titan_thd/assets/`). `field` names the setting in errors."""
    p = Path(path).expanduser()
    tried = [p] if p.is_absolute() else [Path.cwd() / p, ASSETS_DIR / p]
    for candidate in tried:
        if candidate.exists():
            return candidate.resolve()
    raise ValueError(f"{field}: {str(path)!r} not found; tried {', '.join(str(t) for t in tried)}")


def detect_schema(columns: Iterable[str]) -> str:
    """The schema of a record with these column names (rules in the module docstring)."""
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if "conversations" in cols:
        return "sharegpt"
    if cols & set(INSTRUCTION_KEYS) and cols & set(OUTPUT_KEYS):
        return "alpaca"
    if "text" in cols:
        return "text"
    raise ValueError(
        f"cannot infer the record schema from columns {sorted(cols)}; known schemas: {_SCHEMA_HELP}; "
        "set data.format to force one"
    )


def read_records(path: str | Path, fmt: str = "auto", reader: str | None = None) -> Iterator[Record]:
    """Normalised records of a dataset file, read lazily.

    fmt: `auto` (detect from the first record's columns) or one of SCHEMAS to force it.
    reader: `jsonl` or `parquet`; None picks by suffix (`.parquet` -> parquet, else jsonl,
    gzip-compressed when the file starts with the gzip magic bytes).
    """
    if fmt != "auto" and fmt not in SCHEMAS:
        raise ValueError(f"data.format: got {fmt!r}, expected auto or one of {list(SCHEMAS)}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data.path: {path} is not a readable file")
    if reader is None:
        reader = "parquet" if path.suffix == ".parquet" else "jsonl"
    if reader not in ("jsonl", "parquet"):
        raise ValueError(f"unknown reader {reader!r}, expected jsonl or parquet")
    rows = _parquet_rows(path) if reader == "parquet" else _jsonl_rows(path)
    return _normalised(path, rows, fmt)


def _normalised(path: Path, rows: Iterator[tuple[str, dict]], fmt: str) -> Iterator[Record]:
    schema = None if fmt == "auto" else fmt
    for where, row in rows:
        if schema is None:
            try:
                schema = detect_schema(row.keys())
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        yield Record(where, normalise(row, schema, where))
    if schema is None:
        raise ValueError(f"{path}: empty dataset (no records)")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        compressed = f.read(2) == b"\x1f\x8b"
    lineno = 0
    try:
        with gzip.open(path, "rb") if compressed else open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                    ) from None
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
                yield where, row
    except (OSError, EOFError, zlib.error) as e:
        kind = "a corrupt or truncated gzip file" if compressed else "an unreadable file"
        raise ValueError(f"{path}: cannot read {kind} (at line {lineno + 1}): {e}") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        row_index = 0
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"{path}:row {row_index}", row
                row_index += 1
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: cannot read parquet: {e}") from e


# ============================================================================ normalisation
def normalise(record: dict, schema: str, where: str) -> dict:
    """{"messages": [...]} (first turn a system turn) or {"text": str}; ValueError naming `where`
    and the field for anything that cannot be represented."""
    if schema == "text":
        return {"text": _string(record, "text", where, required=True)}
    if schema == "messages":
        turns = [
            _turn(m, "role", "content", f"messages[{i}]", where)
            for i, m in enumerate(_list(record, "messages", where))
        ]
    elif schema == "sharegpt":
        turns = [
            _turn(t, "from", "value", f"conversations[{i}]", where)
            for i, t in enumerate(_list(record, "conversations", where))
        ]
    elif schema == "alpaca":
        instruction = _first_string(record, INSTRUCTION_KEYS, where)
        output = _first_string(record, OUTPUT_KEYS, where)
        extra = _first_string(record, INPUT_KEYS, where)
        if instruction is None or output is None:
            missing = INSTRUCTION_KEYS if instruction is None else OUTPUT_KEYS
            raise ValueError(f"{where}: alpaca record has no non-empty field among {'|'.join(missing)}")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    else:
        raise ValueError(f"{where}: unknown schema {schema!r}, expected one of {list(SCHEMAS)}")
    if not turns:
        raise ValueError(f"{where}: conversation has no turns")
    if schema != "messages":
        system = _string(record, "system", where, required=False)
        if system and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": system})
    if turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": ""})
    return {"messages": turns}


def _turn(turn: object, role_key: str, content_key: str, name: str, where: str) -> dict:
    if not isinstance(turn, dict):
        raise ValueError(
            f"{where}: {name}: expected an object with {role_key!r} and {content_key!r}, got {turn!r:.80}"
        )
    role = turn.get(role_key)
    if role is not None and not isinstance(role, str):
        raise ValueError(f"{where}: {name}.{role_key}: expected a string, got {type(role).__name__}")
    content = turn.get(content_key)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(
            f"{where}: {name}.{content_key}: expected a string, got {type(content).__name__} "
            "(multi-modal / structured content is not supported)"
        )
    mapped = ROLE_MAP.get((role or "user").lower())
    if mapped is None:
        raise ValueError(
            f"{where}: {name}.{role_key}: unknown role {role!r}; expected one of {', '.join(ROLE_MAP)} "
            "(any case)"
        )
    return {"role": mapped, "content": content}


def _list(record: dict, key: str, where: str) -> list:
    if key not in record:
        raise ValueError(f"{where}: field {key!r} missing; columns found: {sorted(record)}")
    value = record[key]
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {key!r}: expected a list of turns, got {type(value).__name__}")
    return value


def _string(record: dict, key: str, where: str, required: bool) -> str | None:
    if key not in record and required:
        raise ValueError(f"{where}: field {key!r} missing; columns found: {sorted(record)}")
    value = record.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: field {key!r}: expected a string, got {type(value).__name__} ({value!r:.80})"
        )
    return value


def _first_string(record: dict, keys: tuple[str, ...], where: str) -> str | None:
    for key in keys:
        value = _string(record, key, where, required=False)
        if value:
            return value
    return None
