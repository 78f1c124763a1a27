"""Print the requirements of one of setup.cfg's extras, one a line (for ``pip install -r -``).

The CI scripts install an extra's tools without reinstalling the package itself, so the pins
stay in one place (setup.cfg) and an editable install elsewhere is left as it is.
"""

from __future__ import annotations

import configparser
import sys
from pathlib import Path

config = configparser.ConfigParser()
config.read(Path(__file__).resolve().parent.parent / "setup.cfg")
extra = sys.argv[1]
try:
    lines = config["options.extras_require"][extra]
except KeyError:
    sys.exit(f"setup.cfg has no extra {extra!r}")
print("\n".join(line.strip() for line in lines.splitlines() if line.strip()))
