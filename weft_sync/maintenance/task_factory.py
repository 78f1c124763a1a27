"""Build a :class:`~.task.RenewalTask`, checking every argument first."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..clock import Clock
from .observer import PassObserver
from .scheduler import IntervalScheduler, TimerScheduler
from .targets import (
    RENEWAL_CONCURRENCY,
    ReclaimTarget,
    RenewalTarget,
    SignalPollTarget,
    UpdatePollTarget,
)
from .task import PassCallback, RenewalTask


def create_renewal_task(
    *,
    target: RenewalTarget,
    clock: Clock,
    interval_ms: int,
    scheduler: IntervalScheduler | None = None,
    reclaim_target: ReclaimTarget | None = None,
    signal_poll_target: SignalPollTarget | None = None,
    update_poll_target: UpdatePollTarget | None = None,
    on_pass_complete: PassCallback | None = None,
    executor_workers: int = RENEWAL_CONCURRENCY,
    before_stop: Callable[[], None] | None = None,
    observers: Sequence[PassObserver] = (),
    verify_store: Callable[[], None] | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> RenewalTask:
    """Build a renewal task; it does nothing until ``run_once()`` or ``start()`` is called.

    :param target: renews the held claims (a batched target is renewed in chunks).
    :param clock: integer-millisecond clock; required, read for ``started_at``/``finished_at``.
    :param interval_ms: tick interval of interval mode (the claim renew interval).
    :param scheduler: fires the ticks; defaults to a :class:`~.scheduler.TimerScheduler`.
    :param reclaim_target: signal_poll_target: update_poll_target: optional sub-passes; a pass
        result's matching field is ``None`` exactly when the target is not configured.
    :param on_pass_complete: called with every (full or partial) result, possibly from several
        threads at once; an exception it raises is logged and does not affect the pass.
    :param executor_workers: size of the worker pool renewal and reclaim fan out over.
    :param before_stop: called first by every ``stop()`` (and so by ``close()``), even before
        ``start()``; the bootstrap passes the reclaim target's ``mark_disposing`` here.
    :param observers: told each sub-pass's duration and each skipped tick (metrics, tracing).
    :param verify_store: called at the start of every pass that renews (the store's
        ``verify_identity``, when it has one); a failure it raises is left for the renewal's own
        writes to meet and report.
    :param heartbeat: called with no argument after every renewal sub-pass and after every
        reclaim sub-pass that reclaimed something (the engine's heartbeat); an exception it
        raises is logged.
    :raises TypeError: a target lacks its methods, or ``clock``, ``on_pass_complete``,
        ``before_stop`` or ``heartbeat`` is not callable, or an observer is not a
        :class:`~.observer.PassObserver`.
    :raises ValueError: ``interval_ms`` or ``executor_workers`` is not a positive integer.
    """
    check_task_arguments(
        target=target,
        clock=clock,
        interval_ms=interval_ms,
        reclaim_target=reclaim_target,
        signal_poll_target=signal_poll_target,
        update_poll_target=update_poll_target,
        on_pass_complete=on_pass_complete,
        executor_workers=executor_workers,
        before_stop=before_stop,
        observers=observers,
        heartbeat=heartbeat,
    )
    return RenewalTask(
        target=target,
        clock=clock,
        interval_ms=interval_ms,
        scheduler=scheduler if scheduler is not None else TimerScheduler(),
        reclaim_target=reclaim_target,
        signal_poll_target=signal_poll_target,
        update_poll_target=update_poll_target,
        on_pass_complete=on_pass_complete,
        executor_workers=executor_workers,
        before_stop=before_stop,
        observers=tuple(observers),
        verify_store=verify_store,
        heartbeat=heartbeat,
    )


def check_task_arguments(
    *,
    target: RenewalTarget,
    clock: Clock,
    interval_ms: int,
    reclaim_target: ReclaimTarget | None,
    signal_poll_target: SignalPollTarget | None,
    update_poll_target: UpdatePollTarget | None,
    on_pass_complete: PassCallback | None,
    executor_workers: int,
    before_stop: Callable[[], None] | None,
    observers: Sequence[PassObserver],
    heartbeat: Callable[[], None] | None,
) -> None:
    """Raise the ``TypeError``/``ValueError`` :func:`create_renewal_task` documents."""
    _require_methods("target", target, ("list_held_workflow_ids", "renew_workflow_claim"))
    if reclaim_target is not None:
        _require_methods(
            "reclaim_target",
            reclaim_target,
            ("list_reclaim_candidate_workflow_ids", "attempt_workflow_claim_takeover"),
        )
    if signal_poll_target is not None:
        _require_methods(
            "signal_poll_target",
            signal_poll_target,
            ("list_parked_signal_waits", "has_buffered_signal", "wake_workflow"),
        )
    if update_poll_target is not None:
        _require_methods(
            "update_poll_target",
            update_poll_target,
            ("list_held_workflow_ids", "has_pending_updates", "drain_pending_updates"),
        )
    if not callable(clock):
        raise TypeError(f"clock must be a zero-argument callable returning ms, got {clock!r}")
    if on_pass_complete is not None and not callable(on_pass_complete):
        raise TypeError(f"on_pass_complete must be callable or None, got {on_pass_complete!r}")
    if before_stop is not None and not callable(before_stop):
        raise TypeError(f"before_stop must be callable or None, got {before_stop!r}")
    _check_positive("interval_ms", interval_ms)
    _check_positive("executor_workers", executor_workers)
    if heartbeat is not None and not callable(heartbeat):
        raise TypeError(f"heartbeat must be callable or None, got {heartbeat!r}")
    for observer in observers:
        if not isinstance(observer, PassObserver):
            raise TypeError(f"observers must be PassObserver objects, got {observer!r}")


def _require_methods(name: str, obj: object, methods: tuple[str, ...]) -> None:
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(
            f"{name} {type(obj).__name__} lacks the method(s) {', '.join(missing)}; it must "
            f"provide {', '.join(methods)}"
        )


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
