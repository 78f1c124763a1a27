"""How :meth:`Ownership.close <weft_sync.ownership.Ownership.close>` ends an engine by one deadline.

In order: the maintenance task stops and its passes in flight are waited for, the handlers
running are waited for (half of what is left of the timeout, then abandoned), the ledger
refuses new work, claim operations in flight are waited for, every claim is released, and the
store is closed if the engine opened it. With a timeout, a store that can bound its lock waits
(:class:`~weft_sync.storage.wait_bound.SupportsWaitBound`: SQLite, and PostgreSQL with a
``statement_timeout``) is told the deadline first, so a foreign session holding the database's
write lock or the table's lock makes the pass in flight, the releases, the final liveness write
and the store's shutdown give up by then instead of each waiting out the busy or lock timeout.
A claim that could not be released is forgotten locally and left to expire in the store (one
warning says how many and why); another engine takes it over once its holder expires. Past the
deadline a write still takes a lock that is free, so a close whose passes overran its timeout
still releases what it can.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

from ..storage.wait_bound import SupportsWaitBound

if TYPE_CHECKING:
    from ..claims.registry import ClaimRegistry
    from ..maintenance.task import RenewalTask
    from ..reclaim.crash_detection import CrashDetection
    from ..storage import Storage
    from ..workflows import Workflows
    from .handler_executor import HandlerExecutor

# The bound ends a pass's lock wait within one busy slice of the deadline: the passes are waited
# for that much longer rather than left running past close().
_PASS_GRACE_S: Final = 0.25


def close_engine(
    *,
    task: RenewalTask,
    workflows: Workflows,
    registry: ClaimRegistry,
    storage: Storage,
    owns_storage: bool,
    timeout: float | None,
    crash: CrashDetection | None = None,
    handlers: HandlerExecutor | None = None,
) -> None:
    """Close the engine's parts in order, all by ``timeout`` seconds from now (``None``: no bound).

    The handler executor (``handlers``) stops taking runs and waits for the running ones up to
    half of what is left of the bound; a handler still running then is abandoned (one warning
    each) and its claim released with the others, so its later writes are refused.
    A store the engine did not open is not closed; the bound set on it is lifted again. The
    crash probe (``crash``) stops first; the engine's liveness record is removed (or marked
    closed when claims are left) and its session lock released after the claims.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    bounded = storage if isinstance(storage, SupportsWaitBound) and deadline is not None else None
    if bounded is not None:
        bounded.bound_waits(deadline)
    try:
        try:
            if crash is not None:
                crash.stop_watching(timeout)
            task.close(timeout if bounded is None or timeout is None else timeout + _PASS_GRACE_S)
            if handlers is not None:
                # Half of what is left: the releases below get the rest, whatever handlers do.
                handlers.close(None if deadline is None else (deadline - time.monotonic()) / 2)
        finally:
            workflows.close()
            # Waits for claim operations racing close() (start, claim, resume) so that the
            # final release sees what they claimed; later ones raise ClosedError.
            unreleased = registry.close(None if deadline is None else deadline - time.monotonic())
            try:
                if crash is not None:
                    # A claim whose release failed is forgotten locally but its holder stays in
                    # the store: counting it marks the record closed, so others take it at once.
                    crash.close(len(registry.list_held_workflow_ids()) + len(unreleased))
            finally:
                if owns_storage:
                    storage.close()
    finally:
        if bounded is not None and not owns_storage:
            bounded.bound_waits(None)
