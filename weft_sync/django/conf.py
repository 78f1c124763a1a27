"""Reading ``settings.WEFT_SYNC``: validation, the store URL, the handlers.

Settings are read when asked for (never at import), so tests and ``override_settings`` see the
current value. Every problem found is a :class:`Problem` carrying the system-check id it is
reported under; :func:`load_config` raises the first one as ``ImproperlyConfigured``.

With ``"DATABASE": alias`` the store URL is built from ``settings.DATABASES[alias]`` (the sqlite3
and postgresql engines). Such a URL may hold a password: it is only ever shown through
:func:`weft_sync.redaction.redact_url`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import quote, urlencode, urlunsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from weft_sync.options import OwnershipOptions
from weft_sync.redaction import redact_url
from weft_sync.storage import SUPPORTED_SCHEMES

SETTING: Final = "WEFT_SYNC"
_KEYS: Final = (
    "URL",
    "DATABASE",
    "STORAGE",
    "OPTIONS",
    "HANDLERS",
    "BACKGROUND",
    "OPEN_ON_REQUEST",
    "MAX_CLAIMS",
)
_BACKGROUNDS: Final = ("thread", "manual")
_SQLITE_ENGINES: Final = ("django.db.backends.sqlite3",)
_POSTGRES_ENGINES: Final = (
    "django.db.backends.postgresql",
    "django.db.backends.postgresql_psycopg2",
)
# Keys of a Django PostgreSQL ``OPTIONS`` that configure Django or psycopg objects, not libpq.
_DJANGO_ONLY_PG_OPTIONS: Final = frozenset(
    {"isolation_level", "assume_role", "server_side_binding", "pool", "cursor_factory", "context"}
)


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with ``settings.WEFT_SYNC``, under the check id that reports it."""

    check_id: str
    message: str
    hint: str | None = None


@dataclass(frozen=True, slots=True)
class WeftSyncSettings:
    """``settings.WEFT_SYNC`` validated: where the store is and how to open it."""

    url: str = field(repr=False)
    source: str
    """Where the URL came from, for messages: ``WEFT_SYNC["URL"]`` or the database alias."""
    options: OwnershipOptions
    handler_paths: Mapping[str, str]
    background: str
    open_on_request: bool
    max_claims: int | None = None

    def import_handlers(self) -> dict[str, Callable[..., object]]:
        """Import every handler by its dotted path.

        :raises ImproperlyConfigured: a path does not import or names something not callable.
        """
        handlers: dict[str, Callable[..., object]] = {}
        for workflow_type, path in self.handler_paths.items():
            handler, problem = _import_handler(workflow_type, path)
            if problem is not None:
                raise ImproperlyConfigured(problem.message)
            assert handler is not None
            handlers[workflow_type] = handler
        return handlers

    def __repr__(self) -> str:
        return f"WeftSyncSettings(url={redact_url(self.url)!r}, source={self.source!r})"


def load_config() -> WeftSyncSettings:
    """Validate ``settings.WEFT_SYNC`` and return it.

    :raises ImproperlyConfigured: the setting is missing or wrong (the message says how).
    """
    config, problems = _parse()
    if problems:
        first = problems[0]
        raise ImproperlyConfigured(first.message + (f" ({first.hint})" if first.hint else ""))
    assert config is not None
    return config


def find_problems(*, import_handlers: bool = True) -> list[Problem]:
    """Every problem of ``settings.WEFT_SYNC`` (empty when it is usable)."""
    config, problems = _parse()
    if config is not None and import_handlers:
        for workflow_type, path in config.handler_paths.items():
            _, problem = _import_handler(workflow_type, path)
            if problem is not None:
                problems.append(problem)
    return problems


def _parse() -> tuple[WeftSyncSettings | None, list[Problem]]:
    raw = getattr(settings, SETTING, None)
    if raw is None:
        return None, [
            Problem(
                "weft_sync.E001",
                f"settings.{SETTING} is not set",
                'set it to {"DATABASE": "default"} or {"URL": "sqlite:///weft.db"}',
            )
        ]
    if not isinstance(raw, Mapping):
        return None, [
            Problem(
                "weft_sync.E001", f"settings.{SETTING} must be a dict, got {type(raw).__name__}"
            )
        ]
    problems: list[Problem] = []
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        problems.append(
            Problem(
                "weft_sync.E001",
                f"settings.{SETTING} has unknown keys {', '.join(map(repr, unknown))}",
                f"valid keys are {', '.join(_KEYS)}",
            )
        )
    url, source = _store_url(raw, problems)
    options = _options(raw.get("OPTIONS"), problems)
    handler_paths = _handler_paths(raw.get("HANDLERS"), problems)
    background, open_on_request, max_claims = _switches(raw, problems)
    if problems or url is None or options is None or handler_paths is None:
        return None, problems
    config = WeftSyncSettings(
        url=url,
        source=source,
        options=options,
        handler_paths=handler_paths,
        background=background,
        open_on_request=open_on_request,
        max_claims=max_claims,
    )
    return config, problems


