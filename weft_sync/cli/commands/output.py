"""What every command shares: where the store comes from, errors, tables, JSON and times."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final, TextIO

from ...codec import WorkflowRecord
from ...errors import MissingStoreError, StorageError, WeftError
from ...redaction import redact_text, redact_url
from ...storage import Storage, open_storage
from .locations import (
    check_postgres_url,
    is_postgres,
    postgres_endpoints,
    sqlite_access_problem,
    sqlite_path,
    unreachable,
)

SHOWN_PROBLEMS: Final = 10
"""Bad rows a listing names on stderr one by one; more are only counted."""


class NotFound(WeftError):
    """The workflow or claim named on the command line does not exist (exit 3)."""


class CommandError(WeftError):
    """The command ran but found a problem or refused to act (exit 1)."""


class StoreMissing(CommandError):
    """A command that only reads found no store (no file or no table) and created none.

    :param fixable: whether creating the store is the likely fix: not for a SQLite file that
        exists without the table (another application's database, or a mistyped ``?table=``).
    """

    def __init__(self, message: str, *, fixable: bool = True) -> None:
        super().__init__(message)
        self.fixable = fixable


class UsageError(ValueError):
    """The command line itself is wrong: a bad URL, argument or handler (exit 2)."""


@dataclass(frozen=True)
class StoreRef:
    """The store a command works on, and where its URL came from (for error messages).

    :param url: the store URL, credentials included; show :attr:`shown` instead.
    :param source: ``"--url"``, ``"$WEFT_SYNC_URL"``, ``"the default URL"``, or where an
        integration configured it (``"settings.WEFT_SYNC"``, ``"app.config['WEFT_SYNC_URL']"``).
    :param prog: how the operator runs the command line (``"weft-sync"``,
        ``"manage.py weft_sync"``, ``"flask weft"``), for the commands that hints suggest.
    """

    url: str
    source: str
    prog: str = "weft-sync"

    def command(self, rest: str) -> str:
        """The command line ``rest`` as the operator would type it, e.g. ``doctor --fix``."""
        return f"{self.prog} {rest}"

    @property
    def shown(self) -> str:
        """The URL with its password masked."""
        return redact_url(self.url)

    def open(self, *, read_only: bool, create: bool = False) -> Storage:
        """Open the store; only ``create`` may make a missing file or table.

        A command that writes (``maintain``, ``cancel``, ``release``) still needs the store to
        exist: a mistyped URL must not leave a new empty store, or a weft table in some other
        application's database, behind.

        :raises UsageError: the URL is malformed (the message names its source).
        :raises StoreMissing: the store does not exist and ``create`` is false.
        :raises CommandError: the store cannot be opened (a SQLite file this process may not
            reach, a PostgreSQL server that accepts no connection: the message says which).
        """
        try:
            if is_postgres(self.url):
                check_postgres_url(self.url)
            if not read_only and not create:
                open_storage(self.url, read_only=True).close()
            return open_storage(self.url, read_only=read_only)
        except ValueError as exc:
            raise UsageError(f"bad store URL from {self.source}: {exc}") from None
        except StorageError as exc:
            raise self._open_error(exc) from None

    def _open_error(self, exc: StorageError) -> CommandError:
        """The error to report for a failed open: why the store is out of reach, if known."""
        where = f"(store URL {self.shown!r} from {self.source})"
        path = sqlite_path(self.url)
        if path is not None:
            problem = sqlite_access_problem(path)
            if problem is not None:
                return CommandError(f"cannot open the SQLite store {path!r}: {problem} {where}")
        if isinstance(exc, MissingStoreError):
            # A file that exists is a database already: the table is not simply missing.
            fixable = path is None or not os.path.isfile(path)
            return StoreMissing(f"{exc} {where}", fixable=fixable)
        if is_postgres(self.url):
            refusals = unreachable(postgres_endpoints(self.url))
            if refusals is not None:
                return CommandError(f"could not reach the PostgreSQL server at {refusals} {where}")
        return CommandError(f"{exc} {where}")


def one_line(text: str) -> str:
    """``text`` with its passwords masked and its whitespace runs (newlines too) made one space."""
    return " ".join(redact_text(text).split())


def warn_rows(problems: Sequence[str], listed_as: str) -> None:
    """Name the store's bad rows on stderr, one line each (the first :data:`SHOWN_PROBLEMS`).

    :param listed_as: how the listing shows them, e.g. ``"listed as undecodable"``.
    """
    for problem in problems[:SHOWN_PROBLEMS]:
        print(f"weft-sync: warning: {one_line(problem)}; {listed_as}", file=sys.stderr)
    if len(problems) > SHOWN_PROBLEMS:
        more = len(problems) - SHOWN_PROBLEMS
        print(f"weft-sync: warning: ... and {more} more such rows", file=sys.stderr)


def emit_json(data: Any, out: TextIO) -> None:
    """Write ``data`` as indented JSON with sorted keys; values it cannot encode become text."""
    json.dump(data, out, indent=2, sort_keys=True, default=str)
    out.write("\n")


def shown(text: str) -> str:
    """``text`` as a terminal shows it safely: each character that does not print (a newline,
    a tab, an escape sequence's ``ESC``) written as its Python escape, so that a workflow id or a
    value from the store cannot start a row of its own or recolour the screen."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def emit_table(headers: list[str], rows: list[list[str]], out: TextIO) -> None:
    """Write left-aligned columns, two spaces apart, with a header row; cells go through
    :func:`shown`."""
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")


def iso_utc(ms: int) -> str:
    """``ms`` since the Unix epoch as ISO-8601 UTC to the second, e.g. ``2026-12-01T07:41:07Z``."""
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def relative_time(ms: int, now: int) -> str:
    """How far ``ms`` is from ``now``: ``"in 12 s"``, ``"3 min ago"``, ``"now"``."""
    delta = ms - now
    seconds = abs(delta) // 1000
    if seconds == 0:
        return "now"
    if seconds < 120:
        amount = f"{seconds} s"
    elif seconds < 120 * 60:
        amount = f"{seconds // 60} min"
    elif seconds < 48 * 3600:
        amount = f"{seconds // 3600} h"
    else:
        amount = f"{seconds // 86400} d"
    return f"in {amount}" if delta > 0 else f"{amount} ago"


def human_time(ms: int | None, now: int) -> str:
    """``ms`` as ISO-8601 UTC plus its distance from ``now``; ``"-"`` when unset (``None``/0)."""
    if not ms:
        return "-"
    return f"{iso_utc(ms)} ({relative_time(ms, now)})"


def record_dict(record: WorkflowRecord) -> dict[str, Any]:
    """A workflow record as a JSON-ready map, times in raw milliseconds."""
    return {
        "workflow_id": record.workflow_id,
        "type": record.type,
        "status": record.status,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "revision": record.revision,
        "input": record.input,
    }
