"""``.. weft-cli::``: the ``weft-sync`` command line reference, generated from its own parser.

Every subcommand's ``--help`` text is rendered from ``weft_sync.cli.app``'s argparse parser at build
time, so the reference cannot drift from what the program accepts.
"""

from __future__ import annotations

import argparse
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def build_cli_parser() -> argparse.ArgumentParser:
    """The ``weft-sync`` program's own argument parser."""
    from weft_sync.cli.app import _build_parser

    return _build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse offers no public way to list subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


class WeftCliDirective(SphinxDirective):
    """Render ``weft-sync --help`` and one section per subcommand with its ``--help``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        parser = build_cli_parser()
        result: list[nodes.Node] = [nodes.literal_block(text=parser.format_help())]
        for name, sub in _subcommands(parser).items():
            rubric = nodes.rubric(text=f"weft-sync {name}", ids=[nodes.make_id(f"cli-{name}")])
            result.append(rubric)
            result.append(nodes.literal_block(text=sub.format_help()))
        return result


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("weft-cli", WeftCliDirective)
    return {"version": "1", "parallel_read_safe": True}
