"""This process's ``Ownership``: opened on first use, reopened after a fork, closed at exit.

Importing this module registers nothing: :func:`close_ownership` is registered with
:mod:`atexit` when the process's ``Ownership`` opens and unregistered when it is closed, and a
forked child's reset runs from the library's one fork hook (see :mod:`weft_sync._fork`), which
the first store opened registers.

Threading model: one module lock (``_lock``) guards ``_current``, ``_pid`` and ``_opening``. The
store is opened outside it: the first caller marks an open as in progress (an ``Event``), opens,
publishes the result and sets the event; concurrent callers wait on the event, then look again.
A child forked from a process that had opened one finds ``_pid`` differing from its own and opens
its own (the inherited object is inert there and is dropped, not closed: the parent owns its
claims). Nothing opens at import time or in ``AppConfig.ready()``, so a pre-fork server master
(``gunicorn --preload``) holds no claims unless the host asks for them there.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from django.db import connections

from weft_sync import Ownership, ReclaimedWorkflow, WorkflowHandler, _fork
from weft_sync.redaction import redact_url

from .conf import WeftSyncSettings, load_config

_log = logging.getLogger(__name__)

# _lock guards _current, _pid and _opening.
_lock = threading.Lock()
_current: Ownership | None = None
_pid: int | None = None
_opening: threading.Event | None = None


def get_ownership() -> Ownership:
    """This process's :class:`~weft_sync.Ownership` over the store ``settings.WEFT_SYNC`` names.

    Opened on the first call of the process (and of each forked child), with the handlers of
    ``WEFT_SYNC["HANDLERS"]`` driving the workflows it takes over; later calls return the same
    object until it is closed (:func:`close_ownership`, or its own ``close()``) or the process
    ends; the next call then opens a new one. Safe from any thread.

    :raises django.core.exceptions.ImproperlyConfigured: ``settings.WEFT_SYNC`` is wrong.
    :raises weft_sync.errors.WeftError: the store refused to open (the gates failed).
    """
    global _current, _pid, _opening
    while True:
        with _lock:
            if _current is not None and _pid == os.getpid() and not _current.closed:
                return _current
            if _pid != os.getpid():
                # Inherited across a fork: inert here, and its claims belong to the parent.
                _current, _pid, _opening = None, os.getpid(), None
            waiter = _opening
            if waiter is None:
                opened = _opening = threading.Event()
        if waiter is not None:
            waiter.wait()
            continue
        try:
            ownership = _open(load_config())
        except BaseException:
            with _lock:
                _opening = None
            opened.set()
            raise
        with _lock:
            _current, _opening = ownership, None
            # Once per open Ownership: unregister first, as register() would add a second call.
            atexit.unregister(close_ownership)
            atexit.register(close_ownership)
        opened.set()
        return ownership


def is_open() -> bool:
    """Whether this process has opened its ``Ownership`` (and not closed it)."""
    with _lock:
        return _current is not None and _pid == os.getpid()


def close_ownership() -> None:
    """Close this process's ``Ownership`` (release its claims); the next use opens a new one.

    Registered with :mod:`atexit` while one is open, and called when ``settings.WEFT_SYNC``
    changes under test.
    """
    global _current
    with _lock:
        ownership = _current if _pid == os.getpid() else None
        _current = None
        atexit.unregister(close_ownership)
    if ownership is None:
        return
    try:
        ownership.close()
    except BaseException:
        if not ownership.closed:
            # Refused (called from a handler or an on_lost callback) before it changed
            # anything: still open, so still this process's to close (at exit).
            with _lock:
                if _current is None and _pid == os.getpid():
                    _current = ownership
                    atexit.register(close_ownership)
        raise


def handlers_from_settings(config: WeftSyncSettings) -> dict[str, WorkflowHandler]:
    """The ``HANDLERS`` of ``config``, imported, each closing its thread's DB connections."""
    return {
        workflow_type: _closing_db_connections(handler)
        for workflow_type, handler in config.import_handlers().items()
    }


def _open(config: WeftSyncSettings) -> Ownership:
    handlers = handlers_from_settings(config)
    background: Any = config.background
    ownership = Ownership.open(
        config.url,
        options=config.options,
        handlers=handlers,
        background=background,
        max_claims=config.max_claims,
    )
    _log.info(
        "opened weft_sync ownership of engine %s on %s (%s) in process %d",
        ownership.engine_id,
        redact_url(config.url),
        config.source,
        os.getpid(),
    )
    return ownership


def _closing_db_connections(handler: Callable[..., object]) -> WorkflowHandler:
    """``handler``, closing the Django connections it opened on its thread, as a request does.

    Handlers run on the engine's handler threads, which Django's request cycle never cleans
    up after.
    """

    def run(workflow: ReclaimedWorkflow) -> object:
        try:
            return handler(workflow)
        finally:
            connections.close_all()

    run.__name__ = getattr(handler, "__name__", "handler")
    run.__qualname__ = getattr(handler, "__qualname__", run.__name__)
    return run


def _reset_in_child() -> None:
    global _lock, _current, _opening
    # A parent thread may have held the lock, or been opening, at fork time; the parent's
    # Ownership is inert here and the parent closes it (the atexit list is the parent's copy).
    _lock = threading.Lock()
    _current, _opening = None, None
    atexit.unregister(close_ownership)


_fork.reset_in_child(_reset_in_child)
