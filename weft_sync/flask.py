"""Flask integration: one lazily opened ``Ownership`` per app and process, and ``flask weft``.

Use it like any Flask extension, directly or from an app factory::

    weft = WeftSync()

    @weft.handler("report")
    def resume_report(ctx):            # a ReclaimedWorkflow; runs inside an app context
        ...

    def create_app():
        app = Flask(__name__)
        app.config["WEFT_SYNC_URL"] = "postgresql://app@db/app"
        weft.init_app(app)
        return app

    # in a view:  weft.ownership.workflows.start(job_id, "report")

Config keys (defaults set with ``setdefault`` by :meth:`WeftSync.init_app`):

- ``WEFT_SYNC_URL``: the store; default ``sqlite:///<instance path>/weft_sync.db``.
- ``WEFT_SYNC_OPTIONS``: an ``OwnershipOptions`` or a dict of its fields
  (``{"claim_ttl": "30s", "claim_renew_interval": "5s"}``); default ``{}``.
- ``WEFT_SYNC_BACKGROUND``: ``"thread"`` (default) or ``"manual"``.

Processes: nothing opens at import or in ``init_app`` (do not touch ``weft.ownership`` while
the app is being created either: under ``gunicorn --preload`` that runs in the master, which
would then reclaim and drive workflows itself). ``weft.ownership`` opens the ``Ownership``
in the process that first uses it, so a pre-forking server (gunicorn, with or without
``--preload``) gives every worker its own engine; a forked child that inherited an open one
opens a fresh one on first use. Each process closes what it opened at interpreter exit. Under
gunicorn also set, in the config file, ``post_worker_init =
weft_sync.flask.gunicorn_post_worker_init``, so that each worker opens its ``Ownership`` as it
boots (and takes a dead worker's workflows over without waiting for a request of its own), and
``worker_exit = weft_sync.flask.gunicorn_worker_exit``, so that it releases its claims before it
exits. Closing is idempotent.

Threading: each app's state has one lock guarding its ``Ownership`` slot; the ``Ownership`` is
opened outside that lock (storage I/O) by the first caller while concurrent callers wait on an
event, so exactly one is opened per app and process.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Final, TypeVar

try:
    import click
    from flask import Flask, current_app, has_app_context
    from flask.cli import AppGroup, with_appcontext
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without Flask
    raise ImportError(
        'weft_sync.flask needs Flask, which is not installed: pip install "weft_sync[flask]"'
    ) from exc

from . import _fork
from .errors import ClosedError
from .ledger.records import validate_name
from .options import BACKGROUND_MODES, OwnershipOptions
from .ownership.facade import Ownership, ReclaimedWorkflow, WorkflowHandler
from .redaction import redact_url

__all__ = [
    "EXTENSION_KEY",
    "WeftSync",
    "close_all",
    "gunicorn_post_worker_init",
    "gunicorn_worker_exit",
]

_log = logging.getLogger(__name__)

EXTENSION_KEY: Final = "weft_sync"
"""The key of this extension's per-app state in ``app.extensions``."""

_Handler = TypeVar("_Handler", bound=WorkflowHandler)


