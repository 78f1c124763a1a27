"""``manage.py weft_sync <command> …``: the ``weft-sync`` command line on this project's store.

Every ``weft-sync`` subcommand works (``claims``, ``workflows``, ``show``, ``maintain``,
``metrics``, ``doctor``, ``cancel``, …); the store is the one ``settings.WEFT_SYNC`` names unless
``--url`` is given. The command line's output and messages stream through Django's
``stdout``/``stderr`` as they come (passwords masked); a non-zero exit becomes a ``CommandError``
carrying that exit code, so ``manage.py`` shows the command line's error, one ``CommandError``
line and no traceback.
"""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stderr
from typing import Any, ClassVar, TextIO, cast

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from weft_sync.cli import app as cli
from weft_sync.ownership import WorkflowHandler
from weft_sync.redaction import redact_text

from ...conf import load_config
from ...runtime import handlers_from_settings


class Command(BaseCommand):
    help = (
        "Run a weft-sync command (claims, workflows, show, maintain, metrics, doctor, cancel, "
        "…) on the store settings.WEFT_SYNC names; 'manage.py weft_sync --help-cli' lists them."
    )
    # The command line reads the store, not models: a broken model check must not block it.
    requires_system_checks: ClassVar[list[str]] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", help="store URL (default: from settings.WEFT_SYNC)")
        parser.add_argument(
            "--help-cli", action="store_true", help="show the weft-sync commands and exit"
        )
        parser.add_argument(
            "cli_args",
            nargs=argparse.REMAINDER,
            metavar="COMMAND …",
            help="a weft-sync command and its arguments",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        argv = list(options["cli_args"])
        if options["help_cli"]:
            argv = ["--help"]
        elif not argv:
            raise CommandError(
                "name a weft-sync command, e.g. 'manage.py weft_sync claims' "
                "('manage.py weft_sync --help-cli' lists them)",
                returncode=cli.EXIT_USAGE,
            )
        if options["url"]:
            argv = ["--url", options["url"], *argv]
        configured = None if _names_url(argv) else (_settings_url(), "settings.WEFT_SYNC")
        out, err = _Lines(self.stdout), _Lines(self.stderr)
        # Live, not buffered: ``maintain --interval`` reports warnings while it runs.
        with redirect_stderr(cast(TextIO, err)):
            try:
                code = cli.main(
                    argv,
                    out=cast(TextIO, out),
                    handlers=_settings_handlers(argv),
                    configured_url=configured,
                    prog="manage.py weft_sync",
                )
            finally:
                out.flush()
                err.flush()
        if code != cli.EXIT_OK:
            # What went wrong is already on stderr, in the command line's own words.
            raise CommandError(
                f"weft-sync {_command_name(argv)} failed with exit code {code}", returncode=code
            )


class _Lines(io.TextIOBase):
    """A text stream handing whole lines to a Django ``OutputWrapper``, passwords masked.

    ``OutputWrapper.write`` ends every call with a newline, so pieces of a line (``print`` and
    ``json.dump`` write several) are joined here first.
    """

    def __init__(self, target: Any) -> None:
        super().__init__()
        self._target = target
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._target.write(redact_text(line))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._target.write(redact_text(self._pending))
            self._pending = ""
        self._target.flush()


def _command_name(argv: list[str]) -> str:
    """The subcommand in ``argv`` (the first word that is not an option or its value)."""
    words = iter(argv)
    for word in words:
        if word == "--url":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return "command"


def _names_url(argv: list[str]) -> bool:
    return any(arg == "--url" or arg.startswith("--url=") for arg in argv)


def _settings_handlers(argv: list[str]) -> dict[str, WorkflowHandler] | None:
    """``settings.WEFT_SYNC["HANDLERS"]``, imported, for ``maintain`` (``None`` otherwise)."""
    if _command_name(argv) != "maintain":
        return None
    try:
        return handlers_from_settings(load_config())
    except ImproperlyConfigured as exc:
        raise CommandError(f"settings.WEFT_SYNC: {exc}", returncode=cli.EXIT_USAGE) from None


def _settings_url() -> str:
    try:
        return load_config().url
    except ImproperlyConfigured as exc:
        raise CommandError(f"settings.WEFT_SYNC: {exc}", returncode=cli.EXIT_USAGE) from None
