"""The ``weft-sync`` command line (also ``python -m weft_sync``), over the public API only.

Exit codes: 0 success; 1 the command ran but found a problem (store missing or unreachable,
``doctor`` found an issue, ``maintain`` had a failed candidate, ``release`` refused, the demo did
not go as described); 2 a usage error (bad arguments or URL); 3 the workflow or claim named does
not exist; 130 interrupted by Ctrl-C (``maintain --interval`` treats Ctrl-C as a request to stop
and exits 0). A closed output pipe (``weft-sync claims --json | head -1``) ends quietly with 0.
No command prints a traceback; ``WEFT_SYNC_DEBUG=1`` shows one for an unexpected error, passwords
masked, and exits 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final, TextIO

from .. import __version__
from ..errors import WeftError
from ..redaction import redact_text
from . import commands

if TYPE_CHECKING:
    from ..ownership import WorkflowHandler

DEFAULT_URL: Final = "sqlite:///weft_sync.db"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

_EPILOG = """\
The store comes from --url (before or after the command), else $WEFT_SYNC_URL, else
sqlite:///weft_sync.db in the current directory. claims, workflows, show, status, metrics and
doctor (without --fix) only read: they never create a store, table or file.
Exit codes: 0 success, 1 a problem was found or the store failed, 2 usage error,
3 no such workflow or claim, 130 interrupted."""

_URL_HELP = "store URL (sqlite:///path.db or postgresql://...); default $WEFT_SYNC_URL"


def _build_parser(prog: str = "weft-sync") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Inspect and operate weft_sync workflow ownership claims.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help=_URL_HELP)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    # Each command takes --url too; SUPPRESS keeps an absent one from hiding the global one.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=_URL_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, parents=[common])

    _add_json(command("claims", "list claims: workflow, holder engine, epoch, driver, expiry"))
    workflows = command("workflows", "list workflows, optionally by status")
    workflows.add_argument("--status", help="only workflows with this status")
    workflows.add_argument("--limit", type=int, help="at most this many")
    _add_json(workflows)
    show = command("show", "show one workflow: record, outcome, checkpoint, epoch, holder, driver")
    show.add_argument("workflow_id")
    _add_json(show)
    _add_json(command("status", "the store-wide view: claims per engine, expired, unheld"))
    metrics = command("metrics", "print the store-wide view as Prometheus gauges")
    metrics.add_argument(
        "--store", action="store_true", help="read the store (the default and only source)"
    )
    _add_maintain(command("maintain", "run maintenance passes (renewal and reclaim)"))
    doctor = command("doctor", "check the store: exists, CAS, mode marker, clocks")
    doctor.add_argument("--fix", action="store_true", help="create a missing store or table")
    cancel = command("cancel", "cancel a workflow (deposes its owner)")
    cancel.add_argument("workflow_id")
    release = command("release", "clear a bare claim (deposes its holder; see cancel)")
    release.add_argument("workflow_id")
    repair = command("repair-epoch", "replace a corrupt epoch key (deposes its holder)")
    repair.add_argument("workflow_id")
    repair.add_argument(
        "--at-least",
        type=int,
        metavar="N",
        help="an epoch known to exceed every one handed out (default: derived from the clock)",
    )
    demo = command(
        "demo",
        "worker processes share a temporary SQLite store; one is killed (a few seconds; "
        "--url is refused: the demo writes only its own store)",
    )
    demo.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    demo.add_argument("--workflows", type=int, default=9, help="workflows to share (default 9)")
    demo.add_argument("--keep", metavar="DIR", help="keep the demo's store in DIR")
    return parser


def _add_maintain(maintain: argparse.ArgumentParser) -> None:
    mode = maintain.add_mutually_exclusive_group(required=True)
    mode.add_argument("--once", action="store_true", help="run one pass and exit (for cron)")
    mode.add_argument(
        "--interval", action="store_true", help="run until SIGTERM or Ctrl-C, one pass per renew"
    )
    maintain.add_argument(
        "--handler",
        metavar="MODULE:FUNC",
        help="MODULE:FUNCTION called with a ReclaimedWorkflow for each workflow taken over; "
        "without it nothing is taken over",
    )
    maintain.add_argument(
        "--type",
        dest="types",
        metavar="TYPE",
        action="append",
        default=[],
        help="a workflow type the handler drives (repeatable; default every type)",
    )
    maintain.add_argument(
        "--claim-ttl", default="30s", metavar="DURATION", help="claim TTL (default 30s)"
    )
    maintain.add_argument(
        "--renew-interval", default="5s", metavar="DURATION", help="renew interval (default 5s)"
    )
    _add_json(maintain)


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON (raw values)")


def _store(
    args: argparse.Namespace, configured: tuple[str, str] | None, prog: str
) -> commands.StoreRef:
    if args.url:
        return commands.StoreRef(str(args.url), "--url", prog)
    if configured is not None:
        return commands.StoreRef(configured[0], configured[1], prog)
    env = os.environ.get("WEFT_SYNC_URL")
    if env:
        return commands.StoreRef(env, "$WEFT_SYNC_URL", prog)
    return commands.StoreRef(DEFAULT_URL, "the default URL", prog)


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


def _dispatch(
    args: argparse.Namespace,
    out: TextIO,
    handlers: Mapping[str, WorkflowHandler] | None,
    configured: tuple[str, str] | None,
    prog: str,
) -> int:
    store = _store(args, configured, prog)
    table: dict[str, Callable[[], int]] = {
        "claims": lambda: commands.claims(store, args.json, out),
        "workflows": lambda: commands.workflows(store, args.status, args.limit, args.json, out),
        "show": lambda: commands.show(store, args.workflow_id, args.json, out),
        "status": lambda: commands.status(store, args.json, out),
        "metrics": lambda: commands.metrics(store, out),
        "maintain": lambda: commands.maintain(store, args, out, _stop_signals, handlers),
        "doctor": lambda: commands.doctor(store, args.fix, out),
        "cancel": lambda: commands.cancel(store, args.workflow_id, out),
        "release": lambda: commands.release(store, args.workflow_id, out),
        "repair-epoch": lambda: commands.repair_epoch(store, args.workflow_id, args.at_least, out),
        "demo": lambda: commands.demo(
            args.workers, args.workflows, args.keep, out, url_given=bool(args.url)
        ),
    }
    return table[args.command]()


def _say(message: str) -> None:
    print(f"weft-sync: {commands.one_line(message)}", file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush finds no closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # stdout is not a real file (a test's buffer); nothing will flush into a pipe


def main(
    argv: Sequence[str] | None = None,
    out: TextIO | None = None,
    *,
    handlers: Mapping[str, WorkflowHandler] | None = None,
    configured_url: tuple[str, str] | None = None,
    prog: str = "weft-sync",
) -> int:
    """Run the command line; return its exit code (see the module docstring).

    :param handlers: workflow type -> handler for ``maintain`` (what a Flask or Django
        integration registered), in addition to a ``--handler`` on the command line, which
        takes precedence for the types it names.
    :param configured_url: ``(url, where it was configured)`` from an integration, e.g.
        ``(url, "settings.WEFT_SYNC")``: used when no ``--url`` is given (before
        ``$WEFT_SYNC_URL``), and named in every error about that URL.
    :param prog: how the operator runs the command line, used in usage lines and in the
        commands that messages suggest (``"manage.py weft_sync"``, ``"flask weft"``).
    """
    try:
        args = _build_parser(prog).parse_args(argv)
    except SystemExit as exc:
        # argparse already printed the usage error (or the help); hand back its exit code.
        if exc.code is None:
            return EXIT_OK
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    stream = out if out is not None else sys.stdout
    try:
        code = _dispatch(args, stream, handlers, configured_url, prog)
        stream.flush()
        return code
    except BrokenPipeError:
        # The reader went away (``| head``): what it wanted it has; end quietly.
        _silence_stdout()
        return EXIT_OK
    except commands.NotFound as exc:
        _say(str(exc))
        return EXIT_NOT_FOUND
    except commands.UsageError as exc:
        _say(f"error: {exc}")
        return EXIT_USAGE
    except (WeftError, OSError) as exc:
        # Before ValueError: a library error that is also a ValueError (a workflow in the wrong
        # state for the command) is a problem found in the store, not a usage error.
        _say(f"error: {exc}")
        return EXIT_FAILURE
    except (ValueError, TypeError) as exc:
        _say(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        # A defect, not an operator's mistake: one line unless asked for the traceback, which
        # is then printed with its passwords masked, as every other message is.
        if os.environ.get("WEFT_SYNC_DEBUG"):
            text = "".join(traceback.format_exception(exc))
            print(redact_text(text), end="", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        _say(
            f"unexpected error: {type(exc).__name__}: {exc} (set WEFT_SYNC_DEBUG=1 to see the "
            f"traceback)"
        )
        return EXIT_FAILURE