class WeftSync:
    """The Flask extension: config, handlers, a per-process ``Ownership`` and ``flask weft``.

    :param app: initialise this app now (same as calling :meth:`init_app`).
    :param handlers: workflow type -> handler, as for ``Ownership.open(handlers=...)``; more
        can be added with :meth:`handler`. Each runs inside an app context of the app whose
        ``Ownership`` took the workflow over.
    """

    def __init__(
        self, app: Flask | None = None, *, handlers: Mapping[str, WorkflowHandler] | None = None
    ) -> None:
        # _lock guards _handlers and _states.
        self._lock = threading.Lock()
        self._handlers: dict[str, WorkflowHandler] = {}
        self._states: weakref.WeakSet[_AppState] = weakref.WeakSet()
        if handlers is not None:
            if not isinstance(handlers, Mapping):
                raise TypeError(
                    f"handlers must be a mapping of workflow type to handler, got "
                    f"{type(handlers).__name__} {handlers!r:.80}"
                )
            for workflow_type, fn in handlers.items():
                self.handler(workflow_type)(fn)
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Read and check ``app``'s config, store its state, add ``flask weft``; open nothing.

        :raises ValueError: TypeError: a config value is invalid (named in the message).
        :raises RuntimeError: ``app`` was already initialised by a ``WeftSync``.
        """
        if EXTENSION_KEY in app.extensions:
            raise RuntimeError(
                f"app {app.name!r} already has a WeftSync (app.extensions[{EXTENSION_KEY!r}]); "
                f"call init_app() once per app"
            )
        default_url = "sqlite:///" + os.path.join(app.instance_path, "weft_sync.db")
        app.config.setdefault("WEFT_SYNC_URL", default_url)
        app.config.setdefault("WEFT_SYNC_OPTIONS", {})
        app.config.setdefault("WEFT_SYNC_BACKGROUND", "thread")
        state = _AppState(
            app,
            self,
            url=_config_url(app.config["WEFT_SYNC_URL"]),
            options=_config_options(app.config["WEFT_SYNC_OPTIONS"]),
            background=_config_background(app.config["WEFT_SYNC_BACKGROUND"]),
            make_dirs=app.instance_path if app.config["WEFT_SYNC_URL"] == default_url else None,
        )
        app.extensions[EXTENSION_KEY] = state
        with self._lock:
            self._states.add(state)
        app.cli.add_command(_cli_group())

    # ----------------------------------------------------------------------------------------
    # Handlers
    # ----------------------------------------------------------------------------------------

    def handler(self, workflow_type: str) -> Callable[[_Handler], _Handler]:
        """Register the decorated function as the handler of ``workflow_type``.

        Register handlers before the first use of :attr:`ownership`; one registered later is
        also added to every ``Ownership`` this extension already opened in this process.

        :raises ValueError: ``workflow_type`` is not a valid name, or has another handler.
        :raises TypeError: ``workflow_type`` is not a ``str``, or the handler is not callable.
        """
        validate_name("workflow type", workflow_type)

        def register(fn: _Handler) -> _Handler:
            if not callable(fn):
                raise TypeError(
                    f"the handler of workflow type {workflow_type!r} must be callable with a "
                    f"ReclaimedWorkflow, got {fn!r:.80}"
                )
            with self._lock:
                existing = self._handlers.get(workflow_type)
                if existing is None:
                    self._handlers[workflow_type] = fn
                states = list(self._states)
            if existing is fn:
                return fn
            if existing is not None:
                raise ValueError(
                    f"workflow type {workflow_type!r} already has the handler {existing!r:.80}"
                )
            for state in states:
                state.sync_handlers()
            return fn

        return register

    def handlers(self) -> dict[str, WorkflowHandler]:
        """A copy of the registered handlers, by workflow type."""
        with self._lock:
            return dict(self._handlers)

    # ----------------------------------------------------------------------------------------
    # The per-process Ownership
    # ----------------------------------------------------------------------------------------

    @property
    def ownership(self) -> Ownership:
        """The current app's ``Ownership`` in this process, opened on first use.

        :raises RuntimeError: outside an app context, or the app was not initialised.
        :raises ClosedError: :meth:`close` was called for the app in this process.
        """
        return self.get_ownership()

    def get_ownership(self, app: Flask | None = None) -> Ownership:
        """``app``'s (default: the current app's) ``Ownership`` in this process, opened lazily.

        :raises RuntimeError: no ``app`` and no app context, or the app was not initialised.
        :raises ClosedError: :meth:`close` was called for the app in this process.
        """
        return _state_of(app).ownership()

    def close(self, app: Flask | None = None) -> None:
        """Close ``app``'s (default: the current app's) ``Ownership`` in this process; idempotent.

        Its claims are released. Later use of :attr:`ownership` for that app in this process
        raises ``ClosedError``; a process forked afterwards opens its own again.
        """
        _state_of(app).close()


class _AppState:
    """One app's config and, per process, its lazily opened ``Ownership``."""

    def __init__(
        self,
        app: Flask,
        extension: WeftSync,
        *,
        url: str,
        options: OwnershipOptions,
        background: str,
        make_dirs: str | None,
    ) -> None:
        self.app_name = app.name
        self.url = url
        self.options = options
        self.background = background
        self._app_ref = weakref.ref(app)
        self._extension = extension
        self._make_dirs = make_dirs
        # _lock guards _ownership, _opening, _closed and _pid.
        self._lock = threading.Lock()
        self._ownership: Ownership | None = None
        self._opening: threading.Event | None = None
        self._closed = False
        self._pid = os.getpid()

    def ownership(self) -> Ownership:
        """This process's ``Ownership`` of the app: the open one, or one opened now."""
        while True:
            with self._lock:
                self._adopt_process()
                if self._closed:
                    raise ClosedError(
                        f"WeftSync of app {self.app_name!r} was closed in process "
                        f"{os.getpid()}; it does not reopen"
                    )
                if self._ownership is not None:
                    return self._ownership
                opener = self._opening is None
                if opener:
                    self._opening = threading.Event()
                    # From the first open on, a forked child resets this state (see below).
                    _fork.track(self)
                event = self._opening
            assert event is not None
            if opener:
                return self._open_as_opener(event)
            # Another thread is opening; it sets the event whether or not it succeeded.
            event.wait()

    def _open_as_opener(self, event: threading.Event) -> Ownership:
        try:
            ownership = self._open()
        except BaseException:
            with self._lock:
                self._opening = None
                _fork.untrack(self)
            event.set()
            raise
        with self._lock:
            self._opening = None
            keep = not self._closed and self._pid == os.getpid()
            if keep:
                self._ownership = ownership
                _opened(self)
                # Handlers registered while it was opening.
                self._sync_handlers(ownership)
        event.set()
        if not keep:
            ownership.close()
            raise ClosedError(f"WeftSync of app {self.app_name!r} was closed while opening")
        _log.info(
            "opened ownership of engine %s for app %r in process %d on %s",
            ownership.engine_id,
            self.app_name,
            os.getpid(),
            redact_url(self.url),
        )
        return ownership

    def _open(self) -> Ownership:
        app = self._app_ref()
        if app is None:
            raise ClosedError(f"the Flask app {self.app_name!r} no longer exists")
        if self._make_dirs is not None:
            os.makedirs(self._make_dirs, exist_ok=True)
        handlers = {t: _in_app_context(app, fn) for t, fn in self._extension.handlers().items()}
        return Ownership.open(
            self.url,
            options=self.options,
            handlers=handlers,
            background=self.background,  # type: ignore[arg-type]
        )

    def handlers(self) -> dict[str, WorkflowHandler]:
        """The handlers registered on this app's extension, by workflow type."""
        return self._extension.handlers()

    def sync_handlers(self) -> None:
        """Give the open ``Ownership`` (if any) the handlers registered since it opened."""
        with self._lock:
            self._adopt_process()
            if self._ownership is not None:
                self._sync_handlers(self._ownership)

    def _sync_handlers(self, ownership: Ownership) -> None:
        # Called with _lock held, so the opener and a late registration never both add one
        # type; registering touches no storage.
        app = self._app_ref()
        if app is None or ownership.closed:
            return
        for workflow_type, fn in self._extension.handlers().items():
            if ownership.handlers.get(workflow_type) is None:
                ownership.handler(workflow_type)(_in_app_context(app, fn))

    def close(self) -> None:
        with self._lock:
            self._adopt_process()
            ownership, self._ownership = self._ownership, None
            self._closed = True
            _fork.untrack(self)
        _closed(self)
        if ownership is None:
            return
        try:
            ownership.close()
        except BaseException:
            if not ownership.closed:
                # Refused (called from a handler or an on_lost callback) before it changed
                # anything: still open, so still this state's to close (close_all, at exit).
                with self._lock:
                    self._ownership, self._closed = ownership, False
                    _fork.track(self)
                _opened(self)
            raise

    def _adopt_process(self) -> None:
        # Covers a child forked before this state first opened, or by a fork that bypasses
        # os.register_at_fork; called with _lock held.
        if self._pid != os.getpid():
            self._reset_for_child()

    def _reset_for_child(self) -> None:
        """Forget the parent's ``Ownership`` (inert here) and start this process afresh."""
        self._ownership = None
        self._opening = None
        self._closed = False
        self._pid = os.getpid()

    def _after_fork_in_child(self) -> None:
        # A parent thread may have held the lock at fork time; only this thread exists now.
        self._lock = threading.Lock()
        self._reset_for_child()