def _switches(raw: Mapping[str, Any], problems: list[Problem]) -> tuple[str, bool, int | None]:
    """``BACKGROUND``, ``OPEN_ON_REQUEST`` and ``MAX_CLAIMS``, with their defaults."""
    background = raw.get("BACKGROUND", "thread")
    if background not in _BACKGROUNDS:
        problems.append(
            Problem(
                "weft_sync.E001",
                f'settings.{SETTING}["BACKGROUND"] is {background!r}',
                f"use one of {', '.join(map(repr, _BACKGROUNDS))}",
            )
        )
    open_on_request = raw.get("OPEN_ON_REQUEST", True)
    if not isinstance(open_on_request, bool):
        problems.append(
            Problem(
                "weft_sync.E001",
                f'settings.{SETTING}["OPEN_ON_REQUEST"] must be True or False, got '
                f"{open_on_request!r}",
            )
        )
    max_claims = raw.get("MAX_CLAIMS")
    if max_claims is not None and (
        isinstance(max_claims, bool) or not isinstance(max_claims, int) or max_claims < 1
    ):
        problems.append(
            Problem(
                "weft_sync.E001",
                f'settings.{SETTING}["MAX_CLAIMS"] is {max_claims!r}',
                "use None (no limit) or a whole number of claims of at least 1",
            )
        )
    return str(background), bool(open_on_request), max_claims


def _store_url(raw: Mapping[str, Any], problems: list[Problem]) -> tuple[str | None, str]:
    has_url, has_db = "URL" in raw, "DATABASE" in raw
    if has_url == has_db:
        problems.append(
            Problem(
                "weft_sync.E002",
                f"settings.{SETTING} needs exactly one of URL and DATABASE, got "
                f"{'both' if has_url else 'neither'}",
                'e.g. {"DATABASE": "default"} to keep the claims in that Django database',
            )
        )
        return None, ""
    storage = raw.get("STORAGE", {})
    if not isinstance(storage, Mapping) or not all(isinstance(k, str) for k in storage):
        problems.append(
            Problem(
                "weft_sync.E002",
                f'settings.{SETTING}["STORAGE"] must be a dict of URL parameters, got {storage!r}',
                'e.g. {"table": "weft_kv", "max_size": 4}',
            )
        )
        return None, ""
    if has_url:
        source = f'settings.{SETTING}["URL"]'
        url = _checked_url(raw["URL"], source, problems)
    else:
        alias = raw["DATABASE"]
        source = f'settings.DATABASES["{alias}"]'
        url = _database_url(alias, problems)
    if url is None:
        return None, source
    return _with_params(url, storage), source


def _checked_url(url: object, source: str, problems: list[Problem]) -> str | None:
    if not isinstance(url, str) or "://" not in url:
        shown = redact_url(url) if isinstance(url, str) else repr(url)
        problems.append(
            Problem(
                "weft_sync.E002",
                f"{source} is not a storage URL: {shown!r}",
                "use sqlite:///path.db, sqlite:////abs/path.db or postgresql://user@host/db",
            )
        )
        return None
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SUPPORTED_SCHEMES:
        problems.append(
            Problem(
                "weft_sync.E002",
                f"{source} has the unsupported scheme {scheme!r}",
                f"use one of {', '.join(s + '://' for s in SUPPORTED_SCHEMES)}",
            )
        )
        return None
    if scheme.lower() == "sqlite" and (not rest.startswith("/") or not rest[1:].split("?")[0]):
        problems.append(
            Problem(
                "weft_sync.E002",
                f"{source} names no SQLite file: {url!r}",
                "use sqlite:///relative/path.db or sqlite:////absolute/path.db",
            )
        )
        return None
    return url


