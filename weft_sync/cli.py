"""The ``weft-sync`` command line (also ``python -m weft_sync``), over the public API only.

Exit codes: 0 success; 1 the command ran but found a problem (store unreachable, ``doctor``
found an issue, the demo did not go as described); 2 a usage error (bad arguments or URL);
3 the workflow named does not exist; 130 interrupted by Ctrl-C (``maintain --interval`` treats
Ctrl-C as a request to stop and exits 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO

from . import cli_commands as commands
from .errors import WeftError

__all__ = [
    "DEFAULT_URL",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "main",
]

DEFAULT_URL = "sqlite:///weft_sync.db"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

_EPILOG = """\
The store comes from --url, else $WEFT_SYNC_URL, else sqlite:///weft_sync.db in the current
directory. Exit codes: 0 success, 1 a problem was found or the store failed, 2 usage error,
3 no such workflow, 130 interrupted."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weft-sync",
        description="Inspect and operate weft_sync workflow ownership claims.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="store URL (sqlite:///path.db or postgresql://...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    claims = sub.add_parser("claims", help="list claims: workflow, holder engine, epoch, expiry")
    _add_json(claims)
    workflows = sub.add_parser("workflows", help="list workflows, optionally by status")
    workflows.add_argument("--status", help="only workflows with this status")
    workflows.add_argument("--limit", type=int, help="at most this many")
    _add_json(workflows)
    show = sub.add_parser("show", help="show one workflow and its claim")
    show.add_argument("workflow_id")
    _add_json(show)
    maintain = sub.add_parser("maintain", help="run maintenance passes (renewal and reclaim)")
    mode = maintain.add_mutually_exclusive_group(required=True)
    mode.add_argument("--once", action="store_true", help="run one pass and exit (for cron)")
    mode.add_argument(
        "--interval", action="store_true", help="run until SIGTERM or Ctrl-C, one pass per renew"
    )
    maintain.add_argument(
        "--handler",
        help="MODULE:FUNCTION called with the id of each reclaimed workflow to drive it; "
        "without it nothing is taken over",
    )
    maintain.add_argument(
        "--type", dest="types", action="append", default=[], help="workflow type to reclaim"
    )
    maintain.add_argument("--claim-ttl", default="30s", help="claim TTL (default 30s)")
    maintain.add_argument("--renew-interval", default="5s", help="renew interval (default 5s)")
    _add_json(maintain)
    sub.add_parser("metrics", help="print Prometheus text for the store's claims")
    sub.add_parser("doctor", help="check the store: reachable, CAS, mode marker, clocks")
    cancel = sub.add_parser("cancel", help="cancel a workflow (deposes its owner)")
    cancel.add_argument("workflow_id")
    demo = sub.add_parser(
        "demo", help="worker processes share a temporary SQLite store; one is killed"
    )
    demo.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    demo.add_argument("--workflows", type=int, default=9, help="workflows to share (default 9)")
    return parser


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _url(args: argparse.Namespace) -> str:
    return str(args.url or os.environ.get("WEFT_SYNC_URL") or DEFAULT_URL)


@contextmanager
def _stop_signals() -> Iterator[threading.Event]:
    """Yield an event that SIGTERM and SIGINT set; the previous handlers return on exit."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _dispatch(args: argparse.Namespace, out: TextIO) -> int:
    url = _url(args)
    table: dict[str, Callable[[], int]] = {
        "claims": lambda: commands.claims(url, args.json, out),
        "workflows": lambda: commands.workflows(url, args.status, args.limit, args.json, out),
        "show": lambda: commands.show(url, args.workflow_id, args.json, out),
        "maintain": lambda: commands.maintain(url, args, out, _stop_signals),
        "metrics": lambda: commands.metrics(url, out),
        "doctor": lambda: commands.doctor(url, out),
        "cancel": lambda: commands.cancel(url, args.workflow_id, out),
        "demo": lambda: commands.demo(args.workers, args.workflows, out),
    }
    return table[args.command]()


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line; return its exit code (see the module docstring)."""
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:
        # argparse already printed the usage error (or the help); hand back its exit code.
        if exc.code is None:
            return EXIT_OK
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    stream = out if out is not None else sys.stdout
    try:
        return _dispatch(args, stream)
    except commands.NotFound as exc:
        print(f"weft-sync: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except (WeftError, OSError) as exc:
        # Before ValueError: a library error that is also a ValueError (a workflow in the wrong
        # state for the command) is a problem found in the store, not a usage error.
        print(f"weft-sync: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (ValueError, TypeError) as exc:
        print(f"weft-sync: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("weft-sync: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
