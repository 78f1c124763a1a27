"""``python -m weft_sync``: the command line."""

from __future__ import annotations

import sys

try:
    from .cli.app import main

    sys.exit(main())
except KeyboardInterrupt:
    # Ctrl-C while the interpreter was still importing, before main() could catch it.
    sys.exit(130)
