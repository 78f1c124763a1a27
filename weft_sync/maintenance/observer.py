"""What the renewal task tells an observer: each pass and sub-pass as it runs, skipped ticks.

Metrics and tracing watch the maintenance through this small protocol, so the task imports
neither (tracing is an optional extra). :meth:`PassObserver.observe` returns a context manager
entered on the thread that runs the work, around it: a full ``run_once()`` pass is observed as
``"pass"`` with its sub-passes (``renewal``, ``reclaim``, ``signal_poll``, ``update_poll``)
nested inside; in interval mode each slot is one sub-pass. An observer that raises is logged and
ignored; the pass runs on as if it were not there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

_log = logging.getLogger(__name__)

FULL_PASS = "pass"
"""The name a full ``run_once()`` pass is observed under."""


@runtime_checkable
class PassObserver(Protocol):
    """Watches passes, sub-passes and skipped interval ticks."""

    def observe(self, name: str) -> AbstractContextManager[object]:
        """A context manager around one run of ``name`` (:data:`FULL_PASS` or a sub-pass)."""

    def tick_skipped(self, subpass: str) -> None:
        """An interval tick skipped ``subpass`` because its previous run was still going."""


@contextlib.contextmanager
def observed(observers: Sequence[PassObserver], name: str) -> Iterator[None]:
    """Run the ``with`` body inside every observer's context; an observer's failure is logged."""
    with contextlib.ExitStack() as stack:
        for observer in observers:
            try:
                stack.enter_context(_guarded(observer.observe(name), name))
            except Exception:
                _log.exception("weft_sync: a pass observer failed to start on %s", name)
        yield


@contextlib.contextmanager
def _guarded(inner: AbstractContextManager[object], name: str) -> Iterator[None]:
    # The body's own exception propagates unchanged; the observer's exit sees it first.
    inner.__enter__()
    try:
        yield
    except BaseException as exc:
        try:
            inner.__exit__(type(exc), exc, exc.__traceback__)
        except Exception:
            _log.exception("weft_sync: a pass observer failed to finish %s", name)
        raise
    try:
        inner.__exit__(None, None, None)
    except Exception:
        _log.exception("weft_sync: a pass observer failed to finish %s", name)


def notify_skipped(observers: Sequence[PassObserver], subpass: str) -> None:
    """Tell every observer that a tick skipped ``subpass``; never raises."""
    for observer in observers:
        try:
            observer.tick_skipped(subpass)
        except Exception:
            _log.exception("weft_sync: a pass observer failed on a skipped %s tick", subpass)
