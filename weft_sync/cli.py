"""The ``weft-sync`` command line (also ``python -m weft_sync``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weft-sync",
        description="Inspect and operate weft_sync workflow ownership claims.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    demo = commands.add_parser(
        "demo",
        help="run worker processes over a temporary SQLite store, kill one, watch the takeover",
    )
    demo.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    demo.add_argument("--workflows", type=int, default=9, help="workflows to share (default 9)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 success, 1 failure, 2 usage error)."""
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import DemoSettings, run_demo

        if args.workers < 2 or args.workflows < 1:
            print("weft-sync demo: needs --workers >= 2 and --workflows >= 1", file=sys.stderr)
            return 2
        return run_demo(settings=DemoSettings(workers=args.workers, workflows=args.workflows))
    return 2