def _state_of(app: Flask | None) -> _AppState:
    if app is None:
        if not has_app_context():
            raise RuntimeError(
                "WeftSync.ownership needs an app context (inside a request or "
                "app.app_context()), or pass the app: weft.get_ownership(app)"
            )
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        assert app is not None
    state = app.extensions.get(EXTENSION_KEY)
    if not isinstance(state, _AppState):
        raise RuntimeError(f"app {app.name!r} has no WeftSync: call weft.init_app(app) first")
    return state


def _in_app_context(app: Flask, fn: WorkflowHandler) -> WorkflowHandler:
    """Wrap ``fn`` so it runs inside an app context of ``app`` (handlers run on pool threads)."""

    @functools.wraps(fn)
    def run(ctx: ReclaimedWorkflow) -> object:
        with app.app_context():
            return fn(ctx)

    return run


# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------


def _config_url(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        shown = redact_url(value) if isinstance(value, str) else repr(value)
        raise TypeError(
            f"WEFT_SYNC_URL must be a store URL string (sqlite:///path.db or "
            f"postgresql://...), got {type(value).__name__} {shown!r:.80}"
        )
    scheme = value.partition(":")[0].lower()
    if scheme not in ("sqlite", "postgresql", "postgres"):
        raise ValueError(
            f"WEFT_SYNC_URL {redact_url(value)!r:.120} has the scheme {scheme!r}: use sqlite:///, "
            f"postgresql:// or postgres://"
        )
    return value


def _config_options(value: object) -> OwnershipOptions:
    if isinstance(value, OwnershipOptions):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"WEFT_SYNC_OPTIONS must be an OwnershipOptions or a dict of its fields "
            f"(claim_ttl, claim_renew_interval), got {type(value).__name__} {value!r:.80}"
        )
    try:
        return OwnershipOptions(**value)
    except TypeError as exc:
        raise TypeError(
            f"WEFT_SYNC_OPTIONS {dict(value)!r:.120} is not a set of OwnershipOptions fields "
            f"(claim_ttl, claim_renew_interval): {exc}"
        ) from None
    except ValueError as exc:
        raise ValueError(f"WEFT_SYNC_OPTIONS {dict(value)!r:.120}: {exc}") from None


