"""`python -m titan_thd.check`: see titan_thd/check/__init__.py."""

import sys

from titan_thd.check.cli import main

sys.exit(main())
