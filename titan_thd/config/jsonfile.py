"""Read a JSON object from a file, with errors that name the file (and, for bad JSON, line and column)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, prefix: str = "", missing: str = "") -> dict[str, Any]:
    """The JSON object in `path`; ValueError `<prefix><path> ...` otherwise (`missing`: a hint
    added when the file does not exist)."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{prefix}{path} does not exist{missing}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{prefix}{path}: invalid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{prefix}cannot read {path}: {e}") from None
    if not isinstance(table, dict):
        raise ValueError(f"{prefix}{path} holds a JSON {type(table).__name__}, expected an object")
    return table
