"""Sphinx configuration of the weft_sync documentation (built with ``-W``: a warning fails)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # document this checkout, not an installed copy

import weft_sync  # noqa: E402

project = "weft_sync"
author = "weft_sync contributors"
copyright = "2026, weft_sync contributors"
release = weft_sync.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "cli_reference",
]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

html_theme = "furo"
html_title = f"weft_sync {release}"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
