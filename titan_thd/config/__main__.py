"""`python -m titan_thd.config`: check a configuration and print it merged, or print --help.

run_train.sh runs it before torchrun, so a config error is one `error:` line (exit code 2) and
costs no process launch.
"""

from __future__ import annotations

import os
import sys

from titan_thd.config.loader import load_config
from titan_thd.config.render import help_text, to_toml


def main(argv: list[str] | None = None) -> int:
    """`python -m titan_thd.config [--job.config_file X.toml] [--section.field value ...]`: check a
    configuration without starting anything and print it merged, as TOML (run_train.sh runs this
    before torchrun, so a typo costs no process launch)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
    except ValueError as e:
        if os.environ.get("TITAN_THD_DEBUG", "") not in ("", "0"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_toml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
