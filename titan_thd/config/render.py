"""The configuration as text: `to_toml` (the merged run, what --job.print_config prints; a TOML file
that loads back to the same configuration) and `help_text` (every field with its default, its
choices and its docstring, what --help prints), both in the order of sections.py.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from titan_thd.config.schema import CHOICES, field_docs
from titan_thd.config.sections import Config


def to_toml(cfg: Config) -> str:
    """The merged configuration as TOML (what --job.print_config prints)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {fmt(x)}" for k, x in v.items()) + " }"
        if isinstance(v, (tuple, list)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    out = []
    for f in fields(Config):
        out.append(f"[{f.name}]")
        section = getattr(cfg, f.name)
        out += [f"{g.name} = {fmt(getattr(section, g.name))}" for g in fields(section)]
        out.append("")
    return "\n".join(out)


def help_text() -> str:
    docs = field_docs()
    lines = ["titan_thd training options (--section.field value; TOML [section] field = value):", ""]
    defaults = Config()
    for f in fields(Config):
        lines.append(f"[{f.name}]")
        for g in fields(getattr(defaults, f.name)):
            key = f"{f.name}.{g.name}"
            default = getattr(getattr(defaults, f.name), g.name)
            choices = f" {{{'|'.join(CHOICES[key])}}}" if key in CHOICES else ""
            lines.append(f"  --{key}{choices} (default: {default!r})")
            lines.append(f"      {docs.get(key, '')}")
        lines.append("")
    lines.append(
        "Errors in the input are one `error:` line (exit code 2); TITAN_THD_DEBUG=1 shows the traceback."
    )
    return "\n".join(lines)