def _database_url(alias: object, problems: list[Problem]) -> str | None:
    databases = getattr(settings, "DATABASES", {}) or {}
    if not isinstance(alias, str) or alias not in databases:
        problems.append(
            Problem(
                "weft_sync.E003",
                f'settings.{SETTING}["DATABASE"] is {alias!r}, which is not in settings.DATABASES',
                f"defined aliases: {', '.join(map(repr, databases)) or 'none'}",
            )
        )
        return None
    db = databases[alias]
    engine = db.get("ENGINE", "")
    if engine in _SQLITE_ENGINES:
        return _sqlite_url(alias, db, problems)
    if engine in _POSTGRES_ENGINES:
        return _postgres_url(db)
    problems.append(
        Problem(
            "weft_sync.E004",
            f'settings.DATABASES["{alias}"] uses the engine {engine!r}, which weft_sync cannot '
            f"keep claims in",
            "use a sqlite3 or postgresql database, or give WEFT_SYNC a URL instead",
        )
    )
    return None


def _sqlite_url(alias: str, db: Mapping[str, Any], problems: list[Problem]) -> str | None:
    name = os.fspath(db.get("NAME") or "")
    if not name or name == ":memory:" or "mode=memory" in name or name.startswith("file:"):
        problems.append(
            Problem(
                "weft_sync.E004",
                f'settings.DATABASES["{alias}"] is an in-memory or URI SQLite database '
                f"({name!r}); other processes cannot share its claims",
                "point NAME at a file, or give WEFT_SYNC a URL",
            )
        )
        return None
    return "sqlite:///" + os.path.abspath(name)


def _postgres_url(db: Mapping[str, Any]) -> str:
    user = quote(str(db.get("USER") or ""), safe="")
    password = quote(str(db.get("PASSWORD") or ""), safe="")
    host = str(db.get("HOST") or "")
    port = str(db.get("PORT") or "")
    params: list[tuple[str, str]] = []
    netloc = ""
    if user:
        netloc = user + (f":{password}" if password else "") + "@"
    elif password:
        params.append(("password", str(db.get("PASSWORD"))))
    if host.startswith("/"):
        # A Unix socket directory cannot sit in the netloc.
        params.append(("host", host))
        if port:
            params.append(("port", port))
    elif host:
        netloc += quote(host, safe="") + (f":{port}" if port else "")
    for key, value in (db.get("OPTIONS") or {}).items():
        if key not in _DJANGO_ONLY_PG_OPTIONS and isinstance(value, (str, int)):
            params.append((str(key), str(value)))
    name = quote(str(db.get("NAME") or ""), safe="")
    return urlunsplit(("postgresql", netloc, "/" + name, urlencode(params), ""))


def _with_params(url: str, params: Mapping[str, Any]) -> str:
    if not params:
        return url
    extra = urlencode([(k, str(v)) for k, v in params.items()])
    return url + ("&" if "?" in url else "?") + extra


def _options(raw: object, problems: list[Problem]) -> OwnershipOptions | None:
    if raw is None:
        return OwnershipOptions()
    if not isinstance(raw, Mapping):
        problems.append(
            Problem(
                "weft_sync.E005",
                f'settings.{SETTING}["OPTIONS"] must be a dict, got {type(raw).__name__}',
                'e.g. {"claim_ttl": "30s", "claim_renew_interval": "5s"}',
            )
        )
        return None
    try:
        return OwnershipOptions(**raw)
    except (TypeError, ValueError) as exc:
        problems.append(
            Problem(
                "weft_sync.E005",
                f'settings.{SETTING}["OPTIONS"] is not valid: {exc}',
                "claim_ttl must be at least 3 times claim_renew_interval, e.g. 30s and 5s",
            )
        )
        return None


def _handler_paths(raw: object, problems: list[Problem]) -> dict[str, str] | None:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in raw.items()
    ):
        problems.append(
            Problem(
                "weft_sync.E006",
                f'settings.{SETTING}["HANDLERS"] must map workflow types to dotted paths, got '
                f"{raw!r}",
                'e.g. {"report": "reports.jobs.resume_report"}',
            )
        )
        return None
    return dict(raw)


def _import_handler(
    workflow_type: str, path: str
) -> tuple[Callable[..., object] | None, Problem | None]:
    where = f'settings.{SETTING}["HANDLERS"]["{workflow_type}"]'
    try:
        handler = import_string(path)
    except ImportError as exc:
        return None, Problem(
            "weft_sync.E006",
            f"{where} = {path!r} does not import: {exc}",
            "give the dotted path of a function, e.g. reports.jobs.resume_report",
        )
    if not callable(handler):
        return None, Problem(
            "weft_sync.E007",
            f"{where} = {path!r} is a {type(handler).__name__}, not a callable",
            "a handler is called with one ReclaimedWorkflow argument",
        )
    return handler, None