def _config_background(value: object) -> str:
    if value not in BACKGROUND_MODES:
        raise ValueError(
            f"WEFT_SYNC_BACKGROUND must be one of "
            f"{', '.join(repr(m) for m in BACKGROUND_MODES)}, got {value!r}"
        )
    return str(value)


# ----------------------------------------------------------------------------------------
# ``flask weft ...``
# ----------------------------------------------------------------------------------------


def _cli_subcommands() -> list[tuple[str, str]]:
    """The ``weft-sync`` subcommands and their one-line help, read from its parser."""
    from .cli import app as cli

    parser = cli._build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, "")) for name in action.choices]
    return []


def _cli_group() -> click.Group:
    group = AppGroup(
        "weft",
        help="Inspect and operate this app's weft_sync store (the weft-sync commands, "
        "with --url set to the app's WEFT_SYNC_URL).",
    )
    for name, help_text in _cli_subcommands():
        group.add_command(_delegating_command(name, help_text))
    return group


def _delegating_command(name: str, help_text: str) -> click.Command:
    # Options and --help go to weft-sync's own parser untouched.
    @click.command(
        name,
        help=f"{help_text} (flask weft {name} --help lists its options)",
        short_help=help_text,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    @with_appcontext
    def command(args: Sequence[str]) -> None:
        from .cli.app import main

        app = current_app._get_current_object()  # type: ignore[attr-defined]
        state = _state_of(None)
        # maintain drives what it takes over with this app's handlers, in an app context.
        handlers = {t: _in_app_context(app, fn) for t, fn in state.handlers().items()}
        code = main(
            [name, *args],
            handlers=handlers,
            configured_url=(state.url, "app.config['WEFT_SYNC_URL']"),
            prog="flask weft",
        )
        click.get_current_context().exit(code)

    return command


# ----------------------------------------------------------------------------------------
# Process exit
# ----------------------------------------------------------------------------------------


# The states with an Ownership open in this process: held strongly, so one is closed at exit
# even when its app is gone. _exit_lock guards it and the atexit registration, which is there
# exactly while the set is not empty; replaced in a forked child.
_OPEN: set[_AppState] = set()
_exit_lock = threading.Lock()


def _opened(state: _AppState) -> None:
    with _exit_lock:
        if not _OPEN:
            atexit.register(close_all)
        _OPEN.add(state)


def _closed(state: _AppState) -> None:
    with _exit_lock:
        if state in _OPEN:
            _OPEN.discard(state)
            if not _OPEN:
                atexit.unregister(close_all)


def close_all() -> None:
    """Close every ``Ownership`` this module opened in this process; idempotent.

    Registered with :mod:`atexit` while one is open (from the first open to the last close);
    call it from a server's worker-exit hook too.
    """
    for state in list(_OPEN):
        try:
            state.close()
        except Exception:
            _log.exception("could not close the ownership of app %r", state.app_name)


def gunicorn_worker_exit(server: object, worker: object) -> None:
    """A gunicorn ``worker_exit`` hook: release this worker's claims before it exits."""
    close_all()


def gunicorn_post_worker_init(worker: object) -> None:
    """A gunicorn ``post_worker_init`` hook: open the worker's ``Ownership`` as it boots.

    The worker then renews, watches for crashed workers and takes their workflows over before it
    serves a request, instead of from its first request that uses the store. ``worker.wsgi``
    must be the Flask app a :class:`WeftSync` initialised (for an app wrapped in middleware,
    call ``weft.get_ownership(app)`` from a hook of your own). A store that cannot be opened
    now does not stop the worker from booting: the error is logged and the next use of
    :attr:`WeftSync.ownership` tries again.

    :raises RuntimeError: ``worker.wsgi`` is not a Flask app initialised by a ``WeftSync``.
    """
    app = getattr(worker, "wsgi", None)
    if not isinstance(app, Flask) or not isinstance(app.extensions.get(EXTENSION_KEY), _AppState):
        raise RuntimeError(
            f"gunicorn_post_worker_init needs worker.wsgi to be a Flask app initialised by "
            f"WeftSync, got {type(app).__name__} {app!r:.80}; for a wrapped app call "
            f"weft.get_ownership(app) from your own post_worker_init"
        )
    try:
        _state_of(app).ownership()
    except Exception:
        _log.exception(
            "could not open the ownership of app %r as worker %d booted; its next use tries again",
            app.name,
            os.getpid(),
        )


def _forget_open_in_child() -> None:
    # The parent's Ownerships are inert here and the parent closes them; the child's atexit
    # list is the parent's copy, so close_all stays registered only if the child opens one.
    global _exit_lock
    _exit_lock = threading.Lock()
    if _OPEN:
        _OPEN.clear()
        atexit.unregister(close_all)


_fork.reset_in_child(_forget_open_in_child)
