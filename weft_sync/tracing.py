"""Optional OpenTelemetry spans for maintenance passes, takeover drives and fenced writes.

Install the ``otel`` extra (``pip install "weft_sync[otel]"``) and open with
``Ownership.open(url, tracing=True)`` (the global tracer provider) or
``tracing=my_tracer_provider``. Nothing here is imported unless tracing is asked for, and the
lower layers never import OpenTelemetry: the renewal task sees a
:class:`~weft_sync.maintenance.observer.PassObserver`, the ledger a fence observer, and the
facade wraps the drive of a reclaimed workflow.

Spans (every one carries ``weft_sync.engine_id``; spans may carry a workflow id, metrics never):

- ``weft_sync.maintenance.pass`` for a full ``run_maintenance()`` pass, with the sub-passes
  ``weft_sync.maintenance.renewal`` / ``.reclaim`` / ``.signal_poll`` / ``.update_poll``
  nested inside; in interval mode each slot's run is one sub-pass span;
- ``weft_sync.takeover`` around the drive of a workflow this engine took over, with
  ``weft_sync.workflow_id``, ``weft_sync.workflow_type`` and ``weft_sync.epoch``;
- ``weft_sync.fenced_write`` for each fenced commit of the ledger, with the workflow id.

A span whose work raised records the exception and has an error status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

OTEL_MISSING = (
    "tracing needs the OpenTelemetry API; install the 'otel' extra: pip install \"weft_sync[otel]\""
)
_SCOPE = "weft_sync"


class Tracing:
    """Makes weft_sync's spans on one tracer; one per engine.

    :param engine_id: recorded on every span.
    :param tracer_provider: an OpenTelemetry ``TracerProvider``; the global one when ``None``.
    :raises ImportError: the OpenTelemetry API is not installed (names the extra).
    """

    def __init__(self, engine_id: str, tracer_provider: Any = None) -> None:
        try:
            from opentelemetry import trace
        except ImportError as exc:
            raise ImportError(OTEL_MISSING) from exc
        self._trace = trace
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        self._tracer = provider.get_tracer(_SCOPE)
        self._attributes = {"weft_sync.engine_id": engine_id}

    # -- the renewal task's PassObserver ----------------------------------------------------

    @contextlib.contextmanager
    def observe(self, name: str) -> Iterator[None]:
        """A span around one maintenance pass or sub-pass."""
        with self._tracer.start_as_current_span(
            f"weft_sync.maintenance.{name}", attributes=self._attributes
        ):
            yield

    def tick_skipped(self, subpass: str) -> None:
        """Skipped ticks are counted by the metrics; they make no span."""

    # -- takeovers and fenced writes --------------------------------------------------------

    @contextlib.contextmanager
    def takeover(self, workflow_id: str, workflow_type: str, epoch: int) -> Iterator[None]:
        """A span around the drive of a workflow this engine took over at ``epoch``."""
        attributes: dict[str, str | int] = {
            **self._attributes,
            "weft_sync.workflow_id": workflow_id,
            "weft_sync.workflow_type": workflow_type,
            "weft_sync.epoch": epoch,
        }
        with self._tracer.start_as_current_span("weft_sync.takeover", attributes=attributes):
            yield

    def fenced_write(
        self, workflow_id: str, started_ns: int, seconds: float, error: BaseException | None
    ) -> None:
        """Record one fenced commit that already finished (a ledger fence observer)."""
        span = self._tracer.start_span(
            "weft_sync.fenced_write",
            start_time=started_ns,
            attributes={**self._attributes, "weft_sync.workflow_id": workflow_id},
        )
        if error is not None:
            span.record_exception(error)
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, str(error)))
        span.end(end_time=started_ns + int(seconds * 1e9))


def validate_tracing(tracing: object) -> object:
    """Return ``tracing`` if ``Ownership.open`` accepts it (see :func:`resolve_tracing`).

    :raises TypeError: it is not ``None``, a bool, or an object with ``get_tracer``.
    """
    if tracing is None or isinstance(tracing, bool):
        return tracing
    if callable(getattr(tracing, "get_tracer", None)):
        return tracing
    raise TypeError(
        f"tracing must be True, False or an OpenTelemetry TracerProvider, got {tracing!r:.80}"
    )


def resolve_tracing(tracing: object, engine_id: str) -> Tracing | None:
    """Turn ``Ownership.open``'s ``tracing`` argument into a :class:`Tracing` (or ``None``).

    :param tracing: ``False``/``None`` (off), ``True`` (the global tracer provider), or an
        OpenTelemetry ``TracerProvider`` (anything with ``get_tracer``).
    :raises TypeError: anything else.
    :raises ImportError: tracing is on and OpenTelemetry is not installed.
    """
    validate_tracing(tracing)
    if tracing is None or tracing is False:
        return None
    return Tracing(engine_id, None if tracing is True else tracing)
